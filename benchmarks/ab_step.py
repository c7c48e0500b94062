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
    "fused": (0.05, {}, "foreach"),  # the defaults
    "fused_redraw_mask": (0.05, {"store_dropout_mask": False}, "foreach"),  # the backward redraws the dropout mask
    "fused_concat": (0.05, {"weights_in_place": False}, "foreach"),  # adapter weights concatenated per call
    "fused_adamw_fused": (0.05, {}, "fused"),
    "share_dropout": (0.05, {"share_dropout": True}, "foreach"),  # siblings stacked under dropout, a mask per slice
    "unfused": (0.05, {"fuse_base": False}, "foreach"),
    "p0_fused_shared": (0.0, {}, "foreach"),
    "p0_fused_unshared": (0.0, {"share_shrink": False}, "foreach"),
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
        fast_multilora.patch(pm, fast_multilora.PatchConfig(backend="triton", **kw))

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
    for name in VARIANTS:  # warm-up: kernel compiles
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
    say(host_split(pm, step))  # last: it leaves the model unpatched with one trainable adapter
    if args.out:
        Path(args.out).write_text(buf.getvalue())


def host_split(pm, step, n=7) -> str:
    """Host milliseconds per part of the step (medians of ``n``), the default settings against stock PEFT's single
    adapter (anchors' step: HF loss, foreach AdamW) on the same model: which part a host-bound step spends its time
    in. Our step does not synchronise (``tests/integration/test_sync.py``), so each of its parts is the host's own
    time; stock PEFT's step blocks in its backward (its backward time includes waiting for the GPU)."""
    def med(rows, i):
        return statistics.median(r[i] for r in rows) * 1e3

    step.set_optimizer("foreach")
    fast_multilora.patch(pm, backend="triton")
    for n_, m in pm.named_modules():
        if isinstance(m, torch.nn.Dropout) and "lora_dropout" in n_:
            m.p = 0.05
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    del step.split[:]
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    ours = list(step.split)
    fast_multilora.unpatch(pm)
    pm.set_adapter("a0")  # stock PEFT: one trainable adapter
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
    ids = step.ids
    peft = []
    for i in range(n + 2):
        t0 = time.perf_counter()
        loss = pm(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            peft.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    torch.cuda.synchronize()
    rows = [f"host ms per part (median of {n}): forward+loss / backward / optimizer+zero_grad"]
    for name, v in (("fast_multilora (8 adapters)", ours), ("peft_single", peft)):
        rows.append(f"  {name:28s} {med(v, 0):7.1f} / {med(v, 1):7.1f} / {med(v, 2):7.1f}  "
                    f"(sum {med(v, 0) + med(v, 1) + med(v, 2):.1f})")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
