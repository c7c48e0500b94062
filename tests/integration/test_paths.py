"""The model-level path matrix: every path a GPU call can take, on CPU (Triton through the interpreter), against
stock PEFT running each sample with its adapter alone (outputs, input and LoRA gradients).

Axes: kernel family (SGEMM: one segment per row; chunked: tokens grouped by adapter) × base fused into the
Function or added to the base layer's output × weights: the adapter store's two leaves (the default), or PEFT's
parameters read in place or concatenated (layers the store does not hold, DDP); packed rows (``adapter_ids``)
take the chunked family. Under dropout, where PEFT draws other masks, the stored mask and the redrawn one must give
the same results. A one-row or one-slot mistake on any path fails here. One decoder layer: its seven projections
(four shapes) are every layer call a second layer would repeat.
"""

import contextlib

import pytest
import torch
from models import LLAMA_TARGETS, peft_model, twin
from peft import LoraConfig

import fast_multilora

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]


def configs(dropout=0.0):
    """Three adapters on every projection, ranks 4 / 8 / 2 with their own scales."""
    common = dict(init_lora_weights=False, lora_dropout=dropout, target_modules=LLAMA_TARGETS)
    return {"a0": LoraConfig(r=4, lora_alpha=8, **common),
            "a1": LoraConfig(r=8, lora_alpha=4, use_rslora=True, **common),
            "a2": LoraConfig(r=2, lora_alpha=3, **common)}


def _step(model, ids, w, **kw):
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb, **kw).logits
    (out * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}
    return out.detach(), emb.grad, grads


def _peft_per_sample(ref, ids, w, row_names, by_adapter=False, around=None):
    """Stock PEFT, one row at a time with its adapter alone (``by_adapter``: all rows of one adapter at once);
    ``around(name, rows)``: a context manager entered around an adapter's forward and backward."""
    outs, dxs = [None] * len(row_names), [None] * len(row_names)
    for n, p in ref.named_parameters():
        p.requires_grad_("lora_" in n)
    groups = ([[i for i, n in enumerate(row_names) if n == name] for name in dict.fromkeys(row_names)] if by_adapter
              else [[i] for i in range(len(row_names))])
    for rows in groups:
        name = row_names[rows[0]]
        emb = ref.get_input_embeddings()(ids[rows]).detach().requires_grad_()
        if name == "__base__":
            with ref.disable_adapter():  # backward inside too: checkpoint recomputation must see the same model
                out = ref(inputs_embeds=emb).logits
                (out * w[rows]).sum().backward()
        else:
            ref.set_adapter(name)
            for n, p in ref.named_parameters():
                p.requires_grad_("lora_" in n)
            with around(name, rows) if around is not None else contextlib.nullcontext():
                out = ref(inputs_embeds=emb).logits
                (out * w[rows]).sum().backward()
        for j, i in enumerate(rows):
            outs[i], dxs[i] = out[j : j + 1].detach(), emb.grad[j : j + 1]
    grads = {n: p.grad for n, p in ref.named_parameters() if "lora_" in n and p.grad is not None}
    return torch.cat(outs), torch.cat(dxs), grads


def _close(got, want, what):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()),
                               msg=lambda m: f"{what}: {m}")


def assert_matches_peft(model, ref, what="", **route):
    """One mixed-batch step of ``model`` (routed by ``route``) against stock PEFT per sample on ``ref``: logits,
    input gradients and every LoRA gradient (each adapter gets one)."""
    ids, w = _inputs(5)
    got = _step(model, ids, w, **route)
    want = _peft_per_sample(ref, ids, w, NAMES)
    _close(got[0], want[0], f"{what} logits")
    _close(got[1], want[1], f"{what} input grad")
    assert set(got[2]) == {n for n, p in model.named_parameters() if "lora_" in n}
    for n, g in want[2].items():
        _close(got[2][n], g, n)


WEIGHTS = ["store", "in_place", "concatenated"]


def _patched(family, fuse, weights):
    """The three-adapter model patched with these settings, and its unpatched twin (stock PEFT)."""
    model = peft_model(configs=configs(), layers=1)
    ref = twin(model)
    fast_multilora.patch(model, backend="triton", family=family, fuse_base=fuse, adapter_store=weights == "store",
                         weights_in_place=weights == "in_place")
    return model, ref


def _inputs(T):
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 97, (len(NAMES), T), generator=g), torch.randn(len(NAMES), T, 97, generator=g)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "added"])
@pytest.mark.parametrize("family", ["sgemm", "chunked"])
@pytest.mark.interpreter
def test_path_matrix_matches_peft(family, fuse, weights):
    model, ref = _patched(family, fuse, weights)
    model.train()
    ref.train()
    assert_matches_peft(model, ref, adapter_names=NAMES)


@pytest.mark.parametrize("store", [True, False], ids=["store", "params"])
@pytest.mark.interpreter
def test_packed_rows_match_peft(store):
    """Packed rows (``adapter_ids``): each row one adapter's tokens here, so stock PEFT per row is the oracle."""
    model = peft_model(configs=configs(), layers=1)
    ref = twin(model)
    fast_multilora.patch(model, backend="triton", adapter_store=store)
    vocab = ["a2", "a0", "a1"]
    a_ids = torch.tensor([vocab.index(n) if n != "__base__" else -1 for n in NAMES])[:, None].expand(-1, 5)
    assert_matches_peft(model, ref, adapter_names=vocab, adapter_ids=a_ids)


@pytest.mark.parametrize("weights", ["store", "concatenated"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "added"])
@pytest.mark.parametrize("family", ["sgemm", "chunked"])
@pytest.mark.interpreter
def test_dropout_mask_stored_equals_redrawn(family, fuse, weights):
    """Under LoRA dropout: the backward reading the stored mask and the backward redrawing it give the same outputs
    and gradients, for the same RNG state."""
    results = []
    for store in (True, False):
        model = peft_model(configs=configs(dropout=0.3), layers=1)
        fast_multilora.patch(model, backend="triton", family=family, fuse_base=fuse,
                             adapter_store=weights == "store", store_dropout_mask=store)
        model.train()
        ids, w = _inputs(5)
        torch.manual_seed(7)
        results.append(_step(model, ids, w, adapter_names=NAMES))
    (o1, dx1, g1), (o2, dx2, g2) = results
    assert torch.equal(o1, o2) and torch.equal(dx1, dx2)
    assert set(g1) == set(g2)
    for n in g1:
        assert torch.equal(g1[n], g2[n]), n


def _eval(model, ids, **route):
    with torch.no_grad():
        return model(input_ids=ids, **route).logits


def _fast_states(model):
    from fast_multilora.patching import _STATE_ATTR

    return [m.__dict__[_STATE_ATTR] for m in model.modules() if m.__dict__.get(_STATE_ATTR) is not None]


def _forget_plans(model):
    for state in _fast_states(model):
        state.plans.clear()


# (family, fuse, weights, tokens per row): every pair of two axes' values in some case; 5 tokens per row (35 rows)
# take the one-launch decode kernel, 10 (70 rows, above kernels.DECODE_MAX_ROWS) the segmented kernels
EVAL_CASES = [("sgemm", False, "concatenated", 5), ("sgemm", True, "store", 10), ("chunked", False, "in_place", 5),
              ("chunked", True, "concatenated", 10), ("chunked", True, "store", 5), ("sgemm", True, "in_place", 5),
              ("chunked", False, "store", 10), ("sgemm", False, "in_place", 10), ("sgemm", False, "store", 5)]


@pytest.mark.parametrize("family, fuse, weights, T", EVAL_CASES,
                         ids=["-".join([f, "fused" if u else "added", w, "decode" if t == 5 else "segmented"])
                              for f, u, w, t in EVAL_CASES])
@pytest.mark.interpreter
def test_eval_replays_launch_plans(family, fuse, weights, T, monkeypatch):
    """With autograd off, a layer call records its launch plan and the next call with that layout replays it
    (``function.LaunchPlan``: no launcher runs its general path): logits equal the recording call's bit for bit and
    stock PEFT's per sample; an in-place weight update is read by the replay, a moved weight makes a new plan.
    Calls of few rows take one launch (``kernels.decode``), the others the shrink and the expand."""
    from fast_multilora.kernels import api as K
    from fast_multilora.kernels.decode import DECODE_MAX_ROWS

    model, ref = _patched(family, fuse, weights)
    model.eval()
    ref.eval()
    ids, _ = _inputs(T)
    decode = ids.numel() <= DECODE_MAX_ROWS
    general = {n: getattr(K, n) for n in ("lora_shrink", "lora_expand", "lora_shrink_expand")}
    ran = []
    for n, fn in general.items():
        monkeypatch.setattr(K, n, lambda *a, _n=n, _fn=fn, **k: (ran.append(_n), _fn(*a, **k))[1])
    first = _eval(model, ids, adapter_names=NAMES)
    assert set(ran) == ({"lora_shrink_expand"} if decode else {"lora_shrink", "lora_expand"}), set(ran)
    states = _fast_states(model)
    assert states and all(s.plans for s in states)
    store = model.__dict__[fast_multilora.patching._ROUTER_ATTR].store
    store_tables = [t for s in store.slots.values() for t in (s.table.scales, s.table.dropout)] if store else []
    for s in states:  # a plan holds no activation or weight: only the layout's and the tables' small tensors
        for plan in s.plans.values():
            small = (s.table.scales, s.table.dropout, *store_tables)  # the store's tables: its layers' offsets
            bounds = [plan.decode] if decode else [r.bound for r in (plan.shrink, plan.expand) if r is not None]
            for bound in bounds:
                held = [a for a in (bound.args if bound is not None else ()) if isinstance(a, torch.Tensor)]
                assert all(t.dtype in (torch.int32, torch.int64) or any(t is u for u in small) for t in held)

    def refuse(*a, **k):
        raise AssertionError("a replayed call ran a launcher's general path")

    for n in general:
        monkeypatch.setattr(K, n, refuse)
    second = _eval(model, ids, adapter_names=NAMES)
    assert torch.equal(first, second)
    want = torch.cat([_eval_peft(ref, ids[i : i + 1], n) for i, n in enumerate(NAMES)])
    _close(second, want, "replayed logits")

    # an in-place update (an optimizer step): the replay reads the new values, as the general path does
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        layer.lora_B["a2"].weight.mul_(3.0)
        layer.lora_A["a1"].weight.add_(0.5)
    replayed = _eval(model, ids, adapter_names=NAMES)
    for n, fn in general.items():
        monkeypatch.setattr(K, n, fn)
    _forget_plans(model)
    assert torch.equal(replayed, _eval(model, ids, adapter_names=NAMES))
    assert not torch.equal(replayed, second)

    # a weight moved to new memory (a replaced ``.data``): the plan no longer applies and a new one is recorded
    w = layer.lora_B["a0"].weight
    w.data = w.data * -1.0
    moved = _eval(model, ids, adapter_names=NAMES)
    _forget_plans(model)
    assert torch.equal(moved, _eval(model, ids, adapter_names=NAMES))
    assert not torch.equal(moved, replayed)


def _eval_peft(ref, ids, name):
    with torch.no_grad():
        if name == "__base__":
            with ref.disable_adapter():
                return ref(input_ids=ids).logits
        ref.set_adapter(name)
        return ref(input_ids=ids).logits
