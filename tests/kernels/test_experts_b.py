"""MoE experts tables (``AdapterTable.experts = E > 1``): the expand kernels read the adapter store's packed B block
holding each adapter's B in PEFT's experts layout, and the expand backward writes the blocked dB in that layout.

A table over virtual slots ``v = e * (n + 1) + a + 1`` (``fast_multilora/moe.py``), slot ``e * (n + 1)`` of each
expert base with rank 0; adapter ``a`` of rank ``r_a`` holds ``offsets[v] = off_a + e * r_a`` and its PEFT weight
``[N, r_a * E]`` (expert ``e`` in the strided columns ``j*E + e``) lies as it is at element ``N * off_a`` of the block.
The oracle: ``fast_multilora.reference`` on the expert-major ``B_cat[N, total_rank]`` the block stands for, built
here column by column from the PEFT weights (``weight.view(N, r, E)[..., e]``), not from the kernels' arithmetic.

Shapes that find addressing bugs: unequal ranks incl. rank 1, an absent adapter (rank-0 slots), free rows (holes)
in the block before adapters and at its end -- NaN, so a read of them fails --, odd N and K, one-token segments,
interleaved unsorted slots, base tokens of both kinds (slot -1 and the experts' rank-0 base slots). Outputs are
NaN-poisoned; a blocked dB's holes must stay NaN (nothing writes outside its slot's elements).

Tolerances, as ``test_forward.py`` / ``test_backward.py`` defend them: the forward against an fp64 reference with
``helpers.assert_close_lowp`` (fp32: rtol 1e-5; fp16: at most twice torch's own fp16 error); the backward's dh and
dB with ``helpers.assert_close_max`` (``TOL``: fp32 2e-5, fp16 4e-3 of max|ref|: one fp16 rounding of h / dh
before each dot, fp32 accumulation). Where the same kernel runs on the same values through another addressing (a
2-D expert-major ``B_cat``), the results must be equal bit for bit: same tiles, same summation order.
"""

from dataclasses import dataclass

import pytest
import torch
from fast_multilora.kernels.backward import lora_expand_bwd
from fast_multilora.kernels.decode import lora_shrink_expand
from fast_multilora.kernels.forward import lora_expand
from fast_multilora.kernels.segments import AdapterTable, grouped_segments
from helpers import DTYPE_IDS, KERNEL_DTYPES, assert_close_lowp, assert_close_max, make_segments, poisoned

from fast_multilora import reference as ref


@dataclass
class MoeCase:
    S: int
    K: int
    N: int
    E: int
    ranks: list  # per model adapter; 0 = absent from the layer
    holes: list  # free rows of the block before each adapter, and (last entry) at its end
    base_frac: float = 0.15

    def id(self, dtype):
        return (f"S{self.S}-K{self.K}-N{self.N}-E{self.E}-R{'.'.join(map(str, self.ranks))}-"
                f"H{'.'.join(map(str, self.holes))}-{DTYPE_IDS[dtype]}")


CASES = [
    # ranks <= 16: the fused expand backward; N = 123: two N-tiles and N-splits (partial dh)
    MoeCase(S=41, K=37, N=123, E=3, ranks=[3, 1, 0, 5], holes=[0, 2, 1, 4, 3]),
    # a rank-40 adapter: rank tile 64, the unfused expand backward (dB recomputed from dy); N = 45: one N-tile,
    # dh written directly; a hole first
    MoeCase(S=33, K=19, N=45, E=4, ranks=[1, 40, 6], holes=[5, 0, 3, 0]),
]


def _params(cases, dtypes):
    return [pytest.param(c, dt, id=c.id(dt)) for c in cases for dt in dtypes]


def moe_table(case: MoeCase, device) -> tuple:
    """``(table, adapter offsets)``: the experts table over ``E * (n + 1)`` virtual slots, as moe.py lays it out,
    with the case's holes in the block."""
    n, E = len(case.ranks), case.E
    spe = n + 1
    n_v = E * spe
    ranks, offsets, scales = [0] * n_v, [0] * n_v, [0.0] * n_v
    off_a, acc = [], 0
    for a, r in enumerate(case.ranks):
        acc += case.holes[a]
        off_a.append(acc)
        for e in range(E):
            v = e * spe + a + 1
            ranks[v], offsets[v] = r, (acc + e * r if r else 0)
            scales[v] = 0.5 + 0.25 * a + 0.125 * e  # per (expert, adapter): a swapped slot shows
        acc += E * r
    total = acc + case.holes[n]
    table = AdapterTable(
        ranks=torch.tensor(ranks, dtype=torch.int32, device=device),
        offsets=torch.tensor(offsets, dtype=torch.int32, device=device),
        scales=torch.tensor(scales, dtype=torch.float32, device=device),
        dropout=torch.zeros(n_v, dtype=torch.float32, device=device),
        max_rank=max(ranks), total_rank=total, has_dropout=False, experts=E,
    )
    return table, off_a


def build(case: MoeCase, dtype, layout: str, device, gen) -> dict:
    table, off_a = moe_table(case, device)
    n_v, E, N = table.ranks.numel(), case.E, case.N
    R, R_tot = table.max_rank, table.total_rank
    ts = torch.randint(0, n_v, (case.S,), generator=gen)
    ts[torch.rand(case.S, generator=gen) < case.base_frac] = -1
    ranks_h = table.ranks.cpu()
    live = (ts >= 0) & (ranks_h[ts.clamp(min=0)] > 0)
    assert live.sum() >= case.S // 3 and (ts == -1).any() and (~live & (ts >= 0)).any(), "degenerate draw"
    if layout == "grouped":  # moe.py's: one segment per virtual slot, empty ones included
        segs = grouped_segments(ts.to(device=device, dtype=torch.int32), n_v)
    else:
        segs = make_segments(ts, layout == "chunked", device=device)
    # the packed block: NaN holes, each adapter's PEFT weight [N, r*E] as it is at N * off_a; and the expert-major
    # B_cat it stands for, column by column
    block = torch.full((N * R_tot,), float("nan"), dtype=torch.float64)
    B_cat = torch.full((N, R_tot), float("nan"), dtype=torch.float64)
    for a, r in enumerate(case.ranks):
        if r == 0:
            continue
        w = (torch.randn(N, r * E, generator=gen, dtype=torch.float64) / 4).to(dtype).double()
        block[N * off_a[a] : N * (off_a[a] + r * E)] = w.reshape(-1)
        for e in range(E):
            B_cat[:, off_a[a] + e * r : off_a[a] + (e + 1) * r] = w.view(N, r, E)[..., e]
    h_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    r_tok = torch.where(live, ranks_h[ts.clamp(min=0)], 0)
    defined = torch.arange(R)[None, :] < r_tok[:, None]  # h / dh cells of a token's slot
    h = torch.where(defined, torch.randn(case.S, R, generator=gen, dtype=torch.float64), torch.nan)
    dy = torch.where(live[:, None], torch.randn(case.S, N, generator=gen, dtype=torch.float64), torch.nan)
    y0 = torch.where(live[:, None], torch.randn(case.S, N, generator=gen, dtype=torch.float64), torch.nan)
    return dict(table=table, off_a=off_a, segs=segs, ts=ts, live=live.to(device), defined=defined.to(device),
                block=block.to(device, dtype), B_cat=B_cat.to(device, dtype), h=h.to(device, h_dtype),
                dy=dy.to(device, dtype), y0=y0.to(device, dtype))


def _owned(case: MoeCase, off_a: list, R_tot: int, device) -> torch.Tensor:
    """bool ``[N * total_rank]``: the block's elements some adapter's weight holds (the rest are holes)."""
    m = torch.zeros(case.N * R_tot, dtype=torch.bool)
    for a, r in enumerate(case.ranks):
        m[case.N * off_a[a] : case.N * (off_a[a] + r * case.E)] = True
    return m.to(device)


def _peft_layout(case: MoeCase, off_a: list, dB_cat: torch.Tensor) -> torch.Tensor:
    """An expert-major ``[N, total_rank]`` gradient in the block's layout (holes NaN), column by column."""
    N, E = case.N, case.E
    flat = torch.full((N * dB_cat.shape[1],), float("nan"), dtype=dB_cat.dtype, device=dB_cat.device)
    for a, r in enumerate(case.ranks):
        if r:
            w = flat[N * off_a[a] : N * (off_a[a] + r * E)].view(N, r, E)
            for e in range(E):
                w[..., e] = dB_cat[:, off_a[a] + e * r : off_a[a] + (e + 1) * r]
    return flat


@pytest.mark.parametrize("layout", ["sgemm", "chunked", "grouped"])
@pytest.mark.parametrize("case,dtype", _params(CASES, KERNEL_DTYPES) + _params(CASES[:1], [torch.float64]))
def test_expand_reads_peft_experts_b_in_the_packed_block(case, dtype, layout, device):
    gen = torch.Generator().manual_seed(11)
    d = build(case, dtype, layout, device, gen)
    table, segs, live, h = d["table"], d["segs"], d["live"], d["h"]
    S, N, hi = case.S, case.N, torch.float64
    # the reference helper's view of the block agrees with the column-by-column B_cat (holes: zero there)
    owned_cols = ~torch.isnan(d["B_cat"][0])
    assert torch.equal(ref.packed_b_cat(d["block"], table, N)[:, owned_cols], d["B_cat"][:, owned_cols])

    # accumulate mode: base rows (slot -1 and rank-0 slots) stay NaN
    y = lora_expand(h, d["block"], segs, table, d["y0"].clone())
    assert torch.isnan(y[~live]).all(), "expand wrote rows of base tokens / rank-0 slots"
    y64 = ref.lora_expand(h.to(hi), d["B_cat"].to(hi), segs, table, d["y0"].to(hi, copy=True))
    y_lowp = ref.lora_expand(h.to(dtype), d["B_cat"], segs, table, d["y0"].clone())
    assert_close_lowp(y[live], y64[live], y_lowp[live], dtype, "expand (packed experts B)")
    # the 2-D expert-major B_cat keeps its meaning under an experts table: the same sums, bit for bit
    y2 = lora_expand(h, d["B_cat"], segs, table, d["y0"].clone())
    assert torch.equal(y2[live], y[live]), "2-D B_cat under an experts table != the packed block's result"

    # write mode, with and without a bias: every row defined, the poisoned y never read
    bias = torch.randn(N, generator=gen, dtype=torch.float64).to(device, dtype)
    for b in (None, bias):
        y = lora_expand(h, d["block"], segs, table, poisoned(S, N, dtype=dtype, device=device), accumulate=False,
                        bias=b)
        b64 = None if b is None else b.to(hi)
        y64 = ref.lora_expand(h.to(hi), d["B_cat"].to(hi), segs, table, torch.empty(S, N, dtype=hi, device=device),
                              accumulate=False, bias=b64)
        y_lowp = ref.lora_expand(h.to(dtype), d["B_cat"], segs, table, torch.empty_like(y), accumulate=False, bias=b)
        assert not torch.isnan(y).any(), "write-mode expand left rows unwritten"
        assert_close_lowp(y, y64, y_lowp, dtype, f"expand write mode, bias={b is not None}")


@pytest.mark.parametrize("layout", ["sgemm", "grouped"])
@pytest.mark.parametrize("case,dtype", _params(CASES, KERNEL_DTYPES) + _params(CASES[:1], [torch.float64]))
def test_expand_bwd_reads_and_writes_the_peft_experts_layout(case, dtype, layout, device):
    gen = torch.Generator().manual_seed(12)
    d = build(case, dtype, layout, device, gen)
    table, segs, defined = d["table"], d["segs"], d["defined"]
    N, R_tot = case.N, table.total_rank
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    want_dh, want_dB = ref.lora_expand_bwd(d["dy"], d["h"], d["B_cat"], segs, table)
    want_flat = _peft_layout(case, d["off_a"], want_dB)
    owned = _owned(case, d["off_a"], R_tot, device)

    # the packed block in, the blocked dB (the default for a packed B) out, both in PEFT's layout
    dh = poisoned(case.S, table.max_rank, dtype=acc, device=device)
    flat = poisoned(N * R_tot, dtype=acc, device=device)
    out_dh, out_dB = lora_expand_bwd(d["dy"], d["h"], d["block"], segs, table, dh=dh, dB_out=flat)
    assert out_dh is dh and out_dB is flat
    assert torch.isnan(dh[~defined]).all(), "dh written outside its slot's rows and columns"
    assert_close_max(dh[defined], want_dh[defined], dtype, "dh (packed experts B)")
    assert torch.isnan(flat[~owned]).all(), "blocked dB written in the block's holes"
    assert_close_max(flat[owned], want_flat[owned], dtype, "blocked dB (PEFT experts layout)")

    # the same sums through the other forms, bit for bit: [N, total_rank] dB (expert-major) from the packed block,
    # and from a 2-D expert-major B_cat both dB forms (a blocked one is in the block's layout whatever B's form)
    dB2 = poisoned(N, R_tot, dtype=acc, device=device)
    _, got = lora_expand_bwd(d["dy"], d["h"], d["block"], segs, table, dB_out=dB2, dB_blocked=False)
    owned_cols = ~torch.isnan(d["B_cat"][0])
    assert torch.isnan(got[:, ~owned_cols]).all(), "[N, total_rank] dB written in columns no slot owns"
    assert torch.equal(_peft_layout(case, d["off_a"], got)[owned], flat[owned]), "[N, total_rank] dB != blocked"
    dh3 = poisoned(case.S, table.max_rank, dtype=acc, device=device)
    flat3 = poisoned(N * R_tot, dtype=acc, device=device)
    lora_expand_bwd(d["dy"], d["h"], d["B_cat"], segs, table, dh=dh3, dB_out=flat3, dB_blocked=True)
    assert torch.equal(dh3[defined], dh[defined]), "dh from a 2-D B_cat != from the packed block"
    assert torch.equal(flat3[owned], flat[owned]) and torch.isnan(flat3[~owned]).all(), \
        "blocked dB from a 2-D B_cat != from the packed block"
    # a 16-bit blocked dB: the float32 sums rounded once, as they are stored
    if dtype != torch.float64:
        flat16 = poisoned(N * R_tot, dtype=torch.float16, device=device)
        lora_expand_bwd(d["dy"], d["h"], d["block"], segs, table, dB_out=flat16)
        assert torch.equal(flat16[owned], flat[owned].to(torch.float16)) and torch.isnan(flat16[~owned]).all()


def test_experts_table_errors(device):
    case = CASES[0]
    d = build(case, torch.float32, "grouped", device, torch.Generator().manual_seed(13))
    table, segs, n_v = d["table"], d["segs"], d["table"].ranks.numel()
    assert n_v == 15
    odd = table._replace(experts=4)
    with pytest.raises(ValueError, match="table.experts=4 does not divide the table's 15 slots"):
        lora_expand(d["h"], d["block"], segs, odd, d["y0"].clone())
    with pytest.raises(ValueError, match="table.experts=4 does not divide"):
        lora_expand_bwd(d["dy"], d["h"], d["block"], segs, odd)
    with pytest.raises(ValueError, match="table.experts must be a positive int"):
        lora_expand(d["h"], d["block"], segs, table._replace(experts=0), d["y0"].clone())
    # the decode kernel has no experts addressing: a clear error, not a wrong read
    x = torch.randn(case.S, case.K, device=device)
    A = torch.randn(table.total_rank, case.K, device=device)
    with pytest.raises(ValueError, match="MoE virtual slots .* not supported by the decode kernel"):
        lora_shrink_expand(x, A, d["block"], segs, table, d["y0"].clone())


def test_custom_ops_carry_the_experts(device):
    """``fast_multilora.ops`` (the launchers as torch custom ops, for torch.compile) rebuilds the table inside each op
    from its tensors and host ints: ``experts`` must travel with them, or a packed experts block is misread."""
    from fast_multilora import ops

    case = CASES[0]
    d = build(case, torch.float32, "grouped", device, torch.Generator().manual_seed(14))
    table, segs = d["table"], d["segs"]
    want = lora_expand(d["h"], d["block"], segs, table, d["y0"].clone())
    got = ops.lora_expand(d["h"], d["block"], segs, table, d["y0"].clone())
    assert torch.equal(got[d["live"]], want[d["live"]])
    want_dh, want_dB = lora_expand_bwd(d["dy"], d["h"], d["block"], segs, table)
    got_dh, got_dB = ops.lora_expand_bwd(d["dy"], d["h"], d["block"], segs, table)
    owned = _owned(case, d["off_a"], table.total_rank, device)
    assert torch.equal(got_dh[d["defined"]], want_dh[d["defined"]]) and torch.equal(got_dB[owned], want_dB[owned])
