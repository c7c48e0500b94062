"""Routing: which adapter each sample (or token) uses, and the segment layout every patched layer shares.

A :class:`Router` belongs to one patched model. ``begin()`` runs once per forward call, at the model's entry (its
forward pre-hook, ``generate``, or the :func:`fast_multilora.route` context), outside any compiled graph
(``torch.compiler.disable``: the one graph break of a compiled model is there). It turns the per-sample
``adapter_names`` (or, for packed rows, a name vocabulary plus per-token ``adapter_ids``) into a slot tensor on the
input's device -- ``[rows]`` for per-row names, ``[rows, T]`` for packed rows -- and refreshes every patched layer's
adapter table (``patching.refresh_layers``). Names never reach a layer: what the layers read is tensor data, so a
compiled graph or a captured CUDA graph serves every adapter mix of the same shapes.

Each layer derives its ``Segments`` from that tensor and its input's shape (:meth:`Router.segments`), with device
ops only (``kernels.segments.row_segments`` / ``grouped_segments``); eager calls cache them per shape, so the layers
and backwards of one forward call share one layout. The routing stays active after the forward returns, so that
gradient-checkpointing recomputation, which re-runs layer forwards during ``backward()``, finds the same layout;
the next forward call replaces it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .config import PatchConfig
from .function import get_backend
from .kernels.backward import with_tables
from .kernels.segments import Segments, grouped_segments, row_segments, to_device

BASE = "__base__"

# Family heuristic for per-row routing (benchmarks/ measure it): SGEMM (one segment per row, no gather) for rows of
# at least this many tokens; the chunked SGMV family (tokens grouped by adapter, fixed-size chunks) for short rows
# -- decode steps, short prompts -- where SGEMM would launch one mostly idle program column per row.
SGEMM_MIN_ROW_TOKENS = 64


@dataclass
class Routing:
    """What one forward call asked for, as slot tensors on the input's device."""

    names: tuple
    slot_names: tuple  # the model's adapters when the routing began: the slot order of the layers' tables
    row_slots: Optional[torch.Tensor] = None  # int32 [rows]: per-row names
    token_slots: Optional[torch.Tensor] = None  # int32 [rows, T]: packed rows (adapter_ids)
    layouts: dict = field(default_factory=dict)  # eager: (lead shape, device) -> Segments
    rows: int = 0  # len(names): what the layers check (reading ``names`` would make a compiled graph guard on them)
    seen_index: Optional[torch.Tensor] = None  # 1 + the slots of its tokens, int64 (``AdapterStore.seen_index``)

    def __post_init__(self):
        self.rows = len(self.names)

    @property
    def per_row(self) -> bool:
        return self.token_slots is None

    def row_names(self, x: torch.Tensor) -> list:
        """Names per row of ``x``, for layers that run PEFT's own per-adapter loop."""
        if not self.per_row:
            raise ValueError(
                "packed rows (per-token `adapter_ids`) cannot run on a layer that falls back to PEFT's per-sample "
                "mixed-batch loop; see the patch report for the modules that fall back"
            )
        _check_rows(self.rows, x.shape[0])
        return list(self.names)


def _check_rows(n_names: int, rows: int) -> None:
    if rows != n_names:
        raise ValueError(
            f"Length of `adapter_names` should be the same as the number of inputs, but got {n_names} and {rows} "
            "respectively."
        )


# Changes to what the patched layers read from PEFT's modules (``patching``: the layers' per-adapter dicts, modes,
# ``_apply``, re-patches): a forward call re-reads them only when this count moved since its last read. Which layers
# and adapters changed is marked on each layer (``mark_dirty``), so the re-read covers what changed; ``FULL`` counts
# changes whose extent is unknown (``mark_changed``), after which every layer is read.
CHANGES = [0]
FULL = [0]
DIRTY_ATTR = "_fml_dirty"  # on a patched layer: set of adapter names whose entries changed, or ALL
ALL = "*"


def mark_changed() -> None:
    """Make the next forward call of every patched model re-read its LoRA layers' adapters, settings, modes, dtypes
    and devices. Needed only after editing an adapter's submodules directly (a parameter's ``.data`` or a new weight
    ``Parameter``, one adapter's ``lora_A[name].to(...)``, a dropout module's ``p`` or mode); PEFT's methods,
    ``train()`` / ``eval()``, ``.to()`` and ``requires_grad_`` are seen without it."""
    CHANGES[0] += 1
    FULL[0] += 1


def mark_dirty(layer, name=ALL) -> None:
    """Adapter ``name`` of patched ``layer`` changed (``ALL``: every adapter of it, e.g. its mode or dtype)."""
    CHANGES[0] += 1
    d = layer.__dict__
    cur = d.get(DIRTY_ATTR)
    if name is ALL or cur is ALL:
        d[DIRTY_ATTR] = ALL
    elif cur is None:
        d[DIRTY_ATTR] = {name}
    else:
        cur.add(name)


def _names_of(layer) -> set:
    names = set(layer.lora_A.keys())
    e = layer._modules.get("lora_embedding_A")
    if e is not None:
        names.update(e.keys())
    return names


def _holds(layer, name) -> bool:
    """Whether ``layer`` holds adapter ``name`` (``name in _names_of(layer)``, without building the set)."""
    e = layer._modules.get("lora_embedding_A")
    return name in layer.lora_A._modules or (e is not None and name in e)


class Router:
    """Per-model routing state: the settings, the active :class:`Routing`, the model's LoRA layers."""

    def __init__(self, root: torch.nn.Module, config: PatchConfig):
        self.root = root
        self.config = config
        self.current: Optional[Routing] = None
        self._by_names: dict = {}  # per-row routings by (names, adapters, device), reused across forward calls
        self.entered = False  # begin() ran in the model's pre-hook for the forward call now running
        self.layers: list = []  # every LoRA layer of the model (ours and the fallback ones), set by patch()
        self.fast_layers: list = []  # the layers on our Function
        self.expert_layers: list = []  # PEFT ParamWrappers of MoE experts (fast_multilora.moe), set by patch()
        self.store_layers: list = []  # the layers the adapter store may hold: fast_layers, then the expert wrappers
        self.variants: dict = {}  # adapter name -> (LoRA variant kind, base layer type), set by refresh_layers
        self.tuner = None  # the PEFT tuner whose peft_config keys we watch
        self.config_key: tuple = ()
        self.repatch = None  # callable re-running patch() with the same settings
        self.refresh = None  # callable(routing): refresh the layers' tables (patching.refresh_layers)
        self.store = None  # fast_multilora.store.AdapterStore, once an optimizer of ours built it
        self.checked = None  # (CHANGES, slot names, FULL) at the layers' last check (patching.refresh_layers)
        # the slots: each adapter keeps its slot while it exists (a deleted adapter's slot is reused), so a change of
        # one adapter changes the layers' tables at that slot only
        self.slot_of: dict = {}  # adapter name -> slot
        self.slot_names: tuple = ()  # slot -> adapter name (None: a free slot); the routing's slot order
        self._free: list = []  # free slots (a heap: the lowest is reused first)
        self._holders: dict = {}  # adapter name -> how many of the model's LoRA layers hold it
        self._held_by: dict = {}  # id(layer) -> the adapter names it held when last read
        self._synced = None  # plan.CHANGES when the slots were last brought up to date
        self._full_synced = None  # plan.FULL when every layer was last read (None: after a (re-)patch)
        self._known: tuple = ()  # sorted adapter names
        # the adapters marked changed since paging last looked (``dirty_all``: any), kept only under paging
        self.dirty_seen: set = set()
        self.dirty_all = True
        self.pager = None  # fast_multilora.paging.Pager: PatchConfig.resident_adapters (set by patch)

    # -- adapters known to the model ------------------------------------------------------------------------------
    def known_adapters(self) -> list:
        """Sorted names of the adapters held by the model's LoRA layers."""
        self.sync_slots()
        return list(self._known)

    def sync_slots(self) -> tuple:
        """Bring the slots up to the adapters the layers hold (after a change: the changed layers' marked adapters
        only, or every layer after ``mark_changed`` or a re-patch) and return :attr:`slot_names`."""
        self._repatch_if_changed()  # every way an adapter comes or goes writes the layers' ``r`` dicts (CHANGES)
        if self._synced == CHANGES[0]:
            return self.slot_names
        holders, held_by = self._holders, self._held_by
        came, went = set(), set()
        full = self._full_synced != FULL[0]
        fast = {id(m) for m in self.fast_layers}
        if full:
            held_by.clear()
            holders.clear()
            self.dirty_all = True
        for layer in self.layers:
            d = layer.__dict__
            dirty = d.get(DIRTY_ATTR)
            if id(layer) not in fast:  # (a fast layer's marks are cleared by patching.refresh_layers)
                d.pop(DIRTY_ATTR, None)
            if not full and not dirty:
                continue
            if self.pager is not None and dirty:
                if dirty is ALL:
                    self.dirty_all = True
                else:
                    self.dirty_seen |= dirty
            before = held_by.get(id(layer), set())
            if full or dirty is ALL:
                now = _names_of(layer)
                entered = now - before
                left = before - now
                held_by[id(layer)] = now
            else:  # the layer's set edited at the marked adapters (no copy of the adapters it holds)
                now = held_by.setdefault(id(layer), before)
                entered, left = [], []
                for n in dirty:
                    has = _holds(layer, n)
                    if has and n not in now:
                        now.add(n)
                        entered.append(n)
                    elif not has and n in now:
                        now.discard(n)
                        left.append(n)
            for n in entered:
                holders[n] = holders.get(n, 0) + 1
                came.add(n)
            for n in left:
                holders[n] -= 1
                if holders[n] == 0:
                    del holders[n]
                    went.add(n)
        if full:  # the slots of adapters no layer holds now are freed, those of new ones assigned below
            went = set(self.slot_of) - set(holders)
            came = set(holders) - set(self.slot_of)
        self._assign(sorted(n for n in came if n in holders and n not in self.slot_of),
                     [n for n in went if n not in holders and n in self.slot_of])
        self._synced = CHANGES[0]
        self._full_synced = FULL[0]
        return self.slot_names

    def _assign(self, came: list, went: list) -> None:
        if not came and not went:
            return
        names = list(self.slot_names)
        for n in went:
            s = self.slot_of.pop(n)
            names[s] = None
            heapq.heappush(self._free, s)
        grow = len(came) - len(self._free)
        if grow > 0:  # room for an eighth more adapters: the next ones take a free slot (the tables keep their size)
            start = len(names)
            names += [None] * (grow + (start + grow) // 8)
            for s in range(start, len(names)):
                heapq.heappush(self._free, s)
        for n in came:
            s = heapq.heappop(self._free)
            names[s] = n
            self.slot_of[n] = s
        self.slot_names = tuple(names)
        self._known = tuple(sorted(self.slot_of))

    def _repatch_if_changed(self) -> None:
        """Re-patch when the PEFT config changed (``add_adapter`` may have created new LoRA layers)."""
        tuner = self.tuner
        if tuner is None or self.repatch is None:
            return
        key = tuple(sorted(getattr(tuner, "peft_config", {}).keys()))
        if key != self.config_key:
            if set(key) <= set(self.config_key):  # adapters deleted: no LoRA layer came, the layers marked them
                self.config_key = key
                return
            self.repatch()

    def _check_names(self, names: Sequence[str], known: list) -> None:
        unknown = sorted({n for n in names if n != BASE and n not in known})
        if unknown:
            raise ValueError(  # PEFT's own sentence first, so code matching PEFT's message still matches
                f"Trying to infer with non-existing adapter(s): {', '.join(unknown)} -- unknown adapter name(s) "
                f"{unknown} in `adapter_names`; this model has adapters {known} (use {BASE!r} for rows without an "
                "adapter)"
            )

    def _make_routing(self, adapter_names, adapter_ids, device) -> Routing:
        if isinstance(adapter_names, str):
            raise TypeError("`adapter_names` must be a list of adapter names, one per sample, not a single string")
        names = tuple(adapter_names)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"`adapter_names` must hold strings, got {type(n).__name__}: {n!r}")
        slot_names = self.sync_slots()
        index = self.slot_of
        if any(n != BASE and n not in index for n in names):
            self._check_names(names, list(self._known))
        vocab = torch.tensor([index.get(n, -1) for n in names] + [-1], dtype=torch.int32)  # [-1] for id -1
        if adapter_ids is None:
            return Routing(names, slot_names, row_slots=_to(vocab[:-1], device))
        if not torch.is_tensor(adapter_ids) or adapter_ids.dtype.is_floating_point:
            raise TypeError("`adapter_ids` must be an integer tensor [batch, seq] indexing `adapter_names`")
        if adapter_ids.numel():
            lo, hi = int(adapter_ids.min()), int(adapter_ids.max())  # one check at the entry (a host read)
            if hi >= len(names) or lo < -1:
                raise ValueError(
                    f"`adapter_ids` values must lie in [-1, {len(names) - 1}] (indices into `adapter_names`, "
                    f"-1 = base), got [{lo}, {hi}]"
                )
        ids = adapter_ids.long()
        vocab = _to(vocab, ids.device)
        return Routing(names, slot_names, token_slots=vocab[torch.where(ids < 0, len(names), ids)])

    @torch.compiler.disable
    def begin(self, adapter_names=None, adapter_ids=None, device=None, leads=()) -> None:
        """Start routing a forward call; ``adapter_names=None`` turns routing off (stock PEFT behaviour).
        ``device``: where the slot tensor goes (the input's device; default: the LoRA weights'). ``leads``: token
        shapes the layers will see (the input's ``[rows, T]``; ``[rows, 1]`` for generate's decode steps), whose
        layouts are built here, outside any compiled graph (:meth:`segments`)."""
        if adapter_names is None:
            if adapter_ids is not None:
                raise ValueError("`adapter_ids` needs `adapter_names` (the names its values index)")
            self.current = None
            if self.pager is not None:  # stock PEFT's forward reads the active adapters
                self.pager.enter_active()
            if self.store is not None and torch.is_grad_enabled():  # stock PEFT's path: its gradients may land in
                self.store.dirty = None  # any adapter's pieces (attached .grad views), which zero_grad then clears
            return
        device = torch.device(device) if device is not None else self._weights_device()
        if adapter_ids is None:  # per-row names: reuse the routing (and its layouts) of an identical earlier call
            self.current = self.routing_for_names(adapter_names, device)
        else:
            self.current = self._make_routing(adapter_names, adapter_ids, device)
            self.refresh(self.current)
        for lead in leads:
            self._prebuild(self.current, tuple(lead), device)

    def _prebuild(self, routing: Routing, lead: tuple, device) -> None:
        """Build (eagerly) and cache the layout of token shape ``lead``, when the routing fits it; a shape it does
        not fit is left to the layers, which raise the error that names the mismatch. With autograd on, the layout
        carries the backward's chunk tables (``kernels.backward.with_tables``: one launch, where each layer call's
        backward under ``torch.compile`` would build its own two); with it off, none. Whether it has them follows
        this call's grad mode only, never an earlier call's (a compiled graph guards on their presence)."""
        key = (lead, device)
        segs = routing.layouts.get(key)
        if segs is None:
            if not lead:
                return
            if routing.per_row and lead[0] != routing.rows:
                return
            if not routing.per_row and lead != tuple(routing.token_slots.shape):
                return
            segs = self._build(routing, lead, device)
        want = torch.is_grad_enabled() and self._triton(device)
        if want != (segs.chunk_tables is not None):
            segs = with_tables(segs) if want else segs._replace(chunk_tables=None)  # (the same cache)
        if routing.layouts.get(key) is not segs:
            self._store(routing, key, segs)

    def _triton(self, device) -> bool:
        """Whether the layers' backend on ``device`` is the Triton one (the chunk tables' only reader); ``False``
        where it cannot run, which the layers' first call reports."""
        try:
            return get_backend(self.config.backend, torch.device(device)).name == "triton"
        except (RuntimeError, ValueError):
            return False

    @torch.compiler.disable
    def routing_for_names(self, names, device) -> Routing:
        """Routing for per-row names, cached by (names, the model's adapters, device): a training loop whose batches
        repeat a layout builds it once. Also used for names PEFT's own hooks hand to a layer. Refreshes the layers'
        tables (cheap when nothing changed)."""
        if isinstance(names, str):
            raise TypeError("`adapter_names` must be a list of adapter names, one per sample, not a single string")
        key = (tuple(names), self.sync_slots(), torch.device(device))
        r = self._by_names.get(key)
        if r is None:
            if len(self._by_names) > 8:
                self._by_names.clear()
            r = self._by_names[key] = self._make_routing(key[0], None, key[2])
        self.refresh(r)
        return r

    def _weights_device(self) -> torch.device:
        if self.pager is not None:  # a paged-out adapter's weights are on the host
            return self.pager.device
        for layer in (*self.fast_layers, *self.expert_layers):
            for m in layer.lora_A.values():
                return m.weight.device
        return torch.device("cpu")

    # -- layouts --------------------------------------------------------------------------------------------------
    def segments(self, routing: Routing, x: torch.Tensor) -> Segments:
        """The ``Segments`` of ``x``'s rows (tokens ``x.shape[:-1]``), cached per shape in the routing. While
        ``torch.compile`` traces, a layout :meth:`begin` built for the call's token shape enters the graph as inputs
        (one layout per forward call, as in eager mode; the graph guards on the key only, so it serves every mix);
        any other shape is built by device ops inside the graph (a compiled graph holds no layout of one mix)."""
        lead = tuple(x.shape[:-1])
        key = (lead, x.device)
        if torch.compiler.is_compiling():
            segs = routing.layouts.get(key) if all(type(d) is int for d in lead) else None
            return segs if segs is not None else self._build(routing, lead, x.device)
        segs = routing.layouts.get(key)
        if segs is None:
            segs = self._store(routing, key, self._build(routing, lead, x.device))
        return segs

    @staticmethod
    def _store(routing: Routing, key, segs: Segments) -> Segments:
        if len(routing.layouts) > 16:  # e.g. a long generate(): keep the cache bounded
            routing.layouts.clear()
        routing.layouts[key] = segs
        return segs

    def _build(self, routing: Routing, lead: tuple, device) -> Segments:
        n_slots = len(routing.slot_names)
        if routing.per_row:
            rows = lead[0] if lead else 1
            _check_rows(routing.rows, rows)
            T = 1
            for d in lead[1:]:
                T *= d
            slots = _to(routing.row_slots, device)
            family = self.config.family
            if family == "auto":
                family = "sgemm" if T >= SGEMM_MIN_ROW_TOKENS else "chunked"
            if family == "sgemm":
                return row_segments(slots, T, n_slots)
            return grouped_segments(slots.repeat_interleave(T) if T != 1 else slots, n_slots)
        ids = routing.token_slots
        if tuple(ids.shape) != lead:
            raise ValueError(
                f"`adapter_ids` has shape {tuple(ids.shape)} but the layer input has leading shape {lead}; "
                "give one id per token"
            )
        return grouped_segments(_to(ids, device), n_slots)


def _to(t: torch.Tensor, device) -> torch.Tensor:
    return to_device(t, device)
