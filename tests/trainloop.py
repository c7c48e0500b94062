"""A tiny, fully seeded multi-adapter training loop (mixed batches and packed rows) for the resume, determinism and
memory tests: tiny Llama from tests/models.py, three adapters with dropout, AdamW, a LambdaLR schedule and a data
stream whose position (generator state + step) is part of the checkpoint."""

from __future__ import annotations

import torch
from models import peft_model

import fast_multilora

VOCAB = ["a0", "a1", "a2"]
ROW_NAMES = VOCAB + ["__base__"]


def make_model(backend="torch", device="cpu", dropout=0.1, seed=0, **kw):
    model = peft_model(dropout=dropout, seed=seed, **kw).to(device)
    fast_multilora.patch(model, backend=backend)
    model.train()
    return model


def lora_params(model):
    """LoRA parameters sorted by name: the optimizer's parameter order, the same in a model rebuilt from disk."""
    return sorted(((n, p) for n, p in model.named_parameters() if "lora_" in n), key=lambda t: t[0])


def lora_weights(model):
    return {n: p.detach().clone() for n, p in lora_params(model)}


def make_optim(model, lr=1e-2):
    opt = torch.optim.AdamW([p for _, p in lora_params(model)], lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * 0.9**s)
    return opt, sched


class Data:
    """Mixed batches: even steps one adapter name per row (``__base__`` included), odd steps packed rows
    (``adapter_ids`` runs over the vocabulary, -1 = base). Position = generator state + step counter."""

    def __init__(self, seed=123, rows=4, T=9, device="cpu"):
        self.gen = torch.Generator().manual_seed(seed)
        self.rows, self.T, self.device, self.step = rows, T, device, 0

    def next(self):
        g, rows, T = self.gen, self.rows, self.T
        ids = torch.randint(0, 97, (rows, T), generator=g)
        if self.step % 2 == 0:
            names = [ROW_NAMES[int(i)] for i in torch.randint(0, 4, (rows,), generator=g)]
            names[0] = VOCAB[self.step % 3]  # at least one adapter row: the loss has a graph
            batch = dict(input_ids=ids, adapter_names=names)
        else:
            cut = int(torch.randint(1, T, (1,), generator=g))
            a_ids = torch.randint(-1, 3, (rows, 2), generator=g)
            a_ids[0, 0] = self.step % 3
            a_ids = torch.cat([a_ids[:, :1].expand(rows, cut), a_ids[:, 1:].expand(rows, T - cut)], 1)
            batch = dict(input_ids=ids, adapter_names=list(VOCAB), adapter_ids=a_ids.contiguous())
        self.step += 1
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def state_dict(self):
        return {"gen": self.gen.get_state(), "step": self.step}

    def load_state_dict(self, state):
        self.gen.set_state(state["gen"])
        self.step = state["step"]


def train_step(model, opt, sched, batch):
    out = model(**batch).logits
    loss = fast_multilora.per_adapter_loss(out, batch["input_ids"], batch["adapter_names"],
                                           adapter_ids=batch.get("adapter_ids"))
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for _, p in lora_params(model)], 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def train(model, opt, sched, data, steps):
    for _ in range(steps):
        train_step(model, opt, sched, data.next())
