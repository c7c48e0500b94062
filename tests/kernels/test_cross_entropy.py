"""The cross-entropy kernels (``kernels/cross_entropy.py``) against an fp64 reference.

``ce = logsumexp(z) - z[target]`` per row and ``z`` overwritten with ``softmax(z) - onehot(target)`` (the fused
loss), or ``(ce, lse)`` with ``z`` only read and then ``dz = (softmax(z) - onehot(target)) * g`` (the logits loss), at
odd shapes:
one row, one column, vocabularies that are not a multiple of the column block and rows not a multiple of the row
block (under small blocks: many blocks per row, a ragged last one), targets at the first and last column, large
logits (the online maximum moves between blocks). Every entry of both outputs is compared (an unwritten row or
column fails). Tolerances (tests/helpers.py's rule): fp32 / fp64 within rtol 1e-5 / 1e-12 of the fp64 reference;
16-bit gradients at most twice the error of PyTorch's own path for them (fp32 ``log_softmax`` of the upcast logits,
``exp`` into the 16-bit dtype), the per-row loss (fp32 for every input dtype) within fp32's rule.
"""

import pytest
import torch
from fast_multilora.kernels import configs
from fast_multilora.kernels.cross_entropy import cross_entropy_, cross_entropy_bwd, cross_entropy_fwd
from helpers import DEVICE, KERNEL_DTYPE_PARAMS, assert_close_lowp

SHAPES = [(1, 1), (5, 123), (67, 1000), (3, 4099), (16, 64)]
SMALL_BLOCKS = [{"BLOCK_M": 4, "BLOCK_V": 64, "num_warps": 1}]


def _reference(z, t):
    logp = torch.log_softmax(z.double(), 1)
    grad = logp.exp()
    grad[torch.arange(z.shape[0]), t] -= 1
    return -logp.gather(1, t[:, None])[:, 0], grad


def _torch_path(z, t):
    """PyTorch's path for the same outputs (the fused loss's on a CPU): fp32 log-probabilities, ``exp`` in z's dtype."""
    logp = torch.log_softmax(z, 1, dtype=torch.promote_types(z.dtype, torch.float32))
    grad = logp.exp().to(z.dtype)
    lp_t = logp.gather(1, t[:, None])
    grad.scatter_(1, t[:, None], (lp_t.exp() - 1.0).to(z.dtype))
    return -lp_t[:, 0], grad


def _inputs(M, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(M, V, generator=g, dtype=torch.float64) * 4
    if V > 1:
        z[:, -1] += 30.0  # the row maximum in the last block: the running maximum moves
    t = torch.randint(0, V, (M,), generator=g)
    t[0] = V - 1
    if M > 1:
        t[1] = 0
    return z.to(dtype).to(DEVICE), t.to(DEVICE)


def _check(M, V, dtype, seed=0):
    z, t = _inputs(M, V, dtype, seed)
    want_ce, want_grad = _reference(z, t)
    got = z.clone()
    ce = cross_entropy_(got, t)
    assert ce.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.dtype == dtype and torch.isfinite(ce).all() and torch.isfinite(got).all()
    base_ce, base_grad = _torch_path(z, t)
    assert_close_lowp(ce, want_ce, base_ce, torch.float64 if dtype == torch.float64 else torch.float32,
                      f"ce {M}x{V} {dtype}")
    assert_close_lowp(got, want_grad, base_grad, dtype, f"grad {M}x{V} {dtype}")


CASES = [pytest.param(shape, torch.float64, id=f"{shape}-fp64") for shape in (SHAPES[1], SHAPES[3])] + [
    pytest.param(shape, p.values[0], id=f"{shape}-{p.id}") for shape in SHAPES for p in KERNEL_DTYPE_PARAMS]


def _check_fwd_bwd(M, V, dtype, seed=0):
    z, t = _inputs(M, V, dtype, seed)
    g = torch.randn(M, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64).to(DEVICE)
    g[0] = 0.0  # an ignored row's upstream gradient
    want_ce, want_grad = _reference(z, t)
    want_lse = torch.logsumexp(z.double(), 1)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    kept = z.clone()
    ce, lse = cross_entropy_fwd(z, t)
    assert torch.equal(z, kept) and ce.dtype == lse.dtype == acc  # z only read
    assert_close_lowp(ce, want_ce, want_ce, acc, f"fwd ce {M}x{V} {dtype}")
    assert_close_lowp(lse, want_lse, want_lse, acc, f"fwd lse {M}x{V} {dtype}")
    dz = cross_entropy_bwd(z, t, lse, g.to(acc))
    assert dz.dtype == dtype and dz.shape == z.shape and torch.isfinite(dz).all()
    base_ce, base_grad = _torch_path(z, t)
    base = (base_grad.to(acc) * g.to(acc)[:, None]).to(dtype) if dtype != torch.float64 else None
    want = want_grad * g[:, None]
    assert_close_lowp(dz, want, base if base is not None else want, dtype, f"bwd {M}x{V} {dtype}")
    assert dz[0].abs().sum() == 0


@pytest.mark.parametrize("shape, dtype", CASES)
def test_matches_reference(shape, dtype):
    _check(*shape, dtype)
    _check_fwd_bwd(*shape, dtype)


@pytest.mark.parametrize("shape", [(5, 123), (3, 4099), (9, 64)], ids=str)
def test_many_blocks_per_row(shape):
    """Blocks of 4 rows and 64 columns: every row spans many column blocks (4099: 65 of them, the last of 3 columns)
    and the last row block is ragged."""
    with configs.override("cross_entropy", SMALL_BLOCKS):
        for dtype in (torch.float32, torch.float16):
            _check(*shape, dtype, seed=1)
            _check_fwd_bwd(*shape, dtype, seed=1)


def test_no_rows_and_bad_input():
    z = torch.zeros(0, 7, device=DEVICE)
    assert cross_entropy_(z, torch.zeros(0, dtype=torch.int64, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="contiguous rows"):
        cross_entropy_(torch.zeros(7, 3, device=DEVICE).t(), torch.zeros(3, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="target must be int64"):
        cross_entropy_(torch.zeros(3, 7, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE))
    z, t = torch.zeros(3, 7, device=DEVICE), torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="cross_entropy_bwd: g must be a floating"):
        cross_entropy_bwd(z, t, torch.zeros(3, device=DEVICE), torch.zeros(2, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_llama3_vocabulary_on_the_gpu(dtype):
    """A chunk of the 8B step's logits (256 tokens x 128256, the h200 rows' blocks), compiled kernel: the same rule."""
    _check(256, 128256, dtype, seed=2)
    _check_fwd_bwd(256, 128256, dtype, seed=2)


_COMPILE_SCRIPT = r'''
from fast_multilora.kernels import cross_entropy as C
from fast_multilora.kernels.configs import rows
from tune_kernels import sass_loop, sm90_kernel

bad = 0
for row in rows("cross_entropy", "h200"):
    for dt in ("bf16", "fp16", "fp32"):
        z = "*" + dt
        for fn, types in ((C._cross_entropy_kernel, dict(z=z, target="*i64", ce="*fp32")),
                          (C._cross_entropy_fwd_kernel, dict(z=z, target="*i64", ce="*fp32", lse_out="*fp32")),
                          (C._cross_entropy_bwd_kernel, dict(z=z, target="*i64", lse_in="*fp32", g_in="*fp32",
                                                            dz=z))):
            use = sass_loop(sm90_kernel(fn, types, dict(FP64=False, BLOCK_M=row["BLOCK_M"], BLOCK_V=row["BLOCK_V"]),
                                        row["num_warps"]))
            print(fn.__name__, dt, row["BLOCK_M"], row["BLOCK_V"], row["num_warps"], use)
            bad += use["stack"] > 0
raise SystemExit(1 if bad else 0)
'''


@pytest.mark.slow
def test_gpu_rows_compile_for_sm90_without_spills():
    """The h200 rows compile for sm_90 (Triton's frontend and bundled ptxas, no GPU) in every dtype the loss passes,
    without spilling to local memory: what the interpreter cannot check (lowering, registers at 32 warps)."""
    from helpers import compile_for_sm90

    run = compile_for_sm90(_COMPILE_SCRIPT)
    assert run.returncode == 0, f"compile check failed:\n{run.stdout}\n{run.stderr[-3000:]}"
    assert run.stdout.count("_cross_entropy") == 9 * len(configs.rows("cross_entropy", "h200")), run.stdout
