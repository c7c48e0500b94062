"""``AdamW`` over a patched model's adapters, stepping the adapter store (``fast_multilora.store``) in one launch.

``torch.optim.AdamW`` does host work per parameter tensor: 112 tensors per adapter on a Llama-shaped model of 8
layers, so its step grows with the adapter count. This optimizer keeps ``torch.optim``'s interface (one param group
per adapter with its own ``lr``, ``betas``, ``eps``, ``weight_decay``; LR schedulers, ``state_dict`` /
``load_state_dict``, ``zero_grad``) and steps each arena of the store with one kernel (``kernels.adamw``) whose
per-adapter hyperparameters and step counts are device tensors. Numerically it is ``torch.optim.AdamW`` run per
adapter: an adapter that had no token in a gradient-recording call since the last ``zero_grad`` is not stepped
(its step count stays), as ``torch.optim`` skips parameters without gradients; frozen parameters
(``requires_grad=False``) are not stepped. Parameters the store does not hold (fallback layers, ``lora_bias``
layers, MoE experts, ``modules_to_save``) are stepped by ``torch.optim``'s own AdamW with the same group settings.

Gradient clipping: :meth:`AdamW.clip_grad_norm` (global, or ``per_adapter=True``) reads the arenas directly;
``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` also works (the parameters' ``.grad`` are views of the
gradient arena) but does per-tensor work.
"""

from __future__ import annotations

import itertools
import operator
from typing import Callable, Mapping, NamedTuple, Optional

import torch
from torch.optim.adamw import adamw as _adamw

from . import cpu_ops, reference
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
        self._tables: dict = {}  # (dtype, device) -> (ChunkTable, group index per chunk's block) for trained blocks
        self._version = None  # the store's ``version`` (layouts, flag changes) when the tables were built
        self.steps: Optional[torch.Tensor] = None  # float32 [groups] on the store's device: each group's step count
        self._steps_buf = None  # the buffer ``steps`` is the head of (room for groups to come)
        self._group_slots = None  # (seen_names, int64 [groups] index into store.seen, bool [groups] steppable)
        self._hyper_cache = None  # (host rows, their device tensor) of the last step
        self._others = None  # _outside()'s cache
        # a layout since the tables were built that only removed groups and appended new ones: (the tables, the
        # trained flags, the kept groups' old indices, the old group count); the next build edits those tables
        self._table_delta = None
        # the arenas hold one optimizer's states: a new optimizer on the same model starts from zero moments and
        # takes them over (the previous one then refuses to step)
        for arena in self.store.arenas.values():
            arena.states.clear()
        self.store.owner = self
        self._follow(self.store)

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
        if self.steps is not None:
            host = self.steps.tolist()
            old_steps = {g["adapter"]: host[i] for i, g in enumerate(self.param_groups)}
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
        self.steps = self._steps_buf = torch.tensor([float(old_steps.get(g["adapter"], 0.0)) for g in keep],
                                                    dtype=torch.float32, device=device)
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
                st["step"] = self.steps[i]  # a 0-d view: the group's count
                for s in _STATES:
                    st[s] = arena.states[s][start : start + numel].view(p.shape)
        self._tables, self._version, self._group_slots, self._others = {}, None, None, None
        self._table_delta = None

    def _follow_delta(self, store: AdapterStore, placed: list, released: list) -> bool:
        """:meth:`_follow` for a re-layout that placed and released the parameters listed (``(param, adapter, ...)``),
        touching only those adapters' groups and those parameters' states, when every adapter's parameters are held
        by the store (else ``False``: the model-wide walk of :meth:`_follow` finds the others)."""
        router = store.router
        if not getattr(self, "_all_held", False) or router.expert_layers or len(store.slots) != len(router.layers):
            return False
        if self._steps_buf is None or self._steps_buf.untyped_storage().data_ptr() != \
                self.steps.untyped_storage().data_ptr():
            return False
        configs = getattr(router.tuner, "peft_config", {})
        affected = {name for _, name, *_ in placed} | {name for _, name in released}
        index = {g["adapter"]: i for i, g in enumerate(self.param_groups)}
        for name in affected:
            cfg = configs.get(name)
            if name not in index and (cfg is None or getattr(cfg, "use_dora", False) or any(
                    getattr(cfg, a, None) is not None for a in ("modules_to_save", "trainable_token_indices"))):
                return False  # a new adapter that may have parameters outside the store
        groups, old_index, n_before = [], [], len(self.param_groups)
        for i, g in enumerate(self.param_groups):
            if g["adapter"] in affected:
                g["params"] = list(store.adapter_params.get(g["adapter"], ((),))[0])
                if not g["params"]:
                    continue
            groups.append(g)
            old_index.append(i)
        for name in sorted(affected - set(index)):
            params = list(store.adapter_params.get(name, ((),))[0])
            if params:
                groups.append({"params": params, "adapter": name, **self.defaults, **self.settings.get(name, {})})
        for p, _ in released:
            self.state.pop(p, None)
        # the step counts live in a buffer with spare room (grown in place: the parameters' 0-d views of it follow);
        # groups that keep their index keep their views
        buf = self._steps_buf
        first = next((i for i, j in enumerate(old_index) if i != j), len(old_index))  # the first group that moved
        if first < len(old_index):
            buf[first : len(old_index)] = buf[torch.tensor(old_index[first:], dtype=torch.int64).to(buf.device)]
        if len(groups) > buf.numel():
            _grow(buf, max(len(groups), buf.numel() * 3 // 2))
        buf[len(old_index) : len(groups)] = 0
        self.param_groups, self.steps = groups, buf[: len(groups)]
        for arena in store.arenas.values():
            for s in _STATES:
                if s not in arena.states:
                    arena.states[s] = torch.zeros_like(arena.data)
        for i, g in enumerate(groups):  # each parameter's step count is a 0-d view of its group's
            if i < first and g["adapter"] not in affected:
                continue
            step = buf[i]
            for p in g["params"]:
                st = self.state[p]
                st["step"] = step
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
            pos = {id(g): i for i, g in enumerate(groups)}
            blocks = [a.blocks for a in store.arenas.values()]
            others = [(pos[id(g)], g, ps) for _, g, ps in others if id(g) in pos and g["adapter"] not in affected]
            for g in groups:
                if g["adapter"] in affected:
                    out = [p for p in g["params"] if not any(p in b for b in blocks)]
                    if out:
                        others.append((pos[id(g)], g, out))
            others.sort(key=operator.itemgetter(0))
        # the tables can be edited at the next build when no group that stays changed (its chunks keep their places)
        if self._tables and self._table_delta is None and self._version is not None and \
                all(g["adapter"] not in affected for g in groups[: len(old_index)]):
            self._table_delta = (self._tables, self._trained, old_index, n_before)
        else:
            self._table_delta = None
        self._tables, self._version, self._group_slots, self._others = {}, None, None, others
        return True

    # -- tables ---------------------------------------------------------------------------------------------------
    def _store_params(self) -> list:
        return list(itertools.chain.from_iterable(map(_BLOCK_PARAM, a.blocks.values())
                                                  for a in self.store.arenas.values()))

    def _build_tables(self) -> None:
        """Each arena's chunk table of the trained pieces (``requires_grad``) by group, read from the layers' slots
        (no per-parameter lookups)."""
        from .kernels.adamw import chunk_table

        store = self.store
        delta, self._table_delta = self._table_delta, None
        flagged, store.flagged = store.flagged, set()
        if delta is not None and self._edit_tables(delta, flagged):
            return
        group = {g["adapter"]: i for i, g in enumerate(self.param_groups) if g["adapter"] is not None}
        pattern = store.pattern
        blocks: dict = {key: [] for key in store.arenas}
        for s in store.slots.values():  # per layer a few tensor ops over its adapters (no Python step per adapter)
            n = len(s.names)
            if not n:
                continue
            gi = torch.tensor(list(map(group.get, s.names, itertools.repeat(-1))), dtype=torch.int64)
            off, r = torch.tensor(s.offsets, dtype=torch.int64), torch.tensor(s.ranks, dtype=torch.int64)
            flags = torch.tensor(list(map(pattern.__getitem__, s.held_idx)), dtype=torch.bool)
            both = torch.cat([torch.stack([s.a0 + off * s.K, r * s.K, gi], 1),
                              torch.stack([s.b0 + off * s.N, r * s.N, gi], 1)])
            blocks[(s.arena.dtype, s.arena.device)].append(both[flags & (torch.cat([gi, gi]) >= 0)])
        tables = {}
        trained = torch.zeros(len(self.param_groups), dtype=torch.bool)
        for key, arena in store.arenas.items():
            b = torch.cat(blocks[key]) if blocks[key] else torch.zeros(0, 3, dtype=torch.int64)
            tables[key] = chunk_table(b, len(self.param_groups), arena.used, arena.device)
            trained[b[:, 2]] = True
        self._tables = tables
        self._version = store.version
        self._trained = trained.to(self.steps.device)
        self._group_slots = None  # its steppable flags follow _trained

    def _edit_tables(self, delta: tuple, flagged: set) -> bool:
        """:meth:`_build_tables` after a layout that removed groups and appended new ones (``delta``, from
        :meth:`_follow_delta`) when no flag of another adapter changed since (``flagged``): the old tables' chunks of
        the removed groups dropped and the others renumbered (device ops), the new groups' pieces cut into chunks and
        appended -- the work of the groups that changed, not of the arena. ``False``: a full build is needed."""
        from .kernels.adamw import chunk_table

        store = self.store
        old_tables, old_trained, old_index, n_old = delta
        G, kept = len(self.param_groups), len(old_index)
        new = {g["adapter"]: kept + i for i, g in enumerate(self.param_groups[kept:])}
        if not flagged <= set(new) or set(old_tables) != set(store.arenas) or None in new:
            return False
        pattern, index_of = store.pattern, store.index_of
        blocks: dict = {key: [] for key in store.arenas}
        for name, gi in new.items():
            entry = store.adapter_params.get(name)
            if entry is None:
                continue
            params, where = entry
            for k, (s, off) in enumerate(where):
                pa, pb = params[2 * k], params[2 * k + 1]
                r = pa.shape[0]
                for p, start, numel in ((pa, s.a0 + off * s.K, r * s.K), (pb, s.b0 + off * s.N, r * s.N)):
                    if pattern[index_of[id(p)]]:
                        blocks[(s.arena.dtype, s.arena.device)].append((start, numel, gi))
        keep = torch.tensor(old_index, dtype=torch.int64)
        remap = torch.full((n_old,), -1, dtype=torch.int64)
        remap[keep] = torch.arange(kept)
        trained = torch.zeros(G, dtype=torch.bool, device=self.steps.device)
        trained[:kept] = old_trained[keep.to(old_trained.device)]
        tables = {}
        for key, arena in store.arenas.items():
            t = old_tables[key]
            dev = t.start.device
            a = remap.to(dev)[t.adapter.long()]
            on = a >= 0
            adapter = a[on]
            per = torch.bincount(adapter, minlength=kept)
            add = chunk_table(blocks[key], G, arena.used, arena.device, chunk=t.chunk)
            ptr = torch.zeros(kept + 1, dtype=torch.int64, device=dev)
            ptr[1:] = torch.cumsum(per, 0)
            length = t.length[on]
            tables[key] = add._replace(
                start=torch.cat([t.start[on], add.start]), length=torch.cat([length, add.length]),
                adapter=torch.cat([adapter.to(torch.int32), add.adapter]),
                adapter_ptr=torch.cat([ptr, add.adapter_ptr[kept + 1 :].long() + ptr[-1]]).to(torch.int32),
                max_chunks=max(int(per.max()) if kept else 0, add.max_chunks),
                covered=int(length.sum()) + add.covered, align=min(t.align, add.align))
            for b in blocks[key]:
                trained[b[2]] = True
        self._tables = tables
        self._version = store.version
        self._trained = trained
        self._group_slots = None
        return True

    def _active(self) -> Optional[torch.Tensor]:
        """bool [groups]: the groups whose adapter had tokens in a gradient-recording call since ``zero_grad``."""
        store = self.store
        if store.seen is None:
            return None
        if self._group_slots is None or self._group_slots[0] != store.seen_names:
            index = {n: i + 1 for i, n in enumerate(store.seen_names)}
            slots = torch.tensor([index.get(g["adapter"], 0) for g in self.param_groups], dtype=torch.int64)
            # frozen groups and those without a slot (index 0 is the base tokens' flag) keep their step count
            keep = (slots > 0).to(store.seen.device) & self._trained
            self._group_slots = (store.seen_names, slots.to(store.seen.device), keep)
        return store.seen[self._group_slots[1]] & self._group_slots[2]

    def _hyper(self, device) -> torch.Tensor:
        """float32 [groups, 5] on ``device``: each group's lr, betas, eps, weight decay (read every step: LR
        schedulers change them; copied only when they did). Staged through pinned memory (torch's caching host
        allocator): a copy from pageable memory would wait for the device to drain its queue, a sync per step."""
        rows = [(g["lr"], *g["betas"], g["eps"], g["weight_decay"]) for g in self.param_groups]
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
        active = self._active()
        if active is not None and self._tables:
            # once per step for every arena: each stepped group's count goes up by one, then its scalars
            scalars = self._ops(self.steps.device).scalars(self._hyper(self.steps.device), self.steps, active)
            for (dtype, device), table in self._tables.items():
                arena = self.store.arenas[(dtype, device)]
                used = arena.used  # (the buffers' spare tail past it holds no piece)
                self._ops(device).step(arena.data[:used], arena.grad[:used], arena.states["exp_avg"][:used],
                                       arena.states["exp_avg_sq"][:used], table, scalars, active)
        self._step_others()
        return loss

    def _outside(self) -> list:
        """``[(group index, group, its parameters outside the store)]``, for groups that have some (cached per
        layout)."""
        if self._others is None:  # (C-level filters: no Python step per held parameter)
            held = set(map(id, self._store_params()))
            others = [(i, g, list(itertools.compress(g["params"], map(operator.not_, map(held.__contains__,
                                                                                         map(id, g["params"]))))))
                      for i, g in enumerate(self.param_groups)]
            self._others = [o for o in others if o[2]]
        return self._others

    def _outside_trained(self) -> list:
        """``[(group index, group, its parameters outside the store that train and have a gradient)]``."""
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
        G = len(self.param_groups)
        device = self.steps.device
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
        return norms if per_adapter else total

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
            self.steps.copy_(torch.tensor(steps, dtype=self.steps.dtype))
