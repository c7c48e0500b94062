"""DoRA's per-row combine, ``res = y + g * (y - b + t)``, and its gradient in one pass each.

``y[R, T, N]`` is the layer op's ``base(x) + LoRA delta`` (``R`` rows of ``T`` tokens), ``t[R, T, N]`` (optional) the
dropped-input term ``(x~ - x) W^T``, ``b[N]`` (optional) the base bias and ``g[R, N]`` DoRA's ``magnitude / norm - 1``
of each row's adapter (``fast_multilora.dora``). The backward writes ``dy = G (1 + g)``, ``dt = G g`` and
``dg[r] = sum over the row's tokens of G (y - b + t)`` from one read of ``G``, ``y`` and ``t``: autograd's graph of
the same expression takes about three times the memory traffic (``G g``, ``G z`` and its sum, and the sum of ``y``'s
two gradients). ``dg``'s sums run over each chunk of a row's tokens in a fixed order in one program, then over the
chunks in order (deterministic, no atomics).
Arithmetic in float32 (float64 for float64 tensors), each result rounded once to its tensor's dtype.

:func:`dora_gates` makes the ``g`` table itself, per adapter ``a`` of rank ``r_a`` (columns ``c_a ..`` of the
concatenated ``[N, R]`` operands) and output row ``i``: ``||W_i + s_a (B_a A_a)_i||^2 = ||W_i||^2 + sum_j B_ij
(2 s_a P_ij + s_a^2 (B_a G_a)_ij)`` with ``P = W A^T`` and ``G_a = A_a A_a^T`` (the diagonal block of ``A A^T``),
then ``g = m_a / norm - 1``: one pass over ``P`` and ``B`` where the same expression in torch ops takes about ten
launches per layer call.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_power_of_2

BLOCK_N = 128  # columns per program; 1024 for one-token rows (g per token: packed rows), each program's only tile
T_CHUNK = 128  # a row's tokens per program, in tiles of up to 32 (BLOCK_T); a longer row's dg sums its chunks' partials


@triton.jit
def _z(y, t, b, HAS_T: tl.constexpr, HAS_B: tl.constexpr):
    z = y
    if HAS_B:
        z = z - b[None, :]
    if HAS_T:
        z = z + t
    return z


@triton.jit
def _load_if(ptrs, mask, HAS: tl.constexpr, ACC: tl.constexpr):
    """The block at ``ptrs`` in ``ACC`` (``other`` 0), or zeros of its shape where the tensor is absent."""
    if HAS:
        return tl.load(ptrs, mask=mask, other=0.0).to(ACC)
    else:
        return tl.zeros(ptrs.shape, dtype=ACC)


@triton.jit
def _columns(b, N, HAS_B: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, T_CHUNK: tl.constexpr):
    """The program's row, its columns and their mask, the bias there, and its first token."""
    i_r = tl.program_id(0).to(tl.int64)
    o_n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    return i_r, o_n, m_n, _load_if(b + o_n, m_n, HAS_B, ACC), tl.program_id(2) * T_CHUNK


@triton.jit
def _tile(i_r, t0, T, N, o_n, m_n, BLOCK_T: tl.constexpr):
    """The mask and element offsets of tokens ``t0 ..`` of row ``i_r`` at the program's columns."""
    o_t = t0 + tl.arange(0, BLOCK_T)
    return (o_t < T)[:, None] & m_n[None, :], (i_r * T + o_t)[:, None] * N + o_n[None, :]


@triton.jit
def _combine_fwd_kernel(
    res, zout, y, t, b, g, T, N,
    HAS_T: tl.constexpr, HAS_B: tl.constexpr, WRITE_Z: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, T_CHUNK: tl.constexpr,
):
    i_r, o_n, m_n, b_b, t_lo = _columns(b, N, HAS_B, ACC, BLOCK_N, T_CHUNK)
    b_g = tl.load(g + i_r * N + o_n, mask=m_n, other=0.0).to(ACC)
    for t0 in range(t_lo, tl.minimum(t_lo + T_CHUNK, T), BLOCK_T):
        m, off = _tile(i_r, t0, T, N, o_n, m_n, BLOCK_T)
        b_y = tl.load(y + off, mask=m, other=0.0)
        b_t = _load_if(t + off, m, HAS_T, ACC)
        b_y32 = b_y.to(ACC)
        z = _z(b_y32, b_t, b_b, HAS_T, HAS_B)
        tl.store(res + off, (b_y32 + b_g[None, :] * z).to(b_y.dtype), mask=m)
        if WRITE_Z:
            tl.store(zout + off, z.to(b_y.dtype), mask=m)


@triton.jit
def _combine_bwd_kernel(
    dy, dt, dg, G, y, t, b, g, T, N,
    HAS_T: tl.constexpr, HAS_B: tl.constexpr, WRITE_DT: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr, T_CHUNK: tl.constexpr,
):
    i_r, o_n, m_n, b_b, t_lo = _columns(b, N, HAS_B, ACC, BLOCK_N, T_CHUNK)
    b_g32 = tl.load(g + i_r * N + o_n, mask=m_n, other=0.0).to(ACC)
    acc = tl.zeros((BLOCK_N,), dtype=ACC)
    for t0 in range(t_lo, tl.minimum(t_lo + T_CHUNK, T), BLOCK_T):
        m, off = _tile(i_r, t0, T, N, o_n, m_n, BLOCK_T)
        b_G = tl.load(G + off, mask=m, other=0.0)
        b_G32 = b_G.to(ACC)
        b_y = tl.load(y + off, mask=m, other=0.0).to(ACC)
        b_t = _load_if(t + off, m, HAS_T, ACC)
        tl.store(dy + off, (b_G32 * (1.0 + b_g32[None, :])).to(b_G.dtype), mask=m)
        if WRITE_DT:
            tl.store(dt + off, (b_G32 * b_g32[None, :]).to(b_G.dtype), mask=m)
        z = tl.where(m, _z(b_y, b_t, b_b, HAS_T, HAS_B), 0.0)
        acc += tl.sum(b_G32 * z, axis=0)
    # dg: [R, N] (one chunk per row), else each chunk's float32 (float64) partial sums [R, n_chunks, N]
    tl.store(dg + (i_r * tl.num_programs(2) + tl.program_id(2)) * N + o_n, acc.to(dg.dtype.element_ty), mask=m_n)


def _check(y, t, b, g) -> tuple:
    R, T, N = y.shape
    ok = y.is_contiguous() and g.shape == (R, N) and g.is_contiguous() and g.device == y.device
    ok = ok and (t is None or (t.shape == y.shape and t.is_contiguous() and t.dtype == y.dtype
                               and t.device == y.device))
    ok = ok and (b is None or (b.shape == (N,) and b.is_contiguous() and b.device == y.device))
    if not ok:
        raise ValueError(f"dora_combine: y must be a contiguous [R, T, N] tensor, t None or like y, b None or a "
                         f"contiguous [N] vector and g a contiguous [R, N] tensor on y's device; got y "
                         f"{tuple(y.shape)} {y.dtype}, t {None if t is None else (tuple(t.shape), t.dtype)}, b "
                         f"{None if b is None else tuple(b.shape)}, g {tuple(g.shape)} on {g.device}")
    acc = tl.float64 if y.dtype == torch.float64 else tl.float32
    meta = dict(HAS_T=t is not None, HAS_B=b is not None, ACC=acc, BLOCK_T=min(32, next_power_of_2(max(T, 1))),
                BLOCK_N=BLOCK_N if T != 1 else 1024, T_CHUNK=T_CHUNK)
    return (R, cdiv(N, meta["BLOCK_N"]), max(cdiv(T, T_CHUNK), 1)), meta


def dora_combine(y: torch.Tensor, t: Optional[torch.Tensor], b: Optional[torch.Tensor], g: torch.Tensor,
                 keep_z: bool = False) -> tuple:
    """``(res, z)``: ``res = y + g[:, None, :] * z`` with ``z = y - b + t`` (module docstring), in ``y``'s dtype;
    ``z`` itself (rounded to ``y``'s dtype) only with ``keep_z``, else ``None``."""
    grid, meta = _check(y, t, b, g)
    res = torch.empty_like(y)
    z = torch.empty_like(y) if keep_z else None
    if y.numel():
        launch(_combine_fwd_kernel, grid, (res, res if z is None else z, y, y if t is None else t,
                                           y if b is None else b, g, y.shape[1], y.shape[2]),
               dict(meta, WRITE_Z=keep_z))
    return res, z


def dora_combine_bwd(G: torch.Tensor, y: torch.Tensor, t: Optional[torch.Tensor], b: Optional[torch.Tensor],
                     g: torch.Tensor, with_dt: bool) -> tuple:
    """``(dy, dt, dg)`` of :func:`dora_combine` for the output's gradient ``G`` (like ``y``): ``dy = G (1 + g)``,
    ``dt = G g`` (``None`` unless ``with_dt``), ``dg[r] = sum_t G z`` in ``g``'s dtype, ``z = y - b + t`` from the
    arguments given (the forward's kept ``z`` as ``y``, without ``t`` and ``b``, gives the same ``dg``)."""
    grid, meta = _check(y, t, b, g)
    if G.shape != y.shape or not G.is_contiguous() or G.dtype != y.dtype:
        raise ValueError(f"dora_combine_bwd: G must be a contiguous {tuple(y.shape)} {y.dtype} tensor, got "
                         f"{tuple(G.shape)} {G.dtype}")
    dy = torch.empty_like(y)
    dt = torch.empty_like(y) if with_dt else None
    # one chunk per row: dg written directly; more: partial sums per chunk, added in chunk order (deterministic)
    part = torch.empty(grid[0], grid[2], y.shape[2], dtype=torch.float64 if y.dtype == torch.float64 else
                       torch.float32, device=y.device) if grid[2] > 1 else torch.empty_like(g)
    if part.numel():
        launch(_combine_bwd_kernel, grid, (dy, dy if dt is None else dt, part, G, y, y if t is None else t,
                                           y if b is None else b, g, y.shape[1], y.shape[2]),
               dict(meta, WRITE_DT=with_dt))
    return dy, dt, part.sum(1).to(g.dtype) if grid[2] > 1 else part


# dora_gates' (output rows per program, warps) by its rank block (the largest rank, at least 16, a power of two):
# compiled for sm_90 (tests/kernels/test_dora_combine.py), 32 rows of 4 warps spill at rank block 64 and any tile
# tried at 128 does (10 KB a thread at 32 x 4), so ranks above 64 take torch's ops (GATES_MAX_RANK)
GATES_TILES = {16: (32, 4), 32: (32, 4), 64: (16, 8)}


@triton.jit
def _gates_kernel(
    gm1, norms, P, B, gram, rowsq, mags, offsets, two_s, N, R,
    ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    a = tl.program_id(1)
    o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < N
    c0 = tl.load(offsets + a)
    o_r = tl.arange(0, BLOCK_R)
    m_r = o_r < tl.load(offsets + a + 1) - c0
    cols = (c0 + o_r).to(tl.int64)
    m = m_m[:, None] & m_r[None, :]
    b_B = tl.load(B + o_m[:, None] * R + cols[None, :], mask=m, other=0.0).to(ACC)
    b_P = tl.load(P + o_m[:, None] * R + cols[None, :], mask=m, other=0.0).to(ACC)
    b_G = tl.load(gram + cols[:, None] * R + cols[None, :], mask=m_r[:, None] & m_r[None, :], other=0.0).to(ACC)
    s2 = tl.load(two_s + a).to(ACC)  # 2 s
    bg = tl.dot(b_B, b_G, input_precision="ieee")  # (B_a G_a)_i: the block's rank columns only
    # (rows past N: norm 1, so no 0 / 0 in the lanes not stored)
    n2 = tl.load(rowsq + o_m, mask=m_m, other=1.0).to(ACC) + tl.sum(b_B * (s2 * b_P + (0.25 * s2 * s2) * bg), axis=1)
    nrm = tl.sqrt(tl.maximum(n2, 0.0))
    mag = tl.load(mags + a * N + o_m, mask=m_m, other=0.0).to(ACC)
    tl.store(norms + a * N + o_m, nrm.to(norms.dtype.element_ty), mask=m_m)
    tl.store(gm1 + a * N + o_m, (mag / nrm - 1.0).to(gm1.dtype.element_ty), mask=m_m)


GATES_MAX_RANK = max(GATES_TILES)  # above it a program's [rank, rank] block of A A^T spills out of its registers


def dora_gates(P: torch.Tensor, B: torch.Tensor, gram: torch.Tensor, rowsq: torch.Tensor, mags: torch.Tensor,
               offsets: torch.Tensor, two_s: torch.Tensor, max_rank: int) -> tuple:
    """``(g - 1, norms)``, both float32 ``[n, N]`` (float64 for float64 ``gram``): row ``a`` is adapter ``a``'s
    ``m_a / ||W + s_a B_a A_a||_row - 1`` and the norms (module docstring). ``P = W A^T`` and ``B`` are ``[N, R]``
    (the adapters' rank columns concatenated, any float dtype), ``gram`` the ``[R, R]`` ``A A^T`` in the
    arithmetic's dtype (only its diagonal blocks are read), ``rowsq`` the ``[N]`` ``||W_i||^2``, ``mags`` the
    ``[n, N]`` magnitudes, ``offsets`` int32 ``[n + 1]`` the first rank column of each adapter (and ``R``),
    ``two_s`` the ``[n]`` ``2 s_a``; all contiguous on one device; ``max_rank`` the largest rank (at most
    :data:`GATES_MAX_RANK`)."""
    N, R = P.shape
    n = mags.shape[0]
    ok = B.shape == (N, R) and gram.shape == (R, R) and rowsq.shape == (N,) and mags.shape == (n, N) \
        and offsets.shape == (n + 1,) and offsets.dtype == torch.int32 and two_s.shape == (n,)
    ts = (P, B, gram, rowsq, mags, offsets, two_s)
    ok = ok and all(t.is_contiguous() and t.device == P.device for t in ts) and 0 < max_rank <= GATES_MAX_RANK
    if not ok:
        got = ", ".join(f"{k} {tuple(t.shape)} {t.dtype} on {t.device}"
                        for k, t in zip(("P", "B", "gram", "rowsq", "mags", "offsets", "two_s"), ts, strict=True))
        raise ValueError(f"dora_gates: P and B must be contiguous [N, R], gram [R, R], rowsq [N], mags [n, N], "
                         f"offsets int32 [n + 1] and two_s [n], on one device; got {got}; max_rank {max_rank} "
                         f"(1 .. {GATES_MAX_RANK})")
    acc = torch.float64 if gram.dtype == torch.float64 else torch.float32
    gm1 = torch.empty(n, N, dtype=acc, device=P.device)
    norms = torch.empty(n, N, dtype=acc, device=P.device)
    if gm1.numel():
        block_r = max(16, next_power_of_2(max_rank))
        block_m, warps = GATES_TILES[block_r]
        launch(_gates_kernel, (cdiv(N, block_m), n), (gm1, norms, P, B, gram, rowsq, mags, offsets, two_s, N, R),
               dict(ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK_M=block_m, BLOCK_R=block_r,
                    num_warps=warps))
    return gm1, norms
