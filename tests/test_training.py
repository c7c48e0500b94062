"""``PerAdapterLoss(model, fused=True)``: the Trainer's per-adapter loss computed from the model's last hidden states,
with the model's own forward asked for no full-vocabulary logits. Same values and LoRA gradients as the logits path
(padded and packed rows, post-head transforms), no ``[tokens, vocab]`` tensor built, and the documented fallbacks
(a warning, then the logits) and errors. The Trainer-level wiring is in ``tests/integration/test_trainer.py``."""

import warnings

import pytest
import torch
from models import patched_llama, peft_model, with_adapters
from peft import LoraConfig
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaForCausalLM

import fast_multilora
from fast_multilora.data import MultiAdapterCollator, PackedCollator
from fast_multilora.training import PerAdapterLoss

VOCAB = 97  # tests/models.py


def _samples(names, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        n = int(torch.randint(5, 12, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[:2] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "adapter_name": name})
    return out


def _padded(seed=0):
    return MultiAdapterCollator(pad_token_id=0)(_samples(["a1", "a0", "__base__", "a2", "a1", "a0"], seed))


def _packed(seed=0):
    batch = PackedCollator(max_length=24, pad_token_id=0, adapter_names=["a0", "a1", "a2"])(
        _samples(["a1", "a0", "__base__", "a2", "a1", "a2", "a0", "a1"], seed))
    return {**batch, "use_cache": False}


def _step(model, loss, batch):
    """What the Trainer does with a ``compute_loss_func``: labels out of the inputs, ``model(**inputs)``, then the
    loss of the outputs; returns the loss, the outputs and every LoRA parameter's gradient."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    value = loss(out, batch["labels"])
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    model.zero_grad(set_to_none=True)
    return value.detach(), out, grads


def _assert_same(got, want):
    (lg, _, gg), (lw, _, gw) = got, want
    torch.testing.assert_close(lg, lw, rtol=1e-5, atol=1e-6)
    assert gg.keys() == gw.keys() and len(gw) > 0
    for n in gw:
        assert gw[n].abs().sum() > 0, f"{n}: no gradient in the reference"
        torch.testing.assert_close(gg[n], gw[n], rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("arch, layout", [("llama", "padded"), ("llama", "packed"), ("gpt2", "padded")])
def test_fused_equals_the_logits_path(arch, layout):
    """Loss value, the logged per-adapter means and every LoRA parameter's gradient equal the logits path's; the
    model's forward returned the logits of one position per row only."""
    batch = _padded() if layout == "padded" else _packed()
    if arch == "llama":
        model = patched_llama()
    else:
        model = peft_model("gpt2")
        fast_multilora.patch(model, backend="torch")
    model.train()
    plain = PerAdapterLoss(model)
    want = _step(model, plain, batch)
    fused = PerAdapterLoss(model, fused=True, chunk_size=16)
    got = _step(model, fused, batch)
    assert tuple(want[1].logits.shape) == (*batch["input_ids"].shape, VOCAB)
    assert tuple(got[1].logits.shape) == (batch["input_ids"].shape[0], 1, VOCAB)
    _assert_same(got, want)
    logged = [fused._flush(True), plain._flush(True)]
    assert logged[0].keys() == logged[1].keys() == {"a0", "a1", "a2"}
    for a in logged[1]:
        assert abs(logged[0][a] - logged[1][a]) <= 1e-5 * logged[1][a], (a, logged)


def test_fused_with_gradient_checkpointing_and_accumulation_scaling():
    """Gradient checkpointing recomputes the layers in backward (the kept hidden states stay valid), and the
    Trainer's accumulation scaling applies to the fused loss as to the logits one."""
    model = patched_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = _padded(seed=2)
    results = []
    for fused in (False, True):
        loss = PerAdapterLoss(model, fused=fused)
        loss.gradient_accumulation_steps = 2
        results.append(_step(model, loss, batch))
    _assert_same(results[1], results[0])


def test_fused_applies_the_post_head_transform():
    """Gemma 2 soft-caps its logits (``final_logit_softcapping``): the fused loss applies the cap as the model's
    forward does (its check of the last position passes) and equals the logits path."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    base = Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                          max_position_embeddings=64, final_logit_softcapping=0.5, head_dim=8))
    common = dict(init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    model = with_adapters(base, {"a0": LoraConfig(r=4, lora_alpha=8, **common),
                                 "a1": LoraConfig(r=2, lora_alpha=2, **common),
                                 "a2": LoraConfig(r=1, lora_alpha=2, **common)})
    fast_multilora.patch(model, backend="torch")
    model.train()
    batch = _padded(seed=3)
    plain = PerAdapterLoss(model)
    want = _step(model, plain, batch)
    fused = PerAdapterLoss(model, fused=True)
    assert fused._head.softcap == 0.5
    _assert_same(_step(model, fused, batch), want)


class _VocabSized(TorchDispatchMode):
    """Records the largest tensor with a last dim of the vocabulary's size that any op allocates (forward, loss and
    backward): the full logits and their gradient are ``[tokens, vocab]``."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # views (e.g. the head's weight transposed and expanded for a batched matmul) allocate nothing
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        for t in tree_leaves(out):
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == VOCAB
                    and t.untyped_storage().data_ptr() not in inputs):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fused_builds_no_full_logits(layout):
    """With ``fused=True`` no op creates a tensor of ``[tokens, vocab]`` (nor one a quarter of it) in the forward,
    the loss or the backward; the same meter sees the full logits on the logits path."""
    batch = _padded() if layout == "padded" else _packed()
    tokens = batch["input_ids"].numel()
    model = patched_llama()
    model.train()
    sizes = {}
    for fused in (False, True):
        loss = PerAdapterLoss(model, fused=fused, chunk_size=8)
        with _VocabSized() as meter:
            _step(model, loss, batch)
        sizes[fused] = meter.largest
    assert sizes[False] >= tokens * VOCAB, sizes  # the meter sees the logits where they are built
    assert sizes[True] <= max(8, batch["input_ids"].shape[0]) * VOCAB < tokens * VOCAB // 4, (sizes, tokens)


def test_eval_forwards_keep_their_logits():
    """Evaluation forwards build the logits (the Trainer hands them to compute_metrics); the loss equals the logits
    path's there too."""
    model = patched_llama()
    model.eval()
    batch = _padded()
    loss = PerAdapterLoss(model, fused=True)
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
        value = loss(out, batch["labels"])
    assert tuple(out.logits.shape) == (*batch["input_ids"].shape, VOCAB)
    want = fast_multilora.per_adapter_loss(out.logits, batch["labels"], batch["adapter_names"])
    torch.testing.assert_close(value, want)


# ---- fallbacks: a warning, then the logits --------------------------------------------------------------------------


class NoKeepLlamaForCausalLM(LlamaForCausalLM):
    """A causal LM whose forward has no ``logits_to_keep``: it builds every position's logits."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None, **kw):
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               labels=labels, use_cache=use_cache, **kw)


def _tiny(cls):
    from models import tiny_llama

    base = tiny_llama()
    base.__class__ = cls
    return base


def _lora_on_lm_head():
    model = peft_model("llama", configs={
        "a0": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False),
        "a1": LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], init_lora_weights=False),
        "a2": LoraConfig(r=1, lora_alpha=2, target_modules=["q_proj"], init_lora_weights=False)})
    return model


def _no_keep():
    model = with_adapters(_tiny(NoKeepLlamaForCausalLM), {
        a: LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        for a in ("a0", "a1", "a2")})
    return model


def _learned_scale():
    model = peft_model("llama")
    model.get_base_model().logit_scale = torch.nn.Parameter(torch.tensor(1.0), requires_grad=False)
    return model


def _quantized_head():
    model = peft_model("llama")
    head = model.get_base_model().lm_head

    class Int8Weight(torch.Tensor):  # stands for a quantized weight class (bitsandbytes' Int8Params, torchao's)
        pass

    head.weight = torch.nn.Parameter(head.weight.detach().as_subclass(Int8Weight), requires_grad=False)
    return model


@pytest.mark.parametrize("build, reason", [
    (_lora_on_lm_head, r"the LM head of LlamaForCausalLM is a peft\.tuners\.lora\.layer\.Linear, not a plain "
                       r"nn\.Linear"),
    (_no_keep, r"NoKeepLlamaForCausalLM\.forward takes no `logits_to_keep`"),
    (_learned_scale, r"LlamaForCausalLM\.logit_scale is a tensor \(a learned scale\)"),
    (_quantized_head, r"the LM head's weight is a Int8Weight of dtype torch\.float32 \(a quantized or sharded head"),
], ids=["lora-on-lm_head", "no-logits_to_keep", "learned-logit_scale", "quantized-head"])
def test_fallback_warns_once_and_takes_the_logits(build, reason):
    model = build()
    fast_multilora.patch(model, backend="torch")
    model.train()
    batch = _padded()
    plain = PerAdapterLoss(model)
    want = _step(model, plain, batch)
    fused = PerAdapterLoss(model, fused=True)
    with pytest.warns(UserWarning, match=r"PerAdapterLoss\(fused=True\): " + reason + r".*computed from the full "
                      r"logits"):
        got = _step(model, fused, batch)
    assert tuple(got[1].logits.shape) == (*batch["input_ids"].shape, VOCAB)
    torch.testing.assert_close(got[0], want[0])
    for n in want[2]:
        torch.testing.assert_close(got[2][n], want[2][n], msg=n)
    with warnings.catch_warnings():  # once per reason
        warnings.simplefilter("error")
        _step(model, fused, batch)


def test_labels_given_to_the_model_keep_the_logits():
    """A call that hands ``labels`` to the model (its own loss needs every position's logits) is not fused: a
    warning, the model's loss computed as usual, and the per-adapter loss from the logits."""
    model = patched_llama()
    model.train()
    batch = _padded()
    loss = PerAdapterLoss(model, fused=True)
    with pytest.warns(UserWarning, match=r"PerAdapterLoss\(fused=True\): the call passes `labels` to the model"):
        out = model(**batch)
    assert out.loss is not None and tuple(out.logits.shape) == (*batch["input_ids"].shape, VOCAB)
    want = fast_multilora.per_adapter_loss(out.logits, batch["labels"], batch["adapter_names"])
    torch.testing.assert_close(loss(out, batch["labels"]), want)


# ---- errors ---------------------------------------------------------------------------------------------------------


class DoubledLlamaForCausalLM(LlamaForCausalLM):
    """Does more to its logits than the known post-head transforms."""

    def forward(self, *args, logits_to_keep=0, **kw):
        out = super().forward(*args, logits_to_keep=logits_to_keep, **kw)
        out.logits = out.logits * 2
        return out


class DirectLlamaForCausalLM(LlamaForCausalLM):
    """Calls its backbone's ``forward`` directly (no module call, so no hooks run)."""

    def forward(self, input_ids=None, attention_mask=None, logits_to_keep=0, **kw):
        kw.pop("labels", None)
        hidden = self.model.forward(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
        keep = slice(-logits_to_keep, None) if logits_to_keep else slice(None)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(logits=self.lm_head(hidden[:, keep]))


def _with(cls):
    model = with_adapters(_tiny(cls), {a: LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"],
                                                     init_lora_weights=False) for a in ("a0", "a1", "a2")})
    fast_multilora.patch(model, backend="torch")
    model.train()
    return model


def test_logits_that_are_not_the_head_of_the_hidden_states_raise():
    model = _with(DoubledLlamaForCausalLM)
    with pytest.raises(ValueError, match=r"PerAdapterLoss\(fused=True\): the logits of DoubledLlamaForCausalLM are "
                                         r"not its LM head applied to its backbone's last hidden state"):
        _step(model, PerAdapterLoss(model, fused=True), _padded())
    _step(model, PerAdapterLoss(model), _padded())  # fused=False: the model's own logits


def test_a_backbone_that_runs_without_its_hooks_raises():
    model = _with(DirectLlamaForCausalLM)
    with pytest.raises(RuntimeError, match=r"PerAdapterLoss\(fused=True\): the forward call skipped its logits but "
                                           r"the model's backbone \(LlamaModel\) did not run in it"):
        _step(model, PerAdapterLoss(model, fused=True), _padded())


def test_one_loss_per_model():
    """Attaching a second PerAdapterLoss to a model detaches the first (a fused one would otherwise keep asking the
    forward for one position's logits); the first then refuses to compute a loss rather than reuse stale names."""
    model = patched_llama()
    model.train()
    old = PerAdapterLoss(model, fused=True)
    new = PerAdapterLoss(model)
    value, out, _ = _step(model, new, _padded())
    assert tuple(out.logits.shape) == (*_padded()["input_ids"].shape, VOCAB)
    with pytest.raises(ValueError, match=r"PerAdapterLoss: the forward call carried no `adapter_names`"):
        old(out, _padded()["labels"])


def test_fused_must_be_a_bool():
    with pytest.raises(TypeError, match=r"PerAdapterLoss: `fused` must be True or False, got 'auto'"):
        PerAdapterLoss(fused="auto")
