"""The torch backend's CPU ops (``fast_multilora.cpu_ops``: each slot's rows only) against the reference ops (every
slot over all rows, masked), float64 (only summation order differs) and float32, at odd shapes: rank 1, ranks past
the max rank of other slots, rank-0 slots, slots without rows, one-row slots, unsorted interleaved rows, contiguous
runs (slices) and scattered rows (index tensors), 128 adapters, dropout masks, write-mode expand with a bias, a given
``dh`` whose other columns must survive, the adapter store's packed expand weight (read and written in its layout)."""

import itertools

import pytest
import torch
from helpers import TOL, assert_close_max, make_segments, make_table, random_token_slots

from fast_multilora import cpu_ops
from fast_multilora import reference as ref

CASES = {
    "S37-K23-N19-mixed": (37, 23, 19, [3, 0, 1, 5], "random"),
    "S41-K123-N17-runs": (41, 123, 17, [1, 8, 2], "runs"),
    "S29-K16-N33-skewed": (29, 16, 33, [4, 4, 1, 6, 2], "skewed"),
    "S5-K9-N7-one-row-each": (5, 9, 7, [2, 3, 1, 4], "one_each"),
    "S300-K24-N20-A128": (300, 24, 20, [1 + (i * 7) % 8 for i in range(128)], "random"),
}


def _inputs(case, dtype, dropout, seed=0):
    S, K, N, ranks, layout = CASES[case]
    g = torch.Generator().manual_seed(seed)
    if layout == "one_each":
        ts = torch.tensor([3, -1, 0, 2, 1])
    else:
        ts = random_token_slots(S, len(ranks), g, layout=layout)
    ps = [0.0 if i % 2 else 0.25 for i in range(len(ranks))] if dropout else None
    table = make_table(ranks, dropout=ps)
    R = sum(ranks)
    t = dict(x=torch.randn(S, K, generator=g, dtype=dtype), A=torch.randn(R, K, generator=g, dtype=dtype),
             B=torch.randn(N, R, generator=g, dtype=dtype), dy=torch.randn(S, N, generator=g, dtype=dtype),
             y=torch.randn(S, N, generator=g, dtype=dtype), bias=torch.randn(N, generator=g, dtype=dtype))
    keep = (torch.rand(S, K, generator=g) > 0.25) if dropout else None
    return ts, table, t, keep


def _packed(B_cat: torch.Tensor, table) -> torch.Tensor:
    """``B_cat[N, total_rank]`` as the adapter store packs it: each slot's ``[N, r]`` flat, in offset order."""
    pieces = sorted((off, r) for r, off in zip(table.ranks.tolist(), table.offsets.tolist(), strict=True) if r > 0)
    assert [off for off, _ in pieces] == list(itertools.accumulate([0] + [r for _, r in pieces[:-1]]))
    return torch.cat([B_cat[:, off : off + r].reshape(-1) for off, r in pieces])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("dropout", [False, True], ids=["p0", "dropout"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_ops_match_the_reference(case, grouped, dropout, dtype):
    ts, table, t, keep = _inputs(case, dtype, dropout)
    segs, segs_ref = make_segments(ts, grouped), make_segments(ts, grouped)
    x, A, B = t["x"], t["A"], t["B"]
    h = cpu_ops.lora_shrink(x, A, segs, table, keep=keep)
    h_ref = ref.lora_shrink(x, A, segs_ref, table, keep=keep)
    assert_close_max(h, h_ref, dtype, "h")
    for accumulate, bias in ((True, None), (False, None), (False, t["bias"])):
        y = cpu_ops.lora_expand(h_ref, B, segs, table, torch.full_like(t["y"], float("nan")) if not accumulate
                                else t["y"].clone(), accumulate=accumulate, bias=bias)
        y_ref = ref.lora_expand(h_ref, B, segs_ref, table, t["y"].clone(), accumulate=accumulate, bias=bias)
        assert_close_max(y, y_ref, dtype, f"y (accumulate={accumulate}, bias={bias is not None})")
    if not dropout:
        y = cpu_ops.lora_shrink_expand(x, A, B, segs, table, t["y"].clone())
        assert_close_max(y, ref.lora_shrink_expand(x, A, B, segs_ref, table, t["y"].clone()), dtype, "shrink_expand")
    dh, dB = cpu_ops.lora_expand_bwd(t["dy"], h_ref, B, segs, table)
    dh_ref, dB_ref = ref.lora_expand_bwd(t["dy"], h_ref, B, segs_ref, table)
    assert_close_max(dh, dh_ref, dtype, "dh")
    assert_close_max(dB, dB_ref, dtype, "dB")
    # the adapter store's packed block (1-D, slot a's [N, r] contiguous from element N * offset), read in place
    packed = _packed(B, table)
    y = cpu_ops.lora_expand(h_ref, packed, segs, table, t["y"].clone())
    assert_close_max(y, ref.lora_expand(h_ref, B, segs_ref, table, t["y"].clone()), dtype, "y (packed B)")
    dh, dB = cpu_ops.lora_expand_bwd(t["dy"], h_ref, packed, segs, table)
    assert dB.shape == packed.shape
    assert_close_max(dh, dh_ref, dtype, "dh (packed B)")
    assert_close_max(dB, _packed(dB_ref.to(dB.dtype), table), dtype, "dB (packed B)")
    for need_dx in (True, False):
        dx, dA = cpu_ops.lora_shrink_bwd(dh_ref, x, A, segs, table, keep=keep, need_dx=need_dx)
        dx_ref, dA_ref = ref.lora_shrink_bwd(dh_ref, x, A, segs_ref, table, keep=keep, need_dx=need_dx)
        assert_close_max(dA, dA_ref, dtype, "dA")
        if need_dx:
            assert_close_max(dx, dx_ref, dtype, "dx")
        else:
            assert dx is None


def test_a_given_dh_keeps_its_other_columns():
    ts, table, t, _ = _inputs("S37-K23-N19-mixed", torch.float64, False, seed=3)
    segs = make_segments(ts, False)
    h = ref.lora_shrink(t["x"], t["A"], segs, table)
    given = torch.randn(ts.numel(), table.max_rank + 2, dtype=torch.float64)
    dh, _ = cpu_ops.lora_expand_bwd(t["dy"], h, t["B"], segs, table, dh=given.clone())
    dh_ref, _ = ref.lora_expand_bwd(t["dy"], h, t["B"], make_segments(ts, False), table, dh=given.clone())
    torch.testing.assert_close(dh, dh_ref, rtol=TOL[torch.float64], atol=TOL[torch.float64])


def test_non_finite_rows_and_weights_stay_in_their_adapter():
    """A NaN in one adapter's rows (x, dy) or weights (A, B) reaches that adapter's outputs and gradients only."""
    ts = torch.tensor([0, 1, 1, -1, 0, 2, 1])
    table = make_table([2, 3, 1])
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(7, 5, generator=g), torch.randn(7, 6, generator=g)
    A, B = torch.randn(6, 5, generator=g), torch.randn(6, 6, generator=g)
    x[1, 0] = float("nan")  # adapter 1's row
    dy[2, 3] = float("inf")  # adapter 1's row
    A[5, 2] = float("nan")  # adapter 2's weight (offset 5, rank 1)
    segs = make_segments(ts, False)
    h = cpu_ops.lora_shrink(x, A, segs, table)
    y = cpu_ops.lora_expand(h, B, segs, table, torch.zeros(7, 6))
    dh, dB = cpu_ops.lora_expand_bwd(dy, h, B, segs, table)
    dx, dA = cpu_ops.lora_shrink_bwd(dh, x, A, segs, table)
    clean_rows = (ts == 0) | (ts == -1)
    for name, v in (("h", h), ("y", y), ("dh", dh), ("dx", dx)):
        assert torch.isfinite(v[clean_rows]).all(), f"{name}: adapter 0's or base rows got another's non-finite"
    assert torch.isfinite(dB[:, 0:2]).all() and torch.isfinite(dA[0:2]).all(), "adapter 0's gradients"
    assert not torch.isfinite(dA[2:5]).all() and not torch.isfinite(y[5]).all()  # the poisoned adapters' own


def test_rows_grouping_is_cached_per_forward_and_slices_contiguous_rows():
    ts = torch.tensor([2, 2, 2, -1, 0, 1, 0, 1, 1])
    segs = make_segments(ts, False)
    live = cpu_ops._rows(segs)
    assert [a for a, _ in live] == [0, 1, 2]  # slots with rows only, ascending
    rows = dict(live)
    assert rows[2] == slice(0, 3)  # one contiguous run: a view
    assert torch.equal(rows[0], torch.tensor([4, 6])) and torch.equal(rows[1], torch.tensor([5, 7, 8]))
    assert cpu_ops._rows(segs) is live
    assert cpu_ops._rows(make_segments(torch.tensor([-1, 5, 5]), False)) == [(5, slice(1, 3))]


def test_the_torch_backend_takes_them_on_a_cpu_in_eager_mode_only(monkeypatch):
    from fast_multilora.function import TorchBackend

    ts, table, t, _ = _inputs("S37-K23-N19-mixed", torch.float32, False)
    calls = []
    monkeypatch.setattr(cpu_ops, "lora_shrink", lambda *a, **k: calls.append("cpu") or ref.lora_shrink(*a, **k))
    TorchBackend().shrink(t["x"], t["A"], make_segments(ts, False), table, 1, None)
    assert calls == ["cpu"]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    TorchBackend().shrink(t["x"], t["A"], make_segments(ts, False), table, 1, None)
    assert calls == ["cpu"]  # traced: the reference (static shapes)
