"""Hostile inputs: one test per row of docs/errors.md. Each case gives a clear error naming what is wrong, or a
documented fallback whose result is checked against stock PEFT -- never a silently wrong result.

Models are the tiny ones of tests/models.py (CPU, seeded). Triton rows run under the interpreter; the ones that need
a backward pass skip until ``fast_multilora.kernels`` exports the backward launchers.
"""

import ast
import re
import warnings
from pathlib import Path

import pytest
import torch
from fast_multilora.kernels import api as kernels
from fast_multilora.kernels.api import lora_expand, lora_shrink
from helpers import CPU_BACKENDS, make_segments, make_table
from models import peft_model, twin
from peft import LoraConfig

import fast_multilora
from fast_multilora import reference as ref
from fast_multilora.function import get_backend

NAMES = ["a2", "a0", "__base__", "a1"]
HAS_TRITON_BWD = hasattr(kernels, "lora_expand_bwd") and hasattr(kernels, "lora_shrink_bwd")
BACKENDS = [
    pytest.param("torch"),
    pytest.param("triton", marks=[pytest.mark.interpreter,
                                  pytest.mark.skipif(not HAS_TRITON_BWD, reason="Triton backward not exported yet")]),
]


def _ids(rows=4, T=7, seed=0):
    return torch.randint(0, 97, (rows, T), generator=torch.Generator().manual_seed(seed))


def _per_sample(plain, ids, names, **kw):
    """Stock PEFT, one row at a time with its adapter alone (or adapters disabled for ``__base__``)."""
    outs = []
    for i, name in enumerate(names):
        row = {k: v[i : i + 1] for k, v in dict(input_ids=ids, **kw).items()}
        if name == "__base__":
            with plain.disable_adapter():
                outs.append(plain(**row).logits)
        else:
            plain.set_adapter(name)
            outs.append(plain(**row).logits)
    return torch.cat(outs)


def _layer(model, i=0, name="q_proj"):
    return getattr(model.base_model.model.model.layers[i].self_attn, name)


# --- names ----------------------------------------------------------------------------------------------------------


def test_unknown_adapter_names():
    model = peft_model()
    fast_multilora.patch(model)
    with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \['nope', 'zz'\].*adapters \['a0', 'a1', 'a2'\]"):
        model(input_ids=_ids(), adapter_names=["a0", "nope", "zz", "a2"])
    # PEFT's own message comes first, so code (and PEFT's tests) matching it keep working
    with pytest.raises(ValueError, match=r"^Trying to infer with non-existing adapter\(s\): nope, zz"):
        model(input_ids=_ids(), adapter_names=["a0", "nope", "zz", "a2"])
    # packed rows: the vocabulary is checked the same way
    with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \['A0'\]"):
        model(input_ids=_ids(), adapter_names=["A0", "a1"], adapter_ids=torch.zeros(4, 7, dtype=torch.long))
    # the route() context as well
    with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \[''\]"):
        with fast_multilora.route(model, ["", "a0", "a0", "a0"]):
            pass


def test_wrong_number_or_type_of_names():
    model = peft_model()
    fast_multilora.patch(model)
    for names in (["a0", "a1", "a2"], ["a0"] * 5, []):
        with pytest.raises(ValueError, match=f"Length of `adapter_names`.*got {len(names)} and 4"):
            model(input_ids=_ids(), adapter_names=names)
    with pytest.raises(TypeError, match="list of adapter names, one per sample, not a single string"):
        model(input_ids=_ids(), adapter_names="a0")
    with pytest.raises(TypeError, match="must hold strings, got NoneType"):
        model(input_ids=_ids(), adapter_names=["a0", None, "a1", "a2"])


def test_names_to_unpatched_model():
    """Stock PEFT: an error in training, its own per-sample loop in eval (same result as ours). Where fast_multilora
    is imported, PEFT's training-mode error goes on to name ``fast_multilora.patch(model)``, PEFT's sentence first."""
    model = peft_model()
    plain = twin(model)
    model.train()
    hint = r"\. This model is not patched by fast_multilora: call fast_multilora\.patch\(model\)"
    with pytest.raises(ValueError, match=r"^Cannot pass `adapter_names` when the model is in training mode" + hint):
        model(input_ids=_ids(), adapter_names=NAMES)
    with pytest.raises(ValueError, match="not patched"):
        fast_multilora.route(model, NAMES)
    fast_multilora.patch(plain)
    _assert_same_in_eval(model, plain)


def test_peft_training_mode_hint_is_added_once_and_only_to_that_error():
    """The hint wraps PEFT's method once per process (a second call, or a re-imported fast_multilora, adds nothing)
    and leaves PEFT's other errors of that method as they are."""
    from peft.tuners.lora.model import LoraModel

    from fast_multilora import _third_party

    hooks = LoraModel._enable_peft_forward_hooks
    _third_party.hint_patch_in_peft_training_error()
    assert LoraModel._enable_peft_forward_hooks is hooks and hooks._fml_patch_hint
    model = peft_model()
    model.train()
    with pytest.raises(ValueError) as e:
        model(input_ids=_ids(), adapter_names=NAMES)
    assert str(e.value).count("fast_multilora.patch") == 1
    model.eval()
    with pytest.raises(ValueError) as e:
        model(input_ids=_ids(), adapter_names=["a0", "zz", "a0", "a0"])
    assert str(e.value) == "Trying to infer with non-existing adapter(s): zz"  # PEFT's, untouched


def _assert_same_in_eval(model, plain):
    """In eval, the mixed batch gives the same logits on both models (PEFT's per-sample loop or ours)."""
    model.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids(), adapter_names=NAMES).logits,
                                   plain(input_ids=_ids(), adapter_names=NAMES).logits, rtol=1e-5, atol=1e-6)


def test_names_after_unpatch_are_stock_peft():
    model = peft_model()
    fast_multilora.patch(model)
    fast_multilora.unpatch(model)
    model.train()
    with pytest.raises(ValueError, match="Cannot pass `adapter_names` when the model is in training mode"):
        model(input_ids=_ids(), adapter_names=NAMES)


def test_partially_patched_model():
    """patch() on one decoder layer of a PeftModel: training raises PEFT's error; in eval PEFT's hooks hand the
    names to every LoRA layer, the patched ones route them, and the result equals stock PEFT."""
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model.base_model.model.model.layers[0])
    model.train()
    with pytest.raises(ValueError, match="Cannot pass `adapter_names` when the model is in training mode"):
        model(input_ids=_ids(), adapter_names=NAMES)
    _assert_same_in_eval(model, plain)


def test_new_lora_layers_after_patch_are_routed():
    """add_adapter() on modules that had no LoRA layer creates unpatched layers: they must not silently run the
    active adapter for rows that name the new one (training mode, gradients included)."""
    configs = {"a0": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False)}
    model = peft_model(configs=configs)
    plain = twin(model)
    fast_multilora.patch(model)
    for m in (model, plain):
        torch.manual_seed(5)
        m.add_adapter("new", LoraConfig(r=2, lora_alpha=2, target_modules=["v_proj"], init_lora_weights=False))
        for n, p in m.named_parameters():
            p.requires_grad_("lora_" in n)
    model.train()
    plain.train()
    names = ["new", "a0", "new", "__base__"]
    out = model(input_ids=_ids(), adapter_names=names).logits
    torch.testing.assert_close(out, _per_sample(plain, _ids(), names), rtol=1e-5, atol=1e-6)


def test_merged_adapters():
    model = peft_model()
    fast_multilora.patch(model)
    model.set_adapter("a0")
    model.merge_adapter()
    for train in (False, True):
        model.train(train)
        with pytest.raises(ValueError, match="merged adapters, please call `unmerge_adapter` first"):
            model(input_ids=_ids(), adapter_names=NAMES)
    model.unmerge_adapter()
    model(input_ids=_ids(), adapter_names=NAMES)


def test_adapters_added_deleted_renamed_after_patch(tmp_path):
    """The slot table is rebuilt from the model's adapters every call: new names work, deleted names raise, and
    a rename (save, delete, load under another name) routes the new name to the same weights."""
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model)
    model.eval()
    plain.eval()
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids, adapter_names=NAMES).logits
        for m in (model, plain):
            torch.manual_seed(9)
            m.add_adapter("new", LoraConfig(r=3, target_modules=["k_proj", "o_proj"], init_lora_weights=False))
        names = ["new", "a0", "__base__", "new"]
        torch.testing.assert_close(model(input_ids=ids, adapter_names=names).logits,
                                   plain(input_ids=ids, adapter_names=names).logits, rtol=1e-5, atol=1e-6)
        model.save_pretrained(tmp_path, selected_adapters=["a2"])
        model.delete_adapter("a2")
        with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \['a2'\].*\['a0', 'a1', 'new'\]"):
            model(input_ids=ids, adapter_names=NAMES)
        model.load_adapter(str(tmp_path / "a2"), adapter_name="renamed")
        renamed = ["renamed", "a0", "__base__", "a1"]
        torch.testing.assert_close(model(input_ids=ids, adapter_names=renamed).logits, before, rtol=0, atol=0)


def test_deleted_adapter_named_through_peft_layer_kwargs():
    """Names handed straight to a layer (PEFT's own hooks do this in generate() of a partially patched model) are
    cached per name tuple: a deletion in between must raise, not route the deleted adapter's rows to the base."""
    model = peft_model()
    fast_multilora.patch(model)
    model.eval()
    layer = _layer(model)
    x = torch.randn(4, 5, 32)
    with torch.no_grad():
        layer(x, adapter_names=NAMES)
        model.delete_adapter("a2")
        with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \['a2'\]"):
            layer(x, adapter_names=NAMES)


def test_set_adapter_between_steps():
    """Routing follows adapter_names, not the active adapter; PEFT's set_adapter() does freeze the other adapters
    (requires_grad=False), so they get no gradient until requires_grad is switched back on."""
    model = peft_model()
    fast_multilora.patch(model)
    model.train()
    ids = _ids()
    with torch.no_grad():
        model.eval()
        model(input_ids=ids, adapter_names=NAMES)  # the first call runs unshared; sharing a shrink changes low bits
        before = model(input_ids=ids, adapter_names=NAMES).logits
        model.set_adapter("a1")
        after = model(input_ids=ids, adapter_names=NAMES).logits
    assert torch.equal(before, after)
    model.train()
    model(input_ids=ids, adapter_names=NAMES).logits.square().mean().backward()
    grads = {n: p.grad is not None for n, p in model.named_parameters() if "lora_" in n}
    assert all(g == (".a1." in n) for n, g in grads.items())
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    model.zero_grad()
    model(input_ids=ids, adapter_names=NAMES).logits.square().mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_lora_variants_dora_and_alora():
    model = peft_model()
    model.add_adapter("dora", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, init_lora_weights=False))
    model.add_adapter("al", LoraConfig(r=2, target_modules=["v_proj"], alora_invocation_tokens=[5, 6],
                                       init_lora_weights=False))
    plain = twin(model)
    with pytest.warns(UserWarning, match="LoRA variants other than DoRA") as warned:
        fast_multilora.patch(model)
    assert not any("'dora'" in str(w.message) for w in warned)  # DoRA runs in mixed batches (tests/test_dora.py)
    model.eval()
    plain.eval()
    with torch.no_grad():
        model(input_ids=_ids(), adapter_names=["dora", "a0", "a1", "a2"])
    with pytest.raises(ValueError, match=r"^adapter 'al' uses a LoRA variant \(ALoraLinearVariant\) in module Linear; "
                                         r"mixed batches run vanilla LoRA and DoRA adapters only"):
        model(input_ids=_ids(), adapter_names=["al", "a0", "a1", "a2"])
    with pytest.raises(ValueError, match=r"does not route aLoRA \(`alora_offsets`\) in a mixed batch"):
        model(input_ids=_ids(), adapter_names=NAMES, alora_offsets=[1, 1, 1, 1])
    with torch.no_grad():  # without adapter_names, aLoRA runs PEFT's own path, as on the stock model
        model.set_adapter("al")
        plain.set_adapter("al")
        for offsets in ([1, 1, 1, 1], [3, 2, 5, 1]):
            assert torch.equal(model(input_ids=_ids(), alora_offsets=offsets).logits,
                               plain(input_ids=_ids(), alora_offsets=offsets).logits)
        model.set_adapter("a0")
        plain.set_adapter("a0")
    with torch.no_grad():
        # batches that do not name them run; without adapter_names PEFT's own DoRA forward runs
        torch.testing.assert_close(model(input_ids=_ids(), adapter_names=NAMES).logits,
                                   plain(input_ids=_ids(), adapter_names=NAMES).logits, rtol=1e-5, atol=1e-6)
        model.set_adapter("dora")
        plain.set_adapter("dora")
        assert torch.equal(model(input_ids=_ids()).logits, plain(input_ids=_ids()).logits)


def test_mixed_lora_bias_in_one_layer():
    configs = {
        "b0": LoraConfig(r=2, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False),
        "b1": LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft_model(configs=configs)
    fast_multilora.patch(model)
    with pytest.raises(ValueError, match="mixed lora_bias settings in one layer are not supported"):
        model(input_ids=_ids(), adapter_names=["b0", "b1", "b0", "__base__"])


def test_backend_settings():
    model = peft_model()
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        fast_multilora.patch(model, backend="cuda")
    with pytest.raises(ValueError, match="unknown family 'sgmv'"):
        fast_multilora.patch(model, family="sgmv")


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="needs the Triton interpreter: set TRITON_INTERPRET=1"):
        get_backend("triton", torch.device("cpu"))


# --- inputs ---------------------------------------------------------------------------------------------------------


def test_input_on_another_device_than_the_weights():
    """CPU can only test a "meta" tensor against CPU weights; a CUDA batch against CPU weights (or the reverse)
    fails the same way in the base layer first (torch's "Expected all tensors to be on the same device")."""
    model = peft_model()
    fast_multilora.patch(model)
    with pytest.raises(RuntimeError, match="device meta is not on the expected device cpu"):
        model(inputs_embeds=torch.randn(4, 7, 32, device="meta"), adapter_names=NAMES)
    layer = _layer(model)  # a layer called directly: the base Linear lets a meta input through; we do not
    with fast_multilora.route(model, NAMES):
        with pytest.raises(ValueError, match="input is on meta but the LoRA weights of this layer are on cpu"):
            layer(torch.randn(4, 7, 32, device="meta"))
    # the kernel launchers check every tensor against the activations' device
    table = make_table([2, 3])
    segs = make_segments(torch.tensor([0, 0, 1, -1]), False)
    with pytest.raises(ValueError, match="A_cat is on meta, expected cpu"):
        lora_shrink(torch.randn(4, 8), torch.randn(5, 8, device="meta"), segs, table)
    with pytest.raises(ValueError, match="h is on cpu, expected meta"):
        lora_expand(torch.zeros(4, 3), torch.randn(6, 5), segs, table, torch.zeros(4, 6, device="meta"))
    if HAS_TRITON_BWD:
        with pytest.raises(ValueError, match="h is on meta"):
            kernels.lora_expand_bwd(torch.randn(4, 6), torch.zeros(4, 3, device="meta"), torch.randn(6, 5), segs,
                                    table)
        with pytest.raises(ValueError, match="A_cat is on meta"):
            kernels.lora_shrink_bwd(torch.randn(4, 3), torch.randn(4, 8), torch.randn(5, 8, device="meta"), segs,
                                    table)


@pytest.mark.parametrize("backend", BACKENDS)
def test_noncontiguous_and_strided_inputs(backend):
    """A transposed or sliced activation fed to a patched layer gives the contiguous result, forward and backward."""
    model = peft_model()
    fast_multilora.patch(model, backend=backend)
    model.train()
    layer = _layer(model)
    g = torch.Generator().manual_seed(1)
    inputs = {
        "transposed": torch.randn(7, 4, 32, generator=g).transpose(0, 1),
        "last-dim stride 2": torch.randn(4, 7, 64, generator=g)[..., ::2],
        "row slice": torch.randn(8, 7, 32, generator=g)[::2],
        "expanded": torch.randn(1, 7, 32, generator=g).expand(4, 7, 32),
    }
    for what, x in inputs.items():
        assert not x.is_contiguous()
        results = []
        for inp in (x, x.contiguous()):
            inp = inp.detach().requires_grad_()
            model.zero_grad()
            with fast_multilora.route(model, NAMES):
                y = layer(inp)
            (y * torch.arange(y.numel()).reshape(y.shape).sin()).sum().backward()
            results.append((y.detach(), inp.grad, {n: p.grad.clone() for n, p in layer.named_parameters()
                                                    if p.grad is not None}))
        (y1, dx1, g1), (y2, dx2, g2) = results
        torch.testing.assert_close(y1, y2, rtol=1e-6, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")
        torch.testing.assert_close(dx1, dx2, rtol=1e-6, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")
        assert g1.keys() == g2.keys() and g1
        for n in g1:
            torch.testing.assert_close(g1[n], g2[n], rtol=1e-5, atol=1e-6, msg=lambda m, w=what: f"{w}: {m}")


def test_strided_tensors_at_the_kernel_launchers():
    """The forward launchers take any row stride and refuse a strided last dim with a clear error; the backward
    launchers either compute the reference result or refuse, never return a wrong one."""
    table = make_table([2, 3])
    segs = make_segments(torch.tensor([0, 0, 1, -1, 1]), False)
    g = torch.Generator().manual_seed(2)
    x_wide = torch.randn(5, 16, generator=g)
    A, B = torch.randn(5, 8, generator=g), torch.randn(6, 5, generator=g)
    h = lora_shrink(x_wide[:, :8], A, segs, table)
    defined = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    torch.testing.assert_close(h[defined], ref.lora_shrink(x_wide[:, :8], A, segs, table)[defined])
    with pytest.raises(ValueError, match="x must be contiguous in its last dim"):
        lora_shrink(x_wide[:, ::2], A, segs, table)
    with pytest.raises(ValueError, match="y must be contiguous in its last dim"):
        lora_expand(h, B, segs, table, torch.zeros(6, 5).T)
    if not HAS_TRITON_BWD:
        return
    dy = torch.randn(12, 5, generator=g)[::2].T  # [5, 6], column-major
    h = ref.lora_shrink(x_wide[:, :8], A, segs, table)
    for args, fn, want in (
        ((dy, h, B), kernels.lora_expand_bwd, ref.lora_expand_bwd(dy.contiguous(), h, B, segs, table)),
        ((h, x_wide[:, ::2], A), kernels.lora_shrink_bwd, ref.lora_shrink_bwd(h, x_wide[:, ::2].contiguous(), A,
                                                                                segs, table)),
    ):
        try:
            got = fn(*args, segs, table)
        except ValueError as e:
            assert "contiguous" in str(e) or "stride" in str(e), e
            continue
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
        if fn is kernels.lora_shrink_bwd:
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got[0][defined], want[0][defined], rtol=1e-5, atol=1e-5)


def _exact_per_sample(model, ids, names):
    """PEFT per sample with every LoRA weight upcast to float32 (the exact math of the stored weights)."""
    exact = twin(model)
    for n, p in exact.named_parameters():
        if "lora_" in n:
            p.data = p.data.float()
    return _per_sample(exact, ids, names)


DTYPE_MIXES = [
    pytest.param("torch", torch.float32, torch.bfloat16, id="torch-fp32act-bf16lora"),
    pytest.param("torch", torch.float32, torch.float16, id="torch-fp32act-fp16lora"),
    pytest.param("torch", torch.bfloat16, torch.float32, id="torch-bf16act-fp32lora"),
    pytest.param("torch", torch.float16, torch.float32, id="torch-fp16act-fp32lora"),
    pytest.param("torch", torch.float32, "mixed", id="torch-fp32act-mixed-lora"),
    pytest.param("torch", torch.float32, "mixed16", id="torch-fp32act-mixed16-lora"),
    pytest.param("triton", torch.float32, torch.float16, id="triton-fp32act-fp16lora", marks=pytest.mark.interpreter),
    pytest.param("triton", torch.float16, torch.float32, id="triton-fp16act-fp32lora", marks=pytest.mark.interpreter),
]


@pytest.mark.parametrize("backend, act_dtype, lora_dtype", DTYPE_MIXES)
def test_dtype_mixes(backend, act_dtype, lora_dtype):
    """16-bit adapters with fp32 activations: the input is cast to the adapter dtype (as PEFT does) and the delta
    computed in fp32; fp32 adapters with 16-bit activations: fp32 math, one rounding into the base output. Either
    way each row is at least about as close to the exact result as stock PEFT's own mixed batch."""
    model = peft_model(dtype=act_dtype)  # PEFT keeps adapters in fp32 on a 16-bit base (autocast_adapter_dtype)
    for n, p in model.named_parameters():
        if "lora_" in n:
            dt = lora_dtype
            if isinstance(lora_dtype, str):  # per-adapter dtypes, fp32 for the others
                per = {"mixed": {".a1.": torch.bfloat16}, "mixed16": {".a1.": torch.bfloat16, ".a2.": torch.float16}}
                dt = next((v for k, v in per[lora_dtype].items() if k in n), torch.float32)
            p.data = p.data.to(dt)
    plain = twin(model)
    fast_multilora.patch(model, backend=backend)
    model.eval()
    plain.eval()
    ids = _ids()
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=NAMES).logits
        peft = plain(input_ids=ids, adapter_names=NAMES).logits
        exact = _exact_per_sample(plain, ids, NAMES)
    assert got.dtype == peft.dtype
    scale = exact.abs().max().item()
    for i, name in enumerate(NAMES):
        lowp = act_dtype
        if act_dtype == torch.float32 and name != "__base__":  # the row's adapter dtype
            lowp = next(p.dtype for n, p in model.named_parameters() if f"lora_A.{name}." in n)
        slack = 4 * torch.finfo(lowp).eps * scale
        err = (got[i].double() - exact[i].double()).abs().max().item()
        peft_err = (peft[i].double() - exact[i].double()).abs().max().item()
        assert err <= 2 * peft_err + slack, f"row {i} ({name}): error {err:.3g} vs PEFT's {peft_err:.3g}"


@pytest.mark.interpreter
def test_empty_batch_and_zero_length():
    """Zero rows or zero tokens at a patched layer: an empty output and empty gradients, both backends.
    A whole tiny Llama with batch 0 fails in transformers' attention reshape, patched or not (same error)."""
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model)
    model.train()
    for backend in ["torch"] + (["triton"] if HAS_TRITON_BWD else []):
        fast_multilora.patch(model, backend=backend)
        layer = _layer(model)
        for shape, names in (((0, 7, 32), []), ((3, 0, 32), ["a0", "a1", "__base__"]), ((0, 32), [])):
            x = torch.randn(*shape, requires_grad=True)
            with fast_multilora.route(model, names):
                y = layer(x)
            assert y.shape == (*shape[:-1], layer.out_features)
            y.sum().backward()
            assert x.grad.shape == x.shape
    model.eval()
    plain.eval()
    empty = torch.zeros(0, 7, dtype=torch.long)
    with pytest.raises(RuntimeError) as ours:
        model(input_ids=empty, adapter_names=[])
    with pytest.raises(RuntimeError) as theirs:
        plain(input_ids=empty, adapter_names=[])
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_token_batch(backend):
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model, backend=backend)
    model.train()
    plain.train()
    for name in ("a1", "__base__"):
        ids = _ids(1, 1)
        model.zero_grad()
        out = model(input_ids=ids, adapter_names=[name]).logits
        out.square().sum().backward()
        torch.testing.assert_close(out.detach(), _per_sample(plain, ids, [name]).detach(), rtol=1e-5, atol=1e-6)
        grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.count_nonzero()}
        assert all(f".{name}." in n for n in grads) and (bool(grads) == (name != "__base__"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_or_inf_in_one_sample_stays_in_that_sample(backend, bad):
    """A NaN/Inf in one row: the other rows' outputs, the other adapters' losses and gradients stay finite."""
    model = peft_model(dropout=0.1)
    fast_multilora.patch(model, backend=backend)
    model.train()
    ids = _ids()
    names = ["a2", "a0", "a1", "a0"]
    emb = model.get_input_embeddings()(ids).detach().clone()
    emb[1, 3] = bad  # row 1 (adapter a0); row 3 also uses a0
    out = model(inputs_embeds=emb, adapter_names=names).logits
    assert out[[0, 2]].isfinite().all() and not out[1].isfinite().all()
    loss, per = fast_multilora.per_adapter_loss(out, ids, names, return_dict=True)
    assert torch.isfinite(torch.tensor([per["a1"], per["a2"]])).all(), per
    loss.backward()
    for n, p in model.named_parameters():
        if p.grad is not None and ".a0." not in n:
            assert p.grad.isfinite().all(), n
    assert any(not p.grad.isfinite().all() for n, p in model.named_parameters() if ".a0." in n and p.grad is not None)


def test_adapter_ids_out_of_range_or_wrong_shape():
    model = peft_model()
    fast_multilora.patch(model)
    ids = _ids()
    vocab = ["a0", "a1"]
    cases = {
        r"values must lie in \[-1, 1\].*got \[0, 2\]": torch.tensor([[0] * 6 + [2]] * 4),
        r"values must lie in \[-1, 1\].*got \[-2, 0\]": torch.tensor([[0] * 6 + [-2]] * 4),
        r"has shape \(4, 6\) but the layer input has leading shape \(4, 7\)": torch.zeros(4, 6, dtype=torch.long),
        r"has shape \(28,\) but the layer input has leading shape \(4, 7\)": torch.zeros(28, dtype=torch.long),
    }
    for msg, a_ids in cases.items():
        with pytest.raises(ValueError, match=msg):
            model(input_ids=ids, adapter_names=vocab, adapter_ids=a_ids)
    for a_ids in (torch.zeros(4, 7), [[0] * 7] * 4):
        with pytest.raises(TypeError, match="must be an integer tensor"):
            model(input_ids=ids, adapter_names=vocab, adapter_ids=a_ids)
    with pytest.raises(ValueError, match="`adapter_ids` needs `adapter_names`"):
        model(input_ids=ids, adapter_ids=torch.zeros(4, 7, dtype=torch.long))


def test_adapter_ids_with_a_fallback_layer():
    configs = {"e0": LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)}
    model = peft_model(configs=configs)
    with pytest.warns(UserWarning, match="per-sample mixed-batch loop"):
        fast_multilora.patch(model)
    with pytest.raises(ValueError, match="packed rows .* cannot run on a layer that falls back"):
        model(input_ids=_ids(), adapter_names=["e0"], adapter_ids=torch.zeros(4, 7, dtype=torch.long))


def test_adapter_ids_to_an_unpatched_model_are_ignored_by_transformers():
    """Documented hazard outside our code: stock transformers models take **kwargs, so `adapter_ids` given to an
    UNPATCHED model is dropped and the rows are routed by `adapter_names` per row (eval) -- patch first."""
    model = peft_model()
    model.eval()
    ids = _ids()
    packed = torch.tensor([[0] * 3 + [1] * 4] * 4)
    with torch.no_grad():
        out = model(input_ids=ids, adapter_names=["a0", "a1", "a1", "a0"], adapter_ids=packed).logits
        per_row = model(input_ids=ids, adapter_names=["a0", "a1", "a1", "a0"]).logits
    assert torch.equal(out, per_row)


def test_per_adapter_loss_checks_shapes():
    """Labels, logits or `adapter_ids` of the wrong shape: the shapes given and the ones expected, before any loss
    math (torch's own message spoke of a batch size)."""
    logits, labels = torch.randn(2, 5, 11), torch.zeros(2, 5, dtype=torch.long)
    names = ["a0", "a1"]
    for bad in (torch.zeros(2, 6, dtype=torch.long), torch.zeros(10, dtype=torch.long),
                torch.zeros(3, 5, dtype=torch.long), torch.zeros(2, 5, 1, dtype=torch.long)):
        msg = rf"labels must be \[batch, seq\] = \(2, 5\) to match logits of shape \(2, 5, 11\), got shape " \
              rf"{re.escape(str(tuple(bad.shape)))}"
        with pytest.raises(ValueError, match=msg):
            fast_multilora.per_adapter_loss(logits, bad, names)
    with pytest.raises(ValueError, match=r"logits must be \[batch, seq, vocab\].*got shape \(10, 11\)"):
        fast_multilora.per_adapter_loss(logits.reshape(10, 11), labels, names)
    with pytest.raises(ValueError, match=r"`adapter_ids` must be \[batch, seq\] = \(2, 5\).*got shape \(2, 4\)"):
        fast_multilora.per_adapter_loss(logits, labels, names, adapter_ids=torch.zeros(2, 4, dtype=torch.long))
    ok = fast_multilora.per_adapter_loss(logits, labels, names, adapter_ids=torch.zeros(2, 5, dtype=torch.long))
    assert ok.isfinite()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_float64_inputs_embeds(backend):
    """float64 `inputs_embeds` into a model of another dtype fails in the base layers on stock PEFT as well; a
    patched model says so at its entry, naming the dtypes and the fix. A float64 model takes them, as stock PEFT's
    does, with the same logits."""
    embeds = torch.randn(4, 7, 32, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        model = peft_model(dtype=dtype)
        plain = twin(model)
        plain.eval()
        with pytest.raises(RuntimeError, match="dtype"):  # stock PEFT: torch's own message from a base layer
            plain(inputs_embeds=embeds, adapter_names=NAMES)
        fast_multilora.patch(model, backend=backend)
        for mode in (model.train, model.eval):
            mode()
            msg = rf"^inputs_embeds is float64 but the model's embeddings are {dtype}: cast it to the model's dtype"
            with pytest.raises(TypeError, match=msg + rf" \(inputs_embeds\.to\({dtype}\)\)"):
                model(inputs_embeds=embeds, adapter_names=NAMES)
    model = peft_model(dtype=torch.float64)
    plain = twin(model)
    fast_multilora.patch(model, backend=backend)
    model.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=embeds, adapter_names=NAMES).logits,
                                   plain(inputs_embeds=embeds, adapter_names=NAMES).logits)


# --- every error is documented --------------------------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parents[2]
_HOLE = object()


def _text_runs(node):
    """The literal text of a message expression with ``_HOLE`` where a value goes; None if it is no string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) else _HOLE for v in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text_runs(node.left), _text_runs(node.right)
        return None if left is None or right is None else left + right
    return None


def _message_start(runs) -> str:
    """The message's first literal run of at least three words, stripped of the punctuation next to the values;
    where no run has three, the whole message with ``…`` for each value (as docs/errors.md writes them)."""
    pieces, text = [], ""
    for r in [*runs, _HOLE]:
        if r is _HOLE:
            pieces.append(text.strip(" :;,.-'\"()"))
            text = ""
        else:
            text += r
    whole = "".join("…" if r is _HOLE else r for r in runs).strip()
    return next((p for p in pieces if len(p.split()) >= 3), whole)


def _error_messages(path: Path):
    """``[(line, message start)]`` of every exception a source file raises (``raise E(msg)``, ``return E(msg)`` of
    a helper building one, and the calls of a helper raising its parameter, e.g. ``_check(cond, msg)``), plus the
    lines whose message is no string it can read."""
    tree = ast.parse(path.read_text())
    parents = {c: n for n in ast.walk(tree) for c in ast.iter_child_nodes(n)}

    def function_of(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    found, unreadable, helpers = [], [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise):
            call = node.exc
        elif isinstance(node, ast.Return):
            call = node.value
        else:
            continue
        if not isinstance(call, ast.Call) or not ast.unparse(call.func).endswith(("Error", "Exception")):
            continue  # a bare re-raise, or a helper's call (its own ``return E(...)`` is collected)
        if not call.args:
            unreadable.append(node.lineno)
            continue
        runs = _text_runs(call.args[0])
        fn = function_of(node)
        params = [a.arg for a in fn.args.args] if fn else []
        if runs is not None:
            found.append((node.lineno, _message_start(runs)))
        elif isinstance(call.args[0], ast.Name) and call.args[0].id in params:
            helpers[fn.name] = params.index(call.args[0].id)
        else:
            unreadable.append(node.lineno)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in helpers:
            i = helpers[node.func.id]
            runs = _text_runs(node.args[i]) if len(node.args) > i else None
            if runs is None:
                unreadable.append(node.lineno)
            else:
                found.append((node.lineno, _message_start(runs)))
    return found, unreadable


def test_docs_list_every_error():
    """docs/errors.md names every error the library and the kernels raise: each raise site's message start, read
    from the sources, is in it (a new error without its row there fails here)."""
    docs = (_ROOT / "docs" / "errors.md").read_text()
    sources = sorted([*(_ROOT / "fast_multilora").glob("*.py"), *(_ROOT / "kernels").glob("*.py")])
    missing, unreadable, count = [], [], 0
    for path in sources:
        found, bad = _error_messages(path)
        rel = path.relative_to(_ROOT)
        count += len(found)
        unreadable += [f"{rel}:{line}" for line in bad]
        missing += [f"{rel}:{line}: {start!r}" for line, start in found if len(start) < 8 or start not in docs]
    assert count > 100  # the sources' raise sites were found
    assert not unreadable, f"raise sites whose message is no string literal or f-string: {unreadable}"
    assert not missing, "errors missing from docs/errors.md (message start, or a start under 8 characters):\n" + \
        "\n".join(missing)
