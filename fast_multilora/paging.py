"""Paging: adapters outside the batch keep their weights and optimizer states in (pinned) host memory.

With ``PatchConfig(resident_adapters=k)`` a patched model keeps on its device the adapters of the batch it runs, the
adapters a :func:`prefetch` brought in for a forward to come, adapters holding gradients, and at most ``k`` others
(the most recently used); every other adapter is *paged out*: each of its parameters' ``.data`` is a host tensor
(pinned when the model is on CUDA), and so is every optimizer state of its parameters that lives on the parameter's
device (``exp_avg``, ``exp_avg_sq``, a fused or capturable optimizer's ``step``; a state ``torch.optim`` keeps on the
CPU stays where it is). So device memory grows with the adapters a batch names, not with the registry; the host
holds one copy of every adapter. Each change of the resident set re-lays the adapter store out (one device copy of
the resident adapters' weights, gradients and store states), at the forward's entry.

Where things happen:

* **Forward entry** (``Router.begin`` / ``patching.refresh_layers``, before the layers' tables are read): the
  adapters the call names are paged in (copies host -> device), then, while more than ``k`` adapters outside the
  batch are resident, the least recently used are paged out (device -> host, on the current stream, after the work
  queued there that used them). A paged-out adapter is absent from every layer's ``LayerState`` (rank 0 in its
  table: no kernel reads it), and the adapter store (``fast_multilora.store``) re-lays its arenas out for the
  resident adapters, reading the values from the parameters. Nothing is lost: weights and optimizer states go
  through bitwise copies, and a layer's kernels compute each adapter's rows from its own weights only (the torch
  backend with contiguous per-slot operands), so a paged run computes what a fully resident run does, bit for bit
  (an adapter without rows gets no gradient on either path, resident or not, as under stock PEFT).
* **Prefetch** (:func:`prefetch`, called while the current step runs, e.g. by a data loader's hook): the next
  batch's adapters are copied in on a side CUDA stream; the compute stream waits on their events at the next
  forward's entry (or when they are touched otherwise: page-out, ``state_dict``, :func:`synchronize`). Without
  prefetch the copies happen at the forward's entry, on the compute stream's order.
* **Gradients.** An adapter is paged out only when none of its parameters holds a gradient (``.grad is None``:
  after the optimizer's ``zero_grad()``) and no gradient-recording forward named it since the last optimizer step
  (its backward may be pending). Such an adapter stays resident beyond ``k`` until then: gradient accumulation
  over micro-batches of different adapters keeps all of them resident until the step, and
  ``zero_grad(set_to_none=False)`` keeps every adapter that ever trained resident. Gradients are never paged.
  Forwards that share one backward (``(loss_1 + loss_2).backward()``): the store must not re-lay out between them,
  so a forward that would change residency while an earlier forward's backward is pending raises; prefetch all
  their adapters before the first of them.
* **Optimizers.** Any ``torch.optim.Optimizer`` holding the parameters: found by a global step pre-hook
  (``torch.optim.optimizer.register_optimizer_step_pre_hook``) at its first step, before which it has no states;
  :func:`attach` names one explicitly (e.g. one whose states were loaded before its first step). A torch optimizer
  that skips parameters without a gradient (Adam, AdamW, SGD, ...) steps and ``zero_grad``s, under paging, only the
  resident adapters' parameters with one and the parameters of no adapter: not the registry's (below).
  ``fast_multilora.AdamW`` keeps its states in the store's arenas, which paging does not move: combining the two
  raises; use ``torch.optim.AdamW(..., fused=True)``.

Copies go by the buffer, not by the tensor (:class:`_Page`): an adapter's host copy is one host buffer per kind
(weights, optimizer states), dtype and device, which its paged-out parameters and states are views of; a page-out
gathers each group on the device (one ``torch.cat``) and copies it in one call, a page-in copies each buffer into
one new device buffer whose views the parameters and states take. (One copy call per tensor took 584 ms of host time
per step on an H100 at 64 adapters in and 64 out, 448 tensors each.)

CUDA ordering, as torch documents it: a page-out gathers on the current (compute) stream into new device buffers
(a copy where the group is a single tensor), records an event the page-out stream waits on, copies into its pinned
host buffers with ``non_blocking=True`` on that stream (the gathered buffers ``record_stream``ed on it), off the compute
stream, and records an event there, which a later page-in of the adapter waits on and a host read (``state_dict``,
:func:`synchronize`) synchronises; a page-in allocates and copies on the side stream (after waiting
on that event), ``record_stream``s the new buffers on the compute stream (the caching allocator then does not reuse
them before the compute stream is done with them) and records an event the compute stream waits on before using
them.

Paged like the others: MoE expert LoRA (``target_parameters``: an expert wrapper's adapter is absent from its
projection's table while paged out). Not paged: ``modules_to_save`` copies, trainable tokens and other non-LoRA
parameters. Refused, with an error: a forward under ``DistributedDataParallel``, ``fast_multilora.AdamW``, copying
or pickling a paged model. Moving a paged model (``.to()``) moves its host copies too: they count as resident then.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections import OrderedDict
from typing import Optional

import torch
from torch.optim import optimizer as _optimizer

from .plan import BASE, CHANGES, FULL, mark_changed, mark_dirty
from .store import _DATA_PTR, _GRAD, gc_paused

# tests: after a synchronous (CPU) page-in, the host copies are filled with NaN -- they are stale from then on -- so a
# value read from a host copy of an adapter that should be resident shows in the results
_POISON = False

# The CUDA calls paging makes, in one place: tests put a recording stand-in here to run the stream logic on the CPU.
class _Cuda:
    Stream = staticmethod(torch.cuda.Stream)
    Event = staticmethod(torch.cuda.Event)
    current_stream = staticmethod(torch.cuda.current_stream)
    stream = staticmethod(torch.cuda.stream)

    @staticmethod
    def used(device: torch.device) -> bool:
        """Whether ``device``'s copies go through streams, events and pinned host memory."""
        return device.type == "cuda"

    @staticmethod
    def record_stream(t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    @staticmethod
    def host_empty(shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, pin_memory=True)


_OPTIMIZERS: "weakref.WeakSet" = weakref.WeakSet()  # optimizers seen stepping or attached
_ATTACHED = [0]  # optimizers attached so far (a pager's kept entry lists are read again after one more)
_PAGERS: "weakref.WeakSet" = weakref.WeakSet()
_STEP_HOOK: list = []  # the global optimizer step pre-hook's handle, once registered



def _refuse_fml_adamw() -> None:
    raise ValueError("fast_multilora.AdamW keeps its optimizer states in the adapter store's arenas, which paging "
                     "(PatchConfig.resident_adapters) does not move; use torch.optim.AdamW(model.parameters(), "
                     "fused=True) with paging, or patch without resident_adapters")


def _router(model):
    from .patching import _ROUTER_ATTR

    router = model.__dict__.get(_ROUTER_ATTR)
    if router is None:
        raise ValueError("fast_multilora: the model is not patched; call fast_multilora.patch(model) first")
    return router


def prefetch(model: torch.nn.Module, adapter_names) -> None:
    """Start bringing ``adapter_names``' weights and optimizer states to the device (on CUDA: on a side stream,
    overlapped with the work queued now), for a later forward that names them. Call it while the current step runs
    with the next batch's names. Does nothing when the model was patched without paging; unknown names raise.

    Prefetched adapters stay resident, beyond ``resident_adapters``, until a forward names them or the next
    ``prefetch`` call replaces them; nothing is paged out here (the running step may still need any adapter).
    Forwards that share one backward (``(loss_1 + loss_2).backward()``) need all their adapters resident before the
    first of them: prefetch their names together first."""
    pager = _router(model).pager
    if pager is not None:
        with gc_paused():  # (the moves make tensor objects by the thousand: no GC pass in between)
            pager.prefetch(adapter_names)


def synchronize(model: torch.nn.Module) -> None:
    """Wait for the model's page copies in flight: afterwards a paged-out parameter's host ``.data`` holds its values
    and a prefetched one's device ``.data`` too. ``state_dict`` (so ``save_pretrained``) and optimizer steps do this
    themselves; call it before reading an adapter's tensors some other way."""
    pager = _router(model).pager
    if pager is not None:
        pager.synchronize()


def attach(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer``'s states of paged adapters follow them. Optimizers are found at their first step without
    this; call it for one whose states exist before that (``load_state_dict`` before the first step). Once attached,
    a ``load_state_dict`` puts the loaded states of paged-out adapters in their host pages. Returns
    ``optimizer``."""
    if optimizer in _OPTIMIZERS:
        return optimizer
    store = getattr(optimizer, "store", None)
    if store is not None and getattr(store.router, "pager", None) is not None:
        _refuse_fml_adamw()
    _OPTIMIZERS.add(optimizer)
    _ATTACHED[0] += 1
    optimizer.register_state_dict_pre_hook(lambda opt: (_unfilter(opt), [p.synchronize() for p in list(_PAGERS)]))
    if _split_of(optimizer) is not None and "zero_grad" not in optimizer.__dict__:
        from .optim import ZeroGrad

        optimizer.__dict__["zero_grad"] = ZeroGrad(optimizer, _clear)
    # (a load replaces every state: those of paged-out parameters go to their host pages, as at attach)
    optimizer.register_load_state_dict_post_hook(lambda opt: [p.adopt(opt) for p in list(_PAGERS)])
    for pager in list(_PAGERS):
        pager.adopt(optimizer)
    return optimizer


# Under paging an optimizer holds every registered adapter's parameters (115k at 1024 adapters on an 8-layer model)
# while only the batch's have gradients: torch's step and zero_grad read each one's ``.grad`` in Python (~0.4 us each
# even in a C-level map: cache misses; ~110 ms of profiled host time a step on an H100). A paged-out adapter has no
# gradient (it is paged out only without one, and a forward that names it pages it in first), and the optimizers of
# these classes skip a parameter without a gradient altogether. So for their step each group holds only its
# parameters of resident adapters with a gradient and its parameters of no adapter (which torch reads as usual), and
# gets its list back after the step; their ``zero_grad(set_to_none=True)`` clears the same ones: the same step and the
# same states as torch's walk. (A ``.grad`` set by hand on a paged-out adapter's host parameter is not stepped.)
_SKIPS_NO_GRAD = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad, torch.optim.Adamax,
                  torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta)
_HIDDEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> its groups' lists while filtered
_SPLITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> _Split


class _Split:
    """One optimizer's groups split by the paged models' adapters: ``group_of`` (id of each adapter parameter -> its
    group's index) and, per group, the ``others`` in order. Made again when the groups (their lists or lengths) or a
    pager's adapters (``Pager.epoch``: a change not made by paging itself) changed."""

    __slots__ = ("key", "group_of", "others")

    def __init__(self, key: tuple, groups: list, pagers: list):
        self.key = key
        mine = {id(q) for pager in pagers for name in pager.router.known_adapters() for q in pager.params_of(name)}
        self.group_of, self.others = {}, []
        for gi, g in enumerate(groups):
            ids = list(map(id, g["params"]))
            self.group_of.update((i, gi) for i in ids if i in mine)
            self.others.append([q for q, i in zip(g["params"], ids, strict=True) if i not in mine])


def _split_of(optimizer) -> Optional[_Split]:
    """The split of an optimizer that paging filters (``_SKIPS_NO_GRAD``, holding a paged model's adapters, not
    stepped through the store), or ``None``."""
    if not isinstance(optimizer, _SKIPS_NO_GRAD) or not _PAGERS:
        return None
    groups = optimizer.param_groups
    pagers = list(_PAGERS)
    key = (tuple((id(g["params"]), len(g["params"])) for g in groups), tuple((id(p), p.epoch) for p in pagers))
    split = _SPLITS.get(optimizer)
    if split is None or split.key != key:
        split = _SPLITS[optimizer] = _Split(key, groups, pagers)
    return split if split.group_of and not _bridged(optimizer) else None


def _may_have_grads(split: _Split) -> list:
    """Per group of ``split``'s optimizer its parameters that may have a gradient (see above)."""
    out = [list(o) for o in split.others]
    group_of = split.group_of
    for pager in list(_PAGERS):
        for name in pager.recent:  # (the resident adapters)
            params = pager.params_of(name)
            for q in itertools.compress(params, map(operator.is_not, map(_GRAD, params), itertools.repeat(None))):
                gi = group_of.get(id(q))
                if gi is not None:
                    out[gi].append(q)
    return out


def _bridged(optimizer) -> bool:
    from .optim import _BRIDGE_TYPES, _BRIDGES

    return _BRIDGES is not None and type(_BRIDGES.get(optimizer)) in _BRIDGE_TYPES


def _unfilter(optimizer) -> None:
    from .optim import swap_params

    saved = _HIDDEN.pop(optimizer, None)
    if saved is not None:
        swap_params(optimizer.param_groups, saved)


def _clear(optimizer, set_to_none: bool) -> bool:
    """A paged model's optimizer's ``zero_grad`` (``optim.ZeroGrad``): with ``set_to_none`` the parameters that may
    have a gradient only (see above); False (torch's own) otherwise."""
    _unfilter(optimizer)
    split = _split_of(optimizer) if set_to_none else None
    if split is None:
        return False
    for params in _may_have_grads(split):
        for q in params:
            if q.grad is not None:
                q.grad = None
    return True


def _step_pre_hook(optimizer, args, kwargs):
    if optimizer not in _OPTIMIZERS:
        attach(optimizer)
    for pager in list(_PAGERS):  # (a prefetched adapter has no gradient: the step reads none of its tensors)
        pager.awaiting.clear()  # the backwards of the forwards so far have run
    _unfilter(optimizer)  # (a step that raised left them filtered)
    split = _split_of(optimizer)
    if split is None:
        return None
    from .optim import closure_first, swap_params

    out = closure_first(args, kwargs)  # (the gradients its backward makes count)
    _HIDDEN[optimizer] = swap_params(optimizer.param_groups, _may_have_grads(split))
    return out


def _step_post_hook(optimizer, args, kwargs) -> None:
    _unfilter(optimizer)


def configure(router, config) -> None:
    """At ``patch``: start, update or stop paging for ``router``'s model as ``config.resident_adapters`` says."""
    k = config.resident_adapters
    pager = router.pager
    if k is None:
        if pager is not None:
            pager.close()
            router.pager = None
        return
    if router.store is not None and router.store.owner is not None:
        _refuse_fml_adamw()
    if pager is None:
        pager = router.pager = Pager(router, k)
    pager.capacity = k
    pager.settle()


class _Page:
    """An adapter's host copy: one host buffer (pinned for CUDA) per group of its tensors -- weights or optimizer
    states, by dtype and device -- so a page-out or page-in is a few copies, not one per tensor. Inside a buffer the
    tensors lie in runs of one shape, so a buffer's views are one ``unbind`` per run (~0.5 us a tensor; a ``view`` of
    each ``split`` piece costs ~2 us). ``sig``: what the page was laid out for (entry key, shape, dtype, device);
    ``groups``: per buffer its ``(shape, entry indices)`` runs (a page-out stacks each run's tensors); ``views``:
    each tensor's view of its buffer, in entry order; ``keys``, ``ptrs``: their entry keys and addresses (a page-in
    checks that the adapter's tensors are still these views); ``plan``: the entry list it was last checked against;
    ``shapes``, ``dtypes``, ``devices``: the sig's, as lists (the weights' devices only), for that check."""

    __slots__ = ("sig", "groups", "flats", "views", "keys", "ptrs", "plan", "shapes", "dtypes", "devices")

    def __init__(self, sig: tuple, cuda: bool):
        self.sig, self.plan = sig, None
        self.shapes, self.dtypes = [s[1] for s in sig], [s[2] for s in sig]
        self.devices = [s[3] for s in sig if s[0][0] == "w"]
        by: dict = {}
        for i, (key, shape, dtype, device) in enumerate(sig):
            by.setdefault((key[0], dtype, device), {}).setdefault(shape, []).append(i)
        self.groups = [list(runs.items()) for runs in by.values()]
        self.flats, self.views = [], [None] * len(sig)
        for (_, dtype, _), runs in zip(by, self.groups, strict=True):
            total = sum(shape.numel() * len(idx) for shape, idx in runs)
            flat = _Cuda.host_empty((total,), dtype) if cuda else torch.empty(total, dtype=dtype)
            self.flats.append(flat)
            self.views_of(flat, runs, self.views)
        self.keys = [k[0] for k in sig]
        self.ptrs = [v.data_ptr() for v in self.views]

    @staticmethod
    def views_of(flat: torch.Tensor, runs: list, out: list) -> None:
        """``out[i]``: entry ``i``'s view of ``flat`` laid out as ``runs``."""
        at = 0
        for shape, idx in runs:
            n = shape.numel() * len(idx)
            for i, v in zip(idx, flat[at : at + n].view(len(idx), *shape).unbind(0), strict=True):
                out[i] = v
            at += n


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


class _Plan:
    """An adapter's paging entries (:meth:`Pager._entries`) as last read: valid while ``params`` is the pager's list
    of its parameters (a new list after any change but the pager's own moves) and ``token`` -- the optimizers
    attached, their ``state`` dicts and how many of the parameters have states in each -- stays (counted again only
    when an optimizer's number of parameters with states, ``sizes``, moved). (An optimizer makes a parameter's
    states together, at its first step or ``load_state_dict``, which replaces ``state``.)"""

    __slots__ = ("params", "token", "sizes", "entries", "weights")

    def __init__(self, params: list, token: tuple, sizes: tuple, entries: list):
        self.params, self.token, self.sizes, self.entries = params, token, sizes, entries
        self.weights = [i for i, e in enumerate(entries) if e[1] is None]


class Pager:
    """The residency of one patched model's adapters (see the module docstring)."""

    def __init__(self, router, capacity: int):
        self.router = router
        self.capacity = capacity
        self.device: torch.device = router._weights_device()  # where resident adapters live
        self.recent: OrderedDict = OrderedDict()  # resident adapters, least recently used first
        self.paged: dict = {}  # paged-out adapter -> {id(param): its device when resident}
        self.absent: frozenset = frozenset()  # the paged-out adapters (what the layers' states leave out)
        self.buffers: dict = {}  # adapter -> {key: host tensor}: each parameter's and state's host copy, kept
        self.pages: dict = {}  # adapter -> _Page: the host buffers those are views of
        self.plans: dict = {}  # adapter -> _Plan: its entries as last read
        self.awaiting: set = set()  # adapters named by gradient-recording forwards since the last optimizer step
        self.reserved: set = set()  # prefetched adapters no forward has named since: not paged out
        self.entered: frozenset = frozenset()  # ``absent`` when the last forward entered
        self.inflight: dict = {}  # adapter -> CUDA event: its page-in on the side stream
        self.outgoing: dict = {}  # adapter -> CUDA event: its page-out's copies into host memory
        self.side = None  # the side stream of prefetches (CUDA)
        self.out = None  # the stream of page-outs' device-to-host copies (CUDA)
        self.changes = None  # plan.CHANGES after this pager's own last change (another one: check the host copies)
        self.params: dict = {}  # adapter -> its parameters (params_of), while no other change was made
        self.full_seen = None  # plan.FULL at the last check
        self.epoch = 0  # counts the checks after changes not made here (the optimizers' _Split follows it)
        self.hook = router.root.register_state_dict_pre_hook(lambda *args: self.synchronize())
        _PAGERS.add(self)
        if not _STEP_HOOK:
            _STEP_HOOK.append(_optimizer.register_optimizer_step_pre_hook(_step_pre_hook))
            _STEP_HOOK.append(_optimizer.register_optimizer_step_post_hook(_step_post_hook))

    # -- the adapters' tensors ------------------------------------------------------------------------------------
    def params_of(self, name: str) -> list:
        """Every parameter of adapter ``name`` in the model's LoRA layers (``lora_A``, ``lora_B``, embeddings, DoRA
        magnitudes); kept per adapter while no change but this pager's own moves (which keep the parameters) has
        been made since its last check (:meth:`_check` forgets them). Not to be edited by the caller."""
        if self.changes != CHANGES[0]:
            return self._walk(name)
        out = self.params.get(name)
        if out is None:
            out = self.params[name] = self._walk(name)
        return out

    def _walk(self, name: str) -> list:
        out = []
        for layer in self.router.layers:
            for attr in layer.adapter_layer_names:
                d = layer._modules.get(attr)
                if d is None:
                    continue
                kind = type(d)
                if kind is torch.nn.ModuleDict or kind is torch.nn.ParameterDict:  # (their dicts, not __contains__)
                    obj = d._modules.get(name) if kind is torch.nn.ModuleDict else d._parameters.get(name)
                    if obj is None:
                        continue
                elif name in d:
                    obj = d[name]
                else:
                    continue
                if isinstance(obj, torch.Tensor):
                    out.append(obj)
                elif obj._modules:
                    out.extend(obj.parameters())
                else:  # (a leaf module, nn.Linear: its own parameters, without parameters()'s generators)
                    out.extend(q for q in obj._parameters.values() if q is not None)
        return out

    @staticmethod
    def _optimizers() -> list:
        """``(optimizer, moves_step)`` of every optimizer seen: whether its ``step`` states follow the parameter's
        device (``Optimizer._process_value_according_to_param_policy``: a fused or capturable optimizer's do)."""
        return [(opt, any(g.get("fused") or g.get("capturable") for g in opt.param_groups))
                for opt in list(_OPTIMIZERS)]

    @staticmethod
    def _states(param, opts=None) -> list:
        """``(state dict, key)`` of every optimizer state of ``param`` that follows the parameter's device (all but a
        non-fused, non-capturable ``step``); ``opts``: :meth:`_optimizers`, read once for many parameters."""
        out = []
        for opt, moves_step in Pager._optimizers() if opts is None else opts:
            st = opt.state.get(param)
            if not st:
                continue
            out += [(st, (id(opt), k)) for k, v in st.items()
                    if isinstance(v, torch.Tensor) and (k != "step" or moves_step)]
        return out

    def _entries(self, name: str) -> tuple:
        """``(entries, values)``: every tensor of adapter ``name`` that pages, in a fixed order -- per parameter its
        weight (``(param, None, ("w", id))``) then its device-following optimizer states (``(param, state dict,
        ("s", id, id(opt), key))``) -- and their current tensors (a weight's: the parameter; read it under
        no_grad). The entries are kept per adapter (a :class:`_Plan`) and read again only when its parameters' list,
        the optimizers or which of the parameters have states changed: walking every parameter's state dicts cost ~2
        us a tensor, three times the copies."""
        params = self.params_of(name)
        opts = self._optimizers()
        plan = self.plans.get(name)
        sizes = (_ATTACHED[0], len(opts), *[(id(opt.state), len(opt.state)) for opt, _ in opts])

        def token():  # (how many of the parameters have states in each optimizer)
            return (_ATTACHED[0], len(opts), *[(id(opt.state), sum(map(opt.state.__contains__, params)))
                                               for opt, _ in opts])

        now = None
        if plan is not None and plan.params is params and plan.sizes != sizes:
            now = token()
            if plan.token == now:
                plan.sizes = sizes  # (states made for other adapters' parameters only)
        if plan is None or plan.params is not params or plan.sizes != sizes:
            entries = []
            for p in params:
                entries.append((p, None, ("w", id(p))))
                for st, key in self._states(p, opts):
                    entries.append((p, st, ("s", id(p), *key)))
            plan = self.plans[name] = _Plan(params, now or token(), sizes, entries)
        # (a weight's value is its parameter itself: ``p.data`` would make a tensor object per weight, ~0.7 us)
        return plan.entries, [p if st is None else st[key[3]] for p, st, key in plan.entries]

    def _page(self, name: str, entries: list, values: list) -> "_Page":
        """Adapter ``name``'s host page for tensors like ``values`` (kept while their shapes and dtypes stay): one
        host buffer (pinned on CUDA) per kind (weights, states), dtype and device, its views ``self.buffers[name]``'s
        entries."""
        page = self.pages.get(name)
        plan = self.plans.get(name)
        if page is not None and plan is not None and page.plan is plan and plan.entries is entries:
            # (the entries the page was last checked against: their shapes, dtypes and the weights' devices compared)
            if list(map(_SHAPE, values)) == page.shapes and list(map(_DTYPE, values)) == page.dtypes and \
                    [values[i].device for i in plan.weights] == page.devices:
                return page
        sig = tuple((e[2], v.shape, v.dtype, v.device) for e, v in zip(entries, values, strict=True))
        if page is None or page.sig != sig:
            page = _Page(sig, _Cuda.used(self.device) or any(_Cuda.used(v.device) for v in values))
            bufs = self.buffers.setdefault(name, {})
            for e, view in zip(entries, page.views, strict=True):
                bufs[e[2]] = view
            self.pages[name] = page
        page.plan = plan if plan is not None and plan.entries is entries else None
        return page

    @staticmethod
    def _assign(entries: list, tensors) -> None:
        for (p, st, key), t in zip(entries, tensors, strict=True):
            if st is None:
                p.data = t
            else:
                st[key[3]] = t

    def _buffer(self, name: str, key, like: torch.Tensor) -> torch.Tensor:
        bufs = self.buffers.setdefault(name, {})
        b = bufs.get(key)
        if b is None or b.shape != like.shape or b.dtype != like.dtype:
            cuda = _Cuda.used(self.device)
            b = bufs[key] = _Cuda.host_empty(like.shape, like.dtype) if cuda else torch.empty_like(like, device="cpu")
        return b

    def adopt(self, optimizer) -> None:
        """A newly found optimizer's states of paged-out parameters (stepped before paging began, or loaded while
        paged out) go to their host buffers."""
        self.synchronize()
        with torch.no_grad():
            for name in self.paged:
                for p in self.params_of(name):
                    for st, key in self._states(p):
                        if key[0] == id(optimizer):
                            v = st[key[1]]
                            hb = self._buffer(name, ("s", id(p), *key), v)
                            if hb is not v:
                                st[key[1]] = hb.copy_(v)

    def _pending_grad(self, name: str) -> bool:
        return name in self.awaiting or any(p.grad is not None for p in self.params_of(name))

    # -- moves ----------------------------------------------------------------------------------------------------
    def _page_out(self, name: str) -> None:
        """Copy ``name``'s weights and device optimizer states into its host page: per kind, dtype and device one
        gather on the device (current stream) and one copy, not one per tensor; then point the parameters and states
        at the page's views. On CUDA the device-to-host copies run on the page-out stream (after the gathers), off
        the compute stream, into whose order the next adapter's writes to the freed rows go."""
        self._wait(name)
        entries, values = self._entries(name)
        homes = {id(p): p.device for p, st, _ in entries if st is None}
        page = self._page(name, entries, values)
        with torch.no_grad():
            srcs = []
            for runs, flat in zip(page.groups, page.flats, strict=True):
                # (a run's tensors stacked as the run's [n, *shape] block of the page: one call per run, not a
                # reshape per tensor, ~1.2 us each on an H100 host)
                parts = [torch.stack([values[i] for i in idx]) if len(idx) > 1 else values[idx[0]]
                         for _, idx in runs]
                src = parts[0].reshape(-1) if len(parts) == 1 else torch.cat([t.reshape(-1) for t in parts])
                if not _Cuda.used(src.device):  # (a host tensor: an adapter made on the CPU, paged out at patch)
                    flat.copy_(src)
                    continue
                if len(parts) == 1 and len(runs[0][1]) == 1:
                    src = src.clone()  # (a view of the tensor itself: its rows are rewritten before the copy is done)
                srcs.append((flat, src))
            if srcs:
                compute, out = _Cuda.current_stream(self.device), self._out()
                gathered = _Cuda.Event()
                gathered.record(compute)
                with _Cuda.stream(out):
                    out.wait_event(gathered)
                    for flat, src in srcs:
                        flat.copy_(src, non_blocking=True)
                        _Cuda.record_stream(src, out)  # (made on the compute stream, read on this one)
                    ev = _Cuda.Event()
                    ev.record(out)
                self.outgoing[name] = ev
            self._assign(entries, page.views)
        self.paged[name] = homes
        self.recent.pop(name, None)

    def _page_in(self, name: str, side: bool) -> None:
        """Copy ``name``'s weights and optimizer states back to the device: per kind, dtype and device of its host
        page one copy into one new device buffer, whose views the parameters and states take (a tensor whose host
        copy is not its page's view -- a state an optimizer gained while the adapter was out -- is copied on its
        own). On CUDA on the side stream (``side``) or the current one, the new buffers ``record_stream``ed on the
        compute stream; on the CPU the host copies are then poisoned under test."""
        homes = self.paged.pop(name)
        entries, values = self._entries(name)
        page = self.pages.get(name)
        # (the same entries, each still its page view: same address, and so shape and dtype, as the sig's keys match)
        bulk = page is not None and list(map(_DATA_PTR, values)) == page.ptrs and \
            [e[2] for e in entries] == page.keys
        cuda = _Cuda.used(self.device) or any(_Cuda.used(d) for d in homes.values())
        compute = _Cuda.current_stream(self.device) if cuda else None
        stream = (self._side() if side else compute) if cuda else None
        ev = None
        with torch.no_grad(), _Cuda.stream(stream) if cuda else contextlib.nullcontext():
            if cuda:
                out = self.outgoing.pop(name, None)
                if out is not None:
                    stream.wait_event(out)

            def to_device(src: torch.Tensor, dev) -> torch.Tensor:
                t = torch.empty_like(src, device=dev)
                t.copy_(src, non_blocking=cuda)
                if cuda and stream is not compute:
                    _Cuda.record_stream(t, compute)
                return t

            if bulk:
                moved = [None] * len(entries)
                for runs, flat in zip(page.groups, page.flats, strict=True):
                    dev = homes.get(id(entries[runs[0][1][0]][0]), self.device)
                    page.views_of(to_device(flat, dev), runs, moved)
                stale = page.flats
            else:
                moved = [to_device(v, homes.get(id(e[0]), self.device))
                         for e, v in zip(entries, values, strict=True)]
                stale = [e[0].data if e[1] is None else v for e, v in zip(entries, values, strict=True)]
            self._assign(entries, moved)
            if cuda and stream is not compute:
                ev = _Cuda.Event()
                ev.record(stream)
        if not cuda and _POISON:
            for v in stale:
                if v.is_floating_point():
                    v.fill_(float("nan"))
        if ev is not None:
            self.inflight[name] = ev
        self.recent[name] = None

    def _side(self):
        if self.side is None:
            self.side = _Cuda.Stream(device=self.device)
        return self.side

    def _out(self):
        if self.out is None:  # (its own stream: page-outs and prefetches use the two copy directions at once)
            self.out = _Cuda.Stream(device=self.device)
        return self.out

    def _wait(self, name: str) -> None:
        """The current stream waits for ``name``'s page-in, if one is in flight."""
        ev = self.inflight.pop(name, None)
        if ev is not None:
            _Cuda.current_stream(self.device).wait_event(ev)

    def wait_inflight(self) -> None:
        for name in list(self.inflight):
            self._wait(name)

    def synchronize(self) -> None:
        self.wait_inflight()
        for ev in self.outgoing.values():
            ev.synchronize()
        self.outgoing.clear()

    def _changed(self, names=None) -> None:
        """Adapters ``names`` moved in or out (``None``: any): the layers' states drop or take them."""
        self.absent = frozenset(self.paged)
        if self.changes != CHANGES[0]:  # another change came first (and no check since): its lists are not kept
            self.params = {}
        if names is None:
            mark_changed()
        else:
            for layer in self.router.fast_layers:
                for name in names:
                    mark_dirty(layer, name)
        self.changes = CHANGES[0]

    # -- entry points ---------------------------------------------------------------------------------------------
    def enter(self, names) -> None:
        """At a forward call's entry: ``names``' adapters resident (waited on), the least recently used others paged
        out beyond the capacity."""
        want = set(names)
        want.discard(BASE)
        if not want:
            return
        if torch.nn.parallel.DistributedDataParallel._active_ddp_module is not None:
            raise ValueError("fast_multilora: paging (PatchConfig.resident_adapters) does not run under "
                             "DistributedDataParallel, whose buckets hold the parameters' memory; patch without it")
        store = self.router.store
        if store is not None and store.owner is not None:
            _refuse_fml_adamw()
        if self.changes != CHANGES[0]:
            self._check()
        # an earlier forward's backward has not run: its gradients land in the store's current arenas, so the store
        # must not re-lay out (nothing is paged out now, and a page-in cannot wait)
        pending = store is not None and bool(store.pending)
        if pending and (self.absent != self.entered or any(n in self.paged for n in want)):
            late = sorted(n for n in want if n in self.paged) or sorted(self.entered - self.absent)
            raise ValueError(
                f"fast_multilora paging: this forward needs adapters {late} brought to the device, but the backward "
                f"of an earlier forward (adapters {sorted(store.pending)}) has not run yet; re-laying the adapter "
                "store out now would lose its gradients. Run that backward first, or make every adapter of the "
                "forwards that share a backward resident before the first of them: fast_multilora.prefetch(model, "
                "all their names). A forward whose output is never backpropagated: run it under torch.no_grad(), or "
                "call model.zero_grad() after it")
        self.reserved -= want
        # every prefetch in flight, not only this batch's: the store's re-layout reads every resident adapter
        self.wait_inflight()
        moved = self._bring_in(want, side=False)
        if torch.is_grad_enabled():
            self.awaiting |= want
        if not pending:
            moved |= self._evict(want)
        if moved:
            self._changed(moved)
        self.entered = self.absent

    def _bring_in(self, want, side: bool) -> bool:
        """Page in the adapters of ``want`` that are out (on the side stream for a prefetch), mark them all most
        recently used; returns those that moved."""
        moved = set()
        for name in sorted(want):
            if name in self.paged:
                self._page_in(name, side=side)
                moved.add(name)
            self.recent[name] = None
            self.recent.move_to_end(name)
        return moved

    def enter_active(self) -> None:
        """A forward without routing (stock PEFT: the active adapters) pages those in."""
        tuner, layers = self.router.tuner, self.router.layers
        names = list(getattr(tuner, "active_adapters", ()) or ()) if tuner is not None else []
        if names and layers and not layers[0].disable_adapters:  # (the tuner's attribute is the HF model's method)
            self.enter(names)

    def prefetch(self, names) -> None:
        if isinstance(names, str):
            raise TypeError("fast_multilora.prefetch takes a list of adapter names, not a single string")
        want = set(names)
        want.discard(BASE)
        known = set(self.router.known_adapters())
        unknown = sorted(want - known)
        if unknown:
            raise ValueError(f"fast_multilora.prefetch: unknown adapter name(s) {unknown}; this model has "
                             f"{len(known)} adapters")
        if self.changes != CHANGES[0]:
            self._check()
        moved = self._bring_in(want, side=True)
        self.reserved = want  # kept resident until a forward names them (or the next prefetch)
        if moved:  # nothing is paged out here: the running step may still need any resident adapter
            self._changed(moved)

    def settle(self) -> None:
        """At ``patch``: adapters the pager does not know yet count as the least recently used ones; then page out
        down to the capacity."""
        self._check()
        fresh = [n for n in self.router.known_adapters() if n not in self.recent and n not in self.paged]
        for name in reversed(fresh):
            self.recent[name] = None
            self.recent.move_to_end(name, last=False)
        out = self._evict(set())
        if out:
            self._changed(out)

    def _evict(self, keep: set) -> set:
        keep = keep | self.reserved
        over = sum(1 for n in self.recent if n not in keep) - self.capacity
        if over <= 0:
            return set()
        out = []
        for name in self.recent:
            if len(out) == over:
                break
            if name not in keep and not self._pending_grad(name):
                out.append(name)
        for name in out:
            self._page_out(name)
        return set(out)

    def _check(self) -> None:
        """After a change not made here (an adapter added or deleted, ``.to()``, a re-patch): forget deleted adapters,
        count added ones as resident (least recently used), and a paged-out adapter whose parameters no longer hold
        their host copies as resident too."""
        self.params = {}
        self.epoch += 1
        router = self.router
        router.sync_slots()
        known = router.slot_of
        # the adapters marked changed since the last check (every one after mark_changed, a mode or device change of
        # a layer, a re-patch): the others' records stand
        marked = None if router.dirty_all or self.full_seen != FULL[0] else router.dirty_seen
        router.dirty_all, router.dirty_seen, self.full_seen = False, set(), FULL[0]

        def among(records) -> list:
            return list(records) if marked is None else [n for n in marked if n in records]

        for name in among(self.recent):
            if name not in known:
                del self.recent[name]
        for name in among(self.paged):
            if name not in known:
                del self.paged[name]
                continue
            bufs = self.buffers.get(name, {})
            for p in self.params_of(name):
                b = bufs.get(("w", id(p)))
                if b is None or p.data_ptr() != b.data_ptr():  # moved (``.to()``) or replaced: it is where it is
                    self._found_moved(name, p.device)
                    self.device = p.device
                    break
        # adapters that came since (``add_adapter``, ``load_adapter``, ``add_adapters``): resident, the least recently
        # used (the next forward pages them out beyond the capacity, not when a forward first names them)
        came = [n for n in (known if marked is None else marked)
                if n in known and n not in self.recent and n not in self.paged]
        for name in reversed(came):
            self.recent[name] = None
            self.recent.move_to_end(name, last=False)
        for name in among(self.buffers):
            if name not in known:
                del self.buffers[name]
                self.pages.pop(name, None)
                self.plans.pop(name, None)
                self.outgoing.pop(name, None)
                self.inflight.pop(name, None)
        for name in self.recent:  # the resident adapters' device (the model may have moved)
            params = self.params_of(name)
            if params:
                self.device = params[0].device
                break
        if self.absent != frozenset(self.paged):
            self._changed()
        self.changes = CHANGES[0]

    def _found_moved(self, name: str, device: torch.device) -> None:
        """Paged-out adapter ``name`` has a parameter elsewhere than its host copy (``.to()`` moved the model, or a
        ``.data`` was replaced): it is resident from now on, everything of it off its host page -- parameters still
        there copied to ``device``, optimizer states there (``.to()`` moves none) to their parameter's device."""
        self.paged.pop(name)
        ev = self.outgoing.pop(name, None)
        if ev is not None:  # (its page-out's copies into the host page are done first)
            ev.synchronize()
        bufs = self.buffers.get(name, {})
        entries, values = self._entries(name)
        with torch.no_grad():
            for (p, st, key), v in zip(entries, values, strict=True):  # (a weight before its states)
                host = bufs.get(key)
                if host is None or v.data_ptr() != host.data_ptr():
                    continue
                t = torch.empty_like(host, device=device if st is None else p.device)
                t.copy_(host)
                if st is None:
                    p.data = t
                else:
                    st[key[3]] = t
        self.recent[name] = None
        self.recent.move_to_end(name, last=False)

    def __getstate__(self):
        raise TypeError("fast_multilora: a model with paging (PatchConfig.resident_adapters) cannot be copied or "
                        "pickled: its paged-out adapters' records point at this model's parameters; "
                        "fast_multilora.unpatch(model) first (every adapter back on the device), or copy before patch")

    def resident(self) -> list:
        """The resident adapters, least recently used first."""
        return list(self.recent)

    def close(self) -> None:
        """Everything back to the device (``unpatch``, or a re-patch without paging)."""
        self.synchronize()
        for name in sorted(self.paged):
            self._page_in(name, side=False)
        self.synchronize()
        self._changed()
        self.hook.remove()
        _PAGERS.discard(self)


__all__ = ["Pager", "attach", "configure", "prefetch", "synchronize"]
