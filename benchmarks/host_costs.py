"""Host time of the primitives one LoRA layer call is made of, on this machine: cuBLAS GEMM variants (``mm`` /
``addmm_`` / ``addmm(out=)``), the weight concatenations, allocations, casts, and our four kernel launchers (host
time until each returns, kernels queued, not waited for). A slow host makes every row larger; the ratios between
rows say which primitive a layer call should avoid. Usage (GPU): ``python benchmarks/host_costs.py``."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bandwidth import case  # noqa: E402
from fast_multilora.kernels import api as K  # noqa: E402


def host_us(fn, n=200) -> float:
    """Median host microseconds until ``fn`` returns (a sync every 20 calls keeps the queue short)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ts = []
    for i in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
        if i % 20 == 19:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return round(statistics.median(ts), 1)


def main() -> None:
    dev, bf = "cuda", torch.bfloat16
    S, D = 8192, 4096
    segs, table, x, A_cat, B_cat = case(S, D, D)
    W = torch.randn(D, D, device=dev, dtype=bf)
    y = torch.randn(S, D, device=dev, dtype=bf)
    dy = torch.randn(S, D, device=dev, dtype=bf)
    A_list = list(A_cat.split(16))
    B_list = list(B_cat.split(16, dim=1))
    Wt = W.t()
    h = K.lora_shrink(x, A_cat, segs, table)
    dh, _ = K.lora_expand_bwd(dy, h, B_cat, segs, table)
    res = {
        "mm": host_us(lambda: torch.mm(x, Wt)),
        "addmm_ (in place, beta 1)": host_us(lambda: y.addmm_(x, Wt)),
        "addmm(out=y)": host_us(lambda: torch.addmm(y, x, Wt, out=y)),
        "addmm (new output)": host_us(lambda: torch.addmm(y, x, Wt)),
        "mm dy W": host_us(lambda: torch.mm(dy, W)),
        "cat 8 x [16, K]": host_us(lambda: torch.cat(A_list)),
        "cat 8 x [N, 16] dim 1": host_us(lambda: torch.cat(B_list, 1)),
        "empty [S, 16] fp32": host_us(lambda: torch.empty(S, 16, device=dev)),
        "zeros [S, 16] fp32": host_us(lambda: torch.zeros(S, 16, device=dev)),
        "cast [128, K] fp32 -> bf16": host_us(lambda: h.new_empty(128, D).to(bf)),
        "int(torch.randint) (CPU)": host_us(lambda: int(torch.randint(0, 2**31 - 1, (1,)))),
        "lora_shrink": host_us(lambda: K.lora_shrink(x, A_cat, segs, table)),
        "lora_shrink dropout": host_us(lambda: K.lora_shrink(x, A_cat, segs, table, seed=3)),
        "lora_expand write": host_us(lambda: K.lora_expand(h, B_cat, segs, table, y, accumulate=False)),
        "lora_expand_bwd": host_us(lambda: K.lora_expand_bwd(dy, h, B_cat, segs, table)),
        "lora_shrink_bwd": host_us(lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table)),
    }
    for k, v in res.items():
        print(f"{v:8.1f} us  {k}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
