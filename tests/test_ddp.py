"""The adapter store under ``DistributedDataParallel`` (``fast_multilora/ddp.py``): DDP ignores the store's parameters
(but one anchor layer's), the layer calls take the store's leaves, and the store all-reduces its gradient arenas once
per synchronised backward.

One rank in this process (gloo over a file store): what DDP is handed, which layers take the leaves, the gradients
equal a plain backward, and a DDP built around the patched model warns and takes the per-parameter path. Two ranks
(torchrun, ``tests/ddp_worker.py``, slow): several ``torch.optim.AdamW`` steps with ``no_sync`` accumulation and
different adapter mixes per rank equal one process on the global batches and the per-parameter path under DDP.
Under ``torch.compile`` (``aot_eager``; the orders torch supports, one rank, and compiling the DDP module, two ranks):
one graph whose layer calls take the leaves, the same reduces and results as eager.
"""

import contextlib
import functools
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

import fast_multilora
from fast_multilora import patching
from fast_multilora.store import AdapterStore

sys.path.insert(0, str(Path(__file__).parent))
import ddp_worker  # noqa: E402
from models import lora_weights, peft_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def calls(monkeypatch):
    """How many layer calls took the store's leaves (``stored``) or PEFT's parameters (``params``)."""
    counts = {}
    real = patching.run_layer

    def run_layer(*args):
        counts[args[1][0]] = counts.get(args[1][0], 0) + 1
        return real(*args)

    monkeypatch.setattr(patching, "run_layer", run_layer)
    return counts


def _step(model, ids, labels, names):
    out = model(input_ids=ids, adapter_names=names)
    fast_multilora.per_adapter_loss(out.logits, labels, names).backward()


def _reference_and_model(checkpointing=None):
    """The first batch, a patched model after one step on it without DDP, and a fresh patched model with its store
    (``checkpointing``: its gradient checkpointing's ``use_reentrant``)."""
    ids, labels, names = ddp_worker.batches()[0]
    ref = peft_model("llama")
    fast_multilora.patch(ref, backend="torch")
    ref.train()
    _step(ref, ids, labels, names)
    model = peft_model("llama")
    if checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    fast_multilora.patch(model, backend="torch")
    return ids, labels, names, ref, model, AdapterStore.of(model)


def test_ddp_is_handed_the_store_parameters_but_an_anchor_layer(one_rank, calls, monkeypatch):
    """DDP's constructor reads the model's ``_ddp_params_and_buffers_to_ignore``: every held parameter but one layer's
    (nothing else trains); under DDP every other layer call takes the store's leaves, the gradients (reduced over one
    rank: unchanged) equal a backward without DDP, and the arenas are all-reduced once per backward outside
    ``no_sync`` only."""
    ids, labels, names, ref, model, store = _reference_and_model()
    held = {n for n, p in model.named_parameters() if any(p is q for q in store.held)}
    ignored = {n for n in model._ddp_params_and_buffers_to_ignore if not n.startswith("_orig_mod.")}
    anchor = next(iter(store.slots.values())).params
    assert ignored == held - {n for n, p in model.named_parameters() if any(p is q for q in anchor)}
    # each name also as DDP(torch.compile(model)) names it, through the compile wrapper
    assert set(model._ddp_params_and_buffers_to_ignore) == ignored | {"_orig_mod." + n for n in ignored}
    assert len(held) - len(ignored) == len(anchor) > 0
    ddp = DDP(model)
    reduced = {id(q) for q in ddp._module_parameters}
    assert not any(id(p) in reduced for p in store.held if all(p is not q for q in anchor))
    model.train()
    calls.clear()
    _step(ddp, ids, labels, names)
    assert calls == {"stored": len(store.slots) - 1, "params": 1}
    assert len(store.ddp.layers) == len(store.slots) - 1
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(grads)
    for n, g in grads.items():
        torch.testing.assert_close(got[n], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")
    # every trained parameter has a gradient after the reduce (an adapter without rows: zeros), as DDP gives one
    model.zero_grad()
    calls.clear()
    _step(ddp, ids[:2], labels[:2], ["a1", "__base__"])
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert all(float(p.grad.abs().sum()) == 0 for n, p in model.named_parameters() if ".a0." in n or ".a2." in n)
    # the arenas are all-reduced once per synchronised backward, not inside no_sync (gradient accumulation)
    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t), real(t, *a, **k))[1])
    arena_grads = [a.grad for a in store.arenas.values()]
    with ddp.no_sync():
        _step(ddp, ids, labels, names)
    assert reduced == []
    _step(ddp, ids, labels, names)
    assert [t for t in reduced if any(t is g for g in arena_grads)] == arena_grads
    fast_multilora.unpatch(model)
    assert "_ddp_params_and_buffers_to_ignore" not in model.__dict__


def test_ddp_around_the_patched_model_warns_and_takes_the_parameter_path(one_rank, calls):
    """A module around the patched model hides the names from DDP: it reduces every parameter itself, so every layer
    takes PEFT's parameters (its hooks sit on them), with a warning naming the fix; the gradients stay right."""
    ids, labels, names, ref, model, store = _reference_and_model()
    outer = DDP(torch.nn.ModuleDict({"inner": model}))
    model.train()
    calls.clear()
    with pytest.warns(UserWarning, match="wrap the patched model itself"), outer._inside_ddp_forward():
        _step(model, ids, labels, names)  # the inner model's forward, as the wrapper's would run it
    assert calls.get("stored", 0) == 0 and calls["params"] == len(store.slots)
    for n, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(dict(model.named_parameters())[n].grad, p.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpoint", "reentrant-checkpoint"])
def test_ddp_store_with_gradient_checkpointing(one_rank, calls, monkeypatch, reentrant):
    """Gradient checkpointing under DDP: the store's leaves get their gradients in the recomputation (reentrant: in a
    nested backward per decoder layer); the arenas are all-reduced once, after the last leaf's gradient arrived, and
    the gradients equal a backward without checkpointing or DDP."""
    ids, labels, names, ref, model, store = _reference_and_model(checkpointing=reentrant)
    ddp = DDP(model)
    model.train()
    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t), real(t, *a, **k))[1])
    calls.clear()
    _step(ddp, ids, labels, names)
    assert calls["stored"] >= len(store.slots) - 1
    arena_grads = [a.grad for a in store.arenas.values()]
    assert [t for t in reduced if any(t is g for g in arena_grads)] == arena_grads
    for n, p in ref.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(dict(model.named_parameters())[n].grad, p.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m, n=n: f"{n}: {m}")


def test_ddp_store_with_dora_adapters_absent_from_the_batch(one_rank):
    """DoRA under DDP: its magnitudes are not held by the store, so DDP reduces them (and no anchor layer is needed:
    every held layer takes the leaves); a DoRA adapter the batch does not name gets zero magnitude gradients (DDP's
    reducer needs one for every parameter it reduces, or the next forward raises), and two steps equal the
    per-parameter path."""
    from test_dora import build

    names = ["d0", "l1", "__base__", "d1", "d1", "l0", "d0", "l1"]  # d2 absent
    ids = torch.randint(0, 97, (len(names), 5), generator=torch.Generator().manual_seed(3))
    runs = []
    for store in (True, False):
        model, _ = build("llama")
        fast_multilora.patch(model, backend="torch", adapter_store=store)
        ddp = DDP(model)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model.train()
        for _ in range(2):
            _step(ddp, ids, ids, names)
            opt.step()
            opt.zero_grad()
        if store:
            held = AdapterStore.of(model).slots
            assert len(AdapterStore.of(model).ddp.layers) == len(held) > 0  # no anchor: the magnitudes train
        runs.append(lora_weights(model) | {n: p.detach().clone() for n, p in model.named_parameters()
                                           if "magnitude" in n})
    for n, w in runs[1].items():
        torch.testing.assert_close(runs[0][n], w, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_ddp_parameters_leaving_the_store_after_the_wrap_are_reduced_by_it(one_rank, monkeypatch):
    """A layer that leaves the store after DDP was built (its adapters now mix dtypes) keeps parameters DDP was told
    to ignore: the store all-reduces their gradients itself, once per backward."""
    ids, labels, names = ddp_worker.batches()[0]
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    store = AdapterStore.of(model)
    ddp = DDP(model)
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    layer.lora_A["a0"].to(torch.bfloat16)
    layer.lora_B["a0"].to(torch.bfloat16)
    fast_multilora.mark_changed()
    model.train()
    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t), real(t, *a, **k))[1])
    _step(ddp, ids, labels, names)
    left = [p for p in layer.parameters() if p.requires_grad]
    assert left and all(p.grad is not None for p in left)
    assert not any(any(p is q for q in store.held) for p in left)
    assert all(sum(t is p.grad for t in reduced) == 1 for p in left)


def _fully_shard(model, ignored):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh, ignored_params=ignored)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    return model


def test_fsdp2_with_the_store_parameters_ignored_takes_the_leaves(one_rank, calls, monkeypatch):
    """FSDP2 with ``ignored_params=fast_multilora.fsdp_ignored_params(model)`` (one rank): the base is sharded, every
    layer call takes the store's leaves, the store reduces its gradient arena once per backward (none under
    ``set_requires_gradient_sync(False)``), and the gradients equal a plain backward. (Two ranks:
    ``tests/integration/test_accelerate.py``.)"""
    from torch.distributed.tensor import DTensor

    ids, labels, names, ref, model, store = _reference_and_model()
    ignored = fast_multilora.fsdp_ignored_params(model)
    assert ignored and {id(p) for p in ignored} == {id(p) for p in store.held}
    _fully_shard(model, ignored)
    assert not any(isinstance(p, DTensor) for p in ignored)
    assert any(isinstance(p, DTensor) for p in model.parameters())
    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t), real(t, *a, **k))[1])
    model.train()
    store.zero_grad()  # (its adapters then known: the batch's)
    calls.clear()
    with warnings_as_errors():
        model.set_requires_gradient_sync(False)
        _step(model, ids, labels, names)
        assert calls == {"stored": calls["stored"]} and calls["stored"] > 0 and not reduced
        model.set_requires_gradient_sync(True)
        _step(model, ids, labels, names)
    grads = [a.grad for a in store.arenas.values()]
    assert sum(any(t is g for g in grads) for t in reduced) == len(grads) and store.ddp.orphans == ()
    assert store.dirty is None  # other ranks' adapters may have gradients now: the next zero_grad clears them all
    for n, p in ref.named_parameters():
        if p.grad is not None:
            got = dict(model.named_parameters())[n].grad
            torch.testing.assert_close(got, 2 * p.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}")


def test_fsdp2_reduces_trained_parameters_it_leaves_out_and_the_store_does_not_hold(one_rank, monkeypatch):
    """Adapters left out of FSDP2 by a name pattern (accelerate's ``ignored_modules``, here every ``lora_A`` /
    ``lora_B``), one of whose layers the store cannot hold (its adapters mix dtypes): FSDP2 reduces neither, so the
    store all-reduces that layer's gradients too, once per backward."""
    from accelerate.utils.fsdp_utils import get_parameters_from_modules

    ids, labels, names = ddp_worker.batches()[0]
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    layer = model.base_model.model.model.layers[1].self_attn.q_proj
    layer.lora_A["a0"].to(torch.bfloat16)
    layer.lora_B["a0"].to(torch.bfloat16)
    fast_multilora.mark_changed()
    store = AdapterStore.of(model)
    _fully_shard(model, get_parameters_from_modules(r".*\.lora_(A|B)", model, None))
    reduced = []
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t), real(t, *a, **k))[1])
    model.train()
    _step(model, ids, labels, names)
    left = [p for p in layer.parameters() if p.requires_grad]
    assert left and all(p.grad is not None for p in left)
    assert not any(any(p is q for q in store.held) for p in left)
    assert {id(p) for p in store.ddp.orphans} == {id(p) for p in left}
    assert all(sum(t is p.grad for t in reduced) == 1 for p in left)


def test_fsdp2_sharding_the_adapters_warns_with_the_fix(one_rank, calls):
    """``fully_shard`` without ``ignored_params``: the adapters are shards, which the store cannot hold; the layer calls
    take PEFT's (unsharded) parameters, FSDP2 reduces them, and a warning names ``fsdp_ignored_params``."""
    ids, labels, names, ref, model, store = _reference_and_model()
    _fully_shard(model, None)
    model.train()
    calls.clear()
    with pytest.warns(UserWarning, match="fsdp_ignored_params"):
        _step(model, ids, labels, names)
    assert calls.get("params", 0) > 0 and "stored" not in calls


def test_fsdp2_errors_name_the_way_out(one_rank):
    """``fsdp_ignored_params`` of an unpatched model, and paging under FSDP2: errors that say what to do."""
    with pytest.raises(ValueError, match=r"not patched; call fast_multilora.patch\(model\) before fully_shard"):
        fast_multilora.fsdp_ignored_params(peft_model("llama"))
    ids, labels, names = ddp_worker.batches()[0]
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch", resident_adapters=1)
    _fully_shard(model, fast_multilora.fsdp_ignored_params(model))
    model.train()
    with pytest.raises(ValueError, match="does not run under FSDP2"):
        _step(model, ids, labels, names)


@contextlib.contextmanager
def warnings_as_errors():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        yield


# torch.compile with DDP, the orders torch 2.13 supports: compiling the DDP module (accelerate's order, with a
# dynamo_backend: Dynamo compiles the module under DDP's forward, DDPOptimizer splits its graph at DDP's buckets),
# compiling the model in place before DDP (``model.compile()``, torch's "where to apply torch.compile" page), and DDP
# around torch.compile's wrapper (DDP reads the model's names through it, prefixed ``_orig_mod.``)
_COMPILE_ORDERS = {
    "compile(DDP(model))": lambda model: (lambda ddp: (ddp, torch.compile(ddp, backend="aot_eager")))(DDP(model)),
    "model.compile();DDP(model)": lambda model: (model.compile(backend="aot_eager"), (DDP(model),) * 2)[1],
    "DDP(compile(model))": lambda model: (DDP(torch.compile(model, backend="aot_eager")),) * 2,
}


def test_ddp_around_torch_compile_wrapper_is_handed_the_store_names(one_rank):
    """``DDP(torch.compile(model))``: DDP reads the model's names through the compile wrapper and names the
    parameters under it (``_orig_mod.``): it reduces the same parameters as ``DDP(model)``, all but the anchor
    layer's held ones (nothing compiles before the first call)."""
    runs = []
    for wrap in (lambda m: m, lambda m: torch.compile(m, backend="aot_eager")):
        model = peft_model("llama")
        fast_multilora.patch(model, backend="torch")
        store = AdapterStore.of(model)
        names = {id(p): n for n, p in model.named_parameters()}
        runs.append(sorted(names[id(p)] for p in DDP(wrap(model))._module_parameters if p.requires_grad))
        anchor = next(iter(store.slots.values())).params
        assert runs[-1] == sorted(names[id(p)] for p in anchor)
    assert runs[0] == runs[1]


def _train_under_ddp(order, monkeypatch):
    """3 ``torch.optim.AdamW`` steps of the patched model under DDP (``order``: how it is compiled, or ``"eager"``;
    ``"plain"``: no DDP) over ``ddp_worker.batches()``: steps 0 and 1 accumulate a micro-batch under ``no_sync`` and a
    synchronised one, step 2 backpropagates the sum of two forwards' losses (every adapter has rows in each step).
    Returns the gradients of step 0, the weights after the last step, per backward which store leaves and which held
    parameters got a gradient from autograd, which tensors were all-reduced and whether every ``.grad`` of a held
    parameter is a view of the gradient arena, and the layer calls run outside any compiled graph."""
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    store = AdapterStore.of(model)
    if order == "plain":
        ddp = types.SimpleNamespace(no_sync=contextlib.nullcontext)
        fwd = model
    else:
        ddp, fwd = (DDP(model),) * 2 if order == "eager" else _COMPILE_ORDERS[order](model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    eager_calls = {}
    real_run = patching.run_layer

    def run_layer(*args):  # a call Dynamo traces is in the graph, not counted (no side effect for it to replay)
        if not torch.compiler.is_compiling():
            eager_calls[args[1][0]] = eager_calls.get(args[1][0], 0) + 1
        return real_run(*args)

    monkeypatch.setattr(patching, "run_layer", run_layer)
    reduced = []
    real_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (reduced.append(t), real_reduce(t, *a, **k))[1])
    got = set()  # ids of the tensors autograd handed a gradient (the engine runs these hooks, compiled or not)
    for t in [leaf for s in store.slots.values() for leaf in (s.a_leaf, s.b_leaf)] + store.held:
        if t.requires_grad:
            t.register_hook(functools.partial(lambda i, g: got.add(i), id(t)))
    leaves = {id(leaf): lid for lid, s in store.slots.items() for leaf in (s.a_leaf, s.b_leaf)}
    held = {id(p): p for p in store.held}
    backwards, first = [], None

    def backward(loss):
        got.clear()
        reduced.clear()
        loss.backward()
        arenas = [a.grad for a in store.arenas.values()]
        ptrs = {g.untyped_storage().data_ptr() for g in arenas}
        backwards.append({"leaf_layers": sorted(leaves[i] for i in got if i in leaves),
                          "params": {i for i in got if i in held},
                          "arena_reduces": [sum(t is g for t in reduced) for g in arenas],
                          "views": all(p.grad is None or p.grad.untyped_storage().data_ptr() in ptrs
                                       for p in store.held)})

    def loss_of(ids, labels, names):
        out = fwd(input_ids=ids, adapter_names=names)
        return fast_multilora.per_adapter_loss(out.logits, labels, names) / ddp_worker.MICRO

    model.train()
    data = ddp_worker.batches()
    for step in range(ddp_worker.STEPS):
        micro = data[step * ddp_worker.MICRO:(step + 1) * ddp_worker.MICRO]
        if step < 2:
            with ddp.no_sync():
                backward(loss_of(*micro[0]))
            backward(loss_of(*micro[1]))
        else:  # two forwards, one backward
            backward(loss_of(*micro[0]) + loss_of(*micro[1]))
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"grads": first, "weights": lora_weights(model), "backwards": backwards, "eager_calls": eager_calls,
            "layers": sorted(store.ddp.layers), "held_layers": len(store.slots),
            "anchor": {id(p) for p in next(iter(store.slots.values())).params}}


@pytest.mark.parametrize("order", [pytest.param(o, marks=() if i == 0 else pytest.mark.slow, id=o)
                                   for i, o in enumerate(_COMPILE_ORDERS)])
def test_ddp_store_under_torch_compile(one_rank, fresh_dynamo, monkeypatch, order):
    """The store under DDP and ``torch.compile`` (``aot_eager``), 3 ``torch.optim.AdamW`` steps with
    ``per_adapter_loss`` over mixed adapter names, ``no_sync`` accumulation and a two-forward step: one graph for every
    mix and both sync modes (no recompilation; the only graph breaks are in DDP's own forward, where torch breaks on
    purpose so that Dynamo compiles the module under it; the model's routing pre-hook runs before the compiled frame
    and counts none); no layer call runs outside the graph; in every backward the same tensors get gradients from
    autograd as in the eager DDP run -- both store leaves of every layer but the anchor's, the anchor's parameters, no
    other held parameter --; each gradient arena is all-reduced once per synchronised backward and never under
    ``no_sync``, and every held parameter's ``.grad`` is a view of it; the first step's gradients and the weights
    after the last equal a run without DDP (one rank: DDP's average is the gradient), as the eager DDP run's do.

    Tolerances: gradients fp32-tight (rtol 1e-5, atol 1e-6 x the largest; measured 2.7e-7 x): the graph runs the same
    ops, AOTAutograd's decompositions round in their own order. Weights atol 1e-4 = lr / 100 (measured 2.4e-7):
    AdamW's update m / (sqrt(v) + eps) carries an element's gradient rounding into the update without the gradient's
    scale where the gradient is small (1.2e-5 in a 4-step variant of this run), while a wrong gradient moves an
    element by up to lr per step."""
    plain = _train_under_ddp("plain", monkeypatch)
    want = _train_under_ddp("eager", monkeypatch)
    torch._dynamo.reset()
    counters.clear()
    got = _train_under_ddp(order, monkeypatch)
    breaks = sum(counters["graph_break"].values())
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert breaks <= (3 if order == "compile(DDP(model))" else 0), dict(counters["graph_break"])
    assert want["eager_calls"] == {"stored": 6 * (len(want["layers"])), "params": 6}
    assert got["eager_calls"] == {}  # every layer call ran inside the compiled graph
    assert len(got["layers"]) == len(want["layers"]) == got["held_layers"] - 1  # all but the anchor layer
    for run in (want, got):
        assert len(run["backwards"]) == 5
        for b, synced in zip(run["backwards"], (False, True, False, True, True), strict=True):
            assert b["leaf_layers"] == sorted(run["layers"] * 2)  # both leaves of every layer but the anchor's
            assert b["params"] == run["anchor"]
            assert b["arena_reduces"] == [int(synced)] * len(b["arena_reduces"])
            assert b["views"]  # the all-reduced arena is what the parameters' .grad show
    for run, what in ((want, "eager DDP"), (got, order)):
        assert set(run["grads"]) == set(plain["grads"])
        for n, g in plain["grads"].items():
            torch.testing.assert_close(run["grads"][n], g, rtol=1e-5, atol=1e-6 * g.abs().max().item(),
                                       msg=lambda m, n=n, what=what: f"{what}: {n}: {m}")
        for n, w in plain["weights"].items():
            torch.testing.assert_close(run["weights"][n], w, rtol=0, atol=1e-4,
                                       msg=lambda m, n=n, what=what: f"{what}: {n}: {m}")


def _reference(kind):
    """One process on the global batches: the same steps without DDP."""
    model = peft_model("llama", seed=0)
    fast_multilora.patch(model, backend="torch")
    opt = ddp_worker.optimizer(model, kind)
    model.train()
    first = None
    data = ddp_worker.batches()
    for step in range(ddp_worker.STEPS):
        for m in range(ddp_worker.MICRO):
            ids, labels, names = data[step * ddp_worker.MICRO + m]
            out = model(input_ids=ids, adapter_names=names)
            (fast_multilora.per_adapter_loss(out.logits, labels, names) / ddp_worker.MICRO).backward()
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return lora_weights(model), first


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ddp_two_ranks_match_one_process_and_the_parameter_path(tmp_path, compiled):
    """2 gloo ranks, ``torch.optim.AdamW`` (and ``fast_multilora.AdamW`` on the store), 3 steps of 2 micro-batches
    (the first under ``no_sync``), different adapter mixes per rank (one lacks an adapter for a whole step, one has
    base rows only in a micro-batch), rank-dependent initial adapter weights: the store's run equals one process on
    the global batches (gradients of the first step, weights after the last) and the per-parameter path under DDP;
    both ranks end with the same weights, every trained parameter has a gradient on every rank, and all layer calls
    but the anchor layer's take the leaves. ``compiled``: the store's run with ``torch.optim.AdamW`` under
    ``torch.compile(ddp, backend="aot_eager")``: one graph, no layer call outside it, the same one-process result."""
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1")
    out = tmp_path / "ddp.pt"
    # --standalone: the rendezvous store binds a free port itself (a port picked here and released could be taken by
    # a concurrent run's ranks in between, which then join the wrong job)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(ROOT / "tests" / "ddp_worker.py"), str(out)]
                         + (["compile"] if compiled else []),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-5000:]
    ranks = [torch.load(f"{out}.{r}") for r in range(2)]
    refs = {kind: _reference(kind) for kind in (("torch",) if compiled else ("torch", "fast"))}
    forwards = ddp_worker.STEPS * ddp_worker.MICRO
    for got in ranks:
        assert got["world"] == 2
        store = got["store"]
        runs = [(store, refs["torch"])]
        assert store["ddp_layers"] == store["held_layers"] - 1  # all but the anchor layer
        assert store["none"] == []
        if compiled:
            assert store["counts"] == {}  # every layer call ran inside the compiled graph
            assert store["graphs"] == 1
        else:
            params, fast = got["params"], got["fast"]
            assert store["counts"] == {"stored": forwards * (store["held_layers"] - 1), "params": forwards}
            assert params["none"] == [] == fast["none"]
            runs += [(params, refs["torch"]), (fast, refs["fast"])]
            for n, w in params["weights"].items():
                # the two paths sum the same gradients in another order; Adam's g / (sqrt(v) + eps) amplifies that
                # rounding where a gradient is near zero (seen: 2.4e-7 after 3 steps of lr 1e-2, torch 2.13 CPU);
                # a missing or doubled update differs by ~1e-2
                torch.testing.assert_close(store["weights"][n], w, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, n=n: f"{n}: {m}")
        for run, (weights, first) in runs:
            assert set(run["grads"]) == set(first)
            for n, g in first.items():
                torch.testing.assert_close(run["grads"][n], g, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
            assert set(run["weights"]) == set(weights)
            for n, w in weights.items():
                torch.testing.assert_close(run["weights"][n], w, rtol=1e-4, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")
    for kind in ("store",) if compiled else ("store", "fast"):
        for n, w in ranks[0][kind]["weights"].items():
            assert torch.equal(ranks[1][kind]["weights"][n], w), (kind, n)


def test_ddp_store_errors_name_the_way_out(one_rank):
    """Under DDP the store all-reduces at the end of a backward: a second backward through the same forward, and a
    forward after a backward that left one of the forward's leaves without its gradient, raise saying why and what
    to do; paging does not run under DDP."""
    ids, labels, names = ddp_worker.batches()[0]
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    ddp = DDP(model)
    model.train()
    out = ddp(input_ids=ids, adapter_names=names)
    loss = fast_multilora.per_adapter_loss(out.logits, labels, names)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="this backward continued after that"):
        loss.backward()
    # a forward whose LoRA output does not reach the loss (one layer's leaves get no gradient)
    model.zero_grad()
    out = ddp(input_ids=ids, adapter_names=names, output_hidden_states=True)
    out.hidden_states[1].sum().backward()  # the first decoder layer's output only: later layers' leaves get nothing
    with pytest.raises(RuntimeError, match="a backward ended before every adapter-store leaf"):
        ddp(input_ids=ids, adapter_names=names)
    fast_multilora.unpatch(model)

    paged = peft_model("llama")
    fast_multilora.patch(paged, backend="torch", resident_adapters=1)
    ddp = DDP(paged)
    paged.train()
    with pytest.raises(ValueError, match="does not run under DistributedDataParallel"):
        ddp(input_ids=ids, adapter_names=names)
