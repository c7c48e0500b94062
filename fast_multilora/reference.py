"""Pure-PyTorch segmented LoRA ops: the CPU backend and the oracle the Triton kernels are tested against.

Signatures match ``fast_multilora.kernels`` (the Triton launchers) except for dropout, which the reference takes as
an explicit boolean ``keep`` mask (``[S, K]``, or ``[stack_num, S, K]``: one per stacked slice, as the kernels draw
with a seed) where the kernels take a Philox ``seed``; see ``kernels/segments.py``
for the layout of ``Segments``, ``AdapterTable``, ``A_cat``, ``B_cat`` and ``h``. All arithmetic is float32
(float64 for float64 inputs, so gradcheck can run through them).

Each op is written per slot over all rows with the slot's row mask (``torch.where``), never with the rows' indices:
shapes never depend on the mix, so the ops also run under ``torch.compile`` without graph breaks (the table's host
copies, ``AdapterTable.host``, give the per-slot ranks and scales; without them they are read once from the device).

Math, for a token ``t`` of slot ``a`` with rank ``r``, scale ``c`` and dropout ``p`` (slice ``s`` of a stack)::

    x~[t]        = x[t] * keep[t] / (1 - p)                      (x~ = x without dropout)
    h[t, s*r+i]  = x~[t] . A_cat[stack*off + s*r + i]             shrink
    y[t]        += c * h[t, s*r : s*r+r] @ B_cat[:, off:off+r]^T  expand (slice s)
    dh[t, s*r+i] = c * dy[t] . B_cat[:, off+i]                    expand backward, data part
    dB[:, off+i] = c * sum_t dy[t] * h[t, s*r+i]                  expand backward, weight part
    dx[t]        = keep[t] / (1 - p) * dh[t, :stack*r] @ A_cat[rows of a]   shrink backward, data part
    dA[rows a]   = sum_t dh[t, :stack*r]^T x~[t]                  shrink backward, weight part
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels.adamw import ChunkTable
from .kernels.segments import AdapterTable, Segments


def token_slots(segs: Segments) -> torch.Tensor:
    """Physical row -> slot (``-1`` for rows in no adapter segment), int64 on the segments' device; static shapes
    (``repeat_interleave`` with its output size), so it traces under ``torch.compile``."""
    if segs.token_slots is not None:
        return segs.token_slots.long()
    ts = torch.full((segs.num_tokens,), -1, dtype=torch.int64, device=segs.slot.device)
    n_pos = segs.perm.numel() if segs.perm is not None else segs.num_tokens
    lens = (segs.indptr[1:] - segs.indptr[:-1]).long()
    logical_slot = torch.repeat_interleave(segs.slot.long(), lens, output_size=n_pos)
    if segs.perm is None:
        return logical_slot
    ts[segs.perm.long()] = logical_slot
    return ts


def _slots(table: AdapterTable):
    """Yield ``(slot, rank, offset, scale, p)`` for every slot of rank > 0 (host values)."""
    host = table.host
    if host is None:
        host = (table.ranks.tolist(), table.offsets.tolist(), table.scales.tolist(), table.dropout.tolist())
    for a, (r, off, c, p) in enumerate(zip(*host, strict=True)):
        if r > 0:
            yield a, r, off, c, p


def _packed_views(flat: torch.Tensor, table: AdapterTable, N: int):
    """Yield ``(slot, offset, rank, view)``: each slot of rank > 0 and its ``[N, rank]`` weight as a view of the
    packed 1-D block ``flat`` (``kernels.segments.packed_b``: at ``N * offset``; with ``table.experts = E > 1``
    expert ``e = slot // (n_slots // E)``'s strided columns of its adapter's PEFT ``[N, rank*E]`` weight)."""
    E = table.experts
    spe = table.ranks.numel() // E
    for a, r, off, _, _ in _slots(table):
        e = a // spe if E > 1 else 0
        start = N * (off - e * r)
        yield a, off, r, flat[start : start + N * r * E].view(N, r, E)[..., e]


def packed_b_cat(B_packed: torch.Tensor, table: AdapterTable, N: int) -> torch.Tensor:
    """The ``B_cat[N, total_rank]`` a packed block stands for (slot ``a``'s columns at ``offsets[a]``; expert-major
    for an experts table); columns no slot owns are zero. A copy."""
    out = torch.zeros(N, table.total_rank, dtype=B_packed.dtype, device=B_packed.device)
    for _, off, r, w in _packed_views(B_packed, table, N):
        out[:, off : off + r] = w
    return out


def packed_db(dB_cat: torch.Tensor, table: AdapterTable, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dB_cat[N, total_rank]`` in the packed layout (``kernels.lora_expand_bwd``'s ``dB_blocked``): flat
    ``[N * total_rank]``, every slot's columns at its place; elements no slot owns keep what ``out`` holds (zero
    when ``out`` is not given)."""
    N = dB_cat.shape[0]
    if out is None:
        out = torch.zeros(N * table.total_rank, dtype=dB_cat.dtype, device=dB_cat.device)
    for _, off, r, w in _packed_views(out, table, N):
        w.copy_(dB_cat[:, off : off + r])
    return out


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _dropped(x: torch.Tensor, keep: Optional[torch.Tensor], p: float) -> torch.Tensor:
    if keep is None or p == 0.0:
        return x
    return x * keep.to(x.dtype) / (1.0 - p)


def _slice_keeps(keep: Optional[torch.Tensor], stack_num: int) -> list:
    """The mask of each slice of a stack: a ``[stack_num, S, K]`` keep gives each its own (as the kernels draw with a
    seed), a ``[S, K]`` one (or ``None``) is shared."""
    if keep is None or keep.dim() == 2:
        return [keep] * stack_num
    if keep.dim() != 3 or keep.shape[0] != stack_num:
        raise ValueError(f"keep must be [S, K] or [stack_num={stack_num}, S, K], got {list(keep.shape)}")
    return list(keep)


def lora_shrink(x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, keep=None) -> torch.Tensor:
    """``h[S, stack_num*max_rank]`` (float32; float64 for float64 ``x``): ``h[t] = dropout(x[t]) @ A_a^T`` for
    every token of an adapter; rows of base tokens are zero. ``keep``: ``[S, K]``, or one mask per slice
    ``[stack_num, S, K]``."""
    acc = _acc_dtype(x)
    h = torch.zeros(x.shape[0], stack_num * table.max_rank, dtype=acc, device=x.device)
    keeps = _slice_keeps(keep, stack_num)
    ts = token_slots(segs)
    xa = x.to(acc)
    for a, r, off, _, p in _slots(table):
        m = (ts == a)[:, None]
        w = A_cat[stack_num * off : stack_num * (off + r)].to(acc)
        for s, k in enumerate(keeps):
            cols = slice(s * r, (s + 1) * r)
            h[:, cols] = torch.where(m, _dropped(xa, k, p) @ w[cols].T, h[:, cols])
    return h


def lora_expand(h, B_cat, segs: Segments, table: AdapterTable, y, *, stack_num: int = 1, slice_idx: int = 0,
                accumulate: bool = True, bias: Optional[torch.Tensor] = None):
    """In place ``y[t] += scale_a * h[t, slice] @ B_a^T``; returns ``y``. Rows of base tokens are untouched.

    ``accumulate=False``: ``y`` is overwritten -- ``bias`` (or zero) on every row, plus the product on adapter rows.
    """
    acc = h.dtype
    ts = token_slots(segs)
    if accumulate:
        start, out = y.to(acc), y
    else:  # base rows: the bias in y's dtype (or zero); adapter rows: product + bias
        start = torch.zeros(y.shape, dtype=acc, device=y.device) + (0 if bias is None else bias.to(acc))
        out = torch.zeros_like(y) + (0 if bias is None else bias.to(y.dtype))
    for a, r, off, c, _ in _slots(table):
        m = (ts == a)[:, None]
        # contiguous operands: a strided one (row stride: the layer's max / total rank) can change the BLAS
        # kernel's summation order, and a slot's results would depend on the layer's other adapters
        delta = c * (h[:, slice_idx * r : (slice_idx + 1) * r].contiguous() @
                     B_cat[:, off : off + r].to(acc).contiguous().T)
        out = torch.where(m, (start + delta).to(y.dtype), out)
    y.copy_(out)
    return y


def lora_shrink_expand(x, A_cat, B_cat, segs: Segments, table: AdapterTable, y):
    """In place ``y[t] += scale_a * (x[t] @ A_a^T) @ B_a^T`` (no dropout, one slice): ``lora_expand`` of
    ``lora_shrink``, the one-launch op of few-row calls (``kernels.decode``); returns ``y``."""
    return lora_expand(lora_shrink(x, A_cat, segs, table), B_cat, segs, table, y)


def lora_expand_bwd(dy, h, B_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, slice_idx: int = 0,
                    dh: Optional[torch.Tensor] = None):
    """Returns ``(dh, dB_cat)``: ``dh`` (float32 ``[S, stack_num*max_rank]``, this slice's columns written; a
    given ``dh`` is filled in place) and ``dB_cat`` (float32 ``[N, total_rank]``, zero for slots without tokens)."""
    acc = _acc_dtype(dy)
    if dh is None:
        dh = torch.zeros(dy.shape[0], stack_num * table.max_rank, dtype=acc, device=dy.device)
    dB = torch.zeros(B_cat.shape[0], table.total_rank, dtype=acc, device=dy.device)
    ts = token_slots(segs)
    g = dy.to(acc)
    for a, r, off, c, _ in _slots(table):
        m = (ts == a)[:, None]
        cols = slice(slice_idx * r, (slice_idx + 1) * r)
        dh[:, cols] = torch.where(m, c * (g @ B_cat[:, off : off + r].to(acc).contiguous()), dh[:, cols])
        # both operands masked: another adapter's rows (0 here) may hold NaN or Inf, and 0 * NaN is NaN
        dB[:, off : off + r] = c * (torch.where(m, g, 0).T @ torch.where(m, h[:, cols].to(acc), 0))
    return dh, dB


def lora_shrink_bwd(dh, x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, keep=None,
                    need_dx: bool = True):
    """Returns ``(dx, dA_cat)``: ``dx`` in ``x``'s dtype with zero rows for base tokens (``None`` unless
    ``need_dx``), ``dA_cat`` float32 ``[stack_num*total_rank, K]``, zero for slots without tokens."""
    acc = _acc_dtype(x)
    g_x = torch.zeros(x.shape, dtype=acc, device=x.device)
    dA = torch.zeros(stack_num * table.total_rank, x.shape[1], dtype=acc, device=x.device)
    keeps = _slice_keeps(keep, stack_num)
    ts = token_slots(segs)
    xa = x.to(acc)
    for a, r, off, _, p in _slots(table):
        m = (ts == a)[:, None]
        g = torch.where(m, dh[:, : stack_num * r].to(acc), 0)
        w = A_cat[stack_num * off : stack_num * (off + r)].to(acc)
        xm = torch.where(m, xa, 0)  # another adapter's rows may hold NaN or Inf: 0 * NaN is NaN
        for s, k in enumerate(keeps):
            cols = slice(s * r, (s + 1) * r)
            dA[stack_num * off + s * r : stack_num * off + (s + 1) * r] = g[:, cols].T @ _dropped(xm, k, p)
            g_x = g_x + torch.where(m, _dropped(g[:, cols] @ w[cols], k, p), 0)
    return (g_x.to(x.dtype) if need_dx else None), dA


# ----------------------------------------------------------------------------------------------------------------
# Adapter arenas: AdamW, gradient norms and gradient scaling (``kernels/adamw.py``)
# ----------------------------------------------------------------------------------------------------------------


def _arena_elements(table: ChunkTable) -> tuple:
    """``(pos, adapter)``, int64 ``[table.covered]``: every element of the table's blocks and its owner, in the
    table's chunk order (by adapter, then position)."""
    lens = table.length.long()
    dev = lens.device
    chunk_of = torch.repeat_interleave(torch.arange(lens.numel(), device=dev), lens, output_size=table.covered)
    first = torch.cumsum(lens, 0) - lens  # the element index of each chunk's first element
    pos = table.start[chunk_of] + torch.arange(table.covered, device=dev) - first[chunk_of]
    return pos, table.adapter.long()[chunk_of]


def adamw_scalars_reference(hyper, step, active) -> torch.Tensor:
    """``kernels.adamw.adamw_scalars_``: ``step`` incremented in place for active adapters, then float32
    ``[n_adapters, 8]`` = (1 - lr*wd, 1 - beta1, 1 - beta2, beta2, -lr / (1 - beta1^t), sqrt(1 - beta2^t), eps, 0),
    each computed in float64 (torch's Python floats) and rounded to float32."""
    step += (active != 0).to(step.dtype)
    lr, beta1, beta2, eps, wd = hyper.double().unbind(1)
    t = step.double().clamp(min=1)
    cols = (1 - lr * wd, 1 - beta1, 1 - beta2, beta2, -lr / (1 - beta1**t), (1 - beta2**t).sqrt(), eps,
            torch.zeros_like(lr))
    return torch.stack([c.float() for c in cols], 1)


def adamw_step_reference(param, grad, exp_avg, exp_avg_sq, table: ChunkTable, scalars, active, chunks=None) -> None:
    """``kernels.adamw.adamw_step_``: ``torch.optim.AdamW``'s step on the elements of active adapters, in place, with
    this step's per-adapter ``scalars`` (:func:`adamw_scalars_reference`): the elementwise math in float32 with
    torch's own ops in its order (``lerp``, ``mul`` + ``addcmul``, ``sqrt`` / + ``eps``, the ``addcdiv`` quotient),
    every result rounded once to the buffers' dtype as it is stored. ``chunks`` (the kernel's launch list, which
    holds every active adapter's chunks) changes nothing here: every active adapter is stepped."""
    pos, ad = _arena_elements(table)
    keep = active[ad] != 0
    pos, ad = pos[keep], ad[keep]
    decay, w1, w2, b2, neg_step, bc2_sqrt, eps, _ = scalars[ad].unbind(1)
    p, g, m, v = (x[pos].float() for x in (param, grad, exp_avg, exp_avg_sq))
    p = p * decay
    m = torch.lerp(m, g, w1)
    v = torch.addcmul(v * b2, w2 * g, g)
    # a correctly rounded float32 sqrt (double rounding through float64 is exact for sqrt); torch's CPU float32
    # sqrt is not (1 ulp off on ~16% of inputs, torch 2.13 CPU build), CUDA's is
    denom = v.double().sqrt().float() / bc2_sqrt + eps
    p = p + neg_step * m / denom
    for buf, x in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        buf[pos] = x.to(buf.dtype)


def grad_sq_norms_reference(grad, table: ChunkTable) -> torch.Tensor:
    """``kernels.adamw.grad_sq_norms``: float32 ``[n_adapters]``, each adapter's sum of squared gradient elements
    (float32; a deterministic segment sum over the elements grouped by adapter)."""
    pos, ad = _arena_elements(table)
    counts = torch.bincount(ad, minlength=table.n_adapters)
    return torch.segment_reduce(grad[pos].float().square(), "sum", lengths=counts)


def scale_grads_reference(grad, table: ChunkTable, factors) -> None:
    """``kernels.adamw.scale_grads_``: in place ``g *= factors[a]`` (float32 product, rounded once) on the elements
    of every adapter whose factor is not 1."""
    pos, ad = _arena_elements(table)
    f = factors[ad]
    sel = f != 1
    pos, f = pos[sel], f[sel]
    grad[pos] = (grad[pos].float() * f).to(grad.dtype)
