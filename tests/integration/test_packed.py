"""Packed rows: several samples of different adapters in one row, routed per token by ``adapter_ids``.

A packed batch must give, for every sample, the logits and LoRA gradients of that sample run alone (unpacked, one
row per sample, ``adapter_names``). Attention across packed samples is prevented by transformers (5.x): with
``attention_mask=None`` and no KV cache, restarting ``position_ids`` yield a block-diagonal causal mask
(``masking_utils.find_packed_sequence_indices``); or by an explicit additive 4-D mask (``attention="4d"``).
"""

import pytest
import torch
from models import peft_model

import fast_multilora
from fast_multilora.data import MultiAdapterCollator, pack_samples

NAMES = ["a0", "a1", "__base__", "a2", "a1", "a0", "a2", "__base__", "a1"]


def make_samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in NAMES:
        n = int(torch.randint(2, 12, (1,), generator=g))
        ids = torch.randint(0, 97, (n,), generator=g)
        labels = ids.clone()
        labels[: n // 3] = -100  # a "prompt" part that is not trained
        out.append({"input_ids": ids, "labels": labels, "adapter_name": name})
    return out


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def build(attn, family="auto"):
    model = peft_model("llama")
    model.base_model.model.set_attn_implementation(attn)
    fast_multilora.patch(model, backend="torch", family=family)
    model.train()
    return model


@pytest.mark.parametrize("family", ["auto", "sgemm"])
@pytest.mark.parametrize("attention", ["position_ids", "4d"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_match_unpacked(attn, attention, family):
    samples = make_samples()
    model = build(attn, family)
    packed = pack_samples(samples, max_length=24, attention=attention)
    assert packed["input_ids"].shape[0] < len(samples)  # several samples do share rows
    vocab = packed["adapter_names"]
    kwargs = {k: packed[k] for k in ("input_ids", "position_ids", "adapter_ids")}
    if attention == "4d":
        kwargs["attention_mask"] = packed["attention_mask"]
    out = model(**kwargs, adapter_names=vocab, use_cache=False).logits
    loss = fast_multilora.per_adapter_loss(out, packed["labels"], vocab, adapter_ids=packed["adapter_ids"])
    loss.backward()
    got = lora_grads(model)
    model.zero_grad(set_to_none=True)

    # reference: the same samples unpacked, one padded row each, routed per row
    batch = MultiAdapterCollator(pad_token_id=0)(samples)
    ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                adapter_names=batch["adapter_names"]).logits
    ref_loss = fast_multilora.per_adapter_loss(ref, batch["labels"], batch["adapter_names"])
    ref_loss.backward()
    want = lora_grads(model)

    for i, (r, t, n) in enumerate(packed["sample_spans"]):
        torch.testing.assert_close(out[r, t : t + n], ref[i, :n], rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"{i}: {m}")
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(got) == set(want) and len(want) == sum(1 for n, _ in model.named_parameters() if "lora_" in n)
    for n, gw in want.items():
        assert gw.abs().sum() > 0, n  # every adapter trains in this batch
        torch.testing.assert_close(got[n], gw, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("attention", ["position_ids", "4d"])
def test_packed_collator_batch_as_it_is_matches_unpacked(attention):
    """``model(**PackedCollator(...)(samples))`` in a training loop of one's own (no Trainer, which turns the model's
    KV cache off itself): transformers 5 builds a cache in a training forward unless told not to, and with a cache it
    derives no block-diagonal mask from ``position_ids``, so the batch itself says ``use_cache=False``."""
    from fast_multilora.data import PackedCollator

    samples = make_samples(seed=3)
    model = build("sdpa")
    batch = PackedCollator(max_length=24, pad_token_id=0, attention=attention)(samples)
    packed = pack_samples(samples, max_length=24, attention=attention)
    out = model(**batch).logits
    ref = MultiAdapterCollator(pad_token_id=0)(samples)
    want = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"],
                 adapter_names=ref["adapter_names"]).logits
    for i, (r, t, n) in enumerate(packed["sample_spans"]):
        torch.testing.assert_close(out[r, t : t + n], want[i, :n], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, i=i: f"sample {i}: {m}")


def test_packing_without_boundaries_leaks_attention():
    """Negative control: the same packed row with plain ``arange`` positions and no mask attends across samples,
    so the comparison above would fail if the packed-sequence masking were not in effect."""
    samples = make_samples()
    model = build("sdpa")
    packed = pack_samples(samples, max_length=24)
    pos = torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"])
    with torch.no_grad():
        good = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False,
                     adapter_ids=packed["adapter_ids"], adapter_names=packed["adapter_names"]).logits
        bad = model(input_ids=packed["input_ids"], position_ids=pos, use_cache=False,
                    adapter_ids=packed["adapter_ids"], adapter_names=packed["adapter_names"]).logits
    r, t, n = next(s for s in packed["sample_spans"] if s[1] > 0)  # a sample that is not first in its row
    assert not torch.allclose(good[r, t : t + n], bad[r, t : t + n], atol=1e-3)


def test_adapter_ids_route_tokens_not_rows():
    """Per-token routing inside one row: each token gets exactly its own adapter's delta."""
    model = build("sdpa")
    model.eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (1, 12), generator=g)
    names = ["a0", "a1", "a2"]
    adapter_ids = torch.tensor([[0, 0, 0, 1, 1, 1, -1, -1, 2, 2, 2, 2]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 2, 3]])
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, adapter_ids=adapter_ids, adapter_names=names,
                    use_cache=False).logits
        for (s, e), name in zip([(0, 3), (3, 6), (6, 8), (8, 12)], ["a0", "a1", "__base__", "a2"], strict=True):
            alone = model(input_ids=ids[:, s:e], adapter_names=[name]).logits
            torch.testing.assert_close(out[:, s:e], alone, rtol=1e-4, atol=1e-5)


def test_pack_samples_layout():
    samples = [
        {"input_ids": [5, 6, 7], "adapter_name": "x"},
        {"input_ids": [8, 9], "adapter_name": "__base__"},
        {"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4], "adapter_name": "y"},
        {"input_ids": [11], "adapter_name": "x"},
    ]
    p = pack_samples(samples, max_length=6, pad_token_id=0, strategy="in_order", pad_to_max_length=True)
    assert p["adapter_names"] == ["x", "y"]
    assert p["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [1, 2, 3, 4, 11, 0]]
    assert p["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert p["adapter_ids"].tolist() == [[0, 0, 0, -1, -1, -1], [1, 1, 1, 1, 0, -1]]
    assert p["labels"].tolist() == [[-100, 6, 7, -100, 9, -100], [-100, -100, 3, 4, -100, -100]]
    ff = pack_samples(samples, max_length=6, strategy="first_fit")
    assert ff["input_ids"].shape == (2, 6) and sorted(ff["adapter_names"]) == ["x", "y"]
    with pytest.raises(ValueError, match="not in adapter_names"):
        pack_samples(samples, max_length=6, adapter_names=["x"])
