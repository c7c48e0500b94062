"""``AdamW`` over a patched model's adapters, stepping the adapter store (``fast_multilora.store``) in one launch.

``torch.optim.AdamW`` does host work per parameter tensor: 112 tensors per adapter on a Llama-shaped model of 8
layers, so its step grows with the adapter count. This optimizer keeps ``torch.optim``'s interface (one param group
per adapter with its own ``lr``, ``betas``, ``eps``, ``weight_decay``; LR schedulers, ``state_dict`` /
``load_state_dict``, ``zero_grad``) and steps each arena of the store with one kernel (``kernels.adamw``) whose
per-adapter hyperparameters and step counts are device tensors. Numerically it is ``torch.optim.AdamW`` run per
adapter: an adapter that had no token in a gradient-recording call since the last ``zero_grad`` is not stepped
(its step count stays), as ``torch.optim`` skips parameters without gradients -- also when a term of the loss on its
weights (a penalty) gave it a gradient, which ``torch.optim.AdamW`` would step; frozen parameters
(``requires_grad=False``) are not stepped. Parameters the store does not hold (fallback layers, ``lora_bias``
layers, ``modules_to_save``) are stepped by ``torch.optim``'s own AdamW with the same group settings.

Gradient clipping: :meth:`AdamW.clip_grad_norm` (global, or ``per_adapter=True``) reads the arenas directly;
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` also works (the parameters' ``.grad`` are views of the
gradient arena) but does per-tensor work.
"""

from __future__ import annotations

import itertools
import operator
import warnings
import weakref
from typing import Callable, Mapping, NamedTuple, Optional

import torch
from torch.optim.adamw import adamw as _adamw

from . import cpu_ops, optim_bnb, reference
from .kernels.segments import to_device
from .plan import BASE
from .store import AdapterStore, _grow

_STATES = ("exp_avg", "exp_avg_sq")


class _Ops(NamedTuple):
    """The arena operations of one backend (``kernels.adamw`` or its references)."""

    scalars: Callable
    step: Callable
    norms: Callable
    scale: Callable


_BLOCK_PARAM = operator.itemgetter(2)  # an arena block's (start, numel, param)
_ADAPTER = operator.itemgetter("adapter")  # a param group's adapter
_LR, _BETAS, _EPS, _WD = map(operator.itemgetter, ("lr", "betas", "eps", "weight_decay"))
_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)
_FREE = ("",)  # a free step slot's adapter (no group's: groups' adapters are names or None)
_FREE_ROW = (0.0, 0.9, 0.999, 1e-8, 0.0)  # a free slot's hyperparameters (never stepped)


def _index(seq, item) -> Optional[int]:
    """``seq.index(item)``, or ``None`` where ``item`` is not in ``seq`` (one C-level scan)."""
    try:
        return seq.index(item)
    except ValueError:
        return None


def _tally(blocks: torch.Tensor, n_slots: int, chunk: int) -> torch.Tensor:
    """int64 ``[n_slots, 2]`` (host): per slot the chunks and the elements of ``blocks`` (``[n, 3]`` rows
    ``(start, numel, slot)``), as ``kernels.adamw.chunk_table`` cuts them."""
    out = torch.zeros(n_slots, 2, dtype=torch.int64)
    size, slot = blocks[:, 1], blocks[:, 2]
    out.index_add_(0, slot, torch.stack([(size + chunk - 1) // chunk, size], 1))
    return out


class AdamW(torch.optim.Optimizer):
    """AdamW over every adapter of a patched ``model`` (see the module docstring)::

        opt = fast_multilora.AdamW(model, lr=2e-4, weight_decay=0.0, settings={"a3": {"lr": 1e-4}})

    ``settings``: per-adapter group options (``lr``, ``betas``, ``eps``, ``weight_decay``); the other adapters get
    the defaults. Adapters added to the model later (``add_adapter``, ``load_adapter``) join with the defaults at the
    next forward call; deleted ones leave (their states are freed).
    """

    def __init__(self, model: torch.nn.Module, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, settings: Optional[Mapping[str, Mapping]] = None):
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid beta parameters: {betas}")
        self.model = model
        self.store = AdapterStore.of(model)
        self.settings = {k: dict(v) for k, v in (settings or {}).items()}
        known = self.store.router.known_adapters()
        unknown = sorted(set(self.settings) - set(known))
        if unknown:
            raise ValueError(f"settings for unknown adapter(s) {unknown}; the model has {known}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(self._groups(known, defaults), defaults)
        self._tables: dict = {}  # (dtype, device) -> ChunkTable of the trained pieces, by step slot
        self._version = None  # the store's ``version`` (layouts, flag changes) when the tables were built
        # Each group has a step slot, kept while the group lives: its step count is ``_counts[slot]`` (its parameters'
        # ``state["step"]`` are 0-d views of it) and the kernels index their per-group values (hyperparameters,
        # counts, active flags, chunk owners) by slot. A group that goes frees its slot; new groups take slots at the
        # end (the slots are renumbered compactly when the free ones are most of them), so an add or delete touches
        # the slots of the groups that changed only.
        self._counts: Optional[torch.Tensor] = None  # float32 [slots + room] on the store's device
        self._slot: list = []  # param_groups[i]'s slot
        self._slot_names: list = []  # per slot its group's adapter (``_FREE`` for a free slot)
        self._dirty: set = set()  # slots whose chunks changed since the tables were built (edited at the next build)
        self._tally: dict = {}  # (dtype, device) -> host int64 [slots, 2]: per slot its chunks and elements
        self._trained = None  # bool [slots] on the device: the slot's group has trained pieces
        self._group_slots = None  # (seen_names, int64 [slots] index into store.seen, bool [slots] steppable)
        self._hyper_cache = None  # (host rows by slot, their device tensor, host tensor) of the last step
        self._others = None  # _outside()'s cache
        self._launch_chunks: dict = {}  # (arena key, stepped slots) -> the kernel's chunk list (per tables)
        # the arenas hold one optimizer's states: a new optimizer on the same model starts from zero moments and
        # takes them over (the previous one then refuses to step)
        for arena in self.store.arenas.values():
            arena.states.clear()
        self.store.owner = self
        self._follow(self.store)

    @property
    def steps(self) -> Optional[torch.Tensor]:
        """float32 ``[groups]``: each param group's step count (a copy; the counts live in per-group slots)."""
        if self._counts is None:
            return None
        return self._counts[self._slot_index()]

    def _n_slots(self) -> int:
        return len(self._slot_names)

    def _slot_index(self) -> torch.Tensor:
        """int64 ``[groups]`` on the counts' device: each param group's slot (a per-slot tensor read by group)."""
        return to_device(torch.tensor(self._slot, dtype=torch.int64), self._counts.device)

    # -- groups ---------------------------------------------------------------------------------------------------
    def _params_of(self) -> dict:
        from .data import adapter_of_parameter

        known = self.store.router.known_adapters()
        by: dict = {n: [] for n in known}
        by[None] = []
        for name, p in self.model.named_parameters():
            a = adapter_of_parameter(name, known)
            if a is not None or p.requires_grad:
                by[a].append(p)
        return by

    def _groups(self, known, defaults) -> list:
        by = self._params_of()
        groups = [{"params": by[n], "adapter": n, **defaults, **self.settings.get(n, {})} for n in known if by[n]]
        if by[None]:
            groups.append({"params": by[None], "adapter": None, **defaults})
        return groups

    def _follow(self, store: AdapterStore) -> None:
        """After a re-layout: groups for adapters that came, none for those that went, states on the new pieces."""
        if not hasattr(self, "param_groups") or store.owner is not self:
            return
        if store.delta is not None and self._follow_delta(store, *store.delta):
            return
        by = self._params_of()
        old_steps = {}
        if self._counts is not None:  # (groups appended since by add_param_group have no slot: they start at 0)
            host = self._counts.tolist()
            old_steps = {g["adapter"]: host[s] for s, g in zip(self._slot, self.param_groups, strict=False)}
        keep = []
        for g in self.param_groups:
            if g["adapter"] is None or g["adapter"] in by:
                g["params"] = by.get(g["adapter"], g["params"])
                if g["params"]:
                    keep.append(g)
        have = {g["adapter"] for g in keep}
        for n, params in by.items():
            if n is not None and n not in have and params:
                keep.append({"params": params, "adapter": n, **self.defaults, **self.settings.get(n, {})})
        self.param_groups = keep
        live = {p for g in keep for p in g["params"]}
        for p in list(self.state):
            if p not in live:
                del self.state[p]
        device = next(iter(store.arenas.values())).device if store.arenas else torch.device("cpu")
        # the slots numbered afresh: group i's is i
        self._counts = torch.tensor([float(old_steps.get(g["adapter"], 0.0)) for g in keep], dtype=torch.float32,
                                    device=device)
        self._slot, self._slot_names = list(range(len(keep))), list(map(_ADAPTER, keep))
        for arena in store.arenas.values():
            for s in _STATES:
                if s not in arena.states:
                    arena.states[s] = torch.zeros_like(arena.data)
        group_of = {p: i for i, g in enumerate(keep) for p in g["params"]}
        held = {p for arena in store.arenas.values() for _, _, p in arena.blocks.values()}
        # every adapter's parameters are held: an adapter added or deleted later changes only its own group
        self._all_held = not any(p not in held for g in keep if g["adapter"] is not None for p in g["params"])
        for p in live - held:  # a parameter that left the store keeps its states, now its own tensors (its dtype)
            st = self.state.get(p)
            if st and any(isinstance(v, torch.Tensor) and v._base is not None for v in st.values()):
                self.state[p] = {k: (v.clone() if k == "step" else v.to(p.dtype, copy=True)) for k, v in st.items()}
        for arena in store.arenas.values():
            for start, numel, p in arena.blocks.values():
                i = group_of.get(p)
                if i is None:
                    continue
                st = self.state[p]
                st["step"] = self._counts[i]  # a 0-d view: the group's count
                for s in _STATES:
                    st[s] = arena.states[s][start : start + numel].view(p.shape)
        self._tables, self._version, self._group_slots, self._others = {}, None, None, None
        self._dirty, self._tally = set(), {}

    def _follow_delta(self, store: AdapterStore, placed: list, released: list) -> bool:
        """:meth:`_follow` for a re-layout that placed and released the parameters listed (``(param, adapter, ...)``),
        touching only those adapters' groups, slots and parameters' states (C-level passes over the groups' names
        aside), when every adapter's parameters are held by the store (else ``False``: the model-wide walk of
        :meth:`_follow` finds the others)."""
        router = store.router
        if not getattr(self, "_all_held", False) or len(store.slots) != len(router.layers):
            return False
        groups, slot = self.param_groups, self._slot
        if self._counts is None or len(slot) != len(groups):
            return False
        configs = getattr(router.tuner, "peft_config", {})
        affected = {name for _, name, *_ in placed} | {name for _, name in released}
        index = {}  # the affected adapters' groups, found through their slots (no map of every group built)
        for name in affected:
            s = _index(self._slot_names, name)
            i = _index(slot, s) if s is not None else None
            if i is not None:
                if groups[i]["adapter"] != name:  # (slots out of step with the groups: the full follow)
                    return False
                index[name] = i
        for name in affected:
            cfg = configs.get(name)
            if name not in index and (cfg is None or getattr(cfg, "use_dora", False) or any(
                    getattr(cfg, a, None) is not None for a in ("modules_to_save", "trainable_token_indices"))):
                return False  # a new adapter that may have parameters outside the store
        names, dirty, gone, came = self._slot_names, self._dirty, [], []
        changed = []  # (group, its slot) of the affected groups that stay or came
        for p, _ in released:
            self.state.pop(p, None)
        for name in sorted(affected):
            i = index.get(name)
            params = list(store.adapter_params.get(name, ((),))[0])
            if i is None:
                if params:
                    came.append({"params": params, "adapter": name, **self.defaults, **self.settings.get(name, {})})
                continue
            groups[i]["params"] = params
            dirty.add(slot[i])
            if params:
                changed.append((groups[i], slot[i]))
            else:
                gone.append(i)
        for i in sorted(gone, reverse=True):  # a group that went frees its slot
            names[slot[i]] = _FREE
            del groups[i], slot[i]
        buf, n = self._counts, len(names)
        if n + len(came) > buf.numel():  # (grown in place: the parameters' 0-d views of it follow)
            _grow(buf, max(n + len(came), buf.numel() * 3 // 2))
        buf[n : n + len(came)] = 0
        for g in came:
            changed.append((g, len(names)))
            dirty.add(len(names))
            slot.append(len(names))
            names.append(g["adapter"])
            groups.append(g)
        for arena in store.arenas.values():
            for s in _STATES:
                if s not in arena.states:
                    arena.states[s] = torch.zeros_like(arena.data)
        for g, s in changed:  # each parameter's step count is a 0-d view of its group's slot
            step = buf[s]
            for p in g["params"]:
                self.state[p]["step"] = step
        for p, *_ in placed:  # their states' views on their new pieces
            st = self.state.get(p)
            if st is None:
                continue
            arena = store.arenas[(p.dtype, p.device)]
            start, numel, _ = arena.blocks[p]
            for s in _STATES:
                st[s] = arena.states[s][start : start + numel].view(p.shape)
        others = self._others
        if others is not None:  # the affected groups' parameters outside the store read again, the others' kept
            blocks = [a.blocks for a in store.arenas.values()]
            others = [o for o in others if o[1]["adapter"] not in affected]
            for g, s in changed:
                out = [p for p in g["params"] if not any(p in b for b in blocks)]
                if out:
                    others.append((s, g, out))
            others.sort(key=operator.itemgetter(0))
        self._version, self._group_slots, self._others = None, None, others
        if len(groups) * 2 < len(names) and len(names) > 16:  # most slots free: renumbered compactly
            self._compact_slots()
        return True

    def _compact_slots(self) -> None:
        """The groups' slots renumbered ``0 .. groups - 1`` (their counts moved along, their parameters' step views
        re-pointed); the tables are built afresh at the next step."""
        buf, groups = self._counts, self.param_groups
        n = len(groups)
        buf[:n] = buf[self._slot_index()]
        held = [a.blocks for a in self.store.arenas.values()]
        for i, g in enumerate(groups):
            step = buf[i]
            for p in g["params"]:
                if any(p in b for b in held):  # (a parameter outside the store has its own count)
                    self.state[p]["step"] = step
        self._slot, self._slot_names = list(range(n)), list(map(_ADAPTER, groups))
        self._tables, self._version, self._group_slots, self._others = {}, None, None, None
        self._dirty, self._tally = set(), {}

    # -- tables ---------------------------------------------------------------------------------------------------
    def _store_params(self) -> list:
        return list(itertools.chain.from_iterable(map(_BLOCK_PARAM, a.blocks.values())
                                                  for a in self.store.arenas.values()))

    def _build_tables(self) -> None:
        """Each arena's chunk table of the trained pieces (``requires_grad``) by slot, read from the layers' slots
        (no per-parameter lookups); edited at the slots that changed (:meth:`_edit_tables`) where tables stand."""
        from .kernels.adamw import chunk_table

        store = self.store
        flagged, store.flagged = store.flagged, set()
        dirty, self._dirty = self._dirty, set()
        if self._tables and set(self._tables) == set(store.arenas):
            self._edit_tables(dirty, flagged)
            return
        S = self._n_slots()
        slot_of = dict(zip(self._slot_names, range(S), strict=True))
        pattern = store.pattern
        blocks: dict = {key: [] for key in store.arenas}
        for s in store.slots.values():  # per layer a few tensor ops over its adapters (no Python step per adapter)
            n = len(s.names)
            if not n:
                continue
            gi = torch.tensor(list(map(slot_of.get, s.names, itertools.repeat(-1))), dtype=torch.int64)
            off, r = torch.tensor(s.offsets, dtype=torch.int64), torch.tensor(s.ranks, dtype=torch.int64)
            flags = torch.tensor(list(map(pattern.__getitem__, s.held_idx)), dtype=torch.bool)
            both = torch.cat([torch.stack([s.a0 + off * s.K, r * s.K, gi], 1),
                              torch.stack([s.b0 + off * s.N, r * s.N, gi], 1)])
            blocks[(s.arena.dtype, s.arena.device)].append(both[flags & (torch.cat([gi, gi]) >= 0)])
        tables, tally = {}, {}
        for key, arena in store.arenas.items():
            b = torch.cat(blocks[key]) if blocks[key] else torch.zeros(0, 3, dtype=torch.int64)
            tables[key] = chunk_table(b, S, arena.used, arena.device)
            tally[key] = _tally(b, S, tables[key].chunk)
        self._set_tables(tables, tally)

    def _set_tables(self, tables: dict, tally: dict) -> None:
        self._tables, self._tally, self._version = tables, tally, self.store.version
        self._launch_chunks = {}
        chunks = sum((t[:, 0] for t in tally.values()), torch.zeros(self._n_slots(), dtype=torch.int64))
        self._trained = to_device(chunks > 0, self._counts.device)
        self._group_slots = None  # its steppable flags follow _trained

    def _edit_tables(self, dirty: set, flagged: set) -> None:
        """:meth:`_build_tables` at the slots that changed since the tables were built (``dirty``: groups that came,
        went or whose pieces moved; the slots of the adapters ``flagged`` with a flag change): their chunks dropped
        from the old tables, their pieces (for groups that stay) cut into chunks and merged in by slot (device ops,
        no host sync: the chunk counts per slot are kept on the host) -- the work of the groups that changed, not of
        the arena."""
        from .kernels.adamw import ChunkTable, chunk_table

        store = self.store
        S, names = self._n_slots(), self._slot_names
        if flagged:  # (their slots looked up by name: no map of every slot built)
            dirty = dirty | {_index(names, n) for n in flagged} - {None}
        pattern, index_of = store.pattern, store.index_of
        blocks: dict = {key: [] for key in store.arenas}
        for s in sorted(dirty):
            entry = store.adapter_params.get(names[s]) if isinstance(names[s], str) else None
            if entry is None:
                continue
            params, where = entry
            for k, (ls, off) in enumerate(where):
                pa, pb = params[2 * k], params[2 * k + 1]
                r = pa.shape[0]
                for p, start, numel in ((pa, ls.a0 + off * ls.K, r * ls.K), (pb, ls.b0 + off * ls.N, r * ls.N)):
                    if pattern[index_of[id(p)]]:
                        blocks[(ls.arena.dtype, ls.arena.device)].append((start, numel, s))
        drop = torch.zeros(S, dtype=torch.bool)
        drop[list(dirty)] = True
        tables, tally = {}, {}
        for key, arena in store.arenas.items():
            t, old = self._tables[key], self._tally[key]
            dev = t.start.device
            if old.shape[0] < S:
                old = torch.cat([old, torch.zeros(S - old.shape[0], 2, dtype=torch.int64)])
            b = blocks[key]
            add = chunk_table(b, S, arena.used, arena.device, chunk=t.chunk)
            kept_tally = old.masked_fill(drop[:, None], 0)
            n_old, n_add = t.start.numel(), add.start.numel()
            n_keep = int(kept_tally[:, 0].sum())
            with_chunks = kept_tally[:, 0].nonzero()
            inc: dict = {}  # slot -> (chunks, elements) of its new blocks (as _tally counts them)
            for _, numel, slot in b:
                c, e = inc.get(slot, (0, 0))
                inc[slot] = (c + -(-numel // t.chunk), e + numel)
            new = kept_tally  # (the kept counts read above: added to in place)
            if inc:
                new[list(inc)] += torch.tensor(list(inc.values()), dtype=torch.int64)
            kept = (t.start, t.length, t.adapter)
            if n_keep < n_old:  # the dirty slots' chunks dropped
                at = torch.nonzero_static(to_device(drop, dev)[t.adapter.long()].logical_not(), size=n_keep).squeeze(1)
                kept = tuple(f[at] for f in kept)
            added = (add.start, add.length, add.adapter)
            if not n_add or min(x[2] for x in b) > (int(with_chunks[-1]) if with_chunks.numel() else -1):
                out = [torch.cat(f) for f in zip(kept, added, strict=True)]  # (the new slots after every kept one)
            else:  # the kept chunks and the new ones, each sorted by slot, merged (no slot has both)
                pos_k = torch.arange(n_keep, device=dev) + torch.searchsorted(add.adapter, kept[2])
                pos_a = torch.arange(n_add, device=dev) + torch.searchsorted(kept[2], add.adapter)
                out = []
                for k, a in zip(kept, added, strict=True):
                    m = torch.empty(n_keep + n_add, dtype=a.dtype, device=dev)
                    m[pos_k] = k
                    m[pos_a] = a
                    out.append(m)
            ptr = torch.zeros(S + 1, dtype=torch.int64)
            ptr[1:] = torch.cumsum(new[:, 0], 0)
            tables[key] = ChunkTable(*out, adapter_ptr=to_device(ptr.to(torch.int32), dev), n_adapters=S,
                                     numel=arena.used, chunk=t.chunk, max_chunks=int(new[:, 0].max()) if S else 0,
                                     covered=int(new[:, 1].sum()), align=min(t.align, add.align))
            tally[key] = new
        self._set_tables(tables, tally)

    def _active(self) -> Optional[torch.Tensor]:
        """bool [slots]: the slots whose group's adapter had tokens in a gradient-recording call since
        ``zero_grad``."""
        store = self.store
        if store.seen is None:
            return None
        if self._group_slots is None or self._group_slots[0] != store.seen_names:
            index = dict(zip(store.seen_names, range(1, len(store.seen_names) + 1), strict=True))
            slots = torch.tensor(list(map(index.get, self._slot_names, itertools.repeat(0))), dtype=torch.int64)
            # frozen groups, free slots and those without a slot in ``seen`` (index 0 is the base tokens' flag) keep
            # their step count
            keep = to_device(slots > 0, store.seen.device) & self._trained
            self._group_slots = (store.seen_names, to_device(slots, store.seen.device), keep)
        return store.seen[self._group_slots[1]] & self._group_slots[2]

    def _hyper(self, device) -> torch.Tensor:
        """float32 [slots, 5] on ``device``: each group's lr, betas, eps, weight decay at its slot (read every step:
        LR schedulers change them; copied only when they did). Staged through pinned memory (torch's caching host
        allocator): a copy from pageable memory would wait for the device to drain its queue, a sync per step."""
        groups = self.param_groups
        betas = list(map(_BETAS, groups))
        rows = [_FREE_ROW] * self._n_slots()
        any(map(rows.__setitem__, self._slot, zip(map(_LR, groups), map(_FIRST, betas), map(_SECOND, betas),
                                                  map(_EPS, groups), map(_WD, groups), strict=True)))  # (by slot)
        cached = self._hyper_cache
        if cached is not None and cached[0] == rows and cached[1].device == device:
            return cached[1]
        if cached is not None and cached[1].device == device:  # (after an add or delete: the rows that differ)
            old, k = cached[0], min(len(rows), len(cached[0]))
            diff = list(itertools.compress(range(k), map(operator.ne, rows[:k], old[:k]))) + list(range(k, len(rows)))
            changed = [rows[i] for i in diff]
            if len(diff) * 4 < len(rows) and all(type(x) in (float, int) for r in changed for x in r):
                host = torch.empty(len(rows), 5, dtype=torch.float32)
                host[:k] = cached[2][:k]
                if diff:
                    host[diff] = torch.tensor(changed, dtype=torch.float32)
                dev = to_device(host, device)
                self._hyper_cache = (rows, dev, host)
                return dev
        host = torch.tensor(rows, dtype=torch.float32)
        dev = to_device(host, device)
        # (a tensor-valued setting can change in place: such rows are read afresh every step)
        plain = all(type(x) in (float, int) for r in rows for x in r)
        self._hyper_cache = (rows, dev, host) if plain else None
        return dev

    def _ops(self, device):
        from .function import get_backend

        if get_backend(self.store.router.config.backend, device).name == "triton":
            from .kernels import adamw as K

            return _Ops(K.adamw_scalars_, K.adamw_step_, K.grad_sq_norms, K.scale_grads_)
        step = cpu_ops.adamw_step if device.type == "cpu" else reference.adamw_step_reference
        return _Ops(reference.adamw_scalars_reference, step, reference.grad_sq_norms_reference,
                    reference.scale_grads_reference)

    def _check_owner(self, what: str) -> None:
        if self.store.owner is not self:
            raise RuntimeError("fast_multilora.AdamW: a newer fast_multilora.AdamW was built on this model and holds "
                               f"its adapter store's optimizer states; {what} that one")

    def _prepare(self) -> None:
        store = self.store
        self._check_owner("step")
        # the adapters trained since the last step (the others are not stepped: a moved parameter of one of them is
        # read by the first forward that names it)
        if store.stale(store.trained - {BASE}):
            store.layout()
        store.trained = set()
        store.prepare_grads()  # gradients a caller or DDP put in place of the views: into the arena
        if self._version != store.version:
            self._build_tables()

    # -- torch.optim interface ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prepare()
        self.store.touched_adapters = set()  # (it steps the adapters with rows: ``seen``)
        self._step_arenas(self._active())
        self._step_others()
        return loss

    def _step_arenas(self, active: Optional[torch.Tensor], slots: Optional[tuple] = None) -> None:
        """The held parameters of the groups ``active`` (bool ``[slots]``) marks: one step of each arena. ``slots``
        (host, ascending), when known: every slot ``active`` may mark -- the kernel then runs their chunks only."""
        if active is not None and self._tables:
            # once per step for every arena: each stepped group's count goes up by one, then its scalars
            device = self._counts.device
            counts = self._counts[: self._n_slots()]
            scalars = self._ops(device).scalars(self._hyper(device), counts, active)
            for key, table in self._tables.items():
                arena = self.store.arenas[key]
                used = arena.used  # (the buffers' spare tail past it holds no piece)
                self._ops(key[1]).step(arena.data[:used], arena.grad[:used], arena.states["exp_avg"][:used],
                                       arena.states["exp_avg_sq"][:used], table, scalars, active,
                                       chunks=self._chunks_of(key, table, slots))

    def _chunks_of(self, key, table, slots: Optional[tuple]) -> Optional[torch.Tensor]:
        """The step kernel's chunk list of arena ``key`` for the groups of ``slots`` (``None``: every chunk, when
        they hold most of them): a step of a few adapters of a large registry launches for those few (cached per
        slot set until the tables change)."""
        if slots is None:
            return None
        cache = self._launch_chunks
        hit = cache.get((key, slots), False)
        if hit is not False:
            return hit
        per_slot = self._tally[key][: self._n_slots(), 0]
        if slots and slots[-1] >= per_slot.shape[0]:
            return None
        wanted = per_slot[list(slots)].sum() if slots else 0
        out = None
        if 2 * int(wanted) < table.start.shape[0]:
            from .kernels.adamw import adapter_chunks

            out = to_device(adapter_chunks(per_slot, list(slots)), table.start.device)
        if len(cache) >= 8:  # (sets of the last steps: a loop over a few recurring batches hits)
            cache.clear()
        cache[(key, slots)] = out
        return out

    def _outside(self) -> list:
        """``[(group's slot, group, its parameters outside the store)]``, for groups that have some (cached per
        layout)."""
        if self._others is None:  # (C-level filters: no Python step per held parameter)
            held = set(map(id, self._store_params()))
            others = [(i, g, list(itertools.compress(g["params"], map(operator.not_, map(held.__contains__,
                                                                                         map(id, g["params"]))))))
                      for i, g in zip(self._slot, self.param_groups, strict=True)]
            self._others = [o for o in others if o[2]]
        return self._others

    def _outside_trained(self) -> list:
        """``[(group's slot, group, its parameters outside the store that train and have a gradient)]``."""
        out = [(i, g, [p for p in ps if p.grad is not None and p.requires_grad]) for i, g, ps in self._outside()]
        return [o for o in out if o[2]]

    def _step_others(self) -> None:
        """torch's AdamW for the parameters outside the store (their own ``step`` states)."""
        for _, g, params in self._outside_trained():
            states = [self.state[p] for p in params]
            for p, st in zip(params, states, strict=True):
                if "step" not in st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            _adamw(
                params, [p.grad for p in params], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [], [s["step"] for s in states], foreach=False, amsgrad=False, beta1=g["betas"][0],
                beta2=g["betas"][1], lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the gradient arena (its views stay the parameters' ``.grad``) and the ``seen`` adapters; the
        parameters outside the store as ``torch.optim`` does."""
        self.store.zero_grad()
        for _, _, outside in self._outside():
            for p in outside:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, per_adapter: bool = False) -> torch.Tensor:
        """Scale the trained gradients so that their 2-norm is at most ``max_norm``: over everything (as
        ``clip_grad_norm_(model.parameters())``), or per adapter (each group on its own: one adapter's large
        gradient does not shrink the others' steps). Returns the pre-clip norm: a scalar, or ``[groups]``."""
        self._prepare()
        G = self._n_slots()  # (per slot; a free slot has no chunk)
        device = self._counts.device
        sq = torch.zeros(G, dtype=torch.float32, device=device)
        for (dtype, dev), table in self._tables.items():
            arena = self.store.arenas[(dtype, dev)]
            sq = sq + self._ops(dev).norms(arena.grad[: arena.used], table).to(device)
        trained_outside = self._outside_trained()
        for i, _, params in trained_outside:
            sq[i] += sum(p.grad.float().pow(2).sum().to(device) for p in params)
        norms = sq.sqrt()
        total = sq.sum().sqrt()
        if per_adapter:
            factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
        else:
            factors = (max_norm / (total + 1e-6)).clamp(max=1.0).expand(G).contiguous()
        for (dtype, dev), table in self._tables.items():
            arena = self.store.arenas[(dtype, dev)]
            self._ops(dev).scale(arena.grad[: arena.used], table, factors.to(dev))
        for i, _, params in trained_outside:
            for p in params:
                p.grad.mul_(factors[i].to(p.grad.device, p.grad.dtype))
        return norms[self._slot_index()] if per_adapter else total

    def load_state_dict(self, state_dict) -> None:
        """``torch.optim``'s, then the store's states copied into their arena pieces (the loaded tensors would
        otherwise replace them) and the groups' step counts taken from their parameters."""
        self._check_owner("load into")
        super().load_state_dict(state_dict)
        store_params = set(self._store_params())
        loaded = {p: dict(self.state[p]) for p in store_params if p in self.state}
        self._follow(self.store)
        steps = self.steps.tolist()
        with torch.no_grad():
            for i, g in enumerate(self.param_groups):
                counted = False
                for p in g["params"]:
                    src = loaded.get(p)
                    if src is None:
                        continue
                    for s in _STATES:
                        if s in src:
                            self.state[p][s].copy_(src[s])
                    if "step" in src and not counted:  # one count per group (its parameters share it)
                        steps[i], counted = float(src["step"]), True
            counts = torch.tensor(steps, dtype=self._counts.dtype)
            self._counts[self._slot_index()] = to_device(counts, self._counts.device)


# -- torch.optim.AdamW on the store ------------------------------------------------------------------------------------
# A ``torch.optim.AdamW`` holding parameters of an adapter store (``model.parameters()``, HF Trainer's groups, ...)
# steps them through the store: a global step pre-hook runs the store's step (one launch per arena, the adapter's
# group's hyperparameters read every step) for each adapter whose held parameters all sit in one of its param groups,
# then hides those parameters from torch's own step, which steps the rest; a post-hook puts them back. Their states
# are torch's as usual -- ``optimizer.state[p]`` is ``{"step", "exp_avg", "exp_avg_sq"}`` (views of the store's
# arenas), ``state_dict`` / ``load_state_dict`` as ever (loaded states are copied into the arenas) -- and a parameter
# is stepped when it has a gradient, as torch steps it. Not taken over (torch steps them): other optimizer classes,
# ``amsgrad``, ``maximize``, ``differentiable``, ``capturable``, tensor hyperparameters, an adapter split over groups
# or only partly in the optimizer, paging, ``PatchConfig(store_optimizer=False)``; a second optimizer on the same
# store, or a ``fast_multilora.AdamW`` built later, takes the arenas' states over (the first then steps as torch).
# bitsandbytes' blockwise 8-bit Adam family is stepped the same way by ``optim_bnb.BnbBridge`` (its own buffers).

_BRIDGES = None  # weakref.WeakKeyDictionary: torch optimizer -> _Bridge, the store count when found unheld, or False
_BRIDGE_HOOKS: list = []
_GROUP_FLAGS = ("amsgrad", "maximize", "differentiable", "capturable")


def install_step_hooks() -> None:
    """Register the global optimizer step hooks (once per process; at the first store built)."""
    global _BRIDGES
    if _BRIDGE_HOOKS:
        return
    import weakref

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    _BRIDGES = weakref.WeakKeyDictionary()
    _BRIDGE_HOOKS.extend([register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step)])


def _bridgeable(opt) -> bool:
    if type(opt) is not torch.optim.AdamW:
        return False
    for g in opt.param_groups:
        if any(g.get(f) for f in _GROUP_FLAGS) or not all(type(g[k]) in (float, int) for k in ("lr", "eps",
                                                                                               "weight_decay")):
            return False
        if not all(type(b) in (float, int) for b in g["betas"]):
            return False
    return True


def _store_of(opt) -> Optional[AdapterStore]:
    from .store import stores

    for store in stores():
        index_of, held = store.index_of, store._held
        for g in opt.param_groups:
            for p in g["params"]:
                i = index_of.get(id(p))
                if i is not None and held[i] is p:
                    return store
    return None


def _steps_optimizers(store: AdapterStore) -> bool:
    """Whether ``store`` takes the steps of a ``torch.optim.AdamW`` now: its model patched (not unpatched), without
    paging, ``PatchConfig.store_optimizer`` on."""
    router = store.router
    return not getattr(store, "retired", False) and router.pager is None and router.config.store_optimizer


def _pre_step(opt, args, kwargs):
    bridge = _BRIDGES.get(opt)
    if type(bridge) not in _BRIDGE_TYPES:
        from .store import stores

        # (False: its states were handed to another optimizer for good; an int: the stores when none held it)
        if bridge is False or bridge == len(stores()):
            return
        kind = _Bridge if _bridgeable(opt) else optim_bnb.BnbBridge if optim_bnb.bridgeable(opt) else None
        if kind is None:
            return
        store = _store_of(opt)
        # (a torch.optim.AdamW not over a user's fast_multilora.AdamW: it owns the arenas' states)
        if store is None or not _steps_optimizers(store) or \
                (kind is _Bridge and store.owner is not None and not isinstance(store.owner, _Engine)):
            _BRIDGES[opt] = len(stores())
            return
        bridge = _BRIDGES[opt] = kind(opt, store)
    out = closure_first(args, kwargs)
    bridge.before(opt)
    return out


def closure_first(args: tuple, kwargs: dict) -> Optional[tuple]:
    """For a step pre-hook that changes what the step sees from the gradients: the step's closure (torch calls it
    inside its step) run now, and the ``(args, kwargs)`` with which the step then takes its loss; ``None`` without a
    closure. (``args``: the optimizer, then step's.)"""
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        return None
    with torch.enable_grad():
        loss = closure()
    return args[:1], {"closure": lambda: loss}


def _post_step(opt, args, kwargs) -> None:
    bridge = _BRIDGES.get(opt)
    if type(bridge) in _BRIDGE_TYPES:
        bridge.after(opt)


class _Engine(AdamW):
    """The store's step for one ``torch.optim.AdamW`` (:class:`_Bridge`): its groups take that optimizer's
    hyperparameters; it steps the adapters the bridge marks."""


class _Bridge:
    """One ``torch.optim.AdamW`` stepping store-held parameters through the store (see above)."""

    def __init__(self, opt, store: AdapterStore):
        self.store = store
        self.engine = _Engine(store.router.root)
        self.key = None  # (store version, the optimizer's parameters) when mapped
        self.owned: dict = {}  # adapter -> index of the optimizer's group holding its held parameters
        self.pairs: list = []  # (engine group, optimizer group) per owned adapter: the hyperparameters copied
        self.hyper = None  # the optimizer's groups' hyperparameters when last copied
        self.others: list = []  # per optimizer group, its parameters torch steps
        self.saved = None  # the groups' parameter lists while hidden
        self.aliased: set = set()  # adapters whose parameters' optimizer states are the arena's
        self.mask = None  # (active adapters, slot names, bool [slots] on the device)
        opt.register_load_state_dict_post_hook(self._loaded)
        opt.__dict__["zero_grad"] = ZeroGrad(opt, self._zero_grad)

    def _zero_grad(self, opt, set_to_none: bool) -> bool:  # (the optimizer's while this bridge is its own)
        return _BRIDGES.get(opt) is self and self.zero_grad(opt, set_to_none)

    def zero_grad(self, opt, set_to_none: bool) -> bool:
        """``opt.zero_grad()`` without a look at every parameter: of the adapters this optimizer steps through the
        store, the held parameters with a gradient are those whose view the store attached and those a gradient
        reached through autograd since (their hooks, ``store._TOUCHED``); the store leaves every other ``None``. The
        groups' other parameters as torch does. False (nothing done) when the groups or the layout changed since the
        last step mapped them: torch's own ``zero_grad`` then."""
        store = self.store
        groups = opt.param_groups
        if self.saved is not None or self.key != (store.version, tuple((id(g["params"]), len(g["params"]))
                                                                       for g in groups)):
            return False
        store.clear_held_grads(itertools.chain.from_iterable(self.others), set_to_none, owned=self.owned)
        return True

    def _loaded(self, opt) -> None:
        self.key, self.aliased = None, set()  # the loaded states are read into the arenas at the next step

    def _map(self, opt) -> None:
        """Which adapters this optimizer's groups hold whole; their hyperparameter sources; the rest per group;
        the states of the aliased adapters (and any torch made or loaded) read into the arenas."""
        store, eng = self.store, self.engine
        index_of, held, adapter_of = store.index_of, store._held, store.adapter_of
        groups_of: dict = {}
        count: dict = {}
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                i = index_of.get(id(p))
                if i is not None and held[i] is p:
                    a = adapter_of[i]
                    groups_of.setdefault(a, set()).add(gi)
                    count[a] = count.get(a, 0) + 1
        self.owned = {a: next(iter(gs)) for a, gs in groups_of.items()
                      if len(gs) == 1 and count[a] == len(store.adapter_idx.get(a, ()))}
        owned_ids = {id(p) for a in self.owned for p in store.adapter_params.get(a, ((),))[0]}
        self.others = [[p for p in g["params"] if id(p) not in owned_ids] for g in opt.param_groups]
        by_adapter = {g["adapter"]: (i, g) for i, g in enumerate(eng.param_groups)}
        self.pairs = [(by_adapter[a][1], opt.param_groups[gi]) for a, gi in self.owned.items() if a in by_adapter]
        self.aliased = set()  # (the owned adapters with states -- aliased before, or torch's made or loaded -- again)
        self._alias(opt, {a for a in self.owned if any(map(opt.state.get, store.adapter_params.get(a, ((),))[0]))},
                    adopt=True)

    def _alias(self, opt, names, adopt: bool = False) -> None:
        """The optimizer's states of adapters ``names``' trained parameters: the engine's (arena views); with
        ``adopt`` a state torch made or loaded is copied in first (moments, and the adapter's step count)."""
        eng, store = self.engine, self.store
        slot_of = {g["adapter"]: s for s, g in zip(eng._slot, eng.param_groups, strict=True)}
        steps = {}
        with torch.no_grad():
            for a in names:
                for p in store.adapter_params.get(a, ((),))[0]:
                    mine = eng.state[p]
                    cur = opt.state.get(p)
                    if cur is mine or not p.requires_grad and not cur:
                        continue
                    if adopt and cur:
                        for s in _STATES:
                            if s in cur and s in mine:
                                mine[s].copy_(cur[s])
                        if "step" in cur:
                            steps[a] = float(cur["step"])
                    opt.state[p] = mine
            for a, k in steps.items():
                if a in slot_of:
                    eng._counts[slot_of[a]] = k
        self.aliased.update(names)

    def before(self, opt) -> None:
        if self.saved is not None:  # (a step that raised left the parameters hidden)
            self.after(opt)
        store, eng = self.store, self.engine
        if store.owner is not eng or not _steps_optimizers(store):
            # (another optimizer took the states; the model was unpatched; paging or the setting came with a re-patch)
            self.detach(opt)
            return
        eng._prepare()  # the layout, the gradients into the arena, the chunk tables
        if store.touched_adapters:
            split = sorted(a for a in store.touched_adapters if store.whole(a) is None)
            store.touched_adapters = set()
            if split:  # the store steps an adapter whole; torch steps each parameter with a gradient
                warnings.warn(
                    f"fast_multilora: gradients reached some but not all trained parameters of adapter(s) {split} "
                    "outside the layer calls (a term of the loss on their weights); torch.optim.AdamW steps every "
                    "parameter itself from now on (exact, slower): put such a term on all of an adapter's LoRA "
                    "parameters to keep the fast step", stacklevel=4)
                self.detach(opt)
                return
        groups = opt.param_groups
        # (per group its parameter list and length: add_param_group makes a list, an append changes the length)
        key = (store.version, tuple((id(g["params"]), len(g["params"])) for g in groups))
        if key != self.key:
            self._map(opt)
            self.key, self.hyper = key, None
        if not self.owned:
            return
        hyper = [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in groups]  # (LR schedulers write them)
        if hyper != self.hyper:
            for dst, src in self.pairs:
                dst["lr"], dst["betas"], dst["eps"], dst["weight_decay"] = src["lr"], src["betas"], src["eps"], \
                    src["weight_decay"]
            self.hyper = hyper
        adapter_of = store.adapter_of
        active = frozenset(self.owned).intersection(map(adapter_of.__getitem__, store.attached))
        if active - self.aliased:
            self._alias(opt, active - self.aliased)
        mask = self.mask
        if mask is None or mask[0] != active or mask[1] != eng._slot_names or mask[2] is not eng._trained:
            host = torch.tensor(list(map(active.__contains__, eng._slot_names)), dtype=torch.bool)
            self.mask = mask = (active, list(eng._slot_names), eng._trained, to_device(host, eng._counts.device) &
                                eng._trained, tuple(host.nonzero().reshape(-1).tolist()))
        eng._step_arenas(mask[3], slots=mask[4])
        hide(self, groups)

    def after(self, opt) -> None:
        give_back(self, opt)

    def detach(self, opt) -> None:
        """Another optimizer owns the arenas' states now: this one's states become its own copies (torch steps)."""
        for a in self.aliased:
            for p in self.store.adapter_params.get(a, ((),))[0]:
                st = opt.state.get(p)
                if st:  # (a step count on the host, as torch keeps it, unless fused / capturable keep it on device)
                    on_host = not any(g.get("fused") or g.get("capturable") for g in opt.param_groups)
                    opt.state[p] = {k: torch.tensor(float(v), dtype=torch.float32) if k == "step" and on_host
                                    else v.clone() for k, v in st.items()}
        zg = opt.__dict__.get("zero_grad")
        if isinstance(zg, ZeroGrad) and zg.clear == self._zero_grad:
            del opt.__dict__["zero_grad"]
        _BRIDGES[opt] = False


class ZeroGrad:
    """An optimizer's ``zero_grad`` as an instance attribute (a copy or a pickle of the optimizer has torch's, which
    ``Optimizer.__getstate__`` leaves out): ``clear(optimizer, set_to_none)``, else torch's where that returns False
    (a bridge's, :meth:`_Bridge.zero_grad`; paging's, ``paging._clear``)."""

    def __init__(self, opt, clear):
        self.opt, self.clear = weakref.ref(opt), clear

    def __call__(self, set_to_none: bool = True) -> None:
        opt = self.opt()
        if not self.clear(opt, set_to_none):
            type(opt).zero_grad(opt, set_to_none)


def swap_params(groups: list, lists) -> list:
    """Each group's ``params`` set to the list of ``lists`` beside it; returns the lists they held."""
    saved = [g["params"] for g in groups]
    for g, params in zip(groups, lists, strict=True):
        g["params"] = params
    return saved


def hide(bridge, groups: list) -> None:
    """A bridge's stepped parameters out of the optimizer's groups (``bridge.others``: each group's other
    parameters) for the optimizer's own step, kept in ``bridge.saved``; :func:`give_back` returns them."""
    bridge.saved = swap_params(groups, bridge.others)


def give_back(bridge, opt) -> None:
    """The groups' parameters as they were before :func:`hide` (nothing if none are hidden)."""
    saved, bridge.saved = bridge.saved, None
    if saved is not None:
        swap_params(opt.param_groups, saved)


_BRIDGE_TYPES = (_Bridge, optim_bnb.BnbBridge)
