"""bitsandbytes' blockwise 8-bit Adam family over a patched model steps the adapter store's parameters in a few calls
per step (``fast_multilora.optim_bnb``), bit for bit as bitsandbytes stepping each tensor itself.

Oracle: the same model, optimizer and batches with ``PatchConfig(store_optimizer=False)``: bitsandbytes' own step per
tensor (its CPU kernel, the one the bridge calls too: bitsandbytes 0.50 runs ``optimizer_update_8bit_blockwise`` on
the CPU, so weights and states are compared for equality, not closeness).
"""

from __future__ import annotations

import pytest
import torch
from models import peft_model
from test_optimizers import resume

import fast_multilora
from fast_multilora import optim, optim_bnb

bnb = pytest.importorskip("bitsandbytes")
F = bnb.functional


def _bridge(opt):
    b = optim._BRIDGES.get(opt)
    return b if type(b) is optim_bnb.BnbBridge else None


class _Calls:
    """Counts ``optimizer_update_8bit_blockwise`` calls (the per-tensor step calls it once per tensor)."""

    def __init__(self, mp):
        self.n = 0
        real = F.optimizer_update_8bit_blockwise

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)

        mp.setattr(F, "optimizer_update_8bit_blockwise", counted)


def _run(store_optimizer: bool, cls="AdamW8bit", steps=4, resume_at=None, same=False, unpatch_at=None, calls=None,
         **opt_kw):
    """``bnb.optim.<cls>`` over ``model.parameters()`` in two groups (``a0``'s with its own lr and no weight decay; an
    lm_head weight trained too: a parameter outside the store) with an
    LR schedule over batches that leave ``a1`` out after the first step and ``a0`` in every other one; ``a2`` frozen
    half-way. ``resume_at``: the optimizer's ``state_dict`` and the weights saved after that step and loaded into a
    fresh model and optimizer (``same``: into these, after one more step). ``unpatch_at``: the model unpatched after
    that step. ``calls``: a list that gets each step's kernel calls."""
    opt_kw = {"lr": 1e-2, "weight_decay": 0.1, "min_8bit_size": 1, **opt_kw}

    def fresh():
        model = peft_model("llama")
        fast_multilora.patch(model, backend="torch", store_optimizer=store_optimizer)
        model.base_model.model.lm_head.weight.requires_grad_(True)
        model.train()
        of_a0 = [p for n, p in model.named_parameters() if ".a0." in n]  # its own group: another lr, no decay
        rest = [p for n, p in model.named_parameters() if ".a0." not in n]
        opt = getattr(bnb.optim, cls)([{"params": rest}, {"params": of_a0, "lr": 2e-2, "weight_decay": 0.0}],
                                      **opt_kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return model, opt, sched

    model, opt, sched = fresh()
    g = torch.Generator().manual_seed(5)
    with pytest.MonkeyPatch.context() as mp:
        counter = _Calls(mp)
        for s in range(steps):
            names = ["a0", "a1", "a2", "__base__"] if s == 0 else (["a2", "a0", "__base__"] if s % 2 else
                                                                    ["a2", "a2"])
            if s == 2:
                for n, p in model.named_parameters():
                    if ".a2." in n:
                        p.requires_grad_(False)
            ids = torch.randint(0, 97, (len(names), 6), generator=g)
            opt.zero_grad()
            kw = {} if unpatch_at is not None and s > unpatch_at else {"adapter_names": names}
            if not kw:
                model.set_adapter("a0")
            loss = model(input_ids=ids, **kw).logits
            loss = fast_multilora.per_adapter_loss(loss, ids, names) if kw else loss.float().pow(2).mean()
            loss.backward()
            before = counter.n
            opt.step()
            if calls is not None:
                calls.append(counter.n - before)
            sched.step()
            if s == resume_at:
                model, opt, sched = resume(model, opt, sched, fresh, same, ids, names, frozen_a2=s >= 2)
            if s == unpatch_at:
                fast_multilora.unpatch(model)
    return model, opt


def _assert_same(got, got_opt, want, want_opt):
    """Weights and optimizer states equal, bit for bit; the same state entries (an adapter never stepped has none)."""
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach()), f"{n}: max diff {(p - q).abs().max().item()}"
        assert (p.grad is None) == (q.grad is None), n
    a, b = got_opt.state_dict(), want_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    wrapped = bnb.optim.optimizer.Optimizer8bit._FSDP_WRAPPED_QUANT_STATE_KEY
    for k, st in b["state"].items():
        mine = a["state"][k]
        assert mine.keys() == st.keys(), k
        assert mine["step"] == st["step"], k
        for name, v in st[wrapped].items():
            assert torch.equal(mine[wrapped][name], v), f"param {k} {name}"


def _held_states(model, opt) -> list:
    ids = {id(p) for n, p in model.named_parameters() if "lora_" in n}
    return [st for p, st in opt.state.items() if id(p) in ids]


@pytest.mark.parametrize("cls", ["AdamW8bit", "PagedAdamW8bit", "Adam8bit"])
def test_bnb_8bit_adam_steps_the_store_in_a_few_calls(cls):
    """Weights, states and ``state_dict`` equal bitsandbytes stepping each tensor (``store_optimizer=False``); each
    step is a few kernel calls, not one per tensor; the states are bitsandbytes' dicts whose tensors are views of the
    bridge's buffers."""
    got_calls, want_calls = [], []
    got, got_opt = _run(True, cls, calls=got_calls)
    want, want_opt = _run(False, cls, calls=want_calls)
    bridge = _bridge(got_opt)
    assert bridge is not None and _bridge(want_opt) is None
    lora = [p for n, p in got.named_parameters() if "lora_" in n]
    assert len(bridge.pieces) == len(lora) == 52  # every LoRA tensor (min_8bit_size=1), lm_head left to bitsandbytes
    # per step: one call per run of pieces of one step count (adapter by adapter) and the lm_head's own
    assert want_calls[0] == 53 and max(got_calls) <= 4, (got_calls, want_calls)
    assert all(st["state1"]._base is not None for st in _held_states(got, got_opt))
    _assert_same(got, got_opt, want, want_opt)
    start = peft_model("llama")
    moved = [n for (n, p), (_, q) in zip(got.named_parameters(), start.named_parameters(), strict=True)
             if "lora_" in n and not torch.equal(p.detach(), q.detach())]
    assert len(moved) == len(lora), "every adapter trained: the comparison covers them all"


@pytest.mark.parametrize("resume_at,same", [(1, False), (2, True)], ids=["resume", "rollback"])
def test_bnb_8bit_state_dict_resumes(resume_at, same):
    """A ``state_dict`` saved mid-run and loaded into a fresh model and optimizer (or into these after a step more)
    goes on bit for bit as bitsandbytes does."""
    got, got_opt = _run(True, resume_at=resume_at, same=same)
    want, want_opt = _run(False)
    assert _bridge(got_opt) is not None
    _assert_same(got, got_opt, want, want_opt)


def test_bnb_8bit_mixed_sizes_and_overrides_are_bitsandbytes_own():
    """Tensors under ``min_8bit_size`` keep bitsandbytes' 32-bit states and its per-tensor step, as does a parameter
    with an ``override_config``; the rest take the bridge; all equal to bitsandbytes stepping each tensor. A
    default ``min_8bit_size`` (4096) leaves every LoRA tensor of the tiny model to bitsandbytes."""
    mng = bnb.optim.GlobalOptimManager.get_instance()

    def run(flag, **kw):
        model = peft_model("llama")
        fast_multilora.patch(model, backend="torch", store_optimizer=flag)
        model.train()
        target = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["a1"].weight
        mng.override_config(target, "lr", 3e-2)
        opt = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2, **kw)
        g = torch.Generator().manual_seed(3)
        for names in (["a0", "a1", "a2"], ["a1", "a2"], ["a0", "a1", "a1"]):
            ids = torch.randint(0, 97, (len(names), 6), generator=g)
            opt.zero_grad()
            fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=names).logits, ids, names).backward()
            opt.step()
        return model, opt, target

    try:
        got, got_opt, target = run(True, min_8bit_size=200)
        want, want_opt, _ = run(False, min_8bit_size=200)
        bridge = _bridge(got_opt)
        sizes = [p.numel() for n, p in got.named_parameters() if "lora_" in n]
        owned = {id(pc.param) for pc in bridge.pieces}
        assert id(target) not in owned and got_opt.state[target]["state1"]._base is None
        assert len(owned) == sum(n >= 200 for n in sizes) - 1 > 0 and min(sizes) < 200
        assert any(st["state1"].dtype == torch.float32 for st in _held_states(got, got_opt))
        _assert_same(got, got_opt, want, want_opt)
        got, got_opt, _ = run(True)
        want, want_opt, _ = run(False)
        assert not _bridge(got_opt).pieces
        _assert_same(got, got_opt, want, want_opt)
    finally:
        mng.initialize()


def test_bnb_8bit_padding_stays_zero():
    """Pieces that are not whole 256-element blocks are padded in the bridge's buffers: the padding dequantises to
    zero after every step (it would otherwise enter the block's absmax)."""
    model, opt = _run(True)
    bridge = _bridge(opt)
    padded = 0
    for pc, st in zip(bridge.pieces, bridge.dicts, strict=True):
        if st is None or pc.numel % 256 == 0:
            continue
        a = bridge.arenas[pc.arena]
        lo, hi = pc.offset + pc.numel, pc.offset + -(-pc.numel // 256) * 256
        absmax = a.absmax1[hi // 256 - 1]
        for buf, qmap, amax in ((a.state1, st["qmap1"], absmax), (a.state2, st["qmap2"], a.absmax2[hi // 256 - 1])):
            assert torch.all(qmap[buf[lo:hi].long()] * amax == 0), pc.param.shape
        padded += 1
    assert padded > 10


def test_unpatch_hands_bnb_states_back():
    """After ``unpatch`` bitsandbytes steps every tensor with its own copies of the states, equal to a run it stepped
    all along."""
    got, got_opt = _run(True, steps=3, unpatch_at=1)
    want, want_opt = _run(False, steps=3, unpatch_at=1)
    assert _bridge(got_opt) is None and optim._BRIDGES.get(got_opt) is False
    assert all(v._base is None for st in got_opt.state.values() for v in st.values() if torch.is_tensor(v))
    _assert_same(got, got_opt, want, want_opt)
