"""Dropout drawn inside the kernels: a keep-mask from Philox ``tl.rand(seed, row * K + col)``.

Every kernel that reads ``x~`` (the shrink forward, the ``dx``/``dA`` backward) calls :func:`keep_block` with the
*physical* row index, so the mask is regenerated in backward and never stored. ``dropout_keep_mask`` materialises
the same mask for tests (it feeds the reference's ``keep=`` argument).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import AdapterTable, Segments


@triton.jit
def keep_block(seed, o_rows, o_cols, K, p):
    """Boolean keep-mask of the block ``[rows, cols]``; ``rows`` physical token rows (int64), ``p`` the drop rate."""
    offs = o_rows.to(tl.int64)[:, None] * K + o_cols.to(tl.int64)[None, :]
    return tl.rand(seed, offs) >= p


@triton.jit
def _keep_mask_kernel(
    keep, token_p, seed, S, K,
    stride_ks, stride_kk,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_s = tl.program_id(0).to(tl.int64)
    i_k = tl.program_id(1).to(tl.int64)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_s = o_s < S
    b_p = tl.load(token_p + o_s, mask=m_s, other=0.0)  # [BLOCK_S]
    offs = o_s[:, None] * K + o_k[None, :]
    b_keep = tl.rand(seed, offs) >= b_p[:, None]  # same draw as keep_block
    m = m_s[:, None] & (o_k[None, :] < K)
    tl.store(keep + o_s[:, None] * stride_ks + o_k[None, :] * stride_kk, b_keep.to(tl.int8), mask=m)


def token_dropout_p(segs: Segments, table: AdapterTable) -> torch.Tensor:
    """Per physical row, the dropout rate of its adapter (0 for base tokens), float32 ``[S]``."""
    from_slot = torch.zeros(segs.num_tokens, dtype=torch.float32, device=segs.slot.device)
    lens = (segs.indptr[1:] - segs.indptr[:-1]).long()
    slot = segs.slot.long()
    p_seg = torch.where(slot >= 0, table.dropout[slot.clamp(min=0)], torch.zeros_like(table.dropout[:1]))
    logical_p = torch.repeat_interleave(p_seg, lens)
    rows = segs.perm.long() if segs.perm is not None else torch.arange(logical_p.numel(), device=from_slot.device)
    from_slot[rows] = logical_p
    return from_slot


def dropout_keep_mask(seed: int, segs: Segments, table: AdapterTable, K: int) -> torch.Tensor:
    """The ``[S, K]`` boolean keep-mask the kernels draw for ``seed`` (for tests and the reference)."""
    S = segs.num_tokens
    keep = torch.empty(S, K, dtype=torch.int8, device=segs.slot.device)
    if S == 0:
        return keep.bool()
    p = token_dropout_p(segs, table)
    grid = (triton.cdiv(S, 32), triton.cdiv(K, 64))
    _keep_mask_kernel[grid](keep, p, seed, S, K, keep.stride(0), keep.stride(1), BLOCK_S=32, BLOCK_K=64)
    return keep.bool()
