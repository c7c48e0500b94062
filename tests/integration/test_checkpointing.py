"""Gradient checkpointing with LoRA dropout: recomputation must redraw the same dropout masks.

Each patched layer draws its dropout seed from the CPU RNG (``torch.randint``), whose state
``torch.utils.checkpoint`` saves and restores for the recompute; the routing stays active after the forward returns,
so the recompute (inside ``backward()``) finds the same batch plan. LoRA gradients with and without checkpointing must
therefore match under the same seed -- for per-row ``adapter_names`` and for packed rows (``adapter_ids``).
"""

import warnings

import pytest
import torch
from models import peft_model, twin

import fast_multilora
from fast_multilora.data import pack_samples

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1"]


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def batch(layout):
    g = torch.Generator().manual_seed(5)
    if layout == "rows":
        ids = torch.randint(0, 97, (len(NAMES), 10), generator=g)
        return {"input_ids": ids, "adapter_names": NAMES}, ids, None
    samples = [{"input_ids": torch.randint(0, 97, (int(n),), generator=g), "adapter_name": a}
               for n, a in zip([5, 7, 3, 9, 4, 6], NAMES, strict=True)]
    p = pack_samples(samples, max_length=16)
    kw = {k: p[k] for k in ("input_ids", "position_ids", "adapter_ids", "adapter_names")}
    kw["use_cache"] = False
    return kw, p["labels"], p["adapter_ids"]


def run(model, kw, labels, adapter_ids, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**kw).logits
    loss = fast_multilora.per_adapter_loss(out, labels, kw["adapter_names"], adapter_ids=adapter_ids)
    loss.backward()
    return lora_grads(model)


@pytest.mark.parametrize("layout", ["rows", "packed"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointing_reproduces_dropout(reentrant, layout):
    ref = peft_model("llama", dropout=0.3)
    ck = twin(ref)
    for m in (ref, ck):
        fast_multilora.patch(m, backend="torch")
        m.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        ck.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert ck.base_model.model.model.gradient_checkpointing

    calls = []
    q = ck.base_model.model.model.layers[0].self_attn.q_proj
    hook = q.register_forward_hook(lambda *a: calls.append(1))
    kw, labels, adapter_ids = batch(layout)
    want = run(ref, kw, labels, adapter_ids, seed=123)
    got = run(ck, kw, labels, adapter_ids, seed=123)
    hook.remove()
    assert len(calls) == 2  # forward + recompute in backward: checkpointing is really active

    assert set(got) == set(want) and want
    for n, gw in want.items():
        torch.testing.assert_close(got[n], gw, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")

    # control: another seed draws other masks, so the comparison above does depend on dropout
    other = run(ref, kw, labels, adapter_ids, seed=124)
    assert any(not torch.allclose(other[n], want[n], rtol=1e-3, atol=1e-5) for n in want)
