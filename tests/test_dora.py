"""DoRA adapters (``use_dora=True``) in mixed batches with plain LoRA adapters and ``__base__`` rows, against stock PEFT
running each adapter alone on its rows: logits, the input's gradient and every LoRA / DoRA parameter's gradient
(``lora_A``, ``lora_B``, ``lora_magnitude_vector``), fp32 (``helpers.TOL``: 2e-5 of the largest entry), training and
eval, on the torch backend and the Triton backend (the interpreter on CPU).

Adapters: three DoRA (ranks 8 / 3 / 5, one rsLoRA) and two LoRA (ranks 1 / 4), ``init_lora_weights=False`` (B != 0)
and magnitudes moved away from their initial value (the weight norms), so a wrong norm, scale, slot or detach shows.
Bases: Llama's bias-free ``nn.Linear``, Llama with biases (``attention_bias``, ``mlp_bias``), GPT-2's ``Conv1D``
(``fan_in_fan_out``, biases). Under dropout PEFT draws its own masks: the masks our layers drew are recorded
(``dora._keep_mask``) and PEFT's dropout modules replaced by ones applying them, so the LoRA part and DoRA's base term
on the dropped input are both checked against the mask the kernels used.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from fast_multilora.kernels.dropout import unpack_keep_bits
from helpers import assert_close_max
from models import LLAMA_TARGETS, tiny_gpt2, twin, with_adapters
from peft import LoraConfig
from test_paths import _peft_per_sample, _step  # (logits, input gradient, LoRA gradients) of a weighted sum

import fast_multilora
from fast_multilora import dora as dora_mod

NAMES = ["d0", "l1", "__base__", "d2", "d1", "l0", "d0", "d2"]
T = 5
P = 0.25  # on the kernels' 2^-16 grid: PEFT's rate and ours are equal

PATHS = {  # (backend, patch settings)
    "torch": ("torch", {}),
    "triton": ("triton", {}),  # T < 64: the chunked family, base fused, the adapter store
    "triton-sgemm-added-params": ("triton", dict(family="sgemm", fuse_base=False, adapter_store=False)),
}


def _cases(paths):
    """``paths`` as parameters, the Triton ones marked ``interpreter`` (CPU models: a CUDA run skips them)."""
    return [p if PATHS[p][0] == "torch" else pytest.param(p, marks=pytest.mark.interpreter) for p in paths]


def _tiny_llama(bias: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, attention_bias=bias,
                      mlp_bias=bias)
    return LlamaForCausalLM(cfg)


def configs(arch: str, dropout: float = 0.0) -> dict:
    """d0 on every target (so every LoRA layer holds a DoRA adapter), the others on subsets."""
    if arch == "gpt2":
        every, t1, t2, t3 = ["c_attn", "c_proj", "c_fc"], ["c_attn"], ["c_fc", "c_proj"], ["c_attn", "c_fc"]
        extra = {"fan_in_fan_out": True}
    else:
        every, t1, t2, t3 = LLAMA_TARGETS, ["q_proj", "down_proj"], ["v_proj", "up_proj", "o_proj"], ["q_proj"]
        extra = {}
    common = dict(init_lora_weights=False, lora_dropout=dropout, **extra)
    return {
        "d0": LoraConfig(r=8, lora_alpha=4, target_modules=every, use_dora=True, **common),
        "d1": LoraConfig(r=3, lora_alpha=5, target_modules=t1, use_dora=True, use_rslora=True, **common),
        "d2": LoraConfig(r=5, lora_alpha=7, target_modules=t2, use_dora=True, **common),
        "l0": LoraConfig(r=1, lora_alpha=3, target_modules=t3, **common),
        "l1": LoraConfig(r=4, lora_alpha=8, target_modules=every, **common),
    }


def build(arch: str, dropout: float = 0.0):
    """The five-adapter model (magnitudes perturbed) and its unpatched twin; one decoder layer (a second one of the
    same shapes repeats every layer call)."""
    base = tiny_gpt2(layers=1) if arch == "gpt2" else _tiny_llama(bias=arch == "llama_bias")
    torch.manual_seed(1)
    with torch.no_grad():  # GPT-2 and Llama initialise biases to zero: give DoRA's bias handling something to do
        for m in base.modules():
            if type(m).__name__ in ("Linear", "Conv1D") and getattr(m, "bias", None) is not None:
                m.bias.normal_(0, 0.1)
    model = with_adapters(base, configs(arch, dropout))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    return model, twin(model)


def _inputs(rows=None, t=T):
    rows = len(NAMES) if rows is None else rows
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 97, (rows, t), generator=g), torch.randn(rows, t, 97, generator=g)


class _FixedMask(torch.nn.Module):
    """Dropout with a given keep-mask (PEFT's DoRA takes any non-Identity module as dropout)."""

    def __init__(self, keep, p):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, x):
        return x * self.keep.to(x.dtype) / (1 - self.p)


def _peft_by_adapter(ref, ids, w, names, masks=None):
    """Stock PEFT, each adapter alone on its rows (adapters disabled for ``__base__``); ``masks``: module name ->
    the ``[rows * T, K]`` keep-mask our run drew there, applied by every adapter's dropout module of that layer."""

    @contextlib.contextmanager
    def fixed_masks(name, rows):
        saved = {}
        for mod_name, keep in (masks or {}).items():
            layer = ref.get_submodule(mod_name)
            if name in layer.lora_dropout:
                saved[mod_name] = layer.lora_dropout[name]
                K = keep.shape[1]
                layer.lora_dropout[name] = _FixedMask(keep.view(len(names), -1, K)[rows], P)
        try:
            yield
        finally:
            for mod_name, drop in saved.items():
                ref.get_submodule(mod_name).lora_dropout[name] = drop

    ref.zero_grad(set_to_none=True)
    return _peft_per_sample(ref, ids, w, names, by_adapter=True, around=fixed_masks)


def _assert_matches(got, want, model, names):
    assert_close_max(got[0], want[0], torch.float32, "logits")
    assert_close_max(got[1], want[1], torch.float32, "input grad")
    in_batch = set(names)
    for n, g in want[2].items():
        assert n in got[2], f"{n}: no gradient"
        assert_close_max(got[2][n], g, torch.float32, n)
    mags = [n for n, _ in model.named_parameters() if "lora_magnitude_vector" in n]
    assert mags and all(n in want[2] for n in mags if n.split(".")[-2] in in_batch)


def _patch(model, path, **settings):
    backend, extra = PATHS[path]
    fast_multilora.patch(model, backend=backend, **{**extra, **settings})


@pytest.fixture
def combines(monkeypatch):
    """The shapes ``(R, T, N)`` of each call of the Triton backend's combine kernels (``dora._Combine``), and whether
    it had the dropped-input term."""
    calls, real = [], dora_mod._Combine

    def rec(y, t, g, bias):
        calls.append((tuple(y.shape), t is not None))
        return real.apply(y, t, g, bias)

    monkeypatch.setattr(dora_mod, "_Combine", types.SimpleNamespace(apply=rec))
    return calls


@pytest.mark.parametrize("arch", ["llama", "llama_bias", "gpt2"])
@pytest.mark.parametrize("path", _cases(PATHS))
def test_training_step_matches_peft(path, arch, combines):
    model, ref = build(arch)
    _patch(model, path)
    model.train()
    ref.train()
    ids, w = _inputs()
    got = _step(model, ids, w, adapter_names=NAMES)
    want = _peft_by_adapter(ref, ids, w, NAMES)
    _assert_matches(got, want, model, NAMES)
    # the Triton backend combines per sample ([rows, T, N]) in its kernels; the torch backend with torch ops
    assert {(shape[:2], t) for shape, t in combines} == ({((len(NAMES), T), False)} if path != "torch" else set())


@pytest.mark.parametrize("names", [["d1", "l1", "__base__", "d0", "d1", "l0"], ["d2", "l1", "d1", "__base__", "d2"]],
                         ids=["d2-absent", "d0-absent"])
@pytest.mark.parametrize("path", _cases(["torch", "triton"]))
def test_training_step_matches_peft_with_a_dora_adapter_absent(path, names):
    """A batch naming some of a layer's DoRA adapters (d0 is on every layer, d1 and d2 on some): the named ones'
    ``g - 1`` rows placed among the absent ones' zero rows, values and gradients as stock PEFT's."""
    model, ref = build("llama")
    _patch(model, path)
    model.train()
    ref.train()
    ids, w = _inputs(rows=len(names))
    got = _step(model, ids, w, adapter_names=names)
    want = _peft_by_adapter(ref, ids, w, names)
    _assert_matches(got, want, model, names)


def _rel_rmse(got, truth) -> float:
    return ((got.double() - truth.double()).norm() / truth.double().norm()).item()


def test_bf16_training_step_within_twice_peft_error():
    """16-bit (the model in bf16, torch backend): ours and stock PEFT per adapter, each against the fp32 truth of the
    same weights (PEFT in fp32); ours at most twice PEFT's own error plus bf16's unit roundoff (2^-8), in relative
    RMSE of the logits, the input's gradient and every LoRA / DoRA gradient (test_errors.py's rule). The path that
    applies each sample's ``g - 1`` in the output's dtype runs only here."""
    model, ref = build("llama_bias")
    truth = twin(ref)
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    _patch(model, "torch")
    for m in (model, ref, truth):
        m.train()
    ids, w = _inputs()
    got = _step(model, ids, w, adapter_names=NAMES)
    low = _peft_by_adapter(ref, ids, w, NAMES)
    exact = _peft_by_adapter(truth, ids, w, NAMES)
    u = 2.0**-8
    for what, g, lo, ex in (("logits", got[0], low[0], exact[0]), ("input grad", got[1], low[1], exact[1])):
        assert _rel_rmse(g, ex) <= 2 * _rel_rmse(lo, ex) + u, what
    assert got[2].keys() == exact[2].keys()
    for n, ex in exact[2].items():
        assert _rel_rmse(got[2][n], ex) <= 2 * _rel_rmse(low[2][n], ex) + u, n


def _recording_masks(monkeypatch, routes=None):
    """Record, per patched layer, the keep-mask DoRA's base term read (module name filled in by the caller), and in
    ``routes`` how it read it: ``"bits"`` (the Triton kernels' stored mask, one kernel pass) or ``"mask"``."""
    seen, current = [], [None]
    apply, keep_mask, delta = dora_mod.apply, dora_mod._keep_mask, dora_mod._DroppedInputDelta

    def rec_apply(layer, *args, **kwargs):
        current[0] = layer
        return apply(layer, *args, **kwargs)

    def rec_keep(*args, **kwargs):
        keep = keep_mask(*args, **kwargs)
        seen.append((current[0], keep.clone()))
        if routes is not None:
            routes.append("mask")
        return keep

    def rec_delta(x, bits, kept):
        seen.append((current[0], unpack_keep_bits(bits, x.shape[1])))
        if routes is not None:
            routes.append("bits")
        return delta.apply(x, bits, kept)

    monkeypatch.setattr(dora_mod, "apply", rec_apply)
    monkeypatch.setattr(dora_mod, "_keep_mask", rec_keep)
    monkeypatch.setattr(dora_mod, "_DroppedInputDelta", types.SimpleNamespace(apply=rec_delta))
    return seen


@pytest.mark.parametrize("arch,path,store_mask", [
    pytest.param(arch, path, store, id=name, marks=() if path == "torch" else pytest.mark.interpreter)
    for arch, path, store, name in [
        ("llama", "torch", True, "llama-torch"), ("gpt2", "torch", True, "gpt2-torch"),
        ("llama_bias", "triton", True, "llama_bias-triton-stored"),
        ("llama", "triton", False, "llama-triton-store_mask_off"),
        ("gpt2", "triton-sgemm-added-params", True, "gpt2-triton-sgemm-added")]])
def test_training_under_dropout_matches_peft_with_the_same_masks(arch, path, store_mask, monkeypatch, combines):
    """lora_dropout > 0 in training: PEFT's DoRA recomputes the base term on the dropped input; with our masks
    given to PEFT's dropout modules, every output and gradient matches. A DoRA layer's op returns its mask, which
    the Triton kernels keep packed even with ``store_dropout_mask=False`` (the base term reads it in the forward)."""
    model, ref = build(arch, dropout=P)
    _patch(model, path, store_dropout_mask=store_mask)
    model.train()
    ref.train()
    routes = []
    seen = _recording_masks(monkeypatch, routes)
    ids, w = _inputs()
    torch.manual_seed(11)
    got = _step(model, ids, w, adapter_names=NAMES)
    names_of = {m: n for n, m in model.named_modules()}
    masks = {names_of[layer]: keep for layer, keep in seen}
    dora_layers = [m for m in model.modules() if getattr(m, "lora_magnitude_vector", None)]
    assert len(masks) == len(seen) == len(dora_layers)  # every layer (each holds d0) read its mask once
    # the Triton kernels' packed mask is read in one kernel pass; the torch backend's as booleans
    assert set(routes) == {"bits" if path.startswith("triton") else "mask"}, routes
    assert {t for _, t in combines} == ({True} if path.startswith("triton") else set())
    d0_rows = [i for i, n in enumerate(NAMES) if n == "d0"]
    for keep in masks.values():  # a real draw at p = 0.25 on d0's rows
        assert 0.6 < keep.view(len(NAMES), T, -1)[d0_rows].float().mean() < 0.9
    want = _peft_by_adapter(ref, ids, w, NAMES, masks)
    _assert_matches(got, want, model, NAMES)


@pytest.mark.parametrize("path", _cases(["torch", "triton"]))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eval_matches_peft(arch, path):
    """Eval, autograd off: full rows and one-token rows (Triton: the decode launch), twice each (Triton: the second
    call replays its launch plans); dropout configured but inactive in eval."""
    model, ref = build(arch, dropout=P)
    _patch(model, path)
    model.eval()
    ref.eval()
    for t in (T, 1):
        ids, _ = _inputs(t=t)
        with torch.no_grad():
            want = torch.cat([_peft_eval(ref, ids[i : i + 1], n) for i, n in enumerate(NAMES)])
            for _ in range(2):
                assert_close_max(model(input_ids=ids, adapter_names=NAMES).logits, want, torch.float32,
                                 f"logits T={t}")


def test_base_weight_changed_in_place():
    """The base weights' row norms are kept between calls (frozen weights): a weight changed in place (its version
    moves) is read again, on both paths (torch backend per-parameter / store)."""
    model, ref = build("llama")
    _patch(model, "torch")
    model.eval()
    ref.eval()
    ids, _ = _inputs()
    for step in range(2):
        with torch.no_grad():
            want = torch.cat([_peft_eval(ref, ids[i : i + 1], n) for i, n in enumerate(NAMES)])
            assert_close_max(model(input_ids=ids, adapter_names=NAMES).logits, want, torch.float32, f"call {step}")
            for m in (model, ref):  # every DoRA layer's base weight scaled in place
                for mod in m.modules():
                    if hasattr(mod, "lora_magnitude_vector") and len(mod.lora_magnitude_vector):
                        mod.get_base_layer().weight.mul_(1.5)


def _peft_eval(ref, ids, name):
    if name == "__base__":
        with ref.disable_adapter():
            return ref(input_ids=ids).logits
    ref.set_adapter(name)
    return ref(input_ids=ids).logits


@pytest.mark.interpreter
def test_packed_rows_match_peft(combines):
    """Packed rows (``adapter_ids``, the chunked family): each row one adapter's tokens, so PEFT per adapter is the
    oracle; ``g`` per token, so the combine kernels run one token per row."""
    model, ref = build("llama")
    _patch(model, "triton")
    model.train()
    ref.train()
    vocab = ["d2", "l0", "d0", "d1", "l1"]
    a_ids = torch.tensor([vocab.index(n) if n != "__base__" else -1 for n in NAMES])[:, None].expand(-1, T)
    ids, w = _inputs()
    got = _step(model, ids, w, adapter_names=vocab, adapter_ids=a_ids)
    _assert_matches(got, _peft_by_adapter(ref, ids, w, NAMES), model, NAMES)
    assert combines and {(shape[:2], t) for shape, t in combines} == {((len(NAMES) * T, 1), False)}


@pytest.mark.parametrize("store", [True, False], ids=["store", "params"])
def test_weight_norms_once_per_layer_call_and_absent_adapters(monkeypatch, store):
    """The norms are computed once per layer call for the DoRA adapters the batch names (not per row). A DoRA
    adapter the batch does not name gets no gradient, magnitude included, on both paths (as stock PEFT; its LoRA
    weights neither; exact zeros on the per-parameter path under a process group, which DDP needs:
    ``test_function.py``)."""
    model, _ = build("llama")
    fast_multilora.patch(model, backend="torch", adapter_store=store)
    model.train()
    calls = []
    norms = dora_mod.weight_norms

    def counting(W, As, Bs, scales, dtype):
        calls.append(len(As))
        return norms(W, As, Bs, scales, dtype)

    monkeypatch.setattr(dora_mod, "weight_norms", counting)
    names = ["d0", "d0", "l1", "__base__", "d1", "d0", "d1", "l0"]  # d2 absent
    ids, w = _inputs()
    got = _step(model, ids, w, adapter_names=names)
    expected = [len([n for n in ("d0", "d1") if n in m.lora_magnitude_vector])
                for m in model.modules() if getattr(m, "lora_magnitude_vector", None)]
    assert calls == expected
    d2 = {n for n, _ in model.named_parameters() if ".d2." in n}
    assert any("lora_magnitude_vector" in n for n in d2)
    assert not d2 & set(got[2]), "an absent adapter got a gradient"
    assert all(got[2][n].abs().sum() > 0 for n in got[2] if "lora_magnitude_vector" in n and ".d2." not in n)


def test_weight_norms_equal_the_direct_norm():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(48, 32, generator=g, dtype=torch.float64)
    As = [torch.randn(r, 32, generator=g, dtype=torch.float64) for r in (1, 4, 7)]
    Bs = [torch.randn(48, r, generator=g, dtype=torch.float64) for r in (1, 4, 7)]
    scales = (0.5, 2.0, 1.25)
    got = dora_mod.weight_norms(W.float(), [a.float() for a in As], [b.float() for b in Bs], scales)
    want = torch.stack([torch.linalg.norm(W + s * B @ A, dim=1) for A, B, s in zip(As, Bs, scales, strict=True)])
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=0)
    assert not got.requires_grad
    wide = dora_mod.weight_norms(W, As, Bs, scales, torch.float64)  # (a float64 layer's norms)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide, want, rtol=1e-12, atol=0)


def test_dora_layer_gradchecks_in_float64():
    """One DoRA layer call in float64 on the torch backend (its norms and gates in float64 too): gradcheck of the
    input and of every DoRA magnitude over a batch of two DoRA adapters, two LoRA adapters and base rows. (Not of
    ``lora_A`` / ``lora_B``: DoRA's weight norm is a constant in the backward, as in PEFT and the DoRA paper, so
    their gradients are by design not the numerical ones; the parity tests compare them with PEFT's.)"""
    model, _ = build("llama")
    model.double()
    fast_multilora.patch(model, backend="torch")
    layer = model.base_model.model.model.layers[0].self_attn.q_proj  # d0, d1 (DoRA), l0, l1 (LoRA)
    names = ["d0", "l1", "__base__", "d1", "l0", "d0"]
    x = torch.randn(len(names), 3, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5),
                    requires_grad=True)
    mags = [layer.lora_magnitude_vector[n].weight for n in ("d0", "d1")]

    def f(x, *mags):
        with fast_multilora.route(model, names):
            return layer(x)

    assert f(x).dtype == torch.float64
    assert torch.autograd.gradcheck(f, (x, *mags), eps=1e-6, atol=1e-7)


def test_models_without_dora_take_no_dora_work(monkeypatch):
    from models import peft_model

    from fast_multilora.patching import _STATE_ATTR

    model = peft_model()
    fast_multilora.patch(model, backend="torch")

    def fail(*args, **kwargs):
        raise AssertionError("DoRA work on a model without DoRA adapters")

    monkeypatch.setattr(dora_mod, "apply", fail)
    model.train()
    model(input_ids=_inputs(4)[0], adapter_names=["a0", "a1", "__base__", "a2"]).logits.sum().backward()
    states = [m.__dict__.get(_STATE_ATTR) for m in model.modules() if _STATE_ATTR in m.__dict__]
    assert states and all(s is None or s.dora is None for s in states)


@pytest.mark.parametrize("path", _cases(["torch", "triton"]))
def test_forward_without_autograd_in_training_mode_under_dropout(path):
    """A training-mode forward under ``torch.no_grad()`` (dropout active, the op's Function not recorded): DoRA's
    base term reads the mask the op returns there too; the logits equal a recorded forward's from the same RNG
    state."""
    model, _ = build("llama", P)
    _patch(model, path)
    model.train()
    ids, _ = _inputs()
    torch.manual_seed(3)
    want = model(input_ids=ids, adapter_names=NAMES).logits.detach()
    torch.manual_seed(3)
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=NAMES).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("path", _cases(["torch", "triton"]))
@pytest.mark.parametrize("dropout", [0.0, P], ids=["no-dropout", "dropout"])
def test_compiled_equals_eager(dropout, path):
    """``torch.compile`` (``aot_eager``): one graph, no break, under dropout in training too (a DoRA layer's op
    returns the mask it drew with its output, and the base term on the dropped input reads it inside the graph); the
    same results as eager. (Under dropout both draw the same masks from the same RNG state: the torch backend from
    torch's RNG, the Triton kernels from a seed drawn on the CPU generator eagerly and by the graph.) The layer calls'
    cached host-made constants are cleared first: the graph makes its own, whatever ran before in the process."""
    from torch._dynamo.utils import counters

    dora_mod._KEPT.clear()
    model, _ = build("llama", dropout)
    _patch(model, path)
    model.train()
    ids, w = _inputs()
    torch.manual_seed(5)
    want = _step(model, ids, w, adapter_names=NAMES)
    torch.manual_seed(5)
    got = _step(torch.compile(model, backend="aot_eager"), ids, w, adapter_names=NAMES)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters["graph_break"])
    _assert_matches((got[0], got[1], {n.removeprefix("_orig_mod."): g for n, g in got[2].items()}), want, model,
                    NAMES)


def test_qlora_nf4_base_matches_peft(tmp_path):
    """A bitsandbytes 4-bit base (the added-base path): the norms from PEFT's dequantized weight, as PEFT's DoRA."""
    pytest.importorskip("bitsandbytes")
    from test_quantized import quantized_base
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # bitsandbytes' CPU 4-bit layers need in_features >= 64
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=97)).save_pretrained(tmp_path)
    common = dict(init_lora_weights=False, target_modules=["q_proj", "v_proj", "down_proj"])
    torch.manual_seed(1)
    adapters = {"d0": LoraConfig(r=4, lora_alpha=8, use_dora=True, **common), "l0": LoraConfig(r=2, **common)}
    model = with_adapters(quantized_base(tmp_path, "nf4"), adapters)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_magnitude_vector" in n:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    ref = twin(model)
    _patch(model, "torch")
    model.train()
    ref.train()
    names = ["d0", "l0", "__base__", "d0"]
    ids, w = _inputs(len(names))
    _assert_matches(_step(model, ids, w, adapter_names=names), _peft_by_adapter(ref, ids, w, names), model, names)


@pytest.mark.interpreter
def test_float64_inputs_to_a_4bit_base_take_the_torch_gates(tmp_path):
    """float64 activations into a bitsandbytes 4-bit DoRA layer (its dequantized weight float32, its output float64:
    the layer computes its norms and gates in float64) on the Triton backend: the gates come from torch's ops, not
    the float32 kernel, and the output equals the torch backend's."""
    pytest.importorskip("bitsandbytes")
    from test_quantized import quantized_base
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # bitsandbytes' CPU 4-bit layers need in_features >= 64
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=97)).save_pretrained(tmp_path)
    common = dict(init_lora_weights=False, target_modules=["q_proj"])
    adapters = {"d0": LoraConfig(r=4, lora_alpha=8, use_dora=True, **common), "l0": LoraConfig(r=2, **common)}
    x = torch.randn(3, 2, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    names = ["d0", "l0", "__base__"]
    out = {}
    for backend in ("torch", "triton"):
        torch.manual_seed(1)
        model = with_adapters(quantized_base(tmp_path, "nf4"), adapters)
        fast_multilora.patch(model, backend=backend)
        with fast_multilora.route(model, names):
            out[backend] = model.base_model.model.model.layers[0].self_attn.q_proj(x)
    assert out["triton"].dtype == torch.float64
    torch.testing.assert_close(out["triton"], out["torch"], rtol=1e-6, atol=1e-6)
