"""Pure-PyTorch segmented LoRA ops: the CPU backend and the oracle the Triton kernels are tested against.

Signatures match ``fast_multilora.kernels`` (the Triton launchers) except for dropout, which the reference takes as
an explicit boolean ``keep`` mask (``[S, K]``, or ``[stack_num, S, K]``: one per stacked slice, as the kernels draw
with a seed) where the kernels take a Philox ``seed``; see ``kernels/segments.py``
for the layout of ``Segments``, ``AdapterTable``, ``A_cat``, ``B_cat`` and ``h``. All arithmetic is float32
(float64 for float64 inputs, so gradcheck can run through them).

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

from .kernels.segments import AdapterTable, Segments


def token_slots(segs: Segments) -> torch.Tensor:
    """Physical row -> slot (``-1`` for rows in no adapter segment), int64 on the segments' device."""
    ts = torch.full((segs.num_tokens,), -1, dtype=torch.int64, device=segs.slot.device)
    lens = (segs.indptr[1:] - segs.indptr[:-1]).long()
    logical_slot = torch.repeat_interleave(segs.slot.long(), lens)
    rows = segs.perm.long() if segs.perm is not None else torch.arange(logical_slot.numel(), device=ts.device)
    ts[rows] = logical_slot
    return ts


def _slot_rows(segs: Segments, table: AdapterTable):
    """Yield ``(slot, rows, rank, offset, scale, p)`` for every slot with tokens and rank > 0."""
    ts = token_slots(segs)
    ranks, offsets = table.ranks.tolist(), table.offsets.tolist()
    scales, ps = table.scales.tolist(), table.dropout.tolist()
    for a in sorted({int(v) for v in ts.unique().tolist() if v >= 0}):
        if ranks[a] == 0:
            continue
        rows = torch.nonzero(ts == a).reshape(-1)
        yield a, rows, ranks[a], offsets[a], scales[a], ps[a]


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _dropped(x_rows: torch.Tensor, keep: Optional[torch.Tensor], rows: torch.Tensor, p: float) -> torch.Tensor:
    if keep is None or p == 0.0:
        return x_rows
    return x_rows * keep[rows].to(x_rows.dtype) / (1.0 - p)


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
    for _, rows, r, off, _, p in _slot_rows(segs, table):
        w = A_cat[stack_num * off : stack_num * (off + r)].to(acc)
        xr = x[rows].to(acc)
        for s, k in enumerate(keeps):
            h[rows, s * r : (s + 1) * r] = _dropped(xr, k, rows, p) @ w[s * r : (s + 1) * r].T
    return h


def lora_expand(h, B_cat, segs: Segments, table: AdapterTable, y, *, stack_num: int = 1, slice_idx: int = 0,
                accumulate: bool = True, bias: Optional[torch.Tensor] = None):
    """In place ``y[t] += scale_a * h[t, slice] @ B_a^T``; returns ``y``. Rows of base tokens are untouched.

    ``accumulate=False``: ``y`` is overwritten -- ``bias`` (or zero) on every row, plus the product on adapter rows.
    """
    if not accumulate:
        y.zero_()
        if bias is not None:
            y += bias.to(y.dtype)
    for _, rows, r, off, c, _ in _slot_rows(segs, table):
        hs = h[rows, slice_idx * r : (slice_idx + 1) * r]
        delta = c * (hs @ B_cat[:, off : off + r].to(h.dtype).T)
        if accumulate:
            delta = y[rows].to(h.dtype) + delta
        elif bias is not None:
            delta = delta + bias.to(h.dtype)
        y[rows] = delta.to(y.dtype)
    return y


def lora_expand_bwd(dy, h, B_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, slice_idx: int = 0,
                    dh: Optional[torch.Tensor] = None):
    """Returns ``(dh, dB_cat)``: ``dh`` (float32 ``[S, stack_num*max_rank]``, this slice's columns written; a
    given ``dh`` is filled in place) and ``dB_cat`` (float32 ``[N, total_rank]``, zero for slots without tokens)."""
    acc = _acc_dtype(dy)
    if dh is None:
        dh = torch.zeros(dy.shape[0], stack_num * table.max_rank, dtype=acc, device=dy.device)
    dB = torch.zeros(B_cat.shape[0], table.total_rank, dtype=acc, device=dy.device)
    for _, rows, r, off, c, _ in _slot_rows(segs, table):
        g = dy[rows].to(acc)
        cols = slice(slice_idx * r, (slice_idx + 1) * r)
        dh[rows, cols] = c * (g @ B_cat[:, off : off + r].to(acc))
        dB[:, off : off + r] = c * (g.T @ h[rows, cols].to(acc))
    return dh, dB


def lora_shrink_bwd(dh, x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, keep=None,
                    need_dx: bool = True):
    """Returns ``(dx, dA_cat)``: ``dx`` in ``x``'s dtype with zero rows for base tokens (``None`` unless
    ``need_dx``), ``dA_cat`` float32 ``[stack_num*total_rank, K]``, zero for slots without tokens."""
    dx = torch.zeros_like(x) if need_dx else None
    acc = _acc_dtype(x)
    dA = torch.zeros(stack_num * table.total_rank, x.shape[1], dtype=acc, device=x.device)
    keeps = _slice_keeps(keep, stack_num)
    for _, rows, r, off, _, p in _slot_rows(segs, table):
        g = dh[rows, : stack_num * r].to(acc)
        w = A_cat[stack_num * off : stack_num * (off + r)].to(acc)
        xr = x[rows].to(acc)
        g_x = torch.zeros(rows.numel(), x.shape[1], dtype=acc, device=x.device)
        for s, k in enumerate(keeps):
            cols = slice(s * r, (s + 1) * r)
            dA[stack_num * off + s * r : stack_num * off + (s + 1) * r] = g[:, cols].T @ _dropped(xr, k, rows, p)
            g_x += _dropped(g[:, cols] @ w[cols], k, rows, p)
        if need_dx:
            dx[rows] = g_x.to(x.dtype)
    return dx, dA
