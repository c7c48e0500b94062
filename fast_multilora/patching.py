"""``patch`` / ``unpatch``: run a PEFT model's LoRA Linear layers through the mixed-batch layer Function.

Patching swaps each LoRA layer's class for a subclass of the same name (so ``repr``, ``isinstance`` and every PEFT
method behave as before) whose ``forward`` routes mixed batches. Parameters, buffers and module objects are not
touched, so ``state_dict``, optimizers, ``save_pretrained`` and ``PeftModel.from_pretrained`` are unaffected.

* ``peft.tuners.lora.Linear`` (vanilla LoRA adapters, incl. rsLoRA, ``lora_bias``, ``fan_in_fan_out`` Conv1D bases):
  the delta runs on our backends, one ``function.LoraLinear`` per layer call.
* ``peft.tuners.lora.bnb.Linear4bit`` / ``Linear8bitLt`` (QLoRA: bitsandbytes 4-bit nf4/fp4 and 8-bit bases) and
  ``peft.tuners.lora.torchao.TorchaoLoraLinear`` (torchao int8 weights): the base layer runs as PEFT calls it and the
  delta is added to its output (to a copy for 4-bit, as PEFT does).
* ``peft.tuners.lora.ParamWrapper`` on the fused 3-D weights of a transformers experts module (MoE LoRA through
  ``target_parameters``): the experts' forward with each routed pair's delta over virtual (expert, adapter) slots
  (``fast_multilora.moe``); a wrapper it cannot run is listed in the report's ``unsupported`` and raises a clear
  error in a mixed batch (PEFT itself refuses mixed batches there).
* Every other LoRA layer (Embedding, Conv, other quantized layers, ...) and PEFT's auxiliary wrappers
  (``modules_to_save``, trainable tokens): PEFT's own per-sample mixed-batch loop, which we call in training too.
  Listed in the report's ``fallback``.
* DoRA adapters (``use_dora=True``) on the layers we run: the same op computes their LoRA part, then
  ``fast_multilora.dora`` turns base + delta into DoRA's output per row's adapter (magnitude over the detached weight
  norm, computed once per layer call per DoRA adapter in the batch).
* Adapters with another LoRA variant (aLoRA, ...): a mixed batch that names them raises (PEFT does not mix them in a
  batch either); without ``adapter_names`` PEFT's forward runs as usual.

A routed layer call, top-down (:meth:`_FastLinearMixin.forward`): the routing (set at the model's entry), the
layer's adapter table (refreshed there too), the layout of ``x``'s tokens, the base (fused into the Function or run
by the base layer), then one ``LoraLinear`` -- on the adapter store's two leaves (``fast_multilora.store``, built at
``patch``), or on PEFT's per-adapter parameters for a layer the store does not hold.
"""

from __future__ import annotations

import bisect
import operator
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Optional

import torch
from peft.tuners.lora import Linear as LoraLinearLayer
from peft.tuners.lora import LoraLayer
from torch.nn.modules import module as _nn_module  # its global forward hooks are read per call

from . import dora as dora_mod
from . import moe
from .config import PatchConfig
from .function import LayerCall, absent_positions, every_grad, get_backend, lora_dropout_rate, run_layer
from .kernels.decode import DECODE_MAX_ROWS
from .kernels.launch import set_enabled as set_fast_launch
from .kernels.segments import AdapterTable, to_device
from .plan import ALL, BASE, CHANGES, DIRTY_ATTR, FULL, Router, mark_changed, mark_dirty
from .store import _positions, _spliced, gc_paused

_ROUTER_ATTR = "_fml_router"
_HOOKS_ATTR = "_fml_hooks"
_STATE_ATTR = "_fml_state"  # on a patched layer: its LayerState (None: no adapter of the routing's slots)
_SIG_ATTR = "_fml_sig"  # what the state was built from
_MOE_ATTR = "_fml_moe"  # on a patched ParamWrapper: {"name", "error", "state", "sig"} (fast_multilora.moe)
_LAYER_ATTRS = (_ROUTER_ATTR, _STATE_ATTR, _SIG_ATTR, _MOE_ATTR)


@dataclass
class PatchReport:
    """What :func:`patch` did: modules on our kernels, and modules left on PEFT's path and why."""

    backend: str
    patched: list = field(default_factory=list)
    fallback: dict = field(default_factory=dict)
    config: Optional[PatchConfig] = None
    unsupported: dict = field(default_factory=dict)  # name -> why a mixed batch through it raises
    experts: list = field(default_factory=list)  # the patched MoE expert-weight wrappers (among ``patched``)

    def __str__(self) -> str:
        lines = [f"fast_multilora: {len(self.patched)} LoRA Linear module(s) patched (backend={self.backend!r})"]
        if self.experts:
            lines[0] = (f"fast_multilora: {len(self.patched) - len(self.experts)} LoRA Linear module(s) and "
                        f"{len(self.experts)} MoE expert-weight wrapper(s) patched (backend={self.backend!r})")
        if self.fallback:
            lines.append(f"{len(self.fallback)} module(s) run PEFT's own mixed-batch path:")
            lines += [f"  {name}: {why}" for name, why in self.fallback.items()]
        if self.unsupported:
            lines.append(f"{len(self.unsupported)} module(s) raise in a mixed batch:")
            lines += [f"  {name}: {why}" for name, why in self.unsupported.items()]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# per-layer state, refreshed at the model's entry


@dataclass(eq=False)
class LayerState:
    """One patched layer's adapters in the routing's slot order: the kernels' table and what the call needs."""

    table: AdapterTable
    present: tuple  # names of the layer's adapters, slot order
    ranks: tuple
    rates: tuple  # dropout rate each applies in this mode
    a_dtypes: tuple
    device: torch.device
    has_bias: bool  # lora_bias
    variants: tuple  # adapters of the layer with a LoRA variant other than DoRA (not in the table)
    bias_map: Optional[torch.Tensor]  # lora_bias: int64 [n_slots + 1], slot -> row among present (n = none)
    # a bitsandbytes 4-bit base: fused into the op in training (its weight dequantized, as bitsandbytes' own autograd
    # function does); else run by itself and the delta added to a copy of its output, as PEFT's bnb layer does
    bnb4: bool = False
    plans: dict = field(default_factory=dict)  # function.LaunchPlan s of eager no-grad calls, by run_layer's key
    a_modules: tuple = ()  # the present adapters' lora_A / lora_B modules (part of the state's signature)
    b_modules: tuple = ()
    dora: Optional[dora_mod.DoraLayer] = None  # the layer's DoRA adapters (in the table too: their LoRA part)
    delta: Optional[tuple] = None  # (the state this one was made from, the adapter names whose entries changed)
    lora_dtype: Optional[torch.dtype] = field(init=False)  # the adapters' one A dtype, else None

    def __post_init__(self):
        # PEFT casts an fp32 input to the adapters' 16-bit dtype: the layer path does the same
        self.lora_dtype = self.a_dtypes[0] if self.a_dtypes.count(self.a_dtypes[0]) == len(self.a_dtypes) else None


# Changes to what the layers' states depend on. Reading every adapter's modules and weights at each forward call costs
# ~2 us per adapter and layer (cache misses over the whole model: 30 ms per call at 256 adapters x 56 layers), so a
# forward call re-reads them only after a change was seen: a write to a patched layer's per-adapter setting dicts
# (``_TrackedDict``: what ``update_layer``, ``delete_adapter``, ``set_scale``, hotswapping and loading write), a
# ``train()`` / ``eval()`` that changes a patched layer's mode, a ``.to()`` / ``.half()`` / ... (``_apply``) reaching
# one, a re-patch (``plan.CHANGES``). Not seen: assigning a parameter's ``.data`` or a new weight ``Parameter``, or a
# dropout module's ``p`` or mode, directly on an adapter's submodule -- ``mark_changed`` after such an edit.
_TRACKED_DICTS = ("r", "lora_alpha", "scaling", "lora_bias", "use_dora", "use_rslora", "lora_variant")


class _TrackedDict(dict):
    """A patched LoRA layer's per-adapter setting dict (``r``, ``scaling``, ...): every write marks the adapter it
    writes (or, for a bulk write, every adapter) of the layer as changed (``plan.mark_dirty``)."""

    __slots__ = ("layer",)

    def _mark(self, key=ALL) -> None:
        layer = getattr(self, "layer", None)  # (unset while pickle rebuilds the dict: its items come first)
        if layer is None:
            mark_changed()
        else:
            mark_dirty(layer, key)

    def __setitem__(self, key, value):
        self._mark(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key):
        self._mark(key)
        dict.__delitem__(self, key)

    def pop(self, key, *default):
        self._mark(key)
        return dict.pop(self, key, *default)

    def setdefault(self, key, default=None):
        self._mark(key)
        return dict.setdefault(self, key, default)

    def __ior__(self, other):
        self._mark()
        return dict.__ior__(self, other)

    def _wrap(name):  # noqa: N805 - a class-body helper
        def method(self, *args, **kwargs):
            self._mark()
            return getattr(dict, name)(self, *args, **kwargs)
        method.__name__ = name
        return method

    popitem, clear, update = map(_wrap, ("popitem", "clear", "update"))
    del _wrap


def _track(module) -> None:
    for attr in _TRACKED_DICTS:
        d = module.__dict__.get(attr)
        if type(d) is dict:
            module.__dict__[attr] = t = _TrackedDict(d)
            t.layer = module
    mark_dirty(module)


def _untrack(module) -> None:
    for attr in _TRACKED_DICTS:
        d = module.__dict__.get(attr)
        if type(d) is _TrackedDict:
            module.__dict__[attr] = dict(d)
    module.__dict__.pop(DIRTY_ATTR, None)


class _TrackedMixin:
    """Mode and dtype/device changes of a patched layer mark its adapters changed (``train`` only when the mode
    changes: HF's Trainer calls ``model.train()`` every step)."""

    def train(self, mode: bool = True):
        if mode != self.training:
            mark_dirty(self)
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        mark_dirty(self)
        return super()._apply(fn, *args, **kwargs)


def _state_signature(layer, slot_names) -> tuple:
    """Everything a :class:`LayerState` depends on, read through the module dicts (no ``nn.Module.__getattr__``).
    Read for every layer only after a reported change (``refresh_layers``): with 256 adapters it costs ~0.5 ms per
    layer, mostly cache misses on the adapters' modules and weights."""
    mods = layer._modules
    a_mods, b_mods, drops = mods["lora_A"]._modules, mods["lora_B"]._modules, mods["lora_dropout"]._modules
    r, scaling, lora_bias = layer.r, layer.scaling, layer.lora_bias
    items = []
    for n, a in a_mods.items():
        w, bw = a._parameters["weight"], b_mods[n]._parameters["weight"]
        items.append((n, a, b_mods[n], r[n], scaling[n], drops[n].__dict__.get("p", 0.0), drops[n].training,
                      lora_bias[n], w.dtype, w.device, bw.dtype, b_mods[n]._parameters.get("bias") is not None))
    return (slot_names, tuple(sorted(layer.lora_variant)), tuple(items), _paged_out(layer))


def _paged_out(layer) -> frozenset:
    """The adapters paging keeps on the host (``fast_multilora.paging``): absent from the layer's state."""
    router = layer.__dict__.get(_ROUTER_ATTR)
    pager = router.pager if router is not None else None
    return pager.absent if pager is not None else frozenset()


def _table_key(host: tuple, slots: tuple, device) -> tuple:
    """What makes two layers' adapter tables equal: the host copies, the slots of rank > 0, the device."""
    return (host, slots, device)


def _build_state(layer, slot_names, tables: dict) -> Optional[LayerState]:
    """The layer's :class:`LayerState`; its adapter table is taken from ``tables`` where an equal one is there (and
    entered there otherwise)."""
    variants = tuple(sorted(n for n, v in layer.lora_variant.items() if not dora_mod.is_dora(v)))
    paged = _paged_out(layer)
    ranks, scales, ps, present, slots = [], [], [], [], []
    for slot, name in enumerate(slot_names):
        if name is not None and name in layer.lora_A and name not in variants and name not in paged:
            slots.append(slot)
            present.append(name)
            ranks.append(layer.r[name])
            scales.append(float(layer.scaling[name]))
            # the kernels draw the mask at 2^-16 resolution: the table holds the rate they draw exactly
            ps.append(lora_dropout_rate(layer.lora_dropout[name]))
        else:
            ranks.append(0)
            scales.append(0.0)
            ps.append(0.0)
    if not present:
        return None
    a_weights = [layer.lora_A[n].weight for n in present]
    device = a_weights[0].device
    table = _table(ranks, scales, ps, slots, device, tables)
    has_bias = any(layer.lora_bias[n] for n in present)
    bias_map = None
    if has_bias:
        for n in present:
            if layer.lora_B[n].bias is None:
                raise ValueError(f"adapter {n!r}: mixed lora_bias settings in one layer are not supported")
        row = {n: i for i, n in enumerate(present)}
        bias_map = to_device(torch.tensor([row.get(n, len(present)) for n in slot_names] + [len(present)],
                                          dtype=torch.int64), device)
    dora_names = [n for n in present if n in layer.lora_variant]
    dora = None
    if dora_names:
        row = {n: i for i, n in enumerate(dora_names)}
        dora = dora_mod.DoraLayer(
            names=tuple(dora_names),
            rows=to_device(torch.tensor([row.get(n, len(dora_names)) for n in slot_names] + [len(dora_names)],
                                        dtype=torch.int64), device),
            scales=tuple(float(layer.scaling[n]) for n in dora_names),
            dropout=any(ps[slot_names.index(n)] > 0 for n in dora_names),
        )
    return LayerState(
        table=table, present=tuple(present), ranks=tuple(layer.r[n] for n in present),
        rates=tuple(ps[s] for s in slots), a_dtypes=tuple(w.dtype for w in a_weights), device=device,
        has_bias=has_bias, variants=variants, bias_map=bias_map,
        bnb4=type(layer.get_base_layer()).__name__ == "Linear4bit",
        a_modules=tuple(layer.lora_A[n] for n in present), b_modules=tuple(layer.lora_B[n] for n in present),
        dora=dora,
    )


def _table(ranks: list, scales: list, ps: list, slots: list, device, tables: dict) -> AdapterTable:
    """The adapter table of per-slot ``ranks``, ``scales``, dropout rates ``ps`` (slots ``slots`` present), each
    slot's rows at the running sum of the ranks before it; an equal one of ``tables`` where there is one."""
    offsets = list(accumulate(ranks, initial=0))
    total = offsets.pop()
    host = (tuple(ranks), tuple(offsets), tuple(scales), tuple(ps))
    key = _table_key(host, tuple(slots), device)
    table = tables.get(key)
    if table is None:
        ints = to_device(torch.tensor([ranks, offsets], dtype=torch.int32), device)  # (two copies, no host wait)
        fl = to_device(torch.tensor([scales, ps], dtype=torch.float32), device)
        table = tables[key] = AdapterTable(
            ranks=ints[0], offsets=ints[1], scales=fl[0], dropout=fl[1], max_rank=max(ranks), total_rank=total,
            has_dropout=max(ps, default=0.0) > 0, slots=tuple(slots), host=host,  # (rates are >= 0)
        )
    return table


def _edited_table(t: AdapterTable, touched: dict, slots: tuple, device, tables: dict) -> AdapterTable:
    """:func:`_table` of ``t``'s entries with the slots ``touched`` (slot -> ``(rank, scale, rate)``) written, slots
    ``slots`` present: the host tuples copied and edited, the device tensors ``t``'s with the touched entries written
    (the offsets their running sum, on the device) -- no host-to-device copy of every slot's entries."""
    h_r, h_s, h_p = list(t.host[0]), list(t.host[2]), list(t.host[3])
    for s, (r, c, p) in touched.items():
        h_r[s], h_s[s], h_p[s] = r, c, p
    offsets = list(accumulate(h_r, initial=0))
    total = offsets.pop()
    host = (tuple(h_r), tuple(offsets), tuple(h_s), tuple(h_p))
    key = _table_key(host, slots, device)
    table = tables.get(key)
    if table is None:
        n = len(h_r)
        idx = to_device(torch.tensor(list(touched), dtype=torch.int64), t.ranks.device)
        vals = list(touched.values())
        ints = torch.empty(2, n, dtype=torch.int32, device=t.ranks.device)
        ints[0] = t.ranks
        ints[0, idx] = to_device(torch.tensor([v[0] for v in vals], dtype=torch.int32), t.ranks.device)
        torch.cumsum(ints[0], 0, dtype=torch.int32, out=ints[1])
        ints[1] -= ints[0]
        fl = torch.empty(2, n, dtype=torch.float32, device=t.ranks.device)
        fl[0], fl[1] = t.scales, t.dropout
        fl[:, idx] = to_device(torch.tensor([[v[1] for v in vals], [v[2] for v in vals]], dtype=torch.float32),
                               t.ranks.device)
        table = tables[key] = AdapterTable(
            ranks=ints[0], offsets=ints[1], scales=fl[0], dropout=fl[1], max_rank=max(h_r), total_rank=total,
            has_dropout=max(h_p, default=0.0) > 0, slots=tuple(slots), host=host,
        )
    return table


def _share_table(tables: dict, st: Optional[LayerState]) -> None:
    """Offer the table of a layer state that stands to the layers rebuilt after it (``tables``, as ``_table``)."""
    if st is not None:
        tables.setdefault(_table_key(st.table.host, st.table.slots, st.table.ranks.device), st.table)


def _update_state(layer, st: LayerState, slot_names: tuple, slot_of: dict, names, tables: dict):
    """``st`` with the entries of adapters ``names`` read again from the layer (added, removed or changed); the
    other adapters' entries are taken as they are (C-level copies: the work is the changed adapters'). Returns
    ``None`` where only a full build (:func:`_build_state`) tells: a state with lora_bias, DoRA or variant adapters,
    a changed slot count, an adapter on another device. Layers whose states share their per-adapter tuples (and
    table) and take the same edit share the results (``tables``, by the edit): only the modules are per layer."""
    if st is None or st.has_bias or st.dora is not None or st.variants or len(st.table.host[0]) != len(slot_names):
        return None
    lv, lb = layer.lora_variant, layer.lora_bias
    if any(n in lv or lb.get(n) for n in names):
        return None
    paged = _paged_out(layer)
    present, slots = st.present, st.table.slots
    a_dict, b_dict = layer.lora_A._modules, layer.lora_B._modules
    drops, ranks, scalings = layer.lora_dropout._modules, layer.r, layer.scaling  # (looked up once, not per name)
    at_of = _positions(present)
    rm = sorted(at_of[n] for n in names if n in at_of)  # out first (a freed slot may be taken again)
    touched = dict.fromkeys(map(slots.__getitem__, rm), (0, 0.0, 0.0))  # the table's slots written: their entries
    ins = []  # (slot, name, rank, rate, A dtype, A module, B module) of the adapters that stay or came
    for name in names:
        a = a_dict.get(name)
        if a is None or name in paged or name not in slot_of:
            continue
        w = a._parameters["weight"]
        if w.device != st.device:
            return None
        s = slot_of[name]
        r, p = ranks[name], lora_dropout_rate(drops[name])
        touched[s] = (r, float(scalings[name]), p)
        ins.append((s, name, r, p, w.dtype, a, b_dict[name]))
    if len(present) - len(rm) + len(ins) == 0:
        return False  # no adapter left: the layer's state is None
    ins.sort(key=lambda e: e[0])
    gone = sorted(map(slots.__getitem__, rm))
    # each one's position among the adapters that stay (those before its slot) and the ones put in before it
    at = [bisect.bisect_left(slots, e[0]) - bisect.bisect_left(gone, e[0]) + k for k, e in enumerate(ins)]
    st.delta = None  # (the store follows one change at a time; one it missed: a full check of the layer)
    was = (present, st.ranks, st.rates, st.a_dtypes, slots)
    if not rm and not ins:  # (none of ``names`` in the layer: its tuples stand)
        tuples = was
    else:  # layers whose tuples were one and take the same edit share the edited ones, found by the edit
        key = ("state", *map(id, was), tuple(rm), tuple(at), tuple(e[:5] for e in ins))
        hit = tables.get(key)
        if hit is not None and all(map(operator.is_, hit[0], was)):
            tuples = hit[1]
        else:
            tuples = tuple(tuple(_spliced(seq, rm, at, map(operator.itemgetter(j), ins)))
                           for seq, j in zip(was, (1, 2, 3, 4, 0), strict=True))
            tuples = tables.setdefault(("tuples", tuples), tuples)  # (equal ones shared: their next edits are found)
            tables[key] = (was, tuples)
    new_present, new_ranks, new_rates, new_dtypes, new_slots = tuples
    if not touched:  # (PEFT's delete_adapter writes to every layer's dicts: most layers had no such adapter)
        table = st.table
    else:  # layers that shared the old table and take the same edit share the new one, found by the edit (the
        # first one builds it, and hashes the whole table to share it with equal ones): the others' work is the edit's
        edit = ("edit", id(st.table), tuple((s, *touched[s]) for s in sorted(touched)))
        hit = tables.get(edit)
        if hit is not None and hit[0] is st.table:
            table = hit[1]
        else:
            table = _edited_table(st.table, touched, new_slots, st.device, tables)
            tables[edit] = (st.table, table)
    return LayerState(
        table=table, present=new_present, ranks=new_ranks, rates=new_rates, a_dtypes=new_dtypes, device=st.device,
        has_bias=False, variants=(), bias_map=None, bnb4=st.bnb4,
        a_modules=tuple(_spliced(st.a_modules, rm, at, map(operator.itemgetter(5), ins))) if rm or ins
        else st.a_modules,
        b_modules=tuple(_spliced(st.b_modules, rm, at, map(operator.itemgetter(6), ins))) if rm or ins
        else st.b_modules,
        dora=None, delta=(st, frozenset(names)),
    )


def refresh_layers(router: Router, routing) -> None:
    """Bring every patched layer's :class:`LayerState` up to date with the routing's slot
    order and the layers' adapters and modes; cheap when nothing changed (no layer is read unless a change was
    marked, see ``plan.CHANGES``; then one signature per layer). Raises when the
    routing names an adapter with a LoRA variant."""
    if router.pager is not None:  # (the moves make tensor objects by the thousand: no GC pass in between)
        with gc_paused():
            _refresh_layers(router, routing)
    else:
        _refresh_layers(router, routing)


def _refresh_layers(router: Router, routing) -> None:
    if router.pager is not None:  # the call's adapters resident first, others paged out (fast_multilora.paging)
        router.pager.enter(routing.names)
    slot_names = routing.slot_names
    changed = False
    get_backend(router.config.backend, router._weights_device())  # created outside any traced graph
    if router.checked is None or router.checked[:2] != (CHANGES[0], slot_names):
        # something changed since the last check: the layers marked changed are read (every layer after
        # mark_changed, a re-patch, or a new slot count)
        full = router.checked is None or router.checked[2] != FULL[0] or len(router.checked[1]) != len(slot_names)
        tables = {}  # layers with equal adapter tables share one (under torch.compile: one graph input, not per layer)
        for layer in router.fast_layers:
            d = layer.__dict__
            dirty = d.pop(DIRTY_ATTR, None)
            st = d.get(_STATE_ATTR)
            if not full and not dirty:
                _share_table(tables, st)
                continue
            new = None
            if not full and dirty is not ALL and d.get(_SIG_ATTR) is not None:
                new = _update_state(layer, st, slot_names, router.slot_of, dirty, tables)
            if new is None:  # a full read: the state rebuilt only if its signature moved
                sig = _state_signature(layer, slot_names)
                if d.get(_SIG_ATTR) == sig:
                    _share_table(tables, st)
                    continue
                d[_STATE_ATTR] = _build_state(layer, slot_names, tables)
                d[_SIG_ATTR] = sig
            else:  # (the signature is read again at the next full read)
                d[_STATE_ATTR] = new or None
                d[_SIG_ATTR] = ()
            changed = True
        router.checked = (CHANGES[0], slot_names, FULL[0])
    if changed:
        router.variants = {}  # adapter name -> (variant kind, base layer type) of its first layer with a variant
        for layer in router.fast_layers:
            for name, variant in layer.lora_variant.items():
                if not dora_mod.is_dora(variant):  # DoRA runs (fast_multilora.dora)
                    router.variants.setdefault(name, (type(variant).__name__, type(layer.base_layer).__name__))
    if router.expert_layers:  # each wrapper's projection state (also its state for the store), then the chains'
        for wrapper in router.expert_layers:
            d = wrapper.__dict__
            d[_STATE_ATTR] = moe.refresh_proj(d[_MOE_ATTR], wrapper, slot_names, _paged_out(wrapper))
        for wrapper in router.expert_layers:
            moe.refresh(wrapper.__dict__[_MOE_ATTR], wrapper, slot_names, lambda w: w.__dict__[_MOE_ATTR])
    if router.store is None and router.config.adapter_store and routing.names:
        _build_store(router)
    if router.store is not None:
        router.store.follow(routing, torch.is_grad_enabled())
    for name in routing.names:
        if name in router.variants:
            kind, module = router.variants[name]
            raise ValueError(
                f"adapter {name!r} uses a LoRA variant ({kind}) in module {module}; mixed batches run vanilla LoRA "
                "and DoRA adapters only (PEFT does not mix such adapters in a batch either)"
            )


# ---------------------------------------------------------------------------------------------------------------------
# layer mixins


class _FastLinearMixin(_TrackedMixin):
    """Mixed-batch forward for ``peft.tuners.lora.Linear``."""

    def forward(self, x, *args, **kwargs):
        router: Optional[Router] = self.__dict__.get(_ROUTER_ATTR)
        names = kwargs.pop("adapter_names", None)  # PEFT's own hooks (or a direct call) hand names to the layer
        if router is None or (names is None and router.current is None):
            if names is not None:
                kwargs["adapter_names"] = names
            return super().forward(x, *args, **kwargs)
        routing = router.current if names is None else router.routing_for_names(names, x.device)
        if self.disable_adapters:  # PEFT: disabled adapters ignore adapter_names
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            raise ValueError(
                "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
            )
        state: Optional[LayerState] = self.__dict__.get(_STATE_ATTR)
        if state is None:  # none of the routing's adapters is in this layer
            return self.base_layer(x, *args, **kwargs)
        if x.device != state.device:
            raise ValueError(
                f"input is on {x.device} but the LoRA weights of this layer are on {state.device}; move the batch to "
                "the model's device"
            )
        config = router.config
        backend = get_backend(config.backend, x.device)
        segs = router.segments(routing, x)
        base = _fused_base(self, x, args, kwargs, state, config)
        if base is not None:  # the base GEMM runs inside the Function (function.linear_with_delta)
            (W, b, base_weight), y, x_d = base, None, x
        else:
            y, W, b, base_weight = self.base_layer(x, *args, **kwargs), None, None, None
            if state.bnb4:  # PEFT's bnb 4-bit layer adds to a copy: never write into bnb's output
                y = y.clone()
            cast = state.lora_dtype
            x_d = x.to(cast) if x.dtype == torch.float32 and cast in (torch.float16, torch.bfloat16) else x
        has_bias = state.has_bias
        # Triton calls with autograd off, no dropout, no lora_bias: eager ones replay a launch plan
        # (function.LaunchPlan); of few rows (decode steps), eager or compiled, shrink and expand in one launch
        plain = (backend.name == "triton" and not torch.is_grad_enabled() and not has_bias
                 and not state.table.has_dropout)
        plans = state.plans if plain and not torch.compiler.is_compiling() else None
        decode = plain and segs.num_tokens <= DECODE_MAX_ROWS and segs.token_slots is not None
        store = router.store
        # the adapter store's two leaves (fast_multilora.store); PEFT's parameters for a layer it does not hold, and
        # under DDP for a layer whose parameters DDP's reducer holds (its hooks sit on them; fast_multilora.ddp)
        slots = store.layer_slots(self) if store is not None else None
        if slots is not None and store.ddp.active:  # the routed call ran under DDP (so does its recomputation)
            slots = store.ddp.take(self, slots)
        if slots is not None:
            a_ws, b_ws, biases = (slots.a_leaf,), (slots.b_leaf,), ()
        else:
            a_ws = [m._parameters["weight"] for m in state.a_modules]
            b_ws = [m._parameters["weight"] for m in state.b_modules]
            biases = [m._parameters["bias"] for m in state.b_modules] if has_bias else ()

        dora = state.dora
        # DoRA in training under dropout: its base term reads the dropped input, the mask the op returns with `out`
        want_keep = dora is not None and dora.dropout and self.training and state.table.has_dropout and not decode

        def call(record):  # the LayerCall of this call (built only when no launch plan replays it)
            return LayerCall(
                backend=backend, segs=segs, table=state.table if slots is None else slots.table, ranks=state.ranks,
                fused=base is not None, base_weight=base_weight,
                in_place=config.weights_in_place and backend.name == "triton", has_bias=has_bias,
                bias_rows=state.bias_map[segs.token_slots.long()] if has_bias else None,
                seed=backend.draw_seed(x) if state.table.has_dropout and not decode else None,
                store_mask=config.store_dropout_mask and torch.is_grad_enabled(), stored=slots, record=record,
                decode=decode, want_keep=want_keep,
                absent=absent_positions(state.present, routing) if slots is None else (),
            )

        args = (plans, ("stored" if slots is not None else "params", decode), segs, slots, call,
                x_d, y, W, b, a_ws, b_ws, biases)
        if dora is None:
            out = run_layer(*args)
        else:
            out = _dora_call(self, dora, state, routing, args, want_keep, backend.name == "triton")
        if not torch.compiler.is_compiling() and slots is not None and store.calls and store.calls[-1][1] is None \
                and torch.is_grad_enabled():  # the forward call's first layer call: its graph node, for the store
            store.note_node(out)
        return out


def _dora_call(layer, dora, state: LayerState, routing, args: tuple, want_keep: bool, kernels: bool) -> torch.Tensor:
    """The layer op's ``base + delta`` (with ``want_keep``, and the dropout mask it drew), then DoRA's output per
    row's adapter (``fast_multilora.dora``; ``kernels``: the Triton backend's combine kernels)."""
    out, keep = run_layer(*args) if want_keep else (run_layer(*args), None)
    in_batch = None if torch.compiler.is_compiling() else routing.names  # traced: every DoRA adapter of the layer
    return dora_mod.apply(layer, dora, out, args[5], args[2], state.table, in_batch, keep,
                          absent_grads=(args[3] is None and every_grad()) or _in_ddp_forward(layer),
                          row_slots=routing.row_slots if routing.per_row else None, kernels=kernels)


def _in_ddp_forward(layer) -> bool:
    """The routed call ran inside ``DistributedDataParallel``'s forward (a gradient-checkpointing recomputation, run
    in the backward, counts as its forward's): DDP's gradient hooks sit on the parameters it reduces, so the adapter
    store's leaves stand in only for parameters DDP ignores (``fast_multilora.ddp``), and every parameter it reduces
    needs a gradient (DoRA's magnitudes of adapters without rows get zeros)."""
    store = layer.__dict__[_ROUTER_ATTR].store
    if store is not None:
        return store.ddp.active
    return torch.nn.parallel.DistributedDataParallel._active_ddp_module is not None


def _fused_base(layer, x, args, kwargs, state: LayerState, config: PatchConfig):
    """``(W, b, base_weight)`` when this call can run the base GEMM inside the Function, else ``None``: a plain,
    hook-free, frozen ``torch.nn.Linear`` of the input's dtype and device (``base_weight`` ``None``: ``W`` is the
    GEMM's weight), or in training a bitsandbytes ``Linear4bit`` computing in the input's dtype (``base_weight``
    dequantizes its packed ``W`` in the forward and again in the backward, as bitsandbytes' own autograd function
    does: the same GEMMs, without the copy of the base output and the separate sum of the two ``dx`` parts of the
    unfused path); without autocast, adapters without ``lora_bias`` that need no input cast. Anything else runs the
    base layer itself and adds the delta (so do 4-bit bases in eval and decode, where bitsandbytes' own 4-bit GEMM
    kernels serve few rows)."""
    if not config.fuse_base or args or kwargs or state.has_bias:
        return None
    base = layer._modules["base_layer"]
    kind = type(base)
    if kind is not torch.nn.Linear and not (state.bnb4 and torch.is_grad_enabled()):
        return None
    if "forward" in base.__dict__:  # accelerate hooks replace forward
        return None
    if base._forward_hooks or base._forward_pre_hooks or _nn_module._global_forward_hooks or \
            _nn_module._global_forward_pre_hooks:
        return None
    W, b = base._parameters["weight"], base._parameters.get("bias")
    if W.requires_grad or (b is not None and b.requires_grad) or x.device != W.device:
        return None
    if b is not None and b.dtype != x.dtype:
        return None
    if kind is torch.nn.Linear:
        if type(W) is not torch.nn.Parameter or x.dtype != W.dtype:
            return None
        base_weight = None
    else:
        base_weight = _bnb4_base(base, x)
        if base_weight is None:
            return None
    if torch._C._is_any_autocast_enabled() and torch.is_autocast_enabled(x.device.type):
        return None
    if x.dtype == torch.float32 and state.lora_dtype in (torch.float16, torch.bfloat16):
        return None  # PEFT feeds the adapters a cast input: the unfused path does the same
    return W, b, base_weight


def _bnb4_base(base, x):
    """The dequantizing weight function of a bitsandbytes ``Linear4bit`` base for input ``x``, or ``None`` where its
    forward would do other than ``linear(x, dequantize_4bit(W).to(x.dtype), b)`` (a compute dtype other than ``x``'s,
    no quantization state yet, ``torch.compile`` tracing). Settles the compute dtype on the first call as its forward
    does (``set_compute_type``: a float32 or bfloat16 input becomes the compute dtype)."""
    if torch.compiler.is_compiling() or getattr(base.weight, "quant_state", None) is None:
        return None
    if not base.compute_type_is_set:
        base.set_compute_type(x)
        base.compute_type_is_set = True
    if base.compute_dtype != x.dtype:
        return None
    return _dequantize_4bit


def _dequantize_4bit(W: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bitsandbytes 4-bit weight as the ``[N, K]`` matrix its GEMMs use, in ``dtype``."""
    import bitsandbytes.functional as bnb_functional

    return bnb_functional.dequantize_4bit(W.data, W.quant_state).to(dtype)


class _ExpertsMixin(_TrackedMixin):
    """Mixed-batch forward for ``peft.tuners.lora.ParamWrapper`` on an experts module (``fast_multilora.moe``): the
    called wrapper runs its whole chain (the nested wrappers below it and the experts module)."""

    def forward(self, x, *args, **kwargs):
        router: Optional[Router] = self.__dict__.get(_ROUTER_ATTR)
        names = kwargs.pop("adapter_names", None)
        if router is None or (names is None and router.current is None):
            if names is not None:
                kwargs["adapter_names"] = names
            return super().forward(x, *args, **kwargs)
        routing = router.current if names is None else router.routing_for_names(names, x.device)
        entry = self.__dict__[_MOE_ATTR]
        if entry["error"] is not None:
            raise ValueError(f"fast_multilora: module {entry['name']} (lora.ParamWrapper of {self.parameter_name!r}) "
                             f"cannot run a mixed batch: {entry['error']}")
        wrappers, experts = moe.chain(self)
        if self.disable_adapters:  # PEFT: disabled adapters ignore adapter_names
            for w in wrappers:
                if w.merged:
                    w.unmerge()
            return experts(x, *args, **kwargs)
        if any(w.merged for w in wrappers):
            raise ValueError(
                "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
            )
        state = entry.get("state")
        if state is None:  # none of the routing's adapters targets these experts
            return experts(x, *args, **kwargs)
        return moe.experts_forward(state, router.config, routing, x, *args, name=entry["name"], store=router.store,
                                   **kwargs)


class _FallbackMixin(_TrackedMixin):
    """PEFT's own per-sample mixed-batch loop for layers we do not run (it works in training at layer level)."""

    def forward(self, *args, **kwargs):
        router: Optional[Router] = self.__dict__.get(_ROUTER_ATTR)
        routing = router.current if router is not None else None
        if routing is not None and "adapter_names" not in kwargs:
            why = _NO_MIXED_BATCH.get(_original_class(self).__name__)
            if why is not None:
                raise ValueError(f"fast_multilora: {type(self).__name__} cannot run a mixed batch: {why}")
            x = args[0] if args else next(iter(kwargs.values()))
            kwargs["adapter_names"] = routing.row_names(x)
        return super().forward(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# class swapping

_SUBCLASSES: dict = {}


def _patched_class(cls, mixin):
    key = (cls, mixin)
    sub = _SUBCLASSES.get(key)
    if sub is None:
        attr = f"_Fast_{cls.__module__.replace('.', '_')}_{cls.__qualname__.replace('.', '_')}"
        # same __name__ as PEFT's class so repr() is unchanged; importable __qualname__ so pickling works
        sub = type(cls.__name__, (mixin, cls), {"__module__": __name__, "__qualname__": attr, "_fml_base": cls})
        setattr(sys.modules[__name__], attr, sub)
        _SUBCLASSES[key] = sub
    return sub


def _is_patched(module) -> bool:
    return "_fml_base" in type(module).__dict__


def _original_class(module):
    return type(module)._fml_base if _is_patched(module) else type(module)


def _quantized_lora_classes() -> tuple:
    """PEFT's LoRA layers over bitsandbytes 4-bit / 8-bit bases (when bitsandbytes is installed) and torchao bases:
    their base layer is opaque to the Function, so they take the added path as any unfusable base."""
    classes = []
    try:
        from peft.tuners.lora import bnb as peft_bnb
    except ImportError:  # pragma: no cover - PEFT without its bnb module
        peft_bnb = None
    classes += [getattr(peft_bnb, name) for name in ("Linear4bit", "Linear8bitLt") if hasattr(peft_bnb, name)]
    try:
        from peft.tuners.lora.torchao import TorchaoLoraLinear  # a lora.Linear: PEFT's plain forward and casts
    except ImportError:  # pragma: no cover - PEFT without its torchao module
        TorchaoLoraLinear = None
    return tuple(classes + ([TorchaoLoraLinear] if TorchaoLoraLinear is not None else []))


# PEFT's other quantized / sharded LoRA layers (PEFT 0.21): why they stay on PEFT's path. Those whose forward takes no
# ``adapter_names`` or refuses it (_NO_MIXED_BATCH) cannot run a mixed batch on stock PEFT either: ours raises then.
_NO_MIXED_BATCH = {
    name: f"PEFT's layer ({lib}) takes no adapter_names: stock PEFT cannot mix adapters in it either; route the batch "
          "to one adapter (set_adapter, no adapter_names)"
    for name, lib in (("GPTQLoraLinear", "GPTQ"), ("AwqLoraLinear", "AWQ"), ("AqlmLoraLinear", "AQLM"),
                      ("EetqLoraLinear", "EETQ"), ("TeLinear", "Transformer Engine"),
                      ("LoraParallelLinear", "Megatron tensor parallel"))
}
_PEFT_LOOP = {  # PEFT mixes adapters here, but the base library is not installed in our CI: untested on our path
    "HqqLoraLinear": "HQQ base (hqq): PEFT's per-sample loop (not run through our Function: untested here)",
    "IncLoraLinear": "Intel Neural Compressor fp8 base: PEFT's per-sample loop (not run through our Function: "
                     "untested here)",
}


def _fallback_reason(module):
    """``None`` when our Function runs this LoRA layer, else why PEFT's path does."""
    cls = _original_class(module)
    if cls.__name__ in _NO_MIXED_BATCH or cls.__name__ in _PEFT_LOOP:
        return f"{cls.__name__}: " + _NO_MIXED_BATCH.get(cls.__name__, _PEFT_LOOP.get(cls.__name__))
    if cls is not LoraLinearLayer and cls not in _quantized_lora_classes():
        return (f"{cls.__module__}.{cls.__qualname__} is not peft.tuners.lora.Linear or a quantized LoRA layer we "
                "run (peft.tuners.lora.bnb.Linear4bit / Linear8bitLt, peft.tuners.lora.torchao.TorchaoLoraLinear)")
    base = module.get_base_layer()
    if not isinstance(base, torch.nn.Linear) and type(base).__name__ != "Conv1D":
        return f"base layer {type(base).__name__} is not nn.Linear/Conv1D"
    return None


def _aux_wrapper_types():
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # pragma: no cover - older PEFT
        return ()
    return (AuxiliaryTrainingWrapper,)


def patch(model: torch.nn.Module, config: Optional[PatchConfig] = None, **settings) -> PatchReport:
    """Run ``model``'s PEFT LoRA Linear layers through fast_multilora; returns a :class:`PatchReport` (and warns
    about every module left on PEFT's path, but for custom LoRA classes registered in an adapter's config, which PEFT
    warns about itself).

    ``model``: a ``PeftModel``, a ``LoraModel`` or any module tree holding PEFT LoRA layers. After patching,
    ``model(**batch, adapter_names=[...])`` (one name per sample, ``"__base__"`` for none) works in training and
    eval; packed rows pass ``adapter_ids`` (``[batch, seq]`` indices into ``adapter_names``, -1 = base).
    ``config``: a :class:`~fast_multilora.PatchConfig` (default settings when ``None``); keyword ``settings``
    override its fields, e.g. ``patch(model, backend="torch", fuse_base=False)``. Patching twice replaces the
    settings and patches layers added since.
    """
    config = (config or PatchConfig()).with_overrides(**settings)
    router = model.__dict__.get(_ROUTER_ATTR)
    if router is None and not any(isinstance(m, LoraLayer) for m in model.modules()):
        # e.g. a PeftModel of another tuner (RoAd, IA3, ...): routing would take its adapter_names away from PEFT
        warnings.warn(
            f"fast_multilora.patch: {type(model).__name__} has no PEFT LoRA layers; the model is left unpatched",
            stacklevel=2,
        )
        return PatchReport(backend=config.backend, config=config)
    if router is None:
        router = Router(model, config)
        model.__dict__[_ROUTER_ATTR] = router
        hooks = [model.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)]
        tuner = _lora_tuner(model)
        if tuner is not None:
            # PeftModel.forward/generate hand adapter_names to the tuner's _enable_peft_forward_hooks, which raises
            # in training mode; ours routes them instead (shadowing the method on this instance only)
            tuner.__dict__["_enable_peft_forward_hooks"] = partial(_enable_routing, router)
            hooks.append(_InstanceAttr(tuner, "_enable_peft_forward_hooks"))
        model.__dict__[_HOOKS_ATTR] = hooks
    router.config = config
    set_fast_launch(config.fast_launch)
    router.current = None
    router.checked = None
    router._full_synced = None
    router._by_names.clear()
    router.tuner = _lora_tuner(model)
    router.config_key = tuple(sorted(getattr(router.tuner, "peft_config", {}).keys()))
    router.repatch = partial(_repatch, model)
    router.refresh = partial(refresh_layers, router)
    router.layers, router.fast_layers, router.expert_layers = [], [], []
    report = PatchReport(backend=config.backend, config=config)
    aux = _aux_wrapper_types()
    variant_warned = []
    for name, module in model.named_modules():
        if module is model:
            continue
        if isinstance(module, LoraLayer):
            router.layers.append(module)
            if moe.is_param_wrapper(module):  # MoE experts (target_parameters): routed per (token, expert) pair
                error = moe.unsupported_reason(module)
                _swap(module, _ExpertsMixin, router)
                module.__dict__[_MOE_ATTR] = {"name": name, "error": error}
                router.expert_layers.append(module)
                if error is None:
                    report.patched.append(name)
                    report.experts.append(name)
                else:
                    report.unsupported[name] = error
                continue
            reason = _fallback_reason(module)
            if reason is None:
                _swap(module, _FastLinearMixin, router)
                report.patched.append(name)
                router.fast_layers.append(module)
                variants = sorted(n for n, v in module.lora_variant.items() if not dora_mod.is_dora(v))
                if variants:
                    variant_warned.append(f"{name}: {variants}")
            else:
                _swap(module, _FallbackMixin, router)
                report.fallback[name] = reason
        elif aux and isinstance(module, aux):
            _swap(module, _FallbackMixin, router)
            report.fallback[name] = f"{type(module).__name__}: PEFT's per-sample loop"
    router.store_layers = router.fast_layers + [w for w in router.expert_layers
                                                if w.__dict__[_MOE_ATTR]["error"] is None]
    # custom LoRA classes registered in an adapter's config (LoraConfig._register_custom_module) are listed, not
    # warned about: PEFT warns about them itself ("Unsupported layer type ..."), and ours would bury its warning
    custom = {c for cfg in getattr(router.tuner, "peft_config", {}).values()
              for c in (getattr(cfg, "_custom_modules", None) or {}).values()}
    warned = {n: why for n, why in report.fallback.items() if _original_class(model.get_submodule(n)) not in custom}
    if warned:
        warnings.warn(
            f"fast_multilora.patch: {len(warned)} module(s) run PEFT's per-sample mixed-batch loop instead "
            f"of our kernels (see the returned report), e.g. {next(iter(warned.items()))}",
            stacklevel=2,
        )
    if report.unsupported:
        warnings.warn(
            f"fast_multilora.patch: {len(report.unsupported)} module(s) cannot run a mixed batch and raise when one is "
            f"routed through them (see the returned report), e.g. {next(iter(report.unsupported.items()))}",
            stacklevel=2,
        )
    if variant_warned:
        warnings.warn(
            "fast_multilora.patch: adapters with LoRA variants other than DoRA (e.g. aLoRA) cannot be mixed in a "
            f"batch; naming them in adapter_names raises: {variant_warned[:3]}",
            stacklevel=2,
        )
    from .paging import configure as configure_paging

    configure_paging(router, config)  # before the store is built: it holds the resident adapters only
    if config.adapter_store:
        try:
            _build_store(router)
        except ValueError:  # a layer's adapters cannot run a mixed batch: the first routed call raises why
            pass
    return report


def _build_store(router: Router) -> None:
    """The adapter store (``fast_multilora.store``) of the model, built once its layers' states can be: at ``patch``,
    or at the first routed forward call when a layer's adapters cannot run a mixed batch yet (that call raises why)."""
    from .plan import Routing
    from .store import AdapterStore

    if router.store is None:
        refresh_layers(router, Routing((), router.sync_slots()))  # the layers' tables, no call yet
        AdapterStore.attach(router)


def _swap(module, mixin, router):
    module.__class__ = _patched_class(_original_class(module), mixin)
    for attr in _LAYER_ATTRS:
        module.__dict__.pop(attr, None)
    module.__dict__[_ROUTER_ATTR] = router
    _track(module)


def unpatch(model: torch.nn.Module) -> None:
    """Restore stock PEFT behaviour: original classes, no hooks, no routing state."""
    router = model.__dict__.get(_ROUTER_ATTR)
    if router is not None and router.pager is not None:  # every adapter back on the device
        router.pager.close()
        router.pager = None
    if router is not None and router.store is not None:  # its parameters keep their memory, not the store's class
        from .store import release

        release([*router.store.held, *router.store.parked_params()], router.store.acc_hooks)
        router.store.parked = {}
        router.store.retired = True  # (an optimizer stepping it hands its states back to torch)
    for module in model.modules():
        if _is_patched(module):
            module.__class__ = type(module)._fml_base
            _untrack(module)
        for attr in _LAYER_ATTRS:
            module.__dict__.pop(attr, None)
    for h in model.__dict__.pop(_HOOKS_ATTR, []):
        h.remove()
    model.__dict__.pop(_ROUTER_ATTR, None)


class _InstanceAttr:
    """A removable instance attribute (so ``unpatch`` can treat it like a hook handle)."""

    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def remove(self):
        self.obj.__dict__.pop(self.name, None)


def _repatch(model):
    router: Router = model.__dict__[_ROUTER_ATTR]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first patch() already warned about fallbacks
        patch(model, router.config)


def adapters_added(model) -> None:
    """Adapters were added to ``model`` inside its present LoRA layers only (``fast_multilora.add_adapters``): the
    patched model takes them at its next forward call without a re-patch (their layers marked them)."""
    for obj in (model, _lora_tuner(model)):
        router = obj.__dict__.get(_ROUTER_ATTR) if obj is not None else None
        if router is not None and router.tuner is not None:
            router.config_key = tuple(sorted(router.tuner.peft_config.keys()))


def _lora_tuner(model):
    """The PEFT tuner (``LoraModel``) of a ``PeftModel`` or the model itself, else ``None``."""
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, BaseTuner):
        return model
    base = getattr(model, "base_model", None)
    return base if isinstance(base, BaseTuner) else None


def _input_info(args, kwargs) -> tuple:
    """``(device, token shape)`` of a forward call's first tensor argument: ``input_ids`` / ``attention_mask``
    ``[rows, T]`` as they are, ``inputs_embeds`` less its last dim; ``(None, None)`` without one."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            lead = tuple(v.shape[:-1]) if v.is_floating_point() else tuple(v.shape)
            return v.device, (lead if len(lead) == 2 else None)
    return None, None


def _begin(router: Router, names, ids, args, kwargs, decode: bool = False) -> None:
    """``router.begin`` for a call on ``args`` / ``kwargs``; with ``decode`` (generate) also the layout of the
    one-token decode steps."""
    device, lead = _input_info(args, kwargs)
    leads = () if lead is None else (lead, (lead[0], 1)) if decode and ids is None else (lead,)
    router.begin(names, ids, device, leads)


def _refuse_mixed_alora(kwargs, names, ids) -> None:
    if kwargs.get("alora_offsets") is not None and (names is not None or ids is not None):
        raise ValueError("fast_multilora does not route aLoRA (`alora_offsets`) in a mixed batch; call the model "
                         "without `adapter_names` for aLoRA (PEFT's own path)")


def _refuse_float64_embeds(model, kwargs) -> None:
    """float64 ``inputs_embeds`` into a model of another dtype: its base layers would fail on the dtype mix (as on a
    stock PEFT model); said here, at the model's entry, with the fix."""
    x = kwargs.get("inputs_embeds")
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float64):
        return
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    dtype = getattr(getattr(emb, "weight", None), "dtype", None)
    if dtype is not None and dtype != torch.float64:
        raise TypeError(f"inputs_embeds is float64 but the model's embeddings are {dtype}: cast it to the model's "
                        f"dtype (inputs_embeds.to({dtype})), or the model to float64 (model.double())")


@torch.compiler.disable
def _model_pre_hook(model, args, kwargs):
    """Routes the forward call: names -> slot tensor on the input's device (``Router.begin``). Outside any compiled
    graph: the one graph break of a compiled patched model is here."""
    router: Router = model.__dict__[_ROUTER_ATTR]
    names = kwargs.pop("adapter_names", None)
    ids = kwargs.pop("adapter_ids", None)
    _refuse_mixed_alora(kwargs, names, ids)
    _refuse_float64_embeds(model, kwargs)
    _begin(router, names, ids, args, kwargs)
    router.entered = True  # PeftModel.forward's _enable_peft_forward_hooks then keeps this routing
    return args, kwargs


@contextmanager
def _enable_routing(router: Router, *args, **kwargs):
    """Stands in for the tuner's ``_enable_peft_forward_hooks``: inside ``PeftModel.forward`` (the pre-hook already
    routed the call) it keeps the routing; from ``generate`` it routes the names given there."""
    names = kwargs.pop("adapter_names", None)
    ids = kwargs.pop("adapter_ids", None)
    entered, router.entered = router.entered, False
    if kwargs.get("alora_offsets") is not None:
        _refuse_mixed_alora(kwargs, names, ids)
        router.begin(None)  # no routing: PEFT's aLoRA hooks, as on a stock model
        tuner = router.tuner
        with type(tuner)._enable_peft_forward_hooks(tuner, *args, **kwargs):
            yield
        return
    if not entered or names is not None:
        if names is not None and not entered and router.root.training:
            warnings.warn(  # generate() is where names arrive here outside a forward call
                "fast_multilora: generate(..., adapter_names=...) with the model in training mode: LoRA dropout is "
                "active while generating; call model.eval() first (PEFT itself refuses adapter_names in training)",
                stacklevel=4,
            )
        _begin(router, names, ids, args, kwargs, decode=not entered)
    yield


class route:
    """Context manager routing calls that bypass the patched model's own forward (e.g. calling a submodule)::

        with fast_multilora.route(model, adapter_names):
            out = model.base_model.model(input_ids)
    """

    def __init__(self, model, adapter_names, adapter_ids=None):
        self.router: Router = model.__dict__.get(_ROUTER_ATTR)
        if self.router is None:
            raise ValueError("fast_multilora.route: the model is not patched; call fast_multilora.patch(model) first")
        self.names, self.ids = adapter_names, adapter_ids

    def __enter__(self):
        self.router.begin(self.names, self.ids)
        return self

    def __exit__(self, *exc):
        self.router.begin(None)
        return False


__all__ = ["PatchConfig", "PatchReport", "patch", "unpatch", "route", "refresh_layers", "BASE"]
