"""``per_adapter_loss_from_hidden`` / ``fused_causal_lm_loss``: the per-adapter loss without the full logits equals
``per_adapter_loss`` of the logits (values and gradients), holds less than the logits at any time, reads nothing
on the host, and refuses what it cannot compute."""

import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from models import patched_llama, peft_model, with_adapters
from test_loss import _NoHostReads
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fast_multilora
from fast_multilora import per_adapter_loss, per_adapter_loss_from_hidden
from fast_multilora.fused_loss import chunk_tokens, linear_cross_entropy

V = 50_000  # a real vocabulary's order: many vocabulary blocks and token chunks per call
H = 16


def _batch(device, dtype=torch.float32, packed=False, bias=True, B=4, T=61, seed=0):
    """Hidden states, head and labels of a mixed batch: adapters "a", "b", "__base__" rows (or packed rows mixing
    them per token), ignore_index labels, and an adapter "c" named but without a valid token."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :7] = -100
    labels[2, 20:30] = -100
    if packed:
        names = ["b", "c", "a"]  # the vocabulary adapter_ids index; "c" only on ignored tokens
        ids = torch.randint(-1, 2, (B, T), generator=g)
        ids[ids == 1] = 2
        ids[:, :5] = 2
        ids[3] = 1
        labels[3] = -100
        routing = dict(adapter_names=names, adapter_ids=ids.to(device))
    else:
        names = ["b", "a", "__base__", "c"]
        labels[3] = -100  # adapter "c": no valid token
        routing = dict(adapter_names=names)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() if t is not None else None
              for t in (hidden, weight, b)]
    return (*leaves, labels.to(device), routing)


def _unfused(hidden, weight, bias, labels, routing, scale=1.0, softcap=None, **kw):
    z = F.linear(hidden, weight, bias)
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return per_adapter_loss(z, labels, routing["adapter_names"], adapter_ids=routing.get("adapter_ids"), **kw)


def _fused(hidden, weight, bias, labels, routing, scale=1.0, softcap=None, **kw):
    return per_adapter_loss_from_hidden(hidden, weight, labels, routing["adapter_names"], bias=bias,
                                        adapter_ids=routing.get("adapter_ids"), logit_scale=scale, softcap=softcap,
                                        **kw)


def _grads(loss, leaves):
    return torch.autograd.grad(loss, [t for t in leaves if t is not None])


CASES = [  # (token routing, bias, chunk_size, (logit_scale, softcap))
    pytest.param(False, True, None, (1.0, None), id="per-row-bias-auto"),
    pytest.param(True, False, 37, (1.0, None), id="packed-nobias-c37"),
    pytest.param(True, True, 10_000, (1.0, None), id="packed-bias-one-chunk"),
    pytest.param(False, True, 37, (0.7, 3.0), id="per-row-bias-c37-scale-softcap"),
    pytest.param(True, False, None, (0.7, 3.0), id="packed-nobias-auto-scale-softcap"),
]


@pytest.mark.parametrize("head", ["trained", "frozen"])  # frozen: d hidden made in the forward
@pytest.mark.parametrize("packed, bias, chunk, transform", CASES)
def test_equals_per_adapter_loss_fp32(device, packed, bias, chunk, transform, head):
    hidden, weight, b, labels, routing = _batch(device, packed=packed, bias=bias)
    scale, softcap = transform
    if head == "frozen":
        weight.requires_grad_(False)
        if b is not None:
            b.requires_grad_(False)
    leaves = (hidden, weight, b) if head == "trained" else (hidden,)
    if head == "frozen":
        loss, per = _fused(hidden, weight, b, labels, routing, scale, softcap, chunk_size=chunk, return_dict=True)
        want, want_per = _unfused(hidden, weight, b, labels, routing, scale, softcap, return_dict=True)
        torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
        (got,), (ref,) = _grads(loss, leaves), _grads(want, leaves)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item(), msg="hidden")
        return
    loss, per = _fused(*leaves, labels, routing, scale, softcap, chunk_size=chunk, return_dict=True)
    want, want_per = _unfused(*leaves, labels, routing, scale, softcap, return_dict=True)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    assert isinstance(per, fast_multilora.loss.AdapterLosses)
    assert dict(per).keys() == dict(want_per).keys() == {"a", "b"}  # "c" has no valid token
    for n in want_per:
        assert abs(per[n] - want_per[n]) <= 1e-5 * abs(want_per[n]), (n, per[n], want_per[n])
    grads = _grads(loss, leaves)
    for got, ref, name in zip(grads, _grads(want, leaves), ["hidden", "weight", "bias"], strict=False):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item(), msg=name)
    # the loss only sees adapters' valid tokens: the base row's and ignored positions' hidden states get no gradient
    dh = grads[0]
    if not packed:
        assert dh[2].abs().sum() == 0 and dh[3].abs().sum() == 0
    assert dh[0, :6].abs().sum() == 0  # labels 1..6 of row 0 are ignored: positions 0..5 predict nothing


def test_bf16_within_twice_the_unfused_error(device):
    """bf16 hidden states and head: the fused loss's error against the fp32 truth is at most twice the unfused bf16
    path's own error (flash-attention's rule): both compute the logits in bf16 and the cross-entropy in fp32; the
    fused path sums ``d hidden`` in fp32 over vocabulary blocks where the unfused path runs one bf16 matmul."""
    leaves16 = _batch(device, dtype=torch.bfloat16, T=31)  # 124 tokens: 4 chunks of 37 (bf16 under the interpreter)
    *params16, labels, routing = leaves16
    params32 = [t.detach().float().requires_grad_() if t is not None else None for t in params16]
    truth = _unfused(*params32, labels, routing)
    truth_grads = _grads(truth, params32)
    fused = _fused(*params16, labels, routing, chunk_size=37)
    unfused = _unfused(*params16, labels, routing)
    for name, got, ref, exact in [("loss", fused, unfused, truth),
                                  *zip(["hidden", "weight", "bias"], _grads(fused, params16),
                                       _grads(unfused, params16), truth_grads, strict=False)]:
        err_fused = (got.float() - exact).abs().max().item()
        err_unfused = (ref.float() - exact).abs().max().item()
        assert err_fused <= 2 * err_unfused + 1e-6 * exact.abs().max().item(), (name, err_fused, err_unfused)
        assert got.dtype == ref.dtype, name


class _MatmulDtypes(TorchDispatchMode):
    """The dtypes of the matmuls run under it."""

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.mm.out):
            self.dtypes.update(a.dtype for a in args if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def test_autocast_equals_the_unfused_head_under_autocast(device):
    """fp32 hidden states and head under bf16 autocast (the head's matmuls in bf16, as the model's own head call
    under autocast): the backward recomputes the logits under the same autocast, so the loss and gradients stay
    within twice the unfused path's error under the same autocast against the fp32 truth; gradients come back in
    the inputs' dtype."""
    *params, labels, routing = _batch(device, T=31)  # 124 tokens: 4 chunks
    truth = _unfused(*params, labels, routing)
    truth_grads = _grads(truth, params)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        fused = _fused(*params, labels, routing, chunk_size=37)
        unfused = _unfused(*params, labels, routing)
    with _MatmulDtypes() as seen:
        fused_grads = _grads(fused, params)
    assert seen.dtypes == {torch.bfloat16}, seen.dtypes  # the backward's matmuls under the forward's autocast
    for name, got, ref, exact in [("loss", fused, unfused, truth),
                                  *zip(["hidden", "weight", "bias"], fused_grads, _grads(unfused, params),
                                       truth_grads, strict=True)]:
        err_fused = (got.float() - exact).abs().max().item()
        err_unfused = (ref.float() - exact).abs().max().item()
        assert err_unfused > 0, name  # autocast did round
        assert err_fused <= 2 * err_unfused + 1e-6 * exact.abs().max().item(), (name, err_fused, err_unfused)
        assert got.dtype == exact.dtype, name


@pytest.mark.parametrize("transform", [(1.0, None), (0.6, 1.5)], ids=["plain", "scale-softcap"])
def test_gradcheck_float64_frozen_head(transform):
    """A frozen head (only the hidden states need a gradient: d hidden made in the forward, scaled by each token's
    upstream gradient in the backward) against finite differences."""
    g = torch.Generator().manual_seed(2)
    scale, softcap = transform
    hidden = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(11, generator=g, dtype=torch.float64)
    labels = torch.tensor([3, -100, 0, 10, 5, 5, 10])
    assert torch.autograd.gradcheck(
        lambda h: linear_cross_entropy(h, weight, bias, labels, chunk_size=2, logit_scale=scale, softcap=softcap),
        (hidden,))


@pytest.mark.parametrize("transform", [(1.0, None), (0.6, 1.5)], ids=["plain", "scale-softcap"])
def test_gradcheck_float64(transform):
    """The autograd Function in float64 (several token chunks and vocabulary blocks, an ignored and a last-row
    label), against finite differences for every input; each token's upstream gradient differs (gradcheck's
    random projection of the output)."""
    g = torch.Generator().manual_seed(1)
    scale, softcap = transform
    hidden = torch.randn(7, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([3, -100, 0, 10, 5, 5, 10])

    def f(h, w, b):
        return linear_cross_entropy(h, w, b, labels, chunk_size=2, logit_scale=scale, softcap=softcap)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))
    ce = f(hidden, weight, bias)
    z = F.linear(hidden, weight, bias) * scale
    z = softcap * torch.tanh(z / softcap) if softcap else z
    torch.testing.assert_close(ce, F.cross_entropy(z, labels, reduction="none"), rtol=1e-12, atol=1e-12)


class _LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages that the ops run under it allocate and that are alive at once (inputs made before
    it are not counted); also the largest single allocation."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, n = storage._cdata, storage.nbytes()  # the storage's own address: fake tensors have one too
            if n == 0 or key in self._seen or key in given:  # a view of or a write into an argument: no allocation
                continue
            self._seen.add(key)
            self.live += n
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, n)
            weakref.finalize(storage, self._free, key, n)
        return out

    def _free(self, key, n):
        self.live -= n
        self._seen.discard(key)


def test_peak_memory_below_the_full_logits(device):
    """Forward and backward of the fused loss never hold the logits of the batch (N x V fp32): the peak of the
    memory they allocate stays below it, and no single tensor is larger than one chunk's fp32 logits. The same meter
    on the unfused path sees at least the full logits (so it would see them here too)."""
    hidden, weight, b, labels, routing = _batch(device, packed=True, B=8, T=64)
    N = labels.numel()
    full = N * V * 4
    chunk = chunk_tokens(N, H, V)
    assert chunk * 4 <= N  # several chunks: the budget below is a chunk's, not the batch's
    with _LiveBytes() as fused:  # (the chunk named: a GPU's default takes at least GPU_MIN_CHUNK tokens, here all)
        _fused(hidden, weight, b, labels, routing, chunk_size=chunk).backward()
    with _LiveBytes() as unfused:
        _unfused(hidden, weight, b, labels, routing).backward()
    assert unfused.peak >= full and unfused.largest >= full, (unfused.peak, full)
    chunk_logits, grads = chunk * V * 4, (V * H + V + N * H) * 4
    assert fused.largest <= chunk_logits, (fused.largest, chunk_logits)
    # a forward chunk's logits and logsumexp's temporary, or a backward block's logits and the gradients
    assert fused.peak <= 2 * chunk_logits + grads, (fused.peak, chunk_logits, grads)
    assert fused.peak < full / 2, (fused.peak, full)


def test_default_chunks():
    """Tokens per chunk by default: at a Llama-3-8B step's shape (8192 tokens, hidden 4096, vocabulary 128,256) the
    chunk's logits are about the hidden states' size (256 tokens) on the CPU, and at least 1024 tokens on a GPU
    (fewer rows leave SMs idle in the head's matmuls: measured, see ``GPU_MIN_CHUNK``); never more than the tokens,
    never fewer than 64 (or the tokens)."""
    assert chunk_tokens(8192, 4096, 128_256) == 256
    assert chunk_tokens(8192, 4096, 128_256, gpu=True) == 1024
    assert chunk_tokens(8192, 4096, 32_000, gpu=True) == 1024 and chunk_tokens(8192, 4096, 32_000) == 1024
    assert chunk_tokens(600, 4096, 128_256, gpu=True) == 600 and chunk_tokens(600, 4096, 128_256) == 64
    assert chunk_tokens(40, 64, 50_000) == 40


def test_peak_memory_of_a_llama3_8b_step_under_fake_tensors():
    """A Llama-3-8B-shaped step (8 x 1024 tokens, hidden 4096, vocabulary 128,256, bf16, the head frozen as under
    LoRA) run on fake tensors (shapes only, no memory, no compute; the same meter): the fused loss's allocations
    peak at about a chunk's logits (256 tokens) and its temporaries, under a tenth of the fp32 logits (3.9 GiB),
    where the unfused path holds about three times them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, T, Hs, Vs = 8, 1024, 4096, 128_256
    full = B * T * Vs * 4
    with FakeTensorMode():
        hidden = torch.randn(B, T, Hs, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.randn(Vs, Hs, dtype=torch.bfloat16)
        labels = torch.randint(0, Vs, (B, T))
        names = [f"a{i % 3}" for i in range(B)]
        with _LiveBytes() as fused:
            per_adapter_loss_from_hidden(hidden, weight, labels, names).backward()
        with _LiveBytes() as unfused:
            per_adapter_loss(hidden @ weight.T, labels, names).backward()
    assert unfused.peak >= 2.5 * full, (unfused.peak, full)
    assert fused.peak < full / 10, (fused.peak, full)


def test_no_host_reads_in_the_step():
    """Forward, backward and the per-adapter means without one read of a tensor's value by the host (on a GPU each
    would stall the step until the device caught up); the means are read once, when used."""
    hidden, weight, b, labels, routing = _batch("cpu", packed=True)
    with _NoHostReads():
        loss, per = _fused(hidden, weight, b, labels, routing, chunk_size=64, return_dict=True)
        loss.backward()
    assert set(per) == {"a", "b"}


def _lora_grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "lora_" in n}
    model.zero_grad(set_to_none=True)
    return grads


def _check_model(model, batch, names, ids=None, **kw):
    labels = batch["labels"]
    loss, per = fast_multilora.fused_causal_lm_loss(model, batch, return_dict=True, **kw)
    loss.backward()
    got = _lora_grads(model)
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "adapter_names", "adapter_ids")}
    out = model(**inputs, adapter_names=names, **({} if ids is None else {"adapter_ids": ids}))
    want, want_per = per_adapter_loss(out.logits, labels, names, adapter_ids=ids, return_dict=True)
    want.backward()
    ref = _lora_grads(model)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert dict(per).keys() == dict(want_per).keys()
    for n in want_per:
        assert abs(per[n] - want_per[n]) <= 1e-5 * abs(want_per[n]), (n, per[n], want_per[n])
    assert got.keys() == ref.keys() and len(got) > 0
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)
    return got


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_model_helper_equals_per_adapter_loss_of_the_logits(arch):
    """A patched tiny PEFT model (three adapters, B != 0): fused_causal_lm_loss equals per_adapter_loss of
    model(...).logits, and so does the gradient of every LoRA parameter; every adapter's parameters get one."""
    model = patched_llama() if arch == "llama" else peft_model("gpt2")
    if arch == "gpt2":
        fast_multilora.patch(model, backend="torch")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (4, 9), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100
    names = ["a0", "__base__", "a2", "a1"]
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels, adapter_names=names)
    got = _check_model(model, batch, names)
    assert all(v.abs().sum() > 0 for v in got.values())  # every adapter trained by its rows


def test_model_helper_packed_rows_and_gradient_checkpointing():
    """Packed rows (adapter_ids per token) and gradient checkpointing: the routing set by the helper is still
    active when backward() recomputes the layers."""
    model = patched_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (2, 12), generator=g)
    adapter_ids = torch.tensor([[0] * 5 + [2] * 7, [1] * 4 + [-1] * 3 + [0] * 5])
    names = ["a0", "a1", "a2"]
    batch = dict(input_ids=ids, labels=ids, adapter_names=names, adapter_ids=adapter_ids)
    _check_model(model, batch, names, ids=adapter_ids)


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_model_helper_applies_the_post_head_transform(arch):
    """transformers' causal LMs that scale or soft-cap the head's output (Gemma 2's final_logit_softcapping,
    Cohere's logit_scale, Granite's logits_scaling): the helper's loss equals the loss of the model's own logits,
    which differs from the loss of the plain lm_head output."""
    import transformers as tf
    from peft import LoraConfig

    kinds = {"gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config, dict(final_logit_softcapping=0.2, head_dim=8)),
             "cohere": (tf.CohereForCausalLM, tf.CohereConfig, dict(logit_scale=0.3, eos_token_id=1)),
             "granite": (tf.GraniteForCausalLM, tf.GraniteConfig, dict(logits_scaling=4.0))}
    cls, cfg, extra = kinds[arch]
    base = cls(cfg(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, **extra))
    common = dict(init_lora_weights=False, target_modules=["q_proj", "v_proj"])
    model = with_adapters(base, {"a0": LoraConfig(r=4, lora_alpha=8, **common),
                                 "a1": LoraConfig(r=2, lora_alpha=2, **common)})
    fast_multilora.patch(model, backend="torch")
    ids = torch.randint(0, 97, (3, 8), generator=torch.Generator().manual_seed(2))
    names = ["a0", "__base__", "a1"]
    _check_model(model, dict(input_ids=ids, labels=ids, adapter_names=names), names)
    with fast_multilora.route(model, names):
        hidden = model.get_base_model().base_model(input_ids=ids).last_hidden_state
    plain = per_adapter_loss(model.get_base_model().lm_head(hidden), ids, names)
    fused = fast_multilora.fused_causal_lm_loss(model, dict(input_ids=ids, labels=ids, adapter_names=names))
    assert (plain - fused).abs() > 1e-3  # the transform matters on this model


# ---- errors (docs/errors.md, "Loss without full logits") ---------------------------------------------------------

def test_errors_of_per_adapter_loss_from_hidden():
    hidden = torch.randn(2, 5, 4)
    weight = torch.randn(9, 4)
    labels = torch.randint(0, 9, (2, 5))
    names = ["a", "b"]
    with pytest.raises(TypeError, match="`lm_head` must be the LM head as an nn.Linear or its weight tensor"):
        per_adapter_loss_from_hidden(hidden, torch.nn.Embedding(9, 4), labels, names)
    with pytest.raises(TypeError, match="a plain floating-point tensor"):
        per_adapter_loss_from_hidden(hidden, weight.to(torch.int8), labels, names)
    with pytest.raises(ValueError, match="an nn.Linear head brings its own bias"):
        per_adapter_loss_from_hidden(hidden, torch.nn.Linear(4, 9), labels, names, bias=torch.zeros(9))
    with pytest.raises(ValueError, match=r"weight must be \[vocab, hidden\] and its bias \[vocab\]"):
        per_adapter_loss_from_hidden(hidden, weight, labels, names, bias=torch.zeros(8))
    with pytest.raises(ValueError, match=r"must be the floating-point hidden states \[batch, seq, hidden\]"):
        per_adapter_loss_from_hidden(hidden.reshape(10, 4), weight, labels, names)
    with pytest.raises(ValueError, match="hidden size 4 does not match the LM head's weight"):
        per_adapter_loss_from_hidden(hidden, torch.randn(9, 3), labels, names)
    with pytest.raises(ValueError, match="give one label per token"):
        per_adapter_loss_from_hidden(hidden, weight, labels[:, :4], names)
    with pytest.raises(ValueError, match="`chunk_size` must be a positive int"):
        per_adapter_loss_from_hidden(hidden, weight, labels, names, chunk_size=0)
    with pytest.raises(ValueError, match="`softcap` must be positive"):
        per_adapter_loss_from_hidden(hidden, weight, labels, names, softcap=0.0)
    with pytest.raises(TypeError, match="cast one to the other"):
        per_adapter_loss_from_hidden(hidden, weight.double(), labels, names)
    with pytest.raises(ValueError, match="move them to one device"):
        per_adapter_loss_from_hidden(hidden, weight.to("meta"), labels, names)
    with pytest.raises(ValueError, match="got 1 adapter names for a batch of 2 rows"):  # per_adapter_loss's own
        per_adapter_loss_from_hidden(hidden, weight, labels, names[:1])


def test_out_of_range_label_makes_its_adapter_nan():
    """No host read to raise on: a label outside [0, V) other than ignore_index makes its adapter's loss NaN, the
    other adapters' losses stay finite (per_adapter_loss raises instead)."""
    hidden = torch.randn(2, 5, 4)
    weight = torch.randn(9, 4)
    labels = torch.randint(0, 9, (2, 5))
    labels[0, 2] = 9
    _, per = per_adapter_loss_from_hidden(hidden, weight, labels, ["a", "b"], return_dict=True)
    assert torch.isnan(torch.tensor(per["a"])) and torch.isfinite(torch.tensor(per["b"]))


def test_errors_of_the_model_helper():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForSequenceClassification

    model = patched_llama()
    ids = torch.randint(0, 97, (2, 6))
    with pytest.raises(ValueError, match="the batch has no `labels`"):
        fast_multilora.fused_causal_lm_loss(model, dict(input_ids=ids, adapter_names=["a0", "a1"]))
    with pytest.raises(ValueError, match="no `adapter_names` in the batch or the arguments"):
        fast_multilora.fused_causal_lm_loss(model, dict(input_ids=ids, labels=ids))
    unpatched = peft_model("llama")
    with pytest.raises(ValueError, match=r"the model is not patched; call fast_multilora.patch\(model\) first"):
        fast_multilora.fused_causal_lm_loss(unpatched, dict(input_ids=ids, labels=ids, adapter_names=["a0", "a1"]))
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, num_labels=3, pad_token_id=0)
    cls = get_peft_model(LlamaForSequenceClassification(cfg), LoraConfig(r=2, target_modules=["q_proj"]))
    fast_multilora.patch(cls, backend="torch")
    with pytest.raises(ValueError, match="is not a standard transformers causal LM"):
        fast_multilora.fused_causal_lm_loss(cls, dict(input_ids=ids, labels=ids, adapter_names=["default"] * 2))
    model.get_base_model().logit_scale = torch.nn.Parameter(torch.tensor(0.5))  # a learned scale: not handled
    with pytest.raises(ValueError, match="logit_scale is a tensor"):
        fast_multilora.fused_causal_lm_loss(model, dict(input_ids=ids, labels=ids, adapter_names=["a0", "a1"]))
    head = peft_model("llama", configs={"a0": LoraConfig(r=2, target_modules=["q_proj", "lm_head"])})
    fast_multilora.patch(head, backend="torch")
    with pytest.raises(ValueError, match=r"is a peft\.tuners\.lora\.layer\.Linear, not a plain nn.Linear"):
        fast_multilora.fused_causal_lm_loss(head, dict(input_ids=ids, labels=ids, adapter_names=["a0", "a0"]))


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_plain_chunk_on_both_paths(device, path, monkeypatch):
    """The plain chunk (a frozen head without a post-head transform) on each of its paths -- ``kernels.cross_entropy_``
    (on a GPU; here under the interpreter) and PyTorch's ops (a CPU without the interpreter) -- equals the unfused
    loss and hidden-state gradient in fp32 (several chunks, ignored labels, packed rows) and passes a float64
    gradcheck; the path is the one taken (kernel calls counted)."""
    import fast_multilora.kernels.cross_entropy as kce

    import fast_multilora.loss as fl

    calls = []
    real = kce.cross_entropy_
    monkeypatch.setattr(kce, "cross_entropy_", lambda z, t: calls.append(z.shape) or real(z, t))
    if path == "torch":
        monkeypatch.setattr(fl, "_kernel_for", lambda z: False)
    else:
        assert fl._kernel_for(torch.empty(1, device=device))  # the GPU, or the interpreter the tests run under
    hidden, weight, b, labels, routing = _batch(device, packed=True, bias=True, T=31)  # 124 tokens: 4 chunks
    weight.requires_grad_(False)
    b.requires_grad_(False)
    loss = _fused(hidden, weight, b, labels, routing, chunk_size=37)
    want = _unfused(hidden, weight, b, labels, routing)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    (got,), (ref,) = _grads(loss, (hidden,)), _grads(want, (hidden,))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6 * ref.abs().max().item())
    g = torch.Generator().manual_seed(3)
    h64 = torch.randn(7, 3, generator=g, dtype=torch.float64).to(device).requires_grad_()
    w64 = torch.randn(11, 3, generator=g, dtype=torch.float64).to(device)
    lab = torch.tensor([3, -100, 0, 10, 5, 5, 10], device=device)
    assert torch.autograd.gradcheck(lambda h: linear_cross_entropy(h, w64, None, lab, chunk_size=3), (h64,))
    assert (len(calls) > 0) == (path == "kernel"), calls


def test_a_kernel_that_cannot_compile_falls_back_with_a_warning(device, monkeypatch):
    """A GPU where the cross-entropy kernel does not compile (Triton's OutOfResources, say): one warning naming it,
    then PyTorch's ops for good -- the same loss and gradient."""
    import fast_multilora.kernels.cross_entropy as kce
    from triton.runtime.errors import OutOfResources

    import fast_multilora.loss as fl

    calls = []

    def fails(z, t):
        calls.append(1)
        raise OutOfResources(300000, 232448, "shared memory")

    monkeypatch.setattr(kce, "cross_entropy_", fails)
    monkeypatch.setattr(fl, "_KERNEL_OFF", [])
    hidden, weight, b, labels, routing = _batch(device, packed=True, bias=False)
    weight.requires_grad_(False)
    with pytest.warns(UserWarning, match="cross-entropy kernels could not run on this GPU .*OutOfResources"):
        loss = _fused(hidden, weight, b, labels, routing, chunk_size=37)
    want = _unfused(hidden, weight, b, labels, routing)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _fused(hidden, weight, b, labels, routing, chunk_size=37)
    torch.testing.assert_close(again, want, rtol=1e-6, atol=1e-6)
    assert len(calls) == 1  # the kernel is not tried again
