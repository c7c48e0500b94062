"""The adapter store on CUDA: the layers' leaves against the per-parameter path (64 adapters of mixed ranks, fp32 and
bf16, Triton kernels with bf16 dots), and ``fast_multilora.AdamW``'s one-launch step against ``torch.optim.AdamW``
per adapter on the same gradients (fp32 and bf16 adapters)."""

import copy

import pytest
import torch
from test_store import _assert_same_weights, _batches, _hyper, many_model

import fast_multilora
from fast_multilora.store import AdapterStore

pytestmark = pytest.mark.gpu


def _step(model, ids, rows, w):
    model.zero_grad()
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb, adapter_names=rows).logits
    (out.float() * w).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
    return out.float().detach(), emb.grad.float(), grads


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
    twin = copy.deepcopy(model)
    names = sorted(model.peft_config)
    hyper = _hyper(names)
    ours = fast_multilora.AdamW(model, settings=hyper)
    groups = [{"params": [p for n, p in twin.named_parameters() if f".{a}." in n], **hyper[a]} for a in names]
    stock = torch.optim.AdamW(groups, foreach=False)
    model.train()
    for ids, rows in _batches(names[:7], steps=3, seed=6):
        ours.zero_grad()
        out = model(input_ids=ids.cuda(), adapter_names=rows).logits
        fast_multilora.per_adapter_loss(out.float(), ids.cuda(), rows).backward()
        for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
            trained = "lora_" in n and any(f".{a}." in n for a in rows)
            q.grad = p.grad.clone() if trained else None
        ours.step()
        stock.step()
        if dtype == torch.float32:
            _assert_same_weights(model, twin, rtol=1e-6, atol=1e-7)
        else:  # torch's single-tensor AdamW rounds each operation to bf16; the kernel rounds once per state
            _assert_same_weights(model, twin, rtol=2e-2, atol=4e-2 * 3e-2)
