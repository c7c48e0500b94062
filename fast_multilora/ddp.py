"""The adapter store under ``DistributedDataParallel``: the store, not DDP's reducer, all-reduces the gradients of the
parameters it holds.

DDP's reducer hooks sit on each parameter's gradient accumulator; a layer call on the store takes the layer's two
arena leaves instead (``fast_multilora.store``), whose gradients never pass through the parameters' accumulators. So:

* **DDP ignores the store's parameters.** A patched model with a store carries ``_ddp_params_and_buffers_to_ignore``
  (the attribute ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model`` sets and DDP's constructor
  reads), whose names are computed when DDP's constructor reads them: every parameter the store holds, except one
  layer's when nothing else in the model trains (DDP refuses a model none of whose parameters it reduces trains).
  That layer, the *anchor*, stays DDP's. Names set there before ``patch`` are kept.
* **Per layer, at a forward under DDP:** a held layer none of whose parameters DDP reduces takes the store's leaves;
  any other layer (the anchor, a layer held after DDP was built, every layer when DDP wraps a module around the
  patched model) takes the per-parameter path, on which DDP's hooks see its parameters. Checked once per DDP module
  and layout; when DDP reduces every held parameter, a warning names the fix.
* **Start.** DDP broadcasts rank 0's parameters when it is built, but not ignored ones: at the first forward under a
  DDP module the store broadcasts its arenas from the process group's first rank.
* **Reduce.** A backward of a forward under DDP with gradient sync on (not inside ``ddp.no_sync()``, so gradient
  accumulation works as with DDP): the forward notes the leaves its layer calls take; a leaf's gradient hook queues a
  callback on the backward running it (autograd's ``queue_callback``, as DDP's own finalization), which reduces once
  every noted leaf's gradient arrived -- at the end of the backward, or of the last nested one under reentrant
  gradient checkpointing (a recomputation takes the path its forward took). It gives every trained held parameter
  its ``.grad`` view (pieces whose ``.grad`` was ``None`` zeroed first), then, issued together and waited on
  together, per gradient arena one all-reduce (divided by the world size, summed: DDP's average) over DDP's process
  group, one all-reduce (max) of the adapters ``seen`` since ``zero_grad`` (``fast_multilora.AdamW`` steps the
  union, on every rank alike), and one of each parameter DDP ignores for the store but the store no longer holds.
  The anchor's pieces are reduced by both: the average of equal values is the value.
* **Adapters absent from a rank's batch** have zero pieces there, so the average is right; after the reduce every
  trained held parameter has a gradient (its view) on every rank, as DDP gives every parameter it reduces one: an
  adapter in the batch of any rank, or of none, gets one everywhere (zeros for none), so ``torch.optim`` steps the
  same parameters on every rank. (Without DDP an adapter with no rows keeps ``.grad`` ``None``.)

The store's gradients are reduced once per backward, after it ends, not bucket by bucket during it as DDP's are: one
all-reduce per arena. DDP's communication hooks (``register_comm_hook``) do not apply to them. A backward that
continues after the reduce (a second backward through one forward) raises, as does the next forward after a backward
that ended with a noted leaf still waiting (a layer output that never reached the loss).

**FSDP2** (``torch.distributed.fsdp.fully_shard``). The adapters are replicated and the base sharded: the store's
parameters are passed to ``fully_shard`` as ``ignored_params`` (:func:`fsdp_ignored_params`), so FSDP2 neither
shards nor reduces them, and the store does, as under DDP: a forward of a model ``fully_shard`` was applied to (or
to modules inside it; looked for when the model's class changes, which ``fully_shard`` on the model does: apply it
before the first forward) takes the leaves in every held layer; the arenas are broadcast at its first forward and
all-reduced (averaged: FSDP2's default) at the end of each backward over every dimension of FSDP2's device mesh, in
turn -- skipped while ``set_requires_gradient_sync(False)`` holds. FSDP2's mesh and that flag are read from its
state (private attributes; without them: a sharded parameter's mesh or the default group, and a reduce at every
backward, which gives the same gradients: the average of the already-averaged part is itself). Sharded
adapter parameters (``fully_shard`` without ``ignored_params``) leave the store with a warning naming the fix and
take the per-parameter path, on which FSDP2 reduces them.

**torch.compile.** ``torch.compile(DDP(model))`` (accelerate's order), ``model.compile()`` before ``DDP(model)`` and
``DDP(torch.compile(model))`` (DDP reads the names through the compile wrapper and names the parameters under it:
each name is also given as ``_orig_mod.<name>``) run as above: the routing entry (``follow``) and the reduce run
outside the graph, the graph takes the leaves. The leaves a traced layer call notes go to ``noted``, which is empty at
each forward's entry, and tracing does not read ``sync``: Dynamo guards on the Python state a graph reads or mutates,
so one graph serves synchronised and ``no_sync`` forwards and several forwards per backward. A layer output that
does not reach the loss raises as above only when no backward of its graph runs: a compiled graph's backward gives
each of its inputs a gradient (zeros where the loss does not depend on it).
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch


def _active_ddp():
    return torch.nn.parallel.DistributedDataParallel._active_ddp_module


def fsdp_ignored_params(model) -> set:
    """The parameters of patched ``model`` to pass to FSDP2 as ``fully_shard(..., ignored_params=...)`` -- to every
    ``fully_shard`` call on the model or its submodules -- so that the adapter store keeps holding them, replicated
    on every rank, while FSDP2 shards the base: the LoRA weights of every layer the store holds (after ``patch``,
    before ``fully_shard``). The store then broadcasts and all-reduces them itself (the module docstring). Empty
    when the model has no store (``PatchConfig(adapter_store=False)``)."""
    from .patching import _ROUTER_ATTR
    from .store import AdapterStore

    router = model.__dict__.get(_ROUTER_ATTR)
    if router is None:
        raise ValueError("fast_multilora.fsdp_ignored_params: the model is not patched; call "
                         "fast_multilora.patch(model) before fully_shard")
    if not router.config.adapter_store:
        return set()
    store = AdapterStore.of(model)
    if store.stale():
        store.layout()
    store.ddp.given |= {id(p) for p in store.held}
    return set(store.held)


class _Fsdp:
    """A model under FSDP2, as one forward finds it: the process groups to reduce over, the FSDP modules whose gradient
    sync flag is read."""

    def __init__(self, mesh, modules):
        self.mesh = mesh
        self.groups = tuple(mesh.get_group(d) for d in range(mesh.ndim))
        self.modules = [weakref.ref(m) for m in modules]

    def reduces(self) -> bool:
        """FSDP2's ``set_requires_gradient_sync``: off on the root (or the first FSDP module with parameters) skips
        the reduce. The flag lives in FSDP2's private state; without it every backward reduces (the same gradients,
        more traffic)."""
        for ref in self.modules:
            groups = _param_groups(ref())
            if groups is None:
                return True
            if groups:
                return bool(groups[0].reduce_grads)
        return True


def _param_groups(module):
    """FSDP2's parameter groups of ``module`` (private state, the groups ``set_requires_gradient_sync`` writes: a list
    ``_fsdp_param_groups`` in newer torch, one ``_fsdp_param_group`` or ``None`` in torch <= 2.11), or ``None`` where
    neither is there."""
    try:
        state = module._get_fsdp_state()
    except AttributeError:
        return None
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    if not hasattr(state, "_fsdp_param_group"):
        return None
    group = state._fsdp_param_group
    return [group] if group is not None else []


def _unreduced(root, store, given) -> tuple:
    """Under FSDP2, the parameters the store reduces that it does not hold: those handed out by
    :func:`fsdp_ignored_params` that left it, and every trained parameter FSDP2 does not manage -- a plain tensor (not
    a shard) of a module ``fully_shard`` left out (e.g. ignored by a name pattern, as accelerate's ``ignored_modules``,
    in a layer the store cannot hold) -- which FSDP2 would leave unreduced. FSDP2 marks the modules it manages
    (``_is_fsdp_managed_module``, set for Dynamo)."""
    from torch.distributed.tensor import DTensor

    held = {id(p) for p in store.held}
    out, seen = [], set()
    for m in root.modules():
        managed = getattr(m, "_is_fsdp_managed_module", False)
        for p in m._parameters.values():
            if p is None or id(p) in held or id(p) in seen:
                continue
            seen.add(id(p))
            if id(p) in given or (not managed and p.requires_grad and not isinstance(p, DTensor)):
                out.append(p)
    return tuple(out)


def _find_fsdp(root):
    """``_Fsdp`` of ``root`` when ``fully_shard`` was applied to it or to modules inside it, else ``None``. The mesh:
    FSDP2's record of it (a private attribute), else a sharded parameter's (at a forward's entry the root's own group
    is already unsharded, the layers' not yet), else the default process group's (``fully_shard``'s default mesh)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch built without distributed
        return None
    modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
    if not modules:
        return None
    for m in modules:
        groups = _param_groups(m)
        if groups:
            return _Fsdp(groups[0].mesh_info.mesh, modules)
    for p in root.parameters():
        if isinstance(p, DTensor):
            return _Fsdp(p.device_mesh, modules)
    from torch.distributed.device_mesh import init_device_mesh

    return _Fsdp(init_device_mesh(next(root.parameters()).device.type, (torch.distributed.get_world_size(),)),
                 modules)


# DDP(torch.compile(model)): DDP reads the model's names through torch.compile's wrapper (``OptimizedModule`` hands
# attribute reads to the model it wraps) and names the parameters under the wrapper, with this prefix
_COMPILED_PREFIX = "_orig_mod."


class IgnoredNames:
    """``model._ddp_params_and_buffers_to_ignore`` of a patched model with a store: the names are computed when DDP's
    constructor reads them (``set(module._ddp_params_and_buffers_to_ignore)``), so they follow the adapters and
    ``requires_grad`` flags of that moment; each name also as the ``torch.compile`` wrapper names it
    (``_orig_mod.<name>``), for ``DDP(torch.compile(model))``."""

    def __init__(self, store, earlier=()):
        self.store, self.earlier = store, tuple(earlier)

    def names(self) -> list:
        names = list(self.earlier) + self.store.ddp.ignored_names(self.store, self.earlier)
        return names + [_COMPILED_PREFIX + n for n in names]

    def __iter__(self):
        return iter(self.names())

    def __len__(self):
        return len(self.names())

    def __contains__(self, name):
        return name in self.names()


class _Restore:
    """Handle that puts a model's earlier ``_ddp_params_and_buffers_to_ignore`` back (``unpatch``)."""

    def __init__(self, model, earlier):
        self.model, self.earlier = model, earlier

    def remove(self):
        if self.earlier is None:
            self.model.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
        else:
            self.model.__dict__["_ddp_params_and_buffers_to_ignore"] = self.earlier


def mark_model(model, store) -> None:
    """Give ``model`` (the patched one) the names DDP is to ignore (see the module docstring)."""
    from .patching import _HOOKS_ATTR

    earlier = model.__dict__.get("_ddp_params_and_buffers_to_ignore")
    if isinstance(earlier, IgnoredNames):
        earlier = list(earlier.earlier)
    model.__dict__["_ddp_params_and_buffers_to_ignore"] = IgnoredNames(store, earlier or ())
    model.__dict__.setdefault(_HOOKS_ATTR, []).append(_Restore(model, earlier))


class StoreSync:
    """The DDP state of one :class:`~fast_multilora.store.AdapterStore` (a copy of the model starts afresh)."""

    def __init__(self):
        self.active = False  # the last routed call ran under DDP (its recomputation by checkpointing too)
        self.layers: frozenset = frozenset()  # ids of the layers whose calls take the store's leaves under DDP
        self.key = None  # (DDP module ref, held list, its length) the layers were computed for
        self.orphans: tuple = ()  # parameters DDP ignores for the store that the store no longer holds
        self.given: set = set()  # ids of the parameters whose names DDP was handed
        self.started = None  # ref to the DDP module (FSDP2: device mesh) whose first forward broadcast the arenas
        self.sync = None  # the process groups over which the next backward reduces the arenas (None: it does not)
        self.expect: set = set()  # ids of the leaves taken since the last reduce whose gradient has not arrived yet
        # ids of the leaves the layer calls of the last forward took (take), moved to ``expect`` when its backward
        # starts; empty at each forward's entry, so a compiled graph, which guards on the set it adds to, keeps one
        self.noted: set = set()
        self.arrived = False  # a leaf's gradient arrived since the last reduce
        self.queued = False  # the reduce is queued on the running backward
        self.done = False  # the reduce ran since the last forward
        self.warned = None
        self.fsdp = None  # _Fsdp of the model, or None: not under FSDP2
        self.fsdp_key = None  # (held list, its length, the model's class) ``fsdp`` was found for

    # -- names ----------------------------------------------------------------------------------------------------
    def ignored_names(self, store, earlier=()) -> list:
        """The names (in the patched model) of the held parameters DDP is to ignore, all but the anchor's."""
        if store.stale():
            store.layout()
        root = store.router.root
        held = {id(p) for p in store.held}
        names = {id(p): n for n, p in root.named_parameters()}
        skip = set(earlier)
        others = any(p.requires_grad for n, p in root.named_parameters() if id(p) not in held and n not in skip)
        anchor = set()
        if not others:  # DDP needs a trained parameter of its own: one layer's stay with it
            for s in store.slots.values():
                if any(p.requires_grad for p in s.params):
                    anchor = {id(p) for p in s.params}
                    break
        out = []
        for p in store.held:
            if id(p) in anchor:
                if getattr(p, "_ddp_ignored", False):
                    del p._ddp_ignored
            elif id(p) in names:
                p._ddp_ignored = True  # what _set_params_and_buffers_to_ignore_for_model marks (DDP's mixed precision)
                out.append(names[id(p)])
        self.given = {id(p) for p in store.held if id(p) not in anchor}
        return [n for n in out if n not in skip]

    # -- per forward ----------------------------------------------------------------------------------------------
    def follow(self, store, training: bool) -> None:
        """At a forward call's entry: which layers take the store's leaves under the active DDP module, and whether
        the backward of this call reduces the arenas."""
        if self.sync is not None:  # the last forward's backward is to reduce: what it noted is expected
            self._collect()
        else:  # noted by a compiled forward whose backward reduces nothing (no_sync, no_grad; see take)
            self.noted.clear()
        if self.arrived and self.expect:
            self.arrived, self.expect = False, set()
            raise RuntimeError(
                "fast_multilora: under DistributedDataParallel or FSDP2 a backward ended before every adapter-store "
                "leaf taken in the forward got its gradient (a LoRA layer's output did not reach the loss, or it ran "
                "under no_grad), so the store did not all-reduce its gradients; use every patched layer's output, or "
                "fast_multilora.patch(model, adapter_store=False)")
        ddp = _active_ddp()
        self.done = False
        if ddp is None:
            fsdp = self._fsdp(store)
            self.active = fsdp is not None
            if training:
                self.sync = fsdp.groups if fsdp is not None and self.layers and fsdp.reduces() else None
            return
        self.active = True
        key = self.key
        if key is None or key[0]() is not ddp or key[1] is not store.held or key[2] != len(store.held):
            self._check(store, ddp)
        if training:
            self.sync = (ddp.process_group,) if self.layers and ddp.require_backward_grad_sync else None

    def _fsdp(self, store):
        """The model's FSDP2 state (``None`` outside FSDP2), found when the model's class changed (``fully_shard``
        swaps it: apply it before the first forward) -- a walk over every module, so not at each layout; under FSDP2
        every held layer takes the store's leaves, found again per layout."""
        root = store.router.root
        key = self.fsdp_key
        if key is None or key[2] is not type(root):
            self.fsdp = _find_fsdp(root)
            key = None
        fsdp = self.fsdp
        if fsdp is None:
            self.fsdp_key = (None, 0, type(root))
            self.layers = frozenset()
            return None
        if key is not None and key[0] is store.held and key[1] == len(store.held):
            return fsdp
        if store.router.pager is not None:
            raise ValueError("fast_multilora: paging (PatchConfig.resident_adapters) does not run under FSDP2, whose "
                             "all-gathers and reduce-scatters span every rank's adapters; patch without it")
        self.fsdp_key = (store.held, len(store.held), type(root))
        self.key = None  # DDP's layers are computed again if DDP wraps the model later
        self.layers = frozenset(store.slots)
        self.orphans = _unreduced(root, store, self.given)
        if self._sharded_adapters(store) and self.warned is not _Fsdp:
            self.warned = _Fsdp
            warnings.warn(
                "fast_multilora: FSDP2 shards the LoRA parameters, so their layers take the slower per-parameter path; "
                "pass ignored_params=fast_multilora.fsdp_ignored_params(model) to every fully_shard call (after "
                "fast_multilora.patch): the adapters are then replicated and the store reduces them", stacklevel=4)
        if self.layers and (self.started is None or self.started() is not fsdp.mesh):
            self.started = weakref.ref(fsdp.mesh)
            for group in fsdp.groups:
                self._broadcast(store, group)
        return fsdp

    @staticmethod
    def _sharded_adapters(store) -> bool:
        from torch.distributed.tensor import DTensor

        for layer in store.router.store_layers:
            for name in ("lora_A", "lora_B"):
                d = getattr(layer, name, None)
                if isinstance(d, torch.nn.ModuleDict) and any(isinstance(p, DTensor) for p in d.parameters()):
                    return True
        return False

    def _check(self, store, ddp) -> None:
        reduced = getattr(ddp, "_module_parameters", None)  # what DDP's reducer may hold (None: not a torch DDP)
        ids = {id(p) for p in reduced} if reduced is not None else None
        if ids is None:
            layers = frozenset()
        else:
            layers = frozenset(lid for lid, s in store.slots.items() if not any(id(p) in ids for p in s.params))
        held = {id(p) for p in store.held}
        self.orphans = tuple(p for p in store.router.root.parameters()
                             if id(p) in self.given and id(p) not in held and ids is not None and id(p) not in ids)
        self.layers = layers
        self.key = (weakref.ref(ddp), store.held, len(store.held))
        if store.slots and not layers and self.warned is not ddp.__class__:
            self.warned = ddp.__class__
            warnings.warn(
                "fast_multilora: DistributedDataParallel reduces every parameter of the adapter store itself, so every "
                "LoRA layer takes the slower per-parameter path; wrap the patched model itself (DDP(model), "
                "accelerator.prepare(model)) after fast_multilora.patch, and keep the model's "
                "_ddp_params_and_buffers_to_ignore (fast_multilora.ddp)", stacklevel=4)
        if layers and (self.started is None or self.started() is not ddp):
            self.started = weakref.ref(ddp)
            self._broadcast(store, ddp.process_group)

    @staticmethod
    def _broadcast(store, group) -> None:
        import torch.distributed as dist

        src = dist.get_global_rank(group, 0)
        with torch.no_grad():
            for arena in store.arenas.values():
                dist.broadcast(arena.data, src=src, group=group)

    def take(self, layer, slots):
        """A layer call under DDP: the layer's slots when it takes the store's leaves (else ``None``: DDP reduces its
        parameters), its leaves then expected in the backward. While ``torch.compile`` traces, the leaves are noted
        whatever the sync (reading ``sync`` would make the graph guard on it: a second graph for ``no_sync``); what
        a forward whose backward reduces nothing noted is dropped at the next forward (:meth:`follow`)."""
        if id(layer) not in self.layers:
            return None
        # (also under no_grad: reentrant checkpointing's first run of a block)
        if torch.compiler.is_compiling() or self.sync is not None:
            for leaf in (slots.a_leaf, slots.b_leaf):
                if leaf.requires_grad:
                    self.noted.add(id(leaf))
        return slots

    def _collect(self) -> None:
        if self.noted:
            self.expect |= self.noted
            self.noted.clear()

    # -- per backward ---------------------------------------------------------------------------------------------
    def leaf_hook(self, store, leaf) -> None:
        """From a leaf's gradient hook, before its gradient accumulates: queue the reduce on the running backward (the
        graph task this gradient belongs to)."""
        if self.done:
            raise RuntimeError(
                "fast_multilora: under DistributedDataParallel or FSDP2 the adapter store all-reduces its gradients "
                "when the backward ends, and this backward continued after that (a second backward through one "
                "forward, or a layer used in two reentrant checkpointed blocks); run one backward per forward, or "
                "fast_multilora.patch(model, adapter_store=False)")
        if self.sync is None:
            return
        self._collect()
        self.expect.discard(id(leaf))
        self.arrived = True
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._reduce, store))
            self.queued = True

    def _reduce(self, store) -> None:
        import torch.distributed as dist

        self.queued = False
        self._collect()
        if self.expect:  # a nested backward (reentrant checkpointing) ended: the rest come in later ones
            return
        groups = self.sync
        self.sync, self.arrived, self.done = None, False, True
        if groups is None:
            return
        with torch.no_grad():
            attach_views(store)
            grads = [a.grad for a in store.arenas.values()]
            for p in self.orphans:  # (every rank reduces the same list: a missing gradient is zeros)
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads += [p.grad for p in self.orphans if p.grad is not None]
            seen = store.seen.to(torch.int32) if store.seen is not None else None
            for group in groups:  # (several: each dimension of an FSDP2 mesh in turn, summing over all of it)
                world = dist.get_world_size(group)
                works = []
                for g in grads:
                    g.div_(world)
                    works.append(dist.all_reduce(g, group=group, async_op=True))
                if seen is not None:
                    works.append(dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=group, async_op=True))
                for w in works:
                    w.wait()
            if seen is not None:
                store.seen.copy_(seen.bool())
            store.dirty = None  # other ranks' adapters have gradients here now


def attach_views(store) -> None:
    """Every trained held parameter's ``.grad`` becomes its view of the gradient arena (a tensor put in its place is
    copied in; a ``None`` one gets its piece zeroed, in one foreach call), a frozen one's ``None``: the store's
    ``prepare_grads`` over every parameter with every adapter pending."""
    store.pending |= set(store.adapter_idx)
    store.prepare_grads(force=True)
