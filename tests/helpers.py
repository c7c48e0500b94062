"""Shared test builders: random adapter banks, token layouts, and a per-token dense oracle."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from fast_multilora.kernels.segments import AdapterTable, segments_from_token_slots


def compile_for_sm90(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``script`` (Python that compiles kernels for an sm_90 target: no GPU needed) in a subprocess without the
    Triton interpreter; skips where the Triton wheel has no bundled ``ptxas``."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton wheel without the bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def sync_warnings(fn) -> list:
    """The ``warnings.WarningMessage`` s of device->host synchronisations during ``fn()`` (PyTorch's own detector,
    ``torch.cuda.set_sync_debug_mode("warn")``; CUDA only): each names the Python line that synchronised."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [w for w in caught if "synchroniz" in str(w.message)]


def make_table(ranks, scales=None, dropout=None, device="cpu") -> AdapterTable:
    ranks_t = torch.tensor(ranks, dtype=torch.int32)
    offsets = torch.cumsum(ranks_t, 0) - ranks_t
    n = len(ranks)
    scales = torch.tensor(scales if scales is not None else [1.0 + 0.25 * i for i in range(n)], dtype=torch.float32)
    dropout = torch.tensor(dropout if dropout is not None else [0.0] * n, dtype=torch.float32)
    return AdapterTable(
        ranks=ranks_t.to(device), offsets=offsets.to(torch.int32).to(device), scales=scales.to(device),
        dropout=dropout.to(device), max_rank=max(ranks) if ranks else 0, total_rank=int(sum(ranks)),
        has_dropout=bool((dropout > 0).any()),
    )


def random_token_slots(S, n_slots, gen, base_frac=0.1, layout="random"):
    """Per-token slots: 'random' (interleaved), 'runs' (contiguous random-length runs), 'skewed' (90% one slot)."""
    if layout == "runs":
        out, t = [], 0
        while t < S:
            n = int(torch.randint(1, max(2, S // 4), (1,), generator=gen))
            s = int(torch.randint(-1, n_slots, (1,), generator=gen))
            out += [s] * n
            t += n
        return torch.tensor(out[:S])
    if layout == "skewed":
        big = int(torch.randint(0, n_slots, (1,), generator=gen))
        ts = torch.full((S,), big)
        other = torch.rand(S, generator=gen) < 0.1
        ts[other] = torch.randint(-1, n_slots, (int(other.sum()),), generator=gen)
        return ts
    ts = torch.randint(0, n_slots, (S,), generator=gen)
    ts[torch.rand(S, generator=gen) < base_frac] = -1
    return ts


def make_segments(token_slots, grouped, device="cpu"):
    return segments_from_token_slots(token_slots, grouped=grouped, device=device)


def dense_lora(x, token_slots, As, Bs, scales, keep=None, ps=None):
    """Per-token oracle from per-adapter weight lists (no concatenation, no segments): returns the LoRA delta."""
    out = torch.zeros(x.shape[0], Bs[0].shape[0] if Bs else 0, dtype=torch.float64)
    for t in range(x.shape[0]):
        a = int(token_slots[t])
        if a < 0 or As[a].shape[0] == 0:
            continue
        xt = x[t].double()
        if keep is not None and ps[a] > 0:
            xt = xt * keep[t].double() / (1 - ps[a])
        out[t] = scales[a] * (xt @ As[a].double().T) @ Bs[a].double().T
    return out


DEVICE = __import__("os").environ.get("FML_TEST_DEVICE", "cpu")
# The Triton interpreter multiplies raw bits for bfloat16 tl.dot (triton-lang/triton#11584), so bf16 runs on GPU only.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def poisoned(*shape, dtype=torch.float32, device="cpu"):
    """An output buffer full of NaN, so rows or columns a kernel fails to write fail the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)
