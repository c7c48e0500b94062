"""Timing, run metadata and the results file of the benchmarks (``run.py``, ``bench_kernels.py``, ``tune_kernels.py``).

Only the standard library at import time; torch and triton are imported inside the functions, so a script can set
``TRITON_INTERPRET`` before they load.

Results file (schema 2), one JSON object::

    {"schema": 2,
     "scenarios": {<scenario>: {"description": str,
                                "run": {gpu, device, commit, command, versions, date, machine, load, ...},
                                "rows": {<row key>: ROW}}}}

A row key is the provider's name, with ``[variant]`` appended for a scenario's other variants
(``fast_multilora[per_adapter_loss]``, ``fast_multilora_store_adamw[n=64/batch=8]``). ROW::

    {"provider", "variant", "status": "ok" | "error" | "skipped" | "not_implemented", "reason",
     "wall_ms": median wall time of one call (CUDA events on a GPU), "gpu_ms": summed kernel time of one call
     (profiler; null on a CPU), "host_ms": time until the call returns after a synchronize (median),
     "peak_mib": max_memory_allocated over the timed calls (null on a CPU), "iters", "fresh_process",
     "ratios": {"frozen": wall_ms / frozen's, "peft_single": ..., "peft_add_adapter": ..., "first_variant": ...},
     "extra": {...}}

Every row of one scenario comes from one run (``--merge`` replaces scenarios whole), so its ratios compare
measurements of the same machine and moment.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time

SCHEMA = 2
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STATUSES = ("ok", "error", "skipped", "not_implemented")
ROW_KEYS = ("provider", "variant", "status", "reason", "wall_ms", "gpu_ms", "host_ms", "peak_mib", "iters",
            "fresh_process", "ratios", "extra")


# -- run metadata -----------------------------------------------------------------------------------------------------

def git_commit(given: str | None = None) -> str:
    """``given`` if set, else ``git rev-parse --short=12 HEAD`` (+ ``-dirty`` with local changes), else ``unknown``."""
    if given:
        return given
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    """CPU model, core count and load average (host-bound rows follow the host's speed and load)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    load = [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "load_avg_1_5_15": load, "platform": platform.platform()}


def run_meta(device: str, commit: str | None = None, **extra) -> dict:
    """GPU name, library versions, commit, command, date and machine of this run."""
    import torch

    meta = {"device": device, "gpu": None, "commit": git_commit(commit),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "python": platform.python_version(), "torch": torch.__version__, "machine": machine()}
    if device == "cuda" and torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
    for name in ("triton", "peft", "transformers", "accelerate", "bitsandbytes"):
        try:
            meta[name] = __import__(name).__version__
        except Exception as e:  # a missing library is recorded, not fatal
            meta[name] = f"unavailable ({type(e).__name__})"
    meta.update(extra)
    return meta


# -- timing -----------------------------------------------------------------------------------------------------------

def _sync(device: str):
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def wall_s(fn, device: str) -> float:
    """Seconds of one call of ``fn``, device work included (compile + first call of a compiled provider)."""
    sync = _sync(device)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def host_ms(fn, n: int, device: str = "cuda") -> float:
    """Median ms until ``fn`` returns, over ``n`` calls each started after a synchronize: the host's own time of a
    call, not its wait for earlier work."""
    sync = _sync(device)
    times = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    sync()
    return statistics.median(times)


def kernel_ms(fn, reps: int = 1, warmup: bool = True) -> float:
    """ms per call of ``fn``: the summed device time of its kernels (torch profiler over ``reps`` calls, after one
    unprofiled call with ``warmup``). Not ``triton.testing.do_bench``: its CUDA events around a short launcher
    measure the host's launch time."""
    return kernel_profile(fn, reps, warmup)[0]


def kernel_profile(fn, reps: int = 1, warmup: bool = True, top: int = 0) -> tuple:
    """``(ms, kernels)``: :func:`kernel_ms`, and the ``top`` kernels by their summed time per call
    (:func:`top_kernels`)."""
    import torch

    if warmup:
        fn()
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    timed = [(e.name, e.device_time_total) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(us for _, us in timed) / reps / 1e3, top_kernels(timed, top, reps)


def top_kernels(timed, n: int, reps: int = 1) -> list:
    """``[[name, ms per call, launches per call], ...]``: the ``n`` kernels of ``timed`` (``(name, device us)`` per
    launch) with the most summed time, names cut to 80 characters -- where a row's GPU time goes, kept with the row."""
    by: dict = {}
    for name, us in timed:
        t, c = by.get(name, (0.0, 0))
        by[name] = (t + us, c + 1)
    ranked = sorted(by.items(), key=lambda kv: -kv[1][0])[:n]
    return [[name[:80], round(t / reps / 1e3, 3), round(c / reps, 2)] for name, (t, c) in ranked]


def host_profile(fn, reps: int, top: int, device: str = "cuda") -> list:
    """``[[function, ms per call, calls per call], ...]``: the ``top`` functions with the most own time (cProfile's
    ``tottime``, Python functions and the C functions they call) over ``reps`` calls of ``fn``, each started after
    a synchronize -- where a row's host time goes, kept with the row. Profiled calls run slower than plain ones:
    the shares, not the sums, are the measurement."""
    import cProfile
    import pstats

    sync = _sync(device)
    prof = cProfile.Profile()
    for _ in range(reps):
        sync()
        prof.enable()
        fn()
        prof.disable()
    sync()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [[_where(*key), round(tt / reps * 1e3, 4), round(nc / reps, 2)] for key, (_, nc, tt, _, _) in ranked]


def _where(file: str, line: int, name: str) -> str:
    """``file:line(name)`` with the file cut to what follows ``site-packages/`` or this repository's root."""
    for mark in ("site-packages/", "dist-packages/"):
        if mark in file:
            file = file.split(mark, 1)[1]
            break
    else:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
        file = file[len(root):] if file.startswith(root) else file
    return f"{name}" if file == "~" else f"{file}:{line}({name})"


def sync_points(fn, top: int) -> list:
    """``[[file:line, count], ...]``: the ``top`` Python lines where one call of ``fn`` made the host wait for the
    device (PyTorch's sync detector, ``torch.cuda.set_sync_debug_mode("warn")``: a blocking copy, ``.item()``, a
    ``nonzero`` ...), most first -- why a row's wall time may exceed its host and GPU times, kept with the row. A
    GPU row only: the detector watches CUDA streams."""
    by: dict = {}
    for w in sync_warnings(fn):
        where = _where(w.filename, w.lineno, "").removesuffix("()")
        by[where] = by.get(where, 0) + 1
    return [[where, n] for where, n in sorted(by.items(), key=lambda kv: -kv[1])[:top]]


def sync_warnings(fn) -> list:
    """The ``warnings.WarningMessage`` s of device->host synchronisations during ``fn()`` (PyTorch's detector; each
    names the Python line that synchronised); the detector is off again afterwards, ``fn`` raising or not. Also the
    GPU sync tests' (``tests/helpers.py``)."""
    import warnings

    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [w for w in caught if "synchroniz" in str(w.message)]


TOP_KERNELS = int(os.environ.get("FML_BENCH_TOP_KERNELS", "12"))  # kernels kept per GPU row (extra.top_kernels)
TOP_HOST = 12  # host functions kept per row timed by time_step (extra.top_host)
TOP_SYNCS = 8  # lines that synchronised kept per GPU row (extra.sync_points)


def time_step(fn, device: str, *, warm: int, iters: int, split: bool = True) -> dict:
    """One row's timings of ``fn`` (a whole step: forward, backward, optimizer), after ``warm`` warm-up calls.

    ``wall_ms``: median of ``iters`` calls timed by CUDA events (wall clock on a CPU); ``peak_mib``:
    ``max_memory_allocated`` over the timed calls (reset after the warm-up, so lazily created optimizer state counts
    as resident). With ``split`` on a GPU, ``gpu_ms`` (the kernels' summed time, one profiled call; its largest
    kernels go to the row's ``extra.top_kernels``) and ``host_ms``
    (median of 3 calls, each after a synchronize); a call whose wall time exceeds its GPU time leaves the GPU idle
    for the difference; the lines where one more call synchronised go to ``extra.sync_points``
    (:func:`sync_points`). On a CPU ``host_ms`` is the wall time and ``gpu_ms`` null.
    """
    import torch

    for _ in range(warm):
        fn()
    ts = []
    peak = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    out = {"wall_ms": statistics.median(ts), "gpu_ms": None, "host_ms": None, "peak_mib": peak, "iters": iters}
    if device == "cuda" and split:
        out["host_ms"] = host_ms(fn, 3, device)
        out["gpu_ms"], out["top_kernels"] = kernel_profile(fn, warmup=False, top=TOP_KERNELS)
        out["sync_points"] = sync_points(fn, TOP_SYNCS)
    elif device != "cuda":
        out["host_ms"] = out["wall_ms"]
    if split:
        out["top_host"] = host_profile(fn, 3, TOP_HOST, device)
    return out


def time_fresh(fn, setup, device: str, *, iters: int) -> dict:
    """Timings of ``fn(state)`` where each call needs fresh state (creating adapters changes the model): ``iters``
    calls, each on ``setup()``'s result (untimed), timed by the wall clock between synchronizes. ``wall_ms``: the
    median; ``peak_mib``: ``max_memory_allocated`` over the timed calls (setup's memory included, e.g. the model);
    no warm-up, no kernel/host split (the calls are host-bound and seconds long)."""
    import torch

    ts = []
    peak = 0.0
    for _ in range(iters):
        call = functools.partial(fn, setup())
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        ts.append(wall_s(call, device) * 1e3)
        if device == "cuda":
            peak = max(peak, torch.cuda.max_memory_allocated() / 2**20)
        del call  # the next setup builds its state with this one freed
    wall = statistics.median(ts)
    return {"wall_ms": wall, "gpu_ms": None, "host_ms": None if device == "cuda" else wall,
            "peak_mib": peak if device == "cuda" else None, "iters": iters}


def bench_op(fn, device: str, *, warmup_ms: int = 10, rep_ms: int = 40, cpu_reps: int = 3) -> dict:
    """Median and 20/80 % quantiles in ms of one op (``bench_kernels.py``). CUDA: ``triton.testing.do_bench`` (L2
    flushed before every timed call); CPU (dry runs): wall clock after one warm-up call."""
    if device == "cuda":
        import triton.testing

        q50, q20, q80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return {"ms": q50, "q20_ms": q20, "q80_ms": q80}
    fn()
    ts = []
    for _ in range(cpu_reps):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return {"ms": statistics.median(ts), "q20_ms": ts[0], "q80_ms": ts[-1]}


class Budget:
    """Wall-clock budget: ``allows(est_s)`` is False once starting work of ``est_s`` seconds would overrun it."""

    def __init__(self, seconds: float | None):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - self.elapsed()

    def allows(self, est_s: float = 0.0) -> bool:
        return self.seconds is None or self.elapsed() + est_s <= self.seconds


# -- results -----------------------------------------------------------------------------------------------------------

def row_key(provider: str, variant: str = "") -> str:
    return f"{provider}[{variant}]" if variant else provider


def make_row(provider: str, variant: str = "", status: str = "ok", reason: str | None = None, **fields) -> dict:
    """A row of the schema above; ``fields`` are timing keys (``wall_ms`` ...) or go to ``extra``."""
    if status not in STATUSES:
        raise ValueError(f"row status {status!r}; expected one of {STATUSES}")
    row = {"provider": provider, "variant": variant, "status": status, "reason": reason, "wall_ms": None,
           "gpu_ms": None, "host_ms": None, "peak_mib": None, "iters": None, "fresh_process": False, "ratios": {},
           "extra": {}}
    for k, v in fields.items():
        (row.__setitem__ if k in row and k != "extra" else row["extra"].__setitem__)(k, v)
    return row


RATIO_REFS = ("frozen", "frozen_compiled", "peft_single", "peft_add_adapter")  # every scenario's reference providers


def add_ratios(rows: dict, refs=RATIO_REFS) -> dict:
    """Each ok row's wall time over the reference providers' (same variant if that row exists, else their default
    variant) and over the same provider's first variant (variant sweeps such as adapter counts); in place."""
    first = {}
    for r in rows.values():
        if r["status"] == "ok":
            first.setdefault(r["provider"], r)
    for r in rows.values():
        r["ratios"] = {}
        if r["status"] != "ok" or not r["wall_ms"]:
            continue
        for ref in refs:
            base = rows.get(row_key(ref, r["variant"])) or rows.get(ref)
            if base is not None and base is not r and base["status"] == "ok" and base["wall_ms"]:
                r["ratios"][ref] = round(r["wall_ms"] / base["wall_ms"], 4)
        f = first.get(r["provider"])
        if f is not None and f is not r and f["variant"] != r["variant"]:
            r["ratios"]["first_variant"] = round(r["wall_ms"] / f["wall_ms"], 4)
    return rows


def check_results(res: dict) -> None:
    """Raise ``ValueError`` naming what does not follow the schema (what ``load_results`` accepts)."""
    if res.get("schema") != SCHEMA or not isinstance(res.get("scenarios"), dict):
        raise ValueError(f"results: expected {{'schema': {SCHEMA}, 'scenarios': {{...}}}}, got keys {sorted(res)}")
    for sc, rec in res["scenarios"].items():
        missing = {"description", "run", "rows"} - set(rec)
        if missing:
            raise ValueError(f"results: scenario {sc!r} lacks {sorted(missing)}")
        for key, row in rec["rows"].items():
            if set(row) != set(ROW_KEYS):
                raise ValueError(f"results: {sc}/{key} has keys {sorted(row)}, expected {sorted(ROW_KEYS)}")
            if row["status"] not in STATUSES or key != row_key(row["provider"], row["variant"]):
                raise ValueError(f"results: {sc}/{key}: status {row['status']!r}, provider {row['provider']!r}")
            if row["status"] == "ok" and not (row["wall_ms"] and row["wall_ms"] > 0):
                raise ValueError(f"results: {sc}/{key} is ok without a positive wall_ms")


def load_results(path: str) -> dict:
    """The results file at ``path`` (checked), or an empty one when there is none."""
    if not os.path.exists(path):
        return {"schema": SCHEMA, "scenarios": {}}
    with open(path) as f:
        res = json.load(f)
    check_results(res)
    return res


def write_json(path: str, obj) -> None:
    """Write atomically (a killed run leaves the previous complete file, never half of one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def fmt(v, digits: int = 1, scale: float = 1.0) -> str:
    """A number for a markdown cell, ``-`` for None."""
    if v is None:
        return "-"
    return f"{v * scale:.{digits}f}"
