"""Slot-stacked adapter storage: a patched model's LoRA Linear weights, all adapters, in a few flat buffers.

With many resident adapters the cost of a step is host work per adapter tensor: each adapter is two tensors per
LoRA layer (112 on a Llama-shaped model of 8 layers), and each of them went through autograd's per-input
bookkeeping, a gradient split and the optimizer's per-tensor work. An :class:`AdapterStore` removes that:

* **Storage.** Per ``(dtype, device)`` one flat :class:`Arena`. Per patched layer one region with room for ``cap``
  rank-rows: a block ``A[cap, K]`` -- adapter ``a``'s ``[r_a, K]`` rows at its offset, the kernels' ``A_cat`` -- and a
  block ``B[cap * N]`` -- adapter ``a``'s ``[N, r_a]`` weight contiguous at ``N * offset``, the layout the expand
  backward writes ``dB`` in. The offsets are the store's (:class:`LayerSlots`: a layer call takes the layer state's
  adapter table with them, ``total_rank = cap``); rows no slot points at (holes an adapter left, free rows) are
  never read. PEFT's own parameters
  stay the model's parameters (names, ``state_dict``, ``save_pretrained``) and share the arena's memory: their
  ``.data`` is their piece of it, so an update of either is an update of both.
* **Autograd.** A layer call takes the layer's two blocks as two leaf tensors (:class:`LayerSlots`), whatever the
  number of adapters; in eager mode its backward adds the gradients of the adapters with rows in the batch into the
  gradient arena where they lie (the leaves' ``.grad`` are views of it, as are the parameters' ``.grad``:
  ``clip_grad_norm_`` and any code reading ``p.grad`` see the gradients) and gives the leaves none -- a leaf's
  gradient is every adapter of the layer, the registry's size -- running the leaves' hooks itself. Traced by
  ``torch.compile``, under ``torch.autograd.grad`` or ``create_graph`` it returns each block's whole gradient
  instead, which autograd adds into the arena (or hands to the caller).
* **Optimizer.** :class:`fast_multilora.optim.AdamW` steps each arena in one launch (per-adapter hyperparameters from
  its param groups); adapters that were in no batch since the last ``zero_grad`` are not stepped (``seen``), as an
  adapter without gradients is not stepped by ``torch.optim``.

The store is built by that optimizer (``AdapterStore.of(model)``). It follows the model at the next forward call,
by the layers that changed (:meth:`AdapterStore.layout`): an adapter added (``add_adapter``, ``load_adapter``,
``fast_multilora.add_adapters``) takes a hole of its rank or the free rows of each of its layers' regions (a full
region moves, as one block, to one half as large again; the arena grows in place), one deleted leaves holes, and the
gradients and optimizer states of the adapters that stay (``Arena.states``) stay where they are -- so adding or
deleting one adapter writes its own pieces, whatever the registry. A compact re-layout of everything runs when
given-up regions make a third of an arena. MoE expert wrappers (``fast_multilora.moe``) are layers like the others:
an adapter of rank ``r`` on ``E`` experts is held as one of rank ``E * r`` in PEFT's own layout (``lora_B``'s
columns expert-strided), which the kernels read as it is (``AdapterTable.experts``). Layers it cannot hold
(``lora_bias``, mixed adapter dtypes or devices within a layer, PEFT's fallback layers, FSDP2's sharded parameters)
keep their own parameters and take the per-parameter path (the optimizer steps them with torch's AdamW math). Under
``DistributedDataParallel`` the store's parameters are left out of DDP's reducer (all but one anchor layer's) and the
store all-reduces its gradient arenas once per synchronised backward (``fast_multilora.ddp``); a layer whose
parameters DDP does reduce takes the per-parameter path, on which their gradients still land in the gradient arena
(their ``.grad`` are views of it). Under FSDP2 the store's parameters are left out of the sharding
(``fully_shard(..., ignored_params=fast_multilora.fsdp_ignored_params(model))``) and reduced by the store likewise;
sharding them takes their layers out of the store with a warning (their optimizer states start over).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import operator
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from .ddp import StoreSync, mark_model
from .kernels.segments import to_device
from .plan import CHANGES, FULL

_DATA_PTR = torch.Tensor.data_ptr
_PARAMS = operator.attrgetter("_parameters")
_WEIGHT = operator.itemgetter("weight")
_CELL_RANK, _CELL_OFFSET = operator.itemgetter(1), operator.itemgetter(2)
_CELL_A, _CELL_B = operator.itemgetter(3), operator.itemgetter(4)


def _weights(mods: dict, names) -> list:
    """``mods[n]._parameters["weight"]`` for each name (C-level maps: no Python loop per adapter)."""
    return list(map(_WEIGHT, map(_PARAMS, map(mods.__getitem__, names))))
_TENSOR_REQUIRES_GRAD = torch._C.TensorBase.requires_grad  # the C attribute (get / set)
_REQUIRES_GRAD = _TENSOR_REQUIRES_GRAD.__get__  # (a held parameter's own property would be a Python call)
_GRAD = operator.attrgetter("grad")
_HOLE = torch.empty(0)  # a free index's entry in a store's ``_held`` and ``_views`` (no gradient, no flag)


# The ids of held parameters whose ``requires_grad`` was set, in order: a store reads the entries that came since its
# last read (``AdapterStore.sync_requires_grad``), so a flag change costs the flags changed, not the registry. The log
# is cleared when it grows long; a store whose last read is older than that reads every flag.
_FLIPS: list = []
_FLIPS_AT = [0]  # the log position of ``_FLIPS[0]``
_FLIPS_MAX = 1 << 16


def _flipped(p) -> None:
    CHANGES[0] += 1
    if len(_FLIPS) >= _FLIPS_MAX:
        _FLIPS_AT[0] += len(_FLIPS)
        _FLIPS.clear()
    _FLIPS.append(id(p))


class _HeldParameter(torch.nn.Parameter):
    """The class of a parameter while an adapter store holds it: a ``torch.nn.Parameter`` whose ``requires_grad``
    changes (``requires_grad_``, assignment, ``Module.requires_grad_``, PEFT's ``set_requires_grad``) are reported
    (``plan.CHANGES``, and the parameter in ``_FLIPS``), so a forward call reads the flags of the parameters changed
    only -- reading every held flag costs ~0.1-0.3 us per parameter (cache misses), ~10 ms per forward at 256
    adapters x 56 layers. The class goes back to
    ``Parameter`` when the parameter leaves the store or the model is unpatched."""

    __slots__ = ()

    def requires_grad_(self, requires_grad: bool = True):
        _flipped(self)
        return super().requires_grad_(requires_grad)

    @property
    def requires_grad(self):
        return _TENSOR_REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value):
        _flipped(self)
        _TENSOR_REQUIRES_GRAD.__set__(self, value)


_PARAMETER_TYPES = (torch.nn.Parameter, _HeldParameter)


def _register_foreach_type() -> bool:
    """Let ``torch.optim`` take its fast paths for held parameters. Its optimizers pick the foreach / fused
    implementation only for parameters whose ``type()`` is in ``torch.optim.optimizer._foreach_supported_types``
    (``[Tensor, Parameter]``; ``torch.distributed.tensor`` appends ``DTensor`` the same way); any other class silently
    gets the single-tensor loop -- ~10 launches per parameter per step, which made a default ``torch.optim.AdamW`` step
    host-bound (169 vs 108 ms with ``fused=True``, H200, 896 parameters). Where a torch version has no such list the
    class is not swapped at all (``_hold`` does nothing) and a training forward reads every held flag instead."""
    try:
        from torch.optim import optimizer as _optimizer
    except ImportError:  # pragma: no cover
        return False
    types = getattr(_optimizer, "_foreach_supported_types", None)
    if not isinstance(types, list):
        return False
    if _HeldParameter not in types:
        types.append(_HeldParameter)
    return True


SWAP_CLASS = _register_foreach_type()  # False: held parameters keep their class, flags read per training forward


def _hold(p) -> None:
    if SWAP_CLASS and type(p) is torch.nn.Parameter:
        p.__class__ = _HeldParameter


def release(params, hooks: dict) -> None:
    """Give parameters that left a store (or a model being unpatched) their ``Parameter`` class back, and remove their
    post-accumulate-grad hooks (``hooks``: the store's, id -> handle; see :func:`_hook_accumulation`)."""
    for p in params:
        if type(p) is _HeldParameter:
            p.__class__ = torch.nn.Parameter
        h = hooks.pop(id(p), None)
        if h is not None:
            h.remove()


# The ids of held parameters into whose ``.grad`` autograd accumulated a gradient (their hook, :func:`_touched`): a
# graph that uses the parameter itself -- a regularizer, a penalty on the weights -- rather than the layer calls, which
# take the arena's leaves. A store takes its own at its next ``prepare_grads``: such a gradient counts for its adapter
# whether or not the adapter has rows in the batch, as under stock PEFT.
_TOUCHED: set = set()


def _touched(p) -> None:
    _TOUCHED.add(id(p))


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off in the block (as it was after): code that makes thousands of objects
    (modules, parameters, hook handles) in a model of a million would otherwise run collections that rescan every
    object -- most of the time of ``nn.Module.__init__`` in a large model, ~60 us a module."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _hook_accumulation(params, hooks: dict) -> None:
    """Each of ``params`` not yet in ``hooks`` (id -> handle) gets :func:`_touched` as its post-accumulate-grad hook
    (public API; ~3 us per parameter, once while held: a layout's new parameters only)."""
    new = [p for p in params if id(p) not in hooks]
    if not new:
        return
    with gc_paused():
        for p in new:
            try:
                hooks[id(p)] = p.register_post_accumulate_grad_hook(_touched)
            except RuntimeError:  # (a frozen one: torch registers on a tensor that requires a gradient; the hook
                _TENSOR_REQUIRES_GRAD.__set__(p, True)  # stays through flag changes)
                try:
                    hooks[id(p)] = p.register_post_accumulate_grad_hook(_touched)
                finally:
                    _TENSOR_REQUIRES_GRAD.__set__(p, False)


ALIGN = 64  # elements: every block starts 256-byte aligned for fp32 (the kernels' in-place reads need 16)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _piece(buf: torch.Tensor, start: int, shape: tuple) -> torch.Tensor:
    """A tensor on ``buf``'s memory at element ``start`` (not a view: no ``_base``, its own autograd identity)."""
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    empty = functools.partial(torch.empty, 0, dtype=buf.dtype, device=buf.device)
    return _piece_at(empty, buf.untyped_storage(), buf.storage_offset() + start, tuple(shape), tuple(reversed(strides)))


def _piece_at(empty, storage, offset: int, shape: tuple, stride: tuple) -> torch.Tensor:
    """Every piece the store makes: :func:`_piece` with its lookups (storage, offset, strides, an ``empty`` of the
    buffer's dtype and device) done by the caller, once per layer where it makes many (the store's re-layout makes
    ~14k pieces a paged step on a 56-layer model)."""
    return empty().set_(storage, offset, shape, stride)


def _positions(seq) -> dict:
    """``{item: its index}`` of a layer's adapter names: the positions of changed adapters by lookup (``tuple.index``
    per name is quadratic in a paged step's ~128 changes of ~64-128 adapters in each layer)."""
    return {item: i for i, item in enumerate(seq)}


def _write(ops: list, arena) -> None:
    """Run ``ops`` -- ``(piece, source)``: ``piece.copy_(source)``; ``(piece, None)``: ``piece.zero_()`` -- as one
    ``torch._foreach_copy_`` and one ``torch._foreach_zero_`` (a few launches for a layer's new adapters, where one
    per tensor cost a paged step 14 336 launches), or in order one by one when a source lies in ``arena``'s own
    buffers (then a write may feed a later read)."""
    if not ops:
        return
    mine = {t.untyped_storage().data_ptr() for t in (arena.data, arena.grad, *arena.states.values())}
    copies = [(d, s) for d, s in ops if s is not None]
    if any(s.untyped_storage().data_ptr() in mine for _, s in copies):
        for d, s in ops:
            d.zero_() if s is None else d.copy_(s)
        return
    zeros = [d for d, s in ops if s is None]
    if copies:
        torch._foreach_copy_([d for d, _ in copies], [s for _, s in copies])
    if zeros:
        torch._foreach_zero_(zeros)


def _room(ranks) -> int:
    """The rank-rows of a new layer region: its adapters' and an eighth more, so that the next adapters join without
    moving it."""
    total = sum(ranks)
    return total + -(-total // 8)


def _grow(t: torch.Tensor, numel: int) -> None:
    """Grow the flat tensor ``t`` (storage offset 0) to ``numel`` elements in place: its storage is resized, so every
    tensor on it (parameters' ``.data``, ``.grad`` views, leaves, optimizer states) follows; the new tail is zero."""
    old = t.numel()
    storage = t.untyped_storage()
    storage.resize_(numel * t.element_size())
    t.set_(storage, 0, (numel,), (1,))
    t[old:].zero_()


@dataclass(eq=False)
class Arena:
    """One flat buffer of weights per ``(dtype, device)``, its gradient, and optimizer states of the same layout.

    Each held layer owns one region ``[A rows | B block]`` with room for ``cap`` rank-rows; regions are handed out at
    ``used`` and the buffers grow by doubling (:func:`_grow`), so adding a region costs its own size amortised. A
    region a layer gave up (it moved to a larger one) is ``dropped`` until a compaction (:meth:`AdapterStore.layout`
    with ``full``) lays everything out afresh."""

    dtype: torch.dtype
    device: torch.device
    data: torch.Tensor
    grad: torch.Tensor
    states: dict = field(default_factory=dict)  # name -> flat tensor (e.g. AdamW's exp_avg), carried on re-layout
    blocks: dict = field(default_factory=dict)  # param -> (start, numel, param) of every parameter held
    used: int = 0  # elements handed out to regions
    dropped: int = 0  # elements of regions no layer uses any more

    def region(self, numel: int) -> int:
        """Start of a new region of ``numel`` elements; the buffers double when they are full."""
        start, need = self.used, self.used + numel
        if need > self.data.numel():
            cap = max(need, self.data.numel() * 3 // 2)
            for t in (self.data, self.grad, *self.states.values()):
                _grow(t, cap)
        self.used = need
        return start


@dataclass(eq=False)
class LayerSlots:
    """One layer's adapters in the store: the two leaf tensors its calls take, and where their pieces are.

    The layer's region holds ``cap`` rank-rows: ``A[cap, K]`` at ``a0`` and the packed ``B`` block (``[N, r]`` per
    adapter, at ``b0 + N * offset``) after it. ``cells`` lists the region's rank-rows in row order: an adapter's
    ``[name, rank, offset, A param, B param]`` or a hole ``[None, rank, offset, None, None]`` an adapter left, reused
    by the next adapter of the same rank; rows from ``end`` to ``cap`` are free. The layer's :attr:`table` is its
    ``LayerState``'s adapter table with the offsets of the cells and ``total_rank = cap``: the kernels read each
    slot's rows at its offset, and no slot points at a hole."""

    names: tuple  # adapters, slot order (the layer table's)
    ranks: tuple
    K: int
    N: int
    a_leaf: torch.Tensor  # [cap, K]
    b_leaf: torch.Tensor  # [cap * N]
    params: list  # (A params..., B params...) slot order (lists: a layout edits them in place at the changed slots)
    key: tuple  # _layer_key when laid out
    state: object  # the layer's patching.LayerState it was checked against (a new one: the key is checked again)
    held_idx: list = field(default_factory=list)  # each parameter's index in the store's ``_held`` (params' order)
    table: object = None  # kernels.segments.AdapterTable: the state's, with the cells' offsets
    arena: Optional[Arena] = None
    a0: int = 0
    b0: int = 0
    cap: int = 0
    end: int = 0
    cells: list = field(default_factory=list)
    views: list = field(default_factory=list)  # (A grad pieces..., B grad pieces...) slot order
    offsets: list = field(default_factory=list)  # the present adapters' first rows in the region, slot order
    table_of: tuple = ()  # the host tuples of the state table ``table`` was made from
    by_name: dict = field(default_factory=dict)  # adapter -> its cell
    holes: dict = field(default_factory=dict)  # rank -> the cells of that rank no adapter holds
    # a cell's first row -> (its rank, A's data and gradient pieces, B's), made once per region: the next adapter in
    # that cell (a paged step refills ~64 cells a layer) takes them (two pieces per parameter were a quarter of a
    # paged step's re-layout)
    pieces: dict = field(default_factory=dict)
    lid: int = 0  # id of the layer (the key of its leaves' entries in ``AdapterStore.watch`` and ``leaf_of``)

    # from a layout that edited the layer's slots before (``_place``), until the store's index followed: (the slots
    # before, the positions of their adapters that changed, the positions of those now); and the parameters that left
    edit: Optional[tuple] = None
    left: Optional[list] = None
    split: tuple = ()  # the ranks of the cells, then the free rows: the column blocks of ``B_cat[N, cap]``
    uniform: int = 0  # the one rank of every cell when there is one and the free rows are a multiple of it (else 0)
    # MoE experts (``moe.ProjState``): each cell holds an adapter of rank ``E * r`` in PEFT's layout -- B ``[N, r*E]``
    # with expert ``e`` in the columns ``j*E + e`` -- which the kernels read as it is (``AdapterTable.experts``)
    experts: int = 1
    # per leaf (A, B): the store's hook its gradient runs (AdapterStore._hook), also called by a layer call's backward
    # that adds the gradients into the arena itself (function.LoraLinear); with the leaf's gradient-accumulator node
    on_grad: list = field(default_factory=lambda: [None, None])

    def __getstate__(self):  # a copy's leaves are other tensors, with their own hooks (a copied store lays out again)
        state = dict(self.__dict__)
        state["on_grad"] = [None, None]
        state["pieces"] = {}  # (made again for the copy's arena)
        return state

    def _shape(self, old: Optional["LayerSlots"] = None, k0: int = 0) -> None:
        """:attr:`split` and :attr:`uniform` from the cells (once per layout of the layer, not per call); ``old``:
        the layer's slots before, of the same region, whose first ``k0`` cells are these' first (only the cells
        appended since are read)."""
        free = (self.cap - self.end,) if self.cap > self.end else ()
        if old is not None and old.cap == self.cap and old.uniform:
            new = tuple(map(_CELL_RANK, self.cells[k0:]))
            r = old.uniform
            self.split = old.split[:k0] + new + free
            self.uniform = r if all(map(r.__eq__, new)) and (self.cap - self.end) % r == 0 else 0
            return
        ranks = tuple(map(_CELL_RANK, self.cells))
        self.split = ranks + free
        r = ranks[0] if ranks else 0
        self.uniform = r if r and len(set(ranks)) == 1 and (self.cap - self.end) % r == 0 else 0

    def expected(self, off: Optional[int] = None) -> tuple:
        """Where the parameters' ``.data`` are when they are their pieces (``params`` order; ``off``: the two of the
        adapter whose rows start at ``off``), from the layout and the arena's address now (an arena that grew moved
        every piece of it): a parameter elsewhere had its ``.data`` replaced since."""
        es = self.arena.data.element_size()
        base = self.arena.data.data_ptr()
        a, b, ka, nb = base + es * self.a0, base + es * self.b0, es * self.K, es * self.N
        if off is not None:
            return (a + ka * off, b + nb * off)
        return tuple(map(a.__add__, map(ka.__mul__, self.offsets))) + \
            tuple(map(b.__add__, map(nb.__mul__, self.offsets)))

    def moved(self) -> bool:
        return tuple(map(_DATA_PTR, self.params)) != self.expected()

    def b_cat(self, b_leaf: torch.Tensor) -> torch.Tensor:
        """``B_cat[N, cap]`` from the packed block (the torch backend's and a compiled graph's layout; an experts
        layer's cells expert-major, as its table reads them)."""
        N, E = self.N, self.experts
        r = self.uniform
        if r:
            if E > 1:
                return b_leaf.view(self.cap // r, N, r // E, E).permute(1, 0, 3, 2).reshape(N, -1)
            return b_leaf.view(self.cap // r, N, r).permute(1, 0, 2).reshape(N, -1)
        pieces, off, n_cells = [], 0, len(self.cells)
        for i, r in enumerate(self.split):
            piece = b_leaf[off * N : (off + r) * N]
            if E > 1 and i < n_cells:
                pieces.append(piece.view(N, r // E, E).transpose(1, 2).reshape(N, r))
            else:
                pieces.append(piece.view(N, r))
            off += r
        return torch.cat(pieces, 1)

    def packed_grad(self, dB_cat: torch.Tensor) -> torch.Tensor:
        """``dB_cat[N, cap]`` as the packed block's gradient (flat, adapter ``a``'s ``[N, r_a]`` contiguous; an experts
        layer's in PEFT's layout, :meth:`b_cat` reversed)."""
        N, E = self.N, self.experts
        r = self.uniform
        if r:
            if E > 1:
                return dB_cat.view(N, self.cap // r, E, r // E).permute(1, 0, 3, 2).reshape(-1)
            return dB_cat.view(N, self.cap // r, r).permute(1, 0, 2).reshape(-1)
        n_cells = len(self.cells)
        return torch.cat([g.view(N, E, r // E).transpose(1, 2).reshape(-1) if E > 1 and i < n_cells else g.reshape(-1)
                          for i, (g, r) in enumerate(zip(dB_cat.split(list(self.split), dim=1), self.split,
                                                         strict=True))])


def _layer_key(layer, state, old: Optional["LayerSlots"] = None) -> Optional[tuple]:
    """What a layer's slots depend on, or ``None`` when the store cannot hold the layer. ``old``: the layer's slots;
    their parameters still at their pieces' addresses were checked when they came (only the others are read)."""
    if state is None or state.has_bias or len(set(state.a_dtypes)) != 1:
        return None
    present, ranks = state.present, state.ranks
    params = _weights(layer.lora_A._modules, present) + _weights(layer.lora_B._modules, present)
    ids = tuple(map(id, params))
    ptrs = tuple(map(_DATA_PTR, params))
    if old is not None:
        expected = old.expected()
        if ids == tuple(map(id, old.params)) and ptrs == expected:  # the same weights where the store put them
            return (present, ranks, *old.key[2:6], ids)
        checked = set(zip(map(id, old.params), expected, strict=True))  # only parameters not already checked are read
        suspects = list(itertools.compress(range(len(ids)), map(operator.not_, map(checked.__contains__,
                                                                                    zip(ids, ptrs, strict=True)))))
        # the arena's dtype and device: of the old key while a weight still sits at its piece (not of the old first
        # weight, which may have left: a paged-out adapter's lives in host memory), else of the first weight
        dtype, device = old.key[2:4] if len(suspects) < len(params) else (params[0].dtype, params[0].device)
    else:
        suspects = range(len(params))
        dtype, device = params[0].dtype, params[0].device
    K, N, n = layer.in_features, layer.out_features, len(present)
    for i in suspects:
        if not _holdable(params[i], dtype, device, (ranks[i], K) if i < n else (N, ranks[i - n])):
            return None
    return (present, ranks, dtype, device, K, N, ids)


def _holdable(p, dtype, device, shape) -> bool:
    """Whether parameter ``p`` can be a piece of the arena of ``(dtype, device)`` with ``shape``."""
    return p.dtype == dtype and p.device == device and type(p) in _PARAMETER_TYPES and \
        type(p.data) is torch.Tensor and tuple(p.shape) == shape  # (not e.g. an FSDP2 DTensor)


def _spliced(seq, rm: list, at: list, values) -> list:
    """``seq`` as a list with the items at positions ``rm`` (ascending) taken out, then ``values`` put in at
    positions ``at`` (ascending, in the result): a layer's per-adapter entries after some adapters changed."""
    return _splice_into(list(seq), rm, at, values)


def _spliced_pair(seq, n: int, rm: list, at: list, a_values, b_values) -> tuple:
    """A layer's entries ``seq`` -- ``n`` per adapter of its A parameters, then ``n`` of its B parameters -- with both
    halves spliced as :func:`_spliced` does, as a tuple (one copy of the entries, not one per half and step)."""
    return tuple(_splice_pair_into(list(seq), n, rm, at, a_values, b_values))


def _splice_pair_into(out: list, n: int, rm: list, at: list, a_values, b_values) -> list:
    """:func:`_spliced_pair` in place on the list ``out`` (its entries moved by ``del`` / ``insert``: a shift of the
    pointers, no copy of the entries -- a layer's per-adapter list edited at the changed adapters). Returns ``out``."""
    for i in reversed(rm):
        del out[n + i]
    for i in reversed(rm):
        del out[i]
    for i, v in zip(at, a_values, strict=True):
        out.insert(i, v)
    m = n - len(rm) + len(at)  # (the B half's start now)
    for i, v in zip(at, b_values, strict=True):
        out.insert(m + i, v)
    return out


def _splice_into(out: list, rm: list, at: list, values) -> list:
    """:func:`_spliced` in place on the list ``out``. Returns ``out``."""
    for i in reversed(rm):
        del out[i]
    for i, v in zip(at, values, strict=True):
        out.insert(i, v)
    return out


def _take_back_moved(old: LayerSlots, cells: list, arena: Arena) -> None:
    """A parameter of ``old`` whose ``.data`` was replaced: its new values into its piece, which becomes its
    ``.data`` again."""
    if not old.moved():
        return
    ptrs = dict(zip(map(id, old.params), old.expected(), strict=True))
    K, N, a0, cap = old.K, old.N, old.a0, old.cap
    with torch.no_grad():
        for c in cells:
            if c[0] is None or id(c[3]) not in ptrs:
                continue
            for p, start, shape in ((c[3], a0 + c[2] * K, (c[1], K)),
                                    (c[4], a0 + _aligned(cap * K) + c[2] * N, (N, c[1]))):
                if p.data_ptr() != ptrs[id(p)]:
                    piece = _piece(arena.data, start, shape)
                    piece.copy_(p.data)
                    p.data = piece


def _delta_key(layer, st, old: LayerSlots, names, slot_of: dict) -> Optional[tuple]:
    """:func:`_layer_key` of a layer whose state ``st`` differs from ``old.state`` in adapters ``names`` only: the
    others' entries are ``old``'s key's (spliced at the changed positions: no read of the others' parameters or
    slots), the changed ones read and checked."""
    n, by_name, present = len(old.names), old.by_name, st.present
    old_pos, pos = _positions(old.names), _positions(present)
    rm = sorted(old_pos[nm] for nm in names if nm in by_name)
    a_mods, b_mods = layer.lora_A._modules, layer.lora_B._modules
    new = sorted((nm for nm in names if nm in a_mods and nm in slot_of and nm in pos), key=pos.__getitem__)
    at = list(map(pos.__getitem__, new))
    # the adapters that stay keep their order (else the slot order moved: everything is read)
    if n - len(rm) + len(at) != len(present) or tuple(_spliced(old.names, rm, at, new)) != present:
        return _layer_key(layer, st, old)
    A = [a_mods[nm]._parameters["weight"] for nm in new]
    B = [b_mods[nm]._parameters["weight"] for nm in new]
    # the arena's dtype and device (as in _layer_key): the old key's while an adapter stays, else the first new one's
    dtype, device = old.key[2:4] if n > len(rm) or not A else (A[0].dtype, A[0].device)
    K, N = layer.in_features, layer.out_features
    ranks = st.ranks
    for i, a, b in zip(at, A, B, strict=True):
        if not (_holdable(a, dtype, device, (ranks[i], K)) and _holdable(b, dtype, device, (N, ranks[i]))):
            return None
    ids = _spliced_pair(old.key[6], n, rm, at, map(id, A), map(id, B))
    return (present, ranks, dtype, device, K, N, ids)


def _delta_moves(slots: LayerSlots, st, names) -> bool:
    """Whether the change of adapters ``names`` from ``slots.state`` to ``st`` moves pieces: one came, went, or has
    another rank or weight tensor (a change of scale or dropout only re-tables)."""
    present = st.present
    for name in names:
        cell = slots.by_name.get(name)
        if name not in present:
            if cell is not None:
                return True
            continue
        if cell is None:
            return True
        i = present.index(name)
        if cell[1] != st.ranks[i] or cell[3] is not st.a_modules[i]._parameters["weight"] or \
                cell[4] is not st.b_modules[i]._parameters["weight"]:
            return True
    return False


def _store_table(state, offsets: tuple, cap: int, tables: dict):
    """``state.table`` with the adapters' offsets in the store (``offsets``: the present adapters', slot order) and
    ``total_rank = cap``; layers whose tables are equal share one (``tables``), as their states' tables do. An MoE
    projection's (``moe.ProjState``) table is over virtual (expert, adapter) slots: expert ``e`` of an adapter held
    at row ``off`` with rank ``E * r`` starts at row ``off + e * r``."""
    t = state.table
    host_offsets = [0] * len(t.host[0])
    E = getattr(state, "experts", 1)
    if E > 1:
        if len(state.slots) != len(offsets):
            raise ValueError(f"fast_multilora: an experts table of {len(state.slots)} adapters for {len(offsets)} "
                             "offsets")
        spe = len(host_offsets) // E
        for s, off, R in zip(state.slots, offsets, state.ranks, strict=True):
            r = R // E
            host_offsets[s + 1 : len(host_offsets) : spe] = range(off, off + R, r)
    else:
        if len(t.slots) != len(offsets):
            raise ValueError(f"fast_multilora: a layer table of {len(t.slots)} adapters for {len(offsets)} offsets")
        any(map(host_offsets.__setitem__, t.slots, offsets))  # (C-level: no Python step per adapter)
    host = (t.host[0], tuple(host_offsets), t.host[2], t.host[3])
    key = (host, t.slots, cap, t.offsets.device, E)
    out = tables.get(key)
    if out is None:
        if len(tables) > 4096:  # (tables of layouts gone: dropped now and then, not kept for ever)
            tables.clear()
        offsets = to_device(torch.tensor(host_offsets, dtype=torch.int32), t.offsets.device)
        out = tables[key] = t._replace(offsets=offsets, total_rank=cap, host=host, experts=E)
    return out


def _store_table_edit(old: LayerSlots, state, rm: list, at: list, offsets: tuple, cap: int, tables: dict):
    """:func:`_store_table` of ``state`` derived from ``old.table`` by an edit: the slots of ``old``'s adapters at
    positions ``rm`` cleared, those of ``state``'s at ``at`` (``offsets``: the present adapters', slot order) set --
    the changed adapters' entries written, nothing of the others read. Layers whose old tables were one and take the
    same edit share the result (``tables``, by the edit: the first one builds it and offers it to equal ones by the
    whole table, as :func:`_store_table`). ``None`` where only a full build tells (experts, another slot count or
    region size, a table not made from ``old.state``'s)."""
    t_old, t = old.table, state.table
    was = old.state.table
    if t_old is None or getattr(state, "experts", 1) != 1 or t_old.experts != 1 or old.cap != cap or \
            len(t.host[0]) != len(t_old.host[1]) or t.offsets.device != t_old.offsets.device or \
            not (old.table_of is was.host or old.table_of == was.host):
        return None
    edits = dict.fromkeys(map(was.slots.__getitem__, rm), 0)
    edits.update(zip(map(t.slots.__getitem__, at), map(offsets.__getitem__, at), strict=True))
    edit = ("edit", id(t_old), id(t), tuple(sorted(edits.items())))
    hit = tables.get(edit)
    if hit is not None and hit[0] is t_old and hit[1] is t:
        return hit[2]
    host_offsets = list(t_old.host[1])
    any(map(host_offsets.__setitem__, edits, edits.values()))
    host = (t.host[0], tuple(host_offsets), t.host[2], t.host[3])
    key = (host, t.slots, cap, t.offsets.device, 1)
    out = tables.get(key)
    if out is None:
        if len(tables) > 4096:  # (as _store_table)
            tables.clear()
        dev = t_old.offsets.clone()
        if edits:
            ev = to_device(torch.tensor([list(edits), list(edits.values())], dtype=torch.int64), dev.device)
            dev[ev[0]] = ev[1].to(dev.dtype)
        out = tables[key] = t._replace(offsets=dev, total_rank=cap, host=host, experts=1)
    tables[edit] = (t_old, t, out)
    return out


class _ByAdapter:
    """Per adapter, read-only: its held parameters and, per layer, the layer's slots and its first row (``where``),
    or their indices in the store's ``_held``; each adapter's entry is made from the layers' cells (``by_name``) when
    first asked (per layout)."""

    def __init__(self, store, where: bool):
        self.store, self.where, self.cache = store, where, {}
        self.expect: dict = {}  # name -> its parameters' expected addresses (``addresses``)

    def addresses(self, name, hit) -> tuple:
        """Where adapter ``name``'s parameters' ``.data`` are when they are their pieces (``hit``: its entry). Kept
        for the layout's life: arenas move (grow, compact) only in a layout, which makes a new ``_ByAdapter`` (were
        one to move otherwise, its parameters would be found moved and laid out again, from their values)."""
        got = self.expect.get(name)
        if got is None:
            got = self.expect[name] = tuple(itertools.chain.from_iterable(s.expected(off) for s, off in hit[1]))
        return got

    def get(self, name, default=None):
        hit = self.cache.get(name)
        if hit is None:
            params, idx, where = [], [], []
            index_of = self.store.index_of
            for s in self.store.slots.values():
                c = s.by_name.get(name)
                if c is not None:
                    params += (c[3], c[4])
                    idx += (index_of[id(c[3])], index_of[id(c[4])])
                    where.append((s, c[2]))
            if not params:
                return default
            hit = self.cache[name] = (tuple(params), tuple(where)) if self.where else tuple(idx)
        return hit

    def __iter__(self):
        return iter({n for s in self.store.slots.values() for n in s.names})


_STORES: list = []  # weak references to the stores built (an optimizer's parameters are looked up among them)


def _engine_runs(node) -> Optional[bool]:
    """Whether the backward running now runs autograd ``node`` (``torch._C._will_engine_execute_node``, a private
    torch function, as torch.utils.checkpoint uses it); ``None`` outside a backward, ``True`` on a torch without it
    (its adapters armed, as before the check)."""
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return None
    except (AttributeError, TypeError):
        return True


def stores() -> list:
    """The adapter stores alive (of patched models: ``unpatch`` retires a model's store)."""
    live = [s for s in map(lambda r: r(), _STORES) if s is not None and not getattr(s, "retired", False)]
    if len(live) != len(_STORES):
        _STORES[:] = [weakref.ref(s) for s in live]
    return live


class AdapterStore:
    """The slot-stacked storage of one patched model (see the module docstring)."""

    def __init__(self, router):
        self.router = router
        self.retired = False  # its model was unpatched
        _STORES.append(weakref.ref(self))
        self.arenas: dict = {}  # (dtype, device) -> Arena
        self.slots: dict = {}  # id(layer) -> LayerSlots
        # Per held parameter an index, kept while it is held (an add or delete edits its own parameters' entries;
        # a freed index is taken by the next parameter that comes): the lists below are indexed by it, and a free
        # index holds ``_HOLE`` (no gradient, no flag) in ``_held`` and ``_views``.
        self._held: list = []  # every held parameter (class _HeldParameter while held)
        self._views: list = []  # _held[i]'s gradient piece: re-attached when a caller dropped it
        self.adapter_of: list = []  # _held[i]'s adapter name
        self.index_of: dict = {}  # id(param) -> its index
        self.free: list = []  # the free indices
        self._compact = None  # (held, views) without the free indices, per layout (``held``, ``views``)
        self.version = 0  # counts the layouts and the flag changes (fast_multilora.AdamW rebuilds its tables)
        self.flagged: set = set()  # adapters with a flag changed since the owner last took this set (its tables)
        self.adapter_params: dict = {}  # adapter -> (its held parameters, (its layers' slots, its first row)...)
        self.ids_read = None  # plan.FULL when every held parameter's identity was last checked (stale)
        self.pending: set = set()  # adapters of the gradient-recording calls whose backward has not started yet
        # per gradient-recording forward call since a backward last started, and those a backward found it does not
        # run: [its adapter names, a weak reference to one of its layer calls' autograd nodes (None: none yet;
        # False: not weak-referenceable), its index into ``seen``, deferred (a backward did not run it)] (``_armed``)
        self.calls: list = []
        self.last_armed: list = []  # the calls the last backward start armed, of known graph (clear_seen)
        self.started: set = set()  # the pending adapters of the last backward that started (a retained graph's again)
        self.dropped = False  # views dropped with no adapter pending (model.zero_grad() after a backward)
        self.trained: set = set()  # adapters of the gradient-recording calls since fast_multilora.AdamW's last step
        # adapters whose gradient pieces may be nonzero since the last zero_grad (None: any -- at the start, after a
        # data-parallel reduce, which brings other ranks' adapters): zero_grad zeroes theirs only
        self.dirty: Optional[set] = None
        self.hooked: set = set()  # ids of the leaves that carry a hook (leaves live as long as their layout)
        self.flags_read = None  # plan.CHANGES when the held parameters' requires_grad were last read
        self.owner = None  # the fast_multilora.AdamW whose states the arenas hold (the latest one built)
        self._seen: Optional[torch.Tensor] = None  # bool [n_slots + 1]: index 0 base, 1 + slot an adapter (seen_index)
        self.seen_names: tuple = ()
        self._unmarked: dict = {}  # id(index) -> index: the calls' slot indices since ``seen`` was last written
        self.pattern: list = []  # requires_grad of every held parameter, as last read (sync_requires_grad)
        self.unread: set = set()  # indices whose flag is to be read (parameters on new pieces)
        self.flips_read = None  # the position in ``_FLIPS`` up to which the store has read the flags changed
        self.flags_full = None  # plan.FULL when every held flag was last read
        self.laid_out = None  # plan.FULL at the last layout
        # a copy (its layers are other objects; ``torch.load``'s arenas cannot grow): laid out afresh at first use
        self.copied = False
        self.moved: set = set()  # adapters found with a parameter whose ``.data`` was replaced (stale)
        self.attached: set = set()  # indices of the parameters whose ``.grad`` prepare_grads left a view
        self.acc_hooks: dict = {}  # id(held parameter) -> its post-accumulate-grad hook's handle (_TOUCHED)
        self.parked: dict = {}  # paged-out adapter -> its parameters that left, class and hook kept (_release)
        # adapters a gradient reached through their parameters themselves (_TOUCHED) since an optimizer step last
        # looked (the torch.optim bridge: each must have every trained parameter's gradient, or none)
        self.touched_adapters: set = set()
        self.watch: dict = {}  # (id(layer), 0: A / 1: B leaf) -> (its attached parameters, their views): the hooks'
        self.adapter_idx: dict = {}  # adapter -> its parameters' indices
        self.leaf_of: list = []  # _held[i]'s leaf key (as ``watch``)
        self.tables: dict = {}  # the layers' store tables (_store_table), shared among equal ones
        self.delta = None  # during a layout's owner._follow: (parameters on new pieces, parameters that left)
        self.ddp = StoreSync()  # under DistributedDataParallel (fast_multilora.ddp)
        self._layers_checked = None  # (store_layers, version) for which every held layer was found a store layer
        self.layout(full=True)

    def __setstate__(self, state):
        self.__dict__.update(state)
        _STORES.append(weakref.ref(self))

    def __getstate__(self):  # a copy (deepcopy, pickle) of the model: its store has no optimizer yet
        state = dict(self.__dict__)
        state["owner"] = None
        state["ddp"] = StoreSync()
        state["copied"] = True
        state["_compact"] = None
        state["_layers_checked"] = None
        state["dirty"] = None
        state["calls"], state["last_armed"] = [], []  # (weak references to this model's graphs: a copy has none)
        state["acc_hooks"] = {}  # (a copy's parameters carry no hooks: its first layout hooks them)
        state["parked"] = {}
        state["touched_adapters"] = set()
        return state

    # -- attaching ------------------------------------------------------------------------------------------------
    @staticmethod
    def of(model) -> "AdapterStore":
        """The store of a patched ``model`` (built on first use)."""
        from .patching import _ROUTER_ATTR

        router = model.__dict__.get(_ROUTER_ATTR)
        if router is None:
            raise ValueError("fast_multilora: the model is not patched; call fast_multilora.patch(model) first")
        if router.store is None:
            from .patching import _build_store

            _build_store(router)
        return router.store

    @staticmethod
    def attach(router) -> None:
        """Build the store of ``router``'s model (its layers' states are current)."""
        router.store = AdapterStore(router)
        from .optim import install_step_hooks

        install_step_hooks()  # a torch.optim.AdamW on its parameters steps them through it
        _shadow_zero_grad(router.root, router.store)
        mark_model(router.root, router.store)  # DDP built on the model leaves the held parameters to the store

    def follow(self, routing, training: bool) -> None:
        """At a forward call's entry (``patching.refresh_layers``): re-lay out when the layers' adapters changed; in
        a call that records gradients, the leaves' ``requires_grad`` and the adapters the call trains (``seen``)."""
        if self.stale(set(routing.names)):
            self.layout()
        self.ddp.follow(self, training)
        if training:
            if self.flags_read != CHANGES[0] or not SWAP_CLASS:  # a held flag may have changed (_HeldParameter)
                self.sync_requires_grad()
            self.pending.update(routing.names)  # (packed rows: every adapter the call names)
            if len(self.calls) >= 64:  # a loop of forwards with no backward: bounded
                self._prune_calls()
            self.calls.append([frozenset(routing.names), None, self.seen_index(routing), False])
            self.trained.update(routing.names)
            if self.dirty is not None:
                self.dirty.update(routing.names)

    def seen_index(self, routing) -> Optional[torch.Tensor]:
        """The index into :attr:`seen` of ``routing``'s tokens (``1 + slot``; the routing keeps it for its repeats), or
        ``None`` (no store arenas, no slots). The flags are set when the call's backward starts (:meth:`_armed`:
        a forward never backwarded sets none) and written when read, by ``fast_multilora.AdamW`` and under DDP, so a
        step with another optimizer launches nothing for them."""
        slots = routing.row_slots if routing.per_row else routing.token_slots
        if slots is None or not self.arenas:
            return None
        if self._seen is None or self._seen.device != slots.device:
            self._seen = torch.zeros(len(routing.slot_names) + 1, dtype=torch.bool, device=slots.device)
            self.seen_names = routing.slot_names
            self._unmarked = {}
        elif self.seen_names != routing.slot_names:  # adapters came or went: the others' flags stay (their slots do)
            for c in self.calls:  # (indices of the old slot order: set now, as if their backward had started)
                self._note_seen(c[2])
                c[2] = None
            self._mark()
            old, new = self.seen_names, routing.slot_names
            seen = torch.zeros(len(new) + 1, dtype=torch.bool, device=slots.device)
            k = min(len(old), len(new))
            seen[: k + 1] = self._seen[: k + 1]
            gone = list(itertools.compress(range(1, k + 1), map(operator.ne, old[:k], new[:k])))
            if gone:  # a slot now of another adapter (or free): not seen
                seen.index_fill_(0, to_device(torch.tensor(gone, dtype=torch.int64), slots.device), False)
            self._seen, self.seen_names = seen, new
        index = routing.seen_index
        if index is None or index.device != slots.device:
            index = routing.seen_index = slots.reshape(-1).long() + 1  # index 0: base tokens (slot -1)
        return index

    def _note_seen(self, index: Optional[torch.Tensor]) -> None:
        """Set ``index``'s flags of :attr:`seen` (when next read); ``None``: nothing."""
        if index is None:
            return
        if len(self._unmarked) >= 64:
            self._mark()
        self._unmarked[id(index)] = index

    def _mark(self) -> None:
        for index in self._unmarked.values():
            self._seen.index_fill_(0, index, True)
        self._unmarked = {}

    @property
    def seen(self) -> Optional[torch.Tensor]:
        """bool ``[n_slots + 1]`` (``None`` before the first training call): ``seen[1 + slot]`` -- the adapter had a
        token in a gradient-recording call since the last ``zero_grad``; index 0: base tokens. Slot order
        ``seen_names``."""
        if self._unmarked:
            self._mark()
        return self._seen

    # -- layout ---------------------------------------------------------------------------------------------------
    def _wanted(self, checked: bool) -> dict:
        from .patching import _STATE_ATTR

        wanted = {}
        for layer in self.router.store_layers:
            st = layer.__dict__.get(_STATE_ATTR)
            old = self.slots.get(id(layer))
            # a layer whose state the store has checked keeps its key (a moved parameter is caught in layout), but
            # after mark_changed (a weight may be a new Parameter) or for a replaced first weight (``stale``'s check)
            same = checked and old is not None and st is old.state and old.names and \
                layer.lora_A._modules[old.names[0]]._parameters["weight"] is old.params[0]
            d = st.delta if checked and old is not None and st is not None else None
            if same:
                key = old.key
            elif d is not None and d[0] is old.state and old.names:  # a few adapters changed: those are read
                key = _delta_key(layer, st, old, d[1], self.router.slot_of)
            else:
                key = _layer_key(layer, st, old)
            if key is not None:
                wanted[id(layer)] = (layer, key, st)
        return wanted

    def stale(self, names=None) -> bool:
        """Whether the layers' adapters no longer match the layout: per layer its state and first parameter, and the
        address of every parameter of the adapters ``names`` (default: all) -- a parameter whose ``.data`` was
        replaced left its arena. A forward checks the adapters it names only: the kernels read no other adapter's
        rows, and an adapter whose parameter moved is caught by the first forward that names it, its values then
        read from the parameters (``fast_multilora.AdamW``'s step checks the adapters trained since its last step:
        it steps no other)."""
        from .patching import _STATE_ATTR

        for layer in self.router.store_layers:
            st = layer.__dict__.get(_STATE_ATTR)
            slots = self.slots.get(id(layer))
            if slots is None:
                if _layer_key(layer, st) is not None:
                    return True
                continue
            if st is not slots.state:  # the layer's adapters, modes, dtypes or devices changed since the check
                d = st.delta if st is not None else None
                if d is not None and d[0] is slots.state:  # a change of a few adapters: those are read
                    if _delta_moves(slots, st, d[1]):
                        return True
                elif _layer_key(layer, st, slots) != slots.key:
                    return True
                slots.state = st
                if st.table.host != slots.table_of:  # the slot order moved: the store's table follows
                    self._retable(slots)
            if layer._modules["lora_A"]._modules[slots.names[0]]._parameters["weight"] is not slots.params[0]:
                return True
        layers = self.router.store_layers  # (a list patch() replaces, never edits)
        if self._layers_checked != (layers, self.version):
            if not set(self.slots) <= {id(layer) for layer in layers}:
                return True
            self._layers_checked = (layers, self.version)
        if self.ids_read != FULL[0]:  # after mark_changed (a change of unknown extent): every weight still held?
            for layer in self.router.store_layers:
                slots = self.slots.get(id(layer))
                if slots is None:
                    continue
                mods = [layer.lora_A._modules.get(n) for n in slots.names]
                mods += [layer.lora_B._modules.get(n) for n in slots.names]
                if any(m is None or m.weight is not p for m, p in zip(mods, slots.params, strict=True)):
                    return True
            self.ids_read = FULL[0]
        if self.copied:
            return True
        if names is None:
            return any(s.moved() for s in self.slots.values())
        found = False
        by_adapter = self.adapter_params
        for name in names:  # every moved adapter of the call, not the first: the layout reads those (``moved``)
            entry = by_adapter.get(name)
            if entry is not None and tuple(map(_DATA_PTR, entry[0])) != by_adapter.addresses(name, entry):
                self.moved.add(name)
                found = True
        return found

    def _retable(self, slots: LayerSlots) -> None:
        slots.table = _store_table(slots.state, slots.offsets, slots.cap, self.tables)
        slots.table_of = slots.state.table.host

    def _arena(self, dtype, device) -> Arena:
        arena = self.arenas.get((dtype, device))
        if arena is None:
            names = {s for a in self.arenas.values() for s in a.states}
            z = functools.partial(torch.zeros, ALIGN, dtype=dtype, device=device)
            arena = self.arenas[(dtype, device)] = Arena(dtype, device, z(), z(), {s: z() for s in names})
        return arena

    def layout(self, full: bool = False) -> None:
        """Bring the arenas up to the layers' current adapters, by the layers that changed: a layer whose adapters
        did not change keeps its region as it is; in one that changed the adapters that stay keep their pieces (and
        gradients and optimizer states), one that left leaves a hole, and a new one takes a hole of its rank or the
        region's free rows (a full region moves to one twice as large), its weights read from the parameter. So the
        work of one adapter added or deleted is its own pieces, amortised, in every layer it has. ``full`` (done
        also when regions given up make more than half an arena): every layer laid out afresh and compact, the
        gradients and optimizer states of the parameters that stay carried over."""
        checked = self.laid_out == FULL[0]  # no mark_changed since the last layout: a kept layer's weights stand
        wanted = self._wanted(checked)
        self.laid_out = FULL[0]
        moved = self.moved  # adapters ``stale`` found with a replaced ``.data``: their layers are read again
        left = [lid for lid in self.slots if lid not in wanted]
        if left and any(type(p.data) is not torch.Tensor for layer in self.router.store_layers if id(layer) in left
                        for d in (layer.lora_A, layer.lora_B) for p in d.parameters()):
            warnings.warn("fast_multilora: parameters held by the adapter store were replaced by other tensor types "
                          "(FSDP2's shards?): they leave the store, their optimizer states start over and their "
                          "layers take the slower per-parameter path; under FSDP2 pass "
                          "ignored_params=fast_multilora.fsdp_ignored_params(model) to fully_shard", stacklevel=3)
        full = full or self.copied or any(a.dropped * 3 > a.used for a in self.arenas.values())
        self.copied = False
        old_slots, old_arenas = self.slots, self.arenas
        released, placed = [], []  # parameters that left the store; parameters on new pieces (new or moved)
        if full:
            self.arenas, self.tables = {}, {}
            state_names = {s for a in old_arenas.values() for s in a.states}
            for (dtype, device), _ in {(k[2], k[3]): 0 for _, k, _ in wanted.values()}.items():
                numel = sum(_aligned(_room(k[1]) * k[4]) + _aligned(_room(k[1]) * k[5]) for _, k, _ in wanted.values()
                            if (k[2], k[3]) == (dtype, device))
                z = functools.partial(torch.zeros, max(numel, ALIGN), dtype=dtype, device=device)
                self.arenas[(dtype, device)] = Arena(dtype, device, z(), z(), {s: z() for s in state_names})
        slots = {}
        with torch.no_grad():
            for lid, (layer, key, st) in wanted.items():
                old = old_slots.get(lid)
                touched = not checked or any(n in old.by_name for n in moved) if old is not None else True
                if not full and old is not None and old.key == key and not (touched and old.moved()):
                    old.state = st
                    if st.table.host != old.table_of:
                        self._retable(old)
                    slots[lid] = old
                    continue
                arena = self._arena(key[2], key[3])
                reuse = not full and old is not None and old.arena is arena and (old.K, old.N) == key[4:6]
                d = st.delta if reuse and not touched else None
                names = d[1] if d is not None and d[0] is old.state else None
                slots[lid] = self._place(layer, key, st, arena, old if reuse else None, old, placed, names)
            for lid, old in old_slots.items():  # what left: a layer's region, the adapters of a changed layer
                new = slots.get(lid)
                if new is old:
                    continue
                if not full and (new is None or new.arena is not old.arena):  # its region is given up
                    old.arena.dropped += _aligned(old.cap * old.K) + _aligned(old.cap * old.N)
                if new is not None and new.left is not None:  # (the region's cells made holes)
                    gone = new.left
                else:
                    kept = set(map(id, new.params)) if new is not None else set()
                    gone = itertools.compress(zip(old.params, old.names + old.names, strict=True),
                                              map(operator.not_, map(kept.__contains__, map(id, old.params))))
                for p, name in gone:
                    released.append((p, name))
                    if old.arena.blocks.get(p, (0, 0, None))[2] is p:
                        del old.arena.blocks[p]
                if new is not None:
                    new.left = None
                self.hooked.discard(id(old.a_leaf))
                self.hooked.discard(id(old.b_leaf))
        if full:
            for arena in old_arenas.values():
                arena.blocks.clear()
        self.slots = slots
        self.moved = set()
        for p, *_ in placed:
            _hold(p)
        kept = {id(p) for p, *_ in placed}
        released = [(p, name) for p, name in released if id(p) not in kept]
        self._release(released, kept)
        _hook_accumulation((p for p, *_ in placed), self.acc_hooks)
        fresh = [s for lid, s in slots.items() if s is not old_slots.get(lid)]  # the layers laid out anew
        if full:
            self._index_full()
        else:
            self._index_delta(placed, released, fresh)
        self.delta = None if full else (placed, released)
        self.sync_requires_grad(fresh)
        if self.owner is not None:
            self.owner._follow(self)
        self.delta = None

    def _release(self, released: list, kept: set) -> None:
        """Give the parameters that left the store back their class and remove their hooks -- except those of
        adapters paging keeps on the host (``fast_multilora.paging``): they are *parked*, class and hook kept, as
        they come back to the store unchanged (~3 us a parameter each way, 14 336 parameters a step at 64 adapters
        in and 64 out on a 56-layer model). A parked adapter that is no longer paged out (back, or deleted) has its
        parameters that did not come back released."""
        pager = self.router.pager
        absent = pager.absent if pager is not None else frozenset()
        parked = self.parked
        if parked:
            for name in [n for n in parked if n not in absent]:
                release((p for p in parked.pop(name) if id(p) not in kept), self.acc_hooks)
        out = []
        for p, name in released:
            if name in absent:
                parked.setdefault(name, []).append(p)
            else:
                out.append(p)
        release(out, self.acc_hooks)

    def parked_params(self) -> list:
        return [p for ps in self.parked.values() for p in ps]

    def _place(self, layer, key, st, arena: Arena, old: Optional[LayerSlots], prev: Optional[LayerSlots],
               placed: list, names=None) -> LayerSlots:
        """The layer's new :class:`LayerSlots` in ``arena``: ``old``'s region and cells updated, or (``old`` None) a
        new region for all its adapters, whose gradients and optimizer states are carried over from ``prev`` (the
        layer's slots before, in another arena or before a full re-layout). ``names``: only these adapters changed
        since ``old`` (the others' cells are not read). Appends to ``placed`` the parameters now on new pieces:
        ``(param, adapter, its gradient view, its leaf's key)``."""
        present, ranks, _, _, K, N, _ = key
        lid = id(layer)
        a_mods, b_mods = layer.lora_A._modules, layer.lora_B._modules
        left = []  # (old given) the parameters of the cells made holes
        if old is None or names is None:
            check, idx = present, range(len(present))
        else:  # the changed adapters that stay or came, in slot order
            at_of = _positions(present)
            pos = {n: at_of[n] for n in names if n in at_of}
            check = sorted(pos, key=pos.__getitem__)
            idx = list(map(pos.__getitem__, check))
        want = {name: (ranks[i], a_mods[name]._parameters["weight"], b_mods[name]._parameters["weight"])
                for name, i in zip(check, idx, strict=True)}
        if old is None:  # room for an eighth more rank-rows: the next adapters join without moving the region
            cells, end, cap = [], 0, _room(ranks)
            a0 = arena.region(_aligned(cap * K) + _aligned(cap * N))
            views, by_name, holes, pieces = {}, {}, {}, {}
            left = None
        else:
            cells, end, cap, a0 = old.cells, old.end, old.cap, old.a0  # (old is given up: its cells are edited)
            by_name, holes = old.by_name, old.holes
            pieces = old.pieces if old.arena is arena else {}
            n_old = len(old.names)
            if names is None:
                views = dict(zip(map(id, old.params), old.views, strict=True))
                gone = [c for c in cells if c[0] is not None]
            else:  # the changed adapters' positions before (their views; the others' are not read)
                old_at = _positions(old.names)
                rm = sorted(old_at[n] for n in names if n in by_name)
                views = {id(old.params[j]): old.views[j] for i in rm for j in (i, n_old + i)}
                gone = [by_name[n] for n in names if n in by_name]
            for c in gone:  # adapters that left (or whose weights or rank changed) leave holes
                w = want.get(c[0])
                if w is None or w[0] != c[1] or w[1] is not c[3] or w[2] is not c[4]:
                    left += ((c[3], c[0]), (c[4], c[0]))
                    del by_name[c[0]]
                    c[0] = c[3] = c[4] = None
                    holes.setdefault(c[1], []).append(c)
            if names is None:  # (with ``names``, the others' addresses are not read: see the region move below)
                _take_back_moved(old, cells, arena)
        fill = []  # cells whose pieces are written: new adapters (then moved ones)
        k0 = len(cells)
        for name in check:
            if name in by_name:
                continue
            r, pa, pb = want[name]
            spot = holes.get(r)
            if spot:
                c = spot.pop()
                c[0], c[3], c[4] = name, pa, pb
            else:
                c = [name, r, end, pa, pb]
                cells.append(c)
                end += r
            by_name[name] = c
            fill.append(c)
        n_new = len(fill)
        b0 = a0 + _aligned(cap * K)
        splice = old is not None and names is not None and end <= cap  # the others' entries copied, not read
        if end > cap:  # the region is full: the layer moves to one half as large again (its rows copied as a block)
            if old is not None and names is not None:
                _take_back_moved(old, cells, arena)  # a replaced ``.data`` into its piece before the rows move
            new_cap = max(cap + cap // 2, end)
            na0 = arena.region(_aligned(new_cap * K) + _aligned(new_cap * N))
            nb0 = na0 + _aligned(new_cap * K)
            rows = old.end if old is not None else 0
            for buf in (arena.data, arena.grad, *arena.states.values()):
                buf[na0 : na0 + rows * K].copy_(buf[a0 : a0 + rows * K])
                buf[nb0 : nb0 + rows * N].copy_(buf[b0 : b0 + rows * N])
            arena.dropped += _aligned(cap * K) + _aligned(cap * N)
            fresh = set(map(id, fill))
            fill += [c for c in cells if c[0] is not None and id(c) not in fresh]
            cap, a0, b0, pieces = new_cap, na0, nb0, {}
        carried = {}  # id(param) -> (arena, start) of its piece before (prev's)
        if prev is not None and old is None:
            for p in prev.params:
                blk = prev.arena.blocks.get(p)
                if blk is not None:
                    carried[id(p)] = (prev.arena, blk[0])
        ops = []  # a new adapter's pieces' writes, in order: (piece, source) copies, (piece, None) zeroes
        d_store, g_store = arena.data.untyped_storage(), arena.grad.untyped_storage()
        d_at, g_at = arena.data.storage_offset(), arena.grad.storage_offset()
        dtype, device = arena.data.dtype, arena.data.device
        empty = functools.partial(torch.empty, 0, dtype=dtype, device=device)
        blocks = arena.blocks
        for i, (c_name, r, off, pa, pb) in enumerate(fill):
            sa, sb = a0 + off * K, b0 + off * N
            got = pieces.get(off)
            if got is None or got[0] != r:
                got = pieces[off] = (r, _piece_at(empty, d_store, d_at + sa, (r, K), (K, 1)),
                                     _piece_at(empty, g_store, g_at + sa, (r, K), (K, 1)),
                                     _piece_at(empty, d_store, d_at + sb, (N, r), (r, 1)),
                                     _piece_at(empty, g_store, g_at + sb, (N, r), (r, 1)))
            for p, start, numel, data, v in ((pa, sa, r * K, got[1], got[2]), (pb, sb, N * r, got[3], got[4])):
                had_grad = p.grad is not None
                if i < n_new:  # a new adapter's piece (perhaps a hole): its weights, gradient, states
                    src = carried.get(id(p))
                    ops.append((data, p.data))
                    if src is not None:
                        ops.append((v, src[0].grad[src[1] : src[1] + numel].view(v.shape)))
                    elif had_grad and p.grad.shape == p.shape:
                        ops.append((v, p.grad))
                    else:
                        ops.append((v, None))
                    for s, buf in arena.states.items():
                        if src is not None and s in src[0].states:
                            ops.append((buf[start : start + numel], src[0].states[s][src[1] : src[1] + numel]))
                        else:
                            ops.append((buf[start : start + numel], None))
                p.data = data
                views[id(p)] = v
                # a gradient it had lives on in its view; none stays none (as under stock PEFT, a parameter gets a
                # ``.grad`` from the first backward that reaches its adapter)
                p.grad = v if had_grad and _REQUIRES_GRAD(p) else None
                blocks[p] = (start, numel, p)
                placed.append((p, c_name, v, (lid, 0 if p is pa else 1)))
        _write(ops, arena)
        if splice:  # old's per-adapter entries with the changed ones taken out and put in at their new positions
            at = list(idx)
            ins = list(map(by_name.__getitem__, check))

            # (old is given up: its lists are edited in place and become the new slots')
            params = _splice_pair_into(old.params, n_old, rm, at, map(_CELL_A, ins), map(_CELL_B, ins))
            views_t = _splice_pair_into(old.views, n_old, rm, at, [views[id(c[3])] for c in ins],
                                        [views[id(c[4])] for c in ins])
            offsets = _splice_into(old.offsets, rm, at, map(_CELL_OFFSET, ins))
        else:
            ordered = list(map(by_name.__getitem__, present))
            params = list(map(_CELL_A, ordered)) + list(map(_CELL_B, ordered))
            views_t = list(map(views.__getitem__, map(id, params)))
            offsets = list(map(_CELL_OFFSET, ordered))
        a_leaf = _piece(arena.data, a0, (cap, K))
        b_leaf = _piece(arena.data, b0, (cap * N,))
        a_leaf.grad = _piece(arena.grad, a0, (cap, K))
        b_leaf.grad = _piece(arena.grad, b0, (cap * N,))
        out = LayerSlots(present, ranks, K, N, a_leaf, b_leaf, params, key, st, arena=arena, a0=a0, b0=b0, cap=cap,
                         end=end, cells=cells, views=views_t, offsets=offsets, by_name=by_name, holes=holes,
                         pieces=pieces, lid=lid,
                         edit=(old, rm, at) if splice else None, left=left, experts=getattr(st, "experts", 1))
        out._shape(old if splice else None, k0)
        table = _store_table_edit(old, st, rm, at, offsets, cap, self.tables) if splice else None
        if table is None:
            self._retable(out)
        else:
            out.table, out.table_of = table, st.table.host
        return out

    @property
    def held(self) -> list:
        """Every held parameter (a list made at the first use after each layout: under DDP its identity tells a
        re-layout)."""
        return self._compacted()[0]

    @property
    def views(self) -> list:
        """``held[i]``'s gradient piece."""
        return self._compacted()[1]

    def _compacted(self) -> tuple:
        if self._compact is None:
            keep = list(map(operator.is_not, self.adapter_of, itertools.repeat(None)))
            self._compact = (list(itertools.compress(self._held, keep)), list(itertools.compress(self._views, keep)))
        return self._compact

    def _index_full(self) -> None:
        """The per-parameter lists (``_held``, ``_views``, ``adapter_of``, ``leaf_of``, ``pattern``) laid out afresh
        from the layers' slots (at a full layout; C-level copies per layer: no Python step per parameter). Flags
        already read are kept by identity; every flag is read again at the next :meth:`sync_requires_grad`."""
        before = dict(zip(map(id, self._held), self.pattern, strict=True))
        held, views, adapter_of, leaf_of = [], [], [], []
        chain = itertools.chain.from_iterable
        for s in self.slots.values():
            n, base = len(s.names), len(held)
            held += chain(zip(s.params[:n], s.params[n:], strict=True))
            views += chain(zip(s.views[:n], s.views[n:], strict=True))
            adapter_of += chain(zip(s.names, s.names, strict=True))
            s.held_idx = list(range(base, base + 2 * n, 2)) + list(range(base + 1, base + 2 * n, 2))
            leaf_of += [(s.lid, 0), (s.lid, 1)] * n  # each adapter's A, then B: its leaves' keys (as ``watch``)
        self._held, self._views, self.adapter_of, self.leaf_of = held, views, adapter_of, leaf_of
        self.index_of = dict(zip(map(id, held), range(len(held)), strict=True))
        self.free, self.unread, self._compact = [], set(), None
        for s in self.slots.values():
            s.edit = None
        self.pattern = list(map(before.get, map(id, held)))  # (None for a parameter that came: read as changed)
        self.flags_full = None
        self._new_index()
        self.attached = set(itertools.compress(range(len(held)), map(operator.is_, map(_GRAD, held), views)))
        self._watch()

    def _index_delta(self, placed: list, released: list, fresh: list) -> None:
        """The per-parameter lists edited at the parameters of a layout by the layers that changed: those that left
        free their indices, those on new pieces (``placed``) get one (a free one first) or keep theirs, with their
        new view; ``fresh``: the layers laid out anew (their ``held_idx``). Nothing of the other parameters is read."""
        held, views, adapter_of, leaf_of, pattern = self._held, self._views, self.adapter_of, self.leaf_of, self.pattern
        index_of, free, attached, unread = self.index_of, self.free, self.attached, self.unread
        for p, _ in released:
            i = index_of.pop(id(p), None)
            if i is None:
                continue
            held[i] = views[i] = _HOLE
            adapter_of[i] = leaf_of[i] = None
            pattern[i] = False
            attached.discard(i)
            unread.discard(i)
            free.append(i)
        for p, name, v, leaf in placed:
            i = index_of.get(id(p))
            if i is None:
                if free:
                    i = free.pop()
                else:
                    i = len(held)
                    held.append(_HOLE)
                    views.append(_HOLE)
                    adapter_of.append(None)
                    leaf_of.append(None)
                    pattern.append(False)
                index_of[id(p)] = i
                held[i] = p
                unread.add(i)  # its flag is read (and counted changed) at the next sync_requires_grad
            adapter_of[i], views[i], leaf_of[i] = name, v, leaf
            if p.grad is v:
                attached.add(i)
            else:
                attached.discard(i)
        for s in fresh:
            e, s.edit = s.edit, None
            if e is None:
                s.held_idx = list(map(index_of.__getitem__, map(id, s.params)))
                continue
            old, rm, at = e  # old's indices with the changed adapters' taken out and put in at their positions
            n_old, n = len(old.names), len(s.names)  # (old is given up: its list is edited in place)
            s.held_idx = _splice_pair_into(old.held_idx, n_old, rm, at, [index_of[id(s.params[i])] for i in at],
                                           [index_of[id(s.params[n + i])] for i in at])
        self._compact = None
        self._new_index()
        self._watch()

    def _new_index(self) -> None:
        self.adapter_params = _ByAdapter(self, where=True)
        self.adapter_idx = _ByAdapter(self, where=False)
        self.version += 1

    # -- per step -------------------------------------------------------------------------------------------------
    def sync_requires_grad(self, layers=()) -> bool:
        """A leaf requires a gradient when one of its parameters does (a frozen adapter's rows of a trained block get
        gradients nobody reads: its parameters have no ``.grad`` and the optimizer skips them). Returns whether a
        flag changed since the last call. Reads the flags of the parameters whose flag was set since (``_FLIPS``)
        and of those that came (``unread``); every flag after a change of unknown extent (``plan.FULL``), when the
        log was cleared, or where held parameters keep their class (``SWAP_CLASS`` False). ``layers``: slots laid
        out anew (their leaves take their flags whatever changed)."""
        self.flags_read = CHANGES[0]
        held, pattern, unread = self._held, self.pattern, self.unread
        at = self.flips_read - _FLIPS_AT[0] if self.flips_read is not None else -1
        if not SWAP_CLASS or self.flags_full != FULL[0] or at < 0:
            flags = list(map(_REQUIRES_GRAD, held))  # C-level: ~0.1-0.3 us per parameter (cache misses)
            changed = set(itertools.compress(range(len(held)), map(operator.ne, flags, pattern))) | unread
            self.pattern = pattern = flags
            self.flags_full = FULL[0]
        else:
            index_of = self.index_of
            read = unread.union(map(index_of.get, _FLIPS[at:]))
            read.discard(None)
            changed = set()
            for i in read:
                f = _REQUIRES_GRAD(held[i])
                if f != pattern[i] or i in unread:
                    pattern[i] = f
                    changed.add(i)
        self.flips_read = _FLIPS_AT[0] + len(_FLIPS)
        self.unread = set()
        touched = {s.lid: s for s in layers}
        leaf_of = self.leaf_of
        for i in changed:
            lid = leaf_of[i][0]
            if lid not in touched:
                touched[lid] = self.slots.get(lid)
        for s in touched.values():
            if s is None:
                continue
            n = len(s.names)
            a_req = any(map(pattern.__getitem__, s.held_idx[:n]))
            b_req = any(map(pattern.__getitem__, s.held_idx[n:]))
            for leaf, req, part in ((s.a_leaf, a_req, slice(0, n)), (s.b_leaf, b_req, slice(n, 2 * n))):
                if leaf.requires_grad != req:
                    leaf.requires_grad_(req)
                    if req and id(leaf) not in self.hooked:  # once per leaf (a frozen tensor takes no hook)
                        hook = self._hook(s, part)
                        leaf.register_hook(hook)
                        s.on_grad[part.start != 0] = (hook, torch.autograd.graph.get_gradient_edge(leaf).node)
                        self.hooked.add(id(leaf))
        if not changed:
            return False
        self.version += 1
        self.flagged.update(map(self.adapter_of.__getitem__, changed))
        self.prepare_grads(extra=changed)  # one that no longer trains loses its view
        return True

    def _prune_calls(self) -> None:
        """``calls`` without those whose graph is gone, the ones of unknown graph merged into one."""
        live = [c for c in self.calls if c[1] and c[1]() is not None]
        unknown = [c for c in self.calls if not c[1]]
        if unknown:  # (they arm their adapters when a backward starts: their flags set now)
            for c in unknown:
                self._note_seen(c[2])
            live.append([frozenset().union(*(c[0] for c in unknown)), False, None, False])
        self.calls[:] = live
        self.pending = set().union(*(c[0] for c in live))  # (between calls it is their names)

    @staticmethod
    def _runs(call) -> bool:
        """Whether the backward running now runs forward ``call``'s graph (``False`` outside a backward, or gone)."""
        node = call[1]() if call[1] else None
        return node is not None and bool(_engine_runs(node))

    def note_node(self, out: torch.Tensor) -> None:
        """Keep a weak reference to ``out``'s autograd node as the last forward call's (its first layer call's output;
        called by the layers while that call has none): :meth:`_armed` asks the engine whether it will run."""
        c = self.calls[-1]
        if c[1] is None and out.grad_fn is not None and not torch.compiler.is_compiling():
            try:
                c[1] = weakref.ref(out.grad_fn)
            except TypeError:  # (a node of a compiled graph, of DoRA's ops: unknown, the call's adapters armed)
                c[1] = False

    def _armed(self, pending: set) -> tuple:
        """``(armed, later)``: of the ``pending`` adapters, those whose gradients this backward may accumulate, and
        the forward calls that wait. A forward call whose graph was freed without a backward (a metric computed with
        autograd on) arms nothing -- its adapters keep ``None``, as under stock PEFT, so an optimizer does not step
        them -- and one whose graph lives on but that this backward does not run (the engine's
        ``_will_engine_execute_node``; a backward of another graph), or whose graph lives on when asked outside a
        backward (a ``zero_grad``, an optimizer step), waits, deferred (out of ``pending``). Calls of unknown graph
        (no node kept) and adapters pending otherwise (a retained graph's re-arm, DDP) are armed."""
        calls = self.calls
        if not calls:
            return pending, []
        armed = pending.difference(*(c[0] for c in calls))
        later = []
        for c in calls:
            ref = c[1]
            node = ref() if ref else None
            if ref and node is None:  # its graph is gone: it will never run backward
                continue
            # not run by this backward, or asked outside one (a zero_grad, an optimizer step): its backward arms it
            if node is not None and not _engine_runs(node):
                c[3] = True  # deferred: the leaves' hooks ask whether a backward runs it (_runs)
                later.append(c)
                continue
            armed |= c[0]
            self._note_seen(c[2])
            if ref:
                self.last_armed.append(c)
        return armed, later

    def prepare_grads(self, force: bool = False, extra=None) -> None:
        """Give each held parameter the ``.grad`` stock PEFT would leave it, with the gradient in the arena.

        Any optimizer may own the parameters: ``torch.optim``'s ``zero_grad()`` drops each ``.grad`` (``None``: the
        gradient is zero from then on), DDP's reducer or a caller may put another tensor there (it holds the whole
        gradient), while the layer calls' gradients land in the arena through the two leaves. So, per trained
        parameter: a view in place stays; another tensor is copied into its piece and the view attached; a dropped
        one gets its view back, its piece zeroed, when its adapter is in a call whose backward is starting
        (``pending``), else keeps ``None`` -- an adapter with no rows since its gradient was dropped has no gradient,
        as under stock PEFT, so ``torch.optim`` skips it (no weight decay, no momentum step). A frozen parameter has
        no ``.grad``. Runs before the leaves' gradients accumulate (a hook on each leaf, see :meth:`_hook`, which a
        layer call's backward that adds the gradients itself runs too), before
        an optimizer step of ours, after ``model.zero_grad()`` and when a ``requires_grad`` changed.

        Its work grows with the batch, not with the registry: it reads the parameters whose view it left attached
        (``attached``) and those of the pending adapters, nothing else (``force``: every parameter); the pieces it
        zeroes go in one ``torch._foreach_zero_``. A parameter outside both sets has ``None`` as the store left it
        (its piece may hold an old sum: zeroed when its view is attached again); one whose ``.grad`` a caller set to
        a tensor of its own meanwhile is read when its adapter is next pending or the flags change (``extra``: the
        indices of parameters whose flag changed, read too)."""
        pending = self.pending
        attached = self.attached
        held, views = self._held, self._views
        extra = set(extra) if extra is not None else set()
        touched = self._take_touched() if _TOUCHED else set()
        if not force and not pending and not extra and not touched and all(
                map(operator.is_, map(_GRAD, map(held.__getitem__, attached)), map(views.__getitem__, attached))):
            return
        self.pending = set()
        if pending:
            self.last_armed = []
            if force:  # every call armed
                for c in self.calls:
                    self._note_seen(c[2])
                self.last_armed = [c for c in self.calls if c[1]]
                later = []
            else:
                pending, later = self._armed(pending)
            self.calls[:] = later  # (deferred: not pending, which would start every leaf's hook over)
            if pending:
                self.started = pending
        if force:
            check = range(len(held))
        else:
            check = set(attached) | extra | touched
            for name in pending:
                check.update(self.adapter_idx.get(name, ()))
        pattern = self.pattern
        now, zero = set(), []
        adapter_of = self.adapter_of
        for i in check:
            p, v = held[i], views[i]
            g = p.grad
            if not (pattern and pattern[i]):
                want = None
            elif g is v:
                want = v
            elif g is not None:  # a tensor put in place of the view: the whole gradient
                with torch.no_grad():
                    want = v.copy_(g)
                if self.dirty is not None:
                    self.dirty.add(adapter_of[i])
            elif adapter_of[i] in pending:
                want = v
                zero.append(v)
            else:
                want = None
            if g is not want:
                p.grad = want
            if want is not None:
                now.add(i)
        if zero:
            with torch.no_grad():
                torch._foreach_zero_(zero)
        if touched:
            self._note_touched({adapter_of[i] for i in touched if adapter_of[i] is not None})
        if now != attached:  # (the same set: the hooks' ``watch`` holds; a layout rebuilds it itself)
            self.attached = now
            self._watch()

    def _touched_ids(self) -> list:
        """The ids in ``_TOUCHED`` of this store's parameters."""
        index_of = self.index_of
        return [t for t in _TOUCHED if t in index_of] if _TOUCHED else []

    def _take_touched(self) -> set:
        """The indices of this store's parameters in ``_TOUCHED`` (taken out of it)."""
        mine = self._touched_ids()
        _TOUCHED.difference_update(mine)
        out = set(map(self.index_of.__getitem__, mine))
        if out and self.ddp.active:  # under DDP the calls of the layers DDP reduces take the parameters themselves
            leaf_of, lids = self.leaf_of, self.ddp.layers  # (zeros for adapters without rows): not touches
            out = {i for i in out if leaf_of[i][0] in lids}
        return out

    def _note_touched(self, names: set) -> None:
        """Adapters whose parameters a gradient reached outside the layer calls: their pieces may be nonzero
        (``dirty``), and a torch.optim bridge checks at its step that each has all its gradients or none."""
        self.touched_adapters |= names
        if self.dirty is not None:
            self.dirty |= names

    def clear_held_grads(self, others, set_to_none: bool, owned=None) -> None:
        """A ``zero_grad`` (torch's step per parameter: :func:`clear_grads`) of ``others`` and of the held parameters
        that may have a ``.grad`` -- those whose view is attached and those a gradient reached outside the layer calls
        since the last ``prepare_grads`` (every other one has ``None``, as the store left it: a ``.grad`` set by hand
        on the parameter of an adapter outside the batch is not seen); ``owned``: only those of these adapters.
        Without ``set_to_none`` the views stay attached (zeroed); else the cleared ones leave ``attached``, so the
        next backward's start reads the batch's parameters only."""
        idx = set(self.attached)
        idx.update(map(self.index_of.__getitem__, self._touched_ids()))
        if owned is not None:
            adapter_of = self.adapter_of
            idx = {i for i in idx if adapter_of[i] in owned}
        held = self._held
        clear_grads([held[i] for i in idx] + list(others), set_to_none)
        if set_to_none and self.attached:
            self.attached.difference_update(idx)
            self._watch()

    def whole(self, name) -> Optional[bool]:
        """Whether every trained parameter of adapter ``name`` has its gradient view attached (True), none has
        (False), or some do (None)."""
        idx = [i for i in self.adapter_idx.get(name, ()) if self.pattern[i]]
        n = sum(map(self.attached.__contains__, idx))
        return True if n == len(idx) else False if n == 0 else None

    def _watch(self) -> None:
        """``watch`` from ``attached``: per leaf, what its hook checks."""
        attached, held, views = self.attached, self._held, self._views
        if len(attached) * 8 < len(held):  # a few: by index
            by_leaf: dict = {}
            for i in attached:
                by_leaf.setdefault(self.leaf_of[i], []).append(i)
        else:  # most: by layer, C-level filters
            by_leaf = {}
            for s in self.slots.values():
                n = len(s.names)
                for part, ix in ((0, s.held_idx[:n]), (1, s.held_idx[n:])):
                    sel = list(itertools.compress(ix, map(attached.__contains__, ix)))
                    if sel:
                        by_leaf[(s.lid, part)] = sel
        self.watch = {key: (tuple(map(held.__getitem__, ix)), tuple(map(views.__getitem__, ix)))
                      for key, ix in by_leaf.items()}

    def _deferred_runs(self) -> list:
        """The deferred forward calls (``calls`` entries) that the backward running now runs."""
        return [c for c in self.calls if c[3] and self._runs(c)]

    def _backward_starts(self, runs: Optional[list] = None) -> None:
        """:meth:`prepare_grads` at a leaf of a backward that starts with adapters ``pending``, or running deferred
        calls (``runs``: :meth:`_deferred_runs`, when the caller has it) -- or with neither but views dropped since
        the last backward started (``zero_grad`` between two backwards through one retained graph): then that
        backward's adapters (``started``) take their views back, zeroed, as stock PEFT's parameters take the second
        backward's gradients."""
        if not self.pending:
            runs = self._deferred_runs() if runs is None else runs
            self.pending = set().union(*(c[0] for c in runs)) if runs else set(self.started)
        self.dropped = False
        self.prepare_grads()

    def _hook(self, slots: LayerSlots, part: slice):
        """A hook on one of a layer's leaves, run before its gradient accumulates into the arena (by the engine, or
        first by a layer call that adds the gradient itself, see ``function._adds``): at a backward's first leaf
        (adapters are pending), or when one of the leaf's attached parameters lost its view since (an optimizer's
        ``zero_grad``), :meth:`_backward_starts`. A few identity checks per leaf and backward otherwise (the leaf's
        parameters whose view is attached); none at the engine's call after a layer call added the gradient."""
        key = (slots.lid, 0 if part.start == 0 else 1)

        def hook(grad):
            if self.ddp.sync is not None or self.ddp.done:  # under DDP: the arenas' all-reduce, when the backward ends
                self.ddp.leaf_hook(self, slots.a_leaf if part.start == 0 else slots.b_leaf)
            runs = self._deferred_runs() if self.calls and not (self.pending or self.dropped) else None
            if self.pending or self.dropped or runs:
                self._backward_starts(runs)
                return None
            if grad is None:  # the engine's call at a leaf whose gradient the layer call added (or none flows):
                return None  # nothing accumulates; the layer call's own call (not None) checked the views
            params, views = self.watch.get(key, ((), ()))
            if not all(map(operator.is_, [p.grad for p in params], views)):  # (an optimizer's zero_grad since)
                self._backward_starts()
            return None

        return hook

    def zero_grad(self) -> None:
        """Zero the gradient arena and ``seen`` (no per-parameter work: the parameters' ``.grad`` stay its views):
        the pieces of the adapters that may hold a gradient (``dirty``: those of the gradient-recording calls and of
        gradients copied in since the last zero_grad), or every arena when they are a quarter of the model's adapters
        or more, or unknown -- the work of the batches, not of the registry."""
        dirty, self.dirty = self.dirty, set()
        names = self.adapter_idx
        if dirty is None or len(dirty) * 4 > len(self.router.slot_of):  # (the model's adapters)
            for arena in self.arenas.values():
                arena.grad.zero_()
        else:
            views = self._views
            pieces = [views[i] for name in dirty for i in names.get(name, ())]
            if pieces:
                torch._foreach_zero_(pieces)
        self.clear_seen()
        self.prepare_grads()  # views a caller dropped or replaced since: attached again (their pieces are zero)

    def clear_seen(self) -> None:
        """No adapter seen (a ``zero_grad``). The calls the last backward armed whose graph lives on (kept for a
        second backward, ``retain_graph``) wait again, deferred: a backward through them arms them and marks them
        seen again -- ``fast_multilora.AdamW``'s ``zero_grad`` keeps the views attached, so nothing else would."""
        self._unmarked = {}
        if self._seen is not None:
            self._seen.zero_()
        if self.last_armed:
            have = set(map(id, self.calls))
            for c in self.last_armed:
                if id(c) not in have and c[1]() is not None:
                    c[3] = True
                    self.calls.append(c)
            self.last_armed = []

    def layer_slots(self, layer) -> Optional[LayerSlots]:
        return self.slots.get(id(layer))


def _zero_grad(model, set_to_none: bool = True) -> None:
    """``model.zero_grad()`` of a model with a store (bound to the model: a deep copy binds to the copy): torch's,
    except that the adapters the store holds are not walked -- their parameters with a gradient are those whose view
    the store attached and those a gradient reached outside the layer calls (``_TOUCHED``); the store leaves every
    other ``None``. The rest of the model is walked as torch walks it (modules, parameters)."""
    from .patching import _ROUTER_ATTR

    router = model.__dict__.get(_ROUTER_ATTR)
    store = router.store if router is not None else None
    if store is None or store.retired or getattr(model, "_is_replica", False) or type(model).zero_grad is not \
            torch.nn.Module.zero_grad:
        type(model).zero_grad(model, set_to_none=set_to_none)
    else:
        store.clear_held_grads(_outside_params(model, store), set_to_none)
    if store is not None:
        store.prepare_grads()  # the views the stock zero_grad dropped: attached again, zeroed, for pending adapters
        store.dropped = store.dropped or (set_to_none and not store.pending)  # (a retained graph's next backward)
        store.clear_seen()


def clear_grads(params, set_to_none: bool) -> None:
    """What torch's ``zero_grad`` does to each of ``params`` with a ``.grad``: ``None``, or detached and zeroed (one
    ``torch._foreach_zero_``)."""
    zero = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if set_to_none:
            p.grad = None
            continue
        if g.grad_fn is not None:
            g.detach_()
        else:
            g.requires_grad_(False)
        zero.append(g)
    if zero:
        with torch.no_grad():
            torch._foreach_zero_(zero)


def _outside_params(model, store: AdapterStore) -> list:
    """The parameters of ``model`` (as ``model.parameters()``) but those of the per-adapter containers of layers whose
    every adapter the store holds: a walk of the model's modules that does not enter them."""
    slots = store.slots
    out, seen, stack = [], set(), [model]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out += [p for p in m._parameters.values() if p is not None]
        mods = m._modules
        s = slots.get(id(m))
        if s is not None:
            n = len(s.names)
            a, b = mods.get("lora_A"), mods.get("lora_B")
            if a is not None and b is not None and len(a) == n and len(b) == n:  # (all held: not entered)
                stack.extend(c for k, c in mods.items() if c is not None and c is not a and c is not b)
                continue
        stack.extend(c for c in mods.values() if c is not None)
    return out


def _shadow_zero_grad(model, store: AdapterStore) -> None:
    """``model.zero_grad()`` (Trainer calls it) also clears the gradient arena: the parameters' ``.grad`` views would
    otherwise be dropped while the arena kept the old sums."""
    from .patching import _HOOKS_ATTR, _InstanceAttr

    # (a partial, not a bound method: pickle takes it by reference to ``_zero_grad``; a bound method of a module
    # function would be looked up on the model by name)
    model.__dict__["zero_grad"] = functools.partial(_zero_grad, model)
    model.__dict__.setdefault(_HOOKS_ATTR, []).append(_InstanceAttr(model, "zero_grad"))
