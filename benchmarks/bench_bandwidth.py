"""How close the forward LoRA kernels come to the GPU's memory bandwidth, at the model step's shapes.

At S = 16384 tokens, bf16, r = 16, 8 adapters, the forward shrink only reads ``x`` and the write-mode expand only
writes ``y``: both are memory-bound. This script times, by profiler kernel time (mean over ``--reps`` calls),

* the bandwidth floor: PyTorch's ``zero_`` (write only), ``copy_`` (read + write) and a row sum (read only) over
  the same tensors;
* our kernels as shipped (shrink without dropout, with dropout, storing its mask; expand in write and add mode);
* a sweep of expand rows, write and add mode (tile shape, warps, N-tiles per program); ``--sweep-shrink`` adds a
  block sweep of the shrink without dropout;
* cuBLAS doing the same bytes: ``x @ A_catᵀ`` (every adapter's rank for every token) and ``H @ B_catᵀ`` (a
  block-diagonal ``H``), the dense alternatives for few adapters.

Each row gives microseconds and the effective bandwidth (bytes the op must move / time). Usage (GPU):
``python benchmarks/bench_bandwidth.py --out bandwidth.json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
from fast_multilora.kernels import api as K
from fast_multilora.kernels import forward as kf
from fast_multilora.kernels.dropout import keep_bits_buffer
from harness import kernel_ms  # benchmarks/ is on sys.path when this runs as a script
from tune_kernels import make_case


def case(S, Kd, N, r=16, A=8, dropout=0.05, dev="cuda", dtype=torch.bfloat16):
    """``tune_kernels.make_case``'s SGEMM layout (A adapters in equal runs), without its y and dy."""
    segs, table, x, _y, _dy, A_cat, B_cat = make_case(S, Kd, N, r, A, dtype, dropout=dropout, dev=dev)
    return segs, table, x, A_cat, B_cat


class Rows:
    def __init__(self, reps):
        self.reps, self.rows = reps, []

    def add(self, op, shape, config, nbytes, fn):
        try:
            us = kernel_ms(fn, self.reps) * 1e3
        except Exception as e:  # noqa: BLE001 - a configuration that does not fit (resources) is recorded, not fatal
            print(f"{op:28s} {shape:18s} {str(config):24s} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
            self.rows.append({"op": op, "shape": shape, "config": config, "us": None})
            return
        tbs = nbytes / us / 1e6
        print(f"{op:28s} {shape:18s} {str(config):24s} {us:8.1f} us {tbs:5.2f} TB/s", flush=True)
        self.rows.append({"op": op, "shape": shape, "config": config, "us": us, "tb_s": tbs, "bytes": nbytes})


def run_shape(R, S: int, D: int, sweep: bool, sweep_shrink: bool = False) -> None:
    """Floors, shipped kernels, cuBLAS and (``sweep``) block sweeps at S tokens, K = N = D."""
    segs, table, x, A_cat, B_cat = case(S, D, D)
    shape = f"S{S}-D{D}"
    nb = x.numel() * x.element_size()
    y = torch.empty_like(x)
    R.add("floor_zero", shape, "torch", nb, lambda: y.zero_())
    R.add("floor_copy", shape, "torch", 2 * nb, lambda: y.copy_(x))
    R.add("floor_rowsum", shape, "torch", nb, lambda: x.sum(dim=1, dtype=torch.float32))
    # shrink: reads x (h is S x 16 fp32: 1 MiB)
    R.add("shrink", shape, "shipped", nb, lambda: K.lora_shrink(x, A_cat, segs, table))
    R.add("shrink_dropout", shape, "shipped", nb, lambda: K.lora_shrink(x, A_cat, segs, table, seed=1))
    keep = keep_bits_buffer(x)
    R.add("shrink_dropout_store", shape, "shipped", nb + keep.numel(),
          lambda: K.lora_shrink(x, A_cat, segs, table, seed=1, keep_out=keep))
    R.add("cublas_x_Acat", shape, "mm [S,K]x[K,8r]", nb, lambda: torch.mm(x, A_cat.t()))
    # expand: writes y
    h = K.lora_shrink(x, A_cat, segs, table)
    R.add("expand_write", shape, "shipped", nb,
          lambda: K.lora_expand(h, B_cat, segs, table, y, accumulate=False))
    R.add("expand_add", shape, "shipped", 2 * nb, lambda: K.lora_expand(h, B_cat, segs, table, y))
    hb = torch.zeros(S, table.total_rank, device=x.device, dtype=x.dtype)
    R.add("cublas_Hbd_Bcat", shape, "mm [S,8r]x[8r,N]", nb, lambda: torch.mm(hb, B_cat.t(), out=y))
    if not sweep:
        return
    if sweep_shrink:
        saved = list(kf.SHRINK_BLOCKS["gpu"])
        for bs, bk, w, st in itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
            if bs * bk > 128 * 128 or (bs == 128 and w == 4):
                continue
            kf.SHRINK_BLOCKS["gpu"] = [(math.inf, bs, 32, bk, w, st)]
            R.add("shrink", shape, [bs, bk, w, st], nb, lambda: K.lora_shrink(x, A_cat, segs, table))
        kf.SHRINK_BLOCKS["gpu"] = saved
    configs = ((128, 128, 4, 1, 1), (128, 64, 4, 1, 1), (64, 128, 4, 1, 4), (64, 128, 8, 1, 4), (64, 64, 4, 1, 4),
               (128, 128, 4, 1, 4), (128, 64, 4, 1, 2))
    saved = list(kf.EXPAND_WRITE_BLOCKS["gpu"]), list(kf.EXPAND_BLOCKS["gpu"])
    for bs, bn, w, st, nt in configs:  # (BLOCK_S, BLOCK_N, warps, stages, N-tiles per program)
        kf.EXPAND_WRITE_BLOCKS["gpu"] = kf.EXPAND_BLOCKS["gpu"] = [(math.inf, bs, bn, 64, w, st, nt)]
        R.add("expand_write", shape, [bs, bn, w, st, nt], nb,
              lambda: K.lora_expand(h, B_cat, segs, table, y, accumulate=False))
        R.add("expand_add", shape, [bs, bn, w, st, nt], 2 * nb, lambda: K.lora_expand(h, B_cat, segs, table, y))
    kf.EXPAND_WRITE_BLOCKS["gpu"], kf.EXPAND_BLOCKS["gpu"] = saved


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-shrink", action="store_true", help="also sweep the shrink's blocks (no dropout)")
    a = ap.parse_args(argv)
    R = Rows(a.reps)
    for D in (2048, 5632):
        run_shape(R, 16384, D, not a.no_sweep, a.sweep_shrink)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": R.rows}, f, indent=1)


if __name__ == "__main__":
    main()
