"""Backward Triton kernels of segmented multi-LoRA and their launchers: ``lora_expand_bwd`` (dh, dB) and
``lora_shrink_bwd`` (dx, dA). Same signatures and semantics as ``fast_multilora.reference`` except dropout: a Philox
``seed`` (or ``None``) instead of a ``keep`` mask. Math and derivations: ``docs/kernels.md``.

Choices (each explained in the doc):

* Token grouping. Both segment families are regrouped once per ``Segments`` (device ops only, no host sync, cached in
  ``segs.cache``): a stable sort of the per-row slot gives slot-grouped physical rows, cut into *chunks* of at most
  ``chunk`` rows of one slot (slot ``-1`` rows form chunks too: they zero ``dx``). Chunk counts are bounded by
  ``S // chunk + n_slots + 1`` whatever the layout, so interleaved SGEMM-family batches cost no more than grouped ones.
* Expand backward (``_expand_bwd_kernel``): one program per (chunk, N-split) reads each ``dy`` tile ONCE for both
  ``dh`` (reduced over its N-range, in registers) and a per-chunk partial ``dB`` (reduced over the chunk's rows). A
  deterministic second pass (``_expand_bwd_finish``) sums the partials in fixed order (chunks of a slot in ascending
  order, N-splits in ascending order); no atomics anywhere. Where the per-chunk partials would cost more than a second
  read of ``dy`` (large ranks, the table's ``fused=False``) the finish pass recomputes ``dB`` from ``dy`` instead.
* Shrink backward (``_shrink_bwd_kernel``): one program per (chunk, K tile, rank tile) loops over the chunk's rows in
  ``BLOCK_S`` steps: reads ``x`` once, writes ``dx`` once (rank-tile 0 program) and accumulates a per-chunk partial
  ``dA`` in registers; ``_shrink_bwd_finish`` sums the partials per slot in fixed order.
* Dropout is fused (``HAS_DROPOUT`` constexpr, compiled away without a seed): the mask is read from the bits the
  forward stored (``keep=``, ``LOAD_MASK``) or regenerated with ``keep_block`` on physical rows exactly as the
  forward shrink draws it; ``1/(1-p)`` is applied after the dot.
* Dtypes: dots run in the activation dtype (``dy`` / ``x``) with an fp32 accumulator; 16-bit tiles of fp32 operands
  (``h``, ``dh``, fp32 weights) are cast down right before ``tl.dot`` (marked ``# cast:``). fp32 uses
  ``input_precision="ieee"``; float64 inputs accumulate in float64 (works in the interpreter, for gradcheck).
* Block sizes are data (``kernels/configs/*.json`` via ``configs.block_config``, keyed by the rank tile), no
  autotuning; under ``TRITON_INTERPRET=1`` small tiles (``interpreter.json``) keep CPU tests fast and exercise
  every path (N-splits, multi-chunk slots, rank tiles, the unfused mode).
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .chunks import chunk_table, chunk_tables, table_level
from .configs import block_config, target_for
from .dropout import check_keep_bits, check_seed, keep_block, unpack_keep
from .launch import CHECK_KEYS, cdiv, checked, launch, mark_checked, next_power_of_2
from .segments import AdapterTable, Segments, expert_args, packed_b, slot_grouping, weight_args
from .sgemm import slot_b, slot_weight

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Block sizes: rows of kernels/configs/<target>.json (configs.block_config), keyed by the rank tile BLOCK_R and, where
# they differ, the dtype (16-bit activations: tensor-core dots; fp32/fp64: FMA dots under input_precision="ieee",
# smaller tiles, else registers spill): "expand_bwd" (BLOCK_R = next_pow2(max_rank); 16-bit rows by N; fused: dB
# from per-chunk partials, unfused: the finish pass recomputes dB from dy), "shrink_bwd" / "shrink_bwd_da" (dx
# needed / dA alone; BLOCK_R = min(next_pow2(stack*max_rank), _SHRINK_MAX_R)), "shrink_bwd_r16" (the training
# step's case, by the dropout mask's source and K; GPU files only).


def _config_target(device) -> str:
    return target_for(device, interpret=_INTERPRET)


def _shrink_r16_tile(mode: str, K: int, target: Optional[str] = None) -> tuple:
    """``(BLOCK_S, BLOCK_K, num_warps, num_stages)`` of the ``shrink_bwd_r16`` row of ``mode`` for ``K``."""
    cfg = block_config("shrink_bwd_r16", width=K, mode=mode, target=target)
    return cfg["BLOCK_S"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"]


_SHRINK_MAX_R = 128
_SHRINK_MIN_SUB = 1  # row blocks per shrink program, at least
# Finish passes (sums of partials): elements per tile BLOCK_R * BLOCK_N (or BLOCK_K).
_FINISH_TILE = 2048
# Programs aimed for per streaming multiprocessor when picking N-splits (expand) and chunk length (shrink; the
# dA-only shrink backward takes its own).
_PROGRAMS_PER_SM = 2
_DA_PROGRAMS_PER_SM = 4

if _INTERPRET:  # fast on CPU, and small test shapes still hit splits and multi-chunk slots (blocks: interpreter.json)
    _SHRINK_MAX_R = 32
    _SHRINK_MIN_SUB = 2  # the row loop runs more than once
    _FINISH_TILE = 1024


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _target_programs(device: torch.device, per_sm: Optional[int] = None) -> int:
    if device.type == "cuda":
        return (per_sm or _PROGRAMS_PER_SM) * _sm_count(device)
    return 8  # interpreter / CPU: a handful, so splits are exercised


def _block_r(n: int) -> int:
    return max(16, next_power_of_2(max(n, 1)))


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


# ----------------------------------------------------------------------------------------------------------------
# Token grouping (host launcher side, device ops only)
# ----------------------------------------------------------------------------------------------------------------


def _grouping(segs: Segments, n_slots: int):
    """``(order, bounds)``: physical rows stable-sorted by slot (int32 ``[S]``), and ``bounds`` (int64
    ``[n_slots + 2]``) where rows of slot ``a`` are ``order[bounds[a+1]:bounds[a+2]]`` (slot -1 first)."""
    key = ("bwd_grouping", n_slots)
    hit = segs.cache.get(key)
    if hit is not None:
        return hit
    if segs.grouping is not None and segs.grouping[1].numel() == n_slots + 2:  # built with the layout
        return segs.grouping
    dev, S, n_seg = segs.slot.device, segs.num_tokens, segs.num_segments
    ts = torch.full((S,), -1, dtype=torch.int64, device=dev)
    n_pos = segs.perm.numel() if segs.perm is not None else S  # logical positions (identity family covers all S)
    if n_pos > 0 and n_seg > 0:
        j = torch.arange(n_pos, device=dev)
        seg = torch.searchsorted(segs.indptr[1:].long(), j, right=True).clamp_(max=n_seg - 1)
        rows = segs.perm.long() if segs.perm is not None else j
        ts[rows] = segs.slot.long()[seg]
    ts = torch.where(ts < n_slots, ts, -1)  # defensive: out-of-table slots behave as base tokens
    hit = slot_grouping(ts, n_slots)
    segs.cache[key] = hit
    return hit


def _chunks(segs: Segments, n_slots: int, chunk: int):
    """``(info, cptr, order, capacity)``: per chunk int32 ``info[c] = (slot, start, end)`` (logical positions into
    ``order``; unused capacity has slot -1 and no rows), and ``cptr`` (int32 ``[n_slots + 2]``): chunks of slot
    ``a`` are ``cptr[a+1] .. cptr[a+2]``, in ascending row order: slices of the layout's ``chunk_tables`` where it
    has them (:func:`with_tables`), else built (one launch). Cached per ``(n_slots, chunk)``."""
    key = ("bwd_chunks", n_slots, chunk)
    hit = segs.cache.get(key)
    if hit is not None:
        return hit
    capacity = segs.num_tokens // chunk + n_slots + 1  # >= sum of ceil(len / chunk) over the n_slots + 1 groups
    tables = segs.chunk_tables
    level = None
    if tables is not None and tables[1].shape[1] == n_slots + 2:  # built with the layout (with_tables)
        level = table_level(chunk, tables[1].shape[0])
    if level is not None:
        hit = (tables[0][level], tables[1][level], segs.grouping[0], capacity)  # (rows past capacity unread)
    else:
        order, bounds = _grouping(segs, n_slots)
        info, cptr = chunk_table(bounds, chunk, capacity, first_id=-1)  # groups: slot -1 first
        hit = (info, cptr, order, capacity)
    segs.cache[key] = hit
    return hit


def with_tables(segs: Segments) -> Segments:
    """``segs`` with its backward chunk tables (``Segments.chunk_tables``) for every chunk length the launchers may
    take, built from its row grouping in one launch (``chunks.chunk_tables``): for a layout built once per forward
    call whose layer calls cannot share a cache (``fast_multilora.ops``: every custom-op call under
    ``torch.compile``), each backward call then slices its tables out of them. A layout without a grouping is
    returned as it is."""
    if segs.grouping is None or segs.chunk_tables is not None:
        return segs
    return segs._replace(chunk_tables=chunk_tables(segs.grouping[1], segs.num_tokens, first_id=-1))


# ----------------------------------------------------------------------------------------------------------------
# Expand backward: dh = scale * dy @ B_a, dB_a = scale * dy^T @ h
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _expand_bwd_kernel(
    dy, h, B, dh, part_dh, part_dB, order, info, ranks, offsets, w_offs, scales,
    N, slice_idx, tiles_per_split, spe,
    stride_dys, stride_dyn, stride_hs, stride_hr, stride_bn, stride_br, stride_dhs, stride_dhr,
    stride_pds, stride_pdt, stride_pdr, stride_pbc, stride_pbn, stride_pbr,
    DIRECT_DH: tl.constexpr, STORE_DB: tl.constexpr, EVEN_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    W_OFFS: tl.constexpr, B_PACKED: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """dh[t, s*r+i] (+)= c * dy[t, n-range] . B[n-range, off+i];  part_dB[chunk, n, i] = sum_t dy[t, n] h[t, s*r+i].

    ``W_OFFS`` / ``B_PACKED``: the slot's own ``[N, r_a]`` weight, in place or in the store's packed block, row stride
    its rank ``r_a``; ``EXPERTS > 1``: a packed block of PEFT's experts weights, ``spe`` slots per expert
    (``sgemm.slot_b``)."""
    i_c = tl.program_id(0).to(tl.int64)
    i_p = tl.program_id(1).to(tl.int64)
    slot = tl.load(info + i_c * 3)
    if slot < 0:
        return
    rank = tl.load(ranks + slot)
    if rank == 0:
        return
    start = tl.load(info + i_c * 3 + 1).to(tl.int64)
    end = tl.load(info + i_c * 3 + 2)
    B_a, b_col0, stride_bn_a, stride_br_a = slot_b(
        B, offsets, w_offs, slot, rank, N, spe, stride_bn, stride_br, W_OFFS, B_PACKED, EXPERTS)
    col0 = slice_idx * rank  # this slice's first column of h / dh

    o_s = start + tl.arange(0, BLOCK_S)  # logical positions
    m_s = o_s < end
    o_t = tl.load(order + o_s, mask=m_s, other=0).to(tl.int64)  # physical rows
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < rank
    m_sr = m_s[:, None] & m_r[None, :]
    p_h = h + o_t[:, None] * stride_hs + (col0 + o_r)[None, :] * stride_hr
    b_h = tl.load(p_h, mask=m_sr, other=0.0).to(dy.dtype.element_ty)  # [BLOCK_S, BLOCK_R]  cast: dot dtype
    b_dh = tl.zeros([BLOCK_S, BLOCK_R], dtype=dh.dtype.element_ty)  # fp32 (fp64 for fp64 dy)

    t0 = i_p * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(N, BLOCK_N))
    for i_n in range(t0, t1):
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < N
        p_dy = dy + o_t[:, None] * stride_dys + o_n[None, :] * stride_dyn
        if EVEN_N:
            b_dy = tl.load(p_dy, mask=m_s[:, None], other=0.0)  # [BLOCK_S, BLOCK_N]
        else:
            b_dy = tl.load(p_dy, mask=m_s[:, None] & m_n[None, :], other=0.0)
        p_b = B_a + o_n[:, None] * stride_bn_a + (b_col0 + o_r)[None, :] * stride_br_a
        b_b = tl.load(p_b, mask=m_n[:, None] & m_r[None, :], other=0.0).to(b_dy.dtype)  # [BLOCK_N, BLOCK_R]  cast
        b_dh += tl.dot(b_dy, b_b, input_precision=DOT_PRECISION, out_dtype=b_dh.dtype)
        if STORE_DB:
            b_db = tl.dot(tl.trans(b_dy), b_h, input_precision=DOT_PRECISION, out_dtype=b_dh.dtype)  # [BLOCK_N, R]
            p_pb = part_dB + i_c * stride_pbc + o_n[:, None] * stride_pbn + o_r[None, :] * stride_pbr
            tl.store(p_pb, b_db, mask=m_n[:, None] & m_r[None, :])
    if DIRECT_DH:
        scale = tl.load(scales + slot).to(b_dh.dtype)
        p_dh = dh + o_t[:, None] * stride_dhs + (col0 + o_r)[None, :] * stride_dhr
        tl.store(p_dh, b_dh * scale, mask=m_sr)
    else:
        p_pd = part_dh + i_p * stride_pds + o_s[:, None] * stride_pdt + o_r[None, :] * stride_pdr
        tl.store(p_pd, b_dh, mask=m_sr)


@triton.jit
def _finish_db_tile(
    dy, h, dB, part_dB, order, info, cptr, ranks, offsets, scales, slot, i_n, N, slice_idx, spe,
    stride_dys, stride_dyn, stride_hs, stride_hr, stride_dbn, stride_dbr, stride_pbc, stride_pbn, stride_pbr,
    FROM_PARTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DB_BLOCKED: tl.constexpr,
    EXPERTS: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dB[n, off+i] = c * sum over the slot's chunks (ascending) of part_dB, or of dy[chunk]^T h[chunk] (unfused).

    Summed in h's (float) dtype, stored in dB's. ``DB_BLOCKED``: dB is flat, the slot's ``[N, rank]`` gradient one
    contiguous block at ``off * N`` (a parameter's own layout: no copy after); with ``EXPERTS = E > 1`` the slot of
    expert ``e = slot // spe`` writes the strided columns ``j*E + e`` of its adapter's PEFT weight at
    ``(off - e*rank) * N`` (``segments.packed_b``): the E slots of an adapter interleave, each element stored once.
    ``ACCUMULATE``: dB (+)= the sum, added in h's dtype and rounded once; slots without tokens leave dB as it is."""
    rank = tl.load(ranks + slot)
    c0 = tl.load(cptr + slot + 1).to(tl.int64)  # int64 loop index: partial offsets can pass 2**31
    c1 = tl.load(cptr + slot + 2)
    live = rank > 0
    if ACCUMULATE:
        live = live & (c1 > c0)
    if live:
        off = tl.load(offsets + slot).to(tl.int64)
        scale = tl.load(scales + slot)
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        o_r = tl.arange(0, BLOCK_R)
        m_n = o_n < N
        m_r = o_r < rank
        b_db = tl.zeros([BLOCK_N, BLOCK_R], dtype=h.dtype.element_ty)  # [BLOCK_N, BLOCK_R], fp32 (fp64)
        for i_c in range(c0, c1):  # fixed order: deterministic
            if FROM_PARTS:
                p_pb = part_dB + i_c * stride_pbc + o_n[:, None] * stride_pbn + o_r[None, :] * stride_pbr
                b_db += tl.load(p_pb, mask=m_n[:, None] & m_r[None, :], other=0.0)
            else:
                start = tl.load(info + i_c * 3 + 1).to(tl.int64)
                end = tl.load(info + i_c * 3 + 2)
                o_s = start + tl.arange(0, BLOCK_S)
                m_s = o_s < end
                o_t = tl.load(order + o_s, mask=m_s, other=0).to(tl.int64)
                p_dy = dy + o_t[:, None] * stride_dys + o_n[None, :] * stride_dyn
                b_dy = tl.load(p_dy, mask=m_s[:, None] & m_n[None, :], other=0.0)  # [BLOCK_S, BLOCK_N]
                p_h = h + o_t[:, None] * stride_hs + (slice_idx * rank + o_r)[None, :] * stride_hr
                b_h = tl.load(p_h, mask=m_s[:, None] & m_r[None, :], other=0.0).to(b_dy.dtype)  # cast: dot dtype
                b_db += tl.dot(tl.trans(b_dy), b_h, input_precision=DOT_PRECISION, out_dtype=b_db.dtype)
        if DB_BLOCKED:
            if EXPERTS > 1:
                e = slot // spe
                p_db = dB + (off - e * rank) * N + e + o_n[:, None] * (rank * EXPERTS) + o_r[None, :] * EXPERTS
            else:
                p_db = dB + off * N + o_n[:, None] * rank + o_r[None, :]
        else:
            p_db = dB + o_n[:, None] * stride_dbn + (off + o_r)[None, :] * stride_dbr
        b_db = b_db * scale.to(b_db.dtype)
        if ACCUMULATE:
            b_db += tl.load(p_db, mask=m_n[:, None] & m_r[None, :], other=0.0).to(b_db.dtype)
        tl.store(p_db, b_db.to(dB.dtype.element_ty), mask=m_n[:, None] & m_r[None, :])


@triton.jit
def _finish_dh_chunk(
    dh, part_dh, order, info, ranks, scales, i_c, slice_idx, n_splits,
    stride_dhs, stride_dhr, stride_pds, stride_pdt, stride_pdr,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """dh[t, s*r+i] = c * sum over N-splits (ascending) of part_dh[split, t, i] for the chunk's rows."""
    slot = tl.load(info + i_c * 3)
    rank = tl.load(ranks + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    if rank > 0:
        scale = tl.load(scales + slot)
        start = tl.load(info + i_c * 3 + 1).to(tl.int64)
        end = tl.load(info + i_c * 3 + 2)
        o_s = start + tl.arange(0, BLOCK_S)
        o_r = tl.arange(0, BLOCK_R)
        m_s = o_s < end
        o_t = tl.load(order + o_s, mask=m_s, other=0).to(tl.int64)
        m_sr = m_s[:, None] & (o_r < rank)[None, :]
        b_dh = tl.zeros([BLOCK_S, BLOCK_R], dtype=dh.dtype.element_ty)  # [BLOCK_S, BLOCK_R]
        p_pd = part_dh + o_s[:, None] * stride_pdt + o_r[None, :] * stride_pdr
        for _ in range(0, n_splits):  # fixed order: deterministic
            b_dh += tl.load(p_pd, mask=m_sr, other=0.0)
            p_pd += stride_pds
        p_dh = dh + o_t[:, None] * stride_dhs + (slice_idx * rank + o_r)[None, :] * stride_dhr
        tl.store(p_dh, b_dh * scale.to(b_dh.dtype), mask=m_sr)


@triton.jit
def _expand_bwd_finish(
    dy, h, dB, dh, part_dh, part_dB, order, info, cptr, ranks, offsets, scales,
    N, slice_idx, n_splits, n_db_programs, tiles_n, spe,
    stride_dys, stride_dyn, stride_hs, stride_hr, stride_dbn, stride_dbr, stride_dhs, stride_dhr,
    stride_pds, stride_pdt, stride_pdr, stride_pbc, stride_pbn, stride_pbr,
    FROM_PARTS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DB_BLOCKED: tl.constexpr,
    EXPERTS: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Programs [0, n_db_programs): dB tiles (slot, N tile), every column written (``ACCUMULATE``: added to, those of
    slots with tokens); the rest: dh rows of one chunk."""
    i_g = tl.program_id(0).to(tl.int64)
    if i_g < n_db_programs:
        _finish_db_tile(
            dy, h, dB, part_dB, order, info, cptr, ranks, offsets, scales, i_g // tiles_n, i_g % tiles_n, N, slice_idx,
            spe, stride_dys, stride_dyn, stride_hs, stride_hr, stride_dbn, stride_dbr, stride_pbc, stride_pbn,
            stride_pbr, FROM_PARTS, DOT_PRECISION, BLOCK_S, BLOCK_N, BLOCK_R, DB_BLOCKED, EXPERTS, ACCUMULATE,
        )
    else:
        _finish_dh_chunk(
            dh, part_dh, order, info, ranks, scales, i_g - n_db_programs, slice_idx, n_splits,
            stride_dhs, stride_dhr, stride_pds, stride_pdt, stride_pdr, BLOCK_S, BLOCK_R,
        )


# ----------------------------------------------------------------------------------------------------------------
# Shrink backward: dx = keep/(1-p) * dh @ A_a, dA_a = dh^T @ x~
# ----------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["seed"])  # a fresh seed per step must not compile new variants
def _shrink_bwd_kernel(
    dh, x, A, dx, part_dA, keep_bits, order, info, ranks, offsets, w_offs, dropout, seed,
    K, stack_num,
    stride_dhs, stride_dhr, stride_xs, stride_xk, stride_ar, stride_ak, stride_dxs, stride_dxk,
    stride_pac, stride_par, stride_pak, stride_ms,
    NEED_DX: tl.constexpr, HAS_DROPOUT: tl.constexpr, LOAD_MASK: tl.constexpr, HOIST_A: tl.constexpr,
    EVEN_K: tl.constexpr, W_OFFS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    DROP_STACK: tl.constexpr,
):
    """dx[t, k] = keep/(1-p) * dh[t, :R] . A[rows, k];  part_dA[chunk, j, k] = sum_t dh[t, j] x[t, k] keep/(1-p).

    ``DROP_STACK > 1`` (dropout on a stack of that many slices): column ``j`` of dh (row of A) belongs to slice
    ``j // rank``, whose own mask (key ``slice_seed(seed, s)``) multiplies that slice's terms of dx and dA.
    ``LOAD_MASK`` (``DROP_STACK == 1``): the mask is read from the forward's packed ``keep_bits`` instead of drawn.
    ``W_OFFS`` (``stack_num == 1``): the slot's own A weight, read in place (``sgemm.slot_weight``).
    """
    if seed.dtype.is_ptr():  # a seed in device memory (torch.compile, CUDA graphs): read once per program
        seed = tl.load(seed)
    i_c = tl.program_id(0).to(tl.int64)
    i_k = tl.program_id(1).to(tl.int64)
    i_r = tl.program_id(2).to(tl.int64)
    slot = tl.load(info + i_c * 3)
    start = tl.load(info + i_c * 3 + 1).to(tl.int64)
    end = tl.load(info + i_c * 3 + 2)
    rank = tl.load(ranks + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_k = o_k < K
    if (slot < 0) | (rank == 0):  # base tokens / absent adapter: dx rows are zero
        if NEED_DX:
            if i_r == 0:
                for s0 in range(start, end, BLOCK_S):
                    o_s = s0 + tl.arange(0, BLOCK_S)
                    m_s = o_s < end
                    o_t = tl.load(order + o_s, mask=m_s, other=0).to(tl.int64)
                    p_dx = dx + o_t[:, None] * stride_dxs + o_k[None, :] * stride_dxk
                    tl.store(p_dx, tl.zeros([BLOCK_S, BLOCK_K], dtype=dx.dtype.element_ty),
                             mask=m_s[:, None] & m_k[None, :])
        return
    n_r = stack_num * rank  # rows of A_cat / columns of dh owned by the slot
    if i_r * BLOCK_R >= n_r:
        return
    A, row0 = slot_weight(A, offsets, w_offs, slot, stack_num, W_OFFS)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    m_r = o_r < n_r
    if HOIST_A:  # one rank tile, 16-bit dots: A's tile stays in registers across the row loop
        p_a = A + (row0 + o_r)[:, None] * stride_ar + o_k[None, :] * stride_ak
        b_a = tl.load(p_a, mask=m_r[:, None] & m_k[None, :], other=0.0).to(x.dtype.element_ty)  # [BLOCK_R, BLOCK_K]
    b_da = tl.zeros([BLOCK_R, BLOCK_K], dtype=part_dA.dtype.element_ty)  # fp32 (fp64 for fp64 x)
    if HAS_DROPOUT:
        p_drop = tl.load(dropout + slot)
        inv_keep = 1.0 / (1.0 - p_drop.to(b_da.dtype))

    if DROP_STACK > 1:
        r_slice = o_r // rank  # [BLOCK_R] slice of each dh column / A row of this rank tile
    for s0 in range(start, end, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < end
        o_t = tl.load(order + o_s, mask=m_s, other=0).to(tl.int64)  # physical rows
        p_x = x + o_t[:, None] * stride_xs + o_k[None, :] * stride_xk
        if EVEN_K:
            b_x = tl.load(p_x, mask=m_s[:, None], other=0.0)  # [BLOCK_S, BLOCK_K]
        else:
            b_x = tl.load(p_x, mask=m_s[:, None] & m_k[None, :], other=0.0)
        if DROP_STACK > 1:
            p_dh = dh + o_t[:, None] * stride_dhs + o_r[None, :] * stride_dhr
            b_dh = tl.load(p_dh, mask=m_s[:, None] & m_r[None, :], other=0.0).to(x.dtype.element_ty)
            b_dx = tl.zeros([BLOCK_S, BLOCK_K], dtype=b_da.dtype)
            for sl in tl.static_range(DROP_STACK):
                b_keep = keep_block(seed ^ (sl * 16777216), o_t, o_k, K, p_drop).to(b_x.dtype)
                b_dh_s = tl.where((r_slice == sl)[None, :], b_dh, 0.0)  # this slice's columns only
                b_da += tl.dot(tl.trans(b_dh_s), b_x * b_keep, input_precision=DOT_PRECISION, out_dtype=b_da.dtype)
                if NEED_DX:
                    if i_r == 0:
                        if HOIST_A:
                            b_dx_s = tl.dot(b_dh_s, b_a, input_precision=DOT_PRECISION, out_dtype=b_da.dtype)
                        else:  # every rank tile's columns of this slice, A re-read from cache
                            b_dx_s = tl.zeros([BLOCK_S, BLOCK_K], dtype=b_da.dtype)
                            for r0 in range(0, n_r, BLOCK_R):
                                o_j = r0 + tl.arange(0, BLOCK_R)
                                m_j = (o_j < n_r) & (o_j // rank == sl)
                                p_dhj = dh + o_t[:, None] * stride_dhs + o_j[None, :] * stride_dhr
                                b_dhj = tl.load(p_dhj, mask=m_s[:, None] & m_j[None, :], other=0.0)
                                p_aj = A + (row0 + o_j)[:, None] * stride_ar + o_k[None, :] * stride_ak
                                b_aj = tl.load(p_aj, mask=m_j[:, None] & m_k[None, :], other=0.0)
                                b_dx_s += tl.dot(b_dhj.to(x.dtype.element_ty), b_aj.to(x.dtype.element_ty),
                                                 input_precision=DOT_PRECISION, out_dtype=b_da.dtype)
                        b_dx += b_dx_s * b_keep.to(b_dx.dtype)
            if NEED_DX:
                if i_r == 0:
                    p_dx = dx + o_t[:, None] * stride_dxs + o_k[None, :] * stride_dxk
                    # a new name: Triton keeps a variable's type across an if (b_dx is fp32 outside)
                    b_out = (b_dx * inv_keep).to(dx.dtype.element_ty)
                    tl.store(p_dx, b_out, mask=m_s[:, None] & m_k[None, :])
        else:
            if HAS_DROPOUT:
                if LOAD_MASK:  # the forward's draw, packed: [BLOCK_S, BLOCK_K // 8] bytes
                    o_b = i_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
                    p_m = keep_bits + o_t[:, None] * stride_ms + o_b[None, :]
                    b_bits = tl.load(p_m, mask=m_s[:, None] & (o_b < (K + 7) // 8)[None, :], other=0)
                    b_keep = unpack_keep(b_bits, BLOCK_K)
                    b_x = tl.where(b_keep, b_x, 0.0)
                else:
                    # the forward's draw regenerated, [BLOCK_S, BLOCK_K]; 0/1 in x's dtype, not a bool: it crosses
                    # into the dot layout for dx, and i1 cannot live in shared memory
                    b_keep = keep_block(seed, o_t, o_k, K, p_drop).to(b_x.dtype)
                    b_x = b_x * b_keep
            p_dh = dh + o_t[:, None] * stride_dhs + o_r[None, :] * stride_dhr
            # [BLOCK_S, BLOCK_R]
            b_dh = tl.load(p_dh, mask=m_s[:, None] & m_r[None, :], other=0.0).to(x.dtype.element_ty)
            b_da += tl.dot(tl.trans(b_dh), b_x, input_precision=DOT_PRECISION, out_dtype=b_da.dtype)
            if NEED_DX:
                if i_r == 0:
                    if HOIST_A:
                        # [BLOCK_S, BLOCK_K]
                        b_dx = tl.dot(b_dh, b_a, input_precision=DOT_PRECISION, out_dtype=b_da.dtype)
                    else:  # all rank tiles (summed in order by this rank-tile-0 program), A re-read from cache
                        b_dx = tl.zeros([BLOCK_S, BLOCK_K], dtype=b_da.dtype)
                        for r0 in range(0, n_r, BLOCK_R):
                            o_j = r0 + tl.arange(0, BLOCK_R)
                            m_j = o_j < n_r
                            p_dhj = dh + o_t[:, None] * stride_dhs + o_j[None, :] * stride_dhr
                            b_dhj = tl.load(p_dhj, mask=m_s[:, None] & m_j[None, :],
                                            other=0.0).to(x.dtype.element_ty)
                            p_aj = A + (row0 + o_j)[:, None] * stride_ar + o_k[None, :] * stride_ak
                            b_aj = tl.load(p_aj, mask=m_j[:, None] & m_k[None, :],
                                           other=0.0).to(x.dtype.element_ty)
                            b_dx += tl.dot(b_dhj, b_aj, input_precision=DOT_PRECISION, out_dtype=b_da.dtype)
                    if LOAD_MASK:  # scaled before the rounding, masked after it
                        b_dx = tl.where(b_keep, (b_dx * inv_keep).to(dx.dtype.element_ty), 0.0)
                    elif HAS_DROPOUT:
                        b_dx = (b_dx * (b_keep.to(b_dx.dtype) * inv_keep)).to(dx.dtype.element_ty)
                    else:
                        b_dx = b_dx.to(dx.dtype.element_ty)
                    p_dx = dx + o_t[:, None] * stride_dxs + o_k[None, :] * stride_dxk
                    tl.store(p_dx, b_dx, mask=m_s[:, None] & m_k[None, :])
    if HAS_DROPOUT:
        b_da = b_da * inv_keep
    p_pa = part_dA + i_c * stride_pac + o_r[:, None] * stride_par + o_k[None, :] * stride_pak
    tl.store(p_pa, b_da, mask=m_r[:, None] & m_k[None, :])


@triton.jit
def _shrink_bwd_finish(
    dA, part_dA, cptr, ranks, offsets,
    K, stack_num,
    stride_dar, stride_dak, stride_pac, stride_par, stride_pak,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """dA[stack*off + j, k] = sum over the slot's chunks (ascending) of part_dA[chunk, j, k]; zero without tokens.
    Summed in the partials' dtype, stored in dA's. ``ACCUMULATE``: dA (+)= the sum (added in the partials' dtype,
    rounded once); slots without tokens leave dA as it is."""
    i_a = tl.program_id(0).to(tl.int64)
    i_r = tl.program_id(1).to(tl.int64)
    i_k = tl.program_id(2).to(tl.int64)
    n_r = stack_num * tl.load(ranks + i_a)
    if i_r * BLOCK_R >= n_r:
        return
    c0 = tl.load(cptr + i_a + 1).to(tl.int64)  # int64 loop index: partial offsets can pass 2**31
    c1 = tl.load(cptr + i_a + 2)
    if ACCUMULATE:
        if c1 == c0:
            return
    row0 = stack_num * tl.load(offsets + i_a).to(tl.int64)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_rk = (o_r < n_r)[:, None] & (o_k < K)[None, :]
    b_da = tl.zeros([BLOCK_R, BLOCK_K], dtype=part_dA.dtype.element_ty)
    for i_c in range(c0, c1):
        p_pa = part_dA + i_c * stride_pac + o_r[:, None] * stride_par + o_k[None, :] * stride_pak
        b_da += tl.load(p_pa, mask=m_rk, other=0.0)
    p_da = dA + (row0 + o_r)[:, None] * stride_dar + o_k[None, :] * stride_dak
    if ACCUMULATE:
        b_da += tl.load(p_da, mask=m_rk, other=0.0).to(b_da.dtype)
    tl.store(p_da, b_da.to(dA.dtype.element_ty), mask=m_rk)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------

_ACT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _grad_dtypes(acc: torch.dtype) -> tuple:
    """dtypes a weight gradient may be written in: the accumulation dtype, or (float32 accumulation) a 16-bit one
    -- the finish kernels sum in the accumulation dtype and round once as they store."""
    return (acc,) if acc == torch.float64 else (torch.float32, torch.bfloat16, torch.float16)


def _check(cond: bool, msg: str):
    if not cond:
        raise ValueError(msg)


def _check_common(name: str, act: torch.Tensor, segs: Segments, table: AdapterTable, stack_num: int):
    # cheap tests first; the messages are formatted only on failure (this runs twice per layer backward)
    if not (act.dim() == 2 and act.dtype in _ACT_DTYPES and act.shape[0] == segs.num_tokens and stack_num >= 1):
        _check(act.dim() == 2, f"{name}: expected a 2-D activation, got shape {tuple(act.shape)}")
        _check(act.dtype in _ACT_DTYPES, f"{name}: activation dtype {act.dtype} not in {_ACT_DTYPES}")
        _check(act.shape[0] == segs.num_tokens, f"{name}: {act.shape[0]} rows but segs.num_tokens={segs.num_tokens}")
        _check(stack_num >= 1, f"{name}: stack_num must be >= 1, got {stack_num}")
    dev = act.device
    if checked(segs, table, (CHECK_KEYS[1], dev)):  # the checks below run once per (segments, kind of table)
        return
    for t_name, t in (("segs.indptr", segs.indptr), ("segs.slot", segs.slot), ("segs.perm", segs.perm),
                      ("table.ranks", table.ranks), ("table.offsets", table.offsets), ("table.scales", table.scales),
                      ("table.dropout", table.dropout)):
        if t is not None:
            _check(t.device == dev, f"{name}: {t_name} is on {t.device}, activations on {dev}")
    n_slots = table.ranks.numel()
    _check(table.offsets.numel() == n_slots and table.scales.numel() == n_slots and table.dropout.numel() == n_slots,
           f"{name}: table.ranks/offsets/scales/dropout must all have n_slots={n_slots} entries")
    for t_name, t in (("table.ranks", table.ranks), ("table.offsets", table.offsets)):
        _check(t.dtype in (torch.int32, torch.int64), f"{name}: {t_name} must be an integer tensor, got {t.dtype}")
    if table.max_rank > 512:
        raise ValueError(f"{name}: max_rank={table.max_rank} > 512 is not supported by the backward kernels")
    mark_checked(segs, table, (CHECK_KEYS[1], dev))


def _check_tensor(name: str, what: str, t: torch.Tensor, shape, dtypes, device):
    if t.shape == shape and t.dtype in dtypes and t.device == device:  # messages formatted only on failure
        return
    _check(tuple(t.shape) == tuple(shape), f"{name}: {what} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    _check(t.dtype in dtypes, f"{name}: {what} dtype {t.dtype} not in {tuple(dtypes)}")
    _check(t.device == device, f"{name}: {what} is on {t.device}, activations on {device}")


def _weights(name: str, what: str, w, shape, dtypes, device, stack_num: int) -> tuple:
    """``segments.weight_args`` of a launcher's weight, checked against the concatenation's ``shape`` (a
    ``SlotWeights`` stands for it) and ``dtypes``."""
    t, w_offs = weight_args(f"{name}: {what}", w, device, stack_num)
    if w_offs is None:
        _check_tensor(name, what, t, shape, dtypes, device)
        return t, None
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{name}: {what} must stand for shape {tuple(shape)}, got {w.shape}")
    _check_tensor(name, f"{what}.base", t, t.shape, dtypes, device)
    return t, w_offs


def lora_expand_bwd(dy, h, B_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, slice_idx: int = 0,
                    dh: Optional[torch.Tensor] = None, dB_out: Optional[torch.Tensor] = None,
                    dB_blocked: Optional[bool] = None, accumulate_dB: bool = False):
    """Returns ``(dh, dB_cat)``: ``dh`` float32 ``[S, stack_num*max_rank]`` (only this slice's columns of adapter
    tokens written; a given ``dh`` is filled in place) and ``dB_cat`` float32 ``[N, total_rank]`` (every column
    written, zero for slots without tokens). float64 ``dy`` gives float64 outputs. ``B_cat`` may be the store's
    packed block (1-D, ``segments.packed_b``).

    ``dB_blocked``: ``dB_cat`` is flat ``[total_rank * N]`` instead, slot ``a``'s ``[N, r_a]`` gradient the contiguous
    block at ``offsets[a] * N`` (each adapter's ``lora_B`` weight layout, and the packed block's); ``None``: blocked
    when ``B_cat`` is packed (the gradient in its weight's layout). With ``table.experts > 1`` the packed block and
    a blocked ``dB_cat`` are in PEFT's experts layout (``segments.packed_b``), whatever form ``B_cat`` has; the
    ``[N, total_rank]`` ``dB_cat`` stays expert-major, as a 2-D ``B_cat`` is. A given ``dB_out`` may be bfloat16 or
    float16 (for float32 accumulation): the sums are rounded once, as they are stored. ``accumulate_dB``: the given
    ``dB_out`` (+)= the gradients of the slots with tokens (added in float32, rounded once), the others' left as they
    are (an adapter store's gradient arena: no work for the adapters outside the batch)."""
    name = "lora_expand_bwd"
    _check_common(name, dy, segs, table, stack_num)
    if not 0 <= slice_idx < stack_num:
        raise ValueError(f"{name}: slice_idx={slice_idx} outside [0, stack_num={stack_num})")
    S, N = dy.shape
    dev, acc = dy.device, _acc_dtype(dy.dtype)
    n_slots, R, R_tot = table.ranks.numel(), table.max_rank, table.total_rank
    _check_tensor(name, "h", h, (S, stack_num * R), (torch.float32, torch.float64), dev)
    # B in any float dtype: the kernel casts its tiles to dy's (fp32 activations with 16-bit adapters: PEFT casts the
    # input to the adapters' dtype and the delta back, so dy is fp32 while B is 16-bit)
    packed = packed_b(f"{name}: B_cat", B_cat, N, R_tot, dev)
    B, w_offs = (B_cat, None) if packed else _weights(name, "B_cat", B_cat, (N, R_tot), _ACT_DTYPES, dev, 1)
    if packed:
        _check_tensor(name, "B_cat", B, B.shape, _ACT_DTYPES, dev)
    if dB_blocked is None:
        dB_blocked = packed
    experts = expert_args(name, table)  # (E, spe): the packed layout's addressing only
    b_experts, db_experts = experts if packed else (1, 1), experts if dB_blocked else (1, 1)
    if dh is None:
        dh = torch.zeros(S, stack_num * R, dtype=acc, device=dev)
    _check_tensor(name, "dh", dh, (S, stack_num * R), (acc,), dev)
    db_shape = (R_tot * N,) if dB_blocked else (N, R_tot)
    if accumulate_dB and dB_out is None:
        raise ValueError(f"{name}: accumulate_dB needs dB_out (the tensor the gradients are added to)")
    if dB_out is None:
        dB_out = torch.empty(db_shape, dtype=acc, device=dev)
    _check_tensor(name, "dB_out", dB_out, db_shape, _grad_dtypes(acc), dev)
    _check(not dB_blocked or dB_out.is_contiguous(), f"{name}: a blocked dB_out must be contiguous")
    if N == 0 or R_tot == 0 or n_slots == 0:
        return dh, (dB_out if accumulate_dB else dB_out.zero_())

    BLOCK_R = _block_r(R)
    cfg = block_config("expand_bwd", width=N, dtype=dy.dtype, rank_tile=BLOCK_R, target=_config_target(dev))
    BLOCK_S, BLOCK_N, num_warps, fused = cfg["BLOCK_S"], cfg["BLOCK_N"], cfg["num_warps"], cfg["fused"]
    info, cptr, order, capacity = _chunks(segs, n_slots, BLOCK_S)
    tiles_n = cdiv(N, BLOCK_N)
    # enough programs to fill the GPU: split N when there are few chunks (dh partials: ~4*splits*r/N of dy's bytes)
    n_splits = min(tiles_n, max(1, cdiv(_target_programs(dev), max(1, cdiv(S, BLOCK_S)))))
    tiles_per_split = cdiv(tiles_n, n_splits)
    n_splits = cdiv(tiles_n, tiles_per_split)
    direct_dh = n_splits == 1
    part_dh = dh if direct_dh else torch.empty(n_splits, S, R, dtype=acc, device=dev)
    part_dB = torch.empty(capacity, N, R, dtype=acc, device=dev) if fused else dB_out
    prec = _dot_precision(dy.dtype)
    pd_strides = part_dh.stride() if not direct_dh else (0, 0, 0)
    pb_strides = part_dB.stride() if fused else (0, 0, 0)
    launch(_expand_bwd_kernel, (capacity, n_splits), (
        dy, h, B, dh, part_dh, part_dB, order, info, table.ranks, table.offsets,
        table.offsets if w_offs is None else w_offs, table.scales,
        N, slice_idx, tiles_per_split, b_experts[1],
        *dy.stride(), *h.stride(), *((0, 1) if packed else B_cat.stride()),
        *dh.stride(), *pd_strides, *pb_strides,
    ), dict(DIRECT_DH=direct_dh, STORE_DB=fused, EVEN_N=N % BLOCK_N == 0, DOT_PRECISION=prec,
            W_OFFS=w_offs is not None, B_PACKED=packed, EXPERTS=b_experts[0], BLOCK_S=BLOCK_S, BLOCK_N=BLOCK_N,
            BLOCK_R=BLOCK_R, num_warps=num_warps))
    BLOCK_NF = min(128, max(16, _FINISH_TILE // BLOCK_R)) if fused else BLOCK_N
    tiles_nf = cdiv(N, BLOCK_NF)
    n_db = n_slots * tiles_nf
    launch(_expand_bwd_finish, (n_db + (0 if direct_dh else capacity),), (
        dy, h, dB_out, dh, part_dh, part_dB, order, info, cptr, table.ranks, table.offsets, table.scales,
        N, slice_idx, n_splits, n_db, tiles_nf, db_experts[1],
        *dy.stride(), *h.stride(), *((0, 0) if dB_blocked else dB_out.stride()),
        *dh.stride(), *pd_strides, *pb_strides,
    ), dict(FROM_PARTS=fused, DOT_PRECISION=prec, BLOCK_S=BLOCK_S, BLOCK_N=BLOCK_NF, BLOCK_R=BLOCK_R,
            DB_BLOCKED=dB_blocked, EXPERTS=db_experts[0], ACCUMULATE=accumulate_dB, num_warps=8))
    return dh, dB_out


def lora_shrink_bwd(dh, x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1,
                    seed=None, need_dx: bool = True, dx_out: Optional[torch.Tensor] = None,
                    dA_out: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                    accumulate_dA: bool = False):
    """Returns ``(dx, dA_cat)``: ``dx`` in ``x``'s dtype, every row written (zero for base tokens, slot -1 and rank
    0; ``None`` unless ``need_dx``) and ``dA_cat`` float32 ``[stack_num*total_rank, K]`` (every row written, zero for
    slots without tokens). ``seed``
    (Philox, or ``None``) regenerates the forward's dropout mask; ``keep``, the packed mask ``lora_shrink(...,
    keep_out=)`` stored for the same seed, is read instead of drawn again. A given ``dA_out`` may be bfloat16 or
    float16 (float32 accumulation): the sums are rounded once, as they are stored. ``accumulate_dA``: the given
    ``dA_out`` (+)= the gradients of the slots with tokens, the others' rows left as they are."""
    name = "lora_shrink_bwd"
    _check_common(name, x, segs, table, stack_num)
    S, K = x.shape
    dev, acc = x.device, _acc_dtype(x.dtype)
    n_slots, R, R_tot = table.ranks.numel(), table.max_rank, table.total_rank
    _check_tensor(name, "dh", dh, (S, stack_num * R), (torch.float32, torch.float64), dev)
    A, w_offs = _weights(name, "A_cat", A_cat, (stack_num * R_tot, K), _ACT_DTYPES, dev, stack_num)  # cast as B
    check_seed(name, seed, dev, stack_num)
    if keep is not None:
        check_keep_bits(name, keep, x, stack_num)
    if not (need_dx or dx_out is None):
        raise ValueError(f"{name}: dx_out given but need_dx=False")
    dx = None
    if need_dx:
        dx = dx_out if dx_out is not None else torch.empty_like(x)
        _check_tensor(name, "dx_out", dx, (S, K), (x.dtype,), dev)
    if accumulate_dA and dA_out is None:
        raise ValueError(f"{name}: accumulate_dA needs dA_out (the tensor the gradients are added to)")
    if dA_out is None:
        dA_out = torch.empty(stack_num * R_tot, K, dtype=acc, device=dev)
    _check_tensor(name, "dA_out", dA_out, (stack_num * R_tot, K), _grad_dtypes(acc), dev)
    if K == 0:
        return dx, dA_out

    BLOCK_R = min(_block_r(stack_num * R), _SHRINK_MAX_R)
    has_dropout = seed is not None and table.has_dropout
    load_mask = has_dropout and keep is not None
    if BLOCK_R == 16 and need_dx and stack_num == 1 and x.element_size() == 2 and not _INTERPRET:
        BLOCK_S, BLOCK_K, num_warps, num_stages = _shrink_r16_tile(
            "stored" if load_mask else "redrawn" if has_dropout else "none", K, _config_target(dev))
    else:
        cfg = block_config("shrink_bwd" if need_dx else "shrink_bwd_da", dtype=x.dtype, rank_tile=BLOCK_R,
                           target=_config_target(dev))
        BLOCK_S, BLOCK_K, num_warps, num_stages = cfg["BLOCK_S"], cfg["BLOCK_K"], cfg["num_warps"], cfg["num_stages"]
    if has_dropout and stack_num > 1 and not _INTERPRET:
        # a mask per slice: the tables' tiles spill registers on sm_90 for a q/k/v stack (Triton 3.6: 64-row tiles
        # with dx, 4-warp dA-only tiles)
        BLOCK_S, num_warps = min(BLOCK_S, 32), max(num_warps, 8)
    tiles_k = cdiv(K, BLOCK_K)
    tiles_r = cdiv(max(stack_num * R, 1), BLOCK_R)
    # chunk = rows per program, a multiple of BLOCK_S: long enough that ~target programs cover the batch
    per_sm = None if need_dx else _DA_PROGRAMS_PER_SM
    n_sub = max(_SHRINK_MIN_SUB, cdiv(S * tiles_k, _target_programs(dev, per_sm) * BLOCK_S))
    chunk = BLOCK_S * min(next_power_of_2(n_sub), 64)
    info, cptr, order, capacity = _chunks(segs, n_slots, chunk)
    part_dA = torch.empty(capacity, stack_num * R, K, dtype=acc, device=dev)
    launch(_shrink_bwd_kernel, (capacity, tiles_k, tiles_r), (
        dh, x, A, dx if need_dx else x, part_dA, keep if load_mask else x, order, info, table.ranks,
        table.offsets, table.offsets if w_offs is None else w_offs, table.dropout, seed if has_dropout else 0,
        K, stack_num,
        *dh.stride(), *x.stride(), *A_cat.stride(),
        *(dx.stride() if need_dx else (0, 0)), *part_dA.stride(), keep.stride(0) if load_mask else 0,
    ), dict(
        # not for FMA (fp32) dots, whose operand layout would hold A's tile replicated and spill
        NEED_DX=need_dx, HAS_DROPOUT=has_dropout, LOAD_MASK=load_mask, HOIST_A=tiles_r == 1 and x.element_size() == 2,
        EVEN_K=K % BLOCK_K == 0, DOT_PRECISION=_dot_precision(x.dtype), W_OFFS=w_offs is not None,
        BLOCK_S=BLOCK_S, BLOCK_K=BLOCK_K, BLOCK_R=BLOCK_R, num_warps=num_warps, num_stages=num_stages,
        DROP_STACK=stack_num if has_dropout else 1,  # a mask per stacked slice
    ))
    if R_tot > 0 and n_slots > 0:
        BLOCK_KF = min(128, max(16, _FINISH_TILE // BLOCK_R))
        launch(_shrink_bwd_finish, (n_slots, tiles_r, cdiv(K, BLOCK_KF)), (
            dA_out, part_dA, cptr, table.ranks, table.offsets, K, stack_num,
            *dA_out.stride(), *part_dA.stride(),
        ), dict(BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_KF, ACCUMULATE=accumulate_dA, num_warps=4))
    return dx, dA_out

