"""Kernel launches with less host work than ``kernel[grid](...)`` once a specialisation has been compiled.

A LoRA layer launches six small kernels per training step; at 56 layers the host time of Triton's generic launch
path (argument binding, specialisation key, global-value checks, launch hooks) adds up to a sizeable part of a
host-bound step. ``launch`` keeps, per kernel, the compiled kernels it has seen under a key that is at least as fine
as Triton's own specialisation (per tensor argument: dtype and 16-byte alignment; per int: equal to 1, divisible by
16, fits in int32; every ``tl.constexpr`` and launch option), and calls the compiled kernel's launcher directly for
a key it has seen. The first call of each key, the interpreter (``TRITON_INTERPRET=1``), launch hooks (profilers)
and ``PatchConfig(fast_launch=False)`` (:func:`set_enabled`) take Triton's own path.

Arguments: ``args`` are the kernel's leading non-constexpr parameters in order, ``meta`` the constexprs by name plus
launch options (``num_warps``, ``num_stages``); every constexpr must be given (no defaults, no heuristics), which
keeps the key complete.
"""

from __future__ import annotations

import os
import warnings

import torch

try:  # Triton >= 3.3
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SUPPORTED = not _INTERPRET and _knobs is not None  # cleared for good if the path disables itself (_disable)
_ENABLED = _SUPPORTED
_I32 = 2**31


class _Kernel:
    """Per-kernel state: parameter order and the compiled kernels by key."""

    def __init__(self, fn):
        const = [p.is_constexpr for p in fn.params]
        self.n_args = const.index(True) if True in const else len(const)
        if any(not c for c in const[self.n_args:]):
            raise TypeError(f"{fn.__name__}: launch() needs the tl.constexpr parameters last")
        self.constexprs = [p.name for p in fn.params[self.n_args:]]
        self.nospec = {p.num for p in fn.params if p.do_not_specialize}
        self.compiled: dict = {}


_KERNELS: dict = {}
_stats = {"fast": 0, "slow": 0, "off": 0, "hooks": 0, "not_cachable": 0}


def _arg_key(args, nospec) -> tuple:
    """Per argument, what Triton specialises on: a tensor's dtype and 16-byte alignment; an int's value when it is
    -1, 0 or 1, else whether it divides by 16 and fits in int32 (only the latter for ``do_not_specialize``
    parameters); ``None`` and bools as themselves; any other type by its type. One comprehension (this runs for every
    launch: a per-argument function call cost twice as much host time)."""
    key = [(a if -1 <= a <= 1 else 2 + (a & 15 == 0) + 2 * (-_I32 <= a < _I32)) if type(a) is int
           else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
           else a if a is None or type(a) is bool else type(a)
           for a in args]
    for i in nospec:
        if i < len(args) and type(args[i]) is int:
            key[i] = -_I32 <= args[i] < _I32
    return tuple(key)


def _active(hook) -> bool:
    # Triton >= 3.5 keeps an always-present HookChain (empty unless a profiler adds hooks); older ones use None
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else hook is not None


def _hooks_set() -> bool:
    rt = _knobs.runtime
    return _active(rt.launch_enter_hook) or _active(rt.launch_exit_hook)


def launch(fn, grid, args, meta) -> None:
    """``fn[grid](*args, **meta)``; see the module docstring."""
    if not _ENABLED or _hooks_set():
        _stats["off" if not _ENABLED else "hooks"] += 1
        fn[grid](*args, **meta)
        return
    k = _KERNELS.get(fn)
    if k is None:
        k = _KERNELS[fn] = _Kernel(fn)
    dev = args[0].device.index
    key = _key(k, dev, args, meta)
    hit = k.compiled.get(key)
    if hit is None:
        if len(args) != k.n_args:
            raise TypeError(f"{fn.__name__}: {len(args)} positional arguments, expected {k.n_args}")
        compiled = fn[grid](*args, **meta)
        _stats["slow"] += 1
        if all(getattr(compiled, a, None) is not None for a in ("run", "function", "packed_metadata")):
            # the launcher takes every parameter, constexprs included, in signature order
            k.compiled[key] = (compiled, tuple(meta[n] for n in k.constexprs))
        else:
            _stats["not_cachable"] += 1
        return
    compiled, const_vals = hit
    g = (*grid, 1, 1)
    try:
        compiled.run(g[0], g[1], g[2], _stream(dev), compiled.function, compiled.packed_metadata, None, None, None,
                     *args, *const_vals)
    except TypeError as e:  # a Triton whose launcher takes other arguments: parsing fails before any launch
        _disable(f"{type(e).__name__}: {e}")
        fn[grid](*args, **meta)
        return
    _stats["fast"] += 1


class Bound:
    """One launch recorded for replay: ``fn[grid](*args, **meta)`` with its leading ``n_holes`` arguments, tensors,
    given per call (``bound(*tensors)``), everything else fixed -- for a caller that checked once that a later call
    would pass the same grid, constexprs and other arguments (a launch plan, keyed by what those depend on). A replay
    compares only the given tensors' part of the specialisation key (dtype, 16-byte alignment) with the recorded
    call's and runs the compiled kernel it found; a differing part, the interpreter, launch hooks or a disabled fast
    path take :func:`launch` (so the replay launches what a fresh call would)."""

    __slots__ = ("fn", "grid", "args", "meta", "n_holes", "hole_key", "hit", "dev")

    def __init__(self, fn, grid, args, meta, n_holes: int):
        # the holes' tensors are not kept: a plan must not hold a call's activations (nor weights) alive
        self.fn, self.grid, self.meta, self.n_holes = fn, (*grid, 1, 1)[:3], meta, n_holes
        self.args = [None] * n_holes + list(args[n_holes:])
        self.hole_key = _tensor_key(args[:n_holes])
        self.hit = None  # (compiled kernel, the launcher's arguments after the holes: the rest, then constexprs)
        self.dev = args[0].device.index

    def __call__(self, *tensors) -> None:
        if len(tensors) != self.n_holes:
            raise ValueError(f"{self.fn.__name__}: {len(tensors)} tensors for {self.n_holes} holes")
        hit = self.hit
        if hit is None or _tensor_key(tensors) != self.hole_key or not _ENABLED or _hooks_set():
            args = [*tensors, *self.args[self.n_holes:]]
            launch(self.fn, self.grid, args, self.meta)
            if hit is None and _ENABLED and _tensor_key(tensors) == self.hole_key:
                k = _KERNELS.get(self.fn)
                found = None if k is None else k.compiled.get(_key(k, self.dev, args, self.meta))
                if found is not None:
                    self.hit = (found[0], (*args[self.n_holes:], *found[1]))
            return
        compiled, tail = hit
        g = self.grid
        try:
            compiled.run(g[0], g[1], g[2], _stream(self.dev), compiled.function, compiled.packed_metadata, None, None,
                         None, *tensors, *tail)
        except TypeError as e:  # as in launch(): a launcher taking other arguments fails before launching
            _disable(f"{type(e).__name__}: {e}")
            self.fn[g](*tensors, *self.args[self.n_holes:], **self.meta)
            return
        _stats["fast"] += 1


def _tensor_key(tensors) -> tuple:
    return tuple((t.dtype, t.data_ptr() & 15 == 0) for t in tensors)


def _key(k: _Kernel, dev, args, meta) -> tuple:
    return (dev, tuple(meta.items()), _arg_key(args, k.nospec))


def set_enabled(on: bool) -> None:
    """The cached path on or off for the process (``PatchConfig.fast_launch``, which ``fast_multilora.patch`` passes
    here; the compiled kernels it keeps are the process's); it stays off where it cannot run (the interpreter, an
    old Triton, a launcher it failed to call)."""
    global _ENABLED
    _ENABLED = bool(on) and _SUPPORTED


def _disable(why: str) -> None:
    global _ENABLED, _SUPPORTED
    _ENABLED = _SUPPORTED = False
    _KERNELS.clear()
    warnings.warn(f"fast_multilora: cached kernel launches disabled, using Triton's launch path ({why})",
                  stacklevel=3)


def _current_stream(dev: int) -> int:
    return torch.cuda.current_stream(dev).cuda_stream


_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _current_stream  # the raw getter Triton uses


def stats() -> dict:
    """Launch counts since import: ``fast`` (cached path), ``slow`` (Triton's, first call of a key), ``off`` (path
    disabled or interpreter), ``hooks`` (launch hooks set), ``not_cachable`` (Triton returned no launcher handles)."""
    return dict(_stats)


def _table_key(table) -> tuple:
    # what the checks read of a table: its tensors' dtypes, devices and sizes, and its host ints
    r, o, s, d = table.ranks, table.offsets, table.scales, table.dropout
    return (r.dtype, o.dtype, s.dtype, d.dtype, r.device, o.device, s.device, d.device,
            r.numel(), o.numel(), s.numel(), d.numel(), table.max_rank, table.total_rank)


CHECK_KEYS = ("fwd_layout_ok", "bwd_layout_ok")  # the launchers' validation memos in ``Segments.cache`` (per device)


def memo_keys(device) -> tuple:
    """The ``Segments.cache`` keys of the launchers' validation memos for ``device``: sets of tables' properties,
    which hold no tensor (``fast_multilora.ops`` shares them between op calls). Each has a companion ``key + ("id",)``
    of the tables seen by identity, per ``Segments``."""
    return tuple((k, device) for k in CHECK_KEYS)


def checked(segs, table, key) -> bool:
    """Whether :func:`mark_checked` recorded ``table`` -- or one like it: the same tensors' dtypes, devices and sizes,
    the same host ints -- as validated against ``segs`` under ``key``. By identity first (an eager layer passes its
    own table every call); by those properties for tables rebuilt around the same or re-wrapped tensors (every
    custom-op call under ``torch.compile`` builds its own, and a compiled backward receives new tensor objects)."""
    seen = segs.cache.get((*key, "id"))
    if seen is not None and seen.get(id(table)) is table:
        return True
    memo = segs.cache.get(key)
    if memo is None or _table_key(table) not in memo:
        return False
    _remember(segs, table, key)  # the next call with this table takes the identity path
    return True


def mark_checked(segs, table, key) -> None:
    """Record that ``table`` passed the checks against ``segs``: its properties, and itself by identity (held, so
    its id is not reused meanwhile); both bounded."""
    memo = segs.cache.setdefault(key, set())
    if len(memo) >= 256:
        memo.clear()
    memo.add(_table_key(table))
    _remember(segs, table, key)


def _remember(segs, table, key) -> None:
    seen = segs.cache.setdefault((*key, "id"), {})
    if len(seen) >= 256:
        seen.clear()
    seen[id(table)] = table


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host ints (``triton.cdiv`` is a constexpr function: microseconds per call from Python)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of 2 >= ``n`` (1 for ``n <= 1``), for host ints."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


__all__ = ["CHECK_KEYS", "Bound", "cdiv", "checked", "launch", "mark_checked", "memo_keys", "next_power_of_2", "stats"]
