"""Paging (``PatchConfig.resident_adapters``, ``fast_multilora.paging``): adapters outside the batch live on the host.

The oracle is the same run with paging off: after steps whose batches name changing adapters (some return after
being paged out), every adapter's weights and ``torch.optim.AdamW`` states are bitwise equal. On the CPU "host" and
"device" are one memory, but every page-out and page-in still copies through separate buffers, and the host copies
are filled with NaN after each page-in (``paging._POISON``), so a value read from a stale copy shows.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from test_store import _spy_zero_grad, many_model

import fast_multilora
from fast_multilora import paging
from fast_multilora.patching import _ROUTER_ATTR, _STATE_ATTR

N_ADAPTERS = 12


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setattr(paging, "_POISON", True)


def _pager(model):
    return model.__dict__[_ROUTER_ATTR].pager


def _schedule(names, steps, seed=0):
    """Batches of 2-4 adapters (plus base rows), a new mix every step; adapters of early steps come back later."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        n = 2 + s % 3
        pick = [names[i] for i in torch.randperm(len(names), generator=g)[:n].tolist()]
        if s >= 3:
            pick[0] = out[s - 3][1][0]  # an adapter of three steps ago, paged out since when the capacity is small
        rows = pick + [pick[-1], fast_multilora.BASE]
        out.append((torch.randint(0, 97, (len(rows), 6), generator=g), rows))
    return out


def _model(device, k, backend="torch", **settings):
    # (a paged model's torch.optim steps every parameter itself; the resident run too, so both round alike; one
    # decoder layer: its seven LoRA layers are what paging moves, a second layer of the same shapes repeats them)
    model = many_model(N_ADAPTERS, layers=1).to(device)
    fast_multilora.patch(model, backend=backend, resident_adapters=k, store_optimizer=False, **settings)
    model.train()
    return model


def _step(model, opt, ids, rows):
    out = model(input_ids=ids, adapter_names=rows).logits
    fast_multilora.per_adapter_loss(out, ids, rows).backward()


def _is_host_copy(pager, name, p, t) -> bool:
    """Whether ``t`` is the host buffer the pager keeps for a tensor of ``p`` (its weight or a state)."""
    ptrs = {b.data_ptr() for key, b in pager.buffers.get(name, {}).items() if key[1] == id(p)}
    return t.data_ptr() in ptrs


def _check_residency(model, opt, rows, k, device):
    """Only the batch's adapters and at most ``k`` others are resident; a paged-out adapter's weights and AdamW
    states are its host copies (pinned on CUDA), a resident one's are not; the store holds resident adapters only."""
    pager = _pager(model)
    names = set(model.peft_config)
    batch = set(rows) - {fast_multilora.BASE}
    resident, paged = set(pager.recent), set(pager.paged)
    assert resident | paged == names and not resident & paged
    assert batch <= resident
    with_grads = {n for n in names if any(p.grad is not None for p in pager.params_of(n))}
    assert not with_grads & paged  # gradients are never paged: an adapter holding one stays
    assert len(resident - batch - with_grads) <= k, (sorted(resident), sorted(batch))
    assert pager.absent == paged
    for name in names:
        params = pager.params_of(name)
        assert params
        for p in params:
            tensors = [p.data] + [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]
            for t in tensors:
                assert _is_host_copy(pager, name, p, t) == (name in paged), (name, name in paged)
                if device == "cuda":
                    assert (t.device.type == "cpu" and t.is_pinned()) == (name in paged)
    store = model.__dict__[_ROUTER_ATTR].store
    if store is not None:
        assert set(store.adapter_params) <= resident


def _assert_equal_runs(model, opt, ref, ref_opt):
    fast_multilora.paging.synchronize(model)  # (CUDA: page-outs still in flight)
    got, want = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got.keys() == want.keys()
    for n in want:
        assert torch.equal(got[n].detach().cpu(), want[n].detach().cpu()), n
        s, r = opt.state.get(got[n], {}), ref_opt.state.get(want[n], {})
        assert s.keys() == r.keys(), n
        for key in r:
            assert torch.equal(torch.as_tensor(s[key]).cpu(), torch.as_tensor(r[key]).cpu()), (n, key)


def _train(model, batches, device, k=None, prefetch=False, accumulate=1, set_to_none=True):
    """``accumulate`` micro-batches per optimizer step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    returned = 0
    for i, (ids, rows) in enumerate(batches):
        pager = _pager(model)
        came_back = pager is not None and any(r in pager.paged for r in rows)
        _step(model, opt, ids.to(device), rows)
        if pager is not None:
            returned += came_back and any(opt.state.get(p) for r in rows if r in model.peft_config
                                          for p in pager.params_of(r))
            if (i + 1) % accumulate == 0 or accumulate == 1:
                _check_residency(model, opt, rows, k, device) if accumulate == 1 else None
        if prefetch and i + 1 < len(batches):
            fast_multilora.prefetch(model, batches[i + 1][1])
            assert set(batches[i + 1][1]) - {fast_multilora.BASE} <= set(pager.recent)
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    return opt, returned


@pytest.mark.parametrize("backend,store,k", [("torch", True, 2), ("torch", False, 0), ("triton", True, 1)])
def test_paged_training_equals_resident_training(backend, store, k, device):
    """Paged training equals the resident run, bit for bit, on the store (default) and on the per-parameter path
    (``adapter_store=False``: an adapter outside the batch gets no gradient there either, so a resident one takes no
    optimizer step that a paged-out one would not)."""
    steps = 4 if backend == "triton" else 9
    model = _model(device, k, backend, adapter_store=store)
    ref = _model(device, None, backend, adapter_store=store)
    batches = _schedule(sorted(model.peft_config), steps)
    opt, returned = _train(model, batches, device, k)
    ref_opt, _ = _train(ref, batches, device)
    assert returned >= 1  # an adapter with optimizer states came back from the host
    _assert_equal_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("kind", ["sgd", "adamw_closure"])
def test_a_paged_optimizer_steps_and_clears_only_what_may_have_gradients(device, kind, monkeypatch):
    """Under paging a torch optimizer's step sees, per group, the resident adapters' parameters with a gradient and
    the group's parameters of no adapter (a trainable base weight here), not the registry; its groups are its own
    lists again after the step; ``zero_grad`` clears the same ones (torch's own walk of every parameter is not
    called once the optimizer has stepped). Bitwise equal to the resident run's walk of every parameter (two groups,
    SGD with momentum and weight decay, or AdamW stepped through a closure)."""
    calls, _ = _spy_zero_grad(monkeypatch, torch.optim.Optimizer)
    runs = []
    for k in (0, None):
        model = _model(device, k)
        norm = model.base_model.model.model.norm.weight
        norm.requires_grad_(True)
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        groups = [{"params": lora[::2] + [norm]}, {"params": lora[1::2], "lr": 5e-3}]
        opt = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, weight_decay=0.01) if kind == "sgd" else \
            torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05)
        lists = [g["params"] for g in opt.param_groups]
        seen = []
        opt.register_step_pre_hook(lambda o, a, kw, seen=seen: seen.append([list(g["params"]) for g in o.param_groups]))
        for ids, rows in _schedule(sorted(model.peft_config), 7):
            ids = ids.to(device)
            if kind == "sgd":
                _step(model, opt, ids, rows)
                opt.step()
            else:
                def closure(ids=ids, rows=rows, opt=opt, model=model):
                    opt.zero_grad()
                    out = model(input_ids=ids, adapter_names=rows).logits
                    loss = fast_multilora.per_adapter_loss(out, ids, rows)
                    loss.backward()
                    return loss
                opt.step(closure)
            assert [g["params"] for g in opt.param_groups] == lists and \
                all(g["params"] is q for g, q in zip(opt.param_groups, lists, strict=True))
            stepped = {id(q) for g in seen[-1] for q in g}
            with_grad = {id(q) for g in lists for q in g if q.grad is not None}
            if k == 0:  # the step saw those with a gradient and the base weight, nothing of the paged-out adapters
                assert stepped == with_grad | {id(norm)}, (len(stepped), len(with_grad))
                assert _pager(model).paged
            calls.clear()
            opt.zero_grad()
            assert all(q.grad is None for g in lists for q in g)
            assert not calls or k is None, len(calls)  # (paged: the filter's, not torch's)
        runs.append((model, opt))
    _assert_equal_runs(*runs[0], *runs[1])


@pytest.mark.parametrize("fused", [False, True])
def test_an_adapter_pages_as_one_buffer_per_kind_and_dtype(fused, monkeypatch):
    """A page-out or page-in copies an adapter's tensors through one host buffer per kind (weights, optimizer states)
    and dtype, not tensor by tensor: a paged-out adapter's weights are views of one host buffer and its states of
    another (a fused AdamW's float32 ``step`` states of a third: the weights here are float64), and after a page-in
    its states are views of one device buffer. Run with the recorded CUDA stand-in (the CUDA branch) and equal to
    the resident run."""
    rec = _Recorder()
    rec.install(monkeypatch)
    model, ref = _model("cpu", 0), _model("cpu", None)
    for m in (model, ref):
        m.double()
    batches = _schedule(sorted(model.peft_config), 6, seed=3)
    pager = _pager(model)

    def run(m, **kw):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05, fused=fused)
        came_back = 0
        for ids, rows in batches:
            back = {r for r in rows if m is model and r in pager.paged and any(opt.state.get(p)
                                                                               for p in pager.params_of(r))}
            came_back += len(back)
            _step(m, opt, ids, rows)
            if m is model:
                for name in pager.paged:
                    params = pager.params_of(name)
                    weights = {p.data.untyped_storage().data_ptr() for p in params}
                    states = {v.untyped_storage().data_ptr() for p in params for v in opt.state.get(p, {}).values()
                              if torch.is_tensor(v) and v.dim() > 0}
                    assert len(weights) == 1 and len(states) <= 1, name
                for name in back:  # (an adapter whose states were made while resident has one tensor each)
                    states = {v.untyped_storage().data_ptr() for p in pager.params_of(name)
                              for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0}
                    assert len(states) <= 1, name
            opt.step()
            opt.zero_grad(set_to_none=True)
        return opt, came_back

    opt, came_back = run(model)
    assert came_back >= 1  # adapters with optimizer states were paged in again
    ref_opt, _ = run(ref)
    _assert_equal_runs(model, opt, ref, ref_opt)


def test_zero_grad_keeping_zeros_keeps_those_adapters_resident(device):
    """``zero_grad(set_to_none=False)``: adapters that trained keep (zero) gradients, so the optimizer steps them each
    step (weight decay, momentum); they stay resident, and the run equals the resident one."""
    model, ref = _model(device, 1), _model(device, None)
    batches = _schedule(sorted(model.peft_config), 5, seed=4)
    opt, _ = _train(model, batches, device, 1, set_to_none=False)
    ref_opt, _ = _train(ref, batches, device, set_to_none=False)
    _assert_equal_runs(model, opt, ref, ref_opt)


def test_paged_eval_equals_resident_eval(device):
    model, ref = _model(device, 1), _model(device, None)
    for m in (model, ref):
        m.eval()
    for ids, rows in _schedule(sorted(model.peft_config), 6, seed=5):
        with torch.no_grad():
            got = model(input_ids=ids.to(device), adapter_names=rows).logits
            want = ref(input_ids=ids.to(device), adapter_names=rows).logits
        assert torch.equal(got, want), rows
        batch = set(rows) - {fast_multilora.BASE}
        assert batch <= set(_pager(model).recent) and len(set(_pager(model).recent) - batch) <= 1


def test_prefetch_then_forward_equals_no_prefetch(device):
    model, plain, ref = _model(device, 3), _model(device, 3), _model(device, None)
    batches = _schedule(sorted(model.peft_config), 7, seed=1)
    opt, _ = _train(model, batches, device, 3, prefetch=True)
    plain_opt, _ = _train(plain, batches, device, 3)
    ref_opt, _ = _train(ref, batches, device)
    _assert_equal_runs(model, opt, plain, plain_opt)
    _assert_equal_runs(model, opt, ref, ref_opt)


def test_prefetch_pages_nothing_out():
    model = _model("cpu", 0)
    pager = _pager(model)
    names = sorted(model.peft_config)
    _step(model, torch.optim.SGD(model.parameters()), torch.randint(0, 97, (2, 5)), names[:2])
    fast_multilora.prefetch(model, names[2:5])
    assert set(pager.recent) == set(names[:5])  # the running step's adapters stay until the next forward
    with pytest.raises(ValueError, match="unknown adapter"):
        fast_multilora.prefetch(model, ["nope"])
    with pytest.raises(TypeError, match="list of adapter names"):
        fast_multilora.prefetch(model, names[0])


def test_gradient_accumulation_keeps_adapters_with_gradients(device):
    """Micro-batches of different adapters before one step: an adapter holding a gradient (or named by a forward
    whose backward has not run) is not paged out, so the step sees every gradient."""
    model, ref = _model(device, 0), _model(device, None)
    batches = _schedule(sorted(model.peft_config), 6, seed=2)
    opt, _ = _train(model, batches, device, 0, accumulate=3)
    ref_opt, _ = _train(ref, batches, device, accumulate=3)
    _assert_equal_runs(model, opt, ref, ref_opt)
    # two forwards, one backward of both: the second forward must not re-lay the store out (the first one's gradients
    # land in its arenas): without a prefetch of both batches' adapters it raises, with it it equals the resident run
    (ids0, r0), (ids1, r1) = [(ids.to(device), rows) for ids, rows in batches[:2]]
    model, ref = _model(device, 0), _model(device, None)
    fast_multilora.per_adapter_loss(model(input_ids=ids0, adapter_names=r0).logits, ids0, r0)
    with pytest.raises(ValueError, match="backward of an earlier forward"):
        model(input_ids=ids1, adapter_names=r1)
    model = _model(device, 0)
    opts = []
    for m in (model, ref):
        opts.append(torch.optim.AdamW(m.parameters(), lr=1e-2))
        if m is model:
            fast_multilora.prefetch(model, r0 + r1)
        l0 = fast_multilora.per_adapter_loss(m(input_ids=ids0, adapter_names=r0).logits, ids0, r0)
        l1 = fast_multilora.per_adapter_loss(m(input_ids=ids1, adapter_names=r1).logits, ids1, r1)
        (l0 + l1).backward()
        opts[-1].step()
    _assert_equal_runs(model, opts[0], ref, opts[1])
    opts[0].zero_grad()
    _step(model, opts[0], ids0, r0)  # the next forward after the step and zero_grad pages the others out
    assert set(_pager(model).recent) == set(r0) - {fast_multilora.BASE}


def test_save_pretrained_and_unpatch_of_a_paged_model(tmp_path, device):
    from helpers import assert_same_saved_adapters

    model, ref = _model(device, 1), _model(device, None)
    batches = _schedule(sorted(model.peft_config), 4, seed=3)
    _train(model, batches, device, 1)
    _train(ref, batches, device)
    assert _pager(model).paged  # some adapters are on the host now
    model.save_pretrained(tmp_path / "paged")
    ref.save_pretrained(tmp_path / "resident")
    assert_same_saved_adapters(str(tmp_path / "paged"), str(tmp_path / "resident"), model.peft_config)
    pager = _pager(model)
    fast_multilora.unpatch(model)
    for name in model.peft_config:
        for p in pager.params_of(name):
            assert not _is_host_copy(pager, name, p, p.data) and p.device.type == device, name
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.detach(), q.detach()), n
        # every parameter, paged out at the unpatch or not, is a stock Parameter without the store's hook again
        assert type(p) is torch.nn.Parameter and not p._post_accumulate_grad_hooks, n


def test_paging_settings_and_refusals():
    with pytest.raises(ValueError, match="resident_adapters"):
        fast_multilora.PatchConfig(resident_adapters=-1)
    with pytest.raises(ValueError, match="resident_adapters"):
        fast_multilora.PatchConfig(resident_adapters=True)
    model = _model("cpu", 2)
    assert len(_pager(model).paged) == N_ADAPTERS - 2  # paged out at patch: the registry is on the host
    opt = fast_multilora.AdamW(model, lr=1e-2)
    with pytest.raises(ValueError, match="fast_multilora.AdamW"):
        _step(model, opt, torch.randint(0, 97, (1, 5)), [sorted(model.peft_config)[0]])
    # patching again without paging brings everything back; with it again pages out again
    model = _model("cpu", 2)
    fast_multilora.patch(model, backend="torch")
    assert _pager(model) is None
    fast_multilora.patch(model, backend="torch", resident_adapters=4)
    assert len(_pager(model).paged) == N_ADAPTERS - 4


def _moe_model(device, k):
    from models import with_adapters
    from peft import LoraConfig
    from test_moe import EXPERTS, tiny_moe

    cfgs = {f"m{i}": LoraConfig(r=1 + i % 3, lora_alpha=2 + i, target_modules=["q_proj"] if i % 2 else [],
                                target_parameters=EXPERTS, init_lora_weights=False) for i in range(6)}
    model = with_adapters(tiny_moe("qwen3_moe", "grouped_mm"), cfgs).to(device)
    fast_multilora.patch(model, backend="torch", resident_adapters=k, store_optimizer=False)
    model.train()
    return model


def test_paged_expert_lora_training_equals_resident_training(device):
    """MoE expert LoRA (``target_parameters``) pages like the rest: an expert wrapper's paged-out adapter leaves its
    projections' tables and the store; weights and AdamW states equal the resident run bitwise."""
    model = _moe_model(device, 1)
    ref = _moe_model(device, None)
    batches = _schedule(sorted(model.peft_config), 7)
    opt, returned = _train(model, batches, device, 1)
    ref_opt, _ = _train(ref, batches, device)
    assert returned >= 1
    experts = [p for n, p in model.named_parameters() if ".experts" in n and "lora_" in n]
    pager = _pager(model)
    assert pager.paged and any(_is_host_copy(pager, name, p, p.data) for name in pager.paged for p in experts)
    _assert_equal_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("again", [False, True], ids=["new_name", "same_name"])
@pytest.mark.parametrize("how", ["peft", "moved", "fast"])
def test_adapters_added_and_deleted_while_paged(device, how, again):
    """PEFT's ``delete_adapter`` / ``add_adapter`` and ``.to()`` (the pager checks every record), the same with every
    parameter's ``.data`` then replaced by a copy (``moved``: what ``.to()`` to another device does to a paged-out
    adapter's parameters -- it becomes resident, its optimizer states copied off its host page), or
    ``fast_multilora.delete_adapters`` / ``add_adapters`` alone (it checks the marked adapters' records only): a paged
    run then equals the resident one and forgets the deleted adapter -- also when the added adapter takes the deleted
    one's name (new parameters under a name the pager knew: its parameter lists are read again)."""
    from peft import LoraConfig

    model, ref = _model(device, 1), _model(device, None)
    names = sorted(model.peft_config)
    batches = _schedule(names, 3, seed=7)
    opt, ref_opt = _train(model, batches, device, 1)[0], _train(ref, batches, device)[0]
    gone = next(n for n in names if n in _pager(model).paged)
    gone_params = list(_pager(model).params_of(gone))
    late = gone if again else "late"
    cfg = LoraConfig(r=3, lora_alpha=5, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    for m, o in ((model, opt), (ref, ref_opt)):
        torch.manual_seed(9)
        if how in ("peft", "moved"):
            m.delete_adapter(gone)
            m.add_adapter(late, cfg)
            m.to(device)
            if how == "moved":
                for p in m.parameters():
                    p.data = p.data.clone()
        else:
            fast_multilora.delete_adapters(m, [gone])
            fast_multilora.add_adapters(m, {late: cfg})  # (made on its layers' device)
        for n, p in m.named_parameters():  # PEFT's delete_adapter left one adapter trainable: all again
            p.requires_grad_("lora_" in n)
            if f".{late}." in n:
                o.add_param_group({"params": [p]})
    later = _schedule([n for n in names if n != gone] + [late], 4, seed=8)
    for m, o in ((model, opt), (ref, ref_opt)):
        for ids, rows in later:
            _step(m, o, ids.to(device), rows)
            o.step()
            o.zero_grad()
            if m is model:  # (from the first step on: an adapter found moved trains in it)
                _check_residency(model, opt, rows, 1, device)
    pager = _pager(model)
    # the deleted adapter's parameters (paged out: kept by the store with their class and hook while out) released
    assert all(type(p) is torch.nn.Parameter and not p._post_accumulate_grad_hooks for p in gone_params)
    if not again:
        assert gone not in pager.paged and gone not in pager.recent and gone not in pager.buffers
    else:  # the pager's parameters of the name are the new adapter's
        assert {id(p) for p in pager.params_of(gone)} == {id(p) for n, p in model.named_parameters()
                                                          if f".{gone}." in n and "lora_" in n}
    _assert_equal_runs(model, opt, ref, ref_opt)


def _paging_reads_after_a_change(n):
    """The pager's reads of adapters' parameters (``Pager.params_of``) in the forward after one adapter is deleted
    and one added (fast_multilora's calls) on a paged model of ``n`` adapters, 2 resident."""
    from peft import LoraConfig

    model = many_model(n)
    fast_multilora.patch(model, backend="torch", resident_adapters=2)
    model.eval()
    names = sorted(model.peft_config)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with torch.no_grad():
        for pair in (names[:2], names[2:4]):
            model(input_ids=ids, adapter_names=pair)
    fast_multilora.delete_adapters(model, [names[0]])
    fast_multilora.add_adapters(model, {"late": LoraConfig(r=2, target_modules=["q_proj"])})
    reads = [0]
    real = paging.Pager.params_of

    def counting(self, name):
        reads[0] += 1
        return real(self, name)

    paging.Pager.params_of = counting
    try:
        with torch.no_grad():
            model(input_ids=ids, adapter_names=["late", names[5]])
    finally:
        paging.Pager.params_of = real
    return reads[0]


def test_a_change_while_paged_reads_the_changed_adapters_only():
    """After an add and a delete, the pager reads the records of the adapters marked changed (and the ones it moves
    now), not every paged-out adapter's: the same reads with 24 and 48 adapters registered. Counted, not timed."""
    small, large = _paging_reads_after_a_change(24), _paging_reads_after_a_change(48)
    assert 0 < small == large, (small, large)


def test_a_paged_model_refuses_copies():
    model = _model("cpu", 1)
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(model)


def test_a_stock_forward_pages_the_active_adapter_in():
    model, ref = _model("cpu", 0), many_model(N_ADAPTERS, layers=1)
    name = sorted(model.peft_config)[5]
    model.set_adapter(name)
    ref.set_adapter(name)
    ids = torch.randint(0, 97, (2, 5))
    assert name in _pager(model).paged
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    assert name not in _pager(model).paged


class _Recorder:
    """A stand-in for ``paging._Cuda`` on the CPU: streams and events that log what paging asks of them (copies
    stay synchronous), so the CUDA branch's ordering runs here: every side-stream page-in is waited on by the compute
    stream, a page-in after a page-out waits on the page-out's event, side-stream tensors are ``record_stream``ed."""

    def __init__(self):
        self.log, self.events = [], 0
        self.compute = self._stream("compute")
        self.current = self.compute

    def _stream(self, name):
        rec = self

        class Stream:
            def wait_event(self, ev):
                rec.log.append(("wait", name, ev.id))

        s = Stream()
        s.name = name
        return s

    def install(self, monkeypatch):
        rec = self

        class Event:
            def __init__(self):
                rec.events += 1
                self.id = rec.events

            def record(self, stream):
                rec.log.append(("record", stream.name, self.id))

            def synchronize(self):
                rec.log.append(("sync", "host", self.id))

        @contextlib.contextmanager
        def stream(s):
            prev, rec.current = rec.current, s
            try:
                yield
            finally:
                rec.current = prev

        fake = paging._Cuda
        names = iter(["stream1", "stream2", "stream3"])  # (the test reads which is the pager's side / out stream)
        monkeypatch.setattr(fake, "Stream", staticmethod(lambda device=None: rec._stream(next(names))))
        monkeypatch.setattr(fake, "Event", staticmethod(Event))
        monkeypatch.setattr(fake, "current_stream", staticmethod(lambda device=None: rec.current))
        monkeypatch.setattr(fake, "stream", staticmethod(stream))
        monkeypatch.setattr(fake, "used", staticmethod(lambda device: True))
        monkeypatch.setattr(fake, "record_stream", staticmethod(lambda t, s: rec.log.append(("record_stream", s.name,
                                                                                              0))))
        monkeypatch.setattr(fake, "host_empty", staticmethod(lambda shape, dtype: torch.empty(shape, dtype=dtype)))


def test_the_cuda_stream_logic_with_recorded_streams(monkeypatch):
    rec = _Recorder()
    rec.install(monkeypatch)
    model, ref = _model("cpu", 1), _model("cpu", None)
    first = model.__dict__[_ROUTER_ATTR].fast_layers[0]  # its calls come after the forward's entry
    first.register_forward_pre_hook(lambda *args: rec.log.append(("layer", "compute", 0)))
    batches = _schedule(sorted(model.peft_config), 7, seed=6)
    opt, _ = _train(model, batches, "cpu", 1, prefetch=True)
    ref_opt, _ = _train(ref, batches, "cpu")
    _assert_equal_runs(model, opt, ref, ref_opt)
    pager = _pager(model)
    side_s, out_s = pager.side.name, pager.out.name
    assert side_s != out_s
    where = {i: s for kind, s, i in rec.log if kind == "record"}
    side = [i for i, s in where.items() if s == side_s]
    assert side, "no page-in ran on the side stream"
    for i in side:  # the compute stream waited on every side-stream page-in before the next layer call
        at = rec.log.index(("record", side_s, i))
        nxt = rec.log.index(("layer", "compute", 0), at)
        assert ("wait", "compute", i) in rec.log[at:nxt], i
    outs = {i for i, s in where.items() if s == out_s}  # page-outs' events (recorded on the page-out stream)
    assert outs, "no page-out ran on its stream"
    for i in outs:  # each page-out's copies waited on the gather (an event recorded on the compute stream just before)
        at = rec.log.index(("record", out_s, i))
        waits = [e for e in rec.log[:at] if e[0] == "wait" and e[1] == out_s]
        assert waits and where[waits[-1][2]] == "compute", (i, waits[-1:])
    assert any(("wait", side_s, i) in rec.log for i in outs)  # a prefetch of an adapter paged out before: waited
    for kind, s, i in rec.log:
        if kind == "wait" and s == side_s:
            assert i in outs
    # (page-ins' new buffers on the compute stream, page-outs' gathered ones on the page-out stream)
    assert {s for kind, s, _ in rec.log if kind == "record_stream"} == {"compute", out_s}
    model.state_dict()  # host reads wait for the page-outs still in flight
    waited = {j for k, _, j in rec.log if k == "wait"}
    missing = [i for i in outs if i not in waited and ("sync", "host", i) not in rec.log]
    assert not missing, (missing, [e for e in rec.log if e[0] != "record_stream"])


def test_an_adapter_found_moved_waits_for_its_page_out_then_leaves_its_page(monkeypatch):
    """The CUDA branch (recorded streams): a paged-out adapter whose parameters moved (``.data`` replaced, as
    ``.to()`` to another device does) while its page-out's copies may still run is found at the next check; the host
    waits on that page-out's event before it copies the adapter's optimizer states off the host page, and the
    adapter is resident with none of its tensors on the page."""
    from fast_multilora.plan import mark_changed

    rec = _Recorder()
    rec.install(monkeypatch)
    model = _model("cpu", 1)
    opt, _ = _train(model, _schedule(sorted(model.peft_config), 4, seed=3), "cpu", 1)
    pager = _pager(model)
    name = next(n for n in pager.paged if n in pager.outgoing and any(opt.state.get(p) for p in pager.params_of(n)))
    event = pager.outgoing[name].id
    for p in pager.params_of(name):
        p.data = p.data.clone()
    mark_changed()
    fast_multilora.prefetch(model, [name])  # (a check, and nothing paged out)
    assert ("sync", "host", event) in rec.log
    assert name in pager.recent and name not in pager.paged and name not in pager.outgoing
    for p in pager.params_of(name):
        for t in [p.data] + [v for v in opt.state.get(p, {}).values() if torch.is_tensor(v) and v.dim() > 0]:
            assert not _is_host_copy(pager, name, p, t)


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_the_store_keeps_its_layers_while_paged_out_adapters_live_on_another_device(monkeypatch, kind):
    """On CUDA a paged-out adapter's weights are pinned host tensors, not on the arena's device. The CPU has one
    device, so here a paged-out adapter's weights are float64 copies while they are out (back before they page in),
    another arena key as a device is: a layer whose arena key was read from such a weight (the first adapter of its
    old layout) would
    drop out of the store -- its calls then take PEFT's parameters, no backward clears the pager's record of the
    forward, and the next page-in raises. Every step's layers stay held, and the run equals the resident one; the
    same with MoE expert LoRA (``target_parameters``)."""
    real_out, real_in = paging.Pager._page_out, paging.Pager._page_in

    def page_out(self, name):
        real_out(self, name)
        for p in self.params_of(name):
            p.data = p.data.double()

    def page_in(self, name, side):
        for p in self.params_of(name):
            p.data = self.buffers[name][("w", id(p))]
        real_in(self, name, side)

    monkeypatch.setattr(paging.Pager, "_page_out", page_out)
    monkeypatch.setattr(paging.Pager, "_page_in", page_in)
    build = _model if kind == "llama" else _moe_model
    ref, model = build("cpu", None), build("cpu", 0)  # (the paged model patched last: no change after its own)
    names = sorted(model.peft_config)
    per, starts = (3, (0, 3, 6, 0, 9)) if kind == "llama" else (2, (0, 2, 4, 0, 2))
    batches = [(torch.randint(0, 97, (per + 1, 6), generator=torch.Generator().manual_seed(i)),
                names[j:j + per] + ["__base__"]) for i, j in enumerate(starts)]
    router = model.__dict__[_ROUTER_ATTR]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for ids, rows in batches:
        _step(model, opt, ids, rows)
        held = [layer for layer in router.store_layers if router.store.layer_slots(layer) is not None]
        assert held and held == [layer for layer in router.store_layers  # (a layer with every adapter out: none)
                                 if layer.__dict__.get(_STATE_ATTR) is not None], rows
        assert not router.store.pending and not router.store.calls, rows  # the backward found its forward's record
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref_opt, _ = _train(ref, batches, "cpu")
    for p in model.parameters():  # (the stand-ins back to the host copies, for the comparison)
        if p.dtype == torch.float64:
            name = next(n for n in _pager(model).paged if any(q is p for q in _pager(model).params_of(n)))
            p.data = _pager(model).buffers[name][("w", id(p))]
    _assert_equal_runs(model, opt, ref, ref_opt)


@pytest.mark.parametrize("fused,new", [(False, True), (True, True), (True, False)])
def test_an_optimizer_resumed_from_its_state_dict_while_paged(device, fused, new):
    """A resume in the middle of paged training -- the optimizer's ``state_dict`` (paged-out adapters' states are
    their host copies) loaded into a new optimizer or the same one, either way every state tensor replaced --
    continues as the resident run resumed the same way: the pager reads the optimizer's new states (its kept entry
    lists go stale)."""
    model, ref = _model(device, 1), _model(device, None)
    batches = _schedule(sorted(model.peft_config), 8, seed=11)
    opts = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05, fused=fused)
        for i, (ids, rows) in enumerate(batches):
            if i == 4:
                saved = copy.deepcopy(opt.state_dict())
                if new:
                    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05, fused=fused)
                opt.load_state_dict(saved)
            _step(m, opt, ids.to(device), rows)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if m is model and i >= 4:
                _check_residency(model, opt, rows, 1, device)
        opts.append(opt)
    _assert_equal_runs(model, opts[0], ref, opts[1])
