"""The adapter store (``fast_multilora.store``) and its optimizer (``fast_multilora.AdamW``).

Many adapters: parity with stock PEFT per sample at 64 and 128 adapters (mixed ranks and targets), through the
store's leaves; the optimizer against ``torch.optim.AdamW`` run per adapter (own hyperparameters, adapters absent
from a batch not stepped, a frozen adapter untouched); checkpoint resume bit for bit; adapters added and deleted
while training; ``save_pretrained`` files as stock PEFT writes them; gradient clipping.
"""

import collections
import copy
import functools
import io
import pickle
import random

import pytest
import torch
from helpers import CPU_BACKENDS
from models import LLAMA_TARGETS, tiny_llama, with_adapters
from peft import LoraConfig
from test_paths import _peft_per_sample

import fast_multilora
from fast_multilora.store import AdapterStore

RANKS = (1, 2, 4, 8, 3)
TARGET_SETS = (LLAMA_TARGETS, ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj", "o_proj"],
               ["k_proj", "down_proj"])


BACKENDS = CPU_BACKENDS  # (the store's Triton path on CPU models)

def many_configs(n, dropout=0.0):
    """``n`` adapters, ranks and targets cycling, own alphas, every fifth rsLoRA; B != 0."""
    return {f"m{i:03d}": LoraConfig(r=RANKS[i % len(RANKS)], lora_alpha=1 + i % 7,
                                    target_modules=TARGET_SETS[i % len(TARGET_SETS)], use_rslora=i % 5 == 0,
                                    init_lora_weights=False, lora_dropout=dropout)
            for i in range(n)}


def many_model(n, seed=0, layers=2):
    """A tiny Llama with ``many_configs(n)``; B scaled by 0.3: PEFT's ``init_lora_weights=False`` B with alphas up to
    7 makes deltas far larger than the random base's outputs, and such a row amplifies 1-ulp differences to 1e-3
    relative (measured: the same on the per-parameter path); a wrong slot still moves results by the delta itself.
    ``layers=1`` where a second decoder layer only repeats each launch (tiny_llama)."""
    torch.manual_seed(seed + 1)
    model = with_adapters(tiny_llama(seed, layers=layers), many_configs(n))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    return model


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()),
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("n", [64, 128])
@pytest.mark.parametrize("backend", BACKENDS)
def test_many_adapters_match_peft_through_the_store(n, backend):
    model = many_model(n)
    ref = copy.deepcopy(model)
    fast_multilora.patch(model, backend=backend)
    store = AdapterStore.of(model)
    assert len(store.slots) == len(model.__dict__["_fml_router"].fast_layers)  # every layer on the leaves
    names = sorted(model.peft_config)
    g = torch.Generator().manual_seed(n)
    rows = [names[i] for i in torch.randperm(n, generator=g)[:13].tolist()] + ["__base__", names[-1]]
    ids = torch.randint(0, 97, (len(rows), 6), generator=g)
    w = torch.randn(len(rows), 6, 97, generator=g)
    model.train()
    ref.train()
    model.zero_grad()
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb, adapter_names=rows).logits
    (out * w).sum().backward()
    want_out, want_dx, want = _peft_per_sample(ref, ids, w, rows)
    _close(out.detach(), want_out, "logits")
    _close(emb.grad, want_dx, "input grad")
    got = _grads(model)
    for name, gw in want.items():
        _close(got[name], gw, name)
    for name in set(got) - set(want):  # adapters with no row: zero gradients
        assert torch.count_nonzero(got[name]) == 0, name
    # the parameters are the arena: a write through one is seen by the other
    p = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A[names[0]].weight
    arena = next(iter(store.arenas.values()))
    assert p.untyped_storage().data_ptr() == arena.data.untyped_storage().data_ptr()


def _train(model, opt, batches):
    for ids, rows in batches:
        opt.zero_grad()
        out = model(input_ids=ids, adapter_names=rows).logits
        fast_multilora.per_adapter_loss(out, ids, rows).backward()
        opt.step()


def _trained(n, seed, steps=1):
    """A patched (torch backend) ``many_model(n)`` in training mode with its ``fast_multilora.AdamW`` (lr 1e-2),
    trained ``steps`` steps on all its adapters; returns ``(model, optimizer, adapter names)``."""
    model = many_model(n)
    fast_multilora.patch(model, backend="torch")
    opt = fast_multilora.AdamW(model, lr=1e-2)
    model.train()
    names = sorted(model.peft_config)
    _train(model, opt, _batches(names, steps=steps, seed=seed))
    return model, opt, names


def _mirror_grads(model, twin, rows):
    """``twin``'s gradients: ``model``'s for the LoRA weights of the adapters in ``rows``, ``None`` elsewhere (what
    ``torch.optim`` skips)."""
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        trained = "lora_" in n and any(f".{a}." in n for a in rows)
        q.grad = p.grad.clone() if trained and p.grad is not None else None


def adamw_against_torch(model, hyper, batches, device="cpu", schedule=None, **tol):
    """The optimizer alone: ``fast_multilora.AdamW`` on the patched ``model`` against ``torch.optim.AdamW`` (one group
    per adapter, ``hyper``) on a copy given the same gradients each step (``_mirror_grads``); weights compared after
    every step within ``tol``. ``schedule(optimizer)``: called on both before each step (an LR scheduler's work)."""
    twin = copy.deepcopy(model)
    ours = fast_multilora.AdamW(model, settings=hyper)
    groups = [{"params": [p for n, p in twin.named_parameters() if f".{a}." in n], **h} for a, h in hyper.items()]
    stock = torch.optim.AdamW(groups, foreach=False)
    model.train()
    for ids, rows in batches:
        if schedule is not None:
            schedule(ours)
            schedule(stock)
        ours.zero_grad()
        ids = ids.to(device)
        out = model(input_ids=ids, adapter_names=rows).logits
        fast_multilora.per_adapter_loss(out.float(), ids, rows).backward()
        _mirror_grads(model, twin, rows)
        ours.step()
        stock.step()
        _assert_same_weights(model, twin, **tol)


def _per_adapter_reference(ref, batches, hyper, frozen=()):
    """Stock PEFT, each adapter trained alone by its own ``torch.optim.AdamW`` on its rows of each batch; an adapter
    without rows in a batch is not stepped."""
    opts = {}
    for a, h in hyper.items():
        params = [p for n, p in ref.named_parameters() if f".{a}." in n and "lora_" in n]
        opts[a] = torch.optim.AdamW(params, foreach=False, **h)
    for ids, rows in batches:
        for a in hyper:
            mine = [i for i, r in enumerate(rows) if r == a]
            if not mine or a in frozen:
                continue
            ref.set_adapter(a)
            for n, p in ref.named_parameters():
                p.requires_grad_("lora_" in n and f".{a}." in n)
            opts[a].zero_grad()
            out = ref(input_ids=ids[mine]).logits
            fast_multilora.per_adapter_loss(out, ids[mine], [a] * len(mine)).backward()
            opts[a].step()


def _hyper(names):
    return {a: dict(lr=1e-2 * (1 + i % 3), betas=(0.9 - 0.1 * (i % 2), 0.99 + 0.005 * (i % 2)),
                    eps=1e-8 * (1 + i), weight_decay=0.1 * (i % 3)) for i, a in enumerate(names)}


def _batches(names, steps=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        rows = [names[i] for i in torch.randint(0, len(names), (5,), generator=g).tolist()]
        if s == 1:
            rows[0] = names[0]
        out.append((torch.randint(0, 97, (len(rows), 7), generator=g), rows))
    return out


def _assert_same_weights(model, ref, rtol=1e-5, atol=1e-6):
    want = {n: p for n, p in ref.named_parameters() if "lora_" in n}
    got = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n].detach(), want[n].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_equals_torch_adamw_per_adapter(backend):
    model = many_model(6)
    ref = copy.deepcopy(model)
    names = sorted(model.peft_config)
    frozen = names[4]
    for n, p in model.named_parameters():
        if f".{frozen}." in n:
            p.requires_grad_(False)
    fast_multilora.patch(model, backend=backend)
    hyper = _hyper(names)
    opt = fast_multilora.AdamW(model, settings={a: {k: v for k, v in h.items()} for a, h in hyper.items()})
    batches = _batches(names[:5], steps=4)  # names[5] is never in a batch: never stepped
    model.train()
    ref.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if f".{names[5]}." in n or f".{frozen}." in n}
    _train(model, opt, batches)
    _per_adapter_reference(ref, batches, hyper, frozen=(frozen,))
    # Adam moves an element by about lr per step whatever its gradient's size, so an element whose gradient is near
    # the rounding noise of per-sample vs mixed-batch sums moves by a different fraction of lr: the absolute
    # tolerance is 1e-3 of the largest possible move (lr 3e-2 x 4 steps); the optimizer alone is checked tightly
    # in test_adamw_step_equals_torch_on_the_same_gradients
    _assert_same_weights(model, ref, rtol=1e-4, atol=1.2e-4)
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p.detach(), before[n]), f"{n} moved"
    steps = {g["adapter"]: float(opt.steps[i]) for i, g in enumerate(opt.param_groups)}
    counts = {a: sum(a in rows for _, rows in batches) for a in names}
    assert steps == {a: float(counts[a]) if a != frozen else 0.0 for a in names}


@pytest.mark.parametrize("backend", BACKENDS)
def test_adamw_step_equals_torch_on_the_same_gradients(backend):
    """The optimizer alone: the same weights and gradients; ``torch.optim.AdamW`` with one group per adapter (those
    without rows in the batch get no gradient) against ours, over three steps."""
    model = many_model(7)
    fast_multilora.patch(model, backend=backend)
    names = sorted(model.peft_config)
    # fp32: the kernel's update rounds as torch's single-tensor AdamW up to the order of a few operations
    adamw_against_torch(model, _hyper(names), _batches(names[:6], steps=3, seed=5), rtol=1e-6, atol=1e-7)


@pytest.mark.interpreter
def test_torch_adamw_steps_a_few_adapters_of_many_over_their_chunks_only(monkeypatch):
    """The user's ``torch.optim.AdamW`` (stepped through the store) on 12 adapters, 2 in each batch, Triton backend:
    the step kernel's launch lists the chunks of the batch's adapters only (``kernels.adamw.adapter_chunks``; a step
    of 64 adapters of 1024 launched ~2.3M programs over the whole registry, 24 ms on an H100), and the run -- an
    adapter coming back after two steps away, a step after a delete (edited tables) included -- equals torch stepping
    every parameter itself."""
    from fast_multilora.kernels import adamw as K

    launched = []
    real = K.adamw_step_
    monkeypatch.setattr(K, "adamw_step_", lambda *a, chunks=None: launched.append(
        (chunks.tolist() if chunks is not None else None, a[4])) or real(*a, chunks=chunks))

    def run(store_optimizer):
        model = many_model(12, layers=1)
        fast_multilora.patch(model, backend="triton", store_optimizer=store_optimizer)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        names = sorted(model.peft_config)
        g = torch.Generator().manual_seed(3)
        for s, pick in enumerate(((0, 5), (7, 2), (5, 11), (3, 5))):
            if s == 3:  # a deleted adapter: the optimizer's chunk tables are edited, not rebuilt
                model.delete_adapter(names[2])
            rows = [names[pick[0]], names[pick[1]], names[pick[0]]]
            ids = torch.randint(0, 97, (3, 5), generator=g)
            fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=rows).logits, ids, rows).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model

    got, want = run(True), run(False)
    assert len(launched) == 4
    for chunks, table in launched:
        owners = table.adapter.cpu()[torch.tensor(chunks, dtype=torch.long)].unique()
        assert chunks is not None and len(owners) == 2 and len(chunks) < table.start.numel() // 3
    for (n, p), (_, q) in zip(got.named_parameters(), want.named_parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("penalized", ["lora_", ".m004.", "lora_A.m004"], ids=["every", "outside", "part"])
@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused"])
def test_a_penalty_on_the_weights_trains_adapters_outside_the_batch_as_torch_does(penalized, fused):
    """A term of the loss on the LoRA weights themselves (an L2 penalty; autograd accumulates it into the parameters,
    not through the layer calls) gives adapters without rows in the batch gradients that torch's AdamW steps: through
    the store the run equals the per-parameter path (no store) -- every adapter penalized, one adapter never in a
    batch, and only its ``lora_A`` (the store steps an adapter whole: a warning, then torch steps every parameter
    itself). Before, such gradients of an adapter without rows were dropped. The reference: torch stepping every
    parameter by its own ``.grad`` (``store_optimizer=False``; the per-parameter path would give adapters without rows
    zero gradients, which torch steps)."""
    import warnings

    def run(store):
        model = many_model(5)
        fast_multilora.patch(model, backend="torch", store_optimizer=store)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, fused=fused)
        names = sorted(model.peft_config)
        g = torch.Generator().manual_seed(4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for pick in ((0, 1), (2, 0), (3, 1)):  # m004 never in a batch
                rows = [names[pick[0]], names[pick[1]], names[pick[0]]]
                ids = torch.randint(0, 97, (3, 5), generator=g)
                loss = fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=rows).logits, ids, rows)
                loss = loss + 0.1 * sum(p.square().sum() for n, p in model.named_parameters() if penalized in n)
                loss.backward()
                opt.step()
                opt.zero_grad()
        return model, [str(w.message) for w in caught if "some but not all" in str(w.message)]

    (got, said), (want, _) = run(True), run(False)
    _assert_same_weights(got, want, rtol=1e-5, atol=1e-6)
    assert len(said) == (1 if penalized == "lora_A.m004" else 0), said
    if said:
        assert "m004" in said[0] and "torch.optim.AdamW steps every parameter itself" in said[0]
    # the penalized adapter outside the batches moved (torch stepped it), an adapter neither in a batch nor
    # penalized did not
    ref = many_model(5)
    moved = {n: not torch.equal(p, dict(ref.named_parameters())[n]) for n, p in got.named_parameters() if "lora_" in n}
    assert all(moved[n] for n in moved if penalized in n)


def _spy_zero_grad(monkeypatch, cls) -> tuple:
    """``cls.zero_grad`` counted: ``(calls, the real one)``."""
    calls = []
    real = cls.zero_grad
    monkeypatch.setattr(cls, "zero_grad", lambda self, set_to_none=True: calls.append(1) or real(self, set_to_none))
    return calls, real


def _steps_with_penalties(model, opt, zero, set_to_none, picks, seed, alone=None):
    """Steps of two adapters each (``picks``: indices into the sorted names), a penalty on ``m003`` (never in a
    batch) at the third; ``zero()`` after each step, then no ``.grad`` is left (``set_to_none=False``: none nonzero).
    ``alone``: before the second step, a backward of a penalty on those adapters only, dropped by ``zero()``."""
    names = sorted(model.peft_config)
    g = torch.Generator().manual_seed(seed)

    def check(s):
        left = [n for n, p in model.named_parameters() if p.grad is not None and
                (set_to_none or p.grad.count_nonzero())]
        assert not left, (s, left[:3])

    for s, pick in enumerate(picks):
        if s == 1 and alone:  # a backward of a penalty alone, its gradients dropped without a step
            sum(p.square().sum() for n, p in model.named_parameters() if alone in n).backward()
            zero()
            check("alone")
        rows = [names[pick[0]], names[pick[1]]]
        ids = torch.randint(0, 97, (2, 5), generator=g)
        loss = fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=rows).logits, ids, rows)
        if s == 2:  # a penalty on an adapter without rows: its gradients come through autograd
            loss = loss + sum(p.square().sum() for n, p in model.named_parameters() if ".m003." in n)
        loss.backward()
        opt.step()
        zero()
        check(s)


def test_torch_adamw_zero_grad_clears_every_gradient_without_reading_every_parameter(monkeypatch):
    """A bridged ``torch.optim.AdamW``'s ``zero_grad`` clears the gradients of the adapters the store attached and of
    those a penalty reached, not by reading every parameter's ``.grad`` (torch's own loop: ~50 ms per call at 1024
    adapters x 112 parameters): after each call every parameter's ``.grad`` is ``None`` (``set_to_none=False``:
    zero), torch's own ``zero_grad`` is not called after the first step, and the run equals torch's."""
    calls, _ = _spy_zero_grad(monkeypatch, torch.optim.Optimizer)

    def run(fast, set_to_none):
        from fast_multilora import optim as O

        model = many_model(8)
        fast_multilora.patch(model, backend="torch")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
        calls.clear()
        with monkeypatch.context() as m:
            if not fast:
                m.setattr(O._Bridge, "zero_grad", lambda *a: False)
            _steps_with_penalties(model, opt, lambda: opt.zero_grad(set_to_none=set_to_none), set_to_none,
                                  ((0, 5), (7, 2), (5, 1), (0, 5)), seed=5, alone=".m006.")
        return model, len(calls)

    for set_to_none in (True, False):
        (got, n_torch), (want, _) = run(True, set_to_none), run(False, set_to_none)
        assert n_torch == 0
        _assert_same_weights(got, want, rtol=1e-6, atol=1e-7)


def test_model_zero_grad_clears_every_gradient_without_walking_the_held_adapters(monkeypatch):
    """``model.zero_grad()`` (HF Trainer calls it each step) on a patched model clears the held adapters' gradients
    from the store's record (attached views, penalty gradients) and walks the rest of the model only: torch's walk
    visits every adapter's modules (at 1024 adapters x 56 layers, ~170k modules per call). After each call every
    ``.grad`` is ``None`` (``set_to_none=False``: zero), torch's ``Module.zero_grad`` is not called, and the run
    equals torch's. A layer the store does not hold (here: an embedding LoRA's) is walked as torch walks it."""
    calls, real = _spy_zero_grad(monkeypatch, torch.nn.Module)

    def run(fast, set_to_none):
        from fast_multilora import store as S

        model = many_model(6)
        model.add_adapter("m006", LoraConfig(r=2, target_modules=["embed_tokens"], init_lora_weights=False))
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
        fast_multilora.patch(model, backend="torch")
        model.train()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9,
                              weight_decay=0.01)
        calls.clear()

        def zero():
            try:
                model.zero_grad(set_to_none=set_to_none)
            except RuntimeError:
                real(model, set_to_none)

        with monkeypatch.context() as m:
            if not fast:
                # (the fast path raises: torch's runs instead)
                m.setattr(S.AdapterStore, "clear_held_grads", lambda *a: (_ for _ in ()).throw(RuntimeError))
            _steps_with_penalties(model, opt, zero, set_to_none, ((0, 5), (6, 2), (5, 1), (0, 6)), seed=6)
        return model, len(calls)

    for set_to_none in (True, False):
        (got, n_torch), (want, _) = run(True, set_to_none), run(False, set_to_none)
        assert n_torch == 0
        _assert_same_weights(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_adds_the_batch_gradients_into_the_arena_and_nothing_else(backend):
    """A stored layer call's backward adds its adapters' weight gradients into the gradient arena itself -- its
    leaves get no gradient (one of the registry's size per layer) -- so a second backward without ``zero_grad``
    doubles the batch's adapters' gradients and leaves every other adapter's piece as it was; a backward that does
    not fill ``.grad`` (``torch.autograd.grad``, ``backward(inputs=...)`` without the adapters) adds nothing."""
    model = many_model(6, layers=1)
    fast_multilora.patch(model, backend=backend)
    model.train()
    store = AdapterStore.of(model)
    names = sorted(model.peft_config)
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(0))
    rows = [names[0], names[2], names[2]]

    def loss():
        out = model(input_ids=ids, adapter_names=rows).logits
        return fast_multilora.per_adapter_loss(out, ids, rows)

    loss().backward()
    first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert first and all(n.split(".")[-2] in (names[0], names[2]) for n in first)
    arenas = {k: a.grad.clone() for k, a in store.arenas.items()}
    leaf_grads = []
    for s in store.slots.values():
        for leaf in (s.a_leaf, s.b_leaf):
            if leaf.requires_grad:
                leaf.register_hook(lambda g: leaf_grads.append(tuple(g.shape)) if g is not None else None)
    loss().backward()
    assert leaf_grads == []
    for n, p in model.named_parameters():
        if n in first:
            assert torch.equal(p.grad, 2 * first[n]), n
        elif "lora_" in n:
            assert p.grad is None, n
    for k, a in store.arenas.items():  # the others' pieces (and the free rows) as they were
        changed = a.grad != arenas[k]
        batch = torch.zeros_like(changed)
        for n, p in model.named_parameters():
            if n in first:
                batch.view(-1)[p.grad.storage_offset() - a.grad.storage_offset():][: p.numel()] = True
        assert not changed[~batch].any()
    emb = model.get_input_embeddings().weight
    emb.requires_grad_(True)
    arenas = {k: a.grad.clone() for k, a in store.arenas.items()}
    (g,) = torch.autograd.grad(loss(), emb)
    loss().backward(inputs=[emb])
    assert g.abs().sum() > 0 and leaf_grads == []
    assert all(torch.equal(a.grad, arenas[k]) for k, a in store.arenas.items())


@pytest.mark.parametrize("zero", ["optimizer", "model", "none"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_retained_graphs_second_backward_gives_gradients_as_peft(backend, zero):
    """``backward(retain_graph=True)``, a ``zero_grad`` (torch's optimizer's or the model's, to ``None``), a second
    backward through the same graph: each trained parameter holds that backward's gradient, as under stock PEFT
    (without the ``zero_grad``: the sum of both) -- the second backward starts with no adapter pending."""
    model = many_model(4)
    ref = copy.deepcopy(model)
    fast_multilora.patch(model, backend=backend)
    names = sorted(model.peft_config)
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(1))
    rows = [names[1], names[3], names[1]]
    got = {}
    for m, kw in ((model, {"adapter_names": rows}), (ref, {})):
        m.train()
        opt = torch.optim.AdamW([p for n, p in m.named_parameters() if "lora_" in n])
        if m is ref:  # stock PEFT: one graph of per-sample forwards, each row's adapter alone active
            outs = []
            for i, a in enumerate(rows):
                m.set_adapter(a)
                for n, p in m.named_parameters():
                    p.requires_grad_("lora_" in n)  # (set_adapter freezes the others)
                outs.append(m(input_ids=ids[i : i + 1]).logits)
            out = torch.cat(outs)
        else:
            out = m(input_ids=ids, **kw).logits
        loss = fast_multilora.per_adapter_loss(out, ids, rows)
        loss.backward(retain_graph=True)
        if zero == "optimizer":
            opt.zero_grad(set_to_none=True)
        elif zero == "model":
            m.zero_grad(set_to_none=True)
        loss.backward()
        got[m is ref] = {n: p.grad for n, p in m.named_parameters() if "lora_" in n and p.grad is not None}
    fast, peft = got[False], got[True]
    assert fast and {n for n in fast if n.split(".")[-2] in rows} == {n for n in peft if n.split(".")[-2] in rows}
    for n in fast:
        if n.split(".")[-2] in rows:
            _close(fast[n], peft[n], n)
        else:  # (stock PEFT's per-sample graph leaves the others none; the mixed batch at most zeros)
            assert torch.count_nonzero(fast[n]) == 0, n


@pytest.mark.parametrize("graph", ["freed", "kept"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_forward_without_its_backward_leaves_its_adapters_as_peft(backend, graph):
    """A gradient-recording forward with adapter ``a`` whose graph is not backwarded (freed: a metric computed with
    autograd on; kept: another graph's backward runs first), then a training step on adapter ``b``: ``a``'s
    parameters keep ``.grad is None`` and torch's AdamW leaves them as they were, as under stock PEFT (a zero
    gradient would move them: momentum, weight decay); a kept graph's later backward gives ``a`` its gradients."""
    model = many_model(4)
    ref = copy.deepcopy(model)
    fast_multilora.patch(model, backend=backend)
    a, b = sorted(model.peft_config)[1:3]
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    got = {}
    for m in (model, ref):
        m.train()
        lora = {n: p for n, p in m.named_parameters() if "lora_" in n}
        opt = torch.optim.AdamW(lora.values(), lr=1e-2, weight_decay=0.1)

        def loss_of(name, m=m, lora=lora):
            if m is ref:  # stock PEFT: the adapter alone active
                m.set_adapter(name)
                for p in lora.values():
                    p.requires_grad_(True)  # (set_adapter freezes the others)
                out = m(input_ids=ids).logits
            else:
                out = m(input_ids=ids, adapter_names=[name, name]).logits
            return fast_multilora.per_adapter_loss(out, ids, [name, name])

        loss_of(a).backward()  # a step on ``a`` first: AdamW holds its moments
        opt.step()
        opt.zero_grad()
        before = {n: p.detach().clone() for n, p in lora.items()}
        kept = loss_of(a)
        if graph == "freed":
            del kept
        loss_of(b).backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in lora.items()}
        opt.step()
        moved = {n for n, p in lora.items() if not torch.equal(p, before[n])}
        later = {}
        if graph == "kept":
            kept.backward()
            later = {n: p.grad.clone() for n, p in lora.items() if f".{a}." in n}
        got[m is ref] = grads, moved, later
    (fast, fast_moved, fast_later), (peft, peft_moved, peft_later) = got[False], got[True]
    assert {n for n, g in fast.items() if g is not None and f".{a}." in n} == set(), "a's gradients"
    assert {n for n, g in peft.items() if g is not None and f".{a}." in n} == set()
    for n, g in peft.items():
        if g is not None:
            _close(fast[n], g, n)
    assert fast_moved == peft_moved and not any(f".{a}." in n for n in fast_moved), fast_moved ^ peft_moved
    assert fast_later.keys() == peft_later.keys()
    for n in peft_later:
        _close(fast_later[n], peft_later[n], n)


@pytest.mark.parametrize("graph", ["freed", "kept"])
def test_fast_adamw_does_not_step_an_adapter_whose_forward_was_not_backwarded(graph):
    """``fast_multilora.AdamW`` steps the adapters seen since its ``zero_grad``: those of the calls whose backward
    started, not of a forward whose graph was freed unbackwarded or is still waiting for its backward; the kept
    graph's backward then makes it seen, and the next step moves it."""
    model = many_model(4)
    fast_multilora.patch(model, backend="torch")
    a, b = sorted(model.peft_config)[1:3]
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(3))
    model.train()
    opt = fast_multilora.AdamW(model, lr=1e-2, weight_decay=0.1)

    def loss_of(name):
        out = model(input_ids=ids, adapter_names=[name, name]).logits
        return fast_multilora.per_adapter_loss(out, ids, [name, name])

    def params_of(name):
        return {n: p.detach().clone() for n, p in model.named_parameters() if f".{name}." in n}

    loss_of(a).backward()  # a step on ``a`` first: its moments would move it on a zero gradient
    opt.step()
    opt.zero_grad()
    before_a, before_b = params_of(a), params_of(b)
    kept = loss_of(a)
    if graph == "freed":
        del kept
    loss_of(b).backward()
    opt.step()
    opt.zero_grad()
    assert all(torch.equal(p, before_a[n]) for n, p in params_of(a).items()), "a stepped"
    assert not any(torch.equal(p, before_b[n]) for n, p in params_of(b).items() if "lora_A" in n), "b not stepped"
    if graph == "kept":
        kept.backward()
        opt.step()
        assert not any(torch.equal(p, before_a[n]) for n, p in params_of(a).items() if "lora_A" in n), "a not stepped"


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_graph_waiting_for_its_backward_costs_the_other_backwards_one_start(backend):
    """While a forward's graph waits for its backward (kept, not run by the training backwards meanwhile), each of
    those backwards starts once (one ``prepare_grads`` over the views), not at every leaf; the waiting graph's own
    backward later starts it and gives its adapter the gradients."""
    model = many_model(4, layers=1)
    fast_multilora.patch(model, backend=backend)
    a, b = sorted(model.peft_config)[1:3]
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    model.train()
    opt = torch.optim.AdamW([p for n, p in model.named_parameters() if "lora_" in n], lr=1e-2)
    store = AdapterStore.of(model)
    starts = []
    real = store._backward_starts

    def counting(*args):
        starts.append(1)
        real(*args)

    store._backward_starts = counting

    def loss_of(name):
        out = model(input_ids=ids, adapter_names=[name, name]).logits
        return fast_multilora.per_adapter_loss(out, ids, [name, name])

    kept = loss_of(a)
    for _ in range(3):
        starts.clear()
        loss_of(b).backward()
        assert len(starts) == 1, len(starts)
        opt.step()
        opt.zero_grad()
    assert all(p.grad is None for n, p in model.named_parameters() if f".{a}." in n)
    starts.clear()
    kept.backward()
    assert len(starts) == 1, len(starts)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if f".{a}." in n and "lora_B" in n)


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_fast_adamw_steps_a_retained_graphs_second_backward_as_torch_on_peft(zero):
    """``backward(retain_graph=True)``, ``fast_multilora.AdamW``'s (or the model's) ``zero_grad``, a second backward
    through the same graph, a step: the adapter moves as torch's AdamW moves it on stock PEFT from the second
    backward's gradients (the zero_grad clears ``seen``; the retained graph's calls wait again and its backward marks
    them), the other adapters stay."""
    model = many_model(4)
    ref = copy.deepcopy(model)
    fast_multilora.patch(model, backend="torch")
    a = sorted(model.peft_config)[2]
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(5))
    ref.set_adapter(a)
    init = {n: p.detach().clone() for n, p in ref.named_parameters() if "lora_" in n}
    out = {}
    for m in (model, ref):
        m.train()
        lora = {n: p for n, p in m.named_parameters() if "lora_" in n}
        for p in lora.values():
            p.requires_grad_(True)
        if m is model:
            opt = fast_multilora.AdamW(m, lr=1e-2, weight_decay=0.1)
            logits = m(input_ids=ids, adapter_names=[a, a]).logits
        else:
            opt = torch.optim.AdamW(lora.values(), lr=1e-2, weight_decay=0.1)
            logits = m(input_ids=ids).logits
        loss = fast_multilora.per_adapter_loss(logits, ids, [a, a])
        loss.backward(retain_graph=True)
        (opt if zero == "optimizer" else m).zero_grad()
        loss.backward()
        opt.step()
        out[m is ref] = {n: p.detach().clone() for n, p in lora.items()}
    fast, peft = out[False], out[True]
    for n in peft:
        _close(fast[n], peft[n], n)
    moved = {n for n in peft if not torch.equal(fast[n], init[n])}
    assert moved == {n for n in peft if not torch.equal(peft[n], init[n])}
    assert moved and all(f".{a}." in n for n in moved), moved


def test_adamw_follows_changed_hyperparameters():
    """Group settings changed between steps (what an LR scheduler does; also betas, eps, weight decay of one group)
    reach the next step: the device copy of the hyperparameters is not reused once they differ."""
    model = many_model(4)
    fast_multilora.patch(model, backend="torch")  # (the cached device copy is the same for both backends' kernels)
    names = sorted(model.peft_config)
    calls = {}

    def schedule(opt):
        k = calls[id(opt)] = calls.get(id(opt), -1) + 1
        for i, g in enumerate(opt.param_groups):
            g["lr"] = 1e-2 * 0.5 ** k * (1 + i)
        if k == 2:
            opt.param_groups[1].update(betas=(0.5, 0.9), eps=1e-3, weight_decay=0.3)

    adamw_against_torch(model, _hyper(names), _batches(names, steps=4, seed=3), schedule=schedule, rtol=1e-6,
                        atol=1e-7)


def test_resume_is_bit_identical(tmp_path):
    names = [f"m{i:03d}" for i in range(5)]
    batches = _batches(names, steps=4, seed=1)

    def fresh():
        m = many_model(5)
        fast_multilora.patch(m, backend="torch")
        m.train()
        return m, fast_multilora.AdamW(m, lr=1e-2, weight_decay=0.05)

    m1, o1 = fresh()
    _train(m1, o1, batches)
    m2, o2 = fresh()
    _train(m2, o2, batches[:2])
    torch.save(o2.state_dict(), tmp_path / "optimizer.pt")  # as the Trainer saves it: the states are arena views
    saved = torch.load(tmp_path / "optimizer.pt")
    weights = {n: p.detach().clone() for n, p in m2.named_parameters() if "lora_" in n}
    m3, o3 = fresh()
    with torch.no_grad():
        for n, p in m3.named_parameters():
            if n in weights:
                p.copy_(weights[n])
    o3.load_state_dict(saved)
    _train(m3, o3, batches[2:])
    for (n, a), (_, b) in zip(m1.named_parameters(), m3.named_parameters(), strict=True):
        assert torch.equal(a, b), n


def test_adapters_join_and_leave_while_training():
    model = many_model(4)
    ref = copy.deepcopy(model)
    names = sorted(model.peft_config)
    fast_multilora.patch(model, backend="torch")
    opt = fast_multilora.AdamW(model, lr=1e-2)
    model.train()
    ref.train()
    first = _batches(names, steps=2, seed=2)
    _train(model, opt, first)
    store = opt.store
    size = sum(a.data.numel() for a in store.arenas.values())
    cfg = LoraConfig(r=5, lora_alpha=7, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(9)
    model.add_adapter("late", cfg)
    torch.manual_seed(9)
    ref.add_adapter("late", cfg)
    for n, p in model.named_parameters():  # PEFT adds an adapter frozen unless it is active
        if ".late." in n:
            p.requires_grad_(True)
    later = _batches(names + ["late"], steps=3, seed=3)
    _train(model, opt, later)
    grown = sum(a.data.numel() for a in store.arenas.values())
    assert grown > size
    hyper = {a: dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2) for a in names + ["late"]}
    _per_adapter_reference(ref, first + later, hyper)
    _assert_same_weights(model, ref)
    model.delete_adapter(names[0])
    _train(model, opt, _batches(names[1:] + ["late"], steps=1, seed=4))
    assert all(g["adapter"] != names[0] for g in opt.param_groups)
    held = {id(p) for a in store.arenas.values() for _, _, p in a.blocks.values()}
    assert len(held) == sum(1 for n, p in model.named_parameters() if "lora_" in n)  # its pieces were let go
    store.layout(full=True)  # a compaction: its rows (holes now) are gone
    assert sum(a.data.numel() for a in opt.store.arenas.values()) < grown
    _train(model, opt, _batches(names[1:] + ["late"], steps=1, seed=5))


def test_save_pretrained_files_match_stock(tmp_path):
    from helpers import assert_same_saved_adapters
    from peft import PeftModel

    model = many_model(3)
    stock = copy.deepcopy(model)
    fast_multilora.patch(model, backend="torch")
    opt = fast_multilora.AdamW(model, lr=1e-2)
    model.train()
    _train(model, opt, _batches(sorted(model.peft_config), steps=1))
    with torch.no_grad():  # the stock copy holds the trained values
        for p, q in zip(model.parameters(), stock.parameters(), strict=True):
            q.copy_(p)
    model.save_pretrained(tmp_path / "ours")
    stock.save_pretrained(tmp_path / "stock")
    assert_same_saved_adapters(str(tmp_path / "ours"), str(tmp_path / "stock"), model.peft_config)
    loaded = PeftModel.from_pretrained(tiny_llama(0), tmp_path / "ours" / "m001", adapter_name="m001")
    want = {n: p for n, p in model.named_parameters() if ".m001." in n}
    for n, p in loaded.named_parameters():
        if n in want:
            assert torch.equal(p, want[n]), n


@pytest.mark.parametrize("per_adapter", [False, True])
def test_clip_grad_norm(per_adapter):
    from fast_multilora.data import adapter_param_groups, clip_grad_norm_per_adapter

    model = many_model(4)
    fast_multilora.patch(model, backend="torch")
    opt = fast_multilora.AdamW(model, lr=1e-2)
    ref = copy.deepcopy(model)
    fast_multilora.unpatch(ref)
    model.train()
    names = sorted(model.peft_config)
    ids, rows = _batches(names, steps=1)[0]
    for m in (model, ref):
        out = m(input_ids=ids, adapter_names=rows) if m is model else None
        if m is ref:
            fast_multilora.patch(ref, backend="torch")
            out = ref(input_ids=ids, adapter_names=rows)
        fast_multilora.per_adapter_loss(out.logits, ids, rows).backward()
    got = opt.clip_grad_norm(0.05, per_adapter=per_adapter)
    if per_adapter:
        want = clip_grad_norm_per_adapter(adapter_param_groups(ref), 0.05)
        for i, g in enumerate(opt.param_groups):
            if g["adapter"] in want:
                assert float(got[i]) == pytest.approx(want[g["adapter"]], rel=1e-5)
    else:
        want = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.grad is not None], 0.05)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=lambda m, n=n: f"{n}: {m}")


class _ReducesEverything:
    """Stands in for a ``DistributedDataParallel`` whose reducer holds every parameter of ``model``."""

    require_backward_grad_sync = True

    def __init__(self, model):
        self._module_parameters = list(model.parameters())


@pytest.mark.filterwarnings("ignore:fast_multilora. DistributedDataParallel reduces every parameter")
def test_parameter_path_gradients_fold_into_the_store(monkeypatch):
    """Under the forward of a DDP that reduces every parameter itself (simulated: ``_active_ddp_module`` set) the held
    layers take the per-parameter path; with the parameters' ``.grad`` dropped first (a wrapper's own ``zero_grad``),
    autograd puts the gradients outside the arena and the step folds them in: the result equals the leaves' path."""
    names = [f"m{i:03d}" for i in range(4)]
    batches = _batches(names, steps=2, seed=7)
    runs = []
    for ddp in (False, True):
        model = many_model(4)
        fast_multilora.patch(model, backend="torch")
        opt = fast_multilora.AdamW(model, lr=1e-2)
        model.train()
        for ids, rows in batches:
            opt.zero_grad()
            if ddp:
                for p in model.parameters():
                    p.grad = None
                monkeypatch.setattr(torch.nn.parallel.DistributedDataParallel, "_active_ddp_module",
                                    _ReducesEverything(model))
            out = model(input_ids=ids, adapter_names=rows).logits
            monkeypatch.undo()
            fast_multilora.per_adapter_loss(out, ids, rows).backward()
            # the per-parameter path leaves its gradients outside the arena, the leaves' path in it
            outside = [p.grad is not v for p, v in zip(opt.store.held, opt.store.views, strict=True)]
            assert all(outside) if ddp else not any(outside)
            opt.step()
        runs.append(model)
    _assert_same_weights(runs[1], runs[0], rtol=1e-6, atol=1e-7)


def test_gradient_accumulation_and_stock_optimizers_on_the_store():
    """Two backward passes before one step sum into the arena (the parameters' ``.grad`` views show the sum), and a
    stock ``torch.optim`` optimizer stepping the parameters of a model with a store updates the arena (the
    parameters' memory) exactly as without a store."""
    names = [f"m{i:03d}" for i in range(3)]
    (ids1, rows1), (ids2, rows2) = _batches(names, steps=2, seed=8)
    models = []
    for with_store in (False, True):
        model = many_model(3)
        fast_multilora.patch(model, backend="torch", adapter_store=False)
        if with_store:
            AdapterStore.of(model)
        model.train()
        sgd = torch.optim.SGD([p for n, p in model.named_parameters() if "lora_" in n], lr=0.5, momentum=0.9)
        for _ in range(2):
            sgd.zero_grad(set_to_none=False)  # in place: the store's views stay
            for ids, rows in ((ids1, rows1), (ids2, rows2)):
                out = model(input_ids=ids, adapter_names=rows).logits
                fast_multilora.per_adapter_loss(out, ids, rows).backward()
            sgd.step()
        models.append(model)
    _assert_same_weights(models[1], models[0], rtol=1e-6, atol=1e-7)
    for (n, p), (_, q) in zip(models[1].named_parameters(), models[0].named_parameters(), strict=True):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8, msg=lambda m, n=n: f"{n}: {m}")


def test_a_saved_adapter_loads_into_the_store(tmp_path):
    """``save_pretrained`` one adapter, ``delete_adapter`` it, ``load_adapter`` it back on the patched training model:
    the store holds it again with its saved weights, and it trains (a new param group)."""
    model, opt, names = _trained(3, seed=9)
    saved = {n: p.detach().clone() for n, p in model.named_parameters() if ".m002." in n}
    model.save_pretrained(tmp_path, selected_adapters=["m002"])
    model.delete_adapter("m002")
    _train(model, opt, _batches(names[:2], steps=1, seed=10))
    assert all(g["adapter"] != "m002" for g in opt.param_groups)
    model.load_adapter(tmp_path / "m002", adapter_name="m002", is_trainable=True)
    for n, p in model.named_parameters():
        if ".m002." in n:
            assert torch.equal(p.detach(), saved[n]), n
    _train(model, opt, _batches(names, steps=2, seed=11))
    held = {id(p) for a in opt.store.arenas.values() for _, _, p in a.blocks.values()}
    loaded = [p for n, p in model.named_parameters() if ".m002." in n]
    assert loaded and all(id(p) in held for p in loaded)
    assert any(not torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters() if ".m002." in n)
    assert any(g["adapter"] == "m002" for g in opt.param_groups)


def test_parameters_outside_the_store_step_as_torch():
    """A ``lora_bias`` adapter's layers stay outside the store (per-parameter path): ``fast_multilora.AdamW`` steps
    them with torch's AdamW math and the stored ones with its kernel; both equal ``torch.optim.AdamW`` on the same
    gradients, and the clip's norm counts both."""
    torch.manual_seed(5)
    common = dict(init_lora_weights=False)
    model = with_adapters(tiny_llama(0), {  # lora_bias cannot share a layer with adapters without it
        "x0": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **common),
        "biased": LoraConfig(r=2, lora_alpha=4, target_modules=["o_proj"], lora_bias=True, **common),
        "x1": LoraConfig(r=3, lora_alpha=3, target_modules=["gate_proj", "q_proj"], **common)})
    fast_multilora.patch(model, backend="torch")
    twin = copy.deepcopy(model)
    ours = fast_multilora.AdamW(model, lr=1e-2, weight_decay=0.1)
    held = {id(p) for a in ours.store.arenas.values() for _, _, p in a.blocks.values()}
    outside = [n for n, p in model.named_parameters() if ".biased." in n and id(p) not in held]
    assert outside and len(ours.store.slots) < len(model.__dict__["_fml_router"].fast_layers)
    names = sorted(model.peft_config)
    groups = [{"params": [p for n, p in twin.named_parameters() if f".{a}." in n]} for a in names]
    stock = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, foreach=False)
    model.train()
    for ids, rows in _batches(names, steps=2, seed=12):
        ours.zero_grad()
        out = model(input_ids=ids, adapter_names=rows).logits
        fast_multilora.per_adapter_loss(out, ids, rows).backward()
        _mirror_grads(model, twin, rows)
        got = ours.clip_grad_norm(1e9)
        want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(q.grad) for q in twin.parameters()
                                                     if q.grad is not None]))
        assert float(got) == pytest.approx(float(want), rel=1e-5)
        ours.step()
        stock.step()
        _assert_same_weights(model, twin, rtol=1e-6, atol=1e-7)


class _Shard(torch.Tensor):
    """Stands in for FSDP2's DTensor parameters: a tensor subclass replacing a held parameter."""


def test_a_parameter_replaced_by_a_shard_leaves_the_store_with_a_warning():
    model, opt, names = _trained(3, seed=21, steps=0)
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    before = len(opt.store.slots)
    w = layer.lora_A[names[0]].weight
    layer.lora_A[names[0]].weight = torch.nn.Parameter(w.detach().clone().as_subclass(_Shard))
    with pytest.warns(UserWarning, match="leave the store"):
        _train(model, opt, _batches(names, steps=1, seed=13))
    assert len(opt.store.slots) == before - 1 and id(layer) not in opt.store.slots
    assert layer.lora_A[names[0]].weight.grad is not None  # stepped outside the store, as torch's AdamW


def test_a_new_optimizer_starts_from_zero_moments():
    """A second ``fast_multilora.AdamW`` on the same model takes the store's states over, from zero (equal to a fresh
    model's first steps with the same weights); the first one then refuses to step."""
    model, first, names = _trained(3, seed=14, steps=2)
    twin = copy.deepcopy(model)  # the trained weights, no optimizer
    fast_multilora.unpatch(twin)
    fast_multilora.patch(twin, backend="torch")
    second = fast_multilora.AdamW(model, lr=1e-2)
    fresh = fast_multilora.AdamW(twin, lr=1e-2)
    later = _batches(names, steps=2, seed=15)
    _train(model, second, later)
    _train(twin, fresh, later)
    _assert_same_weights(model, twin, rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="newer fast_multilora.AdamW"):
        first.step()


def _torch_save_load(model):
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch_save"])
def test_a_copy_has_its_own_store(how):
    """A copy of a model with a store (``copy.deepcopy``, ``pickle``, ``torch.save`` / ``torch.load`` of the whole
    model): the copy gives the same outputs, trains with its own optimizer (its store laid out afresh: a loaded
    arena cannot grow in place) and leaves the original untouched (its ``zero_grad`` and store are the copy's)."""
    model, opt, names = _trained(3, seed=16)
    copy_ = {"deepcopy": copy.deepcopy, "pickle": lambda m: pickle.loads(pickle.dumps(m)),
             "torch_save": _torch_save_load}[how](model)
    ids, rows = _batches(names, steps=1, seed=17)[0]
    with torch.no_grad():
        torch.testing.assert_close(copy_(input_ids=ids, adapter_names=rows).logits,
                                   model(input_ids=ids, adapter_names=rows).logits, rtol=0, atol=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    _train(copy_, fast_multilora.AdamW(copy_, lr=1e-2), _batches(names, steps=2, seed=18))
    copy_.zero_grad()
    for n, p in model.named_parameters():
        if n in before:
            assert torch.equal(p.detach(), before[n]), n
    assert any(not torch.equal(p.detach(), before[n]) for n, p in copy_.named_parameters() if n in before)


def test_a_layer_leaving_the_store_keeps_its_optimizer_states():
    """A layer whose parameters stay the same objects but which the store can no longer hold (one adapter's weights
    cast to another dtype: one layer, two dtypes) leaves the store at the next forward: its parameters keep their
    AdamW moments and step counts as their own tensors (not views of the arenas, not the group's shared step
    counter), and training goes on."""
    model, opt, names = _trained(2, seed=19, steps=2)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    p = layer.lora_A["m000"].weight
    moments, step = opt.state[p]["exp_avg"].clone(), float(opt.state[p]["step"])
    assert id(layer) in opt.store.slots and opt.state[p]["exp_avg"]._base is not None
    layer.lora_A["m001"].to(torch.float64)  # an adapter's submodule edited directly: announced by mark_changed
    fast_multilora.mark_changed()
    _train(model, opt, _batches(names, steps=1, seed=20))
    assert id(layer) not in opt.store.slots
    st = opt.state[p]
    assert st["exp_avg"]._base is None and st["step"]._base is None
    assert float(st["step"]) == step + 1 and not torch.equal(st["exp_avg"], moments)  # stepped on from its moments


@pytest.mark.parametrize("swap", [True, False], ids=["class", "no_class"])
@pytest.mark.parametrize("how", ["requires_grad_", "assignment", "set_requires_grad"])
def test_freezing_and_unfreezing_while_training_is_seen(how, swap, monkeypatch):
    """A held parameter's ``requires_grad`` changed between steps (``p.requires_grad_``, ``p.requires_grad = ...``,
    PEFT's ``set_requires_grad``) takes effect at the next forward, though the store reads the flags only after such
    a change (``store._HeldParameter``), or at every training forward where the class is not swapped (a torch
    without ``_foreach_supported_types``): frozen, the adapter's weights stay bit-identical and it has no ``.grad``
    while the others train; unfrozen, it gets gradients and trains again."""
    from fast_multilora import store

    monkeypatch.setattr(store, "SWAP_CLASS", swap)
    model, opt, names = _trained(3, seed=23, steps=1)
    assert all((type(p) is store._HeldParameter) == swap for n, p in model.named_parameters() if "lora_" in n)
    frozen = names[1]
    params = [p for n, p in model.named_parameters() if f".{frozen}." in n]
    others = [p for n, p in model.named_parameters() if "lora_" in n and f".{frozen}." not in n]
    g = torch.Generator().manual_seed(24)
    batches = [(torch.randint(0, 97, (5, 7), generator=g), [names[i % 3] for i in range(5)]) for _ in range(3)]

    def set_flag(flag):
        if how == "requires_grad_":
            for p in params:
                p.requires_grad_(flag)
        elif how == "assignment":
            for p in params:
                p.requires_grad = flag
        else:
            model.set_requires_grad([frozen], requires_grad=flag)

    set_flag(False)
    before = [p.detach().clone() for p in params]
    moved = [p.detach().clone() for p in others]
    _train(model, opt, batches[:2])
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)), "a frozen adapter moved"
    assert all(p.grad is None for p in params)
    assert all(p.grad is not None for p in others)
    assert all(not torch.equal(p, b) for p, b in zip(others, moved, strict=True))
    set_flag(True)
    _train(model, opt, batches[2:])
    assert all(p.grad is not None for p in params)
    assert all(not torch.equal(p, b) for p, b in zip(params, before, strict=True)), "an unfrozen adapter did not train"


def test_held_parameters_are_parameters_and_unpatch_gives_their_class_back():
    """While held, PEFT's parameters are ``torch.nn.Parameter`` instances of the store's subclass (names, identity
    and ``state_dict`` unchanged); ``unpatch`` gives every one its ``Parameter`` class back."""
    model, opt, _ = _trained(2, seed=29, steps=1)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert all(isinstance(p, torch.nn.Parameter) and type(p) is not torch.nn.Parameter for p in lora.values())
    assert all(type(t) is torch.Tensor for t in model.state_dict().values())
    fast_multilora.unpatch(model)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert {n: p for n, p in model.named_parameters() if "lora_" in n} == lora


@pytest.mark.interpreter
def test_a_layer_call_does_the_same_work_at_any_adapter_count(monkeypatch):
    """Issue 18's premise, counted: one patched layer call (forward + backward, packed rows, every adapter with
    tokens, the store's leaves) makes the same kernel launches, the same torch ops and the same autograd inputs at
    8 and 64 adapters -- only tensor sizes grow. Launches are counted, not run (the interpreter would take minutes)."""
    from collections import Counter

    import fast_multilora.kernels.backward as KB
    import fast_multilora.kernels.chunks as KC
    import fast_multilora.kernels.forward as KF
    from torch.utils._python_dispatch import TorchDispatchMode

    launches = Counter()
    for m in (KF, KB, KC):
        monkeypatch.setattr(m, "launch", lambda fn, grid, args, meta: launches.update([fn.__name__]))

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func)] += 1
            return func(*args, **(kwargs or {}))

    def work(n):
        model = with_adapters(tiny_llama(0), {f"a{i:02d}": LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                                       target_modules=["q_proj"])
                                              for i in range(n)})  # one target: 64 adapters build in seconds
        fast_multilora.patch(model, backend="triton")
        fast_multilora.AdamW(model, lr=1e-3)  # the store: the layers take its two leaves per call
        model.train()
        rows, T = 4, 32
        ids = (torch.arange(rows * T).reshape(rows, T) * 7) % n  # every adapter has tokens
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
        x = torch.randn(rows, T, layer.in_features, requires_grad=True)
        inputs = Counter()
        apply = fast_multilora.function.LoraLinear.apply

        def counting_apply(*args):
            inputs.update(["tensor" if torch.is_tensor(a) else type(a).__name__ for a in args])
            return apply(*args)

        with fast_multilora.route(model, sorted(model.peft_config), ids):
            layer(x).sum().backward()  # first call: the layer's tables, kernel keys
            launches.clear()
            monkeypatch.setattr(fast_multilora.function.LoraLinear, "apply", counting_apply)
            with Ops() as ops:
                layer(x).sum().backward()
            monkeypatch.setattr(fast_multilora.function.LoraLinear, "apply", apply)
        return dict(launches), dict(ops.ops), dict(inputs)

    few, many = work(8), work(64)
    assert few[0] and few[1], "nothing counted"
    assert few == many


@pytest.mark.interpreter
@pytest.mark.parametrize("T", [5, 10], ids=["decode", "segmented"])
def test_eval_on_the_store_replays_and_matches_peft(T):
    """Eval (autograd off, Triton) on the store's leaves: calls of few rows (7 x 5 tokens) take the one-launch
    kernel (``kernels.decode``), larger ones (7 x 10) the segmented kernels; both record a launch plan and replay
    it bit for bit, and give stock PEFT's logits per sample. One decoder layer: a second one of the same shapes
    repeats every launch and plan."""
    from fast_multilora.kernels.decode import DECODE_MAX_ROWS
    from test_paths import _eval, _eval_peft, _fast_states

    model = many_model(12, layers=1)
    ref = copy.deepcopy(model)
    fast_multilora.patch(model, backend="triton")
    fast_multilora.AdamW(model, lr=1e-3)  # the store: the layers take its two leaves per call
    model.eval()
    ref.eval()
    names = sorted(model.peft_config)
    rows = names[:5] + ["__base__", names[9]]
    ids = torch.randint(0, 97, (len(rows), T), generator=torch.Generator().manual_seed(T))
    first = _eval(model, ids, adapter_names=rows)
    kinds = {k[-2:] for s in _fast_states(model) for k in s.plans}
    assert kinds == {("stored", ids.numel() <= DECODE_MAX_ROWS)}, kinds
    assert torch.equal(first, _eval(model, ids, adapter_names=rows))
    want = torch.cat([_eval_peft(ref, ids[i : i + 1], n) for i, n in enumerate(rows)])
    _close(first, want, "logits")


def _laid_out(n: int, store: bool, seed: int):
    """``many_model(n)`` patched on the torch backend (``adapter_store=store``), in eval mode, after one forward naming
    every adapter (the store laid out): ``(model, names, ids)``."""
    model = many_model(n)
    fast_multilora.patch(model, backend="torch", adapter_store=store)
    model.eval()
    names = sorted(model.peft_config)
    ids = torch.randint(0, 97, (n, 5), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, adapter_names=names)
    return model, names, ids


@pytest.mark.parametrize("data", ["replaced", "assigned_parameter"])
def test_a_moved_parameter_of_an_adapter_outside_the_batch_is_read_when_it_returns(data):
    """A forward checks the addresses of the adapters it names only: an absent adapter whose parameter's ``.data``
    was replaced (or whose weight became a new ``Parameter``, with ``mark_changed``) goes unnoticed while absent --
    the kernels read none of its rows -- and is re-laid out, its new values read, by the first forward that names it.
    Oracle: the same model and edit on the per-parameter path."""
    def run(store):
        model, names, ids = _laid_out(3, store, seed=31)
        layer = next(m for m in model.modules() if names[2] in getattr(m, "lora_B", {}))
        w = layer.lora_B[names[2]].weight
        new = torch.randn(w.shape, generator=torch.Generator().manual_seed(32))
        if data == "replaced":
            w.data = new
        else:  # a new Parameter object: announced, as docs/usage.md asks
            layer.lora_B[names[2]].weight = torch.nn.Parameter(new)
            fast_multilora.mark_changed()
        before = model(input_ids=ids[:2], adapter_names=names[:2]).logits  # the moved adapter absent
        return before, model(input_ids=ids, adapter_names=names).logits

    got, want = run(True), run(False)
    for g, w, what in zip(got, want, ("absent", "back"), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")


def test_every_moved_adapter_of_a_forward_is_read_again():
    """Several adapters' parameters given new ``.data`` at once (as a framework's set-up may do after the store was
    built), then one forward naming them all: each of them is read again and its parameters are arena views again
    (the check stopped at the first moved adapter: the others kept storage the layer op no longer read, and an
    optimizer's updates of them were lost -- in an order that followed the names' hash order). Oracle: the same edit
    on the per-parameter path."""
    def run(store):
        model, names, ids = _laid_out(4, store, seed=41)
        g = torch.Generator().manual_seed(42)
        for n, p in model.named_parameters():
            if "lora_" in n and any(f".{a}." in n for a in names[:3]):
                p.data = p.data + 0.1 * torch.randn(p.shape, generator=g)
        out = model(input_ids=ids, adapter_names=names).logits
        if store:
            held = model.__dict__[fast_multilora.patching._ROUTER_ATTR].store
            arenas = {a.data.untyped_storage().data_ptr() for a in held.arenas.values()}
            assert all(p.untyped_storage().data_ptr() in arenas for p in held.held), "a held parameter left the arena"
        return out

    torch.testing.assert_close(run(True), run(False), rtol=1e-5, atol=1e-6)


CHURN = [  # between steps: (adapters added: name -> (rank, targets)), (adapters deleted)
    ({"m010a": (4, ["q_proj", "v_proj"]), "m000a": (3, LLAMA_TARGETS), "zz0": (2, ["o_proj", "k_proj"])}, ()),
    ({f"m03{i}c": (4, ["q_proj", "gate_proj"]) for i in range(10)}, ()),  # more than the layers' spare rows
    ({}, ("m010a", "m005", "m032c")),
    # m005's and m032c's rows reused (both trained: they hold moments)
    ({"m010a": (5, ["q_proj", "down_proj"]), "m020b": (1, ["q_proj", "v_proj"]), "m033d": (4, ["q_proj"])}, ()),
    ({}, ("zz0",)),
]


@pytest.mark.parametrize("optimizer", ["fast", "torch"])
def test_churn_while_training_leaves_the_others_untouched(optimizer):
    """64 adapters training while adapters are added (``fast_multilora.add_adapters``; names sorting among and after
    the others; ranks equal to a deleted one's, so its rows are reused) and deleted (PEFT's ``delete_adapter`` or
    ``fast_multilora.delete_adapters``; a churned one and one of the 64) between steps: the adapters that stay
    follow exactly the trajectory of a run without the churn -- weights, gradients (``None`` where the run without
    churn has none) and optimizer states (the store's AdamW arena states, or ``torch.optim.AdamW``'s per-parameter
    states), bit for bit. The churned adapters' rows in a batch are base rows in the run without churn (same shapes:
    same arithmetic for the other rows)."""
    runs = {}
    for churn in (False, True):
        model = many_model(64, layers=1)
        fast_multilora.patch(model, backend="torch")
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        opt = (fast_multilora.AdamW(model, lr=1e-2) if optimizer == "fast"
               else torch.optim.AdamW(lora, lr=1e-2))
        model.train()
        stay = sorted(model.peft_config)
        extra: list = []
        g = torch.Generator().manual_seed(40)
        for step in range(len(CHURN) + 1):
            pool = stay + extra
            rows = [pool[i] for i in torch.randint(0, len(pool), (6,), generator=g).tolist()]
            if step <= 2:
                rows[:2] = ["m005", "m032c" if step == 2 else rows[1]]
            ids = torch.randint(0, 97, (6, 7), generator=g)
            if not churn:
                rows = [r if r in model.peft_config else "__base__" for r in rows]
            _train(model, opt, [(ids, rows)])
            if step == len(CHURN):
                break
            added, deleted = CHURN[step]
            if churn and deleted:  # fast_multilora's delete with its AdamW, PEFT's with torch's
                if optimizer == "fast":
                    fast_multilora.delete_adapters(model, list(deleted))
                else:
                    for name in deleted:
                        model.delete_adapter(name)
            for name in deleted:
                extra = [e for e in extra if e != name]
                stay = [s for s in stay if s != name]
            if added and churn:
                torch.manual_seed(step)
                fast_multilora.add_adapters(model, {n: LoraConfig(r=r, lora_alpha=2 * r, target_modules=t,
                                                                  init_lora_weights=False)
                                                    for n, (r, t) in added.items()})
                new = [p for n, p in model.named_parameters() if any(f".{a}." in n for a in added)]
                for p in new:
                    p.requires_grad_(True)
                if optimizer == "torch":
                    opt.add_param_group({"params": new})
                else:  # laid out now (a forward without gradients): the new ones start from zero moments, no grad
                    with torch.no_grad():
                        model(input_ids=ids[:1], adapter_names=[next(iter(added))])
                    for p in new:
                        assert p.grad is None and not opt.state[p]["exp_avg"].any()
                        assert not opt.state[p]["exp_avg_sq"].any() and float(opt.state[p]["step"]) == 0
            extra += list(added)
        runs[churn] = (model, opt, stay)
    (calm, calm_opt, stay), (churned, churned_opt, _) = runs[False], runs[True]
    churn_names = {"m010a", "m000a", "m020b", "m033d"} | {f"m03{i}c" for i in range(10) if i != 2}
    assert set(churned.peft_config) - set(stay) == churn_names
    assert "m005" not in churned.peft_config
    want = {n: p for n, p in calm.named_parameters() if "lora_" in n and n.split(".")[-2] in stay}
    got = {n: p for n, p in churned.named_parameters() if n in want}
    assert got.keys() == want.keys()
    for n, w in want.items():
        p = got[n]
        assert torch.equal(p.detach(), w.detach()), n
        assert (p.grad is None) == (w.grad is None), n
        if w.grad is not None:
            assert torch.equal(p.grad, w.grad), n
        a, b = churned_opt.state[p], calm_opt.state[w]
        assert a.keys() == b.keys(), n
        for k in b:
            assert torch.equal(a[k], b[k]), (n, k)
    if optimizer == "fast":
        assert all(g["adapter"] not in ("m005", "zz0") for g in churned_opt.param_groups)
        held = {id(p) for a in churned_opt.store.arenas.values() for _, _, p in a.blocks.values()}
        assert held == {id(p) for n, p in churned.named_parameters() if "lora_" in n}


def _store_work(n, change):
    """The pieces (``store._piece_at`` calls: every piece) and elements copied by the store (``copy_`` and
    ``torch._foreach_copy_``) when ``change`` runs on a patched, training ``many_model(n)`` and the next training step
    re-lays the store out."""
    import fast_multilora.store as store_mod

    model, opt, names = _trained(n, seed=21)
    counts = {"pieces": 0, "copied": 0}
    piece_at, copy_, foreach_copy_ = store_mod._piece_at, torch.Tensor.copy_, torch._foreach_copy_

    def counting_piece(*args):
        counts["pieces"] += 1
        return piece_at(*args)

    def counting_copy(self, src, *args, **kwargs):
        counts["copied"] += self.numel()
        return copy_(self, src, *args, **kwargs)

    def counting_foreach_copy(dsts, srcs, *args, **kwargs):
        counts["copied"] += sum(d.numel() for d in dsts)
        return foreach_copy_(dsts, srcs, *args, **kwargs)

    change(model)
    store_mod._piece_at = counting_piece
    torch.Tensor.copy_ = counting_copy
    torch._foreach_copy_ = counting_foreach_copy
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 3, dtype=torch.long), adapter_names=[names[0]])
    finally:
        store_mod._piece_at = piece_at
        torch.Tensor.copy_ = copy_
        torch._foreach_copy_ = foreach_copy_
    return counts


@pytest.mark.parametrize("what", ["add", "delete", "add_beside"])
def test_one_adapter_of_churn_costs_the_same_whatever_the_registry(what):
    """Adding one adapter to (or deleting one from) 64 or 128 adapters: the store writes the same pieces and copies
    the same elements for it (its own pieces, the changed layers' leaves) whatever the registry -- no re-layout of
    the others. Counted, not timed."""
    def change(model):
        if what == "delete":
            model.delete_adapter("m003")
        else:
            torch.manual_seed(0)
            name = "zz" if what == "add" else "m002b"  # after the others' names, or among them (slot order)
            fast_multilora.add_adapters(model, {name: LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                                 init_lora_weights=False)})

    small, large = _store_work(64, change), _store_work(128, change)
    assert small == large, (small, large)
    assert small["pieces"] <= 4 * 8 + 2 * 2 * 2, small  # leaves and views of the changed layers, its own pieces


def _host_work(n, change):
    """What the host reads when ``change`` runs on a patched, training ``many_model(n)`` and the next forward call
    follows it: adapter entries read into the layers' states (one ``lora_dropout_rate`` per layer and adapter), full
    state builds and signatures, the store's full key reads, and the pieces it writes."""
    import fast_multilora.patching as patching_mod
    import fast_multilora.store as store_mod

    model, opt, names = _trained(n, seed=21)
    counts = {"entries": 0, "full_states": 0, "signatures": 0, "store_keys": 0, "pieces": 0, "tables": 0,
              "store_tables": 0, "slot_reads": 0}
    real = {}

    class CountingSlots(dict):  # the routing's adapter -> slot map, its reads counted
        def __getitem__(self, name):
            counts["slot_reads"] += 1
            return dict.__getitem__(self, name)

    def counting(mod, attr, key):
        fn = real[(mod, attr)] = getattr(mod, attr)

        def wrapper(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        setattr(mod, attr, wrapper)

    change(model)  # (a change alone reads nothing: the next forward follows it)
    watched = ((patching_mod, "lora_dropout_rate", "entries"), (patching_mod, "_build_state", "full_states"),
               (patching_mod, "_state_signature", "signatures"), (store_mod, "_layer_key", "store_keys"),
               (store_mod, "_piece_at", "pieces"), (patching_mod, "_table", "tables"),
               (patching_mod, "_edited_table", "tables"), (store_mod, "_store_table", "store_tables"))
    for mod, attr, key in watched:
        counting(mod, attr, key)
    router = model.__dict__[patching_mod._ROUTER_ATTR]
    slot_of = router.slot_of
    router.slot_of = CountingSlots(slot_of)
    try:
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), adapter_names=[names[0]]).logits.sum().backward()
    finally:
        for (mod, attr), fn in real.items():
            setattr(mod, attr, fn)
        router.slot_of = dict(router.slot_of)
    _assert_states_and_store_tables_equal_fresh_ones(model)
    return counts


def _assert_states_and_store_tables_equal_fresh_ones(model):
    """Every store layer's table (derived by edits along the changes) equals the one a full build gives, and every
    layer state's tuples and table equal a fresh build's; layer states with equal adapters that a change edited share
    their per-adapter tuples (one edit's result, not one copy per layer)."""
    import fast_multilora.patching as patching_mod
    import fast_multilora.store as store_mod

    router = model.__dict__[patching_mod._ROUTER_ATTR]
    store = router.store
    for s in store.slots.values():
        fresh = store_mod._store_table(s.state, s.offsets, s.cap, {})
        assert (s.table.host, s.table.slots, s.table.total_rank, s.table.max_rank, s.table.experts) == \
            (fresh.host, fresh.slots, fresh.total_rank, fresh.max_rank, fresh.experts)
        for f in ("ranks", "offsets", "scales", "dropout"):
            assert torch.equal(getattr(s.table, f), getattr(fresh, f)), f
    by_present = {}
    for layer in router.fast_layers:
        st = layer.__dict__.get(patching_mod._STATE_ATTR)
        if st is None:
            continue
        fresh = patching_mod._build_state(layer, router.slot_names, {})
        for f in ("present", "ranks", "rates", "a_dtypes", "a_modules", "b_modules"):
            assert getattr(st, f) == getattr(fresh, f), f
        assert (st.table.host, st.table.slots, st.table.max_rank, st.table.total_rank, st.table.has_dropout) == \
            (fresh.table.host, fresh.table.slots, fresh.table.max_rank, fresh.table.total_rank,
             fresh.table.has_dropout)
        for f in ("ranks", "offsets", "scales", "dropout"):
            assert torch.equal(getattr(st.table, f), getattr(fresh.table, f)), f
        if st.delta is not None and st.present != st.delta[0].present:  # edited by the change
            by_present.setdefault(st.present, []).append(st)
    assert by_present
    for states in by_present.values():
        assert all(st.present is states[0].present and st.ranks is states[0].ranks for st in states)


def _assert_tables_equal_a_fresh_build(opt, where=None):
    """``fast_multilora.AdamW``'s chunk tables (edited along the changes) equal the ones a full build gives, field by
    field; the optimizer keeps the fresh ones."""
    edited = opt._tables
    opt._tables = {}
    opt._build_tables()
    for key, t in opt._tables.items():
        for f in t._fields:
            a, b = getattr(t, f), getattr(edited[key], f)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, (where, f)


def _add(name, targets):
    def change(model):
        torch.manual_seed(0)
        fast_multilora.add_adapters(model, {name: LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                             init_lora_weights=False)})
    return change


@pytest.mark.parametrize("what", ["add", "add_beside", "load", "peft_delete", "delete_adapters"])
def test_a_change_of_one_adapter_reads_that_adapter_only(what, tmp_path):
    """After one adapter is added (``add_adapters``: after the others' names or among them; ``load_adapters`` of a
    saved one, trainable) or deleted (PEFT's
    ``delete_adapter`` or ``fast_multilora.delete_adapters``), the next forward reads that adapter's entries in the
    layers it has (or had) and nothing of the others: no layer state is rebuilt from all its adapters, no layer's
    key is read whole, an edited table is built once for the layers that shared the old one and take the same
    edit, the store writes only the changed layers' pieces -- the same counts with 24 and 48 adapters
    registered. Counted, not timed."""
    def load(model):  # m001 (q and v) saved, loaded back as "zz"
        fast_multilora.save_adapters(model, tmp_path, names=["m001"])
        fast_multilora.load_adapters(model, {"zz": tmp_path / "m001"}, is_trainable=True)

    change = {"add": _add("zz", ["q_proj", "v_proj"]), "add_beside": _add("m002b", ["q_proj", "v_proj"]), "load": load,
              "peft_delete": lambda model: model.delete_adapter("m003"),
              "delete_adapters": lambda model: fast_multilora.delete_adapters(model, ["m003"])}[what]
    small, large = _host_work(24, change), _host_work(48, change)
    assert small == large, (small, large)
    assert small["full_states"] == small["signatures"] == small["store_keys"] == 0, small
    # the changed layers' store tables derived from their old ones by the edit (no full build), the others' kept
    assert small["store_tables"] == 0, small
    layers = 2 * 2  # 2 decoder layers x the adapter's 2 target modules (added: q, v; m003: k, down)
    added = what.startswith("add") or what == "load"
    assert small["entries"] == (layers if added else 0), small
    # per changed layer its two leaves and their gradients, and the added adapter's two weights (held -- copied into
    # -- and their gradient views)
    assert small["pieces"] == 4 * layers + (4 * layers if added else 0), small
    # layers that shared a table and take the same edit share the edited one, built once (the added adapter's four
    # layers share one table in many_model; m003's two k layers share one, its two down layers another); a layer
    # the change did not touch keeps its table
    assert small["tables"] == (1 if added else 2), small


@pytest.mark.parametrize("change", ["add", "delete", "reuse"])
def test_an_adapter_added_or_deleted_between_micro_batches_keeps_the_others_steps(change):
    """``fast_multilora.AdamW`` steps the adapters that had rows since ``zero_grad``: one added (a new slot), one
    deleted (a freed slot), or one deleted after its rows and another added into its slot (``reuse``) between two
    micro-batches of one step leaves the first micro-batch's other adapters stepped as without the change (bit for
    bit), and the new adapter, which had no rows, not stepped (no weight decay)."""
    def run(churn):
        model, opt, names = _trained(6, seed=3)
        g = torch.Generator().manual_seed(8)
        for rows in ([names[0], names[5]], [names[2], names[3]]):
            ids = torch.randint(0, 97, (2, 5), generator=g)
            out = model(input_ids=ids, adapter_names=rows)
            fast_multilora.per_adapter_loss(out.logits, ids, rows).backward()
            if churn and rows[0] == names[0]:
                if change != "add":
                    fast_multilora.delete_adapters(model, [names[5]])
                if change != "delete":
                    fast_multilora.add_adapters(model, {"zz": LoraConfig(r=2, target_modules=["q_proj"],
                                                                         init_lora_weights=False)})
                    for n, p in model.named_parameters():
                        if ".zz." in n:
                            p.requires_grad_(True)
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
        opt.step()
        return before, {n: p.detach().clone() for n, p in model.named_parameters() if n in before}

    (b0, calm), (b1, churned) = run(False), run(True)
    for n, w in calm.items():
        if ".m005." not in n:
            assert torch.equal(churned[n], w), n
    assert any(".m000." in n and not torch.equal(calm[n], b0[n]) for n in calm)  # the first micro-batch's stepped
    new = [n for n in churned if ".zz." in n]
    assert len(new) == (0 if change == "delete" else 4)
    for n in new:
        assert torch.equal(churned[n], b1[n]), n


@pytest.mark.interpreter
def test_holes_and_spare_rows_train_alike_on_both_backends():
    """After a delete (its rows a hole) and adds (into free rows, a region grown), the Triton kernels (interpreted
    on CPU) read every slot at the store's offsets, past holes and spare rows, as the torch backend does."""
    out = {}
    for backend in ("torch", "triton"):
        model = many_model(6, layers=1)
        fast_multilora.patch(model, backend=backend)
        opt = fast_multilora.AdamW(model, lr=1e-2)
        model.train()
        _train(model, opt, _batches(sorted(model.peft_config), steps=1, seed=1))
        model.delete_adapter("m002")
        torch.manual_seed(4)
        fast_multilora.add_adapters(model, {
            "m002b": LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
            "zz": LoraConfig(r=3, target_modules=["q_proj", "k_proj"], init_lora_weights=False)})
        for n, p in model.named_parameters():
            if ".m002b." in n or ".zz." in n:
                p.requires_grad_(True)
        _train(model, opt, _batches(sorted(model.peft_config), steps=2, seed=2))
        assert any(s.end > sum(s.ranks) for s in opt.store.slots.values())  # a hole is laid out
        assert any(s.cap > s.end for s in opt.store.slots.values())  # and spare rows
        out[backend] = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    for n, want in out["torch"].items():
        _close(out["triton"][n], want, n)


class _CountingList(list):
    """A list that counts its item reads (the store's ``_held`` / ``_views``: what a step reads of them)."""

    reads = 0

    def __getitem__(self, i):
        _CountingList.reads += 1
        return super().__getitem__(i)


def _per_step_reads(n):
    model = many_model(n)
    fast_multilora.patch(model, backend="torch")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = sorted(model.peft_config)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, 97, (4, 5), generator=g), [names[i % 3], names[3], names[(i + 1) % 3], names[3]])
               for i in range(4)]
    _train(model, opt, batches[:2])  # store built, flags read, hooks on
    store = fast_multilora.store.AdapterStore.of(model)
    store._held, store._views = _CountingList(store._held), _CountingList(store._views)
    _CountingList.reads = 0
    _train(model, opt, batches[2:])
    return _CountingList.reads, store


def test_a_steps_gradient_bookkeeping_reads_the_batchs_adapters_only():
    """The store's per-step gradient bookkeeping (``prepare_grads`` before each backward, the leaves' hooks) reads
    the parameters of the batch's adapters and of those whose views it left attached, not the registry: the same
    reads with 16 and 48 adapters registered (4 in each batch), and every trained adapter got its gradient."""
    small, _ = _per_step_reads(16)
    large, store = _per_step_reads(48)
    assert 0 < small == large, (small, large)
    assert store.attached and all(store._held[i].grad is store._views[i] for i in store.attached)


class _CountingState(collections.defaultdict):
    """An optimizer's ``state`` that counts its per-parameter entries read or written (a pass over every group's
    parameters shows as counts growing with the registry)."""

    reads = 0

    def __getitem__(self, p):
        _CountingState.reads += 1
        return super().__getitem__(p)

    def get(self, p, default=None):
        _CountingState.reads += 1
        return super().get(p, default)

    def pop(self, p, *default):
        _CountingState.reads += 1
        return super().pop(p, *default)


def _change_step_reads(n, what):
    """A trained ``many_model(n)`` with ``fast_multilora.AdamW``; then a change: one adapter added (trainable),
    deleted (the fourth of ``n``: the groups after it stay where they are), one deleted from the middle and one added,
    or one trained again after a step frozen (another adapter's flags changed); then what the next training step
    (forward, backward, optimizer step) reads of the store's per-parameter entries: held parameters' flags and
    ``.grad`` (store-wide passes), items of the store's per-parameter lists, the blocks cut into optimizer chunks, and
    the optimizer's per-parameter states."""
    import fast_multilora.kernels.adamw as adamw_mod

    import fast_multilora.store as store_mod

    model, opt, names = _trained(n, seed=5)
    store = opt.store
    rows = [names[0], names[1]]
    # a last step on the same adapters whatever n: the next zero_grad clears the pieces of the adapters trained
    # since the last one (the same set for both sizes)
    _train(model, opt, [(torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2)), rows)])
    if what in ("delete", "swap"):
        fast_multilora.delete_adapters(model, [names[3] if what == "delete" else names[n // 2]])
    if what in ("add", "swap"):
        torch.manual_seed(0)
        fast_multilora.add_adapters(model, {"zz": LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                             init_lora_weights=False)})
        for name, p in model.named_parameters():
            if ".zz." in name:
                p.requires_grad_(True)
        rows = [names[0], "zz"]
    if what == "refreeze":  # frozen for one step, then trained again: its chunks go back between the others'
        for trainable in (False, True):
            for name, p in model.named_parameters():
                if f".{names[5]}." in name:
                    p.requires_grad_(trainable)
            if not trainable:  # (a batch of the same adapters whatever n, as above)
                _train(model, opt, [(torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(6)),
                                     [names[5], names[1]])])
    counts = {"flags": 0, "grads": 0, "blocks": 0}
    real = (store_mod._REQUIRES_GRAD, store_mod._GRAD, adamw_mod.chunk_table)

    def flag(p):
        counts["flags"] += 1
        return real[0](p)

    def grad(p):
        counts["grads"] += 1
        return real[1](p)

    def table(blocks, *args, **kwargs):
        counts["blocks"] += len(blocks)
        return real[2](blocks, *args, **kwargs)

    store._held, store._views = _CountingList(store._held), _CountingList(store._views)
    opt.state = _CountingState(dict, opt.state)
    _CountingList.reads = _CountingState.reads = 0
    store_mod._REQUIRES_GRAD, store_mod._GRAD, adamw_mod.chunk_table = flag, grad, table
    try:
        ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
        out = model(input_ids=ids, adapter_names=rows)
        fast_multilora.per_adapter_loss(out.logits, ids, rows).backward()
        opt.step()
        opt.zero_grad()
    finally:
        store_mod._REQUIRES_GRAD, store_mod._GRAD, adamw_mod.chunk_table = real
    counts["items"] = _CountingList.reads
    counts["states"] = _CountingState.reads
    return counts, model, opt


def test_without_torchs_engine_query_the_leaves_take_whole_gradients(monkeypatch):
    """Without ``torch._C._will_engine_execute_node`` (private) a stored call's backward gives its leaves their whole
    gradients, which autograd adds into the arena: the same gradients as the in-place path."""
    grads = []
    for missing in (False, True):
        if missing:
            monkeypatch.delattr(torch._C, "_will_engine_execute_node")
        model = many_model(4)
        fast_multilora.patch(model, backend="torch")
        model.train()
        names = sorted(model.peft_config)
        store = AdapterStore.of(model)
        ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
        rows = [names[0], names[2]]
        fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=rows).logits, ids, rows).backward()
        leaf_grads = []
        for s in store.slots.values():
            for leaf in (s.a_leaf, s.b_leaf):
                if leaf.requires_grad:
                    leaf.register_hook(functools.partial(lambda seen, g: seen.append(g is not None), leaf_grads))
        fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=rows).logits, ids, rows).backward()
        assert any(leaf_grads) == missing
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-6, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_zero_grad_clears_the_pieces_gradients_reached(monkeypatch):
    """``fast_multilora.AdamW.zero_grad`` zeroes the pieces of the adapters that may hold a gradient since the last
    one -- those of the routed batches, one trained through stock PEFT's path (no ``adapter_names``: any piece may
    have one), one whose ``.grad`` a caller set -- rather than the whole arena: afterwards every piece is zero."""
    model = many_model(12)
    fast_multilora.patch(model, backend="torch")
    model.train()
    opt = fast_multilora.AdamW(model, lr=1e-2)
    store = opt.store
    names = sorted(model.peft_config)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    fills = []
    real = torch._foreach_zero_
    monkeypatch.setattr(torch, "_foreach_zero_", lambda ts: (fills.append(len(ts)), real(ts))[1])

    def all_zero():
        return all(not a.grad.any() for a in store.arenas.values())

    def routed(rows):
        out = model(input_ids=ids, adapter_names=rows).logits
        fast_multilora.per_adapter_loss(out, ids, rows).backward()

    routed([names[0], names[1]])
    opt.step()
    opt.zero_grad()  # the first: every arena (what came before is unknown)
    assert all_zero()
    routed([names[2], names[3]])
    assert not all_zero() and store.dirty == {names[2], names[3]}
    fills.clear()
    opt.zero_grad()
    assert all_zero() and fills and store.dirty == set()
    routed([names[4], names[4]])
    opt.zero_grad()  # (its views stay attached: stock PEFT's backward adds into them)
    model.set_adapter(names[4])  # stock PEFT's path
    model(input_ids=ids, labels=ids).loss.backward()
    assert not all_zero() and store.dirty is None
    opt.zero_grad()
    assert all_zero()
    for n, q in model.named_parameters():  # (set_adapter froze the others)
        if "lora_" in n:
            q.requires_grad_(True)
    p = next(q for n, q in model.named_parameters() if f".{names[5]}." in n)
    p.grad = torch.ones_like(p)  # a caller's gradient, copied into the piece when its adapter is next in a batch
    routed([names[5], names[0]])
    assert names[5] in store.dirty
    opt.zero_grad()
    assert all_zero()
    q = next(q for n, q in model.named_parameters() if f".{names[6]}." in n)
    q.grad = torch.ones_like(q)  # copied in by a pass over every parameter (as under DDP), no batch naming it
    store.prepare_grads(force=True)
    assert not all_zero() and store.dirty == {names[6]}
    opt.zero_grad()
    assert all_zero()


@pytest.mark.parametrize("what", ["add", "delete", "swap", "refreeze"])
def test_the_step_after_a_change_reads_the_changed_adapters_entries_only(what):
    """After one adapter is added (and made trainable), deleted, one deleted from the middle and one added, or one
    frozen for a step then trained again, the next training step reads the flags of the changed adapter's parameters
    only (no pass over every held flag or ``.grad``), the store's per-parameter entries of the batch's and the
    changed adapters, the optimizer states of the changed adapters' parameters only (the groups after a deleted one
    keep their step slots), and the optimizer cuts the changed adapter's blocks only (its tables are edited at the
    changed groups' slots, not rebuilt): the same counts with 24 and 48 adapters registered. The step's result is the
    full rebuild's: the edited tables equal freshly built ones."""
    small, _, _ = _change_step_reads(24, what)
    large, model, opt = _change_step_reads(48, what)
    assert small == large, (small, large)
    layers = 2 * 2  # 2 decoder layers x q, v
    assert small["flags"] == small["blocks"] == (0 if what == "delete" else 2 * layers), small
    assert small["items"] > 0 and (small["states"] > 0) == (what != "refreeze"), small  # (a flag lays nothing out)
    _assert_tables_equal_a_fresh_build(opt)
    store = opt.store
    for s in store.slots.values():  # the per-layer entries edited in place are those a fresh layout gives
        assert s.held_idx == [store.index_of[id(p)] for p in s.params]
        assert all(store._views[i] is v for i, v in zip(s.held_idx, s.views, strict=True))
        assert s.offsets == [s.by_name[n][2] for n in s.names]
        assert s.params == [s.by_name[n][3] for n in s.names] + [s.by_name[n][4] for n in s.names]


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_adapters_churning_keep_their_step_counts_slots_and_updates(dev):
    """Adapters deleted one at a time from the middle of the groups (until most step slots are free and the slots are
    renumbered) and others added, a step after each change: ``fast_multilora.AdamW`` (per-adapter settings) matches
    ``torch.optim.AdamW`` per adapter on the same gradients after every step; each group's step count is right and
    is its parameters' ``state["step"]``; the tables edited along the way equal freshly built ones. On CUDA the
    tables are edited on the device and the step is the Triton kernel's (fp32: equal to torch's within rounding)."""
    model = many_model(20).to(dev)
    fast_multilora.patch(model, backend="torch" if dev == "cpu" else "triton")
    names = sorted(model.peft_config)
    hyper = _hyper(names)
    twin = copy.deepcopy(model)
    ours = fast_multilora.AdamW(model, settings=hyper)
    stock = torch.optim.AdamW([{"params": [p for n, p in twin.named_parameters() if f".{a}." in n], **h}
                               for a, h in hyper.items()], foreach=False)
    model.train()
    present, counts, made = list(names), dict.fromkeys(names, 0), len(names)
    cfg = LoraConfig(r=3, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    for k in range(13):
        gone = present.pop(len(present) // 2)
        model.delete_adapter(gone)
        twin.delete_adapter(gone)
        if k % 4 == 1:
            new = f"new{k}"
            for m in (model, twin):
                torch.manual_seed(k)
                m.add_adapter(new, cfg)
                for n, p in m.named_parameters():
                    if f".{new}." in n:
                        p.requires_grad_(True)
            stock.add_param_group({"params": [p for n, p in twin.named_parameters() if f".{new}." in n],
                                   **ours.defaults})
            present.append(new)
            counts[new] = 0
            made += 1
        (ids, rows), = _batches(present[::2] + present[-1:], steps=1, seed=30 + k)
        ids = ids.to(dev)
        ours.zero_grad()
        fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=rows).logits, ids, rows).backward()
        _mirror_grads(model, twin, rows)
        ours.step()
        stock.step()
        _assert_same_weights(model, twin, rtol=1e-6, atol=1e-7)
        for a in set(rows):
            counts[a] += 1
        steps = ours.steps.tolist()
        assert {g["adapter"]: steps[i] for i, g in enumerate(ours.param_groups)} == \
            {a: float(counts[a]) for a in present}
        for i, g in enumerate(ours.param_groups):
            assert all(float(ours.state[p]["step"]) == steps[i] for p in g["params"] if p in ours.state)
            assert all(ours.state[p]["step"].data_ptr() == ours.state[g["params"][0]]["step"].data_ptr()
                       for p in g["params"])
        _assert_tables_equal_a_fresh_build(ours, k)
    assert ours._n_slots() < made  # the slots were renumbered (most were free)


def test_a_short_list_of_blocks_is_cut_as_the_vectorised_cut_does(monkeypatch):
    """``kernels.adamw.chunk_table`` cuts a short host list of blocks (the optimizer's table edits: the blocks of the
    adapters that changed) in plain Python: the same table, field by field, as its vectorised cut, over random block
    sets (empty blocks, blocks longer than a chunk, unaligned ones, adapters in any order) -- and the same errors."""
    from fast_multilora.kernels import adamw as adamw_mod

    g = torch.Generator().manual_seed(5)
    for case in range(40):
        n_blocks = int(torch.randint(0, 12, (1,), generator=g))
        chunk = [16, 64, 1024][case % 3]
        sizes = torch.randint(0, 200, (n_blocks,), generator=g).tolist()
        gaps = torch.randint(0, 40, (n_blocks,), generator=g).tolist()
        u = (1, 16, 4, 8)[case % 4]  # every start and length a multiple of u (the alignment hint)
        sizes, gaps = [-(-s // u) * u for s in sizes], [-(-x // u) * u for x in gaps]
        blocks, at = [], 0
        for size, gap in zip(sizes, gaps, strict=True):
            at += gap
            blocks.append((at, size, int(torch.randint(0, 7, (1,), generator=g))))
            at += size
        order = torch.randperm(len(blocks), generator=g).tolist()
        blocks = [blocks[i] for i in order]
        small = adamw_mod.chunk_table(blocks, 7, at + 5, "cpu", chunk=chunk)
        monkeypatch.setattr(adamw_mod, "SMALL_BLOCKS", -1)
        full = adamw_mod.chunk_table(blocks, 7, at + 5, "cpu", chunk=chunk)
        monkeypatch.undo()
        for f in full._fields:
            a, b = getattr(small, f), getattr(full, f)
            assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(b, torch.Tensor) else a == b, (case, f)
    for blocks, match in [([(0, 4, 0), (3, 2, 1)], "overlap"), ([(8, 4, 0)], "outside"), ([(0, 2, 7)], "outside"),
                          ([(-1, 2, 0)], "outside"), ([(0, -2, 0)], "outside")]:
        with pytest.raises(ValueError, match=match):
            adamw_mod.chunk_table(blocks, 7, 10, "cpu")


def test_slot_sync_edits_each_layers_adapters_in_place_as_a_full_read_finds_them():
    """``Router.sync_slots`` after adapters are deleted, re-added under the same name, added to some layers only:
    each layer's set of adapters (edited in place at the marked adapters) and the holder counts equal a full read,
    and the slots are the adapters the layers hold."""
    from fast_multilora.patching import _ROUTER_ATTR
    from fast_multilora.plan import _names_of

    model = many_model(6)
    fast_multilora.patch(model, backend="torch")
    router = model.__dict__[_ROUTER_ATTR]
    rng = random.Random(3)
    for k in range(12):
        names = sorted(model.peft_config)
        if k % 3 == 2 or len(names) < 3:
            name = f"r{k % 4}" if f"r{k % 4}" not in names else f"n{k}"  # (names deleted before come back)
            targets = rng.choice([["q_proj"], ["v_proj"], ["q_proj", "v_proj"]])
            model.add_adapter(name, LoraConfig(r=2, target_modules=targets))
        else:
            model.delete_adapter(rng.choice(names))
        router.sync_slots()
        held = {id(layer): _names_of(layer) for layer in router.layers}
        assert router._held_by == held, k
        counts = {}
        for s in held.values():
            for n in s:
                counts[n] = counts.get(n, 0) + 1
        assert router._holders == counts, k
        assert set(router.slot_of) == set(counts) == set(model.peft_config), k
