"""Shared helpers of the benchmark scripts: timing, run metadata, time budget, result files.

Imported by ``bench_kernels.py`` and ``bench_model.py`` (both put ``benchmarks/`` first on ``sys.path`` by being run
as scripts). Only the standard library at import time; torch and triton are imported inside the functions, so a
script can set ``TRITON_INTERPRET`` before they load.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time


def git_commit(given: str | None = None) -> str:
    """``given`` if set, else ``git rev-parse HEAD`` (+ ``-dirty`` with local changes), else ``"unknown"``."""
    if given:
        return given
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_meta(device: str, commit: str | None = None, **extra) -> dict:
    """GPU name, library versions, commit and date of this run."""
    import torch

    meta = {"device": device, "gpu": None, "commit": git_commit(commit),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
            "python": platform.python_version(), "torch": torch.__version__}
    if device == "cuda" and torch.cuda.is_available():
        meta["gpu"] = torch.cuda.get_device_name()
        meta["cuda"] = torch.version.cuda
    for name in ("triton", "peft", "transformers", "accelerate"):
        try:
            meta[name] = __import__(name).__version__
        except Exception as e:  # a missing library is recorded, not fatal
            meta[name] = f"unavailable ({type(e).__name__})"
    meta.update(extra)
    return meta


def bench_op(fn, device: str, *, warmup_ms: int = 10, rep_ms: int = 40, cpu_reps: int = 3) -> dict:
    """Median and 20/80 % quantiles in ms of ``fn()``.

    CUDA: ``triton.testing.do_bench`` (L2 flushed before every timed call, CUDA events). CPU (dry runs): wall clock
    with ``time.perf_counter`` after one warm-up call; the numbers only show that the code runs.
    """
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


def time_steps(fn, device: str, *, warm: int, iters: int) -> dict:
    """Median of CUDA-event timings of ``fn()`` after ``warm`` warm-up calls, and the peak memory of the timed calls.

    Peak: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (taken after the warm-up, so lazily
    created state such as optimizer moments is already counted as resident). On CPU: wall clock, no peak.
    """
    import torch

    for _ in range(warm):
        fn()
    ts = []
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(iters):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
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
        peak = None
    return {"ms": statistics.median(ts), "peak_mib": peak, "min_ms": min(ts), "iters": iters}


def host_ms(fn, n: int) -> float:
    """Median host ms until ``fn`` returns, over ``n`` calls each started after a ``torch.cuda.synchronize()`` (the
    time the host spends on a call, not waiting for earlier work; without CUDA, wall clock)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
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
    import torch

    if warmup:
        fn()
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return us / reps / 1e3


def split_call(fn, device: str) -> dict:
    """One more call of ``fn`` split into its parts (CUDA only; ``{}`` elsewhere): ``gpu_ms``, the summed device time
    of its kernels (torch profiler, one profiled call), and ``host_ms``, the time until ``fn`` returns (the median of
    5 unprofiled calls, each after a synchronize). A call whose ``ms`` exceeds its ``gpu_ms`` leaves the GPU idle for
    the difference (host-side work, launch latency)."""
    if device != "cuda":
        return {}
    host = host_ms(fn, 5)
    return {"gpu_ms": kernel_ms(fn, warmup=False), "host_ms": host}


def write_json(path: str, obj) -> None:
    """Write atomically (a killed run leaves the previous complete file, never half of one)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Budget:
    """Wall-clock budget: ``allows(est_s)`` is False once starting work of ``est_s`` seconds would overrun it."""

    def __init__(self, seconds: float | None):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def allows(self, est_s: float = 0.0) -> bool:
        return self.seconds is None or self.elapsed() + est_s <= self.seconds


def fmt(v, digits: int = 1, scale: float = 1.0) -> str:
    """A number for a markdown cell, ``-`` for None."""
    if v is None:
        return "-"
    return f"{v * scale:.{digits}f}"
