"""QLoRA: PEFT's LoRA layers over bitsandbytes 4-bit (nf4, fp4 with double quantization) and 8-bit bases run our
layer Function (the base layer opaque, the delta added), on CPU (bitsandbytes runs its 4-bit and 8-bit layers
there). Parity with stock PEFT running each sample with its adapter alone: outputs, input and LoRA gradients, train
and eval, three adapters with different ranks and targets, ``__base__`` rows; the report lists the quantized layers
as patched. Tolerance: fp32 compute, the same quantized base in both runs, so fp32-tight (1e-4 of the largest entry:
the delta is added once in fp32, PEFT's per-adapter path sums in another order)."""

import warnings

import pytest
import torch
from models import adapter_configs
from test_paths import assert_matches_peft

import fast_multilora

bnb = pytest.importorskip("bitsandbytes")

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]
QUANT = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama saved once; bitsandbytes' CPU 4-bit layers need in_features >= its block size (64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def qlora_model(path, quant, kbit_training=False):
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' notes about CPU kernels and casts
        base = LlamaForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**QUANT[quant]),
                                                device_map="cpu")
    if kbit_training:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=True,
                                               gradient_checkpointing_kwargs={"use_reentrant": False})
    cfgs = adapter_configs("llama")
    torch.manual_seed(1)  # the same LoRA weights in every copy
    model = get_peft_model(base, cfgs["a0"], adapter_name="a0")
    for name in ("a1", "a2"):
        model.add_adapter(name, cfgs[name])
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    return model


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("quant", list(QUANT))
def test_qlora_mixed_batch_matches_peft(checkpoint, quant, backend, train):
    model, ref = qlora_model(checkpoint, quant), qlora_model(checkpoint, quant)
    report = fast_multilora.patch(model, backend=backend)
    assert not report.fallback, report.fallback
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__module__.startswith("bitsandbytes")
    assert "base_model.model.model.layers.0.self_attn.q_proj" in report.patched
    model.train(train)
    ref.train(train)
    assert_matches_peft(model, ref, quant, adapter_names=NAMES)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_qlora_kbit_training_with_checkpointing(checkpoint):
    """``prepare_model_for_kbit_training`` (norms in fp32, input grads, gradient checkpointing), then a mixed
    training step: equal to stock PEFT per sample; ``merge_and_unload`` still works on the patched model."""
    model = qlora_model(checkpoint, "nf4", kbit_training=True)
    ref = qlora_model(checkpoint, "nf4", kbit_training=True)
    fast_multilora.patch(model)
    model.train()
    ref.train()
    assert_matches_peft(model, ref, "kbit", adapter_names=NAMES)
    model.set_adapter("a1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merging into 4-bit weights rounds: bitsandbytes / PEFT say so
        merged = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
