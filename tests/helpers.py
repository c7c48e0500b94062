"""Shared test builders: random adapter banks, token layouts, and a per-token dense oracle."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from fast_multilora.kernels.segments import AdapterTable, segments_from_token_slots

# both backends of a test on CPU models: the Triton one runs its kernels under the interpreter, the CPU run's (a
# CUDA run skips it: its kernels are tested on GPU tensors there)
CPU_BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.interpreter)]

def compile_for_sm90(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``script`` (Python that compiles kernels for an sm_90 target: no GPU needed) in a subprocess without the
    Triton interpreter, ``benchmarks/`` on its path (``from tune_kernels import sm90_kernel, sass_loop``); skips
    where the Triton wheel has no bundled ``ptxas``."""
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton wheel without the bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (bench, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def sync_warnings(fn) -> list:
    """The ``warnings.WarningMessage`` s of device->host synchronisations during ``fn()`` (PyTorch's own detector,
    ``torch.cuda.set_sync_debug_mode("warn")``; CUDA only): each names the Python line that synchronised. The
    benchmark harness's (``benchmarks/harness.py``, whose rows record them as ``extra.sync_points``)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    try:
        import harness
    finally:
        sys.path.pop(0)
    return harness.sync_warnings(fn)


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


DEVICE = os.environ.get("FML_TEST_DEVICE", "cpu")
# The Triton interpreter multiplies raw bits for bfloat16 tl.dot (triton-lang/triton#11584), so bf16 runs on GPU only.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
KERNEL_DTYPE_PARAMS = [pytest.param(dt, id=DTYPE_IDS[dt]) for dt in KERNEL_DTYPES]

# The kernels' error budget per activation dtype, times the reference's largest magnitude (kernel tests) or times the
# reference op on absolute values, a bound of the terms' magnitudes (tests/kernels/test_fuzz.py, test_large_index.py).
TOL = {
    torch.float64: 1e-12,  # fp64 everywhere: only summation order differs
    torch.float32: 2e-5,  # ieee fp32 dots: only summation order differs (~K * 2^-24 worst case for K <= 2049)
    torch.float16: 4e-3,  # one fp16 rounding (2^-11) of h / dh / fp32 weights before each dot, fp32 accumulate
    torch.bfloat16: 3e-2,  # one bf16 rounding (2^-8) of h / dh / fp32 weights before each dot, fp32 accumulate
}


def assert_close_max(got, want, dtype, what):
    """``max|got - want| <= TOL[dtype] * max|want|``, every entry of ``got`` finite (a NaN-poisoned entry nobody wrote
    fails); prints the error and the bound."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} non-finite (unwritten?) entries"
    err = (got.double() - want.double()).abs().max().item()
    scale = max(want.double().abs().max().item(), 1e-6)
    assert err <= TOL[dtype] * scale, f"{what}: max err {err:.3e} > tol {TOL[dtype]:.1e} * max|ref| {scale:.3e}"


def assert_close_bound(got, want, bound, tol, what, resolution=0.0, detail=""):
    """``|got - want| <= tol * bound + resolution`` elementwise, ``bound`` the reference op on absolute values (the
    sum of the terms' magnitudes): a rounding-error bound that holds under cancellation, where one relative to
    ``max|want|`` does not. ``resolution``: what storing in ``got``'s dtype may round away (subnormal spacing)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} non-finite entries; {detail}"
    err = (got.double() - want.double()).abs()
    excess = err - (tol * bound.double() + resolution)
    if (excess > 0).any():
        i = int(excess.argmax())
        raise AssertionError(f"{what}: {int((excess > 0).sum())} entries off, worst err {err.reshape(-1)[i]:.3e} > "
                             f"{tol:.0e} * bound {bound.reshape(-1)[i]:.3e} + {resolution:.1e} at flat index {i}; "
                             f"{detail}")


def assert_close_lowp(got, want64, lowp_baseline, dtype, what):
    """The forward kernels' rule against an fp64 reference ``want64``: fp32 (fp64) within rtol 1e-5 (1e-12) and the
    same times max|ref|; fp16 / bf16 (flash-attention's rule) at most twice the error of torch's own low-precision
    computation ``lowp_baseline``, plus 1e-6 of max|ref| so an exact baseline cannot make the bound zero."""
    scale = want64.abs().max().item() if want64.numel() else 0.0
    if dtype in (torch.float32, torch.float64):
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got.double(), want64, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")
        return
    err = (got.double() - want64).abs().max().item() if got.numel() else 0.0
    base = (lowp_baseline.double() - want64).abs().max().item() if got.numel() else 0.0
    assert err <= 2 * base + 1e-6 * scale, f"{what}: kernel error {err:.3e} > 2 x torch {dtype} error {base:.3e}"


def poisoned(*shape, dtype=torch.float32, device="cpu"):
    """An output buffer full of NaN, so rows or columns a kernel fails to write fail the test."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_same_saved_adapters(folder, ref_folder, names) -> None:
    """Two ``save_pretrained`` folders hold the same adapter files: per adapter the same keys, tensors equal bit for
    bit (an adapter named ``default`` sits at the folder's root, as PEFT saves it)."""
    from safetensors.torch import load_file

    for a in names:
        sub = "" if a == "default" else a
        f1 = load_file(os.path.join(folder, sub, "adapter_model.safetensors"))
        f2 = load_file(os.path.join(ref_folder, sub, "adapter_model.safetensors"))
        assert f1.keys() == f2.keys(), a
        for key in f1:
            assert torch.equal(f1[key], f2[key]), (a, key)
