"""Parity with stock PEFT: a mixed batch equals PEFT running each sample's adapter alone (outputs and gradients)."""

import pytest
import torch
from helpers import CPU_BACKENDS
from models import peft_model, twin

import fast_multilora

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]  # unsorted, repeated, with a base row


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def peft_per_sample(ref, ids, names, weights):
    """Stock PEFT, one sample at a time with its adapter alone; returns logits and summed LoRA grads."""
    outs = []
    for i, name in enumerate(names):
        if name == "__base__":
            with ref.disable_adapter():
                outs.append(ref(input_ids=ids[i : i + 1]).logits.detach())
            continue
        ref.set_adapter(name)
        for n, p in ref.named_parameters():
            p.requires_grad_("lora_" in n)
        out = ref(input_ids=ids[i : i + 1]).logits
        (out * weights[i : i + 1]).sum().backward()
        outs.append(out.detach())
    return torch.cat(outs), lora_grads(ref)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_mixed_batch_matches_peft(arch, train, backend):
    model = peft_model(arch)
    ref = twin(model)
    report = fast_multilora.patch(model, backend=backend)
    assert report.patched and not report.fallback
    model.train(train)
    ref.train(train)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (len(NAMES), 11), generator=g)
    w = torch.randn(len(NAMES), 11, 97, generator=g)  # a different loss weight per logit: every grad path counts
    out = model(input_ids=ids, adapter_names=NAMES).logits
    (out * w).sum().backward()
    got = lora_grads(model)
    want_out, want = peft_per_sample(ref, ids, NAMES, w)
    torch.testing.assert_close(out.detach(), want_out, rtol=1e-4, atol=1e-5)
    assert set(got) == {n for n, p in model.named_parameters() if "lora_" in n}  # every adapter gets a gradient
    for n, gw in want.items():
        # fp32 gradients two layers deep: an element that cancels (|sum| << sum of |terms|) carries the terms'
        # rounding, so the absolute part scales with the tensor's magnitude (both backends are within 1e-5 of a
        # float64 run by norm; an element of A.a2 in layer 1's gate_proj differs by 2e-5 at |g| ~ 0.1)
        torch.testing.assert_close(got[n], gw, rtol=1e-4, atol=1e-4 * gw.abs().max().item(),
                                   msg=lambda m, n=n: f"{n}: {m}")
    for n in set(got) - set(want):  # adapters with no tokens in this layer's batch
        assert torch.count_nonzero(got[n]) == 0, n
