"""The one-launch shrink + expand of few-row calls (``kernels/decode.py``) against the pure-PyTorch reference.

Both families' layouts (the kernel reads ``segs.token_slots``, which ``row_segments`` and ``grouped_segments``
carry), weights concatenated, read in place (``SlotWeights``, laid out in reverse slot order with NaN gaps) and
the adapter store's form (``A_cat`` with B as one packed 1-D block, slot ``a``'s ``[N, r_a]`` at ``N * offsets[a]``),
rank-0 slots, rank 1, K = 123, 1-token segments, 128 adapters, unsorted rows. ``y`` rows of base tokens and rank-0
slots are NaN and must stay NaN. Tolerances as ``test_forward.py`` (fp32: 1e-5 of max|ref| against fp64;
16-bit: at most twice torch's own 16-bit error plus 1e-6 of max|ref|); the 16-bit baseline rounds ``h`` to the
activation dtype, as the kernel's expand operands are.
"""

import pytest
import torch
from fast_multilora.kernels import configs
from fast_multilora.kernels.decode import lora_shrink_expand
from fast_multilora.kernels.segments import grouped_segments, row_segments, slot_weights
from helpers import DEVICE, KERNEL_DTYPE_PARAMS, assert_close_lowp, make_table, random_token_slots
from test_slot_weights import _scattered

from fast_multilora import reference as ref

_g = torch.Generator().manual_seed(128)
RANKS_128 = [int(r) if i % 7 else 0 for i, r in enumerate(torch.randint(1, 17, (128,), generator=_g))]

# S, K, N, ranks, layout
CASES = [
    pytest.param(16, 123, 77, [1, 5, 16, 0, 33, 7, 2, 4], "random", id="S16-K123-N77-R1to33-A8"),
    pytest.param(64, 64, 40, RANKS_128, "random", id="S64-K64-N40-R0to16-A128"),
    pytest.param(23, 40, 129, [1] * 5, "runs", id="S23-K40-N129-R1-A5-runs"),
    pytest.param(9, 16, 16, [64, 0, 3], "skewed", id="S9-K16-N16-R64-A3-skewed"),
]
LAYOUTS = [pytest.param(False, id="rows"), pytest.param(True, id="grouped")]
WEIGHTS = [pytest.param("cat", id="cat"), pytest.param("in-place", id="in-place"), pytest.param("packed", id="packed")]


def _weights(As, Bs, slots, n_slots, form):
    """The weight operands of one of the three forms (see the module docstring), from the slots' ``As`` / ``Bs``."""
    if form == "in-place":
        A, B = slot_weights(As, slots, n_slots, 0), slot_weights(Bs, slots, n_slots, 1)
        assert A is not None and B is not None
        return A, B
    A_cat = torch.cat(As)
    if form == "packed":
        return A_cat, torch.cat([b.reshape(-1) for b in Bs])
    return A_cat, torch.cat(Bs, 1)


def _segments(ts, grouped, n_slots):
    t = ts.to(DEVICE, torch.int32)
    return grouped_segments(t, n_slots) if grouped else row_segments(t, 1, n_slots)


def _live(ts, ranks):
    return torch.tensor([a >= 0 and ranks[a] > 0 for a in ts.tolist()], dtype=torch.bool, device=DEVICE)


@pytest.mark.parametrize("form", WEIGHTS)
@pytest.mark.parametrize("grouped", LAYOUTS)
@pytest.mark.parametrize("dtype", KERNEL_DTYPE_PARAMS)
@pytest.mark.parametrize("S, K, N, ranks, layout", CASES)
def test_shrink_expand_matches_reference(S, K, N, ranks, layout, dtype, grouped, form):
    g = torch.Generator().manual_seed(S * 1000 + K + len(ranks))
    ts = random_token_slots(S, len(ranks), g, layout=layout)
    table = make_table(ranks, device=DEVICE)
    segs = _segments(ts, grouped, len(ranks))
    slots = tuple(s for s, r in enumerate(ranks) if r > 0)
    As = _scattered([(ranks[s], K) for s in slots], dtype, g, DEVICE)
    Bs = _scattered([(N, ranks[s]) for s in slots], dtype, g, DEVICE)
    A_cat, B_cat = torch.cat(As), torch.cat(Bs, 1)
    A, B = _weights(As, Bs, slots, len(ranks), form)
    x = torch.randn(S, K, generator=g).to(DEVICE, dtype)
    live = _live(ts, ranks)
    y_in = torch.where(live[:, None], torch.randn(S, N, generator=g).to(DEVICE, dtype), torch.nan)
    y = lora_shrink_expand(x, A, B, segs, table, y_in.clone())
    assert torch.isnan(y[~live]).all(), "wrote rows of base tokens / rank-0 slots"
    hi = torch.float64
    y64 = ref.lora_shrink_expand(x.to(hi), A_cat.to(hi), B_cat.to(hi), segs, table, y_in.to(hi))
    h_lowp = ref.lora_shrink(x, A_cat, segs, table).to(dtype)  # h as the 16-bit expand's operand
    y_lowp = ref.lora_expand(h_lowp, B_cat, segs, table, y_in.clone())
    assert_close_lowp(y[live], y64[live], y_lowp[live], dtype, "shrink_expand")


def test_float64_and_blocks_by_rank():
    """fp64 operands accumulate in fp64 (1e-12 of max|ref|), and every rank bucket of the GPU's rows is covered by
    a row of the table (a rank above the last bound would find none)."""
    S, K, N, ranks = 11, 37, 45, [3, 0, 9]
    g = torch.Generator().manual_seed(3)
    ts = random_token_slots(S, 3, g)
    table = make_table(ranks, device=DEVICE)
    x = torch.randn(S, K, generator=g, dtype=torch.float64).to(DEVICE)
    A = torch.randn(sum(ranks), K, generator=g, dtype=torch.float64).to(DEVICE)
    B = torch.randn(N, sum(ranks), generator=g, dtype=torch.float64).to(DEVICE)
    y0 = torch.randn(S, N, generator=g, dtype=torch.float64).to(DEVICE)
    for grouped in (False, True):
        segs = _segments(ts, grouped, 3)
        y = lora_shrink_expand(x, A, B, segs, table, y0.clone())
        want = ref.lora_shrink_expand(x, A, B, segs, table, y0.clone())
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12 * want.abs().max().item())
    for target in ("h200", "default", "interpreter"):  # every rank has a row
        assert "max_width" not in configs.rows("decode", target)[-1]


@pytest.mark.parametrize("what", ["no-tokens", "all-base", "all-rank0"])
def test_empty_inputs(what):
    S, K, N = {"no-tokens": 0}.get(what, 9), 16, 24
    ranks = [0, 0] if what == "all-rank0" else [4, 2]
    ts = torch.full((S,), -1) if what == "all-base" else torch.arange(S) % 2
    table = make_table(ranks, device=DEVICE)
    y0 = torch.randn(S, N, device=DEVICE)
    rec = []
    y = lora_shrink_expand(torch.randn(S, K, device=DEVICE), torch.randn(sum(ranks), K, device=DEVICE),
                           torch.randn(N, sum(ranks), device=DEVICE), _segments(ts, False, 2), table, y0.clone(),
                           record=rec)
    assert torch.equal(y, y0) and len(rec) == 1


def test_validation_errors():
    from fast_multilora.kernels.segments import segments_from_token_slots

    table = make_table([2, 3], device=DEVICE)
    ts = torch.tensor([0, 0, 1, -1])
    segs = _segments(ts, False, 2)
    x, A = torch.randn(4, 8, device=DEVICE), torch.randn(5, 8, device=DEVICE)
    B, y = torch.randn(6, 5, device=DEVICE), torch.zeros(4, 6, device=DEVICE)
    for msg, kw in {
        "A_cat must be": dict(A=A[:4]),
        "B_cat must be": dict(B=B[:, :4]),
        "packed B must have": dict(B=B.reshape(-1)[:29]),
        "y has 3 rows": dict(y=y[:3]),
        "segs covers": dict(x=x[:3]),
        "needs segs.token_slots": dict(segs=segments_from_token_slots(ts, False, device=DEVICE)),
        "must be 2-D": dict(x=x[None]),
    }.items():
        args = dict(x=x, A=A, B=B, y=y, segs=segs) | kw
        with pytest.raises(ValueError, match=msg):
            lora_shrink_expand(args["x"], args["A"], args["B"], args["segs"], table, args["y"])


def test_replay_of_a_recorded_call_takes_new_tensors():
    """A recorded call (``record=``) replays with other tensors of the same kinds: the launch plan's form."""
    S, K, N, ranks = 12, 32, 40, [4, 8]
    table = make_table(ranks, device=DEVICE)
    segs = _segments(torch.arange(S) % 3 - 1, True, 2)
    rec = []
    mk = lambda *s: torch.randn(*s, device=DEVICE)  # noqa: E731
    lora_shrink_expand(mk(S, K), mk(12, K), mk(N, 12), segs, table, mk(S, N), record=rec)
    x, A, B, y0 = mk(S, K), mk(12, K), mk(N, 12), mk(S, N)
    y = y0.clone()
    rec[0](x, A, B, y)
    torch.testing.assert_close(y, ref.lora_shrink_expand(x, A, B, segs, table, y0.clone()), rtol=1e-5, atol=1e-5)



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("K, N", [(2048, 2048), (2048, 256), (2048, 5632), (5632, 2048)])
@pytest.mark.parametrize("form", WEIGHTS)
def test_gpu_decode_shapes(K, N, form, dtype):
    """The benchmark model's decode step (``generate_dynamic``): 16 rows, 8 adapters of rank 16 and every fourth row
    ``__base__``, each projection's K x N; against the fp64 reference within the 16-bit rule."""
    g = torch.Generator().manual_seed(K + N)
    S, ranks = 16, [16] * 8
    ts = torch.tensor([-1 if i % 4 == 3 else i % 8 for i in range(S)])
    table = make_table(ranks, scales=[2.0] * 8, device="cuda")
    slots = tuple(range(8))
    As = _scattered([(16, K)] * 8, dtype, g, "cuda")
    Bs = _scattered([(N, 16)] * 8, dtype, g, "cuda")
    A_cat, B_cat = torch.cat(As), torch.cat(Bs, 1)
    A, B = _weights(As, Bs, slots, 8, form)
    x = torch.randn(S, K, generator=g).to("cuda", dtype)
    y0 = torch.randn(S, N, generator=g).to("cuda", dtype)
    live = (ts >= 0).cuda()
    for grouped in (False, True):
        segs = _segments(ts, grouped, 8)
        y = lora_shrink_expand(x, A, B, segs, table, y0.clone())
        assert torch.equal(y[~live], y0[~live])
        y64 = ref.lora_shrink_expand(x.double(), A_cat.double(), B_cat.double(), segs, table, y0.double())
        y_lowp = ref.lora_expand(ref.lora_shrink(x, A_cat, segs, table).to(dtype), B_cat, segs, table, y0.clone())
        assert_close_lowp(y[live], y64[live], y_lowp[live], dtype, f"shrink_expand grouped={grouped}")
