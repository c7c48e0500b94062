"""Adapter churn on a patched model with many adapters: the cost of adding / deleting one adapter and of the next
training step, against the registry size (CPU, tiny Llama, r 4 on q/v/gate, one thread).

    python benchmarks/churn.py --n 128 512 1024 [--profile add|delete|step]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

sys.path[:0] = [".", "tests"]


def build(n):
    from models import tiny_llama
    from peft import LoraConfig, get_peft_model

    import fast_multilora

    cfg = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False)
    model = get_peft_model(tiny_llama(0), LoraConfig(**cfg), adapter_name="a0000")
    fast_multilora.add_adapters(model, {f"a{i:04d}": LoraConfig(**cfg) for i in range(1, n)})
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    fast_multilora.patch(model, backend="torch")
    opt = fast_multilora.AdamW(model, lr=1e-3)
    model.train()
    return model, opt, cfg


def step(model, opt, names, ids):
    import fast_multilora

    opt.zero_grad()
    out = model(input_ids=ids, adapter_names=names).logits
    fast_multilora.per_adapter_loss(out, ids, names).backward()
    opt.step()


def timed(fn, prof=None):
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    fn()
    if prof is not None:
        prof.disable()
    return (time.perf_counter() - t) * 1e3


LAYOUT_MS = [0.0]  # time inside AdapterStore.layout (the store's re-layout and the optimizer's _follow)


def _time_layouts() -> None:
    from fast_multilora.store import AdapterStore

    layout = AdapterStore.layout

    def timed_layout(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return layout(self, *args, **kwargs)
        finally:
            LAYOUT_MS[0] += (time.perf_counter() - t) * 1e3

    AdapterStore.layout = timed_layout


def churn_round(model, opt, cfg, batch, ids, new, prof) -> dict:
    """One step, one adapter added, the step that lays it out, the adapter deleted, the next step (ms each; and of
    the two steps after a change, the time in the store's re-layout)."""
    from peft import LoraConfig

    import fast_multilora

    out = {"step": timed(lambda: step(model, opt, batch, ids), prof["step"])}
    out["add"] = timed(lambda: fast_multilora.add_adapters(model, {new: LoraConfig(**cfg)}), prof["add"])
    for name, p in model.named_parameters():
        if f".{new}." in name:
            p.requires_grad_(True)
    LAYOUT_MS[0] = 0.0
    out["addstep"] = timed(lambda: step(model, opt, batch[:7] + [new], ids), prof["addstep"])
    out["add-layout"] = LAYOUT_MS[0]
    out["delete"] = timed(lambda: model.delete_adapter(new), prof["delete"])
    LAYOUT_MS[0] = 0.0
    out["delstep"] = timed(lambda: step(model, opt, batch, ids), prof["delstep"])
    out["del-layout"] = LAYOUT_MS[0]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--profile", choices=["add", "delete", "step", "addstep", "delstep"], default=None)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    _time_layouts()
    torch.manual_seed(0)
    for n in args.n:
        model, opt, cfg = build(n)
        batch = [f"a{i:04d}" for i in range(0, 8)]
        ids = torch.randint(0, 97, (8, 16))
        for _ in range(2):
            step(model, opt, batch, ids)
        rows = {k: [] for k in ("step", "add", "addstep", "add-layout", "delete", "delstep", "del-layout")}
        for rep in range(args.reps):
            prof = {k: (cProfile.Profile() if args.profile == k and rep == args.reps - 1 else None)
                    for k in ("step", "add", "addstep", "delete", "delstep")}
            for k, ms in churn_round(model, opt, cfg, batch, ids, f"z{rep:03d}", prof).items():
                rows[k].append(ms)
            for p in prof.values():
                if p is not None:
                    pstats.Stats(p).sort_stats("cumulative").print_stats(35)
        med = {k: sorted(v)[len(v) // 2] for k, v in rows.items()}
        print(f"n={n}: " + "  ".join(f"{k} {v:.1f} ms" for k, v in med.items()), flush=True)


if __name__ == "__main__":
    main()
