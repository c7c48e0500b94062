"""An unmodified ``transformers.Trainer`` training several adapters in one mixed batch.

Wiring under test (documented Trainer arguments only): ``MultiAdapterCollator`` emits ``adapter_names``,
``compute_loss_func=PerAdapterLoss(model)`` (also a callback: per-adapter loss logs), optional per-adapter
optimizer groups and per-adapter clipping; and ``fast_multilora.trainer_kwargs``, which builds all of it in one call
(equal to the hand-wired Trainer, its misuse warned about or refused).
"""

import warnings

import pytest
import torch
from models import lora_weights, patched_llama, peft_model
from transformers import Trainer, TrainerCallback, TrainingArguments

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


def trainer_for(model, data, tmp_path, *, steps, batch=6, optimizer=None, callbacks=(), collator=None, fused=False,
                **kw):
    loss = PerAdapterLoss(model, fused=fused)
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
    _assert_moved_and_logged(model, before, trainer, steps=3)


def _assert_moved_and_logged(model, before, trainer, steps):
    """Every LoRA weight moved; ``steps`` training logs, each with a plausible ``loss/<adapter>`` of every adapter."""
    after = lora_weights(model)
    for n in before:
        assert not torch.equal(before[n], after[n]), f"{n} did not move"
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == steps
    for h in logged:
        assert {f"loss/{a}" for a in ADAPTERS} <= set(h) and all(0 < h[f"loss/{a}"] < 20 for a in ADAPTERS), h


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


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("accum", [1, 2])
def test_trainer_step_is_the_per_adapter_gradient(tmp_path, accum, fused):
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
                          gradient_accumulation_steps=accum, fused=fused)
    trainer.train()
    after = lora_weights(model)
    for n in want:
        torch.testing.assert_close((before[n] - after[n]) / lr, want[n], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_trainer_with_packed_rows(tmp_path, fused):
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
                          collator=collate, fused=fused)
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


# ---- fast_multilora.trainer_kwargs: the wiring above in one call -----------------------------------------------------


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=6, learning_rate=1e-2,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                dataloader_num_workers=0, optim="adamw_torch", remove_unused_columns=False, max_grad_norm=0.0)
    return TrainingArguments(**{**base, **kw})


class GradNorms(TrainerCallback):
    """Each adapter's gradient norm as the optimizer stepped (after any clipping)."""

    def __init__(self, model):
        self.model, self.norms = model, []

    def on_optimizer_step(self, args, state, control, **kwargs):
        per = {}
        for n, p in self.model.named_parameters():
            if p.grad is not None and "lora_" in n:
                a = n.split(".lora_")[1].split(".")[1]
                per[a] = per.get(a, 0.0) + float(p.grad.float().pow(2).sum())
        self.norms.append({a: v ** 0.5 for a, v in per.items()})


def test_trainer_kwargs_trains_logs_and_clips_every_adapter(tmp_path):
    """A Trainer built with trainer_kwargs trains every adapter, logs loss/<adapter> every step, and clips each
    adapter's gradient to max_grad_norm on its own (each adapter's norm ends at the bound: a global clip would leave
    each below it); the Trainer's own clip is off."""
    model = patched_llama()
    before = lora_weights(model)
    norms = GradNorms(model)
    kw = fast_multilora.trainer_kwargs(model, None, _args(tmp_path), max_grad_norm=1e-3, callbacks=[norms])
    assert kw["args"].max_grad_norm == 0.0 and not kw["args"].remove_unused_columns
    trainer = Trainer(**kw, train_dataset=samples(["a0", "a1", "a2", "__base__"] * 6))
    trainer.train()
    _assert_moved_and_logged(model, before, trainer, steps=3)
    clip = next(c for c in kw["callbacks"] if isinstance(c, PerAdapterGradClip))
    assert set(clip.last_norms) == set(ADAPTERS) and min(clip.last_norms.values()) > 1e-2  # it had to clip
    # evaluation: the same collator and loss, with the logits (eval forwards are not fused)
    trainer.evaluate(eval_dataset=samples(["a2", "a0", "a1", "__base__"] * 2, seed=9))
    assert {f"eval_loss/{a}" for a in ADAPTERS} <= set(trainer.state.log_history[-1]), trainer.state.log_history[-1]
    assert len(norms.norms) == 3
    for step in norms.norms:
        assert step.keys() == set(ADAPTERS)
        for a, v in step.items():
            assert abs(v - 1e-3) < 1e-6, (a, step)


def _hand_wired(model, data, tmp_path, adapter_lr, clip):
    """The six pieces the Trainer needs, wired by hand (examples/trainer_multi_adapter.py before trainer_kwargs)."""
    loss = PerAdapterLoss(model)
    groups = adapter_param_groups(model, {a: {"lr": lr} for a, lr in adapter_lr.items()},
                                  default={"weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=1e-2)
    return Trainer(model=model, args=_args(tmp_path), train_dataset=data,
                   data_collator=MultiAdapterCollator(pad_token_id=0, group_by_adapter=True),
                   compute_loss_func=loss, callbacks=[loss, PerAdapterGradClip(clip)], optimizers=(opt, None))


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_trainer_kwargs_equals_the_hand_wired_trainer(tmp_path, fused):
    """Same seed, same data, three AdamW steps with per-adapter learning rates and clipping: the helper's Trainer
    ends with the hand-wired Trainer's weights and logs (bit-identical on the logits path; the fused loss to fp32
    rounding), and both moved from the start. The helper's fused loss (its default) has the model build the logits
    of one position per row."""
    data = samples(["a2", "a0", "__base__", "a1", "a1", "a0", "a2", "a2", "a0", "a1", "__base__", "a0"] * 2, seed=5)
    adapter_lr = {"a0": 3e-2, "a2": 1e-3}
    runs = []
    for helper in (False, True):
        model = patched_llama()
        if helper:
            kw = fast_multilora.trainer_kwargs(model, None, _args(tmp_path / "h"), adapter_lr=adapter_lr,
                                               max_grad_norm=0.05, fused_loss=fused)
            assert isinstance(kw["optimizers"][0], torch.optim.AdamW)
            trainer = Trainer(**kw, train_dataset=data)
        else:
            trainer = _hand_wired(model, data, tmp_path / "w", adapter_lr, 0.05)
        lengths = []  # positions of the logits each training forward built
        model.register_forward_hook(lambda m, a, out, seen=lengths: seen.append(out.logits.shape[1]))
        trainer.train()
        assert len(lengths) == 3 and (set(lengths) == {1}) == (helper and fused), lengths
        runs.append((lora_weights(model), [h for h in trainer.state.log_history if "loss" in h]))
    (want, want_logs), (got, got_logs) = runs
    start = lora_weights(patched_llama())
    for n, w in want.items():
        assert not torch.equal(w, start[n]), f"{n} did not move"
        if fused:  # AdamW divides each element's gradient by its own RMS: where that gradient is near zero, fp32
            # rounding of the gradient shows in the step (the steps here are ~1e-2 per element)
            torch.testing.assert_close(got[n], w, rtol=1e-5, atol=1e-4, msg=lambda m, n=n: f"{n}: {m}")
        else:
            assert torch.equal(got[n], w), n
    assert len(got_logs) == len(want_logs) == 3
    for g, w in zip(got_logs, want_logs, strict=True):
        for a in ADAPTERS:
            assert abs(g[f"loss/{a}"] - w[f"loss/{a}"]) <= 1e-3, (a, g, w)  # logs are rounded to 4 digits


def test_trainer_kwargs_fixes_the_args_with_a_warning(tmp_path):
    """remove_unused_columns=True and max_grad_norm > 0 (the TrainingArguments defaults): a copy with both changed,
    one warning naming each change; the user's args object is untouched; the norm becomes the per-adapter bound."""
    model = patched_llama()
    given = _args(tmp_path, remove_unused_columns=True, max_grad_norm=0.3)
    with pytest.warns(UserWarning, match=r"trainer_kwargs: returned a copy of args with remove_unused_columns=True "
                      r"-> False \(the Trainer would drop the samples' adapter_name before the collator\); "
                      r"max_grad_norm=0\.3 -> 0\.0 \(the Trainer's global clip is off; each adapter is clipped on "
                      r"its own to 0\.3\)"):
        kw = fast_multilora.trainer_kwargs(model, None, given)
    assert given.remove_unused_columns and given.max_grad_norm == 0.3
    assert kw["args"] is not given and not kw["args"].remove_unused_columns and kw["args"].max_grad_norm == 0.0
    assert [c.max_norm for c in kw["callbacks"] if isinstance(c, PerAdapterGradClip)] == [0.3]
    assert kw["args"].learning_rate == given.learning_rate and kw["args"].seed == given.seed
    # an explicit per-adapter norm wins over args' (and says so)
    with pytest.warns(UserWarning, match=r"max_grad_norm=0\.3 -> 0\.0 \(.*clipped on its own to 2\.0\)"):
        kw = fast_multilora.trainer_kwargs(model, None, _args(tmp_path, max_grad_norm=0.3), max_grad_norm=2.0)
    assert [c.max_norm for c in kw["callbacks"] if isinstance(c, PerAdapterGradClip)] == [2.0]
    # args that already say so: no warning, the same object; max_grad_norm 0 in args and none given: no clipping
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok = _args(tmp_path)
        kw = fast_multilora.trainer_kwargs(model, None, ok)
        assert kw["args"] is ok and not any(isinstance(c, PerAdapterGradClip) for c in kw["callbacks"])
        assert "optimizers" not in kw and "processing_class" not in kw
        # args=None: the Trainer's default arguments with both set, no warning
        kw = fast_multilora.trainer_kwargs(model)
        assert not kw["args"].remove_unused_columns and kw["args"].max_grad_norm == 0.0


def test_trainer_kwargs_refuses_what_cannot_work(tmp_path):
    from trl import SFTConfig

    unpatched = peft_model("llama")
    with pytest.raises(ValueError, match=r"trainer_kwargs: the model is not patched; call fast_multilora\.patch"):
        fast_multilora.trainer_kwargs(unpatched, None, _args(tmp_path))
    empty = patched_llama()
    for a in ADAPTERS:
        empty.delete_adapter(a)
    with pytest.raises(ValueError, match=r"trainer_kwargs: the model has no LoRA adapters"):
        fast_multilora.trainer_kwargs(empty, None, _args(tmp_path))
    model = patched_llama()
    with pytest.raises(TypeError, match=r"trainer_kwargs: args is TRL's SFTConfig; with TRL use "
                                        r"fast_multilora\.trl\.MultiAdapterSFTTrainer"):
        fast_multilora.trainer_kwargs(model, None, SFTConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                                             bf16=False))
    with pytest.raises(TypeError, match=r"trainer_kwargs: args must be a transformers\.TrainingArguments, got dict"):
        fast_multilora.trainer_kwargs(model, None, {"output_dir": "x"})
    with pytest.raises(ValueError, match=r"trainer_kwargs: max_grad_norm must be a number >= 0 .* got -1"):
        fast_multilora.trainer_kwargs(model, None, _args(tmp_path), max_grad_norm=-1)
    with pytest.raises(ValueError, match=r"trainer_kwargs: give adapter_lr .* or optimizer .*, not both"):
        fast_multilora.trainer_kwargs(model, None, _args(tmp_path), adapter_lr={"a0": 1e-3},
                                      optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(ValueError, match=r"trainer_kwargs: group_by_adapter is a setting of the default collator"):
        fast_multilora.trainer_kwargs(model, None, _args(tmp_path), data_collator=MultiAdapterCollator(),
                                      group_by_adapter=False)
    with pytest.raises(ValueError, match=r"settings for unknown adapter\(s\) \['nope'\]"):
        fast_multilora.trainer_kwargs(model, None, _args(tmp_path), adapter_lr={"nope": 1e-3})


def test_trainer_kwargs_warns_about_adapters_that_cannot_train(tmp_path):
    """PEFT leaves only the active adapter trainable: the others are named. One adapter only: said too."""
    from models import adapter_configs, tiny_llama
    from peft import get_peft_model

    model = peft_model("llama")
    model.set_adapter("a1")  # PEFT: requires_grad only on a1
    fast_multilora.patch(model, backend="torch")
    with pytest.warns(UserWarning, match=r"trainer_kwargs: adapter\(s\) \['a0', 'a2'\] have no trainable parameter "
                      r"and will not train"):
        fast_multilora.trainer_kwargs(model, None, _args(tmp_path))
    single = get_peft_model(tiny_llama(), adapter_configs("llama")["a0"], adapter_name="a0")
    fast_multilora.patch(single, backend="torch")
    with pytest.warns(UserWarning, match=r"trainer_kwargs: the model has one adapter \('a0'\)"):
        fast_multilora.trainer_kwargs(single, None, _args(tmp_path))


@pytest.mark.slow
def test_trainer_kwargs_under_ddp_matches_one_process(tmp_path):
    """``trainer_kwargs`` with the fused loss under DDP (torchrun, 2 CPU ranks over gloo; the Trainer wraps a
    PeftModel with ``find_unused_parameters=True``): the ranks' halves of each global batch, per-adapter token counts
    all-reduced, end with the weights and logged per-adapter losses of one process on the global batches; the training
    forwards built the logits of one position per row."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(root), str(root / "tests")]))
    env.pop("TRITON_INTERPRET", None)
    results = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        out.mkdir()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(root / "tests" / "trainer_ddp_worker.py"), str(out), "fused", "12"]
        res = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, f"{' '.join(cmd)} failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
        results[world] = torch.load(out / "result.pt")
    one, two = results[1], results[2]
    assert one["world"] == 1 and two["world"] == 2
    assert set(one["positions"]) == set(two["positions"]) == {1} and len(two["positions"]) == 3
    start = lora_weights(patched_llama())
    for n, w in one["weights"].items():
        assert not torch.equal(w, start[n]), f"{n} did not move"
        torch.testing.assert_close(two["weights"][n], w, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    assert len(one["logs"]) == len(two["logs"]) == 3
    for a, b in zip(one["logs"], two["logs"], strict=True):
        assert a.keys() == b.keys() == {f"loss/{x}" for x in ADAPTERS}
        for k in a:
            assert abs(a[k] - b[k]) <= 1e-3, (k, a, b)  # logs are rounded to 4 digits
