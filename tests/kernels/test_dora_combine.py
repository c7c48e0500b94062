"""DoRA's per-row combine kernels (``kernels/dora.py``) against torch autograd on the same expression.

``res = y + g[:, None, :] * (y - b + t)`` and its gradients ``dy``, ``dt``, ``dg`` (the sum over each row's tokens),
at odd shapes: one token per row, rows longer than a token tile (70 = 2 x 32 + 6) and than a program's chunk
(300 = 2 x 128 + 44: dg from partial sums), N not a multiple of the column block (123, 257; 1100 for one-token
rows, whose block is 1024), N = 1, no tokens, with and without ``t`` and ``b``, ``g`` in float32 beside 16-bit ``y``
(as the DoRA layer passes it for float32 outputs). Tolerances (tests/helpers.py's rule): float32 / float64 within
rtol 1e-5 / 1e-12 of an fp64 reference, 16-bit at most twice torch's own error computing the expression in that
dtype (the kernels compute in float32 and round once). Buffers the kernels write are fresh ``torch.empty``; every
entry of each output is compared, so a row or column left unwritten fails.
"""

import pytest
import torch
from fast_multilora.kernels.dora import dora_combine, dora_combine_bwd
from helpers import DEVICE, KERNEL_DTYPE_PARAMS, assert_close_lowp

SHAPES = [(3, 5, 123), (1, 1, 1), (4, 70, 257), (2, 0, 16), (5, 33, 128), (7, 1, 1100), (2, 300, 37)]


def _torch(y, t, b, g):
    z = y if b is None else y - b
    if t is not None:
        z = z + t
    return torch.addcmul(y, g[:, None, :].to(y.dtype), z)


def _inputs(R, T, N, dtype, has_t, has_b, g_dtype, seed):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dt).to(DEVICE)

    return (rnd(R, T, N), rnd(R, T, N) if has_t else None, rnd(N) if has_b else None, rnd(R, N, dt=g_dtype) * 0.5,
            rnd(R, T, N))


# float64 (the kernels' float64 arithmetic) at two shapes, the kernels' dtypes at every shape
CASES = [pytest.param(shape, torch.float64, id=f"{shape}-fp64") for shape in (SHAPES[0], SHAPES[-1])] + [
    pytest.param(shape, p.values[0], id=f"{shape}-{p.id}") for shape in SHAPES for p in KERNEL_DTYPE_PARAMS]


@pytest.mark.parametrize("has_t,has_b", [(True, False), (False, False), (True, True), (False, True)],
                         ids=["t", "plain", "t-bias", "bias"])
@pytest.mark.parametrize("shape,dtype", CASES)
def test_combine_and_its_gradient_match_torch(shape, dtype, has_t, has_b):
    R, T, N = shape
    g_dtype = dtype if dtype in (torch.float64, torch.float32) else torch.float32 if (R + T) % 2 else dtype
    y, t, b, g, G = _inputs(R, T, N, dtype, has_t, has_b, g_dtype, seed=R * 1000 + T * 10 + N)
    res, z = dora_combine(y, t, b, g, keep_z=True)
    res2, none = dora_combine(y, t, b, g)
    assert torch.equal(res, res2) and none is None
    dy, dt, dg = dora_combine_bwd(G, y, t, b, g, with_dt=t is not None)
    # the backward from the forward's kept z (the DoRA layer's route under dropout): the same dy and dt, dg from z
    dy_z, dt_z, dg_z = dora_combine_bwd(G, z, None, None, g, with_dt=t is not None)
    assert torch.equal(dy, dy_z) and (dt is None or torch.equal(dt, dt_z))
    assert res.dtype == dy.dtype == dtype and dg.dtype == g_dtype and (dt is None) == (t is None)

    def grads(y, t, b, g, G):
        leaves = [v.detach().requires_grad_() for v in (y, t, g) if v is not None]
        yy, gg = leaves[0], leaves[-1]
        tt = leaves[1] if t is not None else None
        out = _torch(yy, tt, b, gg)
        return (out.detach(), *torch.autograd.grad(out, leaves, G))

    want = grads(*(None if v is None else v.double() for v in (y, t, b, g, G)))  # fp64 reference
    base = grads(y, t, b, g, G)  # torch in the tensors' own dtypes
    got = (res, dy, *([dt] if t is not None else []), dg)
    names = ["res", "dy", *(["dt"] if t is not None else []), "dg"]
    for name, a, w, lo in zip(names, got, want, base, strict=True):
        assert a.shape == w.shape, name
        assert_close_lowp(a, w, lo, a.dtype if name != "dg" else g_dtype, f"{name} {dtype}")
    z64 = y.double() + (0 if t is None else t.double()) - (0 if b is None else b.double())
    z_lo = (y if b is None else y - b) + (0 if t is None else t)
    assert_close_lowp(z, z64, z_lo, dtype, f"z {dtype}")
    # dg from the z rounded to y's dtype: within the rule against the fp64 sum over that same rounded z
    dg_want = (G.double() * z.double()).sum(1)
    dg_lo = (G * z.to(G.dtype)).to(g_dtype).sum(1) if T else torch.zeros_like(g)
    assert_close_lowp(dg_z, dg_want, dg_lo, g_dtype, f"dg from kept z {dtype}")


def test_bad_inputs_name_the_shapes():
    y = torch.zeros(2, 3, 4, device=DEVICE)
    with pytest.raises(ValueError, match=r"dora_combine: y must be a contiguous \[R, T, N\]"):
        dora_combine(y, None, None, torch.zeros(3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="G must be a contiguous"):
        dora_combine_bwd(y.half(), y, None, None, torch.zeros(2, 4, device=DEVICE), with_dt=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("R,T,N", [(16, 1024, 2048), (16384, 1, 5632)], ids=["per-sample", "per-token"])
def test_combine_at_the_benchmark_shape_on_the_gpu(R, T, N, dtype):
    """dora_step_8's shapes (16 rows of 1024 tokens; packed rows: one token per row), compiled kernels: the same rule
    as above, and the dropped-input kernel bit for bit against torch at [16384, 2048]."""
    from fast_multilora.kernels.dropout import pack_keep_bits, scale_by_keep

    y, t, b, g, G = (v.cuda() if v is not None else None
                     for v in _inputs(R, T, N, dtype, True, True, dtype, seed=R + T))
    res, z = dora_combine(y, t, b, g, keep_z=True)
    dy, dt, dg = dora_combine_bwd(G, z, None, None, g, with_dt=True)
    leaves = [v.detach().double().requires_grad_() for v in (y, t, g)]
    out = _torch(leaves[0], leaves[1], b.double(), leaves[2])
    want = (out.detach(), *torch.autograd.grad(out, leaves, G.double()))
    lo_leaves = [v.detach().requires_grad_() for v in (y, t, g)]
    lo_out = _torch(lo_leaves[0], lo_leaves[1], b, lo_leaves[2])
    base = (lo_out.detach(), *torch.autograd.grad(lo_out, lo_leaves, G))
    for name, a, w, lo in zip(("res", "dy", "dt", "dg"), (res, dy, dt, dg), want, base, strict=True):
        assert_close_lowp(a, w, lo, dtype, f"{name} {dtype}")
    x = torch.randn(16384, 2048, device="cuda", dtype=dtype)
    keep = torch.rand(16384, 2048, device="cuda") < 0.95
    kept = torch.full((16384,), 0.05 / 0.95, device="cuda").to(dtype)
    assert torch.equal(scale_by_keep(x, pack_keep_bits(keep), kept), x * torch.where(keep, kept[:, None], -1.0))


@pytest.mark.parametrize("has_t,has_b", [(True, True), (False, False)], ids=["t-bias", "plain"])
def test_dora_functions_gradcheck_float64(has_t, has_b):
    """float64 gradcheck of the DoRA layer's two autograd Functions over these kernels: the combine (``y``, ``t``,
    ``g``; with ``t`` the backward reads the forward's kept ``z``) and the dropped-input term (``x``)."""
    from fast_multilora.kernels.dropout import pack_keep_bits

    from fast_multilora import dora as dora_mod

    y, t, b, g, _ = _inputs(2, 3, 5, torch.float64, has_t, has_b, torch.float64, seed=5)
    inputs = (y.requires_grad_(), t.requires_grad_() if t is not None else None, g.requires_grad_(), b)
    assert torch.autograd.gradcheck(dora_mod._Combine.apply, inputs)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 11, generator=gen, dtype=torch.float64).to(DEVICE).requires_grad_()
    bits = pack_keep_bits(torch.rand(3, 11, generator=gen) < 0.7).to(DEVICE)
    kept = (torch.rand(3, generator=gen, dtype=torch.float64) * 0.5).to(DEVICE)
    assert torch.autograd.gradcheck(dora_mod._DroppedInputDelta.apply, (x, bits, kept))


def _gates_reference(W, As, Bs, scales, mags):
    """float64 ``(m / ||W + s B A||_row - 1, the norms)`` from the full matrices."""
    norms = torch.stack([torch.linalg.norm(W.double() + s * B.double() @ A.double(), dim=1)
                         for A, B, s in zip(As, Bs, scales, strict=True)])
    return mags.double() / norms - 1, norms


# (N, ranks, scales): N off the row block (123, 1 and 33 rows), rank 1, mixed ranks, a rank above the 16-column minimum
# block (33: 64 columns, the 16-row tile), one adapter, ranks summing to an odd R; magnitudes near the norms
GATE_CASES = [(123, (1, 4, 7), (0.5, 2.0, 1.25)), (1, (16,), (2.0,)), (33, (33, 2), (0.25, 1.0)),
              (70, (8, 8, 8, 8, 8), (2.0, 2.0, 2.0, 2.0, 2.0)), (257, (5,), (1.5,))]


@pytest.mark.parametrize("N,ranks,scales", GATE_CASES, ids=[f"N{c[0]}-r{'.'.join(map(str, c[1]))}" for c in GATE_CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gates_match_the_direct_norm(N, ranks, scales, dtype):
    """``dora_gates``' ``g - 1`` and norms against the norms of the full ``W + s B A`` in float64, for W, A, B and
    the magnitudes in ``dtype`` (``P = W A^T`` computed in ``dtype`` as the DoRA layer does). Tolerances: float32
    rtol 1e-5; float16 twice the error of the same norms computed by torch's ops from the same 16-bit ``P``
    (``fast_multilora.dora.weight_norms``, the torch backend's path), which both share."""
    from fast_multilora import dora as dora_mod

    g = torch.Generator().manual_seed(N + sum(ranks))
    K = 40
    W = (torch.randn(N, K, generator=g, dtype=torch.float64) * 0.2).to(dtype).to(DEVICE)
    As = [(torch.randn(r, K, generator=g, dtype=torch.float64) * 0.3).to(dtype).to(DEVICE) for r in ranks]
    Bs = [(torch.randn(N, r, generator=g, dtype=torch.float64) * 0.3).to(dtype).to(DEVICE) for r in ranks]
    want_g, want_n = _gates_reference(W.cpu(), [a.cpu() for a in As], [b.cpu() for b in Bs], scales,
                                      torch.ones(len(ranks), N, dtype=torch.float64))
    mags = ((want_n * (1 + 0.1 * torch.randn(len(ranks), N, generator=g, dtype=torch.float64)))).to(dtype)
    want_g = mags.double() / want_n - 1
    got_g, got_n = dora_mod.gates(W, As, Bs, scales, list(mags.to(DEVICE).unbind(0)))
    assert got_g.dtype == got_n.dtype == torch.float32 and got_g.shape == got_n.shape == (len(ranks), N)
    torch_n = dora_mod.weight_norms(W, As, Bs, scales).cpu().double()
    torch_g = mags.double() / torch_n - 1
    if dtype == torch.float32:
        torch.testing.assert_close(got_n.cpu().double(), want_n, rtol=1e-5, atol=0)
        torch.testing.assert_close(got_g.cpu().double(), want_g, rtol=0, atol=1e-5)
    else:
        for got, ref, want in ((got_n, torch_n, want_n), (got_g, torch_g, want_g)):
            err, ref_err = (got.cpu().double() - want).abs().max(), (ref - want).abs().max()
            assert err <= 2 * ref_err + 1e-6, (float(err), float(ref_err))


def test_gates_refuse_bad_arguments():
    from fast_multilora.kernels.dora import dora_gates

    N, R = 5, 4
    P, B, gram = torch.zeros(N, R, device=DEVICE), torch.zeros(N, R, device=DEVICE), torch.zeros(R, R, device=DEVICE)
    args = (P, B, gram, torch.ones(N, device=DEVICE), torch.ones(1, N, device=DEVICE))
    two_s = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match=r"dora_gates: .*offsets int32.*got .*offsets \(2,\) torch.int64"):
        dora_gates(*args, torch.tensor([0, R], device=DEVICE), two_s, R)
    with pytest.raises(ValueError, match=r"max_rank 65 \(1 .. 64\)"):
        dora_gates(*args, torch.tensor([0, R], dtype=torch.int32, device=DEVICE), two_s, 65)
    gm1, norms = dora_gates(*args, torch.tensor([0, R], dtype=torch.int32, device=DEVICE), two_s, R)
    assert torch.equal(norms, torch.ones(1, N, device=DEVICE)) and torch.equal(gm1, torch.zeros(1, N, device=DEVICE))


_GATES_COMPILE = r"""
import triton.language as tl
from fast_multilora.kernels import dora as D
from tune_kernels import sass_loop, sm90_kernel
bad = 0
for act in ("bf16", "fp16", "fp32"):
    for block_r, (block_m, warps) in D.GATES_TILES.items():
        types = {n: "*fp32" for n in ("gm1", "norms", "gram", "rowsq", "two_s")}
        types.update({"P": "*" + act, "B": "*" + act, "mags": "*" + act, "offsets": "*i32"})
        use = sass_loop(sm90_kernel(D._gates_kernel, types, dict(ACC=tl.float32, BLOCK_M=block_m, BLOCK_R=block_r),
                                    warps))
        print("_gates_kernel", act, block_r, block_m, warps, use)
        bad += use["stack"] > 0
raise SystemExit(1 if bad else 0)
"""


@pytest.mark.slow
def test_gates_tiles_compile_for_sm90_without_spills():
    """Every rank block's tile of ``dora_gates`` compiles for sm_90 (Triton's frontend and bundled ptxas, no GPU) in
    every input dtype without spilling to local memory: the float32 ``tl.dot`` in IEEE precision and the
    ``[rank, rank]`` block in registers, which the interpreter does not check."""
    from fast_multilora.kernels.dora import GATES_TILES
    from helpers import compile_for_sm90

    run = compile_for_sm90(_GATES_COMPILE)
    assert run.returncode == 0, f"compile check failed:\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stdout.count("_gates_kernel") == 3 * len(GATES_TILES), run.stdout
