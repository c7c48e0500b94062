"""Tiny models with several PEFT adapters (B != 0) for parity tests."""

from __future__ import annotations

import copy

import torch
from peft import LoraConfig, get_peft_model

LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(seed=0, dtype=torch.float32, layers=2):
    """Two decoder layers by default; ``layers=1`` for tests of one layer call's paths, where a second layer of the
    same shapes only repeats each launch (under the Triton interpreter, the launches are most of a CPU test's time)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(dtype)


def tiny_gpt2(seed=0, dtype=torch.float32, layers=2):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=32, n_layer=layers, n_head=4, vocab_size=97, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).to(dtype)


def adapter_configs(arch, dropout=0.0):
    """Three adapters: different ranks, alphas and targets, one with rsLoRA; B != 0 (init_lora_weights=False)."""
    if arch == "gpt2":
        t0, t1, t2 = ["c_attn"], ["c_attn", "c_proj", "c_fc"], ["c_fc", "c_attn"]
        extra = {"fan_in_fan_out": True}
    else:
        t0, t1, t2 = ["q_proj", "v_proj"], LLAMA_TARGETS, ["gate_proj", "up_proj", "down_proj", "q_proj"]
        extra = {}
    common = dict(init_lora_weights=False, lora_dropout=dropout, **extra)
    return {
        "a0": LoraConfig(r=4, lora_alpha=8, target_modules=t0, **common),
        "a1": LoraConfig(r=8, lora_alpha=4, target_modules=t1, use_rslora=True, **common),
        "a2": LoraConfig(r=1, lora_alpha=3, target_modules=t2, **common),
    }


def peft_model(arch="llama", dropout=0.0, dtype=torch.float32, seed=0, configs=None, layers=2):
    base = tiny_llama(seed, dtype, layers) if arch == "llama" else tiny_gpt2(seed, dtype, layers)
    torch.manual_seed(seed + 1)
    return with_adapters(base, configs or adapter_configs(arch, dropout))


PEFT_LOOP_MAX = 8  # adapters a test model gets by PEFT's add_adapter loop (with_adapters)


def with_adapters(base, configs: dict):
    """``base`` under PEFT with every adapter of ``configs`` (the first one made by ``get_peft_model``), only the LoRA
    weights trainable. Up to ``PEFT_LOOP_MAX`` adapters by PEFT's own ``add_adapter`` loop; more by
    ``fast_multilora.add_adapters``, which leaves the model as that loop does, bit for bit (tests/test_adapters.py),
    in time linear in the count (PEFT's loop re-walks the model per adapter: 128 adapters took 29 s of a 33 s test)."""
    import fast_multilora

    names = list(configs)
    model = get_peft_model(base, configs[names[0]], adapter_name=names[0])
    if len(names) > PEFT_LOOP_MAX:
        assert not fast_multilora.add_adapters(model, {n: configs[n] for n in names[1:]})
    else:
        for n in names[1:]:
            model.add_adapter(n, configs[n])
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


def patched_llama():
    """:func:`peft_model` (three adapters, B != 0: A and B both get gradients) patched on the torch backend."""
    import fast_multilora

    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    return model


def lora_weights(model) -> dict:
    """Copies of the model's LoRA parameters by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def twin(model):
    return copy.deepcopy(model)
