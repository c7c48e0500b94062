"""Property-based fuzzing of the Triton launchers against the pure-PyTorch reference (hypothesis).

Each example draws a problem -- tokens S (0..96), K and N (1..130), adapters (1..128) with ranks 0..256 (0 = the
adapter is absent from the layer), a segment layout (empty, one token, one giant segment, unsorted runs, interleaved
tokens, base runs, all base, runs split into several segments, a shuffled permutation), the family (SGEMM / chunked
SGMV), dropout on/off with a seed, the dtype (fp32/fp16 on CPU, + bf16 on GPU), weights in the activation dtype or
fp32, stack_num 1..3 with a slice -- and checks:

* forward: ``lora_shrink`` (NaN-poisoned ``out``: cells the contract leaves undefined stay NaN) and ``lora_expand``
  (rows without a live adapter stay NaN; don't-care ``h`` cells are NaN and must not be read);
* backward (``lora_expand_bwd``, ``lora_shrink_bwd``): poisoned ``dh``/``dB_out``/``dx_out``/``dA_out``, NaN in the
  rows and cells the kernels must not read; ``dx`` rows of base tokens exactly zero, ``dA``/``dB`` of adapters
  without tokens exactly zero.

Input rows of tokens without a live adapter are NaN everywhere, so a kernel that reads another segment's rows fails.

CPU (Triton interpreter): examples are bounded by a cost model of the interpreter's programs (``_COST_LIMIT``), so the
whole file runs in about two minutes on 2 cores; ``derandomize=True`` makes the examples the same on every run.
GPU: ``FML_TEST_DEVICE=cuda pytest -m gpu tests/test_fuzz.py`` runs the ``*_gpu`` sweeps with larger shapes (S up to
4096, K and N from a fixed list up to 4096 so compiled kernel variants are reused) and ``FML_FUZZ_EXAMPLES`` examples
each (default 200; mostly kernel compilation, several minutes). ``FML_FUZZ_CPU_EXAMPLES`` (default 100; the forward
test runs twice as many) scales the CPU profile.
"""

import os

import pytest
import torch
from fast_multilora.kernels import lora_expand, lora_shrink
from fast_multilora.kernels.dropout import dropout_keep_mask
from fast_multilora.kernels.segments import AdapterTable, Segments, segments_from_token_slots
from helpers import DEVICE, KERNEL_DTYPES, poisoned
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fast_multilora import kernels
from fast_multilora import reference as ref

HAS_BWD = hasattr(kernels, "lora_expand_bwd") and hasattr(kernels, "lora_shrink_bwd")
needs_bwd = pytest.mark.skipif(not HAS_BWD, reason="kernels/backward.py launchers not exported")

CPU_EXAMPLES = int(os.environ.get("FML_FUZZ_CPU_EXAMPLES", "100"))
GPU_EXAMPLES = int(os.environ.get("FML_FUZZ_EXAMPLES", "200"))
_COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
CPU = settings(max_examples=CPU_EXAMPLES, **_COMMON)
CPU_FWD = settings(max_examples=2 * CPU_EXAMPLES, **_COMMON)  # the forward is cheap: twice the examples
GPU = settings(max_examples=GPU_EXAMPLES, **_COMMON)

# Max error relative to the reference's largest magnitude (same budget as tests/test_kernels_backward.py).
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LAYOUTS = ["empty", "one_token", "giant", "unsorted", "interleaved", "base_runs", "all_base", "split_runs"]
# The interpreter runs a Python loop per program and per tile step: keep one example's work near a second.
_COST_LIMIT = 1500


# --- problem generation ---------------------------------------------------------------------------------------------


def _token_slots(layout, S, n, gen):
    """Per-token slots (-1 = base) for a layout; runs are lists of (slot, length) for the split-run SGEMM layout."""
    if layout in ("empty", "one_token") or S <= 1:
        return torch.randint(-1, n, (S,), generator=gen)
    if layout == "giant":
        return torch.full((S,), int(torch.randint(0, n, (1,), generator=gen)))
    if layout == "interleaved":
        ts = torch.randint(0, n, (S,), generator=gen)
        ts[torch.rand(S, generator=gen) < 0.15] = -1
        return ts
    if layout == "all_base":
        return torch.full((S,), -1)
    out = []
    while len(out) < S:  # unsorted runs; base_runs: every other run is a long base run
        if layout == "base_runs" and len(out) % 2 == 0:
            out += [-1] * int(torch.randint(1, max(2, S // 2), (1,), generator=gen))
        out += [int(torch.randint(0, n, (1,), generator=gen))] * int(torch.randint(1, max(2, S // 3), (1,),
                                                                                    generator=gen))
    return torch.tensor(out[:S])


def _split_runs(ts, gen, device):
    """SGEMM segments whose runs are cut at random points (adjacent segments of one slot, as separate samples)."""
    S = ts.numel()
    if S == 0:
        return segments_from_token_slots(ts, grouped=False, device=device)
    cut = torch.ones(S, dtype=torch.bool)
    cut[1:] = (ts[1:] != ts[:-1]) | (torch.rand(S - 1, generator=gen) < 0.3)
    starts = torch.nonzero(cut).reshape(-1)
    indptr = torch.cat([starts, torch.tensor([S])])
    slot = ts[starts]
    lens = indptr[1:] - indptr[:-1]
    live = slot >= 0
    return Segments(indptr=indptr.to(torch.int32).to(device), slot=slot.to(torch.int32).to(device), perm=None,
                    max_len=int(lens[live].max()) if bool(live.any()) else 0, num_tokens=S, cache={})


def _shuffled_chunked(ts, gen, device):
    """Chunked segments with the slots in a random order and each slot's rows in a random order."""
    used = ts[ts >= 0].unique()
    used = used[torch.randperm(used.numel(), generator=gen)]
    perm, indptr = [], [0]
    for a in used.tolist():
        rows = torch.nonzero(ts == a).reshape(-1)
        perm.append(rows[torch.randperm(rows.numel(), generator=gen)])
        indptr.append(indptr[-1] + rows.numel())
    perm = torch.cat(perm) if perm else torch.zeros(0, dtype=torch.long)
    lens = torch.tensor(indptr[1:]) - torch.tensor(indptr[:-1])
    return Segments(indptr=torch.tensor(indptr, dtype=torch.int32).to(device),
                    slot=used.to(torch.int32).to(device), perm=perm.to(torch.int32).to(device),
                    max_len=int(lens.max()) if lens.numel() else 0, num_tokens=ts.numel(), cache={})


def _segments(ts, family, gen, device):
    if family == "sgemm":
        return segments_from_token_slots(ts, grouped=False, device=device)
    if family == "chunked":
        return segments_from_token_slots(ts, grouped=True, device=device)
    if family == "sgemm_split":
        return _split_runs(ts, gen, device)
    return _shuffled_chunked(ts, gen, device)


def _table(ranks, ps, device):
    r = torch.tensor(ranks, dtype=torch.int32)
    n = len(ranks)
    scales = torch.linspace(0.5, 2.0, n) if n > 1 else torch.ones(1)
    p = torch.tensor(ps, dtype=torch.float32)
    return AdapterTable(ranks=r.to(device), offsets=(torch.cumsum(r, 0) - r).to(torch.int32).to(device),
                        scales=scales.to(device), dropout=p.to(device), max_rank=max(ranks), total_rank=sum(ranks),
                        has_dropout=bool((p > 0).any()))


def _cost(ts, ranks, K, N, stack, backward=True):
    """Interpreter work of the four launchers in programs (~0.5-1 ms each on CPU, even when one exits at once):
    grids of 16-row blocks (plus one spare chunk per slot in the backward) x 32-wide K / N / rank tiles, and the
    backward finish passes over every slot."""
    S, n = ts.numel(), len(ranks)
    if S == 0:
        return 0
    runs = 1 + int((ts[1:] != ts[:-1]).sum()) if S > 1 else 1
    blocks = runs + S // 16 + 1
    c = lambda v, b: -(-v // b)
    tk, tn, tr = c(K, 32), c(N, 32), c(stack * max(ranks), 32)
    fwd = blocks * (tr * tk + c(N, 512) * c(max(ranks), 16))
    bwd = (blocks + n) * (tn + tk * tr) + n * (c(N, 64) + tr * tk)
    return fwd + bwd if backward else fwd


def _fit(ts, ranks, K, N, stack, limit, backward):
    """Shrink an example until the interpreter can run it in about a second: fewer tokens, narrower K / N, a
    smaller largest rank, fewer adapters (tokens of dropped adapters are remapped), in turn."""
    step = 0
    while _cost(ts, ranks, K, N, stack, backward) > limit:
        what = step % 5
        step += 1
        if what == 0 and ts.numel() > 16:
            ts = ts[: ts.numel() // 2]
        elif what == 1 and K > 8:
            K //= 2
        elif what == 2 and N > 8:
            N //= 2
        elif what == 3 and max(ranks) > 8:
            big = max(ranks)
            ranks = [r if r != big else big // 2 for r in ranks]
        elif what == 4 and len(ranks) > 2:
            ranks = ranks[: len(ranks) // 2]
            ts = torch.where(ts >= len(ranks), ts % len(ranks), ts)
        elif step > 50:
            break
    return ts, ranks, K, N


@st.composite
def problems(draw, max_S=96, max_KN=130, max_adapters=128, max_rank=256, cost_limit=_COST_LIMIT, backward=True,
             kn_values=None):
    dtype = draw(st.sampled_from(KERNEL_DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    family = draw(st.sampled_from(["sgemm", "chunked", "sgemm_split", "chunked_shuffled"]))
    # sizes: a class drawn by hypothesis (so every class shows up), the value uniform within it from the seed
    # (hypothesis' integers lean hard towards small values)
    n_cls = draw(st.sampled_from(["one", "few", "many"]))
    S_cls = draw(st.sampled_from(["short", "long"]))
    r_cls = draw(st.sampled_from(["narrow", "wide"]))  # one adapter's rank; the others small, as in most layers
    stack = draw(st.integers(1, 3))
    slice_idx = draw(st.integers(0, stack - 1))
    dims = st.sampled_from(kn_values) if kn_values else st.integers(1, max_KN)  # GPU: few values, few compiles
    K = draw(dims)
    N = draw(dims)
    absent = draw(st.floats(0.0, 0.5))  # fraction of adapters absent from the layer (rank 0)
    dropout = draw(st.booleans())
    weights_fp32 = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 2))
    gen = torch.Generator().manual_seed(seed)
    uniform = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))
    n = {"one": 1, "few": uniform(2, 8), "many": uniform(9, max_adapters)}[n_cls]
    S = {"empty": 0, "one_token": 1}.get(layout, uniform(2, 16) if S_cls == "short" else uniform(17, max_S))
    big = uniform(1, 32) if r_cls == "narrow" else uniform(33, max_rank)
    small = uniform(1, min(16, big))
    ranks = torch.randint(1, small + 1, (n,), generator=gen)
    ranks[torch.rand(n, generator=gen) < absent] = 0
    ranks[int(torch.randint(0, n, (1,), generator=gen))] = big
    ranks = ranks.tolist()
    ts = _token_slots(layout, S, n, gen)
    ts, ranks, K, N = _fit(ts, ranks, K, N, stack, cost_limit, backward)
    n = len(ranks)
    ps = (torch.rand(n, generator=gen) * 0.6).tolist() if dropout else [0.0] * n
    return dict(dtype=dtype, layout=layout, family=family, ranks=ranks, stack=stack, slice_idx=slice_idx, K=K, N=N,
                ts=ts, ps=ps, dropout=dropout, weights_fp32=weights_fp32, seed=seed)


def _build(p, device):
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    ts, ranks, stack, K, N, dtype = p["ts"], p["ranks"], p["stack"], p["K"], p["N"], p["dtype"]
    S, R, R_tot = ts.numel(), max(ranks), sum(ranks)
    segs = _segments(ts, p["family"], gen, device)
    table = _table(ranks, p["ps"], device)
    r_tok = torch.tensor([ranks[a] if a >= 0 else 0 for a in ts.tolist()], dtype=torch.long)
    live = r_tok > 0  # rows a LoRA delta touches
    defined = torch.arange(stack * R)[None, :] < (stack * r_tok)[:, None]  # h / dh cells of the contract
    slice_cols = (torch.arange(stack * R)[None, :] >= p["slice_idx"] * r_tok[:, None]) & (
        torch.arange(stack * R)[None, :] < (p["slice_idx"] + 1) * r_tok[:, None])
    wdt = torch.float32 if p["weights_fp32"] else dtype

    def act(cols):
        t = torch.randn(S, cols, generator=gen)
        t[~live] = float("nan")  # rows no kernel may read
        return t.to(device, dtype)

    def cells(mask):
        t = torch.where(mask, torch.randn(mask.shape, generator=gen), torch.full(mask.shape, float("nan")))
        return t.to(device, torch.float32)

    seed = p["seed"] if p["dropout"] else None
    keep = dropout_keep_mask(seed, segs, table, K, p["stack"]) if seed is not None else None  # a mask per slice
    return dict(
        S=S, segs=segs, table=table, live=live.to(device), defined=defined.to(device), slice_cols=slice_cols.to(device),
        x=act(K), dy=act(N), y0=act(N),
        A=(torch.randn(stack * R_tot, K, generator=gen) / max(K, 1) ** 0.5).to(device, wdt),
        B=(torch.randn(N, R_tot, generator=gen) / 4).to(device, wdt),
        h=cells(defined), dh=cells(defined), seed=seed, keep=keep, r_tok=r_tok,
    )


def _close(got, want, bound, dtype, what, p):
    """``|got - want| <= TOL * bound`` elementwise, ``bound`` the same reference op on absolute values (the sum of
    the magnitudes of the terms): a rounding-error bound that holds under cancellation, where a bound relative to
    ``max|want|`` does not."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.numel() == 0:
        return
    assert torch.isfinite(got).all(), f"{what}: {int((~torch.isfinite(got)).sum())} non-finite entries; {_desc(p)}"
    err = (got.double() - want.double()).abs()
    excess = err - TOL[dtype] * bound.double()
    if (excess > 0).any():
        i = int(excess.argmax())
        raise AssertionError(f"{what}: err {err.reshape(-1)[i]:.3e} > {TOL[dtype]:.0e} * bound "
                             f"{bound.reshape(-1)[i]:.3e} at flat index {i}; {_desc(p)}")


def _desc(p):
    q = {k: v for k, v in p.items() if k not in ("ts", "ranks", "ps")}
    return f"{q} S={p['ts'].numel()} ranks[:8]={p['ranks'][:8]} n={len(p['ranks'])}"


def _events(p):
    event(f"layout={p['layout']} family={p['family']} dtype={p['dtype']}")
    event(f"S bucket={min(p['ts'].numel() // 16, 6) * 16} adapters bucket={len(p['ranks']) // 32 * 32}")
    event(f"max rank bucket={max(p['ranks']) // 64 * 64} stack={p['stack']} dropout={p['dropout']}")


def _ref64(fn, *tensors, **kw):
    """The reference op in float64 on the inputs (NaN don't-care cells as 0) and on their absolute values."""
    t64 = [torch.nan_to_num(t.to(torch.float64)) if torch.is_tensor(t) else t for t in tensors]
    a64 = [t.abs() if torch.is_tensor(t) else t for t in t64]
    return fn(*t64, **kw), fn(*a64, **kw)


# --- properties ------------------------------------------------------------------------------------------------------


def check_forward(p, device):
    _events(p)
    d = _build(p, device)
    stack, dtype, S, sl = p["stack"], p["dtype"], d["S"], p["slice_idx"]
    segs, table, defined, live = d["segs"], d["table"], d["defined"], d["live"]
    h = lora_shrink(d["x"], d["A"], segs, table, stack_num=stack, seed=d["seed"],
                    out=poisoned(S, stack * max(p["ranks"]), device=device))
    assert torch.isnan(h[~defined]).all(), f"shrink wrote cells it does not own; {_desc(p)}"
    want, bound = _ref64(lambda x, A: ref.lora_shrink(x, A, segs, table, stack_num=stack, keep=d["keep"]),
                         d["x"], d["A"])
    _close(h[defined], want[defined], bound[defined], dtype, "shrink h", p)

    y = lora_expand(d["h"], d["B"], segs, table, d["y0"].clone(), stack_num=stack, slice_idx=sl)
    assert torch.isnan(y[~live]).all(), f"expand wrote rows without a live adapter; {_desc(p)}"
    want, bound = _ref64(lambda h, B, y: ref.lora_expand(h, B, segs, table, y, stack_num=stack, slice_idx=sl),
                         d["h"], d["B"], d["y0"])
    _close(y[live], want[live], bound[live], dtype, "expand y", p)


def check_backward(p, device):
    _events(p)
    d = _build(p, device)
    stack, dtype, S, K, N, sl = p["stack"], p["dtype"], d["S"], p["K"], p["N"], p["slice_idx"]
    segs, table, live = d["segs"], d["table"], d["live"]
    R, R_tot = max(p["ranks"]), sum(p["ranks"])
    slot_has_tokens = torch.zeros(len(p["ranks"]), dtype=torch.bool)
    slot_has_tokens[p["ts"][p["ts"] >= 0].unique()] = True
    offs = torch.tensor([0] + p["ranks"]).cumsum(0).tolist()

    # expand backward: dh (this slice's cells of live rows written, the rest untouched) and dB (every cell)
    dh = poisoned(S, stack * R, device=device)
    dB = poisoned(N, R_tot, device=device)
    out_dh, out_dB = kernels.lora_expand_bwd(d["dy"], d["h"], d["B"], segs, table, stack_num=stack, slice_idx=sl,
                                             dh=dh, dB_out=dB)
    assert out_dh is dh and out_dB is dB
    (want_dh, want_dB), (bound_dh, bound_dB) = _ref64(
        lambda dy, h, B: ref.lora_expand_bwd(dy, h, B, segs, table, stack_num=stack, slice_idx=sl),
        d["dy"], d["h"], d["B"])
    written = d["slice_cols"]
    assert torch.isnan(dh[~written]).all(), f"expand_bwd wrote dh cells outside this slice's live cells; {_desc(p)}"
    _close(dh[written], want_dh[written], bound_dh[written], dtype, "expand_bwd dh", p)
    _close(dB, want_dB, bound_dB, dtype, "expand_bwd dB", p)
    for a in torch.nonzero(~slot_has_tokens).reshape(-1).tolist():
        assert torch.count_nonzero(dB[:, offs[a] : offs[a + 1]]) == 0, f"dB of slot {a} without tokens; {_desc(p)}"

    # shrink backward: dx (every row; zero for rows without a live adapter) and dA (every row)
    need_dx = p["seed"] % 4 != 0
    dx = poisoned(S, K, dtype=dtype, device=device) if need_dx else None
    dA = poisoned(stack * R_tot, K, device=device)
    out_dx, out_dA = kernels.lora_shrink_bwd(d["dh"], d["x"], d["A"], segs, table, stack_num=stack, seed=d["seed"],
                                             need_dx=need_dx, dx_out=dx, dA_out=dA)
    assert out_dA is dA and out_dx is dx
    (want_dx, want_dA), (bound_dx, bound_dA) = _ref64(
        lambda dh, x, A: ref.lora_shrink_bwd(dh, x, A, segs, table, stack_num=stack, keep=d["keep"],
                                             need_dx=need_dx),
        d["dh"], d["x"], d["A"])
    _close(dA, want_dA, bound_dA, dtype, "shrink_bwd dA", p)
    for a in torch.nonzero(~slot_has_tokens).reshape(-1).tolist():
        rows = slice(stack * offs[a], stack * offs[a + 1])
        assert torch.count_nonzero(dA[rows]) == 0, f"dA of slot {a} without tokens; {_desc(p)}"
    if need_dx:
        assert torch.count_nonzero(dx[~live]) == 0, f"dx rows without a live adapter not zero; {_desc(p)}"
        _close(dx[live], want_dx[live], bound_dx[live], dtype, "shrink_bwd dx", p)


@CPU_FWD
@given(p=problems(backward=False))
def test_fuzz_forward(p):
    check_forward(p, DEVICE)


@needs_bwd
@CPU
@given(p=problems())
def test_fuzz_backward(p):
    check_backward(p, DEVICE)


# --- GPU sweeps (FML_TEST_DEVICE=cuda; FML_FUZZ_EXAMPLES examples each) -------------------------------------------

_GPU_SHAPES = dict(max_S=4096, max_adapters=128, max_rank=256, cost_limit=10**9,
                   kn_values=[1, 7, 64, 100, 128, 129, 1000, 2048, 2049, 4096])


@pytest.mark.gpu
@GPU
@given(p=problems(**_GPU_SHAPES))
def test_fuzz_forward_gpu(p):
    check_forward(p, "cuda")


@pytest.mark.gpu
@needs_bwd
@GPU
@given(p=problems(**_GPU_SHAPES))
def test_fuzz_backward_gpu(p):
    check_backward(p, "cuda")
