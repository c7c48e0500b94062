"""Shrink and expand in one launch for calls of few rows (decode steps): ``y[t] += scale_a * (x[t] A_a^T) B_a^T``.

A dynamic-cache decode step calls every patched layer with one token per row: the two launches of the segmented
path (``forward.lora_shrink`` into ``h``, then ``forward.lora_expand``), the allocation of ``h`` and, for stacked
siblings (q/k/v, gate/up), the concatenation of their A weights are host work on a step that waits on the host.
Here each program takes ``BLOCK_S`` rows (one on the GPU) and an N-tile, reads each row's slot from
``segs.token_slots`` (either family's layout), computes the row's ``h`` (``[rank]``, fp32) over the whole K and adds
its N-tile of the delta to ``y``. Each N-tile of a row recomputes that ``h``: ``rank x K`` multiply-adds and a read
of the slot's A (from L2 after the first tile), cheap while rows are few -- ``DECODE_MAX_ROWS`` bounds the calls the
layer path sends here.

Numerics follow the segmented kernels: the products of x with A rounded to x's dtype are exact in fp32 and summed
in fp32 (fp64 for fp64 operands); ``h`` and B are rounded to ``y``'s dtype when it is 16-bit (the expand's
tensor-core operands), the product scaled and added to ``y`` in fp32, ``y`` stored in its dtype. Rows of base tokens
and rank-0 slots are untouched. Weights: ``A_cat`` / ``B_cat`` or ``SlotWeights`` (read in place), one slice.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .configs import block_config
from .forward import _ACTIVATION_DTYPES, _check_2d, _check_layout, _config_target, _weights
from .launch import Bound, cdiv, launch, next_power_of_2
from .segments import AdapterTable, Segments, packed_b

# rows of x above which the layer path takes the segmented kernels: each N-tile of a row re-reads the slot's A (a
# 2048 x 16 bf16 A is 64 KB), so the redundant work grows with rows x N-tiles
DECODE_MAX_ROWS = 64
# Blocks: the "decode" rows of kernels/configs/<target>.json, by BLOCK_R = next_power_of_2(max_rank)


@triton.jit
def shrink_expand_kernel(
    x, A, B, y, token_slots, ranks, offsets, a_offs, b_offs, scales, S, K, N,
    stride_xs, stride_xk, stride_an, stride_ak, stride_bn, stride_br, stride_ys, stride_yn,
    A_OFFS: tl.constexpr, B_OFFS: tl.constexpr, B_PACKED: tl.constexpr, FP64: tl.constexpr, ROUND: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Rows ``program_id(0)*BLOCK_S ...``, N-tile ``program_id(1)``: ``y[t, tile] += scale_a * (x[t] . A_a^T) .
    B_a[tile]^T``, each row with its own slot ``a`` (its weights gathered per row: ``[BLOCK_S, BLOCK_R, ...]``
    tiles). ``A_OFFS`` / ``B_OFFS``: the slot's own weights read in place (``SlotWeights``; B's row stride its
    rank), else the concatenations at the table's offsets; ``B_PACKED``: B is the adapter store's packed block (the
    slot's ``[N, rank]`` weight contiguous at element ``N * offsets[slot]``)."""
    o_s = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    i_n = tl.program_id(1)
    slot = tl.load(token_slots + o_s, mask=o_s < S, other=-1)
    safe = tl.maximum(slot, 0)
    rank = tl.load(ranks + safe, mask=slot >= 0, other=0)
    m_s = rank > 0  # [BLOCK_S] rows of a live adapter
    if tl.max(m_s.to(tl.int32), axis=0) == 0:
        return
    if FP64:
        acc_t = tl.float64
    else:
        acc_t = tl.float32
    off = tl.load(offsets + safe, mask=m_s, other=0).to(tl.int64)
    if A_OFFS:
        a_off = tl.load(a_offs + safe, mask=m_s, other=0)  # the slot's weight, elements from A
    else:
        a_off = off * stride_an
    o_r = tl.arange(0, BLOCK_R)
    m_r = m_s[:, None] & (o_r[None, :] < rank[:, None])  # [BLOCK_S, BLOCK_R]
    o_k = tl.arange(0, BLOCK_K)
    p_x = x + o_s[:, None] * stride_xs + o_k[None, :] * stride_xk  # [BLOCK_S, BLOCK_K]
    p_a = A + a_off[:, None, None] + o_r[None, :, None] * stride_an + o_k[None, None, :] * stride_ak
    b_acc = tl.zeros([BLOCK_S, BLOCK_R, BLOCK_K], dtype=acc_t)
    for k0 in range(0, K, BLOCK_K):
        m_k = o_k < K - k0
        b_x = tl.load(p_x, mask=m_s[:, None] & m_k[None, :], other=0.0)
        b_a = tl.load(p_a, mask=m_r[:, :, None] & m_k[None, None, :], other=0.0).to(b_x.dtype)  # as the shrink's dot
        b_acc += b_a.to(acc_t) * b_x.to(acc_t)[:, None, :]
        p_x += BLOCK_K * stride_xk
        p_a += BLOCK_K * stride_ak
    b_h = tl.sum(b_acc, axis=2)  # [BLOCK_S, BLOCK_R]
    if B_OFFS:  # [N, rank] contiguous per slot
        b_off = tl.load(b_offs + safe, mask=m_s, other=0)
        s_bn = rank.to(tl.int64)
        s_br = 1
    elif B_PACKED:  # [N, rank] contiguous per slot, back to back in slot order
        b_off = off * N
        s_bn = rank.to(tl.int64)
        s_br = 1
    else:
        b_off = off * stride_br
        s_bn = tl.zeros([BLOCK_S], dtype=tl.int64) + stride_bn
        s_br = stride_br
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_b = B + b_off[:, None, None] + o_n[None, :, None] * s_bn[:, None, None] + o_r[None, None, :] * s_br
    b_b = tl.load(p_b, mask=m_r[:, None, :] & m_n[None, :, None], other=0.0)  # [BLOCK_S, BLOCK_N, BLOCK_R]
    m_y = m_s[:, None] & m_n[None, :]
    p_y = y + o_s[:, None] * stride_ys + o_n[None, :] * stride_yn
    b_y = tl.load(p_y, mask=m_y, other=0.0)
    if ROUND:  # 16-bit y: h and B as the expand's tensor-core operands
        b_h = b_h.to(y.dtype.element_ty).to(acc_t)
        b_b = b_b.to(y.dtype.element_ty)
    delta = tl.sum(b_b.to(acc_t) * b_h[:, None, :], axis=2)  # [BLOCK_S, BLOCK_N]
    scale = tl.load(scales + safe, mask=m_s, other=0.0).to(acc_t)
    tl.store(p_y, (b_y.to(acc_t) + scale[:, None] * delta).to(y.dtype.element_ty), mask=m_y)


def _noop(*tensors) -> None:
    return None


def lora_shrink_expand(x, A_cat, B_cat, segs: Segments, table: AdapterTable, y, *,
                       record: Optional[list] = None) -> torch.Tensor:
    """In place ``y[t] += scale_a * (x[t] @ A_a^T) @ B_a^T`` for every row ``t`` of an adapter slot; returns ``y``.
    Rows of base tokens and rank-0 slots are untouched. One launch, no intermediate ``h``; for calls of few rows
    (``DECODE_MAX_ROWS``). ``segs.token_slots`` must be known (the layouts of ``row_segments`` /
    ``grouped_segments``); weights as ``lora_shrink`` / ``lora_expand`` take them, one slice (no stack, no dropout).
    ``B_cat`` may also be the adapter store's packed block: 1-D ``[N * total_rank]``, slot ``a``'s ``[N, ranks[a]]``
    weight contiguous at element ``N * offsets[a]`` (``store.LayerSlots.b_leaf``), read as it is -- no table, so a
    compiled graph passes the block itself. ``record`` (a list): the call's launch is appended, a callable taking
    ``(x, A, B, y)`` -- the pointer tensors of the weights, as ``launch.Bound`` replays them (a no-op when the call
    launches nothing)."""
    if table.experts != 1:
        raise ValueError(f"lora_shrink_expand: tables of MoE virtual slots (table.experts={table.experts!r}) are not "
                         "supported by the decode kernel; use lora_shrink then lora_expand")
    _check_2d("x", x, getattr(x, "device", None))
    device = x.device
    _check_2d("y", y, device)
    A, a_offs = _weights("A_cat", A_cat, device, 1)
    for name, t in (("x", x), ("y", y)):
        if t.dtype not in _ACTIVATION_DTYPES:
            raise ValueError(f"{name} must be one of {_ACTIVATION_DTYPES}, got {t.dtype}")
    S, K = x.shape
    N = y.shape[1]
    packed = packed_b("B_cat", B_cat, N, table.total_rank, device)
    B, b_offs = (B_cat, None) if packed else _weights("B_cat", B_cat, device, 1)
    _check_layout(segs, table, S, device, 1)
    if y.shape[0] != S:
        raise ValueError(f"y has {y.shape[0]} rows but x has {S}")
    if tuple(A_cat.shape) != (table.total_rank, K):
        raise ValueError(f"A_cat must be [total_rank, K] = [{table.total_rank}, {K}], got {list(A_cat.shape)}")
    if not packed and tuple(B_cat.shape) != (N, table.total_rank):
        raise ValueError(f"B_cat must be [N, total_rank] = [{N}, {table.total_rank}], got {list(B_cat.shape)}")
    ts = segs.token_slots
    if ts is None:
        raise ValueError("lora_shrink_expand needs segs.token_slots (the layouts of row_segments / grouped_segments)")
    if ts.dtype != torch.int32 or ts.device != device or ts.numel() != S:
        raise ValueError(f"segs.token_slots must be int32 [{S}] on {device}, got {ts.dtype} {list(ts.shape)} on "
                         f"{ts.device}")
    if S == 0 or N == 0 or table.max_rank == 0:
        if record is not None:
            record.append(_noop)
        return y
    BLOCK_R = max(16, next_power_of_2(table.max_rank))
    cfg = block_config("decode", width=BLOCK_R, target=_config_target(device))
    BLOCK_S, BLOCK_N, BLOCK_K = cfg["BLOCK_S"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_warps, num_stages = cfg["num_warps"], cfg["num_stages"]
    BLOCK_N = min(BLOCK_N, max(16, next_power_of_2(N)))
    BLOCK_K = min(BLOCK_K, max(16, next_power_of_2(K)))
    fp64 = torch.float64 in (x.dtype, y.dtype)
    args = (x, A, B, y, ts, table.ranks, table.offsets, a_offs if a_offs is not None else table.offsets,
            b_offs if b_offs is not None else table.offsets, table.scales, S, K, N,
            *x.stride(), *A_cat.stride(), *(B_cat.stride() if not packed else (0, 1)), *y.stride())
    meta = dict(A_OFFS=a_offs is not None, B_OFFS=b_offs is not None, B_PACKED=packed, FP64=fp64,
                ROUND=y.dtype in (torch.float16, torch.bfloat16), BLOCK_S=BLOCK_S, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                BLOCK_R=BLOCK_R, num_warps=num_warps, num_stages=num_stages)
    grid = (cdiv(S, BLOCK_S), cdiv(N, BLOCK_N))
    if record is None:
        launch(shrink_expand_kernel, grid, args, meta)
        return y
    bound = Bound(shrink_expand_kernel, grid, args, meta, 4)
    bound(*args[:4])
    record.append(bound)
    return y


__all__ = ["DECODE_MAX_ROWS", "lora_shrink_expand", "shrink_expand_kernel"]
