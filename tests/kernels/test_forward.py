"""Forward Triton launchers (``kernels/forward.py``) against the pure-PyTorch reference, both segment families.

CPU runs use the Triton interpreter (tests/conftest.py), so shapes stay small; the ``gpu`` tests at the benchmark
shape run with ``FML_TEST_DEVICE=cuda``. Outputs are NaN-poisoned: ``h`` entries the contract leaves undefined must
stay NaN (the kernel writes nothing outside its tiles), ``h`` fed to the expand has NaN in every don't-care entry
(the kernel must mask them), and ``y`` rows of tokens without a live adapter are NaN and must stay NaN.

Tolerances:
* fp32 (and fp64): rtol 1e-5 (1e-12), atol the same times max|ref|, against the fp64 reference: the kernel's
  fp32 dot products of <= 123 terms are a few ulp of the largest term off (observed ~1e-7 of max|ref|).
* fp16/bf16 (flash-attention's rule): the kernel's max error against an fp64 reference is at most twice the error
  of torch's own low-precision computation (the reference run on low-precision operands, its result rounded to
  the activation dtype), plus 1e-6 of max|ref| so an exact baseline cannot make the bound zero.
"""

import pytest
import torch
from fast_multilora.kernels.dropout import dropout_keep_mask, keep_bits_buffer, unpack_keep_bits
from fast_multilora.kernels.forward import lora_expand, lora_shrink
from fast_multilora.kernels.sgmv import chunk_table
from helpers import (
    DEVICE,
    KERNEL_DTYPE_PARAMS,
    assert_close_lowp,
    make_segments,
    make_table,
    poisoned,
    random_token_slots,
)

from fast_multilora import reference as ref

FAMILIES = [pytest.param(False, id="sgemm"), pytest.param(True, id="chunked")]

_g = torch.Generator().manual_seed(70)
RANKS_70 = [int(r) if i % 9 else 0 for i, r in enumerate(torch.randint(1, 9, (70,), generator=_g))]

# S, K, N, ranks, stack_num, layout, dropout p per slot (None: no dropout), weights in the activation dtype
CASES = [
    pytest.param(63, 123, 2049, [1] * 8, 1, "random", None, False, id="S63-K123-N2049-R1-A8"),
    pytest.param(48, 123, 77, [1, 5, 16, 0, 33, 64, 7, 2], 1, "runs", None, True, id="S48-K123-R1to64-A8-runs"),
    pytest.param(40, 123, 77, RANKS_70, 1, "random", None, False, id="S40-K123-R0to8-A70"),
    pytest.param(60, 64, 40, [4, 16, 3], 1, "skewed", None, True, id="S60-K64-R16-A3-skewed"),
    pytest.param(37, 123, 77, [2, 0, 13, 5], 2, "random", None, False, id="S37-K123-R13-A4-stack2"),
    pytest.param(37, 123, 77, [3, 17, 1], 3, "runs", [0.1, 0.5, 0.0], False, id="S37-K123-R17-A3-stack3-drop"),
    pytest.param(50, 123, 77, [8, 0, 33], 1, "skewed", [0.2, 0.3, 0.25], True, id="S50-K123-R33-A3-skewed-drop"),
]


def _defined(token_slots, ranks, stack):
    """Mask of the ``h`` entries the contract defines: rows of tokens of live adapters, columns < stack*rank."""
    r_tok = torch.tensor([ranks[a] if a >= 0 else 0 for a in token_slots.tolist()])
    return torch.arange(stack * max(ranks))[None, :] < (stack * r_tok)[:, None]


def _live_rows(token_slots, ranks):
    return torch.tensor([a >= 0 and ranks[a] > 0 for a in token_slots.tolist()], dtype=torch.bool)


def _run_case(S, K, N, ranks, stack, layout, ps, w_lowp, grouped, dtype, device, seed=1234):
    g = torch.Generator().manual_seed(S * 1000 + K + len(ranks))
    ts = random_token_slots(S, len(ranks), g, layout=layout)
    table = make_table(ranks, dropout=ps, device=device)
    segs = make_segments(ts, grouped, device=device)
    w_dtype = dtype if w_lowp else torch.float32
    R = sum(ranks)
    x = torch.randn(S, K, generator=g).to(device, dtype)
    A = (torch.randn(stack * R, K, generator=g) / K**0.5).to(device, w_dtype)
    B = (torch.randn(N, R, generator=g) / 4).to(device, w_dtype)
    y0 = torch.randn(S, N, generator=g).to(device, dtype)
    width = stack * max(ranks)
    defined = _defined(ts, ranks, stack).to(device)
    live = _live_rows(ts, ranks).to(device)
    keep = dropout_keep_mask(seed, segs, table, K, stack) if ps is not None else None  # a mask per slice
    hi = torch.float64

    # shrink
    h_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    h = lora_shrink(x, A, segs, table, stack_num=stack, seed=seed if ps is not None else None,
                    out=poisoned(S, width, dtype=h_dtype, device=device))
    assert torch.isnan(h[~defined]).all(), "shrink wrote outside the rows/columns it owns"
    h64 = ref.lora_shrink(x.to(hi), A.to(hi), segs, table, stack_num=stack, keep=keep)
    h_lowp = ref.lora_shrink(x, A.to(dtype), segs, table, stack_num=stack, keep=keep).to(dtype)
    assert_close_lowp(h[defined], h64[defined], h_lowp[defined], dtype, "shrink")
    if ps is not None and stack == 1:  # a training forward stores the mask it drew, packed, for the backward
        bits = keep_bits_buffer(x).fill_(0xA5)  # a sentinel pattern: rows the kernel does not own keep it
        h2 = lora_shrink(x, A, segs, table, seed=seed, out=poisoned(S, width, dtype=h_dtype, device=device),
                         keep_out=bits)
        assert torch.equal(h2[defined], h[defined]), "storing the mask changed h"
        assert torch.equal(unpack_keep_bits(bits, K)[live], keep[live]), "stored mask != the mask the kernel drew"
        assert (bits[~live] == 0xA5).all(), "mask bytes written for rows without an adapter"

    # expand, every slice, from the fp64 reference h rounded to h's dtype with every don't-care entry NaN
    h_in = torch.where(defined, h64, torch.nan).to(h_dtype)
    y_in = torch.where(live[:, None], y0, torch.nan)
    for s in range(stack):
        y = lora_expand(h_in, B, segs, table, y_in.clone(), stack_num=stack, slice_idx=s)
        assert torch.isnan(y[~live]).all(), "expand wrote rows of base tokens / rank-0 slots"
        y64 = ref.lora_expand(h_in.to(hi), B.to(hi), segs, table, y_in.to(hi), stack_num=stack, slice_idx=s)
        y_lowp = ref.lora_expand(h_in.to(dtype), B.to(dtype), segs, table, y_in.clone(), stack_num=stack,
                                 slice_idx=s)
        assert_close_lowp(y[live], y64[live], y_lowp[live], dtype, f"expand slice {s}")

    # write mode (accumulate=False): the poisoned y is never read and every row is defined -- the product (+ bias)
    # on adapter rows, the bias (or zero) elsewhere; SGEMM segments with and without the base-run length known
    bias = torch.randn(N, generator=g, dtype=torch.float64).to(device, dtype)  # fp64: not fp32-representable
    variants = [segs] if grouped else [segs, segs._replace(base_max_len=-1, cache={})]
    for segs_v in variants:
        for b in (None, bias):
            s = stack - 1
            y = lora_expand(h_in, B, segs_v, table, poisoned(S, N, dtype=dtype, device=device), stack_num=stack,
                            slice_idx=s, accumulate=False, bias=b)
            b64 = None if b is None else b.to(hi)
            y64 = ref.lora_expand(h_in.to(hi), B.to(hi), segs, table, torch.empty(S, N, dtype=hi, device=device),
                                  stack_num=stack, slice_idx=s, accumulate=False, bias=b64)
            y_lowp = ref.lora_expand(h_in.to(dtype), B.to(dtype), segs, table, torch.empty_like(y), stack_num=stack,
                                     slice_idx=s, accumulate=False, bias=b)
            assert not torch.isnan(y).any(), "write-mode expand left rows unwritten"
            assert_close_lowp(y, y64, y_lowp, dtype, f"expand write mode, bias={b is not None}")


@pytest.mark.parametrize("dtype", KERNEL_DTYPE_PARAMS)
@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("S, K, N, ranks, stack, layout, ps, w_lowp", CASES)
def test_forward_matches_reference(S, K, N, ranks, stack, layout, ps, w_lowp, grouped, dtype, device):
    _run_case(S, K, N, ranks, stack, layout, ps, w_lowp, grouped, dtype, device)


@pytest.mark.parametrize("grouped", FAMILIES)
def test_float64(grouped, device):
    if grouped and device == "cuda":  # Triton's GPU compiler fails on the gathered fp64 dot: a clear error instead
        with pytest.raises(NotImplementedError, match="float64 activations with the chunked"):
            _run_case(29, 41, 33, [2, 0, 7], 2, "random", [0.0, 0.3, 0.5], False, grouped, torch.float64, device)
        return
    _run_case(29, 41, 33, [2, 0, 7], 2, "random", [0.0, 0.3, 0.5], False, grouped, torch.float64, device)


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("what", ["no-tokens", "all-base", "all-rank0"])
def test_empty_inputs(what, grouped, device):
    S, K, N = {"no-tokens": 0}.get(what, 9), 16, 24
    ranks = [0, 0] if what == "all-rank0" else [4, 2]
    ts = torch.full((S,), -1) if what == "all-base" else torch.arange(S) % 2
    table = make_table(ranks, device=device)
    segs = make_segments(ts, grouped, device=device)
    x = torch.randn(S, K, device=device)
    h = lora_shrink(x, torch.randn(sum(ranks), K, device=device), segs, table)
    assert h.shape == (S, max(ranks)) and h.dtype == torch.float32
    y0 = torch.randn(S, N, device=device)
    y = lora_expand(torch.zeros(S, max(ranks), device=device), torch.randn(N, sum(ranks), device=device), segs,
                    table, y0.clone())
    assert torch.equal(y, y0)


def test_chunk_table_covers_every_position_once():
    ts = torch.tensor([0] * 50 + [1] + [2] * 16 + [-1] * 3 + [3] * 17)[torch.randperm(87)]
    segs = make_segments(ts, grouped=True, device=DEVICE)
    table = chunk_table(segs, 16)
    assert chunk_table(segs, 16) is table  # cached per block size
    seen = []
    indptr = segs.indptr.tolist()
    for seg, start, end in table.tolist():
        if seg < 0:
            assert start == end == 0
            continue
        assert indptr[seg] <= start < end == min(start + 16, indptr[seg + 1])
        seen += range(start, end)
    assert sorted(seen) == list(range(segs.perm.numel()))


def test_validation_errors(device):
    table = make_table([2, 3], device=device)
    segs = make_segments(torch.tensor([0, 0, 1, -1]), grouped=False, device=device)
    x, A = torch.randn(4, 8, device=device), torch.randn(5, 8, device=device)
    h, B, y = torch.zeros(4, 3, device=device), torch.randn(6, 5, device=device), torch.zeros(4, 6, device=device)
    bad_shrink = {
        "must be 2-D": dict(x=x[None]),
        "contiguous in its last dim": dict(x=torch.randn(8, 4, device=device).T),
        "A_cat must be": dict(A=A[:4]),
        "segs covers": dict(x=x[:3]),
        "floating tensor": dict(x=x.to(torch.int32)),
        "seed must be": dict(seed=1.5),
        "out must be": dict(out=torch.zeros(4, 2, device=device)),
        "stack_num must be": dict(stack_num=0),
    }
    for msg, kw in bad_shrink.items():
        args = dict(x=x, A=A, seed=None, out=None, stack_num=1) | kw
        with pytest.raises(ValueError, match=msg):
            lora_shrink(args["x"], args["A"], segs, table, stack_num=args["stack_num"], seed=args["seed"],
                        out=args["out"])
    bad_expand = {
        "h must be": dict(h=h[:, :2]),
        "B_cat must be": dict(B=B[:, :4]),
        "slice_idx must be": dict(slice_idx=1),
        "segs covers": dict(h=h[:3], y=y[:3]),
    }
    for msg, kw in bad_expand.items():
        args = dict(h=h, B=B, y=y, slice_idx=0) | kw
        with pytest.raises(ValueError, match=msg):
            lora_expand(args["h"], args["B"], segs, table, args["y"], slice_idx=args["slice_idx"])
    if DEVICE == "cuda":
        with pytest.raises(ValueError, match="expected cuda"):
            lora_shrink(x, A.cpu(), segs, table)


# --- GPU: the benchmark shape (S=8192, K=N=4096, r=16, 8 adapters) and determinism -------------------------------

def _big_problem(grouped, dtype, ps=None, n=8):
    """The benchmark's shape (S = 8192, K = N = 4096, r = 16): ``n`` adapters in equal shares, or with ``n = 32``
    90 % of the tokens on adapter 0 (the many-adapter mix, op ``shrink_many``); 5 % base tokens."""
    g = torch.Generator().manual_seed(8192)
    S, K, N, ranks = 8192, 4096, 4096, [16] * n
    if n == 8:
        ts = torch.arange(8).repeat_interleave(S // 8)
    else:
        ts = torch.where(torch.rand(S, generator=g) < 0.9, 0, torch.randint(1, n, (S,), generator=g))
    if grouped:
        ts = ts[torch.randperm(S, generator=g)]  # interleaved tokens: the chunked family gathers them
    ts[torch.rand(S, generator=g) < 0.05] = -1
    table = make_table(ranks, scales=[2.0] * n, dropout=ps, device="cuda")
    segs = make_segments(ts, grouped, device="cuda")
    x = torch.randn(S, K, generator=g).to("cuda", dtype)
    A = (torch.randn(16 * n, K, generator=g) / K**0.5).cuda()
    B = (torch.randn(N, 16 * n, generator=g) / 4).cuda()
    y0 = torch.randn(S, N, generator=g).to("cuda", dtype)
    return ts, table, segs, x, A, B, y0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("n", [8, 32], ids=["A8", "A32-skewed"])
def test_gpu_benchmark_shape(grouped, dtype, n):
    ts, table, segs, x, A, B, y0 = _big_problem(grouped, dtype, n=n)
    live = (ts >= 0).cuda()
    h = lora_shrink(x, A, segs, table)
    h64 = ref.lora_shrink(x.double(), A.double(), segs, table)
    h_lowp = ref.lora_shrink(x, A.to(dtype), segs, table).to(dtype)
    assert_close_lowp(h[live], h64[live], h_lowp[live], dtype, "shrink")
    y = lora_expand(h, B, segs, table, y0.clone())
    y64 = ref.lora_expand(h.double(), B.double(), segs, table, y0.double())
    y_lowp = ref.lora_expand(h.to(dtype), B.to(dtype), segs, table, y0.clone())
    assert_close_lowp(y[live], y64[live], y_lowp[live], dtype, "expand")
    assert torch.equal(y[~live], y0[~live])


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", FAMILIES)
def test_gpu_deterministic(grouped):
    ts, table, segs, x, A, B, y0 = _big_problem(grouped, torch.bfloat16, ps=[0.1] * 4 + [0.0] * 4)
    live = (ts >= 0).cuda()
    runs = []
    for _ in range(2):
        h = lora_shrink(x, A, segs, table, seed=7)
        runs.append((h[live], lora_expand(h, B, segs, table, y0.clone())))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])


def test_dropout_mask_rate_and_halves(device):
    """The in-kernel mask drops each element with probability p (2^-16 resolution): per slot, and for each of the 8
    16-bit halves a Philox draw serves (column % 8), within 5 binomial standard deviations; rows and seeds differ."""
    from fast_multilora.kernels.dropout import P_RESOLUTION, quantize_p

    S, K = 96, 512
    ps = [quantize_p(p) for p in (0.05, 0.3, 0.5)]
    assert all(abs(q - p) <= P_RESOLUTION / 2 for q, p in zip(ps, (0.05, 0.3, 0.5), strict=True))
    ts = torch.arange(S) % 4 - 1  # slots -1 (base), 0, 1, 2 interleaved
    table = make_table([4, 4, 4], dropout=ps, device=device)
    segs = make_segments(ts, False, device=device)
    keep = dropout_keep_mask(7, segs, table, K).cpu()
    assert keep[ts == -1].all(), "base rows must keep everything"
    for a, p in enumerate(ps):
        drop = ~keep[ts == a]  # [S/4, K]
        for half in range(8):
            cells = drop[:, half::8]
            n = cells.numel()
            sd = (n * p * (1 - p)) ** 0.5
            assert abs(cells.sum().item() - n * p) <= 5 * sd, f"slot {a} half {half}: rate {cells.float().mean():.4f}"
        assert not torch.equal(drop[0], drop[1]), "two rows drew the same mask"
    assert not torch.equal(keep, dropout_keep_mask(8, segs, table, K).cpu()), "the seed does not change the mask"


@pytest.mark.parametrize("grouped", FAMILIES)
def test_many_adapter_mixes_take_their_shrink_tiles(grouped, monkeypatch):
    """The GPU's shrink tiles: a mix of at least ``SHRINK_MANY_SEGMENTS`` segments without dropout takes the
    many-adapter row of its family (op ``shrink_many`` of ``kernels/configs/h200.json``), fewer segments or dropout
    the default rows. The kernels on those tiles are checked against the reference on the GPU
    (``test_gpu_benchmark_shape``'s sizes) and, with the interpreter's rows, by the 70-adapter case above."""
    from fast_multilora.kernels import configs
    from fast_multilora.kernels import forward as kf

    monkeypatch.setattr(kf, "_target", lambda: "gpu")
    x = torch.empty(4096, 4096, dtype=torch.bfloat16)
    A = torch.empty(16, 4096, dtype=torch.bfloat16)
    family = "chunked" if grouped else "sgemm"
    for n, dropout, many in ((40, False, True), (8, False, False), (40, True, False)):
        segs = make_segments(torch.arange(n).repeat_interleave(4096 // n + 1)[:4096], grouped, "cpu")
        got = kf._shrink_blocks(segs, 16, x, A, dropout=dropout)
        op = "shrink_many" if many else "shrink_dropout" if dropout else "shrink"
        cfg = configs.block_config(op, width=16, family=family, target="h200")
        S_BLK, BLOCK_K, warps = cfg["BLOCK_S"], cfg["BLOCK_K"], cfg["num_warps"]
        assert (got[0], got[2], got[3]) == (kf._rows_block(segs, S_BLK), BLOCK_K, warps), (n, dropout, got)
        assert (segs.num_segments >= kf.SHRINK_MANY_SEGMENTS) == (n == 40), segs.num_segments


@pytest.mark.parametrize("dtype", [pytest.param(torch.float64, id="fp64"), *KERNEL_DTYPE_PARAMS])
@pytest.mark.parametrize("S,K", [(37, 123), (1, 1), (5, 8), (40, 257), (0, 16)], ids=lambda v: str(v))
def test_scale_by_keep_equals_torch(S, K, dtype):
    """``scale_by_keep`` (DoRA's dropped-input term and its gradient) equals torch's ``x * where(keep, kept, -1)`` in
    ``x``'s dtype bit for bit, from the packed mask; rows of ``x`` and of the mask strided inside wider buffers (a
    kernel reading a row or byte off by one fails), K not a multiple of 8, one row, no rows. bf16 on the GPU only:
    the interpreter's float32 -> bfloat16 cast truncates where the GPU's (and torch's) rounds to nearest."""
    from fast_multilora.kernels.dropout import pack_keep_bits, scale_by_keep

    g = torch.Generator().manual_seed(S * 1000 + K)
    x = torch.randn(S, K + 5, generator=g).to(dtype).to(DEVICE)[:, 2:K + 2]  # rows strided, not at offset 0
    keep = torch.rand(S, K, generator=g) < 0.7
    wide = torch.randint(0, 256, (S, (K + 7) // 8 + 3), generator=g, dtype=torch.uint8)
    if S:
        wide[:, 1:(K + 7) // 8 + 1] = pack_keep_bits(keep)
    bits = wide.to(DEVICE)[:, 1:(K + 7) // 8 + 1]
    p = torch.rand(S, generator=g) * 0.5
    kept = (1 / (1 - p) - 1).to(dtype).to(DEVICE)
    got = scale_by_keep(x, bits, kept)
    want = x * torch.where(keep.to(DEVICE), kept[:, None], -1.0)
    assert got.dtype == dtype and got.shape == (S, K)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="kept be"):
        scale_by_keep(x, bits, kept.float() if dtype != torch.float32 else kept.half())
