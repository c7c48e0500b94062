"""The torch backend's segmented LoRA ops on a CPU, eager: each slot's matmuls on its own rows only.

Same contracts as :mod:`fast_multilora.reference` (stack_num 1; see there for the math and the layouts), which stays
the oracle these are tested against (``tests/test_cpu_ops.py``) and the torch backend's ops wherever these do not
apply (a GPU, ``torch.compile``, stacked slices). The reference runs every slot over all rows with a row mask (static
shapes, so it traces), which costs ``slots x rows`` work and ~6 ops per slot; here the rows are grouped by slot once
per forward (``Segments.cache``: every layer of the call shares it) and each slot's product covers its own rows
(a few ops per slot). Each row is read and written by its own slot's ops only, so a non-finite value in one adapter's
rows or weights stays in that adapter's outputs and gradients, as with the reference and the kernels.
"""

from __future__ import annotations

from typing import Optional

import torch

from .kernels.segments import AdapterTable, Segments, slot_grouping
from .reference import _acc_dtype, _arena_elements, token_slots

_KEY = "cpu_rows_by_slot"


def applies(x: torch.Tensor, stack_num: int = 1) -> bool:
    """Whether these ops serve a call: CPU tensors, eager (not traced), one slice."""
    return x.device.type == "cpu" and stack_num == 1 and not torch.compiler.is_compiling()


def _rows(segs: Segments) -> list:
    """``[(slot, rows)]`` of every slot with rows, ascending (``rows``: a ``slice`` when they are contiguous, else an
    int64 index tensor), cached on ``segs`` for the forward's layers: the work grows with the slots in the batch, not
    with the adapters a model holds."""
    got = segs.cache.get(_KEY)
    if got is not None:
        return got
    ts = token_slots(segs)
    order, bounds = slot_grouping(ts, int(ts.max()) + 1 if ts.numel() else 0)
    order, b = order.long(), bounds.tolist()  # CPU tensors: no device wait
    live = []
    for a in range(len(b) - 2):
        if b[a + 2] == b[a + 1]:
            continue
        idx = order[b[a + 1] : b[a + 2]]
        n = idx.numel()
        first = int(idx[0])
        # ascending and distinct: contiguous exactly when the span equals the count (a row's tokens, grouped rows)
        live.append((a, slice(first, first + n) if int(idx[-1]) - first + 1 == n else idx))
    segs.cache[_KEY] = live
    return live


def _slot_rows(segs: Segments, table: AdapterTable):
    """``(slot, rank, offset, scale, p, rows)`` of every slot of rank > 0 that has rows."""
    host = table.host
    if host is None:
        host = (table.ranks.tolist(), table.offsets.tolist(), table.scales.tolist(), table.dropout.tolist())
    ranks, offsets, scales, ps = host
    for a, rows in _rows(segs):
        if a < len(ranks) and ranks[a] > 0:
            yield a, ranks[a], offsets[a], scales[a], ps[a], rows


def _take(t: torch.Tensor, rows) -> torch.Tensor:
    return t[rows] if type(rows) is slice else t.index_select(0, rows)


def _put(t: torch.Tensor, rows, value: torch.Tensor) -> None:
    if type(rows) is slice:
        t[rows] = value
    else:
        t.index_copy_(0, rows, value)


def _as(t: torch.Tensor, dtype) -> torch.Tensor:
    """``t`` in ``dtype``, contiguous: a slot's column slice of ``B_cat`` / ``h`` / ``dh`` has the row stride of the
    layer's total or max rank, and a strided operand can change the BLAS kernel's summation order (MKL's gemv on
    a rank-1 column: last-bit differences), so a slot's results would depend on the layer's other adapters."""
    return (t if t.dtype == dtype else t.to(dtype)).contiguous()


def _b(B: torch.Tensor, off: int, r: int, N: int) -> torch.Tensor:
    """A slot's ``[N, r]`` expand weight: columns ``off:off+r`` of ``B_cat[N, total_rank]``, or of the adapter
    store's packed block (1-D: each adapter's ``[N, r]`` contiguous from element ``off * N``), read where it lies
    (copying the whole block into ``B_cat`` per call costs the registry, not the batch)."""
    return B[off * N : (off + r) * N].view(N, r) if B.dim() == 1 else B[:, off : off + r]


def _dropped(x: torch.Tensor, keep: Optional[torch.Tensor], rows, p: float) -> torch.Tensor:
    if keep is None or p == 0.0:
        return x
    return x * _take(keep, rows).to(x.dtype) / (1.0 - p)


def lora_shrink(x, A_cat, segs: Segments, table: AdapterTable, *, keep=None) -> torch.Tensor:
    """:func:`reference.lora_shrink` (one slice): ``h[S, max_rank]``, zero on base rows and past each slot's rank."""
    acc = _acc_dtype(x)
    h = torch.zeros(x.shape[0], table.max_rank, dtype=acc, device=x.device)
    for _, r, off, _, p, rows in _slot_rows(segs, table):
        xa = _dropped(_as(_take(x, rows), acc), keep, rows, p)
        _put(h[:, :r], rows, xa @ _as(A_cat[off : off + r], acc).T)
    return h


def lora_expand(h, B_cat, segs: Segments, table: AdapterTable, y, *, accumulate: bool = True,
                bias: Optional[torch.Tensor] = None):
    """:func:`reference.lora_expand` (one slice): in place ``y[t] += scale_a * h[t, :r] @ B_a^T`` on adapter rows;
    ``accumulate=False`` writes ``bias`` (or zero) on every row first, the product added to it on adapter rows.
    ``B_cat``: ``[N, total_rank]`` or the store's packed block (:func:`_b`)."""
    acc, N = h.dtype, y.shape[1]
    if not accumulate:
        if bias is None:
            y.zero_()
        else:
            y.copy_(bias.to(y.dtype).expand_as(y))
    for _, r, off, c, _, rows in _slot_rows(segs, table):
        delta = c * (_as(_take(h, rows)[:, :r], acc) @ _as(_b(B_cat, off, r, N), acc).T)
        if accumulate:
            out = _as(_take(y, rows), acc) + delta
        else:
            out = delta if bias is None else _as(bias, acc) + delta
        _put(y, rows, _as(out, y.dtype))
    return y


def lora_shrink_expand(x, A_cat, B_cat, segs: Segments, table: AdapterTable, y):
    """:func:`reference.lora_shrink_expand`."""
    return lora_expand(lora_shrink(x, A_cat, segs, table), B_cat, segs, table, y)


def lora_expand_bwd(dy, h, B_cat, segs: Segments, table: AdapterTable, *, dh: Optional[torch.Tensor] = None,
                    dB_add: Optional[torch.Tensor] = None):
    """:func:`reference.lora_expand_bwd` (one slice): ``(dh, dB_cat)``; a given ``dh`` gets each adapter row's first
    ``r`` columns written, the rest kept. A packed ``B_cat`` (1-D, :func:`_b`) gets its gradient in its own layout.
    ``dB_add`` (in ``B_cat``'s layout, any float dtype): each slot with rows gets its gradient added there (summed in
    the accumulation dtype, rounded once), the others' left as they are; returned as ``dB_cat``."""
    acc, N = _acc_dtype(dy), dy.shape[1]
    if dh is None:
        dh = torch.zeros(dy.shape[0], table.max_rank, dtype=acc, device=dy.device)
    packed = B_cat.dim() == 1
    dB = dB_add if dB_add is not None else \
        torch.zeros(B_cat.shape[0] if packed else (N, table.total_rank), dtype=acc, device=dy.device)
    for _, r, off, c, _, rows in _slot_rows(segs, table):
        g = _as(_take(dy, rows), acc)
        _put(dh[:, :r], rows, c * (g @ _as(_b(B_cat, off, r, N), acc)))
        _added(_b(dB, off, r, N), c * (g.T @ _as(_take(h, rows)[:, :r], acc)), dB_add is not None)
    return dh, dB


def _added(out: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
    """``out = value``, or ``out += value`` in ``value``'s dtype, rounded once to ``out``'s."""
    out.copy_(out.to(value.dtype) + value if accumulate else value)


def lora_shrink_bwd(dh, x, A_cat, segs: Segments, table: AdapterTable, *, keep=None, need_dx: bool = True,
                    dA_add: Optional[torch.Tensor] = None):
    """:func:`reference.lora_shrink_bwd` (one slice): ``(dx or None, dA_cat)``, ``dx`` zero on base rows. ``dA_add``:
    as ``lora_expand_bwd``'s ``dB_add``."""
    acc = _acc_dtype(x)
    g_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_dx else None
    dA = dA_add if dA_add is not None else torch.zeros(table.total_rank, x.shape[1], dtype=acc, device=x.device)
    for _, r, off, _, p, rows in _slot_rows(segs, table):
        g = _as(_take(dh, rows)[:, :r], acc)
        _added(dA[off : off + r], g.T @ _dropped(_as(_take(x, rows), acc), keep, rows, p), dA_add is not None)
        if need_dx:
            _put(g_x, rows, _dropped(g @ _as(A_cat[off : off + r], acc), keep, rows, p))
    return (g_x.to(x.dtype) if need_dx else None), dA


# -- fast_multilora.AdamW's step on a CPU arena -----------------------------------------------------------------------

_OWNERS: dict = {}  # id(table) -> (table, _Elements)


class _Elements:
    """An arena's elements as a chunk table lays them out: per adapter its element count (``counts``) and, when
    asked, the positions of some adapters' elements (:meth:`positions`, the work of those elements), the owner of
    every element (:meth:`owner`, ``-1`` in gaps and holes; the work of the arena, built once per table) or some
    adapters' elements as runs of adjacent elements (:meth:`spans`, kept for the last few adapter sets)."""

    def __init__(self, table, numel: int):
        self.table, self.numel = table, numel
        self.ptr = table.adapter_ptr.tolist()
        self.start, self.length = table.start, table.length.long()
        per = torch.zeros(table.n_adapters, dtype=torch.int64)
        per.index_add_(0, table.adapter.long(), self.length)
        self.counts = per.tolist()
        self._owner = None
        self._spans: dict = {}

    def positions(self, adapters: list) -> tuple:
        """``(pos, owner)``, int64: the elements of ``adapters`` (by adapter, then position) and their adapter."""
        chunks = torch.cat([torch.arange(self.ptr[a], self.ptr[a + 1]) for a in adapters])
        lens = self.length[chunks]
        total = sum(self.counts[a] for a in adapters)
        of = torch.repeat_interleave(torch.arange(chunks.numel()), lens, output_size=total)
        first = torch.cumsum(lens, 0) - lens
        pos = self.start[chunks][of] + torch.arange(total) - first[of]
        return pos, self.table.adapter.long()[chunks][of]

    def spans(self, adapters: tuple) -> tuple:
        """``(starts, ends)``, host lists: the elements of ``adapters`` as maximal runs of adjacent elements, in
        arena order (adapters whose pieces lie side by side in a region make one run)."""
        hit = self._spans.get(adapters)
        if hit is None:
            chunks = torch.cat([torch.arange(self.ptr[a], self.ptr[a + 1]) for a in adapters])
            start, order = torch.sort(self.start[chunks].long())
            end = start + self.length[chunks][order]
            cut = torch.ones(start.numel(), dtype=torch.bool)
            cut[1:] = start[1:] != end[:-1]  # a run starts where the chunk before it ends elsewhere
            last = torch.cat([torch.nonzero(cut).reshape(-1)[1:] - 1, torch.tensor([start.numel() - 1])])
            if len(self._spans) >= 8:
                self._spans.clear()
            hit = self._spans[adapters] = (start[cut].tolist(), end[last].tolist())
        return hit

    def owner(self) -> torch.Tensor:
        if self._owner is None:
            pos, adapter = _arena_elements(self.table)  # in the table's chunk order: by adapter, then position
            self._owner = torch.full((self.numel,), -1, dtype=torch.int64)
            self._owner[pos] = adapter
        return self._owner


def _elements(table, numel: int) -> _Elements:
    hit = _OWNERS.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1]
    el = _Elements(table, numel)
    if len(_OWNERS) > 16:  # tables of past layouts
        _OWNERS.clear()
    _OWNERS[id(table)] = (table, el)
    return el


_BLOCK = 1 << 15  # elements per pass of the run-wise step: a pass's float32 temporaries stay in the CPU's caches
_MIN_RUN = 512  # the run-wise step is taken while the runs average at least this many elements (break-even ~370)


def adamw_step(param, grad, exp_avg, exp_avg_sq, table, scalars, active, chunks=None,
               way: Optional[str] = None) -> None:
    """:func:`reference.adamw_step_reference` on CPU arenas: the same float32 math in the same order, element by
    element (each with its adapter's scalars; an element of an inactive adapter, a gap or a hole keeps its values).
    Three ways, equal bit for bit (``way``: force one, for the tests): ``"runs"`` -- the active adapters grouped by
    equal scalars (one group when they share their settings and step count), each group's elements as runs of
    adjacent elements, stepped in cache-sized slices with the group's scalars: no per-element tables (taken when the
    runs are long); ``"gather"`` -- the active adapters' elements gathered, each with its adapter's scalars (when
    they are under half of the arena); ``"whole"`` -- the whole buffers, inactive elements written back unchanged.
    ``chunks`` (the kernel's launch list) is not needed: the active adapters' elements are found from ``active``."""
    el = _elements(table, param.numel())
    act = [a for a in torch.nonzero(active).reshape(-1).tolist() if el.counts[a]]
    n_live = sum(el.counts[a] for a in act)
    if not n_live:
        return
    if way in (None, "runs"):
        groups: dict = {}
        for a, row in zip(act, scalars[act].tolist(), strict=True):
            groups.setdefault(tuple(row), []).append(a)
        runs = [(adapters[0], el.spans(tuple(adapters))) for adapters in groups.values()]
        if way == "runs" or sum(len(r[1][0]) for r in runs) * _MIN_RUN <= n_live:
            for a, (starts, ends) in runs:
                sc = scalars[a].unbind(0)  # (float32 0-dim: the values the per-element table holds)
                for s, e in zip(starts, ends, strict=True):
                    for b in range(s, e, _BLOCK):
                        _adamw_slice(param, grad, exp_avg, exp_avg_sq, slice(b, min(e, b + _BLOCK)), sc)
            return
    gather = 2 * n_live < param.numel() if way is None else way == "gather"
    if gather:
        idx, ad = el.positions(act)
        decay, w1, w2, b2, neg_step, bc2_sqrt, eps, _ = scalars[ad].unbind(1)
        p, g, m, v = (x[idx].float() for x in (param, grad, exp_avg, exp_avg_sq))
    else:
        owner = el.owner()
        ad = owner.clamp(min=0)
        live = (active[ad] != 0) & (owner >= 0)
        decay, w1, w2, b2, neg_step, bc2_sqrt, eps, _ = scalars[ad].unbind(1)
        p, g, m, v = (x.float() for x in (param, grad, exp_avg, exp_avg_sq))
    p, m, v = _adamw_math(p, g, m, v, decay, w1, w2, b2, neg_step, bc2_sqrt, eps)
    if gather:
        for buf, x in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
            buf.index_copy_(0, idx, x.to(buf.dtype))
        return
    everything = bool(live.all())
    for buf, x in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        buf.copy_(x if everything else torch.where(live, x.to(buf.dtype), buf))


def _adamw_math(p, g, m, v, decay, w1, w2, b2, neg_step, bc2_sqrt, eps) -> tuple:
    """The reference's float32 AdamW math: the new ``(p, m, v)``."""
    p = p * decay
    m = torch.lerp(m, g, w1)
    v = torch.addcmul(v * b2, w2 * g, g)
    denom = v.double().sqrt().float() / bc2_sqrt + eps  # correctly rounded, as the reference
    return p + neg_step * m / denom, m, v


def _adamw_slice(param, grad, exp_avg, exp_avg_sq, at: slice, sc: tuple) -> None:
    """The step of the buffers' elements ``at``, in place, with one adapter group's scalars ``sc``."""
    decay, w1, w2, b2, neg_step, bc2_sqrt, eps, _ = sc
    p, m, v = _adamw_math(param[at].float(), grad[at].float(), exp_avg[at].float(), exp_avg_sq[at].float(),
                          decay, w1, w2, b2, neg_step, bc2_sqrt, eps)
    for buf, x in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        buf[at].copy_(x)
