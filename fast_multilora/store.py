"""Slot-stacked adapter storage: a patched model's LoRA Linear weights, all adapters, in a few flat buffers.

With many resident adapters the cost of a step is host work per adapter tensor: each adapter is two tensors per
LoRA layer (112 on a Llama-shaped model of 8 layers), and each of them went through autograd's per-input
bookkeeping, a gradient split and the optimizer's per-tensor work. An :class:`AdapterStore` removes that:

* **Storage.** Per ``(dtype, device)`` one flat :class:`Arena`. Per patched layer (in the model's slot order, the
  layer's adapters as its ``AdapterTable`` lists them) one block ``A[total_rank, K]`` -- adapter ``a``'s ``[r_a, K]``
  rows at ``offsets[a]``, the kernels' ``A_cat`` -- and one block ``B[total_rank * N]`` -- adapter ``a``'s ``[N, r_a]``
  weight contiguous at ``N * offsets[a]``, the layout the expand backward writes ``dB`` in. PEFT's own parameters
  stay the model's parameters (names, ``state_dict``, ``save_pretrained``) and share the arena's memory: their
  ``.data`` is their piece of it, so an update of either is an update of both.
* **Autograd.** A layer call takes the layer's two blocks as two leaf tensors (:class:`LayerSlots`), whatever the
  number of adapters; its backward returns each block's whole gradient, which autograd adds in place into the
  gradient arena (the leaves' ``.grad`` are views of it, as are the parameters' ``.grad``: ``clip_grad_norm_`` and
  any code reading ``p.grad`` see the gradients).
* **Optimizer.** :class:`fast_multilora.optim.AdamW` steps each arena in one launch (per-adapter hyperparameters from
  its param groups); adapters that were in no batch since the last ``zero_grad`` are not stepped (``seen``), as an
  adapter without gradients is not stepped by ``torch.optim``.

The store is built by that optimizer (``AdapterStore.of(model)``). It follows the model: a layer whose adapters,
ranks, dtypes or devices change, an adapter added or deleted (``add_adapter``, ``delete_adapter``, ``load_adapter``)
re-lays the arenas out at the next forward call, moving the weights, the gradients and the optimizer states of the
adapters that stay (``Arena.states``) and freeing what went. Layers it cannot hold (``lora_bias``, mixed adapter
dtypes or devices within a layer, MoE experts, PEFT's fallback layers, FSDP2's sharded parameters) keep their own
parameters and take the per-parameter path (the optimizer steps them with torch's AdamW math). Under
``DistributedDataParallel`` the store's parameters are left out of DDP's reducer (all but one anchor layer's) and the
store all-reduces its gradient arenas once per synchronised backward (``fast_multilora.ddp``); a layer whose
parameters DDP does reduce takes the per-parameter path, on which their gradients still land in the gradient arena
(their ``.grad`` are views of it). Sharding a model after its store was built (FSDP2) takes its layers out of the
store with a warning (their optimizer states start over).
"""

from __future__ import annotations

import operator
import types
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch

from .ddp import StoreSync, mark_model
from .plan import CHANGES

_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_DATA_PTR = torch.Tensor.data_ptr
_TENSOR_REQUIRES_GRAD = torch._C.TensorBase.requires_grad  # the C attribute (get / set)


class _HeldParameter(torch.nn.Parameter):
    """The class of a parameter while an adapter store holds it: a ``torch.nn.Parameter`` whose ``requires_grad``
    changes (``requires_grad_``, assignment, ``Module.requires_grad_``, PEFT's ``set_requires_grad``) are reported
    (``plan.CHANGES``), so a forward call reads every held parameter's flag only after one -- that read costs
    ~0.1-0.3 us per parameter (cache misses), ~10 ms per forward at 256 adapters x 56 layers. The class goes back to
    ``Parameter`` when the parameter leaves the store or the model is unpatched."""

    __slots__ = ()

    def requires_grad_(self, requires_grad: bool = True):
        CHANGES[0] += 1
        return super().requires_grad_(requires_grad)

    @property
    def requires_grad(self):
        return _TENSOR_REQUIRES_GRAD.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value):
        CHANGES[0] += 1
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


def release(params) -> None:
    """Give parameters that left a store (or a model being unpatched) their ``Parameter`` class back."""
    for p in params:
        if type(p) is _HeldParameter:
            p.__class__ = torch.nn.Parameter


ALIGN = 64  # elements: every block starts 256-byte aligned for fp32 (the kernels' in-place reads need 16)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _piece(buf: torch.Tensor, start: int, shape: tuple) -> torch.Tensor:
    """A tensor on ``buf``'s memory at element ``start`` (not a view: no ``_base``, its own autograd identity)."""
    t = torch.empty(0, dtype=buf.dtype, device=buf.device)
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return t.set_(buf.untyped_storage(), buf.storage_offset() + start, tuple(shape), tuple(reversed(strides)))


@dataclass(eq=False)
class Arena:
    """One flat buffer of weights per ``(dtype, device)``, its gradient, and optimizer states of the same layout."""

    dtype: torch.dtype
    device: torch.device
    data: torch.Tensor
    grad: torch.Tensor
    states: dict = field(default_factory=dict)  # name -> flat tensor (e.g. AdamW's exp_avg), migrated on re-layout
    blocks: list = field(default_factory=list)  # (start, numel, param) of every parameter held


@dataclass(eq=False)
class LayerSlots:
    """One layer's adapters in the store: the two leaf tensors its calls take, and where their pieces are."""

    names: tuple  # adapters, slot order (the layer table's)
    ranks: tuple
    K: int
    N: int
    a_leaf: torch.Tensor  # [total_rank, K]
    b_leaf: torch.Tensor  # [total_rank * N]
    params: tuple  # (A params..., B params...) slot order
    key: tuple  # _layer_key when laid out
    state: object  # the layer's patching.LayerState it was checked against (a new one: the key is checked again)
    expected: tuple = ()  # each parameter's ``.grad`` as the store last left it: its view, or ``None``
    held_idx: tuple = ()  # each parameter's index in ``AdapterStore.held`` (params' order)

    def b_cat(self, b_leaf: torch.Tensor) -> torch.Tensor:
        """``B_cat[N, total_rank]`` from the packed block (the torch backend's and a compiled graph's layout)."""
        N = self.N
        if len(set(self.ranks)) == 1:
            r = self.ranks[0]
            return b_leaf.view(len(self.ranks), N, r).permute(1, 0, 2).reshape(N, -1)
        pieces, off = [], 0
        for r in self.ranks:
            pieces.append(b_leaf[off * N : (off + r) * N].view(N, r))
            off += r
        return torch.cat(pieces, 1)

    def packed_grad(self, dB_cat: torch.Tensor) -> torch.Tensor:
        """``dB_cat[N, total_rank]`` as the packed block's gradient (flat, adapter ``a``'s ``[N, r_a]`` contiguous)."""
        N = self.N
        if len(set(self.ranks)) == 1:
            r = self.ranks[0]
            return dB_cat.view(N, len(self.ranks), r).permute(1, 0, 2).reshape(-1)
        return torch.cat([g.reshape(-1) for g in dB_cat.split(list(self.ranks), dim=1)])


def _layer_key(layer, state) -> Optional[tuple]:
    """What a layer's slots depend on, or ``None`` when the store cannot hold the layer."""
    if state is None or state.has_bias or len(set(state.a_dtypes)) != 1:
        return None
    a_mods, b_mods = layer.lora_A, layer.lora_B
    params = [a_mods[n].weight for n in state.present] + [b_mods[n].weight for n in state.present]
    p0 = params[0]
    for p in params:
        if p.dtype != p0.dtype or p.device != p0.device or type(p) not in _PARAMETER_TYPES or p.dim() != 2:
            return None
        if type(p.data) is not torch.Tensor:  # e.g. an FSDP2 DTensor
            return None
    K, N = layer.in_features, layer.out_features
    if any(a_mods[n].weight.shape != (r, K) or b_mods[n].weight.shape != (N, r)
           for n, r in zip(state.present, state.ranks, strict=True)):
        return None
    return (state.present, state.ranks, p0.dtype, p0.device, K, N, tuple(id(p) for p in params))


class AdapterStore:
    """The slot-stacked storage of one patched model (see the module docstring)."""

    def __init__(self, router):
        self.router = router
        self.arenas: dict = {}  # (dtype, device) -> Arena
        self.slots: dict = {}  # id(layer) -> LayerSlots
        self.held: list = []  # every held parameter, in layout order (class _HeldParameter while held)
        self.views: list = []  # held[i]'s gradient piece: re-attached when a caller dropped it
        self.adapter_of: list = []  # held[i]'s adapter name
        self.adapter_params: dict = {}  # adapter -> (its held parameters, their addresses when laid out)
        self.ids_read = None  # plan.CHANGES when every held parameter's identity was last checked (stale)
        self.pending: set = set()  # adapters of the gradient-recording calls whose backward has not started yet
        self.hooked: set = set()  # ids of the leaves that carry a hook (leaves live as long as their layout)
        self.flags_read = None  # plan.CHANGES when the held parameters' requires_grad were last read
        self.owner = None  # the fast_multilora.AdamW whose states the arenas hold (the latest one built)
        self.seen: Optional[torch.Tensor] = None  # bool [n_slots + 1]: index 0 base, 1 + slot an adapter (mark_seen)
        self.seen_names: tuple = ()
        self.pattern: Optional[list] = None  # requires_grad of every held parameter (sync_requires_grad)
        self.expected: list = []  # per held parameter: its ``.grad`` as prepare_grads left it (its view or None)
        self.ddp = StoreSync()  # under DistributedDataParallel (fast_multilora.ddp)
        self.layout()

    def __getstate__(self):  # a copy (deepcopy, pickle) of the model: its store has no optimizer yet
        state = dict(self.__dict__)
        state["owner"] = None
        state["ddp"] = StoreSync()
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
            self.mark_seen(routing)

    def mark_seen(self, routing) -> None:
        """``seen[slot]``: the adapter had a token in a gradient-recording call since the last ``zero_grad`` (device
        ops only)."""
        slots = routing.row_slots if routing.per_row else routing.token_slots
        if slots is None or not self.arenas:
            return
        if self.seen is None or self.seen_names != routing.slot_names or self.seen.device != slots.device:
            self.seen = torch.zeros(len(routing.slot_names) + 1, dtype=torch.bool, device=slots.device)
            self.seen_names = routing.slot_names
        self.seen.index_fill_(0, slots.reshape(-1).long() + 1, True)  # index 0: base tokens (slot -1)

    # -- layout ---------------------------------------------------------------------------------------------------
    def _wanted(self) -> dict:
        from .patching import _STATE_ATTR

        wanted = {}
        for layer in self.router.fast_layers:
            key = _layer_key(layer, layer.__dict__.get(_STATE_ATTR))
            if key is not None:
                wanted[id(layer)] = (layer, key)
        return wanted

    def stale(self, names=None) -> bool:
        """Whether the layers' adapters no longer match the layout: per layer its state and first parameter, and the
        address of every parameter of the adapters ``names`` (default: all) -- a parameter whose ``.data`` was
        replaced left its arena. A forward checks the adapters it names only: the kernels read no other adapter's
        rows, and an adapter whose parameter moved is caught by the first forward that names it (or by
        ``fast_multilora.AdamW``'s step, which checks all), its values then read from the parameters."""
        from .patching import _STATE_ATTR

        for layer in self.router.fast_layers:
            st = layer.__dict__.get(_STATE_ATTR)
            slots = self.slots.get(id(layer))
            if slots is None:
                if _layer_key(layer, st) is not None:
                    return True
                continue
            if st is not slots.state:  # the layer's adapters, modes, dtypes or devices changed since the check
                if _layer_key(layer, st) != slots.key:
                    return True
                slots.state = st
            if layer.lora_A[slots.names[0]].weight is not slots.params[0]:
                return True
        if not set(self.slots) <= {id(layer) for layer in self.router.fast_layers}:
            return True
        if self.ids_read != CHANGES[0]:  # after a reported change (mark_changed): every weight still the one held?
            for layer in self.router.fast_layers:
                slots = self.slots.get(id(layer))
                if slots is None:
                    continue
                mods = [layer.lora_A._modules.get(n) for n in slots.names]
                mods += [layer.lora_B._modules.get(n) for n in slots.names]
                if any(m is None or m.weight is not p for m, p in zip(mods, slots.params, strict=True)):
                    return True
            self.ids_read = CHANGES[0]
        for name in (self.adapter_params if names is None else names):
            entry = self.adapter_params.get(name)
            if entry is not None and tuple(map(_DATA_PTR, entry[0])) != entry[1]:
                return True
        return False

    def layout(self) -> None:
        """(Re-)lay the arenas out for the layers' current adapters; weights are read from the parameters, and the
        gradients and optimizer states of parameters that stay are carried over."""
        from .patching import _STATE_ATTR

        wanted = self._wanted()
        left = {id(layer) for layer in self.router.fast_layers if id(layer) in self.slots and id(layer) not in wanted}
        if any(type(p.data) is not torch.Tensor for layer in self.router.fast_layers if id(layer) in left
               for p in layer.parameters()):
            warnings.warn("fast_multilora: parameters held by the adapter store were replaced by other tensor types "
                          "(FSDP2's shards?): they leave the store and their optimizer states start over",
                          stacklevel=3)
        old_arenas = self.arenas
        old_pieces = {}  # param id -> (arena, start, numel)
        for arena in old_arenas.values():
            for start, numel, p in arena.blocks:
                old_pieces[id(p)] = (arena, start, numel)
        sizes: dict = {}
        for _, key in wanted.values():
            _, ranks, dtype, device, K, N, _ = key
            R = sum(ranks)
            sizes[(dtype, device)] = sizes.get((dtype, device), 0) + _aligned(R * K) + _aligned(R * N)
        arenas = {}
        state_names = set()
        for arena in old_arenas.values():
            state_names.update(arena.states)
        for (dtype, device), numel in sizes.items():
            arenas[(dtype, device)] = Arena(dtype, device, torch.zeros(numel, dtype=dtype, device=device),
                                            torch.zeros(numel, dtype=dtype, device=device),
                                            {s: torch.zeros(numel, dtype=dtype, device=device) for s in state_names})
        cursor = dict.fromkeys(arenas, 0)
        slots, held, views, adapter_of = {}, [], [], []
        with torch.no_grad():
            for lid, (layer, key) in wanted.items():
                present, ranks, dtype, device, K, N, _ = key
                arena = arenas[(dtype, device)]
                R = sum(ranks)
                a0 = cursor[(dtype, device)]
                b0 = a0 + _aligned(R * K)
                cursor[(dtype, device)] = b0 + _aligned(R * N)
                a_params = tuple(layer.lora_A[n].weight for n in present)
                b_params = tuple(layer.lora_B[n].weight for n in present)
                off = 0
                first = len(held)
                for name, r, pa, pb in zip(present, ranks, a_params, b_params, strict=True):
                    for p, start, shape in ((pa, a0 + off * K, (r, K)), (pb, b0 + off * N, (N, r))):
                        numel = shape[0] * shape[1]
                        _piece(arena.data, start, shape).copy_(p.data)
                        prev = old_pieces.get(id(p))
                        had_grad = p.grad is not None
                        if prev is not None and prev[2] == numel:  # carried over: its gradient and states
                            old, old_start, _ = prev
                            pairs = [(arena.grad, old.grad)]
                            pairs += [(arena.states[s], old.states[s]) for s in arena.states if s in old.states]
                            for buf, src in pairs:
                                buf[start : start + numel].copy_(src[old_start : old_start + numel])
                        elif had_grad and p.grad.shape == p.shape:
                            _piece(arena.grad, start, shape).copy_(p.grad)
                        p.data = _piece(arena.data, start, shape)
                        gview = _piece(arena.grad, start, shape)
                        # a gradient it had lives on in its view; none stays none (as under stock PEFT, a
                        # parameter gets a ``.grad`` from the first backward that reaches its adapter)
                        p.grad = gview if p.requires_grad and had_grad else None
                        held.append(p)
                        views.append(gview)
                        adapter_of.append(name)
                        arena.blocks.append((start, numel, p))
                    off += r
                a_leaf = _piece(arena.data, a0, (R, K))
                b_leaf = _piece(arena.data, b0, (R * N,))
                a_leaf.grad = _piece(arena.grad, a0, (R, K))
                b_leaf.grad = _piece(arena.grad, b0, (R * N,))
                pairs = range(first, first + 2 * len(present), 2)  # held order: each adapter's A, then its B
                slots[lid] = LayerSlots(present, ranks, K, N, a_leaf, b_leaf, a_params + b_params, key,
                                        layer.__dict__.get(_STATE_ATTR),
                                        held_idx=tuple(pairs) + tuple(i + 1 for i in pairs))

        self.arenas, self.slots, self.held, self.views = arenas, slots, held, views
        self.adapter_of = adapter_of
        by_adapter: dict = {}
        for p, name in zip(held, adapter_of, strict=True):
            by_adapter.setdefault(name, []).append(p)
        self.adapter_params = {n: (tuple(ps), tuple(map(_DATA_PTR, ps))) for n, ps in by_adapter.items()}
        self.expected = [p.grad for p in held]
        self.hooked = set()  # the new layout's leaves have none yet
        for p in held:
            _hold(p)
        kept = {id(p) for p in held}
        release(p for arena in old_arenas.values() for _, _, p in arena.blocks if id(p) not in kept)
        self.pattern = None
        self.sync_requires_grad()
        if self.owner is not None:
            self.owner._follow(self)

    # -- per step -------------------------------------------------------------------------------------------------
    def sync_requires_grad(self) -> bool:
        """A leaf requires a gradient when one of its parameters does (a frozen adapter's rows of a trained block get
        gradients nobody reads: its parameters have no ``.grad`` and the optimizer skips them). Returns whether the
        pattern changed since the last call (one pass over the flags when it did not)."""
        self.flags_read = CHANGES[0]
        pattern = list(map(_REQUIRES_GRAD, self.held))  # C-level: ~0.1-0.3 us per parameter (cache misses)
        if pattern == self.pattern:
            return False
        self.pattern = pattern
        for s in self.slots.values():
            n = len(s.names)
            a_req = any(p.requires_grad for p in s.params[:n])
            b_req = any(p.requires_grad for p in s.params[n:])
            for leaf, req, part in ((s.a_leaf, a_req, slice(0, n)), (s.b_leaf, b_req, slice(n, 2 * n))):
                if leaf.requires_grad != req:
                    leaf.requires_grad_(req)
                    if req and id(leaf) not in self.hooked:  # once per leaf (a frozen tensor takes no hook)
                        leaf.register_hook(self._hook(s, part))
                        self.hooked.add(id(leaf))
        self.prepare_grads(force=True)  # one that no longer trains loses its view
        return True

    def prepare_grads(self, force: bool = False) -> None:
        """Give each held parameter the ``.grad`` stock PEFT would leave it, with the gradient in the arena.

        Any optimizer may own the parameters: ``torch.optim``'s ``zero_grad()`` drops each ``.grad`` (``None``: the
        gradient is zero from then on), DDP's reducer or a caller may put another tensor there (it holds the whole
        gradient), while the layer calls' gradients land in the arena through the two leaves. So, per trained
        parameter: a view in place stays; another tensor is copied into its piece and the view attached; a dropped
        one gets its view (the piece zeroed; one fill per arena when no parameter kept its view, the common case)
        when its adapter is in a call whose backward is starting (``pending``), else keeps ``None`` -- an adapter
        with no rows since its gradient was dropped has no gradient, as under stock PEFT, so ``torch.optim`` skips it
        (no weight decay, no momentum step). A frozen parameter has no ``.grad``. One identity check per parameter
        when nothing changed. Runs before the leaves' gradients accumulate (a hook on each leaf, see :meth:`_hook`),
        before an optimizer step of ours, after ``model.zero_grad()`` and when a ``requires_grad`` changed."""
        grads = [p.grad for p in self.held]
        pending = self.pending
        if not force and not pending and all(map(operator.is_, grads, self.expected)):
            return
        self.pending = set()
        expected = []
        with torch.no_grad():
            kept = any(g is not None and g is e for g, e in zip(grads, self.expected, strict=True))
            if not kept:  # no parameter kept its view: a whole optimizer's zero_grad(), or the first backward
                for arena in self.arenas.values():
                    arena.grad.zero_()
            for p, g, v, trained, name in zip(self.held, grads, self.views, self.pattern or (), self.adapter_of,
                                              strict=True):
                if not trained:
                    want = None
                elif g is v:
                    want = v
                elif g is not None:  # a tensor put in place of the view: the whole gradient
                    want = v.copy_(g)
                elif name in pending:
                    want = v.zero_() if kept else v
                else:
                    want = None
                if g is not want:
                    p.grad = want
                expected.append(want)
        self.expected = expected
        for s in self.slots.values():
            s.expected = tuple(expected[i] for i in s.held_idx)

    def _hook(self, slots: LayerSlots, part: slice):
        """A hook on one of a layer's leaves, run before its gradient accumulates into the arena: at a backward's
        first leaf (adapters are pending), or when one of the layer's parameters lost its view since (an optimizer's
        ``zero_grad`` between the forward and the backward), :meth:`prepare_grads` first. A few identity checks per
        leaf and backward otherwise."""

        def hook(grad):
            if self.ddp.sync is not None or self.ddp.done:  # under DDP: the arenas' all-reduce, when the backward ends
                self.ddp.leaf_hook(self, slots.a_leaf if part.start == 0 else slots.b_leaf)
            if self.pending or not all(map(operator.is_, [p.grad for p in slots.params[part]],
                                           slots.expected[part])):
                self.prepare_grads()
            return None

        return hook

    def zero_grad(self) -> None:
        """Zero the gradient arena and ``seen`` (no per-parameter work: the parameters' ``.grad`` stay its views)."""
        for arena in self.arenas.values():
            arena.grad.zero_()
        self.clear_seen()
        self.prepare_grads()  # views a caller dropped or replaced since: attached again (their pieces are zero)

    def clear_seen(self) -> None:
        if self.seen is not None:
            self.seen.zero_()

    def layer_slots(self, layer) -> Optional[LayerSlots]:
        return self.slots.get(id(layer))


def _zero_grad(model, set_to_none: bool = True) -> None:
    """``model.zero_grad()`` of a model with a store (bound to the model: a deep copy binds to the copy)."""
    from .patching import _ROUTER_ATTR

    type(model).zero_grad(model, set_to_none=set_to_none)
    router = model.__dict__.get(_ROUTER_ATTR)
    if router is not None and router.store is not None:
        router.store.prepare_grads()  # the views the stock zero_grad dropped, their pieces zeroed
        router.store.clear_seen()


def _shadow_zero_grad(model, store: AdapterStore) -> None:
    """``model.zero_grad()`` (Trainer calls it) also clears the gradient arena: the parameters' ``.grad`` views would
    otherwise be dropped while the arena kept the old sums."""
    from .patching import _HOOKS_ATTR, _InstanceAttr

    model.__dict__["zero_grad"] = types.MethodType(_zero_grad, model)
    model.__dict__.setdefault(_HOOKS_ATTR, []).append(_InstanceAttr(model, "zero_grad"))
