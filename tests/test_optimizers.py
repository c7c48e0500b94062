"""Any optimizer the user writes trains a patched model: the adapter store (``fast_multilora.store``, on by default)
keeps PEFT's parameters as views of its arenas, and their ``.grad`` hold their gradients whatever the optimizer does
with them (``zero_grad`` before the forward or between forward and backward, ``set_to_none`` or not, accumulation
over micro-batches, two optimizers over disjoint adapters, ``model.zero_grad()``).

Oracle: the same model patched with ``adapter_store=False`` (every layer call takes PEFT's parameters themselves, the
path compared with stock PEFT per adapter in ``test_parity.py``), the same optimizer, the same batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import peft_model

import fast_multilora
from fast_multilora.store import AdapterStore

NAMES = ["a0", "a1", "a2"]


def _model(store: bool):
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch", adapter_store=store)
    model.train()
    return model


def _lora(model):
    return [(n, p) for n, p in model.named_parameters() if "lora_" in n]


def _batches(n, rows=4, T=7):
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        ids = torch.randint(0, 97, (rows, T), generator=g)
        names = [NAMES[(i + j) % 3] if j < rows - 1 else "__base__" for j in range(rows)]
        out.append((ids, names))
    return out


def _loss(model, batch):
    ids, names = batch
    return fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=names).logits, ids, names)


def _optimizers(model, kind):
    params = [p for _, p in _lora(model)]
    if kind == "adamw":
        return [torch.optim.AdamW(params, lr=1e-2)]
    if kind == "adamw_fused":
        return [torch.optim.AdamW(params, lr=1e-2, fused=True)]
    if kind == "adamw_single_tensor":
        return [torch.optim.AdamW(params, lr=1e-2, foreach=False)]
    if kind == "sgd_momentum":
        return [torch.optim.SGD(params, lr=1e-1, momentum=0.9)]
    if kind == "bnb_paged_adamw8bit":
        bnb = pytest.importorskip("bitsandbytes")
        return [bnb.optim.PagedAdamW8bit(params, lr=1e-2)]
    if kind == "two_optimizers":  # disjoint adapters: each zero_grad drops only its own parameters' views
        by = lambda a: [p for n, p in _lora(model) if f".{a}." in n]  # noqa: E731
        return [torch.optim.AdamW(by("a0") + by("a2"), lr=1e-2), torch.optim.SGD(by("a1"), lr=1e-1)]
    raise AssertionError(kind)


def _train(model, kind, pattern, steps=3):
    opts = _optimizers(model, kind)
    batches = _batches(2 * steps)
    for s in range(steps):
        micro = batches[2 * s : 2 * s + 2] if pattern == "accumulate" else batches[2 * s : 2 * s + 1]
        if pattern == "zero_first":
            for o in opts:
                o.zero_grad()
        for b in micro:
            loss = _loss(model, b)
            if pattern == "zero_between":  # the common script order: zero_grad after the forward
                for o in opts:
                    o.zero_grad()
            loss.backward()
        for o in opts:
            o.step()
        if pattern in ("zero_last", "accumulate"):
            for o in opts:
                o.zero_grad(set_to_none=True)
        elif pattern == "zero_last_keep":
            for o in opts:
                o.zero_grad(set_to_none=False)
        elif pattern == "model_zero_grad":
            model.zero_grad()
    return {n: p.detach().clone() for n, p in _lora(model)}


@pytest.mark.parametrize("kind", ["adamw", "adamw_fused", "adamw_single_tensor", "sgd_momentum", "two_optimizers",
                                  "bnb_paged_adamw8bit"])
@pytest.mark.parametrize("pattern", ["zero_first", "zero_between", "zero_last", "zero_last_keep", "model_zero_grad",
                                     "accumulate"])
def test_any_optimizer_trains_the_store_as_the_parameters(kind, pattern):
    if kind == "bnb_paged_adamw8bit" and pattern not in ("zero_between", "accumulate"):
        pytest.skip("one pattern each for the slower optimizers is enough")
    ours = _model(store=True)
    assert AdapterStore.of(ours).held, "the store holds the adapters by default"
    ref = _model(store=False)
    got, want = _train(ours, kind, pattern), _train(ref, kind, pattern)
    start = {n: p.detach().clone() for n, p in _lora(_model(store=False))}
    for n in want:
        assert not torch.equal(want[n], start[n]), f"{n} did not train: the comparison would be empty"
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_grads_are_the_parameters_own_after_any_zero_grad():
    """``p.grad`` after a backward equals the per-parameter path's, also after ``zero_grad`` dropped it between the
    forward and the backward (the leaves' hooks re-attach the zeroed views before their gradients land)."""
    ours, ref = _model(store=True), _model(store=False)
    b = _batches(2)
    for m in (ours, ref):
        _loss(m, b[0]).backward()  # a first gradient that must not leak into the second
    got_loss, want_loss = _loss(ours, b[1]), _loss(ref, b[1])
    for m in (ours, ref):
        m.zero_grad(set_to_none=True) if m is ref else torch.optim.SGD([p for _, p in _lora(m)], lr=0).zero_grad()
    got_loss.backward()
    want_loss.backward()
    for (n, p), (_, q) in zip(_lora(ours), _lora(ref), strict=True):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_torch_optimizers_take_their_foreach_and_fused_paths_on_held_parameters(monkeypatch):
    """torch's optimizers choose foreach (their default on a GPU) or fused only for parameters whose ``type()`` they
    list (``torch.optim.optimizer._foreach_supported_types``); a held parameter's class is registered there, else
    ``torch.optim.AdamW(model.parameters())`` silently falls back to its per-parameter loop (host-bound on a GPU).
    The device check is widened to the CPU here so the choice itself is what is tested."""
    from torch.optim import optimizer as torch_optimizer

    model = _model(True)
    params = [p for _, p in _lora(model)]
    assert params and all(type(p) is not torch.nn.Parameter for p in params)  # held: the store's class
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    monkeypatch.setattr(torch_optimizer, "_get_fused_kernels_supported_devices", lambda: ["cpu"])
    assert torch_optimizer._default_to_fused_or_foreach(params, False, False) == (False, True)
    assert torch_optimizer._default_to_fused_or_foreach(params, False, True) == (True, False)


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("pattern", ["zero_first", "zero_last", "model_zero_grad"])
def test_an_adapter_absent_from_a_batch_is_left_alone(kind, pattern):
    """As under stock PEFT (training each adapter alone, or PEFT's own mixed batch): an adapter with no rows since
    its gradient was dropped has ``.grad`` ``None``, so torch's optimizers skip it -- no weight decay, no momentum
    step. Its trajectory over batches ``[all, without it, without it, all]`` equals that over ``[all, all]``."""
    g = torch.Generator().manual_seed(11)
    full = [(torch.randint(0, 97, (4, 7), generator=g), ["a0", "a1", "a2", "__base__"]) for _ in range(2)]
    without = [(torch.randint(0, 97, (3, 7), generator=g), ["a2", "a0", "__base__"]) for _ in range(2)]

    def run(batches):
        model = _model(store=True)
        params = [p for _, p in _lora(model)]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1) if kind == "adamw" else \
            torch.optim.SGD(params, lr=1e-1, momentum=0.9)
        seen_grads = []
        for b in batches:
            if pattern == "zero_first":
                opt.zero_grad()
            _loss(model, b).backward()
            seen_grads.append({n for n, p in _lora(model) if p.grad is not None})
            opt.step()
            if pattern == "zero_last":
                opt.zero_grad()
            elif pattern == "model_zero_grad":
                model.zero_grad()
        return {n: p.detach().clone() for n, p in _lora(model) if ".a1." in n}, seen_grads

    got, grads = run([full[0], *without, full[1]])
    want, _ = run(full)
    assert got and all(not any(".a1." in n for n in s) for s in grads[1:3]), "a1 got a gradient while absent"
    assert all(any(".a1." in n for n in s) for s in (grads[0], grads[3]))
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def _bridged(opt) -> bool:
    from fast_multilora import optim

    return type(optim._BRIDGES.get(opt)).__name__ == "_Bridge"


def _adamw_run(store_optimizer: bool, steps=4, resume_at=None, same=False, use_closure=False, **opt_kw):
    """``torch.optim.AdamW(model.parameters())`` (an lm_head weight trained too: a parameter outside the store) with
    an LR schedule over batches that leave ``a1`` out after the first step and ``a0`` in every other one; ``a2``
    frozen half-way. ``resume_at``: the optimizer's ``state_dict`` and the weights are saved after that step and
    loaded into a fresh model and optimizer (``same``: into these, after one more step), which run the remaining
    steps."""
    def fresh():
        model = peft_model("llama")
        fast_multilora.patch(model, backend="torch", store_optimizer=store_optimizer)
        model.base_model.model.lm_head.weight.requires_grad_(True)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, **opt_kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return model, opt, sched

    model, opt, sched = fresh()
    g = torch.Generator().manual_seed(5)
    for s in range(steps):
        names = ["a0", "a1", "a2", "__base__"] if s == 0 else (["a2", "a0", "__base__"] if s % 2 else ["a2", "a2"])
        if s == 2:
            for n, p in model.named_parameters():
                if ".a2." in n:
                    p.requires_grad_(False)
        ids = torch.randint(0, 97, (len(names), 6), generator=g)

        def closure(model=model, opt=opt, ids=ids, names=names):
            opt.zero_grad()
            loss = fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=names).logits, ids, names)
            loss.backward()
            return loss

        if use_closure:  # torch calls it inside its step: the store's step must come after its backward
            assert opt.step(closure) is not None
        else:
            closure()
            opt.step()
        sched.step()
        if s == resume_at:
            model, opt, sched = resume(model, opt, sched, fresh, same, ids, names, frozen_a2=s >= 2)
    return model, opt


@pytest.mark.parametrize("resume_at,same,use_closure", [(None, False, False), (1, False, False), (2, True, False),
                                                         (None, False, True)],
                         ids=["run", "resume", "rollback", "closure"])
@pytest.mark.parametrize("fused", [False, True])
def test_torch_adamw_steps_held_parameters_through_the_store(resume_at, same, use_closure, fused):
    """The user's own ``torch.optim.AdamW(model.parameters())`` steps the store's parameters with the store's step
    (``PatchConfig.store_optimizer``, on by default) and everything else with torch's: weights, ``state_dict``
    (the same entries: an adapter never stepped has none; step counts per parameter) and the LR schedule equal torch
    stepping every parameter itself (``store_optimizer=False``); ``.grad`` stays readable after the step; a
    ``state_dict`` saved mid-run and loaded into a fresh model and optimizer, or into these after a step more, goes
    on identically."""
    from fast_multilora import cpu_ops

    calls = []
    real = cpu_ops.adamw_step
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_ops, "adamw_step", lambda *a, **k: calls.append(1) or real(*a, **k))
        got, got_opt = _adamw_run(True, resume_at=resume_at, same=same, use_closure=use_closure, fused=fused)
    want, want_opt = _adamw_run(False, fused=fused)
    assert _bridged(got_opt) and not _bridged(want_opt)
    assert len(calls) == 4 + same  # one store step per optimizer step (one arena)
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
        assert (p.grad is None) == (q.grad is None), n
    a, b = got_opt.state_dict(), want_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"])
    for k, st in b["state"].items():
        assert float(a["state"][k]["step"]) == float(st["step"]), k
        for s in ("exp_avg", "exp_avg_sq"):
            w = st[s].float()  # (the weights differ by fp32 rounding after a step: so do later gradients)
            torch.testing.assert_close(a["state"][k][s].float(), w, rtol=1e-4, atol=1e-4 * w.abs().max().item())


def test_torch_adamw_options_it_does_not_take_over_are_torchs():
    """``amsgrad`` (and the other options the store's step lacks): torch steps every parameter; a
    ``fast_multilora.AdamW`` built later takes the arenas' states over and the first optimizer keeps stepping its
    own copies."""
    got, got_opt = _adamw_run(True, steps=2, amsgrad=True)
    want, _ = _adamw_run(False, steps=2, amsgrad=True)
    assert not _bridged(got_opt)
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    model, opt = _adamw_run(True, steps=2)
    assert _bridged(opt)
    held = {id(p) for a in AdapterStore.of(model).arenas.values() for _, _, p in a.blocks.values()}
    fast_multilora.AdamW(model, lr=1e-3)  # takes the arenas over
    ids = torch.randint(0, 97, (2, 6))
    fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=["a0", "a0"]).logits, ids,
                                    ["a0", "a0"]).backward()
    opt.step()
    assert not _bridged(opt)
    for p, st in opt.state.items():
        if id(p) in held:
            assert all(v._base is None for v in st.values() if torch.is_tensor(v)), "still a view of an arena"


def _step_on(model, opt, names, g):
    """One step of ``opt`` on rows ``names`` (random tokens from ``g``), ``per_adapter_loss``."""
    ids = torch.randint(0, 97, (len(names), 6), generator=g)
    opt.zero_grad()
    fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=names).logits, ids, names).backward()
    opt.step()


def _assert_store_stepped_like_torch(got, got_opt, want, stepped):
    """``got_opt`` took the store's step (the ``stepped`` parameters' states are arena views) and ``got`` equals
    ``want``, the same run stepped by torch itself. Adam moves an element by about lr whatever its gradient's size:
    one whose gradient is near the rounding noise (the runs' weights differ by fp32 rounding after a step) moves by a
    different fraction of lr, so the bound is 1e-3 of the largest moves (lr up to 3e-2, a few steps), as in
    test_store."""
    assert _bridged(got_opt)
    assert stepped and all(got_opt.state[p]["exp_avg"]._base is not None for p in stepped)
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1.2e-4, msg=lambda m, n=n: f"{n}: {m}")


def test_torch_adamw_steps_expert_lora_through_the_store():
    """MoE expert LoRA (held by the store as adapters of rank ``E*r``) under the user's ``torch.optim.AdamW``: the
    store's step equals torch's, the expert parameters' states are arena views."""
    from test_moe import moe_model

    def run(flag):
        model = moe_model("qwen3_moe", "grouped_mm")
        fast_multilora.patch(model, backend="torch", store_optimizer=flag)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(2)
        for names in (["a0", "a1", "a2", "__base__"], ["a1", "a1", "a0"], ["a0", "a2"]):
            _step_on(model, opt, names, g)
        return model, opt

    got, got_opt = run(True)
    want, _ = run(False)
    experts = [p for n, p in got.named_parameters() if ".experts" in n and "lora_" in n]
    _assert_store_stepped_like_torch(got, got_opt, want, experts)


def test_torch_adamw_follows_adapters_added_and_deleted():
    """An adapter added to the model and to the optimizer (``add_param_group``, its own lr) is stepped through the
    store from its first step; a deleted one's parameters leave; equal to torch stepping every parameter itself."""
    from peft import LoraConfig

    def run(flag):
        model = peft_model("llama")
        fast_multilora.patch(model, backend="torch", store_optimizer=flag)
        model.train()
        opt = torch.optim.AdamW([p for _, p in _lora(model)], lr=1e-2, weight_decay=0.1)
        g = torch.Generator().manual_seed(9)
        for s, names in enumerate((["a0", "a1", "a2"], ["a1", "a2", "a0"], ["n", "a0", "n"], ["n", "a2"])):
            if s == 2:
                model.delete_adapter("a1")
                model.add_adapter("n", LoraConfig(r=3, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
                torch.manual_seed(0)  # (both runs draw the same new weights)
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        if ".n." in n:
                            p.copy_(torch.randn_like(p) * 0.1)
                            p.requires_grad_(True)
                opt.add_param_group({"params": [p for n, p in model.named_parameters() if ".n." in n], "lr": 3e-2})
            _step_on(model, opt, names, g)
        return model, opt

    got, got_opt = run(True)
    want, _ = run(False)
    _assert_store_stepped_like_torch(got, got_opt, want, [p for n, p in got.named_parameters() if ".n." in n])


def test_torch_adamw_takes_over_an_adapter_added_to_its_groups_later():
    """An optimizer first over one adapter, then given another existing adapter (``add_param_group``, no change to
    the model): the store steps the second from then on, equal to torch stepping it."""
    def run(flag):
        model = peft_model("llama")
        fast_multilora.patch(model, backend="torch", store_optimizer=flag)
        model.train()
        of = lambda a: [p for n, p in _lora(model) if f".{a}." in n]  # noqa: E731
        opt = torch.optim.AdamW(of("a0"), lr=1e-2)
        g = torch.Generator().manual_seed(4)
        _step_on(model, opt, ["a0", "a1"], g)
        opt.add_param_group({"params": of("a1"), "lr": 2e-2})
        _step_on(model, opt, ["a1", "a0"], g)
        _step_on(model, opt, ["a1", "a1"], g)
        return model, opt, of("a1")

    got, got_opt, a1 = run(True)
    want, _, _ = run(False)
    _assert_store_stepped_like_torch(got, got_opt, want, a1)


def test_unpatch_hands_a_store_stepped_optimizer_back_to_torch():
    """After ``unpatch`` the optimizer that stepped through the store keeps stepping, as torch, its own copies of the
    states, and a new optimizer is torch's alone: stock behaviour."""
    model, opt = _adamw_run(True, steps=2)
    assert _bridged(opt)
    fast_multilora.unpatch(model)
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 97, (2, 6), generator=g)
    model.set_adapter("a0")
    for o in (opt, torch.optim.AdamW(model.parameters(), lr=1e-2)):
        o.zero_grad()
        model(input_ids=ids).logits.float().pow(2).mean().backward()
        o.step()
        assert not _bridged(o)
        assert all(v._base is None for st in o.state.values() for v in st.values() if torch.is_tensor(v))


def resume(model, opt, sched, fresh, same: bool, ids, names, frozen_a2: bool):
    """The weights, the optimizer's ``state_dict`` and the schedule's saved, then loaded back: into a fresh model,
    optimizer and schedule (``fresh()``), or (``same``) into these after one more step (a rollback); ``a2``'s
    parameters frozen again where they were. Returns what the run goes on with."""
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    sched_state = sched.state_dict()
    if same:
        fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=names).logits, ids, names).backward()
        opt.step()
    else:
        model, opt, sched = fresh()
    model.load_state_dict(saved)
    for n, p in model.named_parameters():
        if ".a2." in n and frozen_a2:
            p.requires_grad_(False)
    opt.load_state_dict(state)
    sched.load_state_dict(sched_state)
    return model, opt, sched
