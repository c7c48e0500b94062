"""Several LoRA adapters finetuned at once, in one mixed batch, by TRL's ``SFTTrainer``.

    python examples/sft_multi_adapter.py --model tiny --max-steps 20          # small random Llama: a smoke test
    python examples/sft_multi_adapter.py                                       # SmolLM2-135M-Instruct
    python examples/sft_multi_adapter.py --data per-adapter --packing          # one dataset per adapter, packed rows

Prompt-completion samples (``"Q: red fox tree =>"`` -> ``" RED FOX TREE"``, the tasks of ``multi_adapter_tasks.py``),
completion-only loss (TRL's default for this format). ``--data column``: one dataset whose ``adapter_name`` column
names each sample's adapter; ``--data per-adapter``: ``{adapter: dataset}``, interleaved round-robin by a sampler so
every batch holds every adapter. ``--packing``: TRL's packing (best-fit decreasing, padding-free rows); every token
keeps its sample's adapter (``adapter_ids``), so one packed row trains several adapters. The trainer is
``fast_multilora.trl.MultiAdapterSFTTrainer``: ``SFTTrainer`` with mixed-batch routing and the per-adapter loss (sum
over adapters of each adapter's mean token loss; ``loss/<adapter>`` in the logs). Outputs in ``--output-dir``:
``adapters/<name>/`` (PEFT format), ``log_history.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_multi_adapter.py

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import multi_adapter_tasks as T  # noqa: E402

LLAMA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 (default), tiny, a .gguf file or a HF model dir")
    p.add_argument("--adapters", default=",".join(T.DEFAULT_ADAPTERS), help="comma-separated, named after tasks")
    p.add_argument("--output-dir", default="runs/sft_multi_adapter")
    p.add_argument("--max-steps", type=int, default=25, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=12, help="samples (or packed rows) per device and step")
    p.add_argument("--data", choices=["column", "per-adapter"], default="column",
                   help="one dataset with an adapter column, or one dataset per adapter interleaved by a sampler")
    p.add_argument("--packing", action="store_true", help="TRL's packing (bfd): several samples per row")
    p.add_argument("--max-length", type=int, default=256, help="tokens per row (packed rows: per packed row)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 2e-3, tiny: 1e-2)")
    p.add_argument("--targets", default=LLAMA_TARGETS, help="LoRA target modules")
    p.add_argument("--train-per-adapter", type=int, default=400, help="generated training samples per adapter")
    p.add_argument("--eval-per-task", type=int, default=12, help="held-out prompts per task")
    p.add_argument("--no-eval", action="store_true", help="skip the generation after training")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--backend", default="auto", help="fast_multilora backend: auto (Triton on GPU), torch, triton")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.adapters = [a for a in args.adapters.split(",") if a]
    if len(set(args.adapters)) != len(args.adapters):
        p.error("--adapters has duplicates")
    if args.lr is None:
        args.lr = 1e-2 if args.model == "tiny" else 2e-3
    return args


def datasets_for(args, adapters):
    """Prompt-completion samples: one dataset with an ``adapter_name`` column, or ``{adapter: dataset}``."""
    from datasets import Dataset

    per = {}
    for a in adapters:
        t = T.task_of(a)
        skip = [x for x, _ in T.make_pairs(t, 64, T.EVAL_SEED)]  # the held-out evaluation prompts
        pairs = T.make_pairs(t, args.train_per_adapter, args.seed, exclude=skip)
        per[a] = {"prompt": [T.prompt_text(x) for x, _ in pairs], "completion": [" " + y for _, y in pairs]}
    if args.data == "per-adapter":
        return {a: Dataset.from_dict(cols) for a, cols in per.items()}
    rows = [(a, p, c) for a in adapters for p, c in zip(per[a]["prompt"], per[a]["completion"], strict=True)]
    return Dataset.from_dict({"prompt": [p for _, p, _ in rows], "completion": [c for *_, c in rows],
                              "adapter_name": [a for a, *_ in rows]})


def main(argv=None):
    args = parse_args(argv)
    from trl import SFTConfig

    import fast_multilora
    from fast_multilora.trl import MultiAdapterSFTTrainer

    t0 = time.time()
    out_dir = Path(args.output_dir)
    cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    base, tok = T.load_base(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = T.add_adapters(base, args.adapters, rank=args.rank, targets=args.targets.split(","), seed=args.seed)
    print(str(fast_multilora.patch(model, backend=args.backend)).splitlines()[0])

    config = SFTConfig(
        output_dir=str(out_dir), max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=max(1, args.max_steps // 10),
        logging_steps=max(1, min(5, args.max_steps // 5)), save_strategy="no", report_to="none", use_cpu=cpu,
        seed=args.seed, completion_only_loss=True, packing=args.packing, max_length=args.max_length,
        shuffle_dataset=True, bf16=False, disable_tqdm=True,
    )
    trainer = MultiAdapterSFTTrainer(model, args=config, train_dataset=datasets_for(args, args.adapters),
                                     processing_class=tok)
    trainer.train()
    model.save_pretrained(out_dir / "adapters", selected_adapters=args.adapters)  # adapters/<name>/, PEFT format
    (out_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1))
    print("per-adapter losses (sum over adapters of each adapter's mean token loss is the logged 'loss'):")
    for h in trainer.state.log_history:
        per = {k[5:]: v for k, v in h.items() if k.startswith("loss/")}
        if per:
            print(f"  step {h['step']:4d}  " + "  ".join(f"{a}={v:.4f}" for a, v in sorted(per.items())))
    print(f"saved {len(args.adapters)} adapters under {out_dir / 'adapters'} ({time.time() - t0:.1f}s so far)")

    if not args.no_eval:
        model.eval()
        rows = T.eval_rows(args.adapters, args.eval_per_task)
        acc = T.score(rows, T.generate_mixed(model, tok, rows, T.max_answer_tokens(tok, args.adapters),
                                             device=model.device))
        print("accuracy after training (adapters and the base, one mixed generation batch):")
        for (a, t), v in sorted(acc.items()):
            print(f"  {a:<10} {t:<8} {v:.2f}")
    print(f"done in {time.time() - t0:.1f}s")
    return trainer


if __name__ == "__main__":
    main()
