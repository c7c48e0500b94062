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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_leaves_equal_the_parameter_path_on_cuda(dtype):
    model = many_model(64).to("cuda", dtype)
    params = copy.deepcopy(model)
    fast_multilora.patch(model, backend="triton")
    fast_multilora.patch(params, backend="triton")
    assert AdapterStore.of(model).slots
    names = sorted(model.peft_config)
    g = torch.Generator().manual_seed(0)
    rows = [names[i] for i in torch.randperm(64, generator=g)[:20].tolist()] + ["__base__", names[3]]
    ids = torch.randint(0, 97, (len(rows), 70), generator=g).cuda()  # 70 tokens: the SGEMM family
    w = torch.randn(len(rows), 70, 97, generator=g).cuda()
    model.train()
    params.train()
    got, want = _step(model, ids, rows, w), _step(params, ids, rows, w)
    # the same kernels on the same values (B read packed in place instead of per adapter): equal up to the order
    # in which a few sums are taken; bf16: 2 ulps of the outputs' scale
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert got[2].keys() == want[2].keys()
    for n, gw in want[2].items():
        scale = max(1.0, gw.abs().max().item())
        torch.testing.assert_close(got[2][n], gw, rtol=tol["rtol"], atol=tol["atol"] * scale,
                                   msg=lambda m, n=n: f"{n}: {m}")


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
