"""One shrink pass for LoRA Linear siblings that read the same input (``q/k/v_proj``, ``gate/up_proj``).

A Llama attention block calls ``q_proj``, ``k_proj`` and ``v_proj`` on the very same tensor, its MLP ``gate_proj``
and ``up_proj``. Their shrinks ``x -> h`` can then run as one pass over the siblings' A weights stacked per adapter
(the kernels' ``stack_num`` layout, see ``kernels/segments.py``): ``h[S, stack_num * max_rank]``, slice ``s`` of a
token of adapter ``a`` at columns ``s*r_a .. (s+1)*r_a``. Each sibling then expands its own slice.

**Groups** (:func:`group_siblings`, at patch time): patched LoRA Linear modules with the same parent module, the same
``in_features`` and the same device -- no name lists. ``o_proj`` joins the attention group by shape; it never shares
because it is never called on the q/k/v input.

**Per call** (:func:`may_share`, then :func:`shared_delta`): a group watches which members are called on one input
tensor (by identity, a weak reference, so no activation is kept alive). What it saw in one forward call is what it
stacks in the next (``Router.generation`` counts forward calls): the first member called on an input runs one shrink
for itself and the members seen with it last time that still qualify for this call -- the same adapters with equal
ranks and dropout rates, no active dropout (unless ``share_dropout``, below), no ``lora_bias``, no LoRA variant, one
A-weight dtype, weights on the input's device -- and leaves their slices pending; a member called later on the same
input takes its slice. Anything else (the first forward call, a member that does not qualify, another input) runs
the per-module path (``FusedLinearDelta`` where the base allows, else ``LoraDelta``), which is always correct. The
choice depends only on the previous forward call, so gradient-checkpointing recomputation (inside ``backward()``,
before the next forward call) takes the same path as the forward it replays, as non-reentrant checkpointing
requires.

**Members**: a member whose base is a plain frozen ``nn.Linear`` (``patching._fused_base``) runs
:class:`StackedLinear` -- its expand writes the delta and cuBLAS accumulates the base GEMM into it, as
``function.FusedLinearDelta`` does; any other member adds its delta to its base layer's output
(:class:`StackedExpand`). One stack may mix both.

**Dropout**: PEFT draws an independent mask per module, so siblings under dropout do not read the same ``x~``. With
``patch(..., share_dropout=True)`` the stacked shrink reads ``x`` once and gives each slice its own mask (key
``kernels.dropout.slice_seed(seed, s)``; one seed per stack, drawn from the CPU RNG as the per-module path draws
its own); its backward regenerates them. Off by default: on an H200 the per-slice masks made the stacked kernels
slower than one shrink per sibling (``docs/benchmarks.md``), so siblings under active dropout take the per-module
path; in eval, or at dropout 0, they share.

**Backward**: each member's expand backward writes its slice of ``dh`` into one buffer of the stack (scoped to the
running backward pass) and returns no gradient for ``h``; autograd runs the shrink's backward after every expand
backward that feeds it, and one ``shrink_bwd`` gives ``dx`` (summed over the slices) and every member's ``dA``.
Fused members hand their ``dy`` to the stack instead of returning a ``dx``: the shrink backward accumulates each
``dy W`` into the ``dx`` it wrote (``addmm_``, beta 1), so q/k/v leave one ``dx`` tensor, not three to be summed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .function import (
    _grad_dtype,
    _split_grads,
    as_rows,
    get_backend,
    linear_with_delta,
    lora_dropout_rate,
    own_storage,
    run,
)
from .kernels.segments import AdapterTable, Segments

GROUP_ATTR = "_fml_group"  # on a member module: (its SiblingGroup, its index in the group)


class _Stack:
    """One stacked shrink: the layout its backward and its members' expand backwards share (kept on their ctx).

    Holds no tensor of the forward graph (``h`` would make a reference cycle through the shrink's own ctx); only the
    ``dh`` buffer that the expand backwards fill during one backward pass.
    """

    def __init__(self, backend, segs: Segments, table: AdapterTable, num: int, block_ranks: list, a_dtypes: list,
                 y_dtype: torch.dtype, seed: Optional[int] = None):
        self.backend = backend
        self.segs = segs
        self.table = table  # the leader's: ranks/offsets and dropout rates (equal for every member)
        self.seed = seed  # dropout: slice s draws its own mask (kernels.dropout.slice_seed); None without dropout
        self.num = num  # stack_num: members sharing the shrink
        self.block_ranks = block_ranks  # rows of each A weight in the stacked A_cat (adapter-major)
        self.a_dtypes = a_dtypes
        self.y_dtype = y_dtype  # every member's base output has it (so one dh dtype)
        self._dh: Optional[torch.Tensor] = None
        self._dh_task: Optional[int] = None
        self._written: set = set()  # slices whose expand backward wrote into _dh
        self._base_dx: list = []  # (dy, W) of fused members: dy W is added into the shrink backward's dx

    def dh(self, index: Optional[int] = None) -> torch.Tensor:
        """The running backward pass's ``dh`` buffer, zeros until the members' expand backwards write their slices
        (``index``: the slice the caller writes).

        Keyed by the autograd graph task, so a pass that stops short of the shrink (``autograd.grad`` for B weights
        only) leaves nothing behind for the next one.
        """
        task = torch._C._current_graph_task_id()
        if self._dh is None or self._dh_task != task:
            acc = torch.float64 if self.y_dtype == torch.float64 else torch.float32
            width = self.num * self.table.max_rank
            self._dh = torch.zeros(self.segs.num_tokens, width, dtype=acc, device=self.table.ranks.device)
            self._dh_task = task
            self._written = set()
            self._base_dx = []
        if index is not None:
            self._written.add(index)
        return self._dh

    def add_base_dx(self, dy: torch.Tensor, W: torch.Tensor) -> None:
        """A fused member's base part of ``dx`` (``dy W``), accumulated by the shrink backward of this pass."""
        self.dh()  # scopes the list to the running backward pass, as the dh buffer
        self._base_dx.append((dy, W))

    def take_dh(self) -> tuple:
        """``(dh, slices written, [(dy, W) of fused members])`` for the shrink backward; releases the buffers."""
        dh = self.dh()
        written, base_dx = self._written, self._base_dx
        self._dh = self._dh_task = None
        self._written, self._base_dx = set(), []
        return dh, written, base_dx


@dataclass
class _Slice:
    """One member's part of a stack: its slice index, its adapter table (its own scales) and ranks."""

    stack: _Stack
    index: int
    table: AdapterTable
    ranks: tuple  # host ranks of the member's adapters, slot order


class StackedShrink(torch.autograd.Function):
    """``h = x A_stackedᵀ`` for a mixed batch: inputs ``x[..., K]``, the :class:`_Stack`, then the members' A
    weights adapter-major (``A[a0][m0], A[a0][m1], ..., A[a1][m0], ...``); output ``h[S, stack_num*max_rank]``."""

    @staticmethod
    def forward(ctx, x_in, stack: _Stack, *a_weights):
        ctx.set_materialize_grads(False)  # the expands pass no gradient for h: dh comes through the stack's buffer
        x = as_rows(x_in)
        A_cat = torch.cat(a_weights)
        h = stack.backend.shrink(x, A_cat, stack.segs, stack.table, stack.num, stack.seed)
        ctx.save_for_backward(x, A_cat)
        ctx.stack = stack
        ctx.x_shape = x_in.shape
        return h

    @staticmethod
    def backward(ctx, _dh_unused):
        stack: _Stack = ctx.stack
        x, A_cat = ctx.saved_tensors
        need_dx = ctx.needs_input_grad[0]
        dh, written, base_dx = stack.take_dh()
        dx, dA = stack.backend.shrink_bwd(dh, x, A_cat, stack.segs, stack.table, stack.num, stack.seed, need_dx,
                                          grad_dtype=_grad_dtype(stack.a_dtypes))
        if need_dx:
            for dy, W in base_dx:  # fused members' base GEMMs, accumulated by cuBLAS (beta 1): no dx per member
                dx.addmm_(dy, W)
        grads = [None] * len(stack.a_dtypes)
        if any(ctx.needs_input_grad[2:]):
            grads = _split_grads(dA, stack.block_ranks, stack.a_dtypes, dim=0)
            # a member whose output this pass did not reach gets no gradient, as on the per-module path
            grads = [g if i % stack.num in written else None for i, g in enumerate(grads)]
        return (dx.view(ctx.x_shape) if dx is not None else None, None, *grads)


class StackedExpand(torch.autograd.Function):
    """``y += scale_a · h[t, slice] B_aᵀ`` in place for one member: inputs ``h`` (from :class:`StackedShrink`), the
    member's base output ``y[..., N]`` (contiguous), its :class:`_Slice`, then its B weights in slot order."""

    @staticmethod
    def forward(ctx, h, y_in, part: _Slice, *b_weights):
        stack = part.stack
        y = y_in.view(-1, y_in.shape[-1])
        B = stack.backend.weights(b_weights, part.table, 1)
        stack.backend.expand(h, B, stack.segs, part.table, y, stack.num, part.index)
        ctx.mark_dirty(y_in)
        ctx.save_for_backward(h, *b_weights)  # the backward reads the weights as the forward did
        ctx.part = part
        ctx.b_dtypes = [w.dtype for w in b_weights]
        return y_in

    @staticmethod
    def backward(ctx, dy_in):
        part: _Slice = ctx.part
        stack = part.stack
        h, *b_weights = ctx.saved_tensors
        need_dh, need_w = ctx.needs_input_grad[0], any(ctx.needs_input_grad[3:])
        grads = [None] * len(ctx.b_dtypes)
        if need_dh or need_w:
            dy = dy_in.reshape(-1, dy_in.shape[-1]).contiguous()
            dh = stack.dh(part.index) if need_dh else None  # this slice's columns go into the shared buffer
            B = stack.backend.weights(b_weights, part.table, 1)
            _, dB = stack.backend.expand_bwd(dy, h, B, stack.segs, part.table, stack.num, part.index, dh=dh,
                                             grad_dtype=_grad_dtype(ctx.b_dtypes))
            if need_w:
                grads = _split_grads(dB, part.ranks, ctx.b_dtypes, dim=1, n_rows=dy.shape[1])
        return (None, dy_in, None, *grads)


class StackedLinear(torch.autograd.Function):
    """``y = x Wᵀ (+ b) + scale_a · h[t, slice] B_aᵀ`` for one member whose base is a frozen ``nn.Linear`` (see
    ``patching._fused_base``): inputs ``h`` (from :class:`StackedShrink`), the member's input ``x[..., K]`` (the
    stack's), ``W``, ``b`` (or ``None``), its :class:`_Slice`, then its B weights in slot order.

    As in ``function.FusedLinearDelta``, the expand writes the delta (write mode, bias folded in) and cuBLAS
    accumulates the base GEMM into it. Backward gives ``dB`` and the member's ``dh`` slice; the base part of ``dx``
    (``dy W``) goes to the stack, whose shrink backward accumulates it into the one ``dx`` it writes -- no ``dx``
    tensor per member and no autograd sum of them (hence no gradient for ``x`` here).
    """

    @staticmethod
    def forward(ctx, h, x_in, W, bias, part: _Slice, *b_weights):
        stack = part.stack
        x = as_rows(x_in)
        B = stack.backend.weights(b_weights, part.table, 1)
        y = linear_with_delta(stack.backend, x, W, bias, h, B, stack.segs, part.table, stack.num, part.index)
        ctx.save_for_backward(h, W, *b_weights)  # the backward reads the weights as the forward did
        ctx.part = part
        ctx.b_dtypes = [w.dtype for w in b_weights]
        return y.view(*x_in.shape[:-1], W.shape[0])

    @staticmethod
    def backward(ctx, dy_in):
        part: _Slice = ctx.part
        stack = part.stack
        h, W, *b_weights = ctx.saved_tensors
        needs = ctx.needs_input_grad
        need_dh, need_dx, need_w = needs[0], needs[1], any(needs[5:])
        grads = [None] * len(ctx.b_dtypes)
        if need_dh or need_dx or need_w:
            dy = dy_in.reshape(-1, dy_in.shape[-1]).contiguous()
            if need_dh or need_w:
                dh = stack.dh(part.index) if need_dh else None
                B = stack.backend.weights(b_weights, part.table, 1)
                _, dB = stack.backend.expand_bwd(dy, h, B, stack.segs, part.table, stack.num, part.index, dh=dh,
                                                 grad_dtype=_grad_dtype(ctx.b_dtypes))
                if need_w:
                    grads = _split_grads(dB, part.ranks, ctx.b_dtypes, dim=1, n_rows=W.shape[0])
            if need_dx:
                stack.add_base_dx(dy, W)
        return (None, None, None, None, None, *grads)


@dataclass
class _Pending:
    """A member's slice of a stack computed by an earlier member on the same input."""

    part: _Slice  # its table is the one the leader checked (a cached object: identity means unchanged)
    h: torch.Tensor
    plan: object


class SiblingGroup:
    """Patched LoRA Linear siblings (same parent, ``in_features`` and device) that may share one shrink per input.

    State, all per forward call: the members seen on the current input (``_observed``), what each member was seen
    with (``_seen``, this forward call; ``_learned``, the previous one) and the slices waiting for members
    (``_pending``).
    """

    def __init__(self, members: list, names: list, table_of: Callable):
        self.members = tuple(members)
        self.names = tuple(names)
        self._table_of = table_of  # patching._layer_table: (layer, plan, device) -> (table, present, bias_row)
        self._generation: Optional[int] = None
        self._learned: dict = {}
        self._seen: dict = {}
        self._input = None
        self._observed: list = []
        self._pending: dict = {}

    def __getstate__(self):  # copies (deepcopy, pickle) keep the grouping, not the per-call state
        return {"members": self.members, "names": self.names, "table_of": self._table_of}

    def __setstate__(self, state):
        self.__init__(list(state["members"]), list(state["names"]), state["table_of"])

    def seen_together(self) -> list:
        """Members called on one input in the current (or last) forward call, as tuples of names (2 or more)."""
        unique = {id(obs): obs for obs in self._seen.values()}.values()
        return [tuple(self.names[i] for i in obs) for obs in unique if len(obs) > 1]

    def _observe(self, i: int, x: torch.Tensor, generation: int) -> None:
        if generation != self._generation:  # a new forward call: what the last one saw is what this one stacks
            self._learned = {m: tuple(obs) for m, obs in self._seen.items()}
            self._seen = {}
            self._input, self._observed, self._pending = None, [], {}
            self._generation = generation
        if self._input is None or self._input() is not x or i in self._observed:
            self._input, self._observed, self._pending = weakref.ref(x), [], {}
        self._observed.append(i)
        self._seen[i] = self._observed  # shared list: later members on this input extend it

    def may_share(self, i, x, table, present, router) -> bool:
        """Records member ``i``'s call on ``x`` and says whether :meth:`forward` may stack it: a slice is pending
        for it, or it qualifies and was seen with siblings in the last forward call. A ``True`` is followed by
        :meth:`forward` (a ``False`` lets the caller run the fused per-module path instead)."""
        self._observe(i, x, router.generation)
        if not present:
            return False
        if i in self._pending:
            return True
        layer = self.members[i]
        return (any(c != i for c in self._learned.get(i, ()))
                and _qualifies(layer, table, present, x.device, router))

    def forward(self, i, x, result, plan, table, present, router, base=None) -> Optional[torch.Tensor]:
        """Member ``i``'s output through a stack, or ``None`` for the per-module path. Runs after :meth:`may_share`,
        which recorded this call. ``result`` is the member's base output, to which the delta is added; or ``None``
        with ``base``, the member's frozen ``nn.Linear``, whose GEMM then runs with the member's expand
        (:class:`StackedLinear`)."""
        if not present:
            return None
        y_dtype = x.dtype if result is None else result.dtype
        pending = self._pending.pop(i, None)
        if pending is not None:
            stack = pending.part.stack
            if pending.plan is plan and pending.part.table is table and y_dtype == stack.y_dtype:
                return _expand(pending.h, x, result, base, pending.part, self.members[i], present)
        return self._lead(i, x, result, base, y_dtype, plan, table, present, router)

    def _lead(self, i, x, result, base, y_dtype, plan, table, present, router) -> Optional[torch.Tensor]:
        """Run one shrink for member ``i`` and the not yet called members seen with it last time that qualify."""
        layer = self.members[i]
        if not _qualifies(layer, table, present, x.device, router):
            return None
        a_dtypes = tuple(layer.lora_A[n].weight.dtype for n in present)
        rates = _dropout_rates(layer, present)
        joined = []
        for c in self._learned.get(i, ()):
            if c == i or c in self._observed or c in self._pending:
                continue
            member = self.members[c]
            if member.disable_adapters or member.merged or not _same_rank(member, layer, present):
                continue
            c_table, c_present, _ = self._table_of(member, plan, x.device)
            if (c_present == present and _qualifies(member, c_table, present, x.device, router)
                    and tuple(member.lora_A[n].weight.dtype for n in present) == a_dtypes
                    and _dropout_rates(member, present) == rates):
                joined.append((c, c_table))
        if not joined:
            return None
        slices = [i] + [c for c, _ in joined]
        x_in = x
        if x.dtype == torch.float32 and a_dtypes[0] in (torch.float16, torch.bfloat16) and len(set(a_dtypes)) == 1:
            x = x.to(a_dtypes[0])  # as the per-module path (and PEFT) does; a fused base never sees this cast
        ranks = tuple(layer.r[n] for n in present)
        # CPU RNG as the per-module path: no device sync, and checkpoint recomputation redraws the same seed
        seed = int(torch.randint(0, 2**31 - 1, (1,))) if table.has_dropout else None
        stack = _Stack(
            get_backend(router.backend, x.device), plan.segments, table, len(slices),
            [r for r in ranks for _ in slices], [dt for dt in a_dtypes for _ in slices], y_dtype, seed,
        )
        weights = [self.members[m].lora_A[n].weight for n in present for m in slices]
        h = run(StackedShrink, x, stack, *weights)
        for s, (c, c_table) in enumerate(joined, start=1):
            self._pending[c] = _Pending(_Slice(stack, s, c_table, ranks), h, plan)
        return _expand(h, x_in, result, base, _Slice(stack, 0, table, ranks), layer, present)


def _same_rank(member, layer, present) -> bool:
    return all(n in member.r and member.r[n] == layer.r[n] for n in present)


def _qualifies(layer, table: AdapterTable, present: list, device, router) -> bool:
    """A member may take part in a stack this call: no lora_bias or variant, weights on the input's device, and no
    active dropout unless ``patch(..., share_dropout=True)``."""
    return ((router.share_dropout or not table.has_dropout) and not layer.lora_variant
            and not any(layer.lora_bias[n] for n in present) and layer.lora_A[present[0]].weight.device == device)


def _dropout_rates(layer, present) -> tuple:
    """The dropout rate each present adapter applies in this call (0 when its dropout is off), as the layer table
    holds them: members stack only with equal rates, since the stack's shrink reads one table's rates."""
    drops = layer._modules["lora_dropout"]._modules
    return tuple(lora_dropout_rate(drops[n]) for n in present)


def _expand(h, x, result, base, part: _Slice, layer, present) -> torch.Tensor:
    b_weights = [layer.lora_B[n].weight for n in present]
    if result is None:
        return run(StackedLinear, h, x, base.weight, base.bias, part, *b_weights)
    return run(StackedExpand, h, own_storage(result), part, *b_weights)  # the delta is added in place


def may_share(layer, x, table, present, router) -> bool:
    """Whether this call of ``layer`` may go through :func:`shared_delta` (see ``SiblingGroup.may_share``). Called
    first for every routed call of a patched LoRA Linear (it records what it sees): a ``False`` lets the call run
    the fused per-module path, a ``True`` is followed by :func:`shared_delta`."""
    if not router.share_shrink:
        return False
    entry = layer.__dict__.get(GROUP_ATTR)
    if entry is None:
        return False
    group, i = entry
    return group.may_share(i, x, table, present, router)


def shared_delta(layer, x, result, plan, table, present, router, base=None) -> Optional[torch.Tensor]:
    """``result`` plus ``layer``'s LoRA delta through a shrink shared with its siblings (with ``result=None``: the
    output of ``base``, the layer's frozen ``nn.Linear``, fused with the delta), or ``None`` when this call runs the
    per-module path. Called after :func:`may_share` returned ``True`` in the same layer call."""
    entry = layer.__dict__.get(GROUP_ATTR)
    if entry is None or not router.share_shrink:
        return None
    group, i = entry
    return group.forward(i, x, result, plan, table, present, router, base)


def group_siblings(named_layers: list, table_of: Callable) -> list:
    """Form the :class:`SiblingGroup` s of ``(name, layer)`` pairs (patched LoRA Linear modules): same parent module,
    ``in_features`` and device. Sets each member's ``GROUP_ATTR``; returns the groups as tuples of names."""
    by_key: dict = {}
    for name, layer in named_layers:
        parent = name.rpartition(".")[0]
        device = layer.get_base_layer().weight.device
        by_key.setdefault((parent, layer.in_features, device), []).append((name, layer))
    groups = []
    for members in by_key.values():
        if len(members) < 2:
            continue
        names = [n for n, _ in members]
        group = SiblingGroup([m for _, m in members], names, table_of)
        for i, (_, layer) in enumerate(members):
            layer.__dict__[GROUP_ATTR] = (group, i)
        groups.append(tuple(names))
    return groups


def shared_siblings(model: torch.nn.Module) -> list:
    """Tuples of module names that were called on one input in ``model``'s last routed forward call: the siblings
    whose shrink the next forward call stacks where they qualify (see the module docstring)."""
    out, done = [], set()
    for module in model.modules():
        entry = module.__dict__.get(GROUP_ATTR)
        if entry is not None and id(entry[0]) not in done:
            done.add(id(entry[0]))
            out += entry[0].seen_together()
    return out
