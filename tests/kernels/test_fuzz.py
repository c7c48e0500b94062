"""Property-based fuzzing of the Triton launchers against the pure-PyTorch reference (hypothesis).

Each example draws a problem -- tokens S (0..96), K and N (1..130), adapters (1..128) with ranks 0..256 (0 = the
adapter is absent from the layer), a segment layout (empty, one token, one giant segment, unsorted runs, interleaved
tokens, base runs, all base, runs split into several segments, a shuffled permutation, packed rows' long base run:
``16 j + 1`` base tokens among shorter adapter runs), the family (SGEMM / chunked SGMV), dropout on/off with a seed,
the dtype (fp32/fp16 on CPU, + bf16 on GPU), weights in the activation dtype or fp32, stack_num 1..3 with a slice --
and checks:

* forward: ``lora_shrink`` (NaN-poisoned ``out``: cells the contract leaves undefined stay NaN) and ``lora_expand``
  (rows without a live adapter stay NaN; don't-care ``h`` cells are NaN and must not be read);
* backward (``lora_expand_bwd``, ``lora_shrink_bwd``): poisoned ``dh``/``dB_out``/``dx_out``/``dA_out``, NaN in the
  rows and cells the kernels must not read; ``dx`` rows of base tokens exactly zero, ``dA``/``dB`` of adapters
  without tokens exactly zero.

Input rows of tokens without a live adapter are NaN everywhere, so a kernel that reads another segment's rows fails.

``test_fuzz_shrink_expand`` (and its ``_gpu`` sweep) draws the same problems at most ``DECODE_MAX_ROWS`` tokens long,
one slice, no dropout, weights in place or concatenated, for the one-launch decode kernel (``lora_shrink_expand``):
rows without a live adapter stay NaN, live rows against the fp64 reference.

The ``*_paths`` tests draw the same problems (mostly one slice and with dropout) plus the launchers' other call forms:

* forward: weights read in place (``slot_weights`` -> ``SlotWeights`` for A and B, each weight a view of one
  NaN-filled buffer in a random order with gaps; sometimes one weight off the 16-element alignment or B ranks unequal,
  where the builder returns None and the concatenation runs); under dropout (one slice) the shrink stores its mask
  (``keep_out=``, a buffer of random bytes: rows it must not write keep them) and the stored bits must be
  ``dropout_keep_mask``'s on live rows; the write-mode expand (``accumulate=False``, no bias, a bias in y's dtype or
  fp32) into a NaN-filled ``y``: every row defined, rows without a live adapter exactly the bias (or zero);
* backward: the same weights in place; ``dA_out`` and ``dB_out`` in fp32, fp16 or bf16, ``dB`` flat per-adapter
  blocks (``dB_blocked=True``) or ``[N, total_rank]``; under dropout (one slice) ``lora_shrink_bwd`` reading the mask
  the forward shrink stored (``keep=``) against redrawing it from the seed (bit for bit under the interpreter, which
  runs both with one block table) and both against the reference with ``dropout_keep_mask`` as its mask.

Tolerance: ``|got - want| <= tol * bound + resolution`` elementwise, ``bound`` the reference op on absolute values;
``tol`` is ``helpers.TOL`` of the activation dtype (16-bit: about twice the error of PyTorch's own 16-bit computation
against fp32), plus one ulp of the output dtype for a gradient stored in another 16-bit dtype (``dA_out`` /
``dB_out``: fp32 sums rounded once); ``resolution`` the spacing of the output dtype's subnormals (a result stored in
fp16 is only defined to 2**-24 below 2**-14, whatever its terms).

CPU (Triton interpreter): examples are bounded by a cost model of the interpreter's programs (``_COST_LIMIT``; a third
of it for the backward paths, which run the shrink backward twice and draw masks the model leaves out), so the whole
file runs in about two minutes on 2 cores (each test 20-45 s; so marked ``slow``: ``pytest -m slow`` runs them);
``derandomize=True`` makes the examples the same on every run.
GPU: ``FML_TEST_DEVICE=cuda pytest -m gpu tests/kernels/test_fuzz.py`` runs the ``*_gpu`` sweeps with larger shapes
(S up to 4096, K and N from a fixed list up to 4096 so compiled kernel variants are reused) and
``FML_FUZZ_EXAMPLES`` examples each (default 200; mostly kernel compilation, several minutes).
``FML_FUZZ_CPU_EXAMPLES`` (default 100; the forward test runs twice as many, the ``*_paths`` tests half as many, each
example checking several paths) scales the CPU profile.
"""

import os

import pytest
import torch
from fast_multilora.kernels import api as kernels
from fast_multilora.kernels.api import lora_expand, lora_shrink
from fast_multilora.kernels.decode import DECODE_MAX_ROWS
from fast_multilora.kernels.dropout import dropout_keep_mask, keep_bits_buffer, unpack_keep_bits
from fast_multilora.kernels.segments import AdapterTable, Segments, segments_from_token_slots, slot_weights
from helpers import DEVICE, KERNEL_DTYPES, TOL, assert_close_bound, poisoned
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fast_multilora import reference as ref

HAS_BWD = hasattr(kernels, "lora_expand_bwd") and hasattr(kernels, "lora_shrink_bwd")
needs_bwd = pytest.mark.skipif(not HAS_BWD, reason="kernels/backward.py launchers not exported")

CPU_EXAMPLES = int(os.environ.get("FML_FUZZ_CPU_EXAMPLES", "100"))
GPU_EXAMPLES = int(os.environ.get("FML_FUZZ_EXAMPLES", "200"))
# FML_FUZZ_DERANDOMIZE=0: examples from hypothesis' seed (``--hypothesis-seed=N``), so parallel processes with
# different seeds run different examples (a sharded GPU sweep)
_COMMON = dict(deadline=None, derandomize=os.environ.get("FML_FUZZ_DERANDOMIZE", "1") != "0", database=None,
               print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
CPU = settings(max_examples=CPU_EXAMPLES, **_COMMON)
CPU_FWD = settings(max_examples=2 * CPU_EXAMPLES, **_COMMON)  # the forward is cheap: twice the examples
CPU_PATHS = settings(max_examples=max(1, CPU_EXAMPLES // 2), **_COMMON)  # each runs several paths per example
GPU = settings(max_examples=GPU_EXAMPLES, **_COMMON)

LAYOUTS = ["empty", "one_token", "giant", "unsorted", "interleaved", "base_runs", "all_base", "split_runs",
           "long_base"]
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
    if layout == "long_base" and S >= 18:
        # packed rows: one base run of 16 j + 1 rows (one past a 16-row block) among shorter adapter runs -- the
        # write-mode expand's grid takes its rows from the longest base run there, not from the adapter runs
        L = 16 * int(torch.randint(1, (S - 2) // 16 + 1, (1,), generator=gen)) + 1
        out, slot = [], -1
        while len(out) < S - L:  # runs of 1 .. min(L - 1, 16) tokens, each of another slot than the last
            slot = (slot + 1 + int(torch.randint(0, max(1, n - 1), (1,), generator=gen))) % n
            out += [slot] * int(torch.randint(1, min(L - 1, 16) + 1, (1,), generator=gen))
        out = out[: S - L]
        cut = int(torch.randint(0, len(out) + 1, (1,), generator=gen))
        return torch.tensor(out[:cut] + [-1] * L + out[cut:])
    out = []
    while len(out) < S:  # unsorted runs; base_runs (long_base below 18 tokens): every other run is a long base run
        if layout in ("base_runs", "long_base") and len(out) % 2 == 0:
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
                    max_len=int(lens[live].max()) if bool(live.any()) else 0, num_tokens=S, cache={},
                    base_max_len=int(lens[~live].max()) if bool((~live).any()) else 0)


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


def _fit(ts, ranks, K, N, stack, limit, backward, keep_tokens=False):
    """Shrink an example until the interpreter can run it in about a second: fewer tokens (unless ``keep_tokens``:
    the layout is the point), narrower K / N, a smaller largest rank, fewer adapters (tokens of dropped adapters are
    remapped), in turn."""
    step = 0
    while _cost(ts, ranks, K, N, stack, backward) > limit:
        what = step % 5
        step += 1
        if what == 0 and ts.numel() > 16 and not keep_tokens:
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
             kn_values=None, stacks=None):
    dtype = draw(st.sampled_from(KERNEL_DTYPES))
    layout = draw(st.sampled_from(LAYOUTS))
    family = draw(st.sampled_from(["sgemm", "chunked", "sgemm_split", "chunked_shuffled"]))
    # sizes: a class drawn by hypothesis (so every class shows up), the value uniform within it from the seed
    # (hypothesis' integers lean hard towards small values)
    n_cls = draw(st.sampled_from(["one", "few", "many"]))
    S_cls = draw(st.sampled_from(["short", "long"]))
    r_cls = draw(st.sampled_from(["narrow", "wide"]))  # one adapter's rank; the others small, as in most layers
    stack = draw(st.sampled_from(stacks) if stacks else st.integers(1, 3))
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
    ts, ranks, K, N = _fit(ts, ranks, K, N, stack, cost_limit, backward, keep_tokens=layout == "long_base")
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


def _resolution(dtype):
    """The spacing of ``dtype``'s subnormals (fp16: 2**-24, bf16: 2**-133, fp32: 2**-149)."""
    fi = torch.finfo(dtype)
    return fi.smallest_normal * fi.eps


def _tol(dtype, out_dtype):
    """``TOL`` of the activation dtype, which covers results stored in it or in fp32; a result stored in another
    16-bit dtype (a weight gradient, summed in fp32) adds twice the one rounding of its store (one ulp)."""
    return TOL[dtype] + (0.0 if out_dtype in (dtype, torch.float32) else torch.finfo(out_dtype).eps)


def _close(got, want, bound, dtype, what, p):
    """``|got - want| <= tol * bound + resolution`` elementwise (``helpers.assert_close_bound``), ``bound`` the same
    reference op on absolute values. ``tol``: :func:`_tol`; ``resolution``: of ``got``'s dtype (storing in it rounds
    a subnormal result to a multiple of that spacing, which no relative bound covers)."""
    assert_close_bound(got, want, bound, _tol(dtype, got.dtype), what, resolution=_resolution(got.dtype),
                       detail=_desc(p))


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



def _check_expand_bwd(p, d, B, segs, dB_dtype, blocked, empty, offs, device):
    """``lora_expand_bwd`` into NaN-poisoned ``dh`` and ``dB`` (``dB_dtype``, flat per-adapter blocks when
    ``blocked``) against the float64 reference: this slice's live cells of ``dh`` written and nothing else, every
    ``dB`` cell, zero for the slots in ``empty`` (no tokens)."""
    stack, dtype, S, N, sl = p["stack"], p["dtype"], d["S"], p["N"], p["slice_idx"]
    table, ranks = d["table"], p["ranks"]
    R, R_tot = max(ranks), sum(ranks)
    dh = poisoned(S, stack * R, device=device)
    dB = poisoned(*((R_tot * N,) if blocked else (N, R_tot)), dtype=dB_dtype, device=device)
    out_dh, out_dB = kernels.lora_expand_bwd(d["dy"], d["h"], B, segs, table, stack_num=stack, slice_idx=sl, dh=dh,
                                             dB_out=dB, dB_blocked=blocked)
    assert out_dh is dh and out_dB is dB
    (want_dh, want_dB), (bound_dh, bound_dB) = _ref64(
        lambda dy, h, B: ref.lora_expand_bwd(dy, h, B, segs, table, stack_num=stack, slice_idx=sl),
        d["dy"], d["h"], d["B"])
    written = d["slice_cols"]
    assert torch.isnan(dh[~written]).all(), f"expand_bwd wrote dh cells outside this slice's live cells; {_desc(p)}"
    _close(dh[written], want_dh[written], bound_dh[written], dtype, "expand_bwd dh", p)
    if blocked:
        want_dB, bound_dB = _blocked(want_dB, ranks), _blocked(bound_dB, ranks)
    _close(dB, want_dB, bound_dB, dtype, "expand_bwd dB", p)
    for a in empty:
        cells = dB[offs[a] * N : offs[a + 1] * N] if blocked else dB[:, offs[a] : offs[a + 1]]
        assert torch.count_nonzero(cells) == 0, f"dB of slot {a} without tokens; {_desc(p)}"

def check_backward(p, device):
    _events(p)
    d = _build(p, device)
    stack, dtype, S, K = p["stack"], p["dtype"], d["S"], p["K"]
    segs, table, live = d["segs"], d["table"], d["live"]
    R_tot = sum(p["ranks"])
    slot_has_tokens = torch.zeros(len(p["ranks"]), dtype=torch.bool)
    slot_has_tokens[p["ts"][p["ts"] >= 0].unique()] = True
    offs = torch.tensor([0] + p["ranks"]).cumsum(0).tolist()

    # expand backward: dh (this slice's cells of live rows written, the rest untouched) and dB (every cell)
    _check_expand_bwd(p, d, d["B"], segs, torch.float32, False, torch.nonzero(~slot_has_tokens).reshape(-1).tolist(),
                      offs, device)

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


# --- the launchers' other call forms: weights in place, write-mode expand, stored mask, gradient dtypes ------------

GRAD_DTYPES = [torch.float32, torch.float16, torch.bfloat16]  # weight gradients are stored in these (no bf16 dot)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@st.composite
def path_problems(draw, **kw):
    """A problem of :func:`problems` (mostly one slice, which weights in place and stored masks need; mostly with
    dropout) and the call forms the ``*_paths`` checks use."""
    p = draw(problems(stacks=[1, 1, 1, 2], **kw))
    if not p["dropout"] and draw(st.booleans()):
        gen = torch.Generator().manual_seed(p["seed"] + 3)
        p.update(dropout=True, ps=(torch.rand(len(p["ranks"]), generator=gen) * 0.6).tolist())
    if draw(st.booleans()):  # one rank for every present adapter (B in place also takes mixed ranks: both are drawn)
        p["ranks"] = [max(p["ranks"]) if r else 0 for r in p["ranks"]]  # the cost model counts max(ranks) only
    p.update(
        in_place=draw(st.sampled_from([True, True, False])),
        misalign=draw(st.sampled_from([None, "A", "B"])),  # one weight 1..15 elements off alignment: no SlotWeights
        known_base=draw(st.booleans()),  # SGEMM segments with base_max_len: the write-mode expand defines base rows
        store_mask=draw(st.booleans()),  # forward under dropout: the shrink also stores its mask (keep_out=)
        bias=draw(st.sampled_from([None, "act", "fp32"])),
        dA_dtype=draw(st.sampled_from(GRAD_DTYPES)),
        dB_dtype=draw(st.sampled_from(GRAD_DTYPES)),
        dB_blocked=draw(st.booleans()),
    )
    return p


def _in_place(ws, slots, n_slots, dim, shift, gen):
    """``slot_weights`` of copies of ``ws`` (``ws[i]`` is slot ``slots[i]``'s weight): views of one NaN-filled buffer
    in a random order, 0..2 x 16 elements apart; ``shift``: the second weight in the buffer starts 1..15 elements
    past that alignment. Returns the SlotWeights, or None where the builder refuses them."""
    if not ws:
        return None
    order = torch.randperm(len(ws), generator=gen).tolist()
    starts, end = [0] * len(ws), 0
    for j, i in enumerate(order):
        gap = 16 * int(torch.randint(0, 3, (1,), generator=gen)) if j else 0
        if j == 1 and shift:
            gap += int(torch.randint(1, 16, (1,), generator=gen))
        starts[i] = end + gap
        end = -(-(starts[i] + ws[i].numel()) // 16) * 16  # the next weight is aligned again
    buf = torch.full((end + 16,), float("nan"), dtype=ws[0].dtype, device=ws[0].device)  # gaps and tail stay NaN
    views = [buf[s0 : s0 + w.numel()].view(w.shape) for s0, w in zip(starts, ws, strict=True)]
    for v, w in zip(views, ws, strict=True):
        v.copy_(w)
    return slot_weights(views, slots, n_slots, dim)


def _weight_args(p, d, gen):
    """``(A, B, A in place, B in place)``: the launchers' weight arguments -- ``SlotWeights`` holding the values of
    ``d["A"]`` / ``d["B"]`` where the example reads weights in place and the builder takes them, otherwise the
    concatenations themselves (what a caller does when ``slot_weights`` returns None)."""
    ranks = p["ranks"]
    if not p["in_place"] or p["stack"] != 1:  # SlotWeights take one slice
        return d["A"], d["B"], False, False
    slots = tuple(a for a, r in enumerate(ranks) if r > 0)
    offs = torch.tensor([0] + ranks).cumsum(0).tolist()
    A_w = _in_place([d["A"][offs[a] : offs[a + 1]] for a in slots], slots, len(ranks), 0, p["misalign"] == "A", gen)
    B_w = _in_place([d["B"][:, offs[a] : offs[a + 1]].contiguous() for a in slots], slots, len(ranks), 1,
                    p["misalign"] == "B", gen)
    # the builder takes aligned weights of one dtype (B: of one rank), so the in-place path is really exercised
    assert A_w is not None or not slots or p["misalign"] == "A", f"slot_weights refused A; {_desc(p)}"
    assert B_w is not None or not slots or p["misalign"] == "B" or len({ranks[a] for a in slots}) > 1, (
        f"slot_weights refused B; {_desc(p)}")
    return (d["A"] if A_w is None else A_w), (d["B"] if B_w is None else B_w), A_w is not None, B_w is not None


def _path_segments(p, d):
    """The example's segments; SGEMM ones without ``base_max_len`` unless ``known_base`` (the write-mode expand then
    fills y before the kernel instead of defining base rows in one pass)."""
    segs = d["segs"]
    return segs if segs.perm is not None or p["known_base"] else segs._replace(base_max_len=-1)


def _random_bits(x, gen):
    """``keep_bits_buffer(x)`` full of random bytes: rows the shrink does not store keep them, and nothing reads
    them."""
    bits = keep_bits_buffer(x)
    bits.copy_(torch.randint(0, 256, tuple(bits.shape), generator=gen, dtype=torch.uint8))
    return bits


def _blocked(t, ranks):
    """``[N, total_rank]`` -> ``dB_blocked=True``'s flat layout: slot ``a``'s ``[N, r_a]`` block at
    ``offsets[a] * N``."""
    offs = torch.tensor([0] + ranks).cumsum(0).tolist()
    return torch.cat([t[:, offs[a] : offs[a + 1]].reshape(-1) for a in range(len(ranks))])


def check_forward_paths(p, device):
    _events(p)
    d = _build(p, device)
    gen = torch.Generator().manual_seed(p["seed"] + 2)
    stack, dtype, S, K, N, sl = p["stack"], p["dtype"], d["S"], p["K"], p["N"], p["slice_idx"]
    table, defined, live = d["table"], d["defined"], d["live"]
    segs = _path_segments(p, d)
    A, B, a_slot, b_slot = _weight_args(p, d, gen)
    store = p["store_mask"] and d["seed"] is not None and table.has_dropout and stack == 1
    event(f"weights A={'in place' if a_slot else 'cat'} B={'in place' if b_slot else 'cat'} stored mask={store}")
    event(f"write-mode expand: bias={p['bias']} one-pass={segs.covers_all_rows}")

    bits = _random_bits(d["x"], gen) if store else None
    h = lora_shrink(d["x"], A, segs, table, stack_num=stack, seed=d["seed"], keep_out=bits,
                    out=poisoned(S, stack * max(p["ranks"]), device=device))
    assert torch.isnan(h[~defined]).all(), f"shrink wrote cells it does not own; {_desc(p)}"
    want, bound = _ref64(lambda x, A: ref.lora_shrink(x, A, segs, table, stack_num=stack, keep=d["keep"]),
                         d["x"], d["A"])
    _close(h[defined], want[defined], bound[defined], dtype, "shrink h", p)
    if store and S:  # (unpack_keep_bits cannot reshape zero rows)
        stored = unpack_keep_bits(bits, K)
        assert torch.equal(stored[live], d["keep"][live]), f"keep_out != dropout_keep_mask on live rows; {_desc(p)}"

    # write mode: y's NaN must never be read, every row is defined, rows without a live adapter are the bias (or 0)
    bias = None if p["bias"] is None else torch.randn(N, generator=gen).to(
        device, dtype if p["bias"] == "act" else torch.float32)
    y = lora_expand(d["h"], B, segs, table, poisoned(S, N, dtype=dtype, device=device), stack_num=stack,
                    slice_idx=sl, accumulate=False, bias=bias)
    assert torch.isfinite(y).all(), f"write-mode expand left {int((~torch.isfinite(y)).sum())} entries; {_desc(p)}"
    fill = torch.zeros(N, dtype=dtype, device=device) if bias is None else bias.to(dtype)
    assert torch.equal(y[~live], fill.expand(int((~live).sum()), N)), f"write-mode base rows != bias; {_desc(p)}"
    want, bound = _ref64(lambda h, B, b: ref.lora_expand(h, B, segs, table, torch.zeros(S, N, dtype=torch.float64,
                                                                                           device=device),
                                                         stack_num=stack, slice_idx=sl, accumulate=False, bias=b),
                         d["h"], d["B"], bias)
    _close(y[live], want[live], bound[live], dtype, "write-mode expand y", p)


def check_backward_paths(p, device):
    _events(p)
    d = _build(p, device)
    gen = torch.Generator().manual_seed(p["seed"] + 2)
    stack, dtype, S, K = p["stack"], p["dtype"], d["S"], p["K"]
    table, live, ranks = d["table"], d["live"], p["ranks"]
    segs = _path_segments(p, d)
    R_tot = sum(ranks)
    A, B, a_slot, b_slot = _weight_args(p, d, gen)
    store = d["seed"] is not None and table.has_dropout and stack == 1
    blocked = p["dB_blocked"]
    event(f"weights A={'in place' if a_slot else 'cat'} B={'in place' if b_slot else 'cat'} stored mask={store}")
    event(f"dA_out={p['dA_dtype']} dB_out={p['dB_dtype']} blocked={blocked}")
    slot_has_tokens = torch.zeros(len(ranks), dtype=torch.bool)
    slot_has_tokens[p["ts"][p["ts"] >= 0].unique()] = True
    empty = torch.nonzero(~slot_has_tokens).reshape(-1).tolist()
    offs = torch.tensor([0] + ranks).cumsum(0).tolist()

    _check_expand_bwd(p, d, B, segs, p["dB_dtype"], blocked, empty, offs, device)

    # shrink backward, redrawing the mask from the seed and (one slice) reading what the forward shrink stored
    need_dx = p["seed"] % 4 != 0
    masks = {"redrawn": None}
    if store:
        masks["stored"] = _random_bits(d["x"], gen)
        lora_shrink(d["x"], A, segs, table, seed=d["seed"], keep_out=masks["stored"])
    (want_dx, want_dA), (bound_dx, bound_dA) = _ref64(
        lambda dh, x, A: ref.lora_shrink_bwd(dh, x, A, segs, table, stack_num=stack, keep=d["keep"],
                                             need_dx=need_dx),
        d["dh"], d["x"], d["A"])
    got = {}
    for name, keep in masks.items():
        dx = poisoned(S, K, dtype=dtype, device=device) if need_dx else None
        dA = poisoned(stack * R_tot, K, dtype=p["dA_dtype"], device=device)
        out_dx, out_dA = kernels.lora_shrink_bwd(d["dh"], d["x"], A, segs, table, stack_num=stack, seed=d["seed"],
                                                 need_dx=need_dx, dx_out=dx, dA_out=dA, keep=keep)
        assert out_dA is dA and out_dx is dx
        what = f"shrink_bwd ({name} mask)" if d["seed"] is not None else "shrink_bwd"
        _close(dA, want_dA, bound_dA, dtype, f"{what} dA", p)
        for a in empty:
            assert torch.count_nonzero(dA[stack * offs[a] : stack * offs[a + 1]]) == 0, (
                f"{what}: dA of slot {a} without tokens; {_desc(p)}")
        if need_dx:
            assert torch.count_nonzero(dx[~live]) == 0, f"{what}: dx rows without a live adapter not zero; {_desc(p)}"
            _close(dx[live], want_dx[live], bound_dx[live], dtype, f"{what} dx", p)
        got[name] = (dx, dA)
    if store and _INTERPRETED:  # one block table for both under the interpreter: the same sums, bit for bit
        for i, what in ((0, "dx"), (1, "dA")):
            if got["stored"][i] is not None:
                assert torch.equal(got["stored"][i], got["redrawn"][i]), f"{what}: stored mask != redrawn; {_desc(p)}"


# --- the one-launch decode kernel (kernels.decode: few rows, no dropout, one slice) ---------------------------------


@st.composite
def decode_problems(draw, **kw):
    """A problem of :func:`path_problems` of at most ``DECODE_MAX_ROWS`` tokens, one slice, no dropout (what the
    layer path sends to ``lora_shrink_expand``), weights in place or concatenated."""
    p = draw(path_problems(backward=False, **{"max_S": DECODE_MAX_ROWS, **kw}))
    p.update(stack=1, slice_idx=0, dropout=False, ps=[0.0] * len(p["ranks"]))
    return p


def check_decode(p, device):
    """``lora_shrink_expand`` into a ``y`` whose rows without a live adapter are NaN (they must stay NaN) against the
    fp64 reference on its live rows, within :func:`_close`'s bound (the same op on absolute values)."""
    _events(p)
    d = _build(p, device)
    A, B, a_slot, b_slot = _weight_args(p, d, torch.Generator().manual_seed(p["seed"] + 5))
    event(f"decode weights A={'in place' if a_slot else 'cat'} B={'in place' if b_slot else 'cat'}")
    segs = d["segs"]._replace(token_slots=p["ts"].to(device, torch.int32))
    table, live = d["table"], d["live"]
    y = kernels.lora_shrink_expand(d["x"], A, B, segs, table, d["y0"].clone())
    assert torch.isnan(y[~live]).all(), f"decode wrote rows without a live adapter; {_desc(p)}"
    hi = torch.float64
    want = ref.lora_shrink_expand(d["x"].to(hi), d["A"].to(hi), d["B"].to(hi), segs, table, d["y0"].to(hi))
    bound = ref.lora_shrink_expand(d["x"].to(hi).abs(), d["A"].to(hi).abs(), d["B"].to(hi).abs(), segs, table,
                                   d["y0"].to(hi).abs())
    _close(y[live], want[live], bound[live], p["dtype"], "shrink_expand", p)


@pytest.mark.slow
@CPU_PATHS
@given(p=decode_problems())
def test_fuzz_shrink_expand(p):
    check_decode(p, DEVICE)


@pytest.mark.slow
@CPU_FWD
@given(p=problems(backward=False))
def test_fuzz_forward(p):
    check_forward(p, DEVICE)


@pytest.mark.slow
@needs_bwd
@CPU
@given(p=problems())
def test_fuzz_backward(p):
    check_backward(p, DEVICE)


@pytest.mark.slow
@CPU_PATHS
@given(p=path_problems(backward=False))
def test_fuzz_forward_paths(p):
    check_forward_paths(p, DEVICE)


@pytest.mark.slow
@needs_bwd
@CPU_PATHS
@given(p=path_problems(cost_limit=_COST_LIMIT // 3))  # mostly under dropout, whose draws the cost model leaves out
def test_fuzz_backward_paths(p):
    check_backward_paths(p, DEVICE)


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


@pytest.mark.gpu
@GPU
@given(p=path_problems(**_GPU_SHAPES))
def test_fuzz_forward_paths_gpu(p):
    check_forward_paths(p, "cuda")


@pytest.mark.gpu
@GPU
@given(p=decode_problems(**_GPU_SHAPES))
def test_fuzz_shrink_expand_gpu(p):
    check_decode(p, DEVICE)


@pytest.mark.gpu
@needs_bwd
@GPU
@given(p=path_problems(**_GPU_SHAPES))
def test_fuzz_backward_paths_gpu(p):
    check_backward_paths(p, "cuda")
