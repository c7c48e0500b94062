"""fast_multilora.data: collator layout, grouping by adapter, parameter -> adapter mapping, per-adapter clipping."""

import pytest
import torch
from models import peft_model

import fast_multilora
from fast_multilora.data import (
    MultiAdapterCollator,
    adapter_of_parameter,
    adapter_param_groups,
    clip_grad_norm_per_adapter,
)

SAMPLES = [
    {"input_ids": [5, 6, 7], "adapter_name": "a1"},
    {"input_ids": [8, 9], "labels": [-100, 9], "adapter_name": "__base__"},
    {"input_ids": [1, 2, 3, 4], "adapter_name": "a0"},
    {"input_ids": [11], "adapter_name": "a1"},
]


def test_collator_pads_and_names_rows():
    b = MultiAdapterCollator(pad_token_id=0)(SAMPLES)
    assert b["adapter_names"] == ["a1", "__base__", "a0", "a1"]
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4], [11, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert b["labels"].tolist() == [[5, 6, 7, -100], [-100, 9, -100, -100], [1, 2, 3, 4], [11, -100, -100, -100]]
    left = MultiAdapterCollator(pad_token_id=0, padding_side="left", pad_to_multiple_of=3)(SAMPLES)
    assert left["input_ids"].shape == (4, 6) and left["input_ids"][3].tolist() == [0, 0, 0, 0, 0, 11]


def test_group_by_adapter_keeps_samples_and_loss():
    g = MultiAdapterCollator(pad_token_id=0, group_by_adapter=True)(SAMPLES)
    assert g["adapter_names"] == ["a1", "a1", "a0", "__base__"]  # first-appearance order, base rows last
    assert g["input_ids"][:, 0].tolist() == [5, 11, 1, 8]
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    model.eval()
    losses = []
    for batch in (MultiAdapterCollator(pad_token_id=0)(SAMPLES), g):
        with torch.no_grad():
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        adapter_names=batch["adapter_names"])
        losses.append(fast_multilora.per_adapter_loss(out.logits, batch["labels"], batch["adapter_names"]))
    torch.testing.assert_close(losses[0], losses[1])


def test_missing_adapter_key_explains_trainer_setting():
    with pytest.raises(KeyError, match="remove_unused_columns=False"):
        MultiAdapterCollator(pad_token_id=0)([{"input_ids": [1, 2]}])
    b = MultiAdapterCollator(pad_token_id=0, require_adapter=False)([{"input_ids": [1, 2]}])
    assert b["adapter_names"] == ["__base__"]


def test_adapter_of_parameter():
    adapters = ["a", "layers", "default"]
    assert adapter_of_parameter("base_model.model.layers.0.q_proj.lora_A.a.weight", adapters) == "a"
    assert adapter_of_parameter("base_model.model.layers.0.q_proj.lora_B.layers.weight", adapters) == "layers"
    assert adapter_of_parameter("base_model.model.embed.lora_embedding_A.default", adapters) == "default"
    assert adapter_of_parameter("base_model.model.lm_head.modules_to_save.a.weight", adapters) == "a"
    assert adapter_of_parameter("base_model.model.layers.0.q_proj.base_layer.weight", adapters) is None


def test_param_groups_and_per_adapter_clipping():
    model = peft_model("llama")
    groups = adapter_param_groups(model, {"a1": {"lr": 0.5, "weight_decay": 0.1}}, default={"weight_decay": 0.0})
    assert [g["adapter"] for g in groups] == ["a0", "a1", "a2"]
    by = {g["adapter"]: g for g in groups}
    assert by["a1"]["lr"] == 0.5 and by["a1"]["weight_decay"] == 0.1 and "lr" not in by["a0"]
    names = {id(p): n for n, p in model.named_parameters()}
    for g in groups:
        assert all(f".{g['adapter']}." in names[id(p)] for p in g["params"])
    assert sum(len(g["params"]) for g in groups) == sum(p.requires_grad for p in model.parameters())
    with pytest.raises(ValueError, match="unknown adapter"):
        adapter_param_groups(model, {"nope": {"lr": 1.0}})

    opt = torch.optim.SGD(groups, lr=0.1)
    for g in groups:  # a0 gets a huge gradient, a2 a tiny one
        scale = {"a0": 100.0, "a1": 1.0, "a2": 1e-4}[g["adapter"]]
        for p in g["params"]:
            p.grad = torch.full_like(p, scale)
    want = {g["adapter"]: float(torch.cat([p.grad.reshape(-1) for p in g["params"]]).norm()) for g in groups}
    norms = clip_grad_norm_per_adapter(opt, 1.0)
    assert norms.keys() == want.keys() and all(type(v) is float for v in norms.values())
    assert norms == pytest.approx(want, rel=1e-6)  # each adapter's own pre-clip norm
    assert norms["a0"] > 1 and norms["a2"] < 1
    after = {g["adapter"]: torch.cat([p.grad.reshape(-1) for p in g["params"]]).norm() for g in groups}
    assert after["a0"] == pytest.approx(1.0, rel=1e-4) and after["a1"] == pytest.approx(1.0, rel=1e-4)
    assert after["a2"] == pytest.approx(norms["a2"], rel=1e-6)  # not scaled down by a0's gradient
