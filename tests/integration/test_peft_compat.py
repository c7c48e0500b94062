"""Patched models behave like stock PEFT: saving, loading, unpatch, merge, disable, set/add/delete adapter, errors."""

import filecmp
import json
import os
import warnings

import pytest
import torch
from models import peft_model, tiny_llama, twin
from peft import LoraConfig, PeftModel

import fast_multilora

NAMES = ["a2", "a0", "__base__", "a1"]


def _ids(rows=4, T=7, seed=0):
    return torch.randint(0, 97, (rows, T), generator=torch.Generator().manual_seed(seed))


def test_save_pretrained_files_identical_and_loadable(tmp_path):
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model)
    model.save_pretrained(tmp_path / "patched")
    plain.save_pretrained(tmp_path / "plain")
    for root, _, files in os.walk(tmp_path / "plain"):
        for f in files:
            a = os.path.join(root, f)
            b = a.replace(str(tmp_path / "plain"), str(tmp_path / "patched"))
            if f.endswith(".json"):  # PEFT writes target_modules from a set: its order varies between objects
                ja, jb = json.load(open(a)), json.load(open(b))
                ja["target_modules"], jb["target_modules"] = sorted(ja["target_modules"]), sorted(jb["target_modules"])
                assert ja == jb, f
            else:
                assert filecmp.cmp(a, b, shallow=False), f
    # PEFT saves every non-"default" adapter in a subfolder named after it
    loaded = PeftModel.from_pretrained(tiny_llama(), str(tmp_path / "patched" / "a0"), adapter_name="a0")
    for n in ("a1", "a2"):
        loaded.load_adapter(str(tmp_path / "patched" / n), adapter_name=n)
    loaded.eval()
    model.eval()
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids, adapter_names=NAMES).logits,
                                   model(input_ids=ids, adapter_names=NAMES).logits)


def test_unpatch_is_bit_identical():
    model = peft_model()
    never = twin(model)
    fast_multilora.patch(model)
    model(input_ids=_ids(), adapter_names=NAMES)  # use it once
    fast_multilora.unpatch(model)
    assert repr(model) == repr(never)
    for m in model.modules():
        assert not type(m).__name__.startswith("_Fast") and type(m).__module__ != "fast_multilora.patching"
    model.eval()
    never.eval()
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, never(input_ids=ids).logits)
        assert torch.equal(model(input_ids=ids, adapter_names=NAMES).logits,
                           never(input_ids=ids, adapter_names=NAMES).logits)


def test_repr_layer_status_and_patch_twice():
    model = peft_model()
    plain = twin(model)
    r1 = fast_multilora.patch(model)
    r2 = fast_multilora.patch(model)
    assert r1.patched == r2.patched and len(r1.patched) > 0
    assert repr(model) == repr(plain)
    assert [s.__dict__ for s in model.get_layer_status()] == [s.__dict__ for s in plain.get_layer_status()]
    assert "patched" in str(r1)


def test_without_names_behaves_like_peft():
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model)
    ids = _ids()
    for m in (model, plain):
        m.set_adapter("a1")
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=0, atol=0)
    with model.disable_adapter(), plain.disable_adapter():
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
        # PEFT ignores adapter_names while adapters are disabled: so do we
        assert torch.equal(model(input_ids=ids, adapter_names=NAMES).logits, plain(input_ids=ids).logits)


def test_merge_unmerge_and_merged_error():
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model)
    model.eval()
    plain.eval()
    ids = _ids()
    for m in (model, plain):
        m.set_adapter("a0")
        m.merge_adapter()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    with pytest.raises(ValueError, match="merged adapters"):
        model(input_ids=ids, adapter_names=NAMES)
    model.unmerge_adapter()
    plain.unmerge_adapter()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, adapter_names=NAMES).logits,
                                   plain(input_ids=ids, adapter_names=NAMES).logits, rtol=1e-5, atol=1e-6)


def test_unknown_and_wrong_number_of_names():
    model = peft_model()
    fast_multilora.patch(model)
    with pytest.raises(ValueError, match=r"unknown adapter name\(s\) \['nope'\].*\['a0', 'a1', 'a2'\]"):
        model(input_ids=_ids(), adapter_names=["a0", "nope", "a1", "a2"])
    with pytest.raises(ValueError, match="Length of `adapter_names`.*3 and 4"):
        model(input_ids=_ids(), adapter_names=["a0", "a1", "a2"])
    with pytest.raises(TypeError, match="list of adapter names"):
        model(input_ids=_ids(), adapter_names="a0")


def test_add_and_delete_adapter_after_patch():
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model)
    model.train()
    ids = _ids()
    model(input_ids=ids, adapter_names=NAMES)
    cfg = LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj", "o_proj"], init_lora_weights=False)
    for m in (model, plain):
        torch.manual_seed(9)
        m.add_adapter("new", cfg)
        m.delete_adapter("a2")
        m.eval()
    names = ["new", "a0", "__base__", "new"]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, adapter_names=names).logits,
                                   plain(input_ids=ids, adapter_names=names).logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown adapter"):
        model(input_ids=ids, adapter_names=["a2", "a0", "a0", "a0"])


def test_dora_adapter_in_mixed_batch_runs():
    """A DoRA adapter next to plain ones: no warning at patch, a mixed batch naming it runs and equals stock PEFT
    with the adapter alone (the full matrix: tests/test_dora.py)."""
    model = peft_model()
    model.add_adapter("dora", LoraConfig(r=2, target_modules=["q_proj"], use_dora=True, init_lora_weights=False))
    plain = twin(model)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fast_multilora.patch(model)
    assert not any("variant" in str(x.message) for x in w)
    model.eval()
    plain.eval()
    ids = _ids()
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=["dora", "a0", "dora", "__base__"]).logits
        plain.set_adapter("dora")
        torch.testing.assert_close(got[[0, 2]], plain(input_ids=ids[[0, 2]]).logits, rtol=1e-5, atol=1e-6)


def test_lora_bias_parity():
    configs = {
        "b0": LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], lora_bias=True,
                         init_lora_weights=False),
        "b1": LoraConfig(r=3, lora_alpha=2, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT warns that Llama's projections have no bias to merge into
        model = peft_model(configs=configs)
    for n, p in model.named_parameters():
        if "lora_B" in n and n.endswith("bias"):
            torch.nn.init.normal_(p)
    plain = twin(model)
    fast_multilora.patch(model)
    ids = _ids()
    names = ["b1", "b0", "__base__", "b0"]
    out = model(input_ids=ids, adapter_names=names).logits
    out.square().sum().backward()
    for i, name in enumerate(names):
        if name == "__base__":
            continue
        plain.set_adapter(name)
        o = plain(input_ids=ids[i : i + 1]).logits
        torch.testing.assert_close(out[i : i + 1].detach(), o.detach(), rtol=1e-4, atol=1e-5)
        o.square().sum().backward()
    got = dict(model.named_parameters())
    for n, p in plain.named_parameters():
        if "lora_" in n and p.grad is not None:
            torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")


def test_generate_with_adapter_names_after_patch():
    model = peft_model()
    plain = twin(model)
    fast_multilora.patch(model)
    model.eval()
    plain.eval()
    ids = _ids(T=5)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # eval mode: no warning
        a = model.generate(input_ids=ids, adapter_names=NAMES, **kw)
    b = plain.generate(input_ids=ids, adapter_names=NAMES, **kw)
    assert torch.equal(a, b)
    model.train()  # PEFT refuses names in training; we generate, and warn that dropout is on
    with pytest.warns(UserWarning, match="generate.*training mode"):
        model.generate(input_ids=ids, adapter_names=NAMES, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a training forward with names is what the library is for: no warning
        model(input_ids=ids, adapter_names=NAMES)


def test_route_context_and_unpatched_model_error():
    model = peft_model()
    with pytest.raises(ValueError, match="not patched"):
        fast_multilora.route(model, NAMES)
    fast_multilora.patch(model)
    model.eval()
    ids = _ids()
    with torch.no_grad():
        model(input_ids=ids, adapter_names=NAMES)  # the first call runs unshared; sharing a shrink changes low bits
        want = model(input_ids=ids, adapter_names=NAMES).logits
        with fast_multilora.route(model, NAMES):
            got = model.base_model.model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_patch_lora_model_and_fallback_layers_in_training():
    """patch() on a LoraModel; an Embedding LoRA layer runs PEFT's own loop (reported), in training too."""
    configs = {
        "e0": LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False),
        "e1": LoraConfig(r=3, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    }
    model = peft_model(configs=configs)
    plain = twin(model)
    with pytest.warns(UserWarning, match="PEFT's per-sample mixed-batch loop"):
        report = fast_multilora.patch(model.base_model)
    assert any("embed_tokens" in n for n in report.fallback) and report.patched
    model.train()
    ids = _ids(3)
    names = ["e1", "e0", "__base__"]
    out = model(input_ids=ids, adapter_names=names).logits
    out.square().mean().backward()
    for i, name in enumerate(names):
        if name == "__base__":
            with plain.disable_adapter():
                o = plain(input_ids=ids[i : i + 1]).logits
            torch.testing.assert_close(out[i : i + 1].detach(), o, rtol=1e-5, atol=1e-6)
            continue
        plain.set_adapter(name)
        o = plain(input_ids=ids[i : i + 1]).logits
        torch.testing.assert_close(out[i : i + 1].detach(), o.detach(), rtol=1e-5, atol=1e-6)
        (o.square().sum() / out.numel()).backward()
    got = dict(model.named_parameters())
    for n, p in plain.named_parameters():
        if "lora_" in n and p.grad is not None:
            torch.testing.assert_close(got[n].grad, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_adapter_on_new_modules_after_patch_is_patched_too():
    """add_adapter() that targets modules without LoRA layers creates new layers: they get routed as well."""
    model = peft_model()
    plain = twin(model)
    report = fast_multilora.patch(model)
    cfg = LoraConfig(r=2, lora_alpha=2, target_modules=["lm_head"], init_lora_weights=False)
    for m in (model, plain):
        torch.manual_seed(5)
        m.add_adapter("head", cfg)
        m.eval()
    ids = _ids()
    names = ["head", "a0", "__base__", "head"]
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=names).logits
        want = plain(input_ids=ids, adapter_names=names).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert len(fast_multilora.patch(model).patched) == len(report.patched) + 1


def test_model_without_lora_layers_is_left_unpatched():
    """A PeftModel of another tuner keeps PEFT's own behaviour, ``adapter_names`` included (RoAd mixes adapters in a
    batch itself): patch() warns and installs nothing."""
    from peft import RoadConfig, get_peft_model

    model = get_peft_model(tiny_llama(), RoadConfig(target_modules=["q_proj"], group_size=8, init_weights=False),
                           adapter_name="r0")
    model.add_adapter("r1", RoadConfig(target_modules=["q_proj"], group_size=8, init_weights=False))
    model.eval()
    ids = _ids()
    names = ["r1", "r0", "__base__", "r1"]
    with torch.no_grad():
        want = model(input_ids=ids, adapter_names=names).logits
    with pytest.warns(UserWarning, match="no PEFT LoRA layers"):
        report = fast_multilora.patch(model)
    assert report.patched == [] and "_fml_router" not in model.__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, adapter_names=names).logits, want)


def test_custom_lora_class_falls_back_without_a_warning_of_ours():
    """A LoRA class registered in the adapter's config (``LoraConfig._register_custom_module``) is user code: it
    runs PEFT's loop and is listed in the report, but patch() does not warn about it (PEFT warns about such layers
    itself, and PEFT's own test reads its warning as the last one); other fallbacks still warn."""
    from peft import get_peft_model
    from peft.tuners import lora

    class MyLora(lora.Linear):
        pass

    cfg = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    cfg._register_custom_module({torch.nn.Linear: MyLora})
    model = get_peft_model(tiny_llama(), cfg, adapter_name="c0")
    model.add_adapter("c1", LoraConfig(r=3, target_modules=["embed_tokens"], init_lora_weights=False))
    with pytest.warns(UserWarning, match="PEFT's per-sample mixed-batch loop") as rec:
        report = fast_multilora.patch(model)
    ours = [str(w.message) for w in rec if "fast_multilora" in str(w.message)]
    assert len(ours) == 1 and "1 module(s)" in ours[0] and "embed_tokens" in ours[0], ours
    assert sum("q_proj" in n or "v_proj" in n for n in report.fallback) == 4, report.fallback  # listed all the same

    model = get_peft_model(tiny_llama(), cfg, adapter_name="c0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = fast_multilora.patch(model)
    assert len(report.fallback) == 4 and not report.patched
    model.eval()
    ids = _ids(2)
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=["c0", "__base__"]).logits
        want = model(input_ids=ids[:1]).logits
        with model.disable_adapter():
            base = model(input_ids=ids[1:]).logits
    torch.testing.assert_close(got, torch.cat([want, base]), rtol=1e-5, atol=1e-6)


def _edits():
    """Edits made between forward calls, each applied to the patched model and its stock twin alike: ``(name,
    edit(model))``. The patched layers read their adapters' settings once per change (not per call), so each of these
    must be seen at the next call without anything else."""
    def layer(m):
        return m.base_model.model.model.layers[0].self_attn.q_proj

    def set_scale(m):
        layer(m).set_scale("a1", 3.0)

    def scaling_written(m):  # as PEFT's hotswapping writes it
        layer(m).scaling["a0"] = 0.25

    def scale_layer(m):
        for mod in m.modules():
            if hasattr(mod, "scale_layer") and "a2" in getattr(mod, "scaling", {}):
                mod.scale_layer(0.5)

    def to_float64(m):
        m.to(torch.float64)

    def dropout_in_eval(m):  # train() -> eval(): the adapters' dropout stops
        m.eval()

    def add_adapter(m):
        torch.manual_seed(5)
        m.add_adapter("late", LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False))

    def delete_adapter(m):
        m.delete_adapter("a1")

    return [("set_scale", set_scale), ("scaling_written", scaling_written), ("scale_layer", scale_layer),
            ("to_float64", to_float64), ("eval", dropout_in_eval), ("add_adapter", add_adapter),
            ("delete_adapter", delete_adapter)]


@pytest.mark.parametrize("name,edit", _edits(), ids=[n for n, _ in _edits()])
def test_edits_between_calls_are_seen(name, edit):
    """After a first mixed call, each edit is seen by the next one: outputs equal stock PEFT's edited twin (PEFT's
    own mixed-batch path in eval)."""
    model = peft_model(dropout=0.5)
    plain = twin(model)
    fast_multilora.patch(model)
    for m in (model, plain):  # the edit is the only change between the two calls (eval: from train mode)
        m.train(name == "eval")
    ids = _ids()
    with torch.no_grad():
        model(input_ids=ids, adapter_names=NAMES)  # states built before the edit
    for m in (model, plain):
        edit(m)
        assert not m.training
    names = [n if n in model.peft_config else "a0" for n in ["late", "a1", "__base__", "a2"]]
    if name == "add_adapter":
        names = ["late", "a0", "__base__", "late"]
    dtype = torch.float64 if name == "to_float64" else torch.float32
    with torch.no_grad():
        got = model(input_ids=ids, adapter_names=names).logits
        want = plain(input_ids=ids, adapter_names=names).logits
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_an_edited_submodule_needs_mark_changed():
    """Editing an adapter's submodule directly (here a new dropout module put into ``lora_dropout`` by hand) is not
    reported: the layer keeps the rate it read until ``fast_multilora.mark_changed()``, after which the next call
    reads the new rate. The limit is documented in docs/usage.md."""
    model = peft_model(dropout=0.0)
    fast_multilora.patch(model)
    model.train()
    ids = _ids()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    model(input_ids=ids, adapter_names=NAMES)
    state = layer.__dict__["_fml_state"]
    layer.lora_dropout["a0"] = torch.nn.Dropout(0.3)  # a ModuleDict write: a new module, not a tracked dict write
    model(input_ids=ids, adapter_names=NAMES)
    assert layer.__dict__["_fml_state"] is state  # not seen
    fast_multilora.mark_changed()
    model(input_ids=ids, adapter_names=NAMES)
    assert layer.__dict__["_fml_state"] is not state and 0.29 < layer.__dict__["_fml_state"].rates[0] < 0.31
