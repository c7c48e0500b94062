"""SGEMM family (``segs.perm is None``): each segment is a contiguous run of rows sharing one adapter slot.

Grid ``(num_segments, cdiv(max_len, BLOCK_S), N-tiles)``: every axis stays inside CUDA's limits (axis 0 takes up to
2**31-1 segments, an interleaved batch can have one per token). Programs of base segments (slot -1), rank-0 slots,
tiles past the segment's end and N-tiles past the adapter's ``stack*rank`` return at once.

Performance notes (targets: S=8192, K=N=4096, r=16, bf16 on H200; block sizes live in ``forward.py``):

* shrink (memory-bound, reads x once): one program owns ``BLOCK_S`` rows and the whole ``stack*rank`` output
  (``BLOCK_N`` >= it up to 128), so x is streamed exactly once; the K loop runs in ``BLOCK_K`` steps, pipelined over
  ``num_stages`` shared-memory buffers. Dropout zeroes ``x`` in its own dtype and scales the fp32 accumulator once by
  ``1/(1-p)`` at the end.
* expand (reads and writes y): K is the rank, one step of ``BLOCK_R``; the y tile is loaded before the dot so its
  latency overlaps the small matmul; scale and add happen in fp32 and y is stored in its own dtype.

The tile bodies (``shrink_tile``, ``expand_tile``) take the *physical* rows of the tile, so the chunked SGMV family
(``sgmv.py``) reuses them with rows gathered through ``perm``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dropout import keep_block, keep_block_packed


@triton.jit
def shrink_tile(
    x, A, h, keep_bits, o_s, m_s, i_n, w_row0, n_a, K, seed, p,
    stride_xs, stride_xk, stride_an, stride_ak, stride_hs, stride_hn, stride_ms,
    HAS_DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DROP_STACK: tl.constexpr,
):
    """h[o_s, n] = (x[o_s] * keep / (1-p)) . A[w_row0 + n] for the columns n < n_a of N-tile ``i_n``.

    ``STORE_MASK`` (dropout, ``DROP_STACK == 1``): N-tile 0 also stores the keep-mask it drew, packed
    (``dropout.keep_block_packed``'s bytes), into ``keep_bits[o_s, k // 8]`` for the backward to read.

    ``DROP_STACK > 1`` (dropout on a stack of that many slices): column ``n`` belongs to slice ``n // rank`` and sees
    that slice's own mask (key ``slice_seed(seed, s)``); the x tile is loaded once and masked once per slice, each
    mask meeting only its slice's columns of A.
    """
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_n = o_n < n_a
    if DROP_STACK > 1:
        n_slice = o_n // (n_a // DROP_STACK)  # [BLOCK_N] slice of each column
    p_x = x + o_s[:, None] * stride_xs + o_k[None, :] * stride_xk  # [BLOCK_S, BLOCK_K]
    p_a = A + (w_row0 + o_n)[None, :] * stride_an + o_k[:, None] * stride_ak  # [BLOCK_K, BLOCK_N]
    b_acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=h.dtype.element_ty)  # fp32 (fp64 for fp64 x)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            b_x = tl.load(p_x, mask=m_s[:, None], other=0.0)
            b_a = tl.load(p_a, mask=m_n[None, :], other=0.0)
        else:
            m_k = o_k < K - k0
            b_x = tl.load(p_x, mask=m_s[:, None] & m_k[None, :], other=0.0)
            b_a = tl.load(p_a, mask=m_k[:, None] & m_n[None, :], other=0.0)
        if DROP_STACK > 1:
            b_a = b_a.to(b_x.dtype)
            for s in tl.static_range(DROP_STACK):
                b_xs = tl.where(keep_block(seed ^ (s * 16777216), o_s, k0 + o_k, K, p), b_x, 0.0)
                b_as = tl.where((n_slice == s)[None, :], b_a, 0.0)
                b_acc = tl.dot(b_xs, b_as, b_acc, input_precision=DOT_PRECISION, out_dtype=b_acc.dtype)
        else:
            if HAS_DROPOUT:
                if STORE_MASK:
                    b_keep, b_bits = keep_block_packed(seed, o_s, k0 + o_k, K, p)
                    o_b = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # bytes of this K step
                    n_b = tl.where(i_n == 0, (K + 7) // 8, 0)  # bytes per row; N-tile 0 stores them
                    m_b = m_s[:, None] & (o_b < n_b)[None, :]
                    tl.store(keep_bits + o_s[:, None] * stride_ms + o_b[None, :], b_bits, mask=m_b)
                else:
                    b_keep = keep_block(seed, o_s, k0 + o_k, K, p)
                b_x = tl.where(b_keep, b_x, 0.0)
            # weights may be fp32 under 16-bit activations: the dot runs in the activation dtype, accumulates fp32
            b_acc = tl.dot(b_x, b_a.to(b_x.dtype), b_acc, input_precision=DOT_PRECISION, out_dtype=b_acc.dtype)
        p_x += BLOCK_K * stride_xk
        p_a += BLOCK_K * stride_ak
    if HAS_DROPOUT:
        b_acc = b_acc / (1.0 - p.to(b_acc.dtype))
    p_h = h + o_s[:, None] * stride_hs + o_n[None, :] * stride_hn  # [BLOCK_S, BLOCK_N]
    tl.store(p_h, b_acc.to(h.dtype.element_ty), mask=m_s[:, None] & m_n[None, :])


@triton.jit
def expand_tile(
    h, B, y, bias, o_s, m_s, i_n, h_col0, b_col0, rank, scale, N,
    stride_hs, stride_hn, stride_bn, stride_br, stride_ys, stride_yn,
    FP64: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """y[o_s, n] (+)= scale * h[o_s, h_col0 : h_col0+rank] . B[n, b_col0 : b_col0+rank] for the N-tile ``i_n``.

    ``ACCUMULATE``: added to y (read first); otherwise y is written, plus ``bias[n]`` with ``HAS_BIAS``.
    """
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_r = tl.arange(0, BLOCK_R)
    m_n = o_n < N
    m_y = m_s[:, None] & m_n[None, :]
    p_y = y + o_s[:, None] * stride_ys + o_n[None, :] * stride_yn  # [BLOCK_S, BLOCK_N]
    if ACCUMULATE:
        b_y = tl.load(p_y, mask=m_y, other=0.0)  # issued first: its latency overlaps the small dot
    if FP64:
        b_acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float64)
    else:
        b_acc = tl.zeros([BLOCK_S, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        m_r = o_r < rank - r0
        p_h = h + o_s[:, None] * stride_hs + (h_col0 + r0 + o_r)[None, :] * stride_hn  # [BLOCK_S, BLOCK_R]
        p_b = B + o_n[None, :] * stride_bn + (b_col0 + r0 + o_r)[:, None] * stride_br  # [BLOCK_R, BLOCK_N]
        b_h = tl.load(p_h, mask=m_s[:, None] & m_r[None, :], other=0.0)
        b_b = tl.load(p_b, mask=m_r[:, None] & m_n[None, :], other=0.0)
        if FP64:
            b_acc = tl.dot(b_h.to(tl.float64), b_b.to(tl.float64), b_acc, input_precision=DOT_PRECISION,
                           out_dtype=tl.float64)
        else:
            # h is fp32: 16-bit y runs the dot in y's dtype (tensor cores), fp32 y in ieee fp32
            b_acc = tl.dot(b_h.to(y.dtype.element_ty), b_b.to(y.dtype.element_ty), b_acc,
                           input_precision=DOT_PRECISION)
    b_out = scale.to(b_acc.dtype) * b_acc
    if ACCUMULATE:
        b_out += b_y.to(b_acc.dtype)
    if HAS_BIAS:
        b_out += tl.load(bias + o_n, mask=m_n, other=0.0).to(b_acc.dtype)[None, :]
    tl.store(p_y, b_out.to(y.dtype.element_ty), mask=m_y)


@triton.jit
def slot_weight(W, offsets, w_offs, slot, STACK: tl.constexpr, W_OFFS: tl.constexpr):
    """``(W_a, row0)``: the slot's rows of a shrink weight start at row ``row0`` of ``W_a``. In the concatenation
    ``A_cat`` (``W_a = W``, ``row0 = STACK*offsets[slot]``), or in place (``W_OFFS``, a ``segments.SlotWeights``: the
    slot's own weight at ``W + w_offs[slot]`` elements, a multiple of 16, and ``row0 = 0``: the 64-bit offset is added
    once to the pointer, so per-element offsets stay 32-bit)."""
    if W_OFFS:
        W_a = W + tl.multiple_of(tl.load(w_offs + slot), 16)
        row0 = 0
    else:
        W_a = W
        row0 = STACK * tl.load(offsets + slot).to(tl.int64)
    return W_a, row0


@triton.jit
def slot_b(B, offsets, w_offs, slot, rank, N, spe, stride_bn, stride_br,
           W_OFFS: tl.constexpr, B_PACKED: tl.constexpr, EXPERTS: tl.constexpr):
    """``(B_a, col0, stride_bn_a, stride_br_a)``: the slot's columns of an expand weight start at column ``col0`` of
    ``B_a``, whose row and column strides those are. In ``B_cat`` (``B_a = B``, ``col0 = offsets[slot]``, the
    launcher's strides); in place (``W_OFFS``: its own contiguous ``[N, rank]`` weight at ``B + w_offs[slot]``
    elements, a multiple of 16); or in the adapter store's packed block (``B_PACKED``: slot ``a``'s ``[N, rank]``
    weight contiguous at element ``N * offsets[a]`` of a 1-D buffer, no table). Both of the latter: ``col0 = 0``,
    row stride ``rank`` (the table's, so slots may differ in rank), column stride 1. The 64-bit offset is added once
    to the pointer, so per-element offsets stay 32-bit.

    ``B_PACKED`` with ``EXPERTS = E > 1`` (MoE virtual slots, ``segments.packed_b``): the slot is expert
    ``e = slot // spe``'s, its ``[N, rank]`` weight the strided columns ``j*E + e`` of its adapter's PEFT weight
    ``[N, rank*E]`` at element ``N * (offsets[slot] - e*rank)``: row stride ``rank*E``, column stride ``E``."""
    if W_OFFS:
        B_a = B + tl.multiple_of(tl.load(w_offs + slot), 16)  # the offset is aligned; the row stride ``rank`` is not
    elif B_PACKED:
        if EXPERTS > 1:
            e = slot // spe
            B_a = B + (tl.load(offsets + slot).to(tl.int64) - e * rank) * N + e
        else:
            B_a = B + tl.load(offsets + slot).to(tl.int64) * N  # N: an int or a constexpr
    else:
        B_a = B
    if W_OFFS or B_PACKED:
        col0 = 0
        if B_PACKED and EXPERTS > 1:
            stride_bn_a = rank * EXPERTS
            stride_br_a = EXPERTS
        else:
            stride_bn_a = rank
            stride_br_a = 1
    else:
        col0 = tl.load(offsets + slot)
        stride_bn_a = stride_bn
        stride_br_a = stride_br
    return B_a, col0, stride_bn_a, stride_br_a


@triton.jit
def fill_tile(y, bias, o_s, m_s, i_n, N, stride_ys, stride_yn, HAS_BIAS: tl.constexpr,
              BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr):
    """y[o_s, n] = bias[n] (or 0) for the N-tile ``i_n``: the rows of a write-mode expand that no adapter touches."""
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    b_out = tl.zeros([BLOCK_S, BLOCK_N], dtype=y.dtype.element_ty)  # a copy of the bias: no rounding past y's
    if HAS_BIAS:
        b_out += tl.load(bias + o_n, mask=m_n, other=0.0).to(y.dtype.element_ty)[None, :]
    p_y = y + o_s[:, None] * stride_ys + o_n[None, :] * stride_yn
    tl.store(p_y, b_out.to(y.dtype.element_ty), mask=m_s[:, None] & m_n[None, :])


@triton.jit(do_not_specialize=["seed"])  # a fresh seed per call must not pick new variants
def sgemm_shrink_kernel(
    x, A, h, keep_bits, indptr, seg_slot, ranks, offsets, w_offs, dropout, seed, K,
    stride_xs, stride_xk, stride_an, stride_ak, stride_hs, stride_hn, stride_ms,
    STACK: tl.constexpr, HAS_DROPOUT: tl.constexpr, STORE_MASK: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, W_OFFS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """h[t, :STACK*r] = dropout(x[t]) @ A_cat[STACK*off : STACK*(off+r)]^T for the rows t of segment ``i_g``
    (``W_OFFS``: the slot's own weight, see :func:`slot_weight`)."""
    if seed.dtype.is_ptr():  # a seed in device memory (torch.compile, CUDA graphs): read once per program
        seed = tl.load(seed)
    i_g = tl.program_id(0)
    i_s = tl.program_id(1).to(tl.int64)
    i_n = tl.program_id(2)
    slot = tl.load(seg_slot + i_g)
    if slot < 0:
        return
    rank = tl.load(ranks + slot)
    n_a = STACK * rank
    if i_n * BLOCK_N >= n_a:  # also rank 0
        return
    bos = tl.load(indptr + i_g).to(tl.int64)
    eos = tl.load(indptr + i_g + 1).to(tl.int64)
    if bos + i_s * BLOCK_S >= eos:
        return
    o_s = bos + i_s * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] physical rows
    p = 0.0
    if HAS_DROPOUT:
        p = tl.load(dropout + slot)
    A_a, w_row0 = slot_weight(A, offsets, w_offs, slot, STACK, W_OFFS)
    shrink_tile(
        x, A_a, h, keep_bits, o_s, o_s < eos, i_n, w_row0, n_a, K, seed, p,
        stride_xs, stride_xk, stride_an, stride_ak, stride_hs, stride_hn, stride_ms,
        HAS_DROPOUT, STORE_MASK, EVEN_K, DOT_PRECISION, BLOCK_S, BLOCK_N, BLOCK_K, STACK if HAS_DROPOUT else 1,
    )


@triton.jit
def sgemm_expand_kernel(
    h, B, y, bias, indptr, seg_slot, ranks, offsets, w_offs, scales, slice_idx, spe, N,
    stride_hs, stride_hn, stride_bn, stride_br, stride_ys, stride_yn,
    FP64: tl.constexpr, DOT_PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, HAS_BIAS: tl.constexpr,
    W_OFFS: tl.constexpr, B_PACKED: tl.constexpr, EXPERTS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, N_TILES: tl.constexpr,
):
    """y[t] += scale_a * h[t, slice*r : (slice+1)*r] @ B_cat[:, off : off+r]^T for the rows t of segment ``i_g``
    (``W_OFFS`` / ``B_PACKED``: the slot's own ``[N, r_a]`` weight, in place or in the store's packed block, row stride
    its rank ``r_a``; with ``EXPERTS > 1`` a packed block holds PEFT's experts weights, ``spe`` slots per expert:
    see :func:`slot_b`).

    Write mode (``ACCUMULATE=False``): y[t] = that product (+ bias), and rows of base segments / rank-0 slots are
    written too (bias or zero), so every row of y is defined. A program covers ``N_TILES`` consecutive N-tiles: the
    segment's table reads (a chain of dependent loads) are paid once per program, not once per output tile.
    """
    i_g = tl.program_id(0)
    i_s = tl.program_id(1).to(tl.int64)
    i_n0 = tl.program_id(2) * N_TILES
    bos = tl.load(indptr + i_g).to(tl.int64)
    eos = tl.load(indptr + i_g + 1).to(tl.int64)
    if bos + i_s * BLOCK_S >= eos:
        return
    o_s = bos + i_s * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S] physical rows
    slot = tl.load(seg_slot + i_g)
    rank = tl.load(ranks + tl.maximum(slot, 0), mask=slot >= 0, other=0)
    if rank == 0:  # base segment or absent adapter
        if not ACCUMULATE:
            for j in range(N_TILES):
                fill_tile(y, bias, o_s, o_s < eos, i_n0 + j, N, stride_ys, stride_yn, HAS_BIAS, BLOCK_S, BLOCK_N)
        return
    B_a, b_col0, stride_bn_a, stride_br_a = slot_b(
        B, offsets, w_offs, slot, rank, N, spe, stride_bn, stride_br, W_OFFS, B_PACKED, EXPERTS)
    scale = tl.load(scales + slot)
    for j in range(N_TILES):
        expand_tile(
            h, B_a, y, bias, o_s, o_s < eos, i_n0 + j, slice_idx * rank, b_col0, rank, scale,
            N, stride_hs, stride_hn, stride_bn_a, stride_br_a, stride_ys, stride_yn,
            FP64, DOT_PRECISION, ACCUMULATE, HAS_BIAS, BLOCK_S, BLOCK_N, BLOCK_R,
        )
