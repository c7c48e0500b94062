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
def _cross_entropy_kernel(z, target, ce, stride_z, M, V, FP64: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_V: tl.constexpr):
    acc = tl.float64 if FP64 else tl.float32
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
    tl.store(ce + o_m, lse - z_t, mask=m_m)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + o
        m = m_m[:, None] & (cols < V)[None, :]
        x = tl.load(p_row + cols[None, :], mask=m, other=0.0).to(acc)
        p = tl.exp(x - lse[:, None])
        p = tl.where(cols[None, :] == t[:, None], p - 1.0, p)
        tl.store(p_row + cols[None, :], p.to(z.dtype.element_ty), mask=m)


def cross_entropy_(z: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``ce[M]`` of the logits ``z[M, V]`` against ``target[M]``, and ``z`` overwritten with ``d ce / d z`` (see the
    module docstring)."""
    if z.dim() != 2 or z.stride(1) != 1 or not z.is_floating_point():
        raise ValueError(f"cross_entropy_: z must be floating-point [M, V] logits with contiguous rows, got shape "
                         f"{tuple(z.shape)}, strides {z.stride()}, {z.dtype}")
    if target.shape != (z.shape[0],) or target.dtype != torch.int64 or target.device != z.device:
        raise ValueError(f"cross_entropy_: target must be int64 [{z.shape[0]}] on {z.device}, got "
                         f"{tuple(target.shape)} {target.dtype} on {target.device}")
    M, V = z.shape
    fp64 = z.dtype == torch.float64
    ce = torch.empty(M, dtype=torch.float64 if fp64 else torch.float32, device=z.device)
    if M == 0:
        return ce
    cfg = block_config("cross_entropy", width=V, dtype=z.dtype)
    block_m = min(cfg["BLOCK_M"], next_power_of_2(M))
    block_v = min(cfg["BLOCK_V"], next_power_of_2(V))
    launch(_cross_entropy_kernel, (cdiv(M, block_m),), [z, target.contiguous(), ce, z.stride(0), M, V],
           dict(FP64=fp64, BLOCK_M=block_m, BLOCK_V=block_v, num_warps=cfg["num_warps"]))
    return ce
