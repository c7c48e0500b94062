"""A training step on a patched model makes no device->host synchronisation that the stock model's step does not.

The host must be able to queue a whole step (forward, ``per_adapter_loss``, backward, optimizer) ahead of the GPU:
one blocking copy or ``.item()`` anywhere (a layer, the batch plan, the loss) makes it wait for every kernel queued
so far, and a step whose host time is close to its GPU time becomes host-bound. Measured with PyTorch's own sync
detector (``torch.cuda.set_sync_debug_mode("warn")``), against the same model's step with adapters disabled (the
baseline catches syncs of the model code itself). GPU only: the detector watches CUDA streams.
"""

import dataclasses

import pytest
import torch
from helpers import sync_warnings
from models import adapter_configs, peft_model

import fast_multilora

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2", "a1"]


def _sync_warnings(fn) -> list:  # each with the Python line that synchronised, for the failure message
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in sync_warnings(fn)]


def _configs(dropout, dora):
    configs = adapter_configs("llama", dropout)
    if dora:  # two DoRA adapters beside a plain one (DoRA's dropped-input term reads the op's mask)
        for name in ("a0", "a2"):
            configs[name] = dataclasses.replace(configs[name], use_dora=True)
    return configs


@pytest.mark.gpu
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["p0", "p0.1"])
def test_training_step_makes_no_sync(dropout, dora):
    model = peft_model("llama", configs=_configs(dropout, dora)).cuda()
    fast_multilora.patch(model)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 97, (len(NAMES), 16), device="cuda")

    def embeds():  # an input that needs a gradient, so the stock step (adapters disabled) has a backward too
        return model.get_input_embeddings()(ids).detach().requires_grad_()

    def ours():
        out = model(inputs_embeds=embeds(), adapter_names=NAMES)
        fast_multilora.per_adapter_loss(out.logits, ids, NAMES).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def stock():
        with model.disable_adapter():
            out = model(inputs_embeds=embeds())
        torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()

    for _ in range(3):  # plans, tables, compiled kernels, optimizer state, sibling stacks (from the 2nd call)
        ours()
    baseline = _sync_warnings(stock)
    got = _sync_warnings(ours)
    assert len(got) <= len(baseline), f"ours: {got}; stock: {baseline}"
