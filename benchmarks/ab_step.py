"""A/B of patch settings on the issue-4 train step (8 adapters mixed, 16 x 1024, Llama-shaped, bf16, r=16), the
variants interleaved in one process: ``fuse_base`` and ``share_shrink`` on and off, at LoRA dropout 0.05 and 0, and
the default settings with ``AdamW(fused=True)`` instead of the anchors' foreach AdamW.
Per variant: median step time (CUDA events), host time until the step returns, and one profiled step's CUDA time
by kernel (top rows), so GPU-side and host-side effects can be told apart.

Usage (GPU): ``python benchmarks/ab_step.py [--out FILE] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import fast_multilora

VARIANTS = {  # name: (lora dropout p, patch kwargs, optimizer: "foreach" AdamW as the anchors, or "fused")
    "fused": (0.05, {}, "foreach"),
    "fused_adamw_fused": (0.05, {}, "fused"),
    "unfused": (0.05, {"fuse_base": False}, "foreach"),
    "p0_fused_shared": (0.0, {}, "foreach"),
    "p0_fused_unshared": (0.0, {"share_shrink": False}, "foreach"),
    "p0_unfused_shared": (0.0, {"fuse_base": False}, "foreach"),
}


def main(argv=None):
    from profile_step import build, cuda_kernels, tee  # the same model, adapters and step as the step profile

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    say, buf = tee()

    pm, step = build()
    drops = [m for n, m in pm.named_modules() if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n]

    def use(name):
        p, kw, optimizer = VARIANTS[name]
        step.set_optimizer(optimizer)
        for m in drops:
            m.p = p
        fast_multilora.patch(pm, backend="triton", **{"fuse_base": True, "share_shrink": True, **kw})

    def timed(n=5):
        ts, hs = [], []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t0 = time.perf_counter()
            step()
            hs.append((time.perf_counter() - t0) * 1e3)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts), statistics.median(hs)

    res = {k: [] for k in VARIANTS}
    for name in VARIANTS:  # warm-up: compiles, sibling groups learn their inputs
        use(name)
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    for _ in range(args.rounds):
        for name in VARIANTS:
            use(name)
            step()  # the first call after re-patching learns sibling inputs again
            res[name].append(timed())
    for name, v in res.items():
        ms = statistics.median(x[0] for x in v)
        host = statistics.median(x[1] for x in v)
        say(f"train_step_8 {name}: {ms:.2f} ms (host {host:.1f} ms until step() returns)  "
            f"{[round(x[0], 1) for x in v]}")
    for name in VARIANTS:
        use(name)
        step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        n, us = cuda_kernels(prof, width=60)
        say(f"--- {name}: {sum(n.values())} kernels, CUDA time {sum(us.values()) / 1e3:.1f} ms; by total time:")
        for k, t in us.most_common(22):
            say(f"  {t / 1e3:7.2f} ms  {n[k]:4d} x {t / n[k]:7.1f} us  {k}")
    if args.out:
        Path(args.out).write_text(buf.getvalue())


if __name__ == "__main__":
    main()
