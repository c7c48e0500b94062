"""Load saved LoRA adapters with stock PEFT, patch, and evaluate them all -- and the base model -- in ONE mixed batch.

    python examples/train_multi_adapter.py --output-dir runs/multi_adapter      # trains and saves the adapters
    python examples/eval_mixed_batch.py --run-dir runs/multi_adapter

Loading is plain PEFT (``PeftModel.from_pretrained`` for the first adapter, ``load_adapter`` for the others);
``fast_multilora.patch`` then lets one batch hold rows of every adapter plus ``"__base__"`` rows, for a forward
(teacher-forced per-adapter loss) and for generation (PEFT's ``generate(..., adapter_names=...)``). ``--check``
also generates the stock way, one adapter at a time (``set_adapter`` / ``disable_adapter``), and verifies that the
mixed batch gives the same answers.
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


def load(run_dir: Path, adapters, model_spec: str, device):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_spec == "tiny":  # the demo saved its random base next to the adapters
        base = AutoModelForCausalLM.from_pretrained(run_dir / "base", dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(run_dir / "base")
    else:
        base, tok = T.load_base(model_spec)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    folder = run_dir / "adapters"
    with T.quiet_peft_model():
        model = PeftModel.from_pretrained(base, folder / adapters[0], adapter_name=adapters[0])
    for a in adapters[1:]:
        model.load_adapter(folder / a, adapter_name=a)
    return model.to(device).eval(), tok


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", default="runs/multi_adapter", help="--output-dir of train_multi_adapter.py")
    p.add_argument("--adapters", default=None, help="comma-separated subset (default: all in run.json)")
    p.add_argument("--model", default=None, help="base model (default: the one in run.json)")
    p.add_argument("--eval-per-task", type=int, default=None,
                   help="held-out prompts per task (default: the training run's, as its own evaluation used)")
    p.add_argument("--device", default="auto")
    p.add_argument("--backend", default="auto")
    p.add_argument("--check", action="store_true", help="compare with stock PEFT, one adapter at a time")
    args = p.parse_args(argv)

    import fast_multilora
    from fast_multilora.data import MultiAdapterCollator

    run_dir = Path(args.run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    adapters = args.adapters.split(",") if args.adapters else run["adapters"]
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    model, tok = load(run_dir, adapters, args.model or run["model"], device)
    print(fast_multilora.patch(model, backend=args.backend))

    per_task = args.eval_per_task or run.get("eval_per_task", 12)  # 12: the demo's default before run.json had it
    rows = T.eval_rows(adapters, per_task)  # every adapter on its task + the base on every task
    print(f"{len(rows)} rows ({per_task} held-out prompts per task): {len(adapters)} adapters + base, in one mixed "
          "batch")
    with torch.no_grad():
        feats = [T.encode_example(tok, x, y, a) for a, _, x, y in rows]
        batch = MultiAdapterCollator(tok)(feats)
        t0 = time.time()
        out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                    adapter_names=batch["adapter_names"])
        # per-adapter answer loss; base rows get a name per task so that they are scored per task too
        names = [a if a != T.BASE else f"base:{t}" for a, t, _, _ in rows]
        _, losses = fast_multilora.per_adapter_loss(out.logits, batch["labels"].to(device), names, return_dict=True)
        t_fwd = time.time() - t0
        t0 = time.time()
        answers = T.generate_mixed(model, tok, rows, T.max_answer_tokens(tok, adapters), batch_size=len(rows),
                                   device=device)
        t_gen = time.time() - t0
    acc = T.score(rows, answers)
    print(f"forward {t_fwd:.2f}s, generation {t_gen:.2f}s (one mixed batch)\n")
    print(f"{'rows':<12}{'task':<10}{'accuracy':>9}{'answer loss':>13}")
    for a in adapters:
        t = T.task_of(a)
        print(f"{a:<12}{t:<10}{acc[(a, t)]:>9.2f}{losses.get(a, float('nan')):>13.3f}")
    for t in sorted({T.task_of(a) for a in adapters}):
        print(f"{T.BASE:<12}{t:<10}{acc[(T.BASE, t)]:>9.2f}{losses.get(f'base:{t}', float('nan')):>13.3f}")

    if args.check:
        t0 = time.time()
        mismatches = 0
        for name in adapters + [T.BASE]:
            idx = [i for i, r in enumerate(rows) if r[0] == name]
            sub = [rows[i] for i in idx]
            fast_multilora.unpatch(model)  # stock PEFT for the reference
            try:
                if name == T.BASE:
                    with model.disable_adapter():
                        ref = _generate_plain(model, tok, sub, adapters, device)
                else:
                    model.set_adapter(name)
                    ref = _generate_plain(model, tok, sub, adapters, device)
            finally:
                fast_multilora.patch(model, backend=args.backend)
            mismatches += sum(ref[j] != answers[i] for j, i in enumerate(idx))
        print(f"\nstock PEFT, one adapter at a time: {time.time() - t0:.2f}s; answers differing from the mixed batch: "
              f"{mismatches} of {len(rows)}")
        if mismatches:
            raise SystemExit(1)
    return {"rows": len(rows), "accuracy": acc, "loss": losses}


def _generate_plain(model, tok, rows, adapters, device):
    """Greedy generation without ``adapter_names`` (PEFT's active adapter)."""
    tok.padding_side = "left"
    enc = tok([T.prompt_text(x) for _, _, x, _ in rows], return_tensors="pt", padding=True,
              add_special_tokens=False).to(device)
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=T.max_answer_tokens(tok, adapters), do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    tok.padding_side = "right"
    texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return [t.split("\n")[0].strip() for t in texts]


if __name__ == "__main__":
    main()
