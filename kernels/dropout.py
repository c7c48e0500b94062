"""Dropout drawn inside the kernels: a keep-mask from Philox-4x32 counters of ``(row, col // 8)``, 16 bits per element.

Every kernel that reads ``x~`` (the shrink forward, the ``dx``/``dA`` backward) calls :func:`keep_block` with the
*physical* row index, so the backward can regenerate the mask. A training forward instead stores it, one bit per
element (:func:`keep_block_packed`, ``[S, cdiv(K, 8)]`` uint8, 1/16 of ``x``'s bf16 bytes), and the backward reads
it back (:func:`unpack_keep`): the Philox draw is paid once per step instead of twice. A stacked call
(``stack_num > 1``: siblings sharing one shrink) draws an independent mask per slice, keyed by :func:`slice_seed`,
as PEFT's separate dropout modules do, and redraws them in the backward. ``dropout_keep_mask`` materialises the same
masks for tests (they feed the reference's ``keep=`` argument).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch
from .segments import AdapterTable, Segments


@triton.jit
def _draw(seed, o_rows, o_cols, K):
    """The four Philox-4x32 words of each (row, 8-column group) of the block: ``[BLOCK_R, BLOCK_C // 8]`` each."""
    BLOCK_C: tl.constexpr = o_cols.shape[0]
    tl.static_assert(BLOCK_C % 8 == 0)
    o_grp = tl.max(tl.reshape(o_cols, (BLOCK_C // 8, 8)), axis=1) // 8  # [BLOCK_C // 8] column groups
    n_grp = (K + 7) // 8
    ctr = o_rows.to(tl.int64)[:, None] * n_grp + o_grp.to(tl.int64)[None, :]  # [BLOCK_R, BLOCK_C // 8]
    # 32-bit counters select Philox-4x32 (64-bit ones would select 4x64); they wrap only past 2^35 elements
    return tl.randint4x(seed, ctr.to(tl.uint32))


@triton.jit
def _threshold(p):
    return (p * 65536.0 + 0.5).to(tl.uint32)  # p < 1


@triton.jit
def _keep_of(r0, r1, r2, r3, thresh):
    BLOCK_R: tl.constexpr = r0.shape[0]
    BLOCK_C: tl.constexpr = r0.shape[1] * 8
    # [BLOCK_R, BLOCK_C // 8, 2, 2]; the outer join is the last axis, so the words run r0 r2 r1 r3
    words = tl.join(tl.join(r0, r1), tl.join(r2, r3))
    words = tl.reshape(words, (BLOCK_R, BLOCK_C // 2))  # uint32
    halves = tl.join(words & 0xFFFF, words >> 16)  # [BLOCK_R, BLOCK_C // 2, 2]: low half first
    halves = tl.reshape(halves, (BLOCK_R, BLOCK_C))
    return halves >= thresh


@triton.jit
def _bits_of(r0, r1, r2, r3, thresh):
    """The keep bits of each 8-column group as one byte (bit ``i`` = column ``8 j + i``), computed in the words'
    own layout (no reshape)."""
    b = ((r0 & 0xFFFF) >= thresh).to(tl.int32) | (((r0 >> 16) >= thresh).to(tl.int32) << 1)
    b |= (((r2 & 0xFFFF) >= thresh).to(tl.int32) << 2) | (((r2 >> 16) >= thresh).to(tl.int32) << 3)
    b |= (((r1 & 0xFFFF) >= thresh).to(tl.int32) << 4) | (((r1 >> 16) >= thresh).to(tl.int32) << 5)
    b |= (((r3 & 0xFFFF) >= thresh).to(tl.int32) << 6) | (((r3 >> 16) >= thresh).to(tl.int32) << 7)
    return b.to(tl.uint8)


@triton.jit
def keep_block(seed, o_rows, o_cols, K, p):
    """Boolean keep-mask of the block ``[rows, cols]``: element ``(t, k)`` is 16-bit half ``k % 8`` of the
    Philox-4x32 draw at counter ``t * cdiv(K, 8) + k // 8`` (halves in order: word 0 low, word 0 high, word 2 low,
    word 2 high, word 1 low, ..., word 3 high), kept when that half ``>= round(p * 2^16)``.

    One Philox call serves eight columns (an eighth of ``tl.rand``'s cost per element); the drop probability is
    ``round(p * 2^16) / 2^16``, which is exactly ``p`` for the rates the patched layers pass (rounded to multiples of
    ``2^-16`` by :func:`quantize_p`). ``o_cols`` must be a contiguous block starting at a multiple of 8 whose length
    is a multiple of 8; ``p`` broadcasts to the block.
    """
    r0, r1, r2, r3 = _draw(seed, o_rows, o_cols, K)
    return _keep_of(r0, r1, r2, r3, _threshold(p))


@triton.jit
def keep_block_packed(seed, o_rows, o_cols, K, p):
    """:func:`keep_block` and the same mask packed, ``[rows, cols // 8]`` uint8 (bit ``i`` of byte ``j`` is column
    ``8 j + i``; :func:`unpack_keep` inverts it), from one draw."""
    r0, r1, r2, r3 = _draw(seed, o_rows, o_cols, K)
    thresh = _threshold(p)
    return _keep_of(r0, r1, r2, r3, thresh), _bits_of(r0, r1, r2, r3, thresh)


@triton.jit
def unpack_keep(packed, C: tl.constexpr):
    """The packed mask of :func:`keep_block_packed` (bit ``i`` of byte ``j`` is column ``8 j + i``), ``[R, C // 8]``
    uint8, as the boolean ``[R, C]`` block."""
    R: tl.constexpr = packed.shape[0]
    bits = (packed.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
    return tl.reshape(bits, (R, C)) != 0


@triton.jit
def _scale_by_keep_kernel(
    out, x, bits, kept, S, K,
    stride_os, stride_xs, stride_bs,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
):
    i_s = tl.program_id(0).to(tl.int64)
    i_k = tl.program_id(1).to(tl.int64)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    o_b = i_k * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    m_s = o_s < S
    m = m_s[:, None] & (o_k[None, :] < K)
    b_bits = tl.load(bits + o_s[:, None] * stride_bs + o_b[None, :], mask=m_s[:, None] & (o_b[None, :] < (K + 7) // 8),
                     other=0)
    b_keep = unpack_keep(b_bits, BLOCK_K)  # [BLOCK_S, BLOCK_K]
    b_kept = tl.load(kept + o_s, mask=m_s, other=0.0)  # the row's factor, in x's dtype
    b_x = tl.load(x + o_s[:, None] * stride_xs + o_k[None, :], mask=m, other=0.0)
    f = tl.where(b_keep, b_kept[:, None], -1.0)
    if b_x.dtype == tl.float64:
        y = b_x * f.to(tl.float64)
    else:  # the float32 product of two 16-bit values is exact: one rounding, as torch's
        y = (b_x.to(tl.float32) * f.to(tl.float32)).to(b_x.dtype)
    tl.store(out + o_s[:, None] * stride_os + o_k[None, :], y, mask=m)


def scale_by_keep(x: torch.Tensor, bits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``x * f`` for ``x[S, K]`` (rows contiguous), ``f[t, k] = kept[t]`` where the packed keep-mask ``bits``
    (uint8 ``[S, cdiv(K, 8)]``, :func:`keep_block_packed`'s format) keeps element ``(t, k)``, else ``-1``; ``kept``
    is ``[S]`` in ``x``'s dtype. The product is rounded once, as torch's ``x * f`` in ``x``'s dtype: one pass over
    ``x`` (DoRA's dropped-input term ``x~ - x`` with ``kept = p / (1 - p)``, and its own gradient)."""
    S, K = x.shape
    check_keep_bits("scale_by_keep", bits, x, 1)
    if x.stride(-1) != 1 or kept.shape != (S,) or kept.dtype != x.dtype or kept.device != x.device:
        raise ValueError(f"scale_by_keep: x must have contiguous rows and kept be [{S}] {x.dtype} on {x.device}, got "
                         f"x strides {tuple(x.stride())}, kept {kept.dtype} {tuple(kept.shape)} on {kept.device}")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if S and K:
        grid = (cdiv(S, 16), cdiv(K, 128))
        launch(_scale_by_keep_kernel, grid, (out, x, bits, kept, S, K, out.stride(0), x.stride(0), bits.stride(0)),
               dict(BLOCK_S=16, BLOCK_K=128))
    return out


def keep_bits_buffer(x: torch.Tensor) -> torch.Tensor:
    """An uninitialised buffer for the packed keep-mask of ``x[S, K]``: uint8 ``[S, cdiv(K, 8)]``."""
    return torch.empty(x.shape[0], cdiv(x.shape[1], 8), dtype=torch.uint8, device=x.device)


def check_keep_bits(name: str, bits, x: torch.Tensor, stack_num: int) -> None:
    """``bits`` is a packed keep-mask buffer for ``x`` (uint8 ``[S, cdiv(K, 8)]``, rows contiguous, on x's
    device) of an unstacked call."""
    shape = (x.shape[0], cdiv(x.shape[1], 8))
    if not (isinstance(bits, torch.Tensor) and bits.dtype == torch.uint8 and tuple(bits.shape) == shape
            and bits.device == x.device and (shape[1] <= 1 or bits.stride(1) == 1)):
        raise ValueError(f"{name}: the packed keep-mask must be a uint8 tensor of shape {shape} on {x.device} with "
                         f"contiguous rows (dropout.keep_bits_buffer(x)), got "
                         f"{getattr(bits, 'dtype', type(bits))} {tuple(getattr(bits, 'shape', ()))}")
    if stack_num != 1:
        raise ValueError(f"{name}: a packed keep-mask holds one mask; stack_num={stack_num} draws one per slice")


def pack_keep_bits(keep: torch.Tensor) -> torch.Tensor:
    """Host-side packing in the kernels' format (for tests): boolean ``[S, K]`` -> uint8 ``[S, cdiv(K, 8)]``."""
    S, K = keep.shape
    padded = torch.zeros(S, cdiv(K, 8) * 8, dtype=torch.int32, device=keep.device)
    padded[:, :K] = keep.to(torch.int32)
    shifts = torch.arange(8, device=keep.device, dtype=torch.int32)
    return (padded.view(S, -1, 8) << shifts).sum(-1).to(torch.uint8)


def unpack_keep_bits(bits: torch.Tensor, K: int) -> torch.Tensor:
    """The kernels' packing inverted by torch ops (tests, DoRA's dropped-input term): uint8 ``[S, cdiv(K, 8)]`` ->
    boolean ``[S, K]``, in byte arithmetic (no wider intermediate than the ``[S, K]`` bytes)."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    full = (bits[:, :, None] >> shifts) & 1  # [S, K/8, 8]: bit i of byte j is column 8 j + i
    return full.reshape(bits.shape[0], -1)[:, :K] != 0


# a stack's slice s draws its mask with key seed ^ (s << 24) (31-bit seeds stay 31-bit); the kernels spell it
# seed ^ (s * 16777216)
_SLICE_SHIFT = 24
MAX_DROPOUT_STACK = 1 << (31 - _SLICE_SHIFT)  # slices a stack may have with dropout (128)


def slice_seed(seed: int, s: int) -> int:
    """The Philox key of slice ``s`` of a stacked shrink (``stack_num > 1``): each slice draws its own mask, as
    PEFT's per-module dropout does (slice 0 uses ``seed`` itself, the mask of an unstacked call)."""
    return seed ^ (s << _SLICE_SHIFT)


def check_seed(name: str, seed, device, stack_num: int) -> None:
    """A launcher's ``seed``: ``None``, a host int, or (``torch.compile``, CUDA graphs: the draw must happen on the
    device, inside the graph) a one-element int32 tensor on ``device``, read by the kernels. Host ints of a stack are
    also checked by :func:`check_stacked_seed`; a device seed is drawn in ``[0, 2^31)`` by its producer."""
    if isinstance(seed, torch.Tensor):
        if seed.dtype != torch.int32 or seed.numel() != 1 or seed.device != device:
            raise ValueError(f"{name}: a device seed must be a one-element int32 tensor on {device}, got "
                             f"{seed.dtype} {tuple(seed.shape)} on {seed.device}")
        return
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"{name}: seed must be an int, a one-element int32 device tensor or None, got "
                         f"{type(seed).__name__}")
    check_stacked_seed(name, seed, stack_num)


def check_stacked_seed(name: str, seed, stack_num: int) -> None:
    """Slice seeds stay distinct 31-bit keys: ``0 <= seed < 2^31`` and at most ``MAX_DROPOUT_STACK`` slices."""
    if seed is None or stack_num <= 1 or isinstance(seed, torch.Tensor):
        return
    if not 0 <= seed < 2**31 or stack_num > MAX_DROPOUT_STACK:
        raise ValueError(f"{name}: dropout on a stack needs 0 <= seed < 2**31 and stack_num <= {MAX_DROPOUT_STACK}, "
                         f"got seed={seed}, stack_num={stack_num}")


P_RESOLUTION = 2.0**-16


def quantize_p(p: float) -> float:
    """``p`` rounded to the mask's resolution (a multiple of ``2^-16``): the rate :func:`keep_block` draws exactly,
    so the ``1 / (1 - p)`` rescale matches it (``|change| <= 2^-17``, 7.6e-6)."""
    return round(p / P_RESOLUTION) * P_RESOLUTION


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
    b_keep = keep_block(seed, o_s, o_k, K, b_p[:, None])  # [BLOCK_S, BLOCK_K], the kernels' own draw
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


def dropout_keep_mask(seed: int, segs: Segments, table: AdapterTable, K: int, stack_num: int = 1) -> torch.Tensor:
    """The boolean keep-mask the kernels draw for ``seed`` (for tests and the reference): ``[S, K]``, or with
    ``stack_num > 1`` one per slice, ``[stack_num, S, K]`` (slice ``s`` keyed by :func:`slice_seed`)."""
    if stack_num > 1:
        return torch.stack([dropout_keep_mask(slice_seed(seed, s), segs, table, K) for s in range(stack_num)])
    S = segs.num_tokens
    keep = torch.empty(S, K, dtype=torch.int8, device=segs.slot.device)
    if S == 0:
        return keep.bool()
    p = token_dropout_p(segs, table)
    grid = (cdiv(S, 32), cdiv(K, 64))
    _keep_mask_kernel[grid](keep, p, seed, S, K, keep.stride(0), keep.stride(1), BLOCK_S=32, BLOCK_K=64)
    return keep.bool()
