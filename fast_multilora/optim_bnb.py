"""bitsandbytes' blockwise 8-bit Adam (``bnb.optim.Adam8bit``, ``AdamW8bit``, ``PagedAdam8bit``,
``PagedAdamW8bit``, ``Adam(optim_bits=8)``) over an adapter store's parameters, in a few calls per arena per step.

bitsandbytes steps each parameter tensor with one ``optimizer_update_8bit_blockwise`` call: Python work, a launch
and (on CUDA) a device synchronisation per tensor -- 896 of them for 8 adapters on an 8-layer Llama. The update is
elementwise, and its 8-bit states are quantised in 256-element blocks counted from each tensor's start, each block on
its own (its ``absmax``). So the pieces of many tensors laid end to end, each starting on a block boundary, the gap
after a piece that is not a whole number of blocks zero (a zero gradient and zero states stay zero: the gap's
elements quantise to the map's exact zero and leave the block's ``absmax`` as the piece's own), are stepped by one
call exactly as bitsandbytes steps each tensor, provided they share the step count and hyperparameters.

:class:`BnbBridge` does that for a bitsandbytes optimizer holding store parameters (found by the same global step
hooks as ``torch.optim.AdamW``, ``fast_multilora.optim``). It keeps the 8-bit states of the parameters it steps in
flat buffers per arena (``state1``/``state2`` uint8, ``absmax1``/``absmax2`` float32), the parameters in a fixed
order (adapter by adapter, each piece padded to whole blocks); each optimizer state is bitsandbytes' own dict --
``{"step", "state1", "qmap1", "state2", "qmap2", "absmax1", "absmax2"}`` -- whose tensors are views of those buffers,
so ``state_dict`` / ``load_state_dict`` / resume work as ever (loaded states are copied into the buffers). Per step
the parameters with a gradient are cut into runs of consecutive pieces of one param group and one step count; a run
is one call over its states, with its weights and gradients gathered from the arena into a staging buffer (by
index, a few copies per run) and its weights written back: equal bit for bit to bitsandbytes stepping each tensor.

Left to bitsandbytes' own per-tensor step: tensors under ``min_8bit_size`` (32-bit states), parameters with a
``GlobalOptimManager.override_config`` entry, states loaded in another form (32-bit), parameters outside the
store, and every parameter of other classes and options (other update rules, ``optim_bits`` 32, ``skip_zeros``,
``register_parameters`` overrides by position). A model unpatched, paging (``resident_adapters``) or
``PatchConfig(store_optimizer=False)`` give the states back (own copies) and bitsandbytes steps everything.
"""

from __future__ import annotations

import inspect
import math
import operator

import torch

from .plan import BASE

BLOCK = 256  # bitsandbytes' block of the 8-bit optimizer states
CHUNK = 1 << 24  # elements per call at most (a staging buffer's size; CUDA's kernel counts in int32)
_STATE_KEYS = ("state1", "state2", "absmax1", "absmax2")


def bridgeable(opt) -> bool:
    """Whether ``opt`` is a bitsandbytes blockwise 8-bit Adam whose step :class:`BnbBridge` reproduces: the class
    does not override the update, the states' layout or the config lookup; 8-bit states; no ``skip_zeros``."""
    if not type(opt).__module__.startswith("bitsandbytes."):
        return False
    from bitsandbytes.optim.optimizer import Optimizer2State, Optimizer8bit

    cls = type(opt)
    if not isinstance(opt, Optimizer2State) or getattr(opt, "optimizer_name", None) != "adam":
        return False
    # (torch wraps a class's ``step`` for its hooks: compared unwrapped)
    same = (cls.update_step is Optimizer2State.update_step and cls.init_state is Optimizer2State.init_state
            and cls.get_config is Optimizer8bit.get_config and cls.get_state_buffer is Optimizer8bit.get_state_buffer
            and inspect.unwrap(cls.step) is inspect.unwrap(Optimizer8bit.step))
    args = getattr(opt, "args", None)
    return same and getattr(args, "optim_bits", 32) == 8 and not getattr(args, "skip_zeros", False)


class _Arena:
    """The bridge's states of one store arena: flat buffers and the staging buffers of one call."""

    def __init__(self, key, size: int, unit: int, padded: bool, opt, qmaps):
        import bitsandbytes.functional as F

        dtype, device = key
        self.key, self.unit, self.size = key, unit, size
        # each map's code of 0.0: the padding's states, so that they dequantise to zero whatever the block's absmax
        self.zero1, self.zero2 = (int((q == 0).nonzero()[0]) for q in qmaps)
        self.buffers = []
        for zero in (self.zero1, self.zero2):  # state1, state2: paged as bitsandbytes pages a state of 1e5 elements
            # or more (where no piece is padded: the padding is reset by device ops, not by the paged kernels)
            if opt.is_paged and device.type == "cuda" and size >= 1e5 and not padded:
                buf = F.get_paged(size, dtype=torch.uint8, device=device)
                F.fill(buf, 0)
                opt.page_mng.paged_tensors.append(buf)
            else:
                buf = torch.full((size,), zero, dtype=torch.uint8, device=device)
            self.buffers.append(buf)
        self.state1, self.state2 = self.buffers
        self.absmax1 = torch.zeros(size // BLOCK, dtype=torch.float32, device=device)
        self.absmax2 = torch.zeros(size // BLOCK, dtype=torch.float32, device=device)
        stage = min(size, CHUNK)
        self.p_stage = torch.zeros(stage, dtype=dtype, device=device)
        self.g_stage = torch.zeros(stage, dtype=dtype, device=device)


def _part(buf: torch.Tensor, lo: int, hi: int, shape=None) -> torch.Tensor:
    """``buf[lo:hi]`` (viewed as ``shape``), marked paged as ``buf`` is (bitsandbytes tells a paged tensor, CUDA
    managed memory that torch sees on the CPU, by these attributes, which a view does not inherit)."""
    part = buf[lo:hi] if shape is None else buf[lo:hi].view(shape)
    if getattr(buf, "is_paged", False):
        part.is_paged, part.page_deviceid = True, buf.page_deviceid
    return part


class _Piece:
    """One parameter the bridge steps: where it lies in its arena and in the bridge's state buffers."""

    __slots__ = ("param", "arena", "start", "numel", "offset", "group", "index", "adapter")

    def __init__(self, param, arena, start, numel, group, index, adapter):
        self.param, self.arena, self.start, self.numel = param, arena, start, numel
        self.group, self.index, self.adapter = group, index, adapter
        self.offset = 0  # in the arena's state buffers (a multiple of BLOCK)


class _Call(tuple):
    """One ``optimizer_update_8bit_blockwise`` call of a plan: ``(arena, group, first piece, state range lo, hi,
    source units, staging units and padding positions, or None where there is no padding)``."""


class BnbBridge:
    """One bitsandbytes 8-bit Adam stepping store-held parameters through the bridge's buffers (see the module
    docstring)."""

    def __init__(self, opt, store):
        self.store = store
        self.key = None  # (store version, the groups' lists and lengths, the optimizer's state dict, overrides)
        self.pieces: list = []  # _Piece, in the buffers' order
        self.dicts: list = []  # per piece its optimizer state (None until its first step)
        self.steps: list = []  # per piece its step count
        self.index: list = []  # per piece its store index (``store.attached`` holds it when it has a gradient)
        self.breaks: list = []  # per piece: its group or arena is not the previous piece's
        self.arenas: dict = {}  # (dtype, device) -> _Arena
        self.others: list = []  # per optimizer group, the parameters bitsandbytes steps
        self.plans: dict = {}  # (stepped pieces, run breaks) -> [_Call], and the runs' piece ranges
        self.saved = None  # the groups' parameter lists while hidden
        self.state_obj = None  # opt.state when mapped (bitsandbytes' load_state_dict replaces it)

    # -- mapping --------------------------------------------------------------------------------------------------
    def _map(self, opt) -> None:
        """Which of the optimizer's parameters the bridge steps; their states read into fresh buffers (the states
        bitsandbytes or the bridge made before, or a loaded ``state_dict``) and the optimizer's states made views of
        them."""
        store = self.store
        index_of, held, adapter_of = store.index_of, store._held, store.adapter_of
        mng, args = opt.mng, opt.args
        qmaps = self._qmaps(opt, None)
        same: dict = {}
        chosen = []
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                i = index_of.get(id(p))
                if i is None or held[i] is not p or p.numel() < args.min_8bit_size or id(p) in mng.pid2config:
                    continue
                arena_key = (p.dtype, p.device)
                arena = store.arenas.get(arena_key)
                blk = arena.blocks.get(p) if arena is not None else None
                if blk is None or blk[2] is not p or not self._adoptable(opt.state.get(p), p, qmaps, same):
                    continue
                chosen.append(_Piece(p, arena_key, blk[0], blk[1], gi, i, adapter_of[i]))
        order = {}
        for pc in chosen:  # adapter by adapter (a run of one adapter's pieces is one call), each in arena order
            order.setdefault((pc.arena, pc.adapter), len(order))
        chosen.sort(key=lambda pc: (order[(pc.arena, pc.adapter)], pc.start))
        sizes: dict = {}
        for pc in chosen:
            pc.offset = sizes.get(pc.arena, 0)
            sizes[pc.arena] = pc.offset + -(-pc.numel // BLOCK) * BLOCK
        old_arenas, self.arenas = self.arenas, {}
        for key, size in sizes.items():
            unit = BLOCK
            for pc in chosen:
                if pc.arena == key:
                    unit = math.gcd(unit, pc.start, pc.numel)
            padded = any(pc.numel % BLOCK for pc in chosen if pc.arena == key)
            self.arenas[key] = _Arena(key, size, unit, padded, opt, qmaps)
        del old_arenas
        dicts, steps = [], []
        with torch.no_grad():
            for pc in chosen:
                a = self.arenas[pc.arena]
                cur = opt.state.get(pc.param)
                if cur:
                    views = self._views(a, pc)
                    for k in _STATE_KEYS:
                        views[k].copy_(cur[k].reshape(views[k].shape))
                    cur.update(views)
                    steps.append(int(cur["step"]))
                    dicts.append(cur)
                else:
                    steps.append(0)
                    dicts.append(None)
        self.pieces, self.dicts, self.steps = chosen, dicts, steps
        self.index = [pc.index for pc in chosen]
        # (a run never spans two groups or arenas)
        self.breaks = [j > 0 and (pc.group, pc.arena) != (chosen[j - 1].group, chosen[j - 1].arena)
                       for j, pc in enumerate(chosen)]
        owned = {id(pc.param) for pc in chosen}
        self.others = [[p for p in g["params"] if id(p) not in owned] for g in opt.param_groups]
        self.plans = {}
        self.state_obj = opt.state

    @staticmethod
    def _qmaps(opt, device):
        """bitsandbytes' quantisation maps (on ``device``, as its ``init_state`` moves them)."""
        if "dynamic" not in opt.name2qmap:
            opt.fill_qmap()
        if device is not None:
            opt.name2qmap["dynamic"] = opt.name2qmap["dynamic"].to(device)
            opt.name2qmap["udynamic"] = opt.name2qmap["udynamic"].to(device)
        return opt.name2qmap["dynamic"], opt.name2qmap["udynamic"]

    @staticmethod
    def _adoptable(cur, p, qmaps, same: dict) -> bool:
        """A parameter's state the bridge can take: none yet, or bitsandbytes' 8-bit blockwise state of it (its
        quantisation maps equal to the optimizer's; ``same`` caches the comparison per map object)."""
        if not cur:
            return True
        n = p.numel()
        blocks = -(-n // BLOCK)
        try:
            ok = all(cur[k].dtype == torch.uint8 and cur[k].numel() == n for k in ("state1", "state2")) and \
                all(cur[k].dtype == torch.float32 and cur[k].numel() == blocks for k in ("absmax1", "absmax2"))
            for q, m in ((cur["qmap1"], qmaps[0]), (cur["qmap2"], qmaps[1])):
                if ok and q is not m and id(q) not in same:
                    same[id(q)] = (q, torch.equal(q.cpu(), m.cpu()))
                ok = ok and (q is m or same[id(q)][1])
            return ok and isinstance(cur["step"], int)
        except (KeyError, AttributeError):
            return False

    @staticmethod
    def _views(a: _Arena, pc: _Piece) -> dict:
        lo, n, shape = pc.offset, pc.numel, pc.param.shape
        b0, nb = lo // BLOCK, -(-n // BLOCK)
        return {"state1": _part(a.state1, lo, lo + n, shape), "state2": _part(a.state2, lo, lo + n, shape),
                "absmax1": a.absmax1[b0 : b0 + nb], "absmax2": a.absmax2[b0 : b0 + nb]}

    def _new_state(self, opt, pc: _Piece) -> dict:
        """bitsandbytes' ``init_state`` of a piece's first step, its tensors the buffers' views."""
        q1, q2 = self._qmaps(opt, pc.param.device)
        v = self._views(self.arenas[pc.arena], pc)
        st = {"step": 0, "state1": v["state1"], "qmap1": q1, "state2": v["state2"], "qmap2": q2,
              "absmax1": v["absmax1"], "absmax2": v["absmax2"]}
        if opt.args.max_unorm > 0.0:
            st["unorm_vec"] = torch.zeros((1,), device=pc.param.device)
        opt.state[pc.param] = st
        return st

    # -- a step ---------------------------------------------------------------------------------------------------
    def _plan(self, stepped: list) -> tuple:
        """The calls of a step with the pieces ``stepped`` have gradients: runs of consecutive stepped pieces of one
        arena, group and step count, cut into calls of at most ``CHUNK`` elements (cached by the stepped pieces
        and where runs break)."""
        pieces, steps = self.pieces, self.steps
        n = len(pieces)
        differs = tuple(map(operator.ne, steps[1:], steps[:-1]))  # (C-level: no Python step per piece)
        key = (tuple(stepped), differs)
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        runs, j = [], 0
        cut = {j for j in range(1, n) if differs[j - 1] or self.breaks[j]}
        while j < n:
            if not stepped[j]:
                j += 1
                continue
            k = j + 1
            while k < n and stepped[k] and k not in cut:
                k += 1
            runs.append((j, k))
            j = k
        calls = []
        for j, k in runs:
            a = self.arenas[pieces[j].arena]
            u = a.unit
            parts = []  # (state offset, arena start, elements) of the run, cut at CHUNK-element state boundaries
            for pc in pieces[j:k]:
                for off in range(0, pc.numel, CHUNK):
                    parts.append((pc.offset + off, pc.start + off, min(CHUNK, pc.numel - off)))
            lo = parts[0][0]
            group = []
            for part in parts + [None]:
                if part is not None:
                    end = part[0] + -(-part[2] // BLOCK) * BLOCK
                    if not group or end - lo <= CHUNK:
                        group.append(part)
                        continue
                hi = group[-1][0] + -(-group[-1][2] // BLOCK) * BLOCK
                src = torch.cat([torch.arange(s // u, (s + m) // u) for _, s, m in group])
                dst = torch.cat([torch.arange((o - lo) // u, (o - lo + m) // u) for o, _, m in group])
                device = a.key[1]
                pad = None  # the state positions of the pieces' padding, given the map's zero after each call
                if dst.numel() * u != hi - lo:
                    pad = torch.cat([torch.arange(o + m, o + -(-m // BLOCK) * BLOCK) for o, _, m in group])
                    dst, pad = dst.to(device), pad.to(device)
                else:
                    dst = None
                calls.append(_Call((a, pieces[j].group, j, lo, hi, src.to(device), dst, pad)))
                if part is None:
                    break
                group, lo = [part], part[0]
        if len(self.plans) > 64:
            self.plans.clear()
        plan = self.plans[key] = (calls, runs)
        return plan

    @torch.no_grad()
    def _step(self, opt, stepped: list) -> None:
        import bitsandbytes.functional as F

        calls, runs = self._plan(stepped)
        steps, groups = self.steps, opt.param_groups
        store = self.store
        views = {}
        if opt.is_paged:
            for a in self.arenas.values():
                for buf in a.buffers:
                    if getattr(buf, "is_paged", False):
                        F.prefetch_tensor(buf)
        for a, gi, first, lo, hi, src, dst, pad in calls:
            v = views.get(a.key)
            if v is None:
                arena = store.arenas[a.key]
                u = a.unit
                m = arena.data.numel() // u * u
                v = views[a.key] = (arena.data[:m].view(-1, u), arena.grad[:m].view(-1, u))
            data, grad = v
            n, u = hi - lo, a.unit
            p, g = a.p_stage[:n], a.g_stage[:n]
            if dst is None:
                torch.index_select(grad, 0, src, out=g.view(-1, u))
                torch.index_select(data, 0, src, out=p.view(-1, u))
            else:  # (pieces padded to whole blocks: the gaps zero)
                g.zero_()
                p.zero_()
                g.view(-1, u).index_copy_(0, dst, grad.index_select(0, src))
                p.view(-1, u).index_copy_(0, dst, data.index_select(0, src))
            group = groups[gi]
            betas = group["betas"]
            b0, b1 = lo // BLOCK, hi // BLOCK
            q1, q2 = self._qmaps(opt, a.key[1])
            F.optimizer_update_8bit_blockwise(
                opt.optimizer_name, g, p, _part(a.state1, lo, hi), _part(a.state2, lo, hi), betas[0], betas[1],
                betas[2] if len(betas) >= 3 else 0.0, group.get("alpha", 0.0), group["eps"], steps[first] + 1,
                group["lr"], q1, q2, a.absmax1[b0:b1], a.absmax2[b0:b1], group["weight_decay"], gnorm_scale=1.0,
                skip_zeros=opt.args.skip_zeros)
            data.index_copy_(0, src, p.view(-1, u) if dst is None else p.view(-1, u).index_select(0, dst))
            if pad is not None:  # (bitsandbytes' quantiser takes 0.0 to a small code, not to the map's zero)
                a.state1.index_fill_(0, pad, a.zero1)
                a.state2.index_fill_(0, pad, a.zero2)
        dicts = self.dicts
        for j, k in runs:
            count = steps[j] + 1
            steps[j:k] = [count] * (k - j)
            for i in range(j, k):
                st = dicts[i]
                if st is None:
                    st = dicts[i] = self._new_state(opt, self.pieces[i])
                st["step"] = count
        if opt.is_paged and calls:
            from bitsandbytes.utils import sync_gpu

            sync_gpu(self.pieces[0].param)  # (as bitsandbytes ends a paged step)

    def before(self, opt) -> None:
        from .optim import _steps_optimizers

        if self.saved is not None:  # (a step that raised left the parameters hidden)
            self.after(opt)
        store, mng = self.store, opt.mng
        if not _steps_optimizers(store) or mng.index2config:
            # (unpatched, paging, the setting off; overrides by position would be read at the hidden positions)
            self.detach(opt)
            return
        if not opt.initialized and mng.module_weight_config_triple:
            opt.check_overrides()  # (bitsandbytes does it at its first step: the overrides of hidden parameters)
            if mng.index2config:
                self.detach(opt)
                return
        if store.stale(store.trained - {BASE}):
            store.layout()
        store.trained = set()
        store.prepare_grads()
        store.touched_adapters = set()  # (each piece steps by its own gradient: a penalty on part of an adapter too)
        groups = opt.param_groups
        key = (store.version, tuple((id(g["params"]), len(g["params"])) for g in groups), len(mng.pid2config))
        if key != self.key or opt.state is not self.state_obj:
            self._map(opt)
            self.key = key
        if not self.pieces:
            return
        stepped = list(map(store.attached.__contains__, self.index))
        if any(stepped):
            self._step(opt, stepped)
        from .optim import hide

        hide(self, groups)

    def after(self, opt) -> None:
        from .optim import give_back

        give_back(self, opt)

    def detach(self, opt) -> None:
        """The optimizer's states of the bridge's parameters become their own tensors; bitsandbytes steps them."""
        from .optim import _BRIDGES

        for pc, st in zip(self.pieces, self.dicts, strict=True):
            if st is not None and opt.state.get(pc.param) is st:
                for k in _STATE_KEYS:
                    st[k] = st[k].clone()
        self.pieces, self.dicts, self.arenas, self.plans = [], [], {}, {}
        _BRIDGES[opt] = False

