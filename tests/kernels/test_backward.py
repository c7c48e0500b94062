"""Backward Triton kernels (kernels/backward.py) against the pure-PyTorch reference, both segment families.

On CPU the kernels run under the Triton interpreter with the small interpreter block table, so these shapes reach
every path: N-splits, multi-chunk slots, rank tiles, the unfused (large-rank) expand mode, base and rank-0 rows.
Outputs are NaN-poisoned buffers; don't-care inputs (base rows of x/dy, h/dh columns past a slot's rank) are NaN
too, so a kernel that reads or leaves anything it should not fails here.
"""

from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from fast_multilora.kernels.backward import lora_expand_bwd, lora_shrink_bwd
from fast_multilora.kernels.dropout import dropout_keep_mask, pack_keep_bits
from helpers import (
    DTYPE_IDS,
    KERNEL_DTYPES,
    assert_close_max,
    compile_for_sm90,
    make_segments,
    make_table,
    poisoned,
    random_token_slots,
)

from fast_multilora import reference as ref


@dataclass
class Case:
    S: int
    K: int
    N: int
    ranks: list
    layout: str = "random"  # helpers.random_token_slots: random (interleaved), runs, skewed
    stack: int = 1
    dropout: Optional[list] = None  # per-slot p; a seed is used when given
    base_frac: float = 0.1
    empty_slots: tuple = ()  # slots whose tokens are moved to slot 0 (adapters without tokens)
    weights: str = "act"  # "act": weights in the activation dtype; "fp32": fp32 weights
    views: bool = False  # x / dy as column slices of wider tensors (row stride != width)

    def id(self, dtype):
        return f"S{self.S}-K{self.K}-N{self.N}-R{max(self.ranks)}-A{len(self.ranks)}-x{self.stack}-{self.layout}" + (
            "-drop" if self.dropout else "") + (f"-w{self.weights}" if self.weights != "act" else "") + (
            "-views" if self.views else "") + f"-{DTYPE_IDS[dtype]}"


CASES = [
    # large N (finish tiles, N-splits, ragged N), ranks 1..64: 64 puts the expand in its unfused mode
    Case(63, 123, 2049, [1, 5, 16, 0, 33, 64, 7, 2], empty_slots=(6,)),
    # rank 1 everywhere, one-token segments (interleaved), fp32 weights
    Case(37, 123, 45, [1, 1, 1, 1], weights="fp32"),
    # 70 slots, most without tokens, some rank 0
    Case(40, 37, 29, [(i * 7) % 6 for i in range(70)]),
    # stacked q/k/v: stack*rank = 192 > the interpreter's rank tile (several rank tiles), skewed layout
    Case(33, 123, 77, [64, 1, 20], layout="skewed", stack=3),
    # gate/up pair, runs layout, ranks not multiples of the block, dropout from a seed
    Case(50, 70, 66, [9, 3, 17, 0], layout="runs", stack=2, dropout=[0.25, 0.0, 0.5, 0.1]),
    # dropout, interleaved, strided views, ranks <= 32 (fused expand)
    Case(45, 96, 64, [8, 32, 3], dropout=[0.3, 0.3, 0.0], views=True, base_frac=0.3),
]
SEED = 1234


def _params(cases, dtypes):
    return [pytest.param(c, dt, id=c.id(dt)) for c in cases for dt in dtypes]


def build(case: Case, dtype, grouped: bool, device, gen):
    """Random inputs for one case: activations with NaN in rows LoRA must not read, poisoned h/dh don't-care cells."""
    n = len(case.ranks)
    ts = random_token_slots(case.S, n, gen, base_frac=case.base_frac, layout=case.layout)
    for a in case.empty_slots:
        ts[ts == a] = 0
    table = make_table(case.ranks, dropout=case.dropout, device=device)
    segs = make_segments(ts, grouped, device=device)
    ranks = torch.tensor(case.ranks)
    live = (ts >= 0) & (ranks[ts.clamp(min=0)] > 0)  # rows LoRA touches
    R, R_tot, st = max(case.ranks), sum(case.ranks), case.stack
    wdt = torch.float32 if case.weights == "fp32" else dtype

    def act(cols):
        t = torch.randn(case.S, cols + (5 if case.views else 0), generator=gen).to(dtype)
        t[~live] = float("nan")
        return (t[:, :cols] if case.views else t).to(device)

    def rank_cols(width_per_rank):  # fp32 [S, stack*R]: valid cells random, the rest NaN
        t = torch.full((case.S, st * R), float("nan"))
        for i in torch.nonzero(live).reshape(-1).tolist():
            r = case.ranks[int(ts[i])]
            t[i, : st * r] = torch.randn(st * r, generator=gen) * width_per_rank
        return t.to(torch.float64 if dtype == torch.float64 else torch.float32).to(device)

    x, dy = act(case.K), act(case.N)
    A = (torch.randn(st * R_tot, case.K, generator=gen) / case.K**0.5).to(wdt).to(device)
    B = (torch.randn(case.N, R_tot, generator=gen) / 4).to(wdt).to(device)
    h, dh_in = rank_cols(1.0), rank_cols(1.0)
    seed = SEED if case.dropout else None
    keep = dropout_keep_mask(seed, segs, table, case.K, st) if seed is not None else None  # a mask per slice
    return dict(ts=ts, live=live, table=table, segs=segs, x=x, dy=dy, A=A, B=B, h=h, dh_in=dh_in, seed=seed,
                keep=keep)


def slot_cols(case, a, stack=1):  # columns (dB) or rows (dA, with stack) of slot a in the concatenated weights
    off = sum(case.ranks[:a])
    return slice(stack * off, stack * (off + case.ranks[a]))


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("case,dtype", _params(CASES, KERNEL_DTYPES))
def test_expand_bwd_matches_reference(case, dtype, grouped, device):
    gen = torch.Generator().manual_seed(0)
    d = build(case, dtype, grouped, device, gen)
    S, st, R, R_tot = case.S, case.stack, max(case.ranks), sum(case.ranks)
    dh = poisoned(S, st * R, dtype=d["h"].dtype, device=device)  # one buffer for all slices, as autograd uses it
    dh_ref = torch.full_like(dh, float("nan"))
    for s in range(st):
        dB = poisoned(case.N, R_tot, dtype=d["h"].dtype, device=device)
        out_dh, out_dB = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], stack_num=st, slice_idx=s,
                                         dh=dh, dB_out=dB)
        assert out_dh is dh and out_dB is dB
        want_dh, want_dB = ref.lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], stack_num=st,
                                               slice_idx=s, dh=dh_ref)
        assert_close_max(dB, want_dB, dtype, f"dB slice {s}")
        for a in range(len(case.ranks)):
            if not bool((d["ts"] == a).any()):
                assert torch.equal(dB[:, slot_cols(case, a)], torch.zeros_like(dB[:, slot_cols(case, a)])), \
                    f"dB of slot {a} (no tokens) not zero"
    written = ~torch.isnan(dh_ref)  # adapter rows x their stack*rank columns
    expect = torch.zeros_like(written)
    for i in torch.nonzero(d["live"]).reshape(-1).tolist():
        expect[i, : st * case.ranks[int(d["ts"][i])]] = True
    assert torch.equal(written.cpu(), expect.cpu())
    assert_close_max(dh[written], dh_ref[written], dtype, "dh (adapter cells)")
    assert torch.isnan(dh[~written]).all(), "dh written outside the adapter rows / columns"


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("case,dtype", _params(CASES, KERNEL_DTYPES))
def test_shrink_bwd_matches_reference(case, dtype, grouped, device):
    gen = torch.Generator().manual_seed(1)
    d = build(case, dtype, grouped, device, gen)
    S, K, st, R_tot = case.S, case.K, case.stack, sum(case.ranks)
    dx = poisoned(S, K, dtype=dtype, device=device)
    dA = poisoned(st * R_tot, K, dtype=d["h"].dtype, device=device)
    out_dx, out_dA = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], stack_num=st, seed=d["seed"],
                                     dx_out=dx, dA_out=dA)
    assert out_dx is dx and out_dA is dA
    want_dx, want_dA = ref.lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], stack_num=st,
                                           keep=d["keep"])
    assert_close_max(dx, want_dx, dtype, "dx")
    assert torch.equal(dx[~d["live"].to(device)], torch.zeros_like(dx[~d["live"].to(device)])), "dx base rows not zero"
    assert_close_max(dA, want_dA, dtype, "dA")
    for a in range(len(case.ranks)):
        if not bool((d["ts"] == a).any()):
            rows = slot_cols(case, a, st)
            assert torch.equal(dA[rows], torch.zeros_like(dA[rows])), f"dA of slot {a} (no tokens) not zero"
    if d["seed"] is not None and st == 1:
        # the forward's packed mask instead of the seed: the same draw, so the same bits out
        packed = pack_keep_bits(d["keep"])
        dx2, dA2 = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], seed=d["seed"], keep=packed)
        # (values, not bits: a dropped element's dx is +0 from the stored mask's select, -0 or +0 from the redrawn
        # mask's multiply)
        assert torch.equal(dx2, dx) and torch.equal(dA2, dA), "stored mask != redrawn mask"
        # and the mask is read, not redrawn: another mask gives that mask's gradients
        other = dropout_keep_mask(d["seed"] + 1, d["segs"], d["table"], K)
        dx3, dA3 = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], seed=d["seed"],
                                   keep=pack_keep_bits(other))
        want_dx, want_dA = ref.lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], keep=other)
        assert_close_max(dx3, want_dx, dtype, "dx from a stored mask")
        assert_close_max(dA3, want_dA, dtype, "dA from a stored mask")


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("case,dtype", _params([CASES[0], CASES[5]], KERNEL_DTYPES))
def test_weight_grads_in_weight_dtype_and_blocked(case, dtype, grouped, device):
    """Weight gradients written in a 16-bit dtype (and dB blocked, one contiguous [N, r_a] piece per slot) are the
    float32 ones rounded once: bit for bit the same sums, cast as they are stored."""
    if dtype == torch.float64:
        pytest.skip("float64 accumulates and stores in float64")
    gen = torch.Generator().manual_seed(4)
    d = build(case, dtype, grouped, device, gen)
    N, K, R_tot = case.N, case.K, sum(case.ranks)
    dh, dB32 = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"])  # float32, [N, total_rank]
    _, dA32 = lora_shrink_bwd(dh, d["x"], d["A"], d["segs"], d["table"], seed=d["seed"])
    for gdt in (torch.float32, dtype):
        flat = poisoned(R_tot * N, dtype=gdt, device=device)
        _, got = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], dB_out=flat, dB_blocked=True)
        assert got is flat
        for a, r in enumerate(case.ranks):
            off = sum(case.ranks[:a])
            piece = flat[off * N : (off + r) * N].view(N, r)
            assert torch.equal(piece, dB32[:, off : off + r].to(gdt)), f"dB of slot {a} ({gdt})"
        dA = poisoned(R_tot, K, dtype=gdt, device=device)
        _, got = lora_shrink_bwd(dh, d["x"], d["A"], d["segs"], d["table"], seed=d["seed"], dA_out=dA)
        assert got is dA and torch.equal(dA, dA32.to(gdt)), f"dA ({gdt})"
    with pytest.raises(ValueError, match="dB_out"):  # the blocked buffer is flat
        lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], dB_out=dB32, dB_blocked=True)
    with pytest.raises(ValueError, match="blocked dB_out must be contiguous"):
        strided = torch.empty(2 * R_tot * N, device=device)[::2]
        lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], dB_out=strided, dB_blocked=True)


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("case,dtype", _params([Case(37, 45, 29, [3, 5, 0, 2, 16], empty_slots=(1,)), CASES[2]],
                                               KERNEL_DTYPES))
def test_weight_grads_accumulate_into_given_buffers(case, dtype, grouped, device):
    """``accumulate_dB`` / ``accumulate_dA`` (an adapter store's gradient arena): each slot with tokens gets its
    float32 gradient added to what the buffer holds, rounded once (bit for bit ``(held + grad).to(dtype)``); every
    slot without tokens, of rank 0 or past the last slot keeps its values (no work for adapters outside the batch)."""
    if dtype == torch.float64:
        pytest.skip("float64 accumulates and stores in float64")
    gen = torch.Generator().manual_seed(5)
    d = build(case, dtype, grouped, device, gen)
    N, K, R_tot = case.N, case.K, sum(case.ranks)
    dh, dB32 = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"])
    _, dA32 = lora_shrink_bwd(dh, d["x"], d["A"], d["segs"], d["table"], seed=d["seed"])
    used = set(d["ts"][d["ts"] >= 0].tolist())
    assert any(r > 0 and a not in used for a, r in enumerate(case.ranks)), "the case needs a slot without tokens"
    for gdt in (torch.float32, dtype):
        held_b = torch.randn(R_tot * N, generator=gen).to(gdt).to(device)
        flat = held_b.clone()
        _, got = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], dB_out=flat, dB_blocked=True,
                                 accumulate_dB=True)
        assert got is flat
        held_a = torch.randn(R_tot, K, generator=gen).to(gdt).to(device)
        dA = held_a.clone()
        _, got = lora_shrink_bwd(dh, d["x"], d["A"], d["segs"], d["table"], seed=d["seed"], dA_out=dA,
                                 accumulate_dA=True)
        assert got is dA
        for a, r in enumerate(case.ranks):
            off = sum(case.ranks[:a])
            piece, before = flat[off * N : (off + r) * N].view(N, r), held_b[off * N : (off + r) * N].view(N, r)
            rows, rows_before = dA[off : off + r], held_a[off : off + r]
            if a in used:
                assert torch.equal(piece, (before.float() + dB32[:, off : off + r]).to(gdt)), f"dB slot {a} ({gdt})"
                assert torch.equal(rows, (rows_before.float() + dA32[off : off + r]).to(gdt)), f"dA slot {a} ({gdt})"
            else:
                assert torch.equal(piece, before) and torch.equal(rows, rows_before), f"slot {a} without tokens"
    with pytest.raises(ValueError, match="accumulate_dB needs dB_out"):
        lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], dB_blocked=True, accumulate_dB=True)
    with pytest.raises(ValueError, match="accumulate_dA needs dA_out"):
        lora_shrink_bwd(dh, d["x"], d["A"], d["segs"], d["table"], seed=d["seed"], accumulate_dA=True)


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("case,dtype", _params([c for c in CASES if c.stack == 1] + [
    Case(41, 123, 30, [5, 16, 2], layout="runs", dropout=[0.5, 0.0, 0.2]),
], KERNEL_DTYPES))
def test_da_alone_matches_reference(case, dtype, grouped, device):
    """``need_dx=False`` (an input without gradient) runs the shrink backward with its own block table and chunking:
    dA == the reference, and == the dA of the full pass."""
    gen = torch.Generator().manual_seed(3)
    d = build(case, dtype, grouped, device, gen)
    R_tot = sum(case.ranks)
    none, dA = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], seed=d["seed"], need_dx=False,
                               dA_out=poisoned(R_tot, case.K, dtype=d["h"].dtype, device=device))
    _, want = ref.lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], keep=d["keep"], need_dx=False)
    _, full = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], seed=d["seed"])
    assert none is None
    assert_close_max(dA, want, dtype, "dA alone")
    assert_close_max(dA, full, dtype, "dA alone vs the full pass")
    if d["seed"] is not None:  # from the forward's packed mask (here: another seed's, so reading it is visible)
        other = dropout_keep_mask(d["seed"] + 1, d["segs"], d["table"], case.K)
        _, dA2 = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], seed=d["seed"], need_dx=False,
                                 keep=pack_keep_bits(other))
        _, want2 = ref.lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], keep=other, need_dx=False)
        assert_close_max(dA2, want2, dtype, "dA alone from a stored mask")


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("case", [CASES[3], CASES[4]], ids=["x3-R64-unfused", "x2-drop-fused"])
def test_bit_identical_reruns(case, grouped, device):
    gen = torch.Generator().manual_seed(2)
    d = build(case, torch.float16, grouped, device, gen)
    runs = []
    for _ in range(2):
        segs = make_segments(d["ts"], grouped, device=device)  # fresh cache: the grouping is rebuilt too
        e = lora_expand_bwd(d["dy"], d["h"], d["B"], segs, d["table"], stack_num=case.stack,
                            slice_idx=case.stack - 1)
        s = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], segs, d["table"], stack_num=case.stack, seed=d["seed"])
        runs.append(e + s)
    for a, b, name in zip(runs[0], runs[1], ["dh", "dB", "dx", "dA"], strict=True):
        assert torch.equal(bits(a), bits(b)), f"{name}: bits differ between two runs"


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_need_dx_false_and_defaults(grouped, device):
    case = CASES[4]
    d = build(case, torch.float32, grouped, device, torch.Generator().manual_seed(3))
    dx, dA = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], stack_num=case.stack, seed=d["seed"],
                             need_dx=False)
    assert dx is None
    _, want_dA = ref.lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], stack_num=case.stack,
                                     keep=d["keep"], need_dx=False)
    assert_close_max(dA, want_dA, torch.float32, "dA")
    dh, dB = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], stack_num=case.stack)  # dh allocated
    want_dh, want_dB = ref.lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], stack_num=case.stack)
    assert_close_max(dh, want_dh, torch.float32, "dh (zeros where unwritten)")
    assert_close_max(dB, want_dB, torch.float32, "dB")


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_float64(grouped, device):
    case = CASES[3]
    d = build(case, torch.float64, grouped, device, torch.Generator().manual_seed(4))
    dh, dB = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], stack_num=case.stack, slice_idx=1)
    want_dh, want_dB = ref.lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"], stack_num=case.stack,
                                           slice_idx=1)
    assert dh.dtype == dB.dtype == torch.float64
    assert_close_max(dB, want_dB, torch.float64, "dB")
    assert_close_max(dh, want_dh, torch.float64, "dh")
    dx, dA = lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], stack_num=case.stack)
    want_dx, want_dA = ref.lora_shrink_bwd(d["dh_in"], d["x"], d["A"], d["segs"], d["table"], stack_num=case.stack)
    assert dx.dtype == torch.float64 and dA.dtype == torch.float64
    assert_close_max(dx, want_dx, torch.float64, "dx")
    assert_close_max(dA, want_dA, torch.float64, "dA")


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("what", ["S0", "all-base", "all-rank0"])
def test_empty_inputs(what, grouped, device):
    S = 0 if what == "S0" else 9
    ranks = [0, 0] if what == "all-rank0" else [3, 2]
    ts = torch.full((S,), -1 if what == "all-base" else 1, dtype=torch.int64)
    table = make_table(ranks, device=device)
    segs = make_segments(ts, grouped, device=device)
    K, N, R, R_tot = 7, 5, max(ranks), sum(ranks)
    x, dy = torch.randn(S, K, device=device), torch.randn(S, N, device=device)
    h, dh_in = torch.randn(S, R, device=device), torch.randn(S, R, device=device)
    A, B = torch.randn(R_tot, K, device=device), torch.randn(N, R_tot, device=device)
    dh = poisoned(S, R, device=device)
    dh, dB = lora_expand_bwd(dy, h, B, segs, table, dh=dh, dB_out=poisoned(N, R_tot, device=device))
    assert torch.isnan(dh).all() and torch.equal(dB, torch.zeros(N, R_tot, device=device))
    dx, dA = lora_shrink_bwd(dh_in, x, A, segs, table, dx_out=poisoned(S, K, device=device),
                             dA_out=poisoned(R_tot, K, device=device))
    assert torch.equal(dx, torch.zeros(S, K, device=device)) and torch.equal(dA, torch.zeros(R_tot, K, device=device))


def test_no_adapters(device):
    table = make_table([], device=device)
    segs = make_segments(torch.full((4,), -1), False, device=device)
    dh, dB = lora_expand_bwd(torch.randn(4, 6, device=device), torch.zeros(4, 0, device=device),
                             torch.zeros(6, 0, device=device), segs, table)
    assert dh.shape == (4, 0) and dB.shape == (6, 0)
    dx, dA = lora_shrink_bwd(torch.zeros(4, 0, device=device), torch.randn(4, 3, device=device),
                             torch.zeros(0, 3, device=device), segs, table, dx_out=poisoned(4, 3, device=device))
    assert torch.equal(dx, torch.zeros(4, 3, device=device)) and dA.shape == (0, 3)


def test_validation_errors(device):
    table = make_table([2, 3], device=device)
    segs = make_segments(torch.tensor([0, 1, -1, 1]), False, device=device)
    dy, h, B = torch.randn(4, 5, device=device), torch.randn(4, 3, device=device), torch.randn(5, 5, device=device)
    x, dh, A = torch.randn(4, 7, device=device), torch.randn(4, 3, device=device), torch.randn(5, 7, device=device)
    with pytest.raises(ValueError, match="rows but segs.num_tokens"):
        lora_expand_bwd(dy[:3], h[:3], B, segs, table)
    with pytest.raises(ValueError, match="h must have shape"):
        lora_expand_bwd(dy, h[:, :2], B, segs, table)
    with pytest.raises(ValueError, match="B_cat must have shape"):
        lora_expand_bwd(dy, h, B[:, :4], segs, table)
    with pytest.raises(ValueError, match="slice_idx"):
        lora_expand_bwd(dy, h, B, segs, table, slice_idx=1)
    with pytest.raises(ValueError, match="dB_out dtype"):  # float32 sums are stored as float32 or 16-bit, not wider
        lora_expand_bwd(dy, h, B, segs, table, dB_out=torch.empty(5, 5, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="B_cat dtype"):  # any float dtype is cast to dy's; integers are not
        lora_expand_bwd(dy, h, B.int(), segs, table)
    with pytest.raises(ValueError, match="activation dtype"):
        lora_shrink_bwd(dh, x.int(), A, segs, table)
    with pytest.raises(ValueError, match="A_cat must have shape"):
        lora_shrink_bwd(dh, x, A[:4], segs, table)
    with pytest.raises(ValueError, match="dx_out given but need_dx=False"):
        lora_shrink_bwd(dh, x, A, segs, table, need_dx=False, dx_out=torch.empty_like(x))
    with pytest.raises(ValueError, match="dx_out dtype"):
        lora_shrink_bwd(dh, x, A, segs, table, dx_out=torch.empty_like(x, dtype=torch.float16))
    with pytest.raises(ValueError, match="seed must be an int"):
        lora_shrink_bwd(dh, x, A, segs, table, seed=1.5)


# ------------------------------------------------------------------------------------------------------------------
# GPU (FML_TEST_DEVICE=cuda on an H200): the benchmark shape, every 16-bit dtype and fp32, both families
# ------------------------------------------------------------------------------------------------------------------

GPU_CASE = Case(8192, 4096, 4096, [16] * 8, base_frac=0.05)
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["random", "runs"])
@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=[DTYPE_IDS[d] for d in GPU_DTYPES])
def test_gpu_benchmark_shape(dtype, grouped, layout, device):
    case = Case(**{**GPU_CASE.__dict__, "layout": layout, "dropout": [0.05] * 8, "stack": 1})
    d = build(case, dtype, grouped, device, torch.Generator().manual_seed(5))
    d["dy"] = torch.nan_to_num(d["dy"])  # real gradients are finite everywhere
    d["x"] = torch.nan_to_num(d["x"])
    outs = []
    for _ in range(2):
        dh, dB = lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"])
        dx, dA = lora_shrink_bwd(dh, d["x"], d["A"], d["segs"], d["table"], seed=d["seed"])
        outs.append((dh, dB, dx, dA))
    for a, b, name in zip(*outs, ["dh", "dB", "dx", "dA"], strict=True):
        assert torch.equal(bits(a), bits(b)), f"{name} not bit-identical across runs"
    dh, dB, dx, dA = outs[0]
    want_dh, want_dB = ref.lora_expand_bwd(d["dy"], d["h"], d["B"], d["segs"], d["table"])
    want_dx, want_dA = ref.lora_shrink_bwd(want_dh, d["x"], d["A"], d["segs"], d["table"], keep=d["keep"])
    assert_close_max(dB, want_dB, dtype, "dB")
    assert_close_max(dh, want_dh, dtype, "dh")
    assert_close_max(dA, want_dA, dtype, "dA")
    assert_close_max(dx, want_dx, dtype, "dx")


# ------------------------------------------------------------------------------------------------------------------
# CPU-only compile check: the GPU table's main configs must compile for sm_90 (frontend + ptxas, no GPU needed)
# without register spills. Catches what the interpreter cannot: layout/lowering failures and spilling tiles.
# ------------------------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r'''
import sys
import torch
import triton
from fast_multilora.kernels import backward as B
from fast_multilora.kernels.configs import block_config, rows as config_rows
from tune_kernels import sass_loop, sm90_kernel

INNER = {"stride_dyn", "stride_hr", "stride_br", "stride_dhr", "stride_xk", "stride_ak", "stride_dxk", "stride_pdr",
         "stride_pbr", "stride_pak", "stride_dbr", "stride_dak"}  # unit strides: specialised to 1 at launch

def spills(kernel, types, consts, num_warps):
    fn = kernel if isinstance(kernel, triton.runtime.jit.JITFunction) else kernel.fn
    consts = dict(consts, **{n: 1 for n in fn.arg_names if n in INNER})
    use = sass_loop(sm90_kernel(fn, types, consts, num_warps))
    print(fn.__name__, consts.get("BLOCK_S"), consts.get("BLOCK_R"), consts.get("W_OFFS"), consts.get("LOAD_MASK"),
          f"REG:{use['regs']} STACK:{use['stack']}")
    return use["stack"]

act = "bf16"
ptr = {n: "*fp32" for n in ("h", "dh", "part_dh", "part_dB", "scales", "dB", "part_dA", "dropout")}
ptr.update({n: "*" + act for n in ("dy", "B", "x", "A", "dx")})
ptr.update({n: "*i32" for n in ("order", "info", "ranks", "offsets", "cptr")})
ptr["keep_bits"] = "*u8"
ptr["w_offs"] = "*i64"  # W_OFFS: each adapter's weight read in place (segments.SlotWeights), the layers' path
bad = 0
# B's forms: concatenated, each adapter's weight read in place, the adapter store's packed block (and its MoE
# experts form: PEFT's strided experts weights, E = 8)
B_FORMS = ((False, False, 1), (True, False, 1), (False, True, 1), (False, True, 8))
for row in config_rows("expand_bwd", "h200"):  # the 16-bit rows of rank tile 16, by N
    if row.get("rank_tile") != 16 or "bfloat16" not in row.get("dtypes", ["bfloat16"]):
        continue
    BS, BN, nw, fused = row["BLOCK_S"], row["BLOCK_N"], row["num_warps"], row["fused"]
    for w_offs, packed, experts in B_FORMS:
        bad += spills(B._expand_bwd_kernel, ptr, dict(DIRECT_DH=False, STORE_DB=fused, EVEN_N=True,
                                                      DOT_PRECISION="tf32", W_OFFS=w_offs, B_PACKED=packed,
                                                      EXPERTS=experts, BLOCK_S=BS, BLOCK_N=BN, BLOCK_R=16), nw)
# dB as [N, total_rank], or blocked in the weights' layout (and the MoE experts one)
# (ACCUMULATE: the store's gradient arena added into)
for blocked, experts, accumulate in ((False, 1, False), (True, 1, False), (True, 8, False), (True, 1, True)):
    bad += spills(B._expand_bwd_finish, ptr, dict(FROM_PARTS=fused, DOT_PRECISION="tf32", BLOCK_S=BS,
                                                  BLOCK_N=B._FINISH_TILE // 16, BLOCK_R=16, DB_BLOCKED=blocked,
                                                  EXPERTS=experts, ACCUMULATE=accumulate), 8)
for need_dx, op in ((True, "shrink_bwd"), (False, "shrink_bwd_da")):
    for stack, block_r in ((1, 16), (3, 64)):  # one mask; a mask per slice of a q/k/v stack (3 x r=16 in one tile)
        cfg = block_config(op, dtype=torch.bfloat16, rank_tile=block_r, target="h200")
        BS, BK, nw = cfg["BLOCK_S"], cfg["BLOCK_K"], cfg["num_warps"]
        if stack > 1:  # the launcher's rule for a mask per slice
            BS, nw = min(BS, 32), max(nw, 8)
        for load_mask in ((False, True) if stack == 1 else (False,)):  # the forward's stored mask, or redrawn
            bad += spills(B._shrink_bwd_kernel, ptr, dict(NEED_DX=need_dx, HAS_DROPOUT=True, LOAD_MASK=load_mask,
                                                          HOIST_A=True, EVEN_K=True, DOT_PRECISION="tf32",
                                                          W_OFFS=False, BLOCK_S=BS, BLOCK_K=BK, BLOCK_R=block_r,
                                                          DROP_STACK=stack),
                          nw)
# the training step's rows: 16-bit, one rank tile of 16, by the dropout mask's source
for row in config_rows("shrink_bwd_r16", "h200"):
    mode = row["mode"]
    for w_offs in (False, True):
        BS, BK, nw, _stages = B._shrink_r16_tile(mode, min(row.get("max_width", 8192), 8192), "h200")  # rule
        bad += spills(B._shrink_bwd_kernel, ptr, dict(NEED_DX=True, HAS_DROPOUT=mode != "none",
                                                      LOAD_MASK=mode == "stored", HOIST_A=True, EVEN_K=True,
                                                      DOT_PRECISION="tf32", W_OFFS=w_offs, BLOCK_S=BS, BLOCK_K=BK,
                                                      BLOCK_R=16, DROP_STACK=1), nw)
# the forward shrink with a mask per slice (dropout on a q/k/v stack), the dropout table's r <= 32 row
from fast_multilora.kernels.sgemm import sgemm_shrink_kernel
row = config_rows("shrink_dropout", "h200")[-1]
BS, BK, nw = row["BLOCK_S"], row["BLOCK_K"], row["num_warps"]
ptr.update({n: "*i32" for n in ("indptr", "seg_slot")})
bad += spills(sgemm_shrink_kernel, ptr, dict(STACK=3, HAS_DROPOUT=True, STORE_MASK=False, EVEN_K=True,
                                             DOT_PRECISION="tf32", W_OFFS=False, BLOCK_S=BS, BLOCK_N=64,
                                             BLOCK_K=min(BK, 64)),
              nw)  # launcher's rule
row = config_rows("shrink_dropout_store", "h200")[0]  # r <= 32, storing the mask it draws
BS, BK, nw = row["BLOCK_S"], row["BLOCK_K"], row["num_warps"]
for w_offs in (False, True):
    bad += spills(sgemm_shrink_kernel, ptr, dict(STACK=1, HAS_DROPOUT=True, STORE_MASK=True, EVEN_K=True,
                                                 DOT_PRECISION="tf32", W_OFFS=w_offs, BLOCK_S=BS, BLOCK_N=16,
                                                 BLOCK_K=BK), nw)
# the forward expand's rows, add and write mode (16-bit y, one rank tile of 16)
from fast_multilora.kernels.sgemm import sgemm_expand_kernel
ptr.update(y="*" + act, bias="*" + act)
for accumulate, op in ((True, "expand_add"), (False, "expand_write")):
    for row, (w_offs, packed, experts) in ((row, f) for row in config_rows(op, "h200") for f in B_FORMS):
        BS, BN, nw, n_tiles = row["BLOCK_S"], row["BLOCK_N"], row["num_warps"], row["N_TILES"]
        bad += spills(sgemm_expand_kernel, dict(ptr, stride_hn=None), dict(
            FP64=False, DOT_PRECISION="tf32", ACCUMULATE=accumulate, HAS_BIAS=False, W_OFFS=w_offs,
            B_PACKED=packed, EXPERTS=experts, BLOCK_S=BS, BLOCK_N=BN, BLOCK_R=16, N_TILES=n_tiles, stride_hn=1,
            stride_yn=1), nw)
# the decode kernel's rows (few-row calls: shrink and expand in one launch), each rank bucket's BLOCK_R
from fast_multilora.kernels.decode import shrink_expand_kernel
ptr.update(token_slots="*i32", a_offs="*i64", b_offs="*i64")
# (weights concatenated, read in place, or the adapter store's A_cat and packed B block)
for row, (offs, packed) in ((row, o) for row in config_rows("decode", "h200")
                             for o in ((False, False), (True, False), (False, True))):
    BS, BN, BK, nw, bound = row["BLOCK_S"], row["BLOCK_N"], row["BLOCK_K"], row["num_warps"], row.get("max_width", 128)
    bad += spills(shrink_expand_kernel, dict(ptr, S="i32"), dict(
        A_OFFS=offs, B_OFFS=offs, B_PACKED=packed, FP64=False, ROUND=True, BLOCK_S=BS, BLOCK_N=BN, BLOCK_K=BK,
        BLOCK_R=int(min(bound, 128)), stride_xk=1, stride_ak=1, stride_yn=1), nw)
sys.exit(1 if bad else 0)
'''


@pytest.mark.slow
def test_gpu_table_compiles_for_sm90_without_spills():
    run = compile_for_sm90(_COMPILE_SCRIPT)
    assert run.returncode == 0, f"compile check failed:\n{run.stdout}\n{run.stderr[-3000:]}"
