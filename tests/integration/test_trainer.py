"""An unmodified ``transformers.Trainer`` training several adapters in one mixed batch.

Wiring under test (documented Trainer arguments only): ``MultiAdapterCollator`` emits ``adapter_names``,
``compute_loss_func=PerAdapterLoss(model)`` (also a callback: per-adapter loss logs), optional per-adapter
optimizer groups and per-adapter clipping.
"""

import pytest
import torch
from models import lora_weights, patched_llama
from transformers import Trainer, TrainingArguments

import fast_multilora
from fast_multilora.data import MultiAdapterCollator, adapter_param_groups
from fast_multilora.training import PerAdapterGradClip, PerAdapterLoss

ADAPTERS = ["a0", "a1", "a2"]


def samples(names, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        n = int(torch.randint(5, 11, (1,), generator=g))
        ids = torch.randint(1, 97, (n,), generator=g)
        labels = ids.clone()
        labels[:2] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "adapter_name": name})
    return out


class Stream(torch.utils.data.IterableDataset):
    """Fixed order (no sampler shuffling), so micro-batches are known to the test."""

    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def trainer_for(model, data, tmp_path, *, steps, batch=6, optimizer=None, callbacks=(), collator=None, **kw):
    loss = PerAdapterLoss(model)
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to="none", remove_unused_columns=False, use_cpu=True,
        disable_tqdm=True, seed=0, dataloader_num_workers=0, **kw,
    )
    collator = collator or MultiAdapterCollator(pad_token_id=0)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=collator,
                   compute_loss_func=loss, callbacks=[loss, *callbacks], optimizers=(optimizer, None))


def test_every_adapter_moves_and_logs_its_loss(tmp_path):
    model = patched_llama()
    before = lora_weights(model)
    data = samples(["a0", "a1", "a2", "__base__"] * 6)
    trainer = trainer_for(model, data, tmp_path, steps=3)
    trainer.train()
    after = lora_weights(model)
    for n in before:
        assert not torch.equal(before[n], after[n]), f"{n} did not move"
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    for h in logged:
        assert {f"loss/{a}" for a in ADAPTERS} <= set(h), h
        assert all(0 < h[f"loss/{a}"] < 20 for a in ADAPTERS)


def test_base_rows_leave_adapters_untouched(tmp_path):
    """A batch of only ``__base__`` rows trains nothing: every adapter weight stays bit-identical."""
    model = patched_llama()
    before = lora_weights(model)
    trainer = trainer_for(model, samples(["__base__"] * 12), tmp_path, steps=2)
    trainer.train()
    after = lora_weights(model)
    for n in before:
        assert torch.equal(before[n], after[n]), n
    # ... while the same Trainer set-up with adapter rows does change them (the check above can fail)
    trainer = trainer_for(model, samples(["__base__", "a1"] * 6), tmp_path, steps=1)
    trainer.train()
    moved = lora_weights(model)
    assert any(not torch.equal(before[n], moved[n]) for n in before if ".a1." in n)
    assert all(torch.equal(before[n], moved[n]) for n in before if ".a1." not in n)


def test_per_adapter_optimizer_groups_and_clipping(tmp_path):
    model = patched_llama()
    before = lora_weights(model)
    groups = adapter_param_groups(model, {"a0": {"lr": 0.0}, "a2": {"lr": 3e-2}}, default={"weight_decay": 0.0})
    assert [g["adapter"] for g in groups] == ADAPTERS
    opt = torch.optim.AdamW(groups, lr=1e-2)
    clip = PerAdapterGradClip(0.5)
    trainer = trainer_for(model, samples(["a0", "a1", "a2"] * 4), tmp_path, steps=2, optimizer=opt,
                          callbacks=[clip], max_grad_norm=0.0)
    trainer.train()
    after = lora_weights(model)
    for n in before:
        if ".a0." in n:
            assert torch.equal(before[n], after[n]), n  # lr 0 for a0
        else:
            assert not torch.equal(before[n], after[n]), n
    assert set(clip.last_norms) == set(ADAPTERS) and all(v > 0 for v in clip.last_norms.values())


@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_step_is_the_per_adapter_gradient(tmp_path, accum):
    """One SGD step of the Trainer equals -lr * grad of fast_multilora.per_adapter_loss (mean over micro-batches
    with gradient accumulation) -- no hidden rescaling by token counts or accumulation steps."""
    model = patched_llama()
    ref = patched_llama()
    data = samples(["a1", "a0", "__base__", "a2", "a1", "a1", "a0", "a2", "__base__", "a1", "a2", "a0"], seed=3)
    micro = len(data) // accum
    collate = MultiAdapterCollator(pad_token_id=0)
    ref.train()
    for i in range(accum):
        b = collate(data[i * micro : (i + 1) * micro])
        out = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], adapter_names=b["adapter_names"])
        (fast_multilora.per_adapter_loss(out.logits, b["labels"], b["adapter_names"]) / accum).backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if "lora_" in n}

    before = lora_weights(model)
    lr = 0.1
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    trainer = trainer_for(model, Stream(data), tmp_path, steps=1, batch=micro, optimizer=opt, max_grad_norm=0.0,
                          gradient_accumulation_steps=accum)
    trainer.train()
    after = lora_weights(model)
    for n in want:
        torch.testing.assert_close((before[n] - after[n]) / lr, want[n], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_trainer_with_packed_rows(tmp_path):
    """PackedCollator through the Trainer: adapter_ids and position_ids reach the model, the loss routes per token,
    and the step equals the per-adapter gradient of the packed batch."""
    from fast_multilora.data import PackedCollator

    model = patched_llama()
    ref = patched_llama()
    data = samples(["a1", "a0", "__base__", "a2", "a1", "a2", "a0", "a1"], seed=4)
    collate = PackedCollator(max_length=24, pad_token_id=0, adapter_names=ADAPTERS)
    b = collate(data)
    assert b["input_ids"].shape[0] < len(data)
    ref.train()
    out = ref(input_ids=b["input_ids"], position_ids=b["position_ids"], adapter_ids=b["adapter_ids"],
              adapter_names=b["adapter_names"], use_cache=False)
    loss = fast_multilora.per_adapter_loss(out.logits, b["labels"], b["adapter_names"], adapter_ids=b["adapter_ids"])
    loss.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if "lora_" in n}

    before = lora_weights(model)
    lr = 0.1
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    trainer = trainer_for(model, Stream(data), tmp_path, steps=1, batch=len(data), optimizer=opt, max_grad_norm=0.0,
                          collator=collate)
    trainer.train()
    after = lora_weights(model)
    for n in want:
        torch.testing.assert_close((before[n] - after[n]) / lr, want[n], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")


def test_trainer_with_fast_adamw_equals_torch_adamw(tmp_path):
    """``Trainer(optimizers=(fast_multilora.AdamW(model), None))`` with the Trainer's own global clipping and its LR
    schedule: the adapters end as with ``torch.optim.AdamW`` over per-adapter groups (the Trainer reads the
    parameters' ``.grad``, which are views of the store's gradient arena). Every batch holds every adapter:
    ``torch.optim`` would also step an adapter absent from a batch (its gradient is zero, not ``None``), ours not."""
    data = samples(["a0", "a1", "a2", "__base__", "a1", "a2"] * 3)
    ends = []
    for fast in (False, True):
        model = patched_llama()
        opt = (fast_multilora.AdamW(model, lr=1e-2, weight_decay=0.0) if fast
               else torch.optim.AdamW(adapter_param_groups(model), lr=1e-2, weight_decay=0.0, foreach=False))
        trainer_for(model, Stream(data), tmp_path, steps=3, optimizer=opt, max_grad_norm=0.05).train()
        if fast:
            assert opt.store.slots and [float(s) for s in opt.steps] == [3.0, 3.0, 3.0]
        ends.append(lora_weights(model))
    for n, w in ends[0].items():
        # AdamW moves each element by ~lr per step; near-zero gradients amplify the two paths' rounding
        torch.testing.assert_close(ends[1][n], w, rtol=1e-4, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_trainer_default_optimizer_on_the_store_equals_parameters(tmp_path):
    """The Trainer's own optimizer (``optimizer=None``: its default AdamW, its zero_grad / clipping / schedule) trains
    the adapter store (the default storage) exactly as PEFT's parameters kept where PEFT made them."""
    from models import peft_model

    ends = []
    for store in (True, False):
        model = peft_model("llama")
        fast_multilora.patch(model, backend="torch", adapter_store=store)
        trainer_for(model, Stream(samples(["a0", "a1", "a2", "__base__"] * 3)), tmp_path / str(store), steps=2,
                    batch=4, gradient_accumulation_steps=2, max_grad_norm=0.5).train()
        ends.append(lora_weights(model))
    start = lora_weights(peft_model("llama"))
    for n, w in ends[1].items():
        assert not torch.equal(w, start[n]), f"{n} did not move"
        torch.testing.assert_close(ends[0][n], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
