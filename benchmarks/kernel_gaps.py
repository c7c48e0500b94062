"""Where the GPU idles between kernels in an eval forward (the harness's ``eval_8``: the issue-4 Llama shape, 16 x 1024
tokens, 8 adapters mixed over 14 rows + 2 ``__base__`` rows, bf16, r=16): the base forward (adapters disabled) against
fast_multilora's mixed forward. From one profiled forward each (CUDA activity only, so the host is not slowed by
CPU-op recording): the kernels' busy time, the forward's span, and the idle time between consecutive kernels summed
by the kind of kernel that ends and the kind that starts -- which transitions cost the time that a wall clock
shows over the kernel time. Then the same for the adapters' weights concatenated per call (the path before they were
read in place), and an interleaved wall-time A/B of the three. ``--step``: the train step's gaps instead (wall vs
host vs kernel time, idle by transition, the longest idle stretches). Usage (GPU):
``python benchmarks/kernel_gaps.py [--out FILE] [--rounds 5] [--step]``."""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from harness import host_ms, time_steps  # benchmarks/ is on sys.path when this runs as a script
from profile_step import TARGETS, tee

import fast_multilora


def kind(name: str) -> str:
    """A short class for a kernel name: ours by kernel, cuBLAS, attention, elementwise/reduce, other."""
    for ours in ("sgemm_shrink", "sgemm_expand", "sgmv_shrink", "sgmv_expand"):
        if name.startswith(ours):
            return ours
    if name.startswith(("nvjet", "sm90_xmma", "cutlass", "gemm")) or "gemm" in name.lower():
        return "cublas"
    if "sdpa" in name or "flash" in name or "fmha" in name or "attention" in name.lower():
        return "attention"
    if "reduce" in name or "elementwise" in name or "Reduce" in name:
        return "elementwise"
    return name[:40]


def kernel_spans(fn, reps: int = 3):
    """``[(start_us, end_us, name)]`` of the CUDA kernels of the last of ``reps`` profiled calls of ``fn``."""
    runs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        spans = []
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset")):
                spans.append((e.time_range.start, e.time_range.end, e.name))
        runs.append(sorted(spans))
    return runs[-1]


def gaps(spans) -> dict:
    busy = sum(e - s for s, e, _ in spans)
    span = spans[-1][1] - spans[0][0]
    by_pair = defaultdict(list)
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:], strict=False):
        by_pair[(kind(n0), kind(n1))].append(max(0.0, s1 - e0))
    return {"kernels": len(spans), "busy_ms": busy / 1e3, "span_ms": span / 1e3, "idle_ms": (span - busy) / 1e3,
            "pairs": {k: (len(v), sum(v), statistics.median(v)) for k, v in by_pair.items()}}


def say_gaps(say, label: str, wall: float, host: float, g: dict) -> None:
    """One measured call: wall, host and profiled kernel time, then its idle time by transition (largest first)."""
    say(f"=== {label}: wall {wall:.2f} ms, host {host:.2f} ms; profiled: {g['kernels']} kernels, "
        f"busy {g['busy_ms']:.2f} ms, span {g['span_ms']:.2f} ms, idle {g['idle_ms']:.2f} ms")
    say("  idle between kernels by (ending kind -> starting kind): count, total us, median us")
    for (k0, k1), (n, tot, med) in sorted(g["pairs"].items(), key=lambda kv: -kv[1][1])[:16]:
        say(f"    {k0:>14s} -> {k1:<14s} {n:5d} {tot:9.1f} {med:7.2f}")


def largest_gaps(spans, n: int = 12) -> list:
    """The ``n`` longest idle stretches between consecutive kernels: ``(idle_us, offset_ms, ending, starting)``, the
    offset from the first kernel's start."""
    t0 = spans[0][0]
    out = [(s1 - e0, (e0 - t0) / 1e3, n0, n1)
           for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:], strict=False) if s1 > e0]
    return sorted(out, reverse=True)[:n]


def step_gaps(say) -> None:
    """The same for the issue-4 train step (``profile_step.build``: 8 adapters mixed, foreach AdamW): wall and host
    time, then the idle time between the step's kernels by transition, and its longest idle stretches."""
    from profile_step import build

    pm, step = build()
    for _ in range(3):
        step()
    wall = time_steps(step, "cuda", warm=2, iters=11)["ms"]
    host = host_ms(step, 7)
    spans = kernel_spans(step)
    g = gaps(spans)
    say_gaps(say, "train step, 8 adapters mixed", wall, host, g)
    say("  longest idle stretches: us, at ms into the step, ending kernel -> starting kernel")
    for idle, at, n0, n1 in largest_gaps(spans):
        say(f"    {idle:8.1f} {at:8.2f}  {n0[:50]} -> {n1[:50]}")


def eval_gaps(say, rounds: int) -> None:
    """The eval forward (the module docstring): base, ours in place, ours concatenated; then the wall-time A/B."""
    from multi_adapter_tasks import BENCH_LLAMA
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(LlamaConfig(**BENCH_LLAMA)).to(torch.bfloat16)
    lc = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS)
    pm = get_peft_model(base, lc, adapter_name="a0")
    for i in range(1, 8):
        pm.add_adapter(f"a{i}", lc)
    pm.eval()
    rows, T = 16, 1024
    ids = torch.randint(0, BENCH_LLAMA["vocab_size"], (rows, T), device="cuda")
    names = sorted([f"a{i % 8}" for i in range(rows - 2)] + ["__base__"] * 2)

    def run(fn, label):
        with torch.no_grad():
            wall = time_steps(fn, "cuda", warm=3, iters=11)["ms"]
            g = gaps(kernel_spans(fn))
            host = host_ms(fn, 11)
        say_gaps(say, label, wall, host, g)

    def base():  # run inside pm.disable_adapter(): entering and leaving it is not part of a base forward
        pm(input_ids=ids)

    def ours():
        pm(input_ids=ids, adapter_names=names)

    in_place = {"in place": True, "concatenated": False}  # the adapters' weights read in place or concatenated

    def use(label):
        fast_multilora.patch(pm, backend="triton", weights_in_place=in_place[label])

    with pm.disable_adapter():
        run(base, "base forward (adapters disabled)")
    use("in place")
    run(ours, "fast_multilora, 8 adapters mixed + 2 base rows")
    use("concatenated")
    run(ours, "fast_multilora, weights concatenated per call (weights_in_place=False)")
    say(f"interleaved wall-time A/B, {rounds} rounds of 11 forwards each (ms, medians per round):")
    walls = {"base": [], "in place": [], "concatenated": []}
    with torch.no_grad():
        for _ in range(rounds):
            with pm.disable_adapter():
                walls["base"].append(time_steps(base, "cuda", warm=2, iters=11)["ms"])
            for label in in_place:
                use(label)
                walls[label].append(time_steps(ours, "cuda", warm=2, iters=11)["ms"])
    b = statistics.median(walls["base"])
    for label, v in walls.items():
        m = statistics.median(v)
        say(f"  {label:13s} {m:7.2f} ms  x{m / b:.4f} of base   rounds {[round(t, 2) for t in v]}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--step", action="store_true", help="the train step instead of the eval forward")
    a = ap.parse_args(argv)
    say, buf = tee()
    if a.step:
        step_gaps(say)
    else:
        eval_gaps(say, a.rounds)
    if a.out:
        Path(a.out).write_text(buf.getvalue())


if __name__ == "__main__":
    main()
