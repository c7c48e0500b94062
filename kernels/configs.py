"""Tuned block sizes as data: ``block_config(op, ...)`` picks a row of the JSON file for the target.

The files in ``kernels/configs/`` hold, per op, a list of rows of named fields. A row may carry match fields --
``max_width`` (the row covers widths up to it; absent: any), ``rank_tile``, ``dtypes`` (names such as
``"bfloat16"``), ``mode``, ``family`` -- and a free ``note`` (how the row was measured); the first row whose match
fields all agree with the call wins, and its other fields are returned. The target's file: ``interpreter.json`` under
``TRITON_INTERPRET=1`` (read at import, as Triton decides), else the GPU's name (``torch.cuda.get_device_name``:
"NVIDIA H200" -> ``h200.json``; "NVIDIA A100-SXM4-80GB" -> ``a100_sxm4_80gb.json``, then ``a100.json``), else
``default.json``. A file may name a ``base`` file whose ops it takes unless it lists them itself. Files are read once.

What ``width`` means is the op's: N (``stack*max_rank``) for the forward shrinks, the output dim for the expands
and the expand backward, K for ``shrink_bwd_r16``, ``next_power_of_2(max_rank)`` for ``decode``, the vocabulary for
``cross_entropy``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
from pathlib import Path
from types import MappingProxyType
from typing import Mapping, Optional

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
INTERPRETER = "interpreter"
DEFAULT = "default"
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_MATCH = ("max_width", "rank_tile", "dtypes", "mode", "family")
_BLOCK = ("BLOCK_S", "BLOCK_K", "num_warps", "num_stages")
# op -> the fields each of its rows returns (all required, ints unless listed in _BOOL)
OP_FIELDS = {
    "shrink": ("BLOCK_S", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "shrink_many": ("BLOCK_S", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "shrink_dropout": ("BLOCK_S", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "shrink_dropout_store": ("BLOCK_S", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "expand_add": ("BLOCK_S", "BLOCK_N", "BLOCK_R", "num_warps", "num_stages", "N_TILES"),
    "expand_write": ("BLOCK_S", "BLOCK_N", "BLOCK_R", "num_warps", "num_stages", "N_TILES"),
    "expand_loop": ("min_tiles",),
    "expand_bwd": ("BLOCK_S", "BLOCK_N", "num_warps", "fused"),
    "shrink_bwd": _BLOCK,
    "shrink_bwd_da": _BLOCK,
    "shrink_bwd_r16": _BLOCK,
    "decode": ("BLOCK_S", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"),
    "cross_entropy": ("BLOCK_M", "BLOCK_V", "num_warps"),
}
_BOOL = ("fused",)
_ZERO_OK = ("min_tiles",)


class ConfigError(ValueError):
    """A block-size file that is missing, malformed, or has no row for a call."""


def _fail(path: Path, where: str, what: str):
    raise ConfigError(f"block-size file {path}: {where}: {what}")


def _check_row(path: Path, op: str, i: int, row) -> dict:
    where = f"ops.{op}[{i}]"
    if not isinstance(row, dict):
        _fail(path, where, f"a row must be an object of named fields, got {type(row).__name__}")
    fields = OP_FIELDS[op]
    unknown = set(row) - set(fields) - set(_MATCH) - {"note"}
    if unknown:
        _fail(path, where, f"unknown field(s) {sorted(unknown)}; {op} rows take {list(fields)}, match fields "
                           f"{list(_MATCH)} and 'note'")
    for f in fields:
        if f not in row:
            _fail(path, where, f"missing field {f!r} ({op} rows take {list(fields)})")
        v = row[f]
        least = 0 if f in _ZERO_OK else 1
        ok = isinstance(v, bool) if f in _BOOL else isinstance(v, int) and not isinstance(v, bool) and v >= least
        if not ok:
            want = "true/false" if f in _BOOL else "a positive integer" if least else "an integer >= 0"
            _fail(path, where, f"{f} must be {want}, got {v!r}")
    for f in ("max_width", "rank_tile"):
        if f in row and (not isinstance(row[f], int) or isinstance(row[f], bool) or row[f] <= 0):
            _fail(path, where, f"{f} must be a positive integer, got {row[f]!r}")
    if "dtypes" in row:
        names = row["dtypes"]
        if not isinstance(names, list) or not all(isinstance(getattr(torch, n, None), torch.dtype) for n in names):
            _fail(path, where, f"dtypes must be a list of torch dtype names such as 'bfloat16', got {names!r}")
    for f in ("mode", "family", "note"):
        if f in row and not isinstance(row[f], str):
            _fail(path, where, f"{f} must be a string, got {row[f]!r}")
    return row


@functools.lru_cache(maxsize=None)
def load(target: str) -> dict:
    """``{op: [row, ...]}`` of ``configs/<target>.json`` (its ``base`` file's ops under its own), validated."""
    path = CONFIG_DIR / f"{target}.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no block-size file for target {target!r} (files: "
                          f"{sorted(p.stem for p in CONFIG_DIR.glob('*.json'))})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("ops", {}), dict):
        _fail(path, "top level", "expected an object with an 'ops' object (op -> list of rows)")
    unknown = set(data) - {"ops", "base", "note"}
    if unknown:
        _fail(path, "top level", f"unknown key(s) {sorted(unknown)}; a file takes 'ops', 'base' and 'note'")
    ops = {}
    if "base" in data:
        if data["base"] == target:
            _fail(path, "base", "a file cannot be its own base")
        ops.update(load(data["base"]))
    for op, rows in data.get("ops", {}).items():
        if op not in OP_FIELDS:
            _fail(path, f"ops.{op}", f"unknown op; known ops: {sorted(OP_FIELDS)}")
        if not isinstance(rows, list) or not rows:
            _fail(path, f"ops.{op}", "expected a non-empty list of rows")
        ops[op] = [_check_row(path, op, i, row) for i, row in enumerate(rows)]
    return ops


def _slug(name: str) -> str:
    return re.sub(r"^nvidia_", "", re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_"))


@functools.lru_cache(maxsize=None)
def _device_target(name: str) -> str:
    slug = _slug(name)
    for stem in (slug, slug.split("_")[0]):
        if stem and (CONFIG_DIR / f"{stem}.json").is_file():
            return stem
    return DEFAULT


def target_for(device=None, interpret: Optional[bool] = None) -> str:
    """The file (stem) for ``device``: ``interpreter`` under ``TRITON_INTERPRET=1`` (or ``interpret=True``), else
    the CUDA device's name's file, else ``default`` (also for non-CUDA devices)."""
    if _INTERPRET if interpret is None else interpret:
        return INTERPRETER
    return _gpu_target(device)


@functools.lru_cache(maxsize=64)
def _gpu_target(device) -> str:
    device = torch.device("cuda") if device is None else torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT
    return _device_target(torch.cuda.get_device_name(device))


def _dtype_name(dtype) -> Optional[str]:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=4096)
def _select(op, target, width, dtype, rank_tile, mode, family) -> Mapping:
    if op not in OP_FIELDS:
        raise ConfigError(f"unknown op {op!r}; known ops: {sorted(OP_FIELDS)}")
    rows = load(target).get(op)
    path = CONFIG_DIR / f"{target}.json"
    if rows is None:
        raise ConfigError(f"{path}: ops.{op}: the file (or its base) has no rows for this op")
    for row in rows:
        if width is not None and width > row.get("max_width", math.inf):
            continue
        if "dtypes" in row and (dtype is None or dtype not in row["dtypes"]):
            continue
        if any(f in row and row[f] != v for f, v in (("rank_tile", rank_tile), ("mode", mode), ("family", family))):
            continue
        return MappingProxyType({f: row[f] for f in OP_FIELDS[op]})
    raise ConfigError(f"{path}: ops.{op}: no row for width={width}, dtype={dtype}, rank_tile={rank_tile}, "
                      f"mode={mode}, family={family} (add a row, e.g. one without max_width as the last)")


def block_config(op: str, *, width=None, dtype=None, rank_tile: Optional[int] = None, mode: Optional[str] = None,
                 family: Optional[str] = None, target: Optional[str] = None, device=None) -> Mapping:
    """The block sizes of ``op`` (a read-only mapping of the row's fields) for the call's keys, from the file of
    ``target`` (a file stem; default ``target_for(device)``). Raises ``ConfigError`` naming the file and op when
    the op is unknown, the file malformed, or no row matches."""
    if target is None:
        target = target_for(device)
    return _select(op, target, width, _dtype_name(dtype), rank_tile, mode, family)


def has_op(op: str, target: str) -> bool:
    """Whether ``target``'s file (or its base) has rows for ``op``."""
    return op in load(target)


def rows(op: str, target: str) -> list:
    """All rows of ``op`` in ``target``'s file (the dicts themselves, with match fields and notes)."""
    if op not in OP_FIELDS:
        raise ConfigError(f"unknown op {op!r}; known ops: {sorted(OP_FIELDS)}")
    ops = load(target)
    if op not in ops:
        raise ConfigError(f"{CONFIG_DIR / f'{target}.json'}: ops.{op}: the file (or its base) has no rows for this op")
    return ops[op]


@contextlib.contextmanager
def override(op: str, new_rows: list, target: Optional[str] = None):
    """Within the block, ``op`` of ``target`` (default: this process's GPU) takes ``new_rows`` (for sweeps:
    ``benchmarks/tune_kernels.py``); restored after."""
    target = target_for() if target is None else target
    ops = load(target)
    path = CONFIG_DIR / f"{target}.json"
    checked = [_check_row(path, op, i, dict(row)) for i, row in enumerate(new_rows)] if op in OP_FIELDS else None
    if checked is None:
        raise ConfigError(f"unknown op {op!r}; known ops: {sorted(OP_FIELDS)}")
    saved = ops.get(op)
    ops[op] = checked
    _select.cache_clear()
    try:
        yield
    finally:
        if saved is None:
            ops.pop(op, None)
        else:
            ops[op] = saved
        _select.cache_clear()


__all__ = ["CONFIG_DIR", "ConfigError", "OP_FIELDS", "block_config", "has_op", "load", "override", "rows",
           "target_for"]
