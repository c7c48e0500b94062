"""TRL's ``SFTTrainer`` training several adapters in one mixed batch (``fast_multilora.trl.MultiAdapterSFTTrainer``).

Prompt-completion text through TRL's own tokenization and completion-only labels, per-row routing from an adapter
column, per-token routing of TRL's packed (padding-free) rows, datasets per adapter interleaved by a sampler. The
oracle is ``fast_multilora.per_adapter_loss`` on the same samples tokenized here, unpacked: the logged per-adapter
losses and one SGD step must equal it and its gradient.
"""

import os
import sys

import pytest
import torch
from models import lora_weights, patched_llama

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from trl import SFTConfig  # noqa: E402

import fast_multilora  # noqa: E402
from fast_multilora.data import AdapterInterleaveSampler, MultiAdapterCollator  # noqa: E402
from fast_multilora.trl import MultiAdapterSFTTrainer  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)
import multi_adapter_tasks as T  # noqa: E402

ADAPTERS = ["a0", "a1", "a2"]
WORDS = "red blue cat dog sun moon tree bird fish rain".split()


@pytest.fixture(scope="module")
def tok():
    return T.char_tokenizer()  # no download; ids < 97, the tiny test model's vocabulary


def rows(names, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for name in names:
        w = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(torch.randint(1, 4, (1,), generator=g)),),
                                                   generator=g)]
        out.append({"prompt": f"Q: {' '.join(w)} =>", "completion": " " + " ".join(reversed(w)).upper(),
                    "adapter_name": name})
    return out


def dataset(samples):
    return datasets.Dataset.from_list(samples)


def encoded(tok, samples):
    """The samples tokenized by hand: prompt + completion + EOS, labels on the completion and EOS only."""
    out = []
    for s in samples:
        p = tok(s["prompt"])["input_ids"]
        c = tok(s["completion"])["input_ids"] + [tok.eos_token_id]
        out.append({"input_ids": p + c, "labels": [-100] * len(p) + c, "adapter_name": s["adapter_name"]})
    return out


def trainer_for(model, data, tok, tmp_path, *, steps, batch, optimizer=None, **kw):
    args = SFTConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-2,
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True, seed=0,
                     dataloader_num_workers=0, bf16=False, completion_only_loss=True, **kw)
    return MultiAdapterSFTTrainer(model, args=args, train_dataset=data, processing_class=tok,
                                  optimizers=(optimizer, None))


def test_every_adapter_moves_base_rows_move_none(tmp_path, tok):
    model = patched_llama()
    before = lora_weights(model)
    trainer = trainer_for(model, dataset(rows(ADAPTERS * 4)), tok, tmp_path, steps=2, batch=6)
    trainer.train()
    after = lora_weights(model)
    for n in before:
        assert not torch.equal(before[n], after[n]), f"{n} did not move"
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all({f"loss/{a}" for a in ADAPTERS} <= set(h) for h in logged), logged
    assert "mean_token_accuracy" in logged[0]  # TRL's own metrics stay

    model = patched_llama()
    before = lora_weights(model)
    trainer_for(model, dataset(rows(["__base__"] * 8)), tok, tmp_path, steps=2, batch=4).train()
    after = lora_weights(model)
    for n in before:
        assert torch.equal(before[n], after[n]), n


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_step_and_logged_losses_are_the_per_adapter_loss(tmp_path, tok, packing):
    """One SGD step over the whole dataset: the logged ``loss/<adapter>`` equal per_adapter_loss on the samples
    tokenized here (unpacked, one row each), and the update is -lr times its gradient. With packing, TRL packs the
    samples into padding-free rows; equality shows that every token was routed to its own adapter and trained on
    its completion only, with no attention across samples."""
    samples = rows(["a1", "a0", "__base__", "a2", "a1", "a0", "a2", "a1", "__base__", "a2"], seed=3)
    ref = patched_llama()
    b = MultiAdapterCollator(tok)(encoded(tok, samples))
    out = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], adapter_names=b["adapter_names"])
    want_loss, want_per = fast_multilora.per_adapter_loss(out.logits, b["labels"], b["adapter_names"],
                                                          return_dict=True)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if "lora_" in n}

    model = patched_llama()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append((kw.get("adapter_ids"), kw.get("adapter_names"))),
                                    with_kwargs=True, prepend=True)
    before = lora_weights(model)
    lr = 0.1
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    trainer = trainer_for(model, dataset(samples), tok, tmp_path, steps=1, batch=len(samples), optimizer=opt,
                          max_grad_norm=0.0, lr_scheduler_type="constant", packing=packing, max_length=64)
    trainer.train()
    ids, names = seen[0]
    if packing:  # one padding-free row holding several samples of several adapters
        assert ids is not None and ids.shape[0] == 1 and names == ADAPTERS
        assert len(set(ids[0].tolist()) - {-1}) == 3
    else:
        assert ids is None and sorted(names) == sorted(s["adapter_name"] for s in samples)
    logged = trainer.state.log_history[0]
    for a in ADAPTERS:
        assert logged[f"loss/{a}"] == pytest.approx(want_per[a], abs=1e-4), (a, logged)
    after = lora_weights(model)
    for n in want:
        torch.testing.assert_close((before[n] - after[n]) / lr, want[n], rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=n: f"{n}: {m}")

    trainer.evaluate(dataset(samples))  # eval_loss/<adapter>: the trained model's per-adapter loss
    model.eval()
    with torch.no_grad():
        out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], adapter_names=b["adapter_names"])
    _, per = fast_multilora.per_adapter_loss(out.logits, b["labels"], b["adapter_names"], return_dict=True)
    logged = trainer.state.log_history[-1]
    for a in ADAPTERS:
        assert logged[f"eval_loss/{a}"] == pytest.approx(per[a], abs=1e-4), (a, logged)


def test_gradient_accumulation(tmp_path, tok):
    """Two micro-batches per step: the update is -lr times the gradient of the mean over the micro-batches of
    per_adapter_loss (the loss is divided by the accumulation steps once: not again by the Trainer)."""
    samples = rows(["a1", "a0", "__base__", "a2", "a1", "a0", "a2", "a1"], seed=5)
    model = patched_llama()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append({k: kw[k] for k in ("input_ids", "attention_mask",
                                                                                       "labels", "adapter_names")}),
                                    with_kwargs=True, prepend=True)
    before = lora_weights(model)
    lr = 0.1
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    trainer_for(model, dataset(samples), tok, tmp_path, steps=1, batch=4, optimizer=opt, max_grad_norm=0.0,
                lr_scheduler_type="constant", gradient_accumulation_steps=2).train()
    assert len(seen) == 2
    ref = patched_llama()
    for b in seen:
        out = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"], adapter_names=b["adapter_names"])
        (fast_multilora.per_adapter_loss(out.logits, b["labels"], b["adapter_names"]) / 2).backward()
    after = lora_weights(model)
    for n, p in ref.named_parameters():
        if "lora_" in n:
            torch.testing.assert_close((before[n] - after[n]) / lr, p.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=n: f"{n}: {m}")


def test_datasets_per_adapter_interleaved(tmp_path, tok):
    """``{adapter: dataset}``: every batch holds every adapter in equal parts (the sampler's round-robin)."""
    model = patched_llama()
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(list(kw["adapter_names"])), with_kwargs=True,
                                    prepend=True)
    data = {a: dataset([{k: v for k, v in r.items() if k != "adapter_name"} for r in rows([a] * 4, seed=i)])
            for i, a in enumerate(ADAPTERS)}
    before = lora_weights(model)
    trainer_for(model, data, tok, tmp_path, steps=4, batch=3).train()
    assert len(seen) == 4 and all(sorted(s) == ADAPTERS for s in seen), seen
    after = lora_weights(model)
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_interleave_sampler():
    names = ["x"] * 5 + ["y"] * 2 + ["z"] * 3
    order = list(AdapterInterleaveSampler(names, seed=1))
    assert sorted(order) == list(range(10))
    assert [names[i] for i in order] == ["x", "y", "z", "x", "y", "z", "x", "z", "x", "x"]
    assert order != list(AdapterInterleaveSampler(names, seed=2))  # shuffled within each adapter
    assert list(AdapterInterleaveSampler(names, shuffle=False)) == [0, 5, 7, 1, 6, 8, 2, 9, 3, 4]


def test_bad_adapter_column(tmp_path, tok):
    model = patched_llama()
    trainer = trainer_for(model, dataset(rows(["a0", "nope"])), tok, tmp_path, steps=1, batch=2)
    with pytest.raises(ValueError, match="'nope' is not one of the model's adapters"):
        trainer.train()
    plain = dataset([{k: v for k, v in r.items() if k != "adapter_name"} for r in rows(["a0", "a1"])])
    trainer = trainer_for(model, plain, tok, tmp_path, steps=1, batch=2)
    with pytest.raises(KeyError, match="no 'adapter_name' column"):
        trainer.train()


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--data", "per-adapter", "--packing"]], ids=["column", "per-adapter-packed"])
def test_example_runs_and_saves_peft_adapters(tmp_path, flags):
    """examples/sft_multi_adapter.py --model tiny: trains, logs every adapter's loss, saves each adapter in PEFT
    format (reloaded by stock PEFT with the trained weights)."""
    import sft_multi_adapter
    from peft import PeftModel

    trainer = sft_multi_adapter.main(["--model", "tiny", "--max-steps", "2", "--output-dir", str(tmp_path),
                                      "--device", "cpu", "--batch-size", "6", "--train-per-adapter", "12",
                                      "--no-eval", *flags])
    adapters = T.DEFAULT_ADAPTERS
    assert any({f"loss/{a}" for a in adapters} <= set(h) for h in trainer.state.log_history)
    trained = {n: p for n, p in trainer.model.named_parameters() if "lora_" in n}
    base, _ = T.load_base("tiny")
    reloaded = PeftModel.from_pretrained(base, str(tmp_path / "adapters" / adapters[0]), adapter_name=adapters[0])
    for a in adapters[1:]:
        reloaded.load_adapter(str(tmp_path / "adapters" / a), adapter_name=a)
    got = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert set(got) == set(trained)
    for n in got:
        assert torch.equal(got[n], trained[n].detach()), n
