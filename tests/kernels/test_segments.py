"""``kernels/segments.py``: the segment tables and the host ints the launchers size their grids with, against runs
counted in plain Python; and the kernels on packed batches whose base run is longer than every adapter run and one
row past a row block (``[a, a, base x 17, a, a, a]``), where the write-mode expand's grid takes its rows from
``base_max_len``: one row short there leaves the run's last row unwritten.

Kernels run under the Triton interpreter (tests/conftest.py) against ``fast_multilora.reference``; outputs are
NaN-poisoned first, so a row no program writes fails the test. The interpreter's expand blocks are 16 rows, so base
runs of 17, 33, 65 and 129 rows each end one row into a new block.
"""

import pytest
import torch
from fast_multilora.kernels.backward import lora_expand_bwd, lora_shrink_bwd
from fast_multilora.kernels.forward import lora_expand, lora_shrink
from fast_multilora.kernels.segments import grouped_segments, row_segments, segments_from_token_slots
from helpers import DEVICE, KERNEL_DTYPES, TOL, make_table, poisoned

from fast_multilora import reference as ref

RANKS = [3, 5, 0]  # slot 2: an adapter absent from the layer (rank 0), which write mode treats as base rows


def _packed(*runs):
    """Token slots of runs ``(slot, length)``, as a packed row lays them out."""
    return torch.tensor([s for s, n in runs for _ in range(n)], dtype=torch.int64)


# base runs longer than every adapter run, one row past a 16-row block; and the neighbours that must keep working
LAYOUTS = {
    **{f"a2-base{n}-a3": _packed((0, 2), (-1, n), (0, 3)) for n in (17, 33, 65, 129)},
    "base17-first": _packed((-1, 17), (1, 2)),
    "base33-last": _packed((1, 3), (0, 1), (-1, 33)),
    "base16-a2-base17": _packed((-1, 16), (0, 2), (-1, 17), (1, 1)),
    "rank0-run17": _packed((0, 2), (2, 17), (1, 3)),  # an absent adapter's run: base rows for the expand
    "a20-base17": _packed((0, 20), (-1, 17), (1, 2)),  # an adapter run longer than the base run
    "a17-base2": _packed((1, 2), (0, 17), (-1, 2)),
    "all-base17": _packed((-1, 17)),
    "interleaved": torch.tensor([0, -1, 1, -1, -1, 0, 2, 1, -1, 0] * 4),
}


def _runs(ts):
    """``[(slot, start, end)]``: maximal runs of equal slots, counted in plain Python."""
    out = []
    for i, s in enumerate(ts.tolist()):
        if out and out[-1][0] == s:
            out[-1][2] = i + 1
        else:
            out.append([s, i, i + 1])
    return [tuple(r) for r in out]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_segments_from_token_slots_counts_every_run(name):
    ts = LAYOUTS[name]
    runs = _runs(ts)
    live = [e - b for s, b, e in runs if s >= 0]
    base = [e - b for s, b, e in runs if s < 0]

    segs = segments_from_token_slots(ts, grouped=False)
    assert segs.indptr.tolist() == [0] + [e for _, _, e in runs]
    assert segs.slot.tolist() == [s for s, _, _ in runs]
    assert segs.perm is None and segs.num_tokens == ts.numel() and segs.covers_all_rows
    assert segs.max_len == max(live, default=0), "max_len: the longest adapter run"
    assert segs.base_max_len == max(base, default=0), "base_max_len: the longest base run"

    grouped = segments_from_token_slots(ts, grouped=True)
    used = sorted({s for s in ts.tolist() if s >= 0})
    counts = [int((ts == s).sum()) for s in used]
    assert grouped.slot.tolist() == used
    assert grouped.indptr.tolist() == [sum(counts[:i]) for i in range(len(counts) + 1)]
    assert grouped.perm.tolist() == [i for s in used for i in range(ts.numel()) if ts[i] == s]  # stable
    assert grouped.max_len == max(counts, default=0) and grouped.base_max_len == -1 and not grouped.covers_all_rows


@pytest.mark.parametrize("T", [1, 17])
def test_row_and_grouped_segments(T):
    row_slots = torch.tensor([1, -1, 0, 1, -1])
    segs = row_segments(row_slots, T, n_slots=3)
    assert segs.indptr.tolist() == [i * T for i in range(6)] and segs.slot.tolist() == row_slots.tolist()
    assert segs.max_len == T and segs.base_max_len == T and segs.num_tokens == 5 * T and segs.covers_all_rows
    assert segs.token_slots.tolist() == row_slots.repeat_interleave(T).tolist()

    ts = row_slots.repeat_interleave(T)
    g = grouped_segments(ts, n_slots=3)
    counts = [int((ts == s).sum()) for s in (-1, 0, 1, 2)]
    assert g.slot.tolist() == [-1, 0, 1, 2]
    assert g.indptr.tolist() == [sum(counts[:i]) for i in range(5)]
    assert g.perm.tolist() == [i for s in (-1, 0, 1, 2) for i in range(ts.numel()) if ts[i] == s]
    assert g.max_len == g.num_tokens == ts.numel() and g.base_max_len == -1


def _close(got, want, dtype, what):
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    scale = max(want.abs().max().item(), 1e-6) if got.numel() else 1.0
    assert err <= TOL[dtype] * scale, f"{what}: max err {err:.3e} > tol {TOL[dtype]:.1e} * max|ref| {scale:.3e}"


# every layout in fp32; the 16-bit dtypes (which change what is stored, not which rows) on two of them
CASES = [pytest.param(name, dt, id=f"{name}-{str(dt).split('.')[-1]}") for name in LAYOUTS
         for dt in KERNEL_DTYPES if dt == torch.float32 or name in ("a2-base17-a3", "interleaved")]


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("name, dtype", CASES)
def test_kernels_define_every_row_of_packed_layouts(name, dtype, grouped):
    """Shrink, expand (accumulate and write mode, with and without a bias) and the shrink backward's ``dx`` on the
    layout, into NaN-filled outputs, against the reference; every row the contract defines is checked."""
    ts = LAYOUTS[name]
    S, K, N = ts.numel(), 24, 20
    g = torch.Generator().manual_seed(S)
    table = make_table(RANKS, device=DEVICE)
    segs = segments_from_token_slots(ts, grouped=grouped, device=DEVICE)
    R = sum(RANKS)
    live = torch.tensor([s >= 0 and RANKS[s] > 0 for s in ts.tolist()], device=DEVICE)
    x = torch.randn(S, K, generator=g).to(DEVICE, dtype)
    A = (torch.randn(R, K, generator=g) / K**0.5).to(DEVICE)
    B = (torch.randn(N, R, generator=g) / 4).to(DEVICE)
    hi = torch.float64

    h = lora_shrink(x, A, segs, table, out=poisoned(S, max(RANKS), device=DEVICE))
    h64 = ref.lora_shrink(x.to(hi), A.to(hi), segs, table)
    r_tok = torch.tensor([RANKS[s] if s >= 0 else 0 for s in ts.tolist()], device=DEVICE)
    defined = torch.arange(max(RANKS), device=DEVICE)[None, :] < r_tok[:, None]
    assert torch.isnan(h[~defined]).all(), "shrink wrote cells outside its rows and columns"
    _close(h[defined], h64[defined], dtype, "shrink")

    h_in = torch.where(defined, h64, torch.nan).float()  # don't-care cells NaN: the expand must not read them
    y0 = torch.where(live[:, None], torch.randn(S, N, generator=g).to(DEVICE), torch.nan).to(dtype)
    y = lora_expand(h_in, B, segs, table, y0.clone())
    assert torch.isnan(y[~live]).all(), "accumulating expand wrote rows without an adapter"
    _close(y[live], ref.lora_expand(h_in.to(hi), B.to(hi), segs, table, y0.to(hi))[live], dtype, "expand")

    for bias in (None, torch.randn(N, generator=g).to(DEVICE, dtype)):
        y = lora_expand(h_in, B, segs, table, poisoned(S, N, dtype=dtype, device=DEVICE), accumulate=False, bias=bias)
        unwritten = torch.isnan(y).any(1).nonzero().reshape(-1).tolist()
        assert not unwritten, f"write-mode expand left rows {unwritten} unwritten (bias={bias is not None})"
        want = ref.lora_expand(h_in.to(hi), B.to(hi), segs, table, torch.empty(S, N, dtype=hi, device=DEVICE),
                               accumulate=False, bias=None if bias is None else bias.to(hi))
        _close(y, want, dtype, f"write-mode expand, bias={bias is not None}")

    dh = torch.where(defined, torch.randn(S, max(RANKS), generator=g).to(DEVICE), torch.nan)
    dx, dA = lora_shrink_bwd(dh, x, A, segs, table, dx_out=poisoned(S, K, dtype=dtype, device=DEVICE))
    dx64, dA64 = ref.lora_shrink_bwd(dh.to(hi), x.to(hi), A.to(hi), segs, table)
    assert (dx[~live] == 0).all(), "dx rows without an adapter must be exactly zero"
    _close(dx, dx64, dtype, "dx")
    _close(dA, dA64, dtype, "dA")


@pytest.mark.parametrize("T", [1, 17])
def test_write_mode_expand_of_row_segments_defines_every_row(T):
    """``row_segments`` (per-row routing, the compiled path's layout) of rows of ``T`` tokens, base rows between
    adapter rows: the write-mode expand's grid takes its rows from ``base_max_len`` = ``T`` here too."""
    row_slots = torch.tensor([0, -1, 1, -1, 2], device=DEVICE)  # slot 2: rank 0
    segs = row_segments(row_slots, T, n_slots=len(RANKS))
    S, N = segs.num_tokens, 20
    g = torch.Generator().manual_seed(T)
    table = make_table(RANKS, device=DEVICE)
    h = torch.randn(S, max(RANKS), generator=g).to(DEVICE)
    B = (torch.randn(N, sum(RANKS), generator=g) / 4).to(DEVICE)
    bias = torch.randn(N, generator=g).to(DEVICE)
    y = lora_expand(h, B, segs, table, poisoned(S, N, device=DEVICE), accumulate=False, bias=bias)
    unwritten = torch.isnan(y).any(1).nonzero().reshape(-1).tolist()
    assert not unwritten, f"write-mode expand left rows {unwritten} unwritten"
    want = ref.lora_expand(h.double(), B.double(), segs, table, torch.empty(S, N, dtype=torch.float64,
                                                                            device=DEVICE),
                           accumulate=False, bias=bias.double())
    _close(y, want, torch.float32, "write-mode expand of row segments")


def test_backward_chunks_of_one_token_per_slot():
    """Every slot and the base one token each, the last slot live: the backward's chunk table holds one chunk per
    group, ``n_slots + 1`` in all -- its capacity's bound is reached exactly, so one chunk short drops the last slot's
    rows from ``dA`` / ``dB``."""
    ranks = [2, 3, 1, 4]
    ts = torch.tensor([3, -1, 0, 2, 1])
    S, K, N = ts.numel(), 12, 10
    g = torch.Generator().manual_seed(5)
    table = make_table(ranks, device=DEVICE)
    segs = segments_from_token_slots(ts, grouped=False, device=DEVICE)
    x = torch.randn(S, K, generator=g).to(DEVICE)
    A = torch.randn(sum(ranks), K, generator=g).to(DEVICE)
    B = torch.randn(N, sum(ranks), generator=g).to(DEVICE)
    h = torch.randn(S, max(ranks), generator=g).to(DEVICE)
    dy = torch.randn(S, N, generator=g).to(DEVICE)
    dh, dB = lora_expand_bwd(dy, h, B, segs, table)
    dh64, dB64 = ref.lora_expand_bwd(dy.double(), h.double(), B.double(), segs, table)
    r_tok = torch.tensor([ranks[s] if s >= 0 else 0 for s in ts.tolist()], device=DEVICE)
    defined = torch.arange(max(ranks), device=DEVICE)[None, :] < r_tok[:, None]
    _close(dh[defined], dh64[defined], torch.float32, "dh")
    _close(dB, dB64, torch.float32, "dB")
    dx, dA = lora_shrink_bwd(torch.where(defined, dh64, 0).float(), x, A, segs, table,
                             dx_out=poisoned(S, K, device=DEVICE))
    dx64, dA64 = ref.lora_shrink_bwd(torch.where(defined, dh64, 0), x.double(), A.double(), segs, table)
    _close(dx, dx64, torch.float32, "dx")
    _close(dA, dA64, torch.float32, "dA")


def test_to_device_on_the_cpu_is_the_tensor_or_a_copy():
    from fast_multilora.kernels.segments import to_device

    t = torch.arange(5)
    assert to_device(t, "cpu") is t
    assert to_device(t, torch.device("meta")).device.type == "meta"


@pytest.mark.gpu
def test_to_device_does_not_wait_for_queued_kernels():
    """A host tensor goes to the GPU through pinned memory: the call returns while a long kernel queued before it
    still runs (a copy from pageable memory may wait for the stream: the routing table at a forward's entry, the
    loss's tables after the forward), and the values arrive in order after it."""
    from fast_multilora.kernels.segments import to_device

    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of one SM's clock
    end.record()
    end.synchronize()
    sleep_ms = start.elapsed_time(end)
    host = torch.arange(1000)
    torch.cuda._sleep(200_000_000)
    import time

    t0 = time.perf_counter()
    dev = to_device(host, "cuda")
    waited_ms = (time.perf_counter() - t0) * 1e3
    assert waited_ms < sleep_ms / 4, (waited_ms, sleep_ms)
    assert torch.equal(dev.cpu(), host)
