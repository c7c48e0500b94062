"""A/B of block tables on the issue-4 train step (8 adapters mixed, 16 x 1024, Llama-shaped, bf16), interleaved in
one run, plus a CUDA-time breakdown of one step by kernel. Usage (GPU): ``python benchmarks/ab_step.py``."""

from __future__ import annotations

import statistics

import torch
from fast_multilora.kernels import backward as kb
from fast_multilora.kernels import forward as kf

TABLES = {
    "previous": dict(
        drop=[(float("inf"), 64, 32, 256, 4, 3)],  # = SHRINK_BLOCKS before the sweep
        e16=((256, 64, 8, True), (64, 64, 8, True)),
        s16=((64, 64, 8), (32, 64, 8)),
    ),
    "swept": dict(drop=list(kf.SHRINK_DROPOUT_BLOCKS["gpu"]), e16=kb._EXPAND_BLOCKS[16], s16=kb._SHRINK_BLOCKS[16]),
}


_REUSE = {"on": True}


def use(name):
    if name == "no_plan_reuse":  # swept tables, but a fresh routing (and plan) every forward call
        _REUSE["on"] = False
        name = "swept"
    else:
        _REUSE["on"] = True
    t = TABLES[name]
    kf.SHRINK_DROPOUT_BLOCKS["gpu"] = t["drop"]
    kb._EXPAND_BLOCKS[16] = t["e16"]
    kb._SHRINK_BLOCKS[16] = t["s16"]


def main():
    from profile_step import build  # the same model, adapters and step as the step profile

    pm, step = build()
    router = pm.__dict__["_fml_router"]
    cached = router.routing_for_names

    def routing_for_names(names):
        return cached(names) if _REUSE["on"] else router._make_routing(names)

    router.routing_for_names = routing_for_names

    def timed(n=5):
        ts = []
        for _ in range(n):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        return statistics.median(ts)

    variants = list(TABLES) + ["no_plan_reuse"]
    res = {k: [] for k in variants}
    for name in variants:
        use(name)
        step()
        step()
    for _ in range(3):
        for name in variants:
            use(name)
            res[name].append(timed())
    for name, v in res.items():
        print(f"train_step_8 {name}: median of medians {statistics.median(v):.2f} ms  {[round(x, 1) for x in v]}")
    best = min(TABLES, key=lambda k: statistics.median(res[k]))
    use(best)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"--- one step with '{best}' tables, CUDA time by kernel")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60))


if __name__ == "__main__":
    main()
