"""The adapter store on CUDA: the layers' leaves against the per-parameter path (64 adapters of mixed ranks, fp32 and
bf16, Triton kernels with bf16 dots), and ``fast_multilora.AdamW``'s one-launch step against ``torch.optim.AdamW``
per adapter on the same gradients (fp32 and bf16 adapters)."""

import copy

import pytest
import torch
from test_paths import _step as _paths_step
from test_store import _batches, _hyper, adamw_against_torch, many_model

import fast_multilora
from fast_multilora.store import AdapterStore

pytestmark = pytest.mark.gpu


def _step(model, ids, rows, w):
    """``test_paths._step`` (logits, input gradient, LoRA gradients), in float32."""
    out, dx, grads = _paths_step(model, ids, w, adapter_names=rows)
    return out.float(), dx.float(), {n: g.float() for n, g in grads.items()}


def _rel(got, want):
    return float((got - want).norm() / want.norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_leaves_equal_the_parameter_path_on_cuda(dtype, device="cuda"):
    """fp32: the same kernels on the same values (B read packed in place instead of per adapter, no sibling
    stacks): equal up to summation order. bf16: each path against an fp32 run of the same weights, the store's
    relative RMSE at most twice the per-parameter path's plus bf16's unit roundoff (the per-parameter path stacks
    q/k/v and gate/up, whose input gradient is one fp32 sum; the store's layers run alone and autograd sums their
    bf16 input gradients: a few ulps apart)."""
    ref = many_model(64).to(device)
    model = copy.deepcopy(ref).to(dtype)
    params = copy.deepcopy(model)
    for m in (ref, model, params):
        fast_multilora.patch(m, backend="triton")
    assert AdapterStore.of(model).slots
    names = sorted(model.peft_config)
    g = torch.Generator().manual_seed(0)
    rows = [names[i] for i in torch.randperm(64, generator=g)[:20].tolist()] + ["__base__", names[3]]
    ids = torch.randint(0, 97, (len(rows), 70), generator=g).to(device)  # 70 tokens: the SGEMM family
    w = torch.randn(len(rows), 70, 97, generator=g).to(device)
    for m in (ref, model, params):
        m.train()
    got, other, want = _step(model, ids, rows, w), _step(params, ids, rows, w), _step(ref, ids, rows, w)
    assert got[2].keys() == other[2].keys() == want[2].keys()
    pairs = [("logits", got[0], other[0], want[0]), ("dx", got[1], other[1], want[1])]
    pairs += [(n, got[2][n], other[2][n], want[2][n]) for n in want[2]]
    for what, a, b, ref_t in pairs:
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()),
                                       msg=lambda m, what=what: f"{what}: {m}")
        else:
            ea, eb = _rel(a, ref_t), _rel(b, ref_t)
            assert ea <= 2 * eb + 2**-8, f"{what}: store {ea:.3e} vs per-parameter {eb:.3e} (relative RMSE vs fp32)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adamw_equals_torch_on_cuda(dtype):
    model = many_model(9).to("cuda", dtype)
    fast_multilora.patch(model, backend="triton")
    names = sorted(model.peft_config)
    # bf16: torch's single-tensor AdamW rounds each operation to bf16; the kernel rounds once per state
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2 * 3e-2)
    adamw_against_torch(model, _hyper(names), _batches(names[:7], steps=3, seed=6), device="cuda", **tol)
