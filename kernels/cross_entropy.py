"""Per-row cross-entropy of a logits block and its gradient written over the block, in two reads and one write.

``cross_entropy_(z, target)``: ``z[M, V]`` (16-bit, fp32 or fp64, rows contiguous), ``target[M]`` (int64 in
``[0, V)``). Returns ``ce[M] = logsumexp(z[m]) - z[m, target[m]]`` in fp32 (fp64 for fp64 ``z``) and overwrites
``z`` with ``softmax(z) - onehot(target)`` in its own dtype: the gradient of ``ce`` with respect to the logits, which
the fused per-adapter loss (``fast_multilora.fused_loss``) multiplies by the LM head's weight right after.

One program per ``BLOCK_M`` rows (one on a GPU, as Liger Kernel's cross-entropy kernel; more under the interpreter,
whose cost is per program), a row's columns in blocks of up to ``BLOCK_V``: the first pass keeps a running maximum
and the sum of exponentials (online softmax), the second writes ``exp(z - lse)``, less 1 at the target. Arithmetic in
fp32 (fp64), each value rounded once. PyTorch's ops take about three times the traffic for the same result (an fp32
copy of 16-bit logits, ``log_softmax``'s output, then ``exp`` into the logits' dtype). No host reads: targets outside
``[0, V)`` are the caller's to clamp (``fused_loss`` marks such rows NaN itself).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import block_config
from .launch import cdiv, launch, next_power_of_2


@triton.jit
def _rows_lse(z, target, stride_z, M, V, acc: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    """The program's rows, their mask, pointers, targets, ``lse`` (one online-softmax pass) and target logits."""
    o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    o = tl.arange(0, BLOCK_V)
    p_row = z + o_m[:, None] * stride_z  # [BLOCK_M, 1]
    mx = tl.full([BLOCK_M], float("-inf"), acc)
    s = tl.zeros([BLOCK_M], dtype=acc)
    for v0 in range(0, V, BLOCK_V):
        m = m_m[:, None] & (v0 + o < V)[None, :]
        x = tl.load(p_row + (v0 + o)[None, :], mask=m, other=float("-inf")).to(acc)
        mx_new = tl.maximum(mx, tl.max(x, 1))
        # rows past M see only -inf: keep their sums 0 (no inf - inf)
        mx_safe = tl.where(m_m, mx_new, 0.0)
        s = s * tl.exp(mx - mx_safe) + tl.sum(tl.exp(x - mx_safe[:, None]), 1)
        mx = mx_new
    lse = tl.where(m_m, mx, 0.0) + tl.log(tl.where(m_m, s, 1.0))
    t = tl.load(target + o_m, mask=m_m, other=0)
    z_t = tl.load(z + o_m * stride_z + t, mask=m_m, other=0.0).to(acc)
    return o_m, m_m, p_row, t, lse, z_t


@triton.jit
def _write_grad(p_row, out_row, m_m, t, lse, g, V, acc: tl.constexpr, HAS_G: tl.constexpr, BLOCK_V: tl.constexpr):
    """``out = (exp(z - lse) - onehot(t)) * g`` over the rows' columns, in ``out``'s dtype."""
    o = tl.arange(0, BLOCK_V)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + o
        m = m_m[:, None] & (cols < V)[None, :]
        x = tl.load(p_row + cols[None, :], mask=m, other=0.0).to(acc)
        p = tl.exp(x - lse[:, None])
        p = tl.where(cols[None, :] == t[:, None], p - 1.0, p)
        if HAS_G:
            p = p * g[:, None]
        tl.store(out_row + cols[None, :], p.to(out_row.dtype.element_ty), mask=m)


@triton.jit
def _cross_entropy_kernel(z, target, ce, stride_z, M, V, FP64: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    acc: tl.constexpr = tl.float64 if FP64 else tl.float32
    o_m, m_m, p_row, t, lse, z_t = _rows_lse(z, target, stride_z, M, V, acc, BLOCK_M, BLOCK_V)
    tl.store(ce + o_m, lse - z_t, mask=m_m)
    _write_grad(p_row, p_row, m_m, t, lse, lse, V, acc, False, BLOCK_V)


@triton.jit
def _cross_entropy_fwd_kernel(z, target, ce, lse_out, stride_z, M, V, FP64: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_V: tl.constexpr):
    acc: tl.constexpr = tl.float64 if FP64 else tl.float32
    o_m, m_m, p_row, t, lse, z_t = _rows_lse(z, target, stride_z, M, V, acc, BLOCK_M, BLOCK_V)
    tl.store(ce + o_m, lse - z_t, mask=m_m)
    tl.store(lse_out + o_m, lse, mask=m_m)


@triton.jit
def _cross_entropy_bwd_kernel(z, target, lse_in, g_in, dz, stride_z, stride_dz, M, V, FP64: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr):
    acc: tl.constexpr = tl.float64 if FP64 else tl.float32
    o_m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_m = o_m < M
    t = tl.load(target + o_m, mask=m_m, other=0)
    lse = tl.load(lse_in + o_m, mask=m_m, other=0.0).to(acc)
    g = tl.load(g_in + o_m, mask=m_m, other=0.0).to(acc)
    _write_grad(z + o_m[:, None] * stride_z, dz + o_m[:, None] * stride_dz, m_m, t, lse, g, V, acc, True, BLOCK_V)


def _check(name: str, z: torch.Tensor, target: torch.Tensor) -> None:
    if z.dim() != 2 or z.stride(1) != 1 or not z.is_floating_point():
        raise ValueError(f"{name}: z must be floating-point [M, V] logits with contiguous rows, got shape "
                         f"{tuple(z.shape)}, strides {z.stride()}, {z.dtype}")
    if target.shape != (z.shape[0],) or target.dtype != torch.int64 or target.device != z.device:
        raise ValueError(f"{name}: target must be int64 [{z.shape[0]}] on {z.device}, got "
                         f"{tuple(target.shape)} {target.dtype} on {target.device}")


def _meta(z: torch.Tensor) -> tuple:
    """``(grid, constexprs and launch options)`` of a call on ``z``'s rows."""
    M, V = z.shape
    cfg = block_config("cross_entropy", width=V, dtype=z.dtype)
    block_m = min(cfg["BLOCK_M"], next_power_of_2(M))
    block_v = min(cfg["BLOCK_V"], next_power_of_2(V))
    return (cdiv(M, block_m),), dict(FP64=z.dtype == torch.float64, BLOCK_M=block_m, BLOCK_V=block_v,
                                     num_warps=cfg["num_warps"])


def _acc(z: torch.Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def cross_entropy_(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``ce[M]`` of the logits ``z[M, V]`` against ``target[M]``, and ``z`` overwritten with ``d ce / d z`` (see the
    module docstring)."""
    _check("cross_entropy_", z, target)
    ce = torch.empty(z.shape[0], dtype=_acc(z), device=z.device)
    if z.shape[0]:
        grid, meta = _meta(z)
        launch(_cross_entropy_kernel, grid, [z, target.contiguous(), ce, z.stride(0), *z.shape], meta)
    return ce


def cross_entropy_fwd(z: torch.Tensor, target: torch.Tensor) -> tuple:
    """``(ce[M], lse[M])`` of the logits ``z[M, V]`` (fp32; fp64 for fp64 ``z``), ``z`` only read (one pass)."""
    _check("cross_entropy_fwd", z, target)
    ce = torch.empty(z.shape[0], dtype=_acc(z), device=z.device)
    lse = torch.empty_like(ce)
    if z.shape[0]:
        grid, meta = _meta(z)
        launch(_cross_entropy_fwd_kernel, grid, [z, target.contiguous(), ce, lse, z.stride(0), *z.shape], meta)
    return ce, lse


def cross_entropy_bwd(z: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``dz = (softmax(z) - onehot(target)) * g[:, None]`` in ``z``'s dtype, from the forward's ``lse`` and the
    per-row upstream gradient ``g`` (both ``[M]``, fp32 or fp64); one pass over ``z``, rounded once."""
    _check("cross_entropy_bwd", z, target)
    for name, v in (("lse", lse), ("g", g)):
        if v.shape != (z.shape[0],) or not v.is_floating_point() or v.device != z.device:
            raise ValueError(f"cross_entropy_bwd: {name} must be a floating [{z.shape[0]}] tensor on {z.device}, "
                             f"got {tuple(v.shape)} {v.dtype} on {v.device}")
    dz = torch.empty_like(z, memory_format=torch.contiguous_format)
    if z.shape[0]:
        grid, meta = _meta(z)
        launch(_cross_entropy_bwd_kernel, grid, [z, target.contiguous(), lse.contiguous(), g.contiguous(), dz,
                                                 z.stride(0), dz.stride(0), *z.shape], meta)
    return dz
