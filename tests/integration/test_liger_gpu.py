"""Liger Kernel and fast_multilora on one model, in either order: Liger's fused RMSNorm, SwiGLU, RoPE and fused linear
cross-entropy replace the model's own modules and forward, ``fast_multilora.patch`` the LoRA layers.

Oracle: stock PEFT with the same Liger patches, each adapter alone on its rows (``__base__`` rows with the adapters
disabled). Checked on a tiny Llama and Qwen2, fp32 (Liger's kernels and ours both compute fp32 there): the logits and
every LoRA parameter's gradient of a mixed batch, and the HF ``labels=`` loss, which Liger computes with its fused
linear cross-entropy (no logits) -- its value and gradients against the mean token cross-entropy of the oracle.
GPU only: Liger's kernels do not run under Triton's interpreter.
"""

import pytest
import torch
from helpers import assert_close_max
from models import with_adapters

import fast_multilora

pytestmark = pytest.mark.gpu
liger = pytest.importorskip("liger_kernel.transformers")

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1"]
# The labels= gradients: Liger's fused linear cross-entropy (its own chunked fp32 softmax and matmuls over the
# vocabulary) against PyTorch's cross_entropy of the oracle's full logits -- two fp32 computations of the loss gradient
# in different orders, through two layers' backward, where the other checks compare one computation each: 2.9e-5 of
# the largest entry measured on an H200 (LoRA B of a rank-1 adapter), 5x the fp32 tolerance of one computation.
LABELS_TOL = 1e-4
T = 12


@pytest.fixture(autouse=True)
def _undo_liger_patches():
    """Liger's ``apply_liger_kernel_to_*`` also patches transformers' modules for the whole process (their RMSNorm,
    MLP and RoPE names, the causal-LM class's ``forward``): restored after each test, so later tests in the process
    (e.g. the compiled-model ones, where Liger's dispatch would break the graph) see stock transformers."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    saved = []
    for module in (modeling_llama, modeling_qwen2):
        saved.append((module, dict(vars(module))))
        saved += [(cls, dict(vars(cls))) for cls in vars(module).values()
                  if isinstance(cls, type) and cls.__module__ == module.__name__]
    yield
    for obj, attrs in saved:
        for name, value in attrs.items():
            if name not in ("__dict__", "__weakref__") and vars(obj).get(name, None) is not value:
                setattr(obj, name, value)


def _base(arch):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg_cls, cls = (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    torch.manual_seed(0)
    cfg = cfg_cls(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    return cls(cfg).cuda().float()


def _apply_liger(arch, model):
    fn = liger.apply_liger_kernel_to_llama if arch == "llama" else liger.apply_liger_kernel_to_qwen2
    fn(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=model)


def _configs():
    from peft import LoraConfig

    attn, mlp = ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"]
    return {"a0": LoraConfig(r=4, lora_alpha=8, target_modules=attn + mlp, init_lora_weights=False),
            "a1": LoraConfig(r=8, lora_alpha=4, target_modules=attn, init_lora_weights=False),
            "a2": LoraConfig(r=1, lora_alpha=3, target_modules=mlp, init_lora_weights=False)}


def _build(arch, order, patch):
    base = _base(arch)
    if order == "liger_first":
        _apply_liger(arch, base)
    torch.manual_seed(1)
    model = with_adapters(base, _configs())
    if patch:
        fast_multilora.patch(model)
    if order == "patch_first":
        _apply_liger(arch, model.base_model.model)
    model.train()
    return model


def _by_adapter(ref, ids, fn):
    """Stock PEFT, each adapter alone on its rows: ``fn(logits, rows)`` gives the loss part of those rows, whose
    backward runs per adapter; returns the logits in row order and the LoRA gradients."""
    ref.zero_grad(set_to_none=True)
    outs = [None] * len(NAMES)
    for name in dict.fromkeys(NAMES):
        rows = [i for i, n in enumerate(NAMES) if n == name]
        if name == "__base__":
            with ref.disable_adapter():  # no LoRA parameter in these rows' graph: nothing to backpropagate
                out = ref(input_ids=ids[rows]).logits
        else:
            ref.set_adapter(name)
            for n, p in ref.named_parameters():
                p.requires_grad_("lora_" in n)
            out = ref(input_ids=ids[rows]).logits
            fn(out, rows).backward()
        for j, i in enumerate(rows):
            outs[i] = out[j : j + 1].detach()
    return torch.cat(outs), {n: p.grad for n, p in ref.named_parameters() if "lora_" in n and p.grad is not None}


def _lora_grads(model):
    return {n: p.grad for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


@pytest.mark.parametrize("order", ["liger_first", "patch_first"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_liger_and_patch_compose(arch, order):
    model, ref = _build(arch, order, True), _build(arch, order, False)
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, 97, (len(NAMES), T), device="cuda", generator=g)
    w = torch.randn(len(NAMES), T, 97, device="cuda", generator=g)
    for m in (model, ref):
        for n, p in m.named_parameters():
            p.requires_grad_("lora_" in n)
    out = model(input_ids=ids, adapter_names=NAMES).logits
    (out * w).sum().backward()
    want_out, want_grads = _by_adapter(ref, ids, lambda logits, rows: (logits * w[rows]).sum())
    assert_close_max(out.detach(), want_out, torch.float32, "logits")
    got = _lora_grads(model)
    assert set(got) == set(want_grads)
    for n, gw in want_grads.items():
        assert_close_max(got[n], gw, torch.float32, n)

    # the HF loss: Liger's fused linear cross-entropy (no logits), the mean over every row's next-token losses
    model.zero_grad(set_to_none=True)
    res = model(input_ids=ids, labels=ids, adapter_names=NAMES)
    assert res.logits is None, "Liger's fused linear cross-entropy was not used"
    res.loss.backward()
    total = len(NAMES) * (T - 1)

    def ce_sum(logits, rows):
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 97), ids[rows, 1:].reshape(-1),
                                                 reduction="sum") / total

    want_logits, want_grads = _by_adapter(ref, ids, ce_sum)
    want_loss = torch.nn.functional.cross_entropy(want_logits[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(res.loss.detach(), want_loss, rtol=2e-5, atol=0)
    got = _lora_grads(model)
    assert set(got) == set(want_grads)
    for n, gw in want_grads.items():  # (see LABELS_TOL)
        err = (got[n].double() - gw.double()).abs().max().item()
        assert err <= LABELS_TOL * gw.abs().max().item(), f"{n} (labels=): max err {err:.3e}"

