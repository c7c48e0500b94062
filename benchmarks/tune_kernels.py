"""Block-size sweep and per-kernel profile at the headline shape (S=8192, K=N=4096, r=16, 8 adapters, bf16).

Writes JSON rows ``{op, family, config, us}`` so the tables in kernels/forward.py and kernels/backward.py can be set
from measurements. Usage (GPU): ``python benchmarks/tune_kernels.py --out tune.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from fast_multilora.kernels import api as K
from fast_multilora.kernels import backward as kb
from fast_multilora.kernels import configs as kc
from fast_multilora.kernels.dropout import _bits_of, _keep_of
from fast_multilora.kernels.segments import AdapterTable, grouped_segments, segments_from_token_slots
from harness import kernel_ms  # benchmarks/ is on sys.path when this runs as a script


def uniform_table(A, r, dropout, dev):
    """``A`` adapters of rank ``r``, scale 2, concatenated in slot order."""
    return AdapterTable(torch.full((A,), r, dtype=torch.int32, device=dev),
                        (torch.arange(A, dtype=torch.int32) * r).to(dev), torch.full((A,), 2.0, device=dev),
                        torch.full((A,), dropout, device=dev), r, r * A, dropout > 0)


def make_case(S=8192, Kd=4096, N=4096, r=16, A=8, dtype=torch.bfloat16, grouped=False, dropout=0.0, dev="cuda",
              skewed=False):
    """Tokens of ``A`` adapters: equal shares, or (``skewed``) 90 % on adapter 0 and the rest evenly spread; sorted by
    adapter (SGEMM family), or (``grouped``) interleaved at random and grouped through a permutation (chunked)."""
    g = torch.Generator().manual_seed(0)
    if skewed:
        rest = (S - S * 9 // 10) // (A - 1)
        counts = [S - rest * (A - 1)] + [rest] * (A - 1)
    else:
        counts = [S // A] * A
    ts = torch.repeat_interleave(torch.arange(A), torch.tensor(counts))
    if grouped:
        ts = ts[torch.randperm(S, generator=g)]
    segs = segments_from_token_slots(ts, grouped=grouped, device=dev)
    table = uniform_table(A, r, dropout, dev)
    x = torch.randn(S, Kd, device=dev, dtype=dtype)
    y = torch.randn(S, N, device=dev, dtype=dtype)
    dy = torch.randn(S, N, device=dev, dtype=dtype)
    A_cat = torch.randn(A * r, Kd, device=dev, dtype=dtype) * 0.02
    B_cat = torch.randn(N, A * r, device=dev, dtype=dtype) * 0.02
    return segs, table, x, y, dy, A_cat, B_cat


BF16 = {"rank_tile": 16, "dtypes": ["float16", "bfloat16"]}  # the match fields of a 16-bit rank-16 row


def first_row(op, row):
    """Within the block, ``row`` comes first among ``op``'s rows of this GPU's block-size file (it wins wherever its
    match fields agree; the other rows stay for the rest); restored after."""
    return kc.override(op, [row, *kc.rows(op, kc.target_for())])


def only_row(*ops, **row):
    """Within the block, each of ``ops`` has the one row ``row`` (kernels/configs/<gpu>.json); restored after."""
    stack = contextlib.ExitStack()
    for op in ops:
        stack.enter_context(kc.override(op, [row]))
    return stack


@contextlib.contextmanager
def shrink_bwd_rows(cfg):
    """Within the block: every 16-bit shrink-backward launch with one rank tile of 16 takes ``cfg`` (BLOCK_S,
    BLOCK_K, num_warps, num_stages) -- the generic op's row and every mode's row of ``shrink_bwd_r16``; restored
    after."""
    fields = dict(zip(("BLOCK_S", "BLOCK_K", "num_warps", "num_stages"), cfg, strict=True))
    with first_row("shrink_bwd", dict(BF16, **fields)), kc.override("shrink_bwd_r16", [fields]):
        yield


def expand_bwd_row(bs, bn, w, fused):
    """Within the block, the 16-bit rank-16 expand backward takes ``(BLOCK_S, BLOCK_N, num_warps, fused)``."""
    return first_row("expand_bwd", dict(BF16, BLOCK_S=bs, BLOCK_N=bn, num_warps=w, fused=fused))


def record(rows, op, family, config, fn, moved=None):
    """Time ``fn`` (us) and append a row; a configuration that fails (out of resources etc.) records ``None``.
    ``moved``: the bytes ``fn`` reads and writes; the row then carries the bandwidth (``tb_s``)."""
    try:
        us = kernel_ms(fn, 10) * 1e3
    except Exception as e:  # noqa: BLE001 - out of resources etc.
        us = None
        print(op, family, *config, "failed", type(e).__name__)
    rows.append({"op": op, "family": family, "config": list(config), "us": us})
    if moved is not None and us:
        rows[-1]["tb_s"] = round(moved / us / 1e6, 3)


def sweep_shrink(rows, case, family, seed):
    """The forward shrink's block rows (op ``shrink``, or ``shrink_dropout`` with a dropout ``seed``)."""
    segs, table, x, y, dy, A_cat, B_cat = case
    op = "shrink" if seed is None else "shrink_dropout"
    for bs, bk, w, st in itertools.product((16, 32, 64), (128, 256), (4, 8), (3,)):
        # the swept row, whatever the segment count (shrink_many too)
        with only_row(op, "shrink_many", BLOCK_S=bs, BLOCK_N=32, BLOCK_K=bk, num_warps=w, num_stages=st):
            record(rows, "shrink" + ("_dropout" if seed is not None else ""), family, (bs, bk, w, st),
                   lambda: K.lora_shrink(x, A_cat, segs, table, seed=seed))
    record(rows, "shrink" + ("_dropout" if seed is not None else ""), family, ("shipped",),
           lambda: K.lora_shrink(x, A_cat, segs, table, seed=seed))


def sweep_expand(rows, case, family):
    segs, table, x, y, dy, A_cat, B_cat = case
    h = K.lora_shrink(x, A_cat, segs, table)
    for bs, bn, w, st in itertools.product((32, 64, 128), (128, 256), (4, 8), (1,)):
        with only_row("expand_add", BLOCK_S=bs, BLOCK_N=bn, BLOCK_R=64, num_warps=w, num_stages=st, N_TILES=1):
            record(rows, "expand", family, (bs, bn, w, st), lambda: K.lora_expand(h, B_cat, segs, table, y))


def sweep_bwd(rows, case, family):
    segs, table, x, y, dy, A_cat, B_cat = case
    h = K.lora_shrink(x, A_cat, segs, table)
    dh, _ = K.lora_expand_bwd(dy, h, B_cat, segs, table)
    saved_p = kb._PROGRAMS_PER_SM
    for pps in (2, 8):
        kb._PROGRAMS_PER_SM = pps
        for bs, bn, w, fused in itertools.product((128, 256), (64, 128), (4, 8), (True,)):
            with expand_bwd_row(bs, bn, w, fused):
                record(rows, "expand_bwd", family, (pps, bs, bn, w, fused),
                       lambda: K.lora_expand_bwd(dy, h, B_cat, segs, table))
        for bs, bk, w in itertools.product((32, 64), (64, 128), (4, 8)):
            with shrink_bwd_rows((bs, bk, w, 3)):
                record(rows, "shrink_bwd", family, (pps, bs, bk, w),
                       lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table))
    kb._PROGRAMS_PER_SM = saved_p


def sweep_model_expand(rows):
    """The expand (write mode, as the fused layer path's forward runs it), the expand backward and the shrink
    backward reading the forward's packed dropout mask, at the training step's shapes (S = 16 x 1024, 8 adapters,
    r = 16, bf16, dropout 0.05); kernel time by the profiler. Rows: ``op`` = kernel, ``family`` = shape."""
    for Kd, N in ((2048, 2048), (2048, 5632), (2048, 256), (5632, 2048)):
        _sweep_model_expand_shape(rows, 16384, Kd, N)


def sweep_model_expand_bwd(rows):
    """The expand backward as the training step calls it (dh given, dB in bf16 blocked per adapter), at the step's N
    (S = 16 x 1024, 8 adapters, r = 16, bf16): the shipped rows (config ``shipped``) beside every swept row, kernel
    time of both kernels by the profiler."""
    for N in (256, 2048, 5632):
        _sweep_expand_bwd_step(rows, 16384, N)


def _sweep_expand_bwd_step(rows, S, N):
    """One N of :func:`sweep_model_expand_bwd` (its own function: the timed call closes over its tensors)."""
    family = f"S{S}-N{N}"
    segs, table, x, y, dy, A_cat, B_cat = make_case(S=S, Kd=2048, N=N, dropout=0.05)
    h = K.lora_shrink(x, A_cat, segs, table)
    dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
    dB = torch.empty(table.total_rank * N, dtype=torch.bfloat16, device=h.device)

    def call():
        K.lora_expand_bwd(dy, h, B_cat, segs, table, dh=dh, dB_out=dB, dB_blocked=True)

    record(rows, "m_expand_bwd_step", family, ("shipped",), call)
    for bs, bn, w in itertools.product((64, 128, 256), (64, 128), (4, 8)):
        with expand_bwd_row(bs, bn, w, True):
            record(rows, "m_expand_bwd_step", family, (bs, bn, w), call)
    mine = [r for r in rows if r["family"] == family and r["us"]]
    shipped = next(r["us"] for r in mine if r["config"] == ["shipped"])
    best = ", ".join(f"{r['config']} {r['us']:.1f}" for r in sorted(mine, key=lambda r: r["us"])[:6])
    print(f"{family}: shipped {shipped:.1f} us; best {best}", flush=True)


def _sweep_model_expand_shape(rows, S, Kd, N):
    """One shape of :func:`sweep_model_expand` (its own function: the timed lambdas close over its tensors)."""
    shape = f"S{S}-K{Kd}-N{N}"
    segs, table, x, y, dy, A_cat, B_cat = make_case(S=S, Kd=Kd, N=N, dropout=0.05)
    keep = K.keep_bits_buffer(x)
    h = K.lora_shrink(x, A_cat, segs, table, seed=5, keep_out=keep)
    dh, _ = K.lora_expand_bwd(dy, h, B_cat, segs, table)
    if Kd == 2048:  # the expand and its backward depend on N only
        for bs, bn, w in itertools.product((64, 128, 256), (64, 128, 256), (4, 8)):
            with only_row("expand_write", BLOCK_S=bs, BLOCK_N=bn, BLOCK_R=64, num_warps=w, num_stages=1, N_TILES=1):
                record(rows, "m_expand_write", shape, (bs, bn, w),
                       lambda: K.lora_expand(h, B_cat, segs, table, y, accumulate=False))
        for bs, bn, w in itertools.product((64, 128, 256), (64, 128), (4, 8)):
            with expand_bwd_row(bs, bn, w, True):
                record(rows, "m_expand_bwd", shape, (bs, bn, w),
                       lambda: K.lora_expand_bwd(dy, h, B_cat, segs, table))
    if N == 2048:  # the shrink backward depends on K only
        for bs, bk, w in itertools.product((32, 64), (64, 128, 256), (4, 8)):
            with shrink_bwd_rows((bs, bk, w, 3)):
                record(rows, "m_shrink_bwd_stored_mask", shape, (bs, bk, w),
                       lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table, seed=5, keep=keep))
        record(rows, "m_shrink_bwd_redrawn_mask", shape, ("default",),
               lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table, seed=5))
        record(rows, "m_shrink_dropout_store", shape, ("default",),
               lambda: K.lora_shrink(x, A_cat, segs, table, seed=5, keep_out=keep))
        record(rows, "m_shrink_dropout", shape, ("default",), lambda: K.lora_shrink(x, A_cat, segs, table, seed=5))
    print(shape, "done", flush=True)


def sweep_model_shrink(rows):
    """The shrink backward (dropout 0, dropout with the mask redrawn, dropout with the forward's stored mask) and the
    shrink forward under dropout (storing the mask or not) at the training step's shapes; kernel time by the
    profiler. Rows: ``op`` = kernel and mode, ``family`` = shape."""
    for Kd in (2048, 5632):
        _sweep_model_shrink_shape(rows, 16384, Kd, 2048)


def _sweep_model_shrink_shape(rows, S, Kd, N):
    """One shape of :func:`sweep_model_shrink` (its own function: the timed lambdas close over its tensors)."""
    shape = f"S{S}-K{Kd}-N{N}"
    segs, table, x, y, dy, A_cat, B_cat = make_case(S=S, Kd=Kd, N=N, dropout=0.05)
    table0 = make_case(S=S, Kd=16, N=16, dropout=0.0)[1]  # the same layout without dropout
    keep = K.keep_bits_buffer(x)
    h = K.lora_shrink(x, A_cat, segs, table, seed=5, keep_out=keep)
    dh, _ = K.lora_expand_bwd(dy, h, B_cat, segs, table)
    modes = {"p0": lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table0),
             "redrawn": lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table, seed=5),
             "stored": lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table, seed=5, keep=keep)}
    for bs, bk, w, st in itertools.product((32, 64), (64, 128, 256), (4, 8), (2, 3)):
        with shrink_bwd_rows((bs, bk, w, st)):
            for mode, fn in modes.items():
                record(rows, f"m_shrink_bwd_{mode}", shape, (bs, bk, w, st), fn)
    for bs, bk, w, st in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4)):
        with only_row("shrink_dropout", "shrink_dropout_store", BLOCK_S=bs, BLOCK_N=32, BLOCK_K=bk, num_warps=w,
                      num_stages=st):
            record(rows, "m_shrink_dropout", shape, (bs, bk, w, st),
                   lambda: K.lora_shrink(x, A_cat, segs, table, seed=5))
            record(rows, "m_shrink_dropout_store", shape, (bs, bk, w, st),
                   lambda: K.lora_shrink(x, A_cat, segs, table, seed=5, keep_out=keep))
    print(shape, "done", flush=True)


def sweep_model_shapes(rows):
    """The kernels of a training step at the benchmark model's shapes (S = 16 x 1024 tokens, 8 adapters of 2 rows,
    r = 16, bf16, dropout 0.05): shrink with dropout, the expand in write mode (the fused layer path's forward) and
    in add mode, the shrink backward (dx + dA, and dA alone), the expand backward, and cuBLAS's base GEMM with and
    without accumulating into its output. Rows carry ``op`` = kernel and ``family`` = shape."""
    for Kd, N in ((2048, 2048), (5632, 2048), (2048, 5632), (2048, 256)):
        _sweep_model_shape(rows, 16384, Kd, N)


def _sweep_model_shape(rows, S, Kd, N):
    """One shape of :func:`sweep_model_shapes` (its own function: the timed lambdas close over its tensors)."""
    shape = f"S{S}-K{Kd}-N{N}"
    segs, table, x, y, dy, A_cat, B_cat = make_case(S=S, Kd=Kd, N=N, dropout=0.05)
    h = K.lora_shrink(x, A_cat, segs, table, seed=5)
    dh, _ = K.lora_expand_bwd(dy, h, B_cat, segs, table)
    saved_p = kb._PROGRAMS_PER_SM
    if N == 2048:  # shrink and shrink backward depend on K only
        for bs, bk, w, st in itertools.product((32, 64), (128, 256), (4, 8), (3, 4)):
            with only_row("shrink_dropout", BLOCK_S=bs, BLOCK_N=32, BLOCK_K=bk, num_warps=w, num_stages=st):
                record(rows, "m_shrink_dropout", shape, (bs, bk, w, st),
                       lambda: K.lora_shrink(x, A_cat, segs, table, seed=5))
        for pps in (2, 4):
            kb._PROGRAMS_PER_SM = pps
            for bs, bk, w, st in itertools.product((32, 64), (64, 128, 256), (4, 8), (2, 3)):
                with shrink_bwd_rows((bs, bk, w, st)):
                    record(rows, "m_shrink_bwd", shape, (pps, bs, bk, w, st),
                           lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table, seed=5))
        kb._PROGRAMS_PER_SM = saved_p
        record(rows, "m_da", shape, ("default",),
               lambda: K.lora_shrink_bwd(dh, x, A_cat, segs, table, seed=5, need_dx=False))
    if Kd == 2048:  # the expand and its backward depend on N only
        for mode, op, accumulate in (("m_expand_write", "expand_write", False), ("m_expand_add", "expand_add", True)):
            for bs, bn, w in itertools.product((64, 128), (64, 128, 256), (4, 8)):
                with only_row(op, BLOCK_S=bs, BLOCK_N=bn, BLOCK_R=64, num_warps=w, num_stages=1, N_TILES=1):
                    record(rows, mode, shape, (bs, bn, w),
                           lambda a=accumulate: K.lora_expand(h, B_cat, segs, table, y, accumulate=a))
        for pps in (2, 4):
            kb._PROGRAMS_PER_SM = pps
            for bs, bn, w in itertools.product((64, 128, 256), (64, 128), (4, 8)):
                with expand_bwd_row(bs, bn, w, True):
                    record(rows, "m_expand_bwd", shape, (pps, bs, bn, w),
                           lambda: K.lora_expand_bwd(dy, h, B_cat, segs, table))
        kb._PROGRAMS_PER_SM = saved_p
    # cuBLAS beside them: the base GEMM alone, and accumulating into a given output (beta = 1), forward and dx
    W = torch.randn(N, Kd, device=x.device, dtype=x.dtype) * 0.02
    dx = torch.empty_like(x)
    record(rows, "m_gemm", shape, ("mm",), lambda: torch.mm(x, W.t()))
    record(rows, "m_gemm", shape, ("addmm_",), lambda: y.addmm_(x, W.t()))
    record(rows, "m_gemm", shape, ("mm+add_",), lambda: y.add_(torch.mm(x, W.t())))
    record(rows, "m_gemm_dx", shape, ("mm",), lambda: torch.mm(dy, W))
    record(rows, "m_gemm_dx", shape, ("addmm_",), lambda: dx.addmm_(dy, W))
    record(rows, "m_gemm_dx", shape, ("mm+add_",), lambda: dx.add_(torch.mm(dy, W)))
    print(shape, "done", flush=True)


def profile_ops(case, family):
    """CUDA time per kernel for one forward + backward of the delta (default tables)."""
    segs, table, x, y, dy, A_cat, B_cat = case

    def run():
        h = K.lora_shrink(x, A_cat, segs, table, seed=5)
        K.lora_expand(h, B_cat, segs, table, y)
        dh, dB = K.lora_expand_bwd(dy, h, B_cat, segs, table)
        K.lora_shrink_bwd(dh, x, A_cat, segs, table, seed=5)

    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    table_str = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(f"--- profile {family} (5 iterations, dropout on)\n{table_str}")
    return table_str


def profile_layer():
    """A patched PEFT Linear (8 adapters, dropout 0.05), fwd+bwd, same names every call: where does time go?"""
    from peft import LoraConfig, get_peft_model

    import fast_multilora

    lin = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).cuda().to(torch.bfloat16)
    cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["0"])
    pm = get_peft_model(lin, cfg, adapter_name="a0")
    for i in range(1, 8):
        pm.add_adapter(f"a{i}", cfg)
    pm.cuda().to(torch.bfloat16)
    for n, p in pm.named_parameters():
        p.requires_grad_("lora_" in n)
    fast_multilora.patch(pm, backend="triton")
    pm.train()
    x = torch.randn(8, 1024, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(8, 1024, 4096, device="cuda", dtype=torch.bfloat16)
    names = [f"a{i}" for i in range(8)]

    def step():
        pm(x, adapter_names=names).backward(gy)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10 * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(f"--- layer fwd+bwd wall {wall:.3f} ms/step")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    return wall


# the issue-4 model's seven projections (K, N): q and o, k and v (4 of 32 heads), gate and up, down
DECODE_SHAPES = ((2048, 2048), (2048, 256), (2048, 5632), (5632, 2048))


def scale_arena_blocks(n_adapters: int, r: int = 16) -> list:
    """``(start, numel, adapter)`` of ``n_adapters`` adapters laid out as the adapter store lays out the scale step's
    (``BENCH_LLAMA``, rank ``r`` on all 7 projections of its 8 layers: A ``[r, in]`` and B ``[out, r]`` blocks)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from multi_adapter_tasks import BENCH_LLAMA

    h, i = BENCH_LLAMA["hidden_size"], BENCH_LLAMA["intermediate_size"]
    kv = h // BENCH_LLAMA["num_attention_heads"] * BENCH_LLAMA["num_key_value_heads"]
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)] * BENCH_LLAMA["num_hidden_layers"]
    blocks, at = [], 0
    for a in range(n_adapters):
        for k_in, n_out in shapes:
            for numel in (r * k_in, n_out * r):
                blocks.append((at, numel, a))
                at += numel
    return blocks


def sweep_adamw(rows, n_adapters: int = 64, dtype=torch.bfloat16):
    """``kernels.adamw.adamw_step_`` over the scale step's arena at ``n_adapters`` adapters, every adapter active:
    chunk x warps, with and without the alignment hint (``align``: 16 as the store lays the arena out, 1: every
    access a scalar one); rows carry the achieved bandwidth (4 buffers read, 3 written). Plus the copy floor: one
    ``copy_`` of the same bytes, and ``adamw_scalars_`` (the per-step scalars, once per optimizer step)."""
    from fast_multilora.kernels import adamw as KA

    blocks = scale_arena_blocks(n_adapters)
    numel = blocks[-1][0] + blocks[-1][1]
    bufs = [torch.randn(numel, device="cuda").to(dtype) for _ in range(4)]
    bufs[3].abs_()  # exp_avg_sq
    hyper = torch.tensor([[1e-4, 0.9, 0.999, 1e-8, 0.01]] * n_adapters, device="cuda")
    step = torch.ones(n_adapters, device="cuda")
    active = torch.ones(n_adapters, dtype=torch.bool, device="cuda")
    scalars = KA.adamw_scalars_(hyper, step, active)
    moved = numel * bufs[0].element_size() * 7
    family = f"A{n_adapters}-{str(dtype)[6:]}"
    saved = KA._meta
    try:
        for chunk, warps, align in itertools.product((1024, 2048), (4, 8), (16, 1)):
            table = KA.chunk_table(blocks, n_adapters, numel, "cuda", chunk=chunk)._replace(align=align)
            KA._meta = lambda t, w=warps: dict(saved(t), num_warps=w)
            record(rows, "adamw", family, (chunk, warps, align),
                   lambda t=table: KA.adamw_step_(*bufs, t, scalars, active), moved)
    finally:
        KA._meta = saved
    table = KA.chunk_table(blocks, n_adapters, numel, "cuda")
    record(rows, "adamw", family, ("shipped", table.align), lambda: KA.adamw_step_(*bufs, table, scalars, active),
           moved)
    record(rows, "adamw_scalars", family, (), lambda: KA.adamw_scalars_(hyper, step, active))
    src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    record(rows, "copy_floor", f"{moved / 2**30:.2f} GiB moved", (), lambda: dst.copy_(src), moved)


def sweep_decode(rows, S_values=(16, 64), dev="cuda"):
    """The decode kernel's rows (op ``decode`` of ``kernels/configs/<gpu>.json``) at the model's projections: ``S``
    rows, a quarter of them base rows, the rest spread over 8 adapters of rank 16 in arrival order (unsorted), bf16;
    concatenated weights (``SlotWeights`` read in place differ only in the per-row weight offsets)."""
    g = torch.Generator().manual_seed(0)
    for S, (Kd, N) in itertools.product(S_values, DECODE_SHAPES):
        ts = torch.randint(0, 8, (S,), generator=g)
        ts[torch.randperm(S, generator=g)[: S // 4]] = -1
        segs = grouped_segments(ts.to(dev, torch.int32), 8)  # the layout decode calls get (with token_slots)
        table = uniform_table(8, 16, 0.0, dev)
        x = torch.randn(S, Kd, device=dev, dtype=torch.bfloat16)
        y = torch.randn(S, N, device=dev, dtype=torch.bfloat16)
        A_cat = torch.randn(128, Kd, device=dev, dtype=torch.bfloat16) * 0.02
        B_cat = torch.randn(N, 128, device=dev, dtype=torch.bfloat16) * 0.02
        name = f"S{S}-K{Kd}-N{N}"
        call = functools.partial(K.lora_shrink_expand, x, A_cat, B_cat, segs, table, y)
        for bn, bk, w, st in itertools.product((32, 64, 128, 256), (128, 256, 512), (2, 4, 8), (1, 3)):
            if 16 * bk > 128 * 32 * w or bn * 16 > 64 * 32 * w:  # > 128 fp32 shrink / 64 expand values per thread
                continue
            with only_row("decode", BLOCK_S=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st):
                record(rows, "decode", name, (bn, bk, w, st), call)
        record(rows, "decode", name, ("shipped",), call)
        print(name, "done", flush=True)


def sweep_cross_entropy(rows, V=128256):
    """The cross-entropy kernels (``cross_entropy`` op: BLOCK_M, BLOCK_V, num_warps) at a Llama-3 vocabulary, bf16:
    the fused loss's chunk (``cross_entropy_``, its default chunk of the 8B step: 256 rows; 2 reads, 1 write) and the
    per-adapter loss on 8192 rows of logits (``cross_entropy_fwd``: 1 read; ``cross_entropy_bwd``: 1 read, 1 write).
    Rows: ``op`` = launcher, ``family`` = rows x vocabulary, ``tb_s`` = bytes moved per second."""
    _sweep_ce_shape(rows, 256, V, ("cross_entropy_",))
    _sweep_ce_shape(rows, 8192, V, ("cross_entropy_fwd", "cross_entropy_bwd"))


def _sweep_ce_shape(rows, M, V, calls):
    """One shape of :func:`sweep_cross_entropy` (its own function: the timed lambdas close over its tensors)."""
    from fast_multilora.kernels import cross_entropy as ce

    g = torch.Generator(device="cuda").manual_seed(0)
    z0 = torch.randn(M, V, device="cuda", generator=g).to(torch.bfloat16)
    z = z0.clone()  # cross_entropy_ overwrites it (with values in [-1, 1]: repeated calls stay finite)
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    lse = torch.logsumexp(z0.float(), 1)
    gr = torch.full((M,), 1.0 / M, device="cuda")
    fns = {"cross_entropy_": (lambda: ce.cross_entropy_(z, t), 6),
           "cross_entropy_fwd": (lambda: ce.cross_entropy_fwd(z0, t), 2),
           "cross_entropy_bwd": (lambda: ce.cross_entropy_bwd(z0, t, lse, gr), 4)}
    family = f"M{M}-V{V}"
    configs = [(1, bv, w) for bv in (4096, 8192, 16384, 32768) for w in (4, 8, 16, 32)]
    configs += [(bm, bv, w) for bm in (2, 4) for bv in (2048, 4096, 8192) for w in (8, 16)]
    for name in calls:
        fn, per = fns[name]
        record(rows, name, family, ("shipped",), fn, moved=per * M * V)
        for bm, bv, w in configs:
            with only_row("cross_entropy", BLOCK_M=bm, BLOCK_V=bv, num_warps=w):
                record(rows, name, family, (bm, bv, w), fn, moved=per * M * V)
        mine = sorted((r for r in rows if r["op"] == name and r["family"] == family and r["us"]),
                      key=lambda r: r["us"])
        print(name, family, "best:", [(r["config"], round(r["us"], 1), r.get("tb_s")) for r in mine[:5]], flush=True)


@triton.jit
def _probe_philox(out, seed, K, thresh, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, EXPAND: tl.constexpr):
    """The training forward's dropout draw alone over ``[S, K]`` (no ``x``): per K step the Philox words of the
    tile's 8-column groups, then their packed bytes (``EXPAND=False``) or the per-element mask the shrink applies
    (``EXPAND=True``), folded into one int per row so nothing is dead code."""
    o_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_S, BLOCK_K if EXPAND else BLOCK_K // 8], dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        o_g = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        ctr = o_s.to(tl.int64)[:, None] * ((K + 7) // 8) + o_g.to(tl.int64)[None, :]
        r0, r1, r2, r3 = tl.randint4x(seed, ctr.to(tl.uint32))
        if EXPAND:
            acc += _keep_of(r0, r1, r2, r3, thresh).to(tl.int32)
        else:
            acc ^= _bits_of(r0, r1, r2, r3, thresh).to(tl.int32)
    tl.store(out + o_s, tl.sum(acc, 1))


@triton.jit
def _probe_read(x, out, K, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    """``x[S, K]`` read once (the shrink's bytes, no dot), summed per row."""
    o_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_S, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += tl.load(x + o_s[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :]).to(tl.float32)
    tl.store(out + o_s, tl.sum(acc, 1))


def sweep_dropout(rows):
    """The training forward's dropout taken apart at the step's shapes (S = 16384, bf16, p = 0.05): the shrink
    without dropout, with its mask drawn, drawn and stored; the draw alone (Philox and the packed bytes; Philox and
    the per-element mask) and ``x`` read alone, at the shrink's tiles. Kernel time by the profiler; rows ``op`` =
    part, ``family`` = K."""
    for Kd in (2048, 5632):
        _sweep_dropout_shape(rows, 16384, Kd)


def _sweep_dropout_shape(rows, S, Kd):
    """One K of :func:`sweep_dropout` (its own function: the timed lambdas close over its tensors)."""
    segs, table, x, y, dy, A_cat, B_cat = make_case(S=S, Kd=Kd, N=2048, dropout=0.05)
    table0 = make_case(S=S, Kd=16, N=16, dropout=0.0)[1]
    keep = K.keep_bits_buffer(x)
    out_i = torch.empty(S, dtype=torch.int32, device=x.device)
    out_f = torch.empty(S, dtype=torch.float32, device=x.device)
    family, thresh = f"K{Kd}", round(0.05 * 65536)
    record(rows, "shrink", family, ("shipped",), lambda: K.lora_shrink(x, A_cat, segs, table0), moved=2 * S * Kd)
    record(rows, "shrink_dropout", family, ("shipped",), lambda: K.lora_shrink(x, A_cat, segs, table, seed=5),
           moved=2 * S * Kd)
    record(rows, "shrink_dropout_store", family, ("shipped",),
           lambda: K.lora_shrink(x, A_cat, segs, table, seed=5, keep_out=keep), moved=2 * S * Kd + S * Kd // 8)
    for bs, bk, w in ((32, 64, 4), (32, 128, 4), (64, 128, 8)):
        grid = (triton.cdiv(S, bs),)
        for expand in (False, True):
            record(rows, "draw_mask" if expand else "draw_bytes", family, (bs, bk, w), functools.partial(
                _probe_philox[grid], out_i, 5, Kd, thresh, BLOCK_S=bs, BLOCK_K=bk, EXPAND=expand, num_warps=w))
        record(rows, "read_x", family, (bs, bk, w), functools.partial(
            _probe_read[grid], x, out_f, Kd, BLOCK_S=bs, BLOCK_K=bk, num_warps=w), moved=2 * S * Kd)
    mine = [r for r in rows if r["family"] == family and r["us"]]
    print(family, [(r["op"], r["config"], round(r["us"], 1)) for r in mine], flush=True)


def sm90_kernel(fn, types, consts, num_warps, num_stages=None, **options):
    """``fn`` compiled for sm_90 with Triton's bundled ptxas (no GPU needed), as a launch on an H100/H200 compiles it:
    every ``tl.constexpr`` given in ``consts`` (one left out would compile as a runtime int, both branches of each
    of its ``if`` s: not the launch's code), the other parameters typed by ``types`` (default ``i32``), pointers,
    strides, ``N`` and ``K`` 16-divisible as launches specialise them (a unit inner stride is passed in ``consts``).
    Also the tests' compile checks (``tests/helpers.compile_for_sm90`` puts this folder on their path)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(fn, triton.runtime.jit.JITFunction):  # an autotuned or heuristics wrapper: its JIT function
        fn = fn.fn
    consts, sig, attrs = dict(consts), {}, {}
    missing = [fn.arg_names[i] for i in fn.constexprs if fn.arg_names[i] not in consts]
    if missing:
        raise ValueError(f"{fn.__name__}: constexprs {missing} not given")
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "i32")
        if sig[name].startswith("*") or name.startswith("stride") or name in ("N", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {"num_warps": num_warps, **({} if num_stages is None else {"num_stages": num_stages}), **options}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts)


def sass_loop(kernel) -> dict:
    """Registers, local memory per thread (``stack``: spills), and per iteration of the longest loop in the SASS
    (the K step or row step): instructions and barriers; by ``cuobjdump`` from Triton's wheel."""
    import re
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    best = (0, 0)
    for a, t in code:
        m = re.search(r"\bBRA\s+(?:0x)?([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            body = [tt for aa, tt in code if int(m.group(1), 16) <= aa <= a]
            best = max(best, (len(body), sum("BAR.SYNC" in tt for tt in body)))
    reg, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    return {"regs": int(reg), "stack": int(stack), "loop_instr": best[0], "loop_bar": best[1]}


def sweep_sass(rows):
    """No GPU: the shrink forward (no dropout, dropout, dropout storing its mask) and the shrink backward (no
    dropout, mask redrawn, mask read back) as the training step launches them on an H200 (bf16, r = 16, K = 2048,
    the shipped rows), compiled for sm_90: registers, and instructions and barriers per iteration of the main loop
    (per warp; a K step of ``BLOCK_S x BLOCK_K`` for the forward, a row step for the backward); and the parts of
    ``--parts dropout`` (the draw with its bytes, the draw expanded to the per-element mask, ``x`` read) at the
    training forward's tile. Where the dropout's instructions go, between GPU runs."""
    from fast_multilora.kernels import sgemm as kg

    ptr = {n: "*fp32" for n in ("h", "dh", "part_dA", "dropout")}
    ptr.update({n: "*bf16" for n in ("x", "A", "dx")})
    ptr.update({n: "*i32" for n in ("order", "info", "ranks", "offsets", "indptr", "seg_slot")})
    ptr.update(keep_bits="*u8", w_offs="*i64")
    unit = dict(stride_xk=1, stride_ak=1)
    first = len(rows)
    for mode, op in (("none", "shrink"), ("dropout", "shrink_dropout"), ("stored", "shrink_dropout_store")):
        cfg = kc.block_config(op, width=16, family="sgemm", target="h200")
        bs, bk, w, st = cfg["BLOCK_S"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"]
        k = sm90_kernel(kg.sgemm_shrink_kernel, ptr, dict(
            unit, stride_hn=1, STACK=1, HAS_DROPOUT=mode != "none", STORE_MASK=mode == "stored", EVEN_K=True,
            DOT_PRECISION="tf32", W_OFFS=False, BLOCK_S=bs, BLOCK_N=16, BLOCK_K=bk), w, st)
        rows.append({"op": f"sass_shrink_{mode}", "family": "sm90-K2048", "config": [bs, 16, bk, w, st],
                     "us": None, **sass_loop(k)})
    for mode in ("none", "redrawn", "stored"):
        bs, bk, w, st = kb._shrink_r16_tile(mode, 2048, "h200")
        k = sm90_kernel(kb._shrink_bwd_kernel, ptr, dict(
            unit, stride_dxk=1, stride_dhr=1, stride_pak=1, NEED_DX=True, HAS_DROPOUT=mode != "none",
            LOAD_MASK=mode == "stored", HOIST_A=True, EVEN_K=True, DOT_PRECISION="tf32", W_OFFS=False, BLOCK_S=bs,
            BLOCK_K=bk, BLOCK_R=16, DROP_STACK=1), w, st)
        rows.append({"op": f"sass_shrink_bwd_{mode}", "family": "sm90-K2048", "config": [bs, bk, w, st],
                     "us": None, **sass_loop(k)})
    for name, fn, types, consts in (
            ("draw_bytes", _probe_philox, {"out": "*i32"}, dict(EXPAND=False)),
            ("draw_mask", _probe_philox, {"out": "*i32"}, dict(EXPAND=True)),
            ("read_x", _probe_read, {"x": "*bf16", "out": "*fp32"}, {})):  # the training forward's tile, apart
        k = sm90_kernel(fn, types, dict(consts, BLOCK_S=32, BLOCK_K=64), 4, 3)
        rows.append({"op": f"sass_{name}", "family": "sm90", "config": [32, 64, 4, 3], "us": None, **sass_loop(k)})
    for r in rows[first:]:
        print(r["op"], r["config"], f"registers {r['regs']}, main loop {r['loop_instr']} instructions, "
              f"{r['loop_bar']} barriers", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune.json")
    ap.add_argument("--parts", default="profile,layer,shrink,expand,bwd", help="any of profile, layer, shrink, "
                    "expand, bwd (headline shape), skewed (the shrink at 32 adapters, 90 %% on one), "
                    "model, model_expand, model_shrink and model_expand_bwd (the "
                    "training step's shapes), cross_entropy (the loss kernels at a 128256 vocabulary), adamw (the "
                    "optimizer kernel over the scale step's arena at 64 "
                    "adapters), decode (the one-launch decode kernel at the model's projections), dropout (the "
                    "training forward's dropout taken apart: the draw, the mask, x read alone), sass (no GPU: "
                    "the shrink's and its backward's main loop compiled for sm_90, with and without dropout: "
                    "instructions and barriers per iteration)")
    args = ap.parse_args()
    parts = args.parts.split(",")
    rows = []
    out = {"rows": rows}
    t0 = time.time()
    for part, sweep in (("model", sweep_model_shapes), ("model_expand", sweep_model_expand),
                        ("model_shrink", sweep_model_shrink), ("model_expand_bwd", sweep_model_expand_bwd),
                        ("cross_entropy", sweep_cross_entropy), ("adamw", sweep_adamw), ("decode", sweep_decode),
                        ("dropout", sweep_dropout), ("sass", sweep_sass)):
        if part in parts:
            sweep(rows)
            with open(args.out, "w") as f:
                json.dump(out, f)
    if "skewed" in parts:  # the many-adapter shrink: 32 adapters, 90 % of the tokens on one
        for family, grouped in (("chunked", True), ("sgemm", False)):
            case = make_case(A=32, grouped=grouped, skewed=True)
            sweep_shrink(rows, case, family + "-A32-skewed", None)
            sweep_shrink(rows, make_case(A=32, grouped=grouped, skewed=True, dropout=0.05), family + "-A32-skewed", 5)
        with open(args.out, "w") as f:
            json.dump(out, f)
    for family, grouped in (("sgemm", False), ("chunked", True)):
        if not {"profile", "shrink", "expand", "bwd"} & set(parts):
            break
        case = make_case(grouped=grouped)
        if "profile" in parts:
            profile_ops(make_case(grouped=grouped, dropout=0.05), family)
        if "shrink" in parts:
            sweep_shrink(rows, case, family, None)
            sweep_shrink(rows, make_case(grouped=grouped, dropout=0.05), family, 5)
        if "expand" in parts:
            sweep_expand(rows, case, family)
        if "bwd" in parts and family == "sgemm":  # backward regroups both families into the same chunks
            sweep_bwd(rows, case, family)
        print(f"{family} done at {time.time() - t0:.0f}s", flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f)
    if "layer" in parts:
        out["layer_wall_ms"] = profile_layer()
    with open(args.out, "w") as f:
        json.dump(out, f)
    for op in sorted({r["op"] for r in rows}):
        for fam in sorted({r["family"] for r in rows if r["op"] == op}):
            ok = [r for r in rows if r["op"] == op and r["family"] == fam and r["us"] is not None]
            ok.sort(key=lambda r: r["us"])
            if ok:
                print(op, fam, "best:", [(r["config"], round(r["us"], 1)) for r in ok[:4]])


if __name__ == "__main__":
    main()
