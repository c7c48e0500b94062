"""Chunked SGMV family (``segs.perm`` given): one segment per slot, its rows gathered through ``perm``.

Segments are cut into fixed ``BLOCK_M`` chunks, so one giant segment spreads over many programs instead of
serialising. The chunk table (chunk -> segment, first and end logical position) is built on the device from
``segs.indptr`` by one small kernel (``kernels/chunks.py``), no device->host sync; the grid is sized to the
capacity ``cdiv(len(perm), BLOCK_M) + num_segments`` (an upper bound on the chunk count) and spare programs return
at once. Activations are not moved:
each program loads ``perm[chunk]`` and reads/writes those physical rows. The tile bodies are the SGEMM ones
(``sgemm.shrink_tile``/``expand_tile``), so both families share one implementation of the math.

``K``, ``N`` (``STACK*max_rank`` for the shrink, the output dim for the expand), ``MAX_RANK`` and ``STACK`` are
``tl.constexpr``: a model has few distinct values and the kernels get fully specialised loops and masks.
Performance notes are in ``sgemm.py``; the gathered rows stay contiguous along K/N, so loads still coalesce.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import chunks
from .launch import cdiv
from .segments import Segments
from .sgemm import expand_tile, shrink_tile, slot_b, slot_weight


def chunk_table(segs: Segments, block_m: int) -> torch.Tensor:
    """int32 ``[capacity, 3]``: per chunk ``(segment, start, end)`` logical positions (``(-1, 0, 0)`` past the last
    chunk), ``kernels.chunks.chunk_table`` of the segments. Cached in ``segs.cache`` per ``block_m``; one launch,
    no host sync."""
    key = ("sgmv_chunks", block_m)
    table = segs.cache.get(key)
    if table is None:
        capacity = cdiv(segs.perm.numel(), block_m) + segs.num_segments
        table = segs.cache[key] = chunks.chunk_table(segs.indptr, block_m, capacity)[0]
    return table


@triton.jit(do_not_specialize=["seed"])  # a fresh seed per call must not pick new variants
def sgmv_shrink_kernel(
    x, A, h, keep_bits, chunks, seg_slot, perm, ranks, offsets, w_offs, dropout, seed,
    stride_xs, stride_xk, stride_an, stride_ak, stride_hs, stride_hn, stride_ms,
    K: tl.constexpr, N: tl.constexpr, STACK: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_OFFS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[perm[j], :STACK*r] = dropout(x[perm[j]]) @ A_cat[STACK*off : STACK*(off+r)]^T for the chunk's positions j."""
    if seed.dtype.is_ptr():  # a seed in device memory (torch.compile, CUDA graphs): read once per program
        seed = tl.load(seed)
    i_c = tl.program_id(0)
    i_n = tl.program_id(1)
    i_g = tl.load(chunks + i_c * 3)
    if i_g < 0:
        return
    slot = tl.load(seg_slot + i_g)
    if slot < 0:
        return
    n_a = tl.minimum(N, STACK * tl.load(ranks + slot))
    if i_n * BLOCK_N >= n_a:  # also rank 0
        return
    o_m = tl.load(chunks + i_c * 3 + 1) + tl.arange(0, BLOCK_M)  # [BLOCK_M] logical positions
    m_s = o_m < tl.load(chunks + i_c * 3 + 2)
    o_s = tl.load(perm + o_m, mask=m_s, other=0).to(tl.int64)  # [BLOCK_M] physical rows
    p = 0.0
    if HAS_DROPOUT:
        p = tl.load(dropout + slot)
    A_a, w_row0 = slot_weight(A, offsets, w_offs, slot, STACK, W_OFFS)
    shrink_tile(
        x, A_a, h, keep_bits, o_s, m_s, i_n, w_row0, n_a, K, seed, p,
        stride_xs, stride_xk, stride_an, stride_ak, stride_hs, stride_hn, stride_ms,
        HAS_DROPOUT, STORE_MASK, EVEN_K, DOT_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K, STACK if HAS_DROPOUT else 1,
    )


@triton.jit
def sgmv_expand_kernel(
    h, B, y, bias, chunks, seg_slot, perm, ranks, offsets, w_offs, scales, slice_idx, spe,
    stride_hs, stride_hn, stride_bn, stride_br, stride_ys, stride_yn,
    N: tl.constexpr, MAX_RANK: tl.constexpr,
    FP64: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    W_OFFS: tl.constexpr, B_PACKED: tl.constexpr, EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """y[perm[j]] (+)= scale_a * h[perm[j], slice*r : (slice+1)*r] @ B_cat[:, off : off+r]^T for the chunk's j
    (``W_OFFS`` / ``B_PACKED``: the slot's own ``[N, r_a]`` weight, in place or in the store's packed block, whose
    ``EXPERTS > 1`` form holds PEFT's experts weights, ``spe`` virtual slots per expert: see ``sgemm.slot_b``).

    Rows outside every segment (base tokens) are not touched, in write mode too: the launcher fills them first.
    """
    i_c = tl.program_id(0)
    i_n = tl.program_id(1)
    i_g = tl.load(chunks + i_c * 3)
    if i_g < 0:
        return
    slot = tl.load(seg_slot + i_g)
    if slot < 0:
        return
    r_a = tl.load(ranks + slot)  # the slot's rank: also its in-place B weight's row stride
    rank = tl.minimum(MAX_RANK, r_a)
    if rank == 0:
        return
    o_m = tl.load(chunks + i_c * 3 + 1) + tl.arange(0, BLOCK_M)  # [BLOCK_M] logical positions
    m_s = o_m < tl.load(chunks + i_c * 3 + 2)
    o_s = tl.load(perm + o_m, mask=m_s, other=0).to(tl.int64)  # [BLOCK_M] physical rows
    B_a, b_col0, stride_bn_a, stride_br_a = slot_b(
        B, offsets, w_offs, slot, r_a, N, spe, stride_bn, stride_br, W_OFFS, B_PACKED, EXPERTS)
    expand_tile(
        h, B_a, y, bias, o_s, m_s, i_n, slice_idx * rank, b_col0, rank, tl.load(scales + slot), N,
        stride_hs, stride_hn, stride_bn_a, stride_br_a, stride_ys, stride_yn,
        FP64, DOT_PRECISION, ACCUMULATE, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_R,
    )
