"""Memory: 1000 tiny training steps hold no more memory at the end than after warm-up, and every cache is bounded.

A small MLP with three PEFT adapters (dropout on), patched; each step changes the batch shape (rows 1..6, tokens
1..5), the names (per row, packed ``adapter_ids``, all base) and sometimes calls a layer straight with
``adapter_names`` (the per-name-tuple routing cache) or runs an eval forward. Measured after warm-up and at the end:
Python memory blocks (``sys.getallocatedblocks``), allocations still live over the last steps (tracemalloc), live
torch tensors (count and bytes) and gc-tracked objects; and the caches: ``Router._by_names``, ``Routing.layouts``,
each layer's ``_fml_state``, ``Segments.cache``.
"""

import gc
import sys
import tracemalloc

import pytest
import torch
from fast_multilora.kernels import api as kernels
from peft import LoraConfig, get_peft_model

import fast_multilora
from fast_multilora.function import _BACKENDS
from fast_multilora.patching import _ROUTER_ATTR, _SUBCLASSES, LayerState

HAS_TRITON_BWD = hasattr(kernels, "lora_expand_bwd") and hasattr(kernels, "lora_shrink_bwd")
NAMES = ["a0", "a1", "a2", "__base__"]


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 24)
        self.down = torch.nn.Linear(24, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _model(backend):
    torch.manual_seed(0)
    cfg = dict(init_lora_weights=False, lora_dropout=0.1)
    model = get_peft_model(MLP(), LoraConfig(r=4, target_modules=["up", "down"], **cfg), adapter_name="a0")
    model.add_adapter("a1", LoraConfig(r=2, target_modules=["up"], **cfg))
    model.add_adapter("a2", LoraConfig(r=8, lora_alpha=4, target_modules=["up", "down"], **cfg))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    fast_multilora.patch(model, backend=backend)
    model.train()
    return model


def _step(model, opt, i, g):
    rows, T = 1 + i % 6, 1 + (i // 6) % 5
    x = torch.randn(rows, T, 16, generator=g)
    kind = i % 7
    if kind == 5:  # packed rows
        kw = dict(adapter_names=["a2", "a0"], adapter_ids=torch.randint(-1, 2, (rows, T), generator=g))
    elif kind == 6:  # all base
        kw = dict(adapter_names=["__base__"] * rows)
    else:
        kw = dict(adapter_names=[NAMES[int(j)] for j in torch.randint(0, 4, (rows,), generator=g)])
        kw["adapter_names"][0] = NAMES[i % 3]
    out = model(x, **kw)
    out.square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if i % 10 == 3:  # names straight to a layer: the per-name-tuple cache (PEFT's own hooks do this)
        up = model.base_model.model.up
        with torch.no_grad():
            up(torch.randn(rows, 16, generator=g), adapter_names=[NAMES[(i + j) % 4] for j in range(rows)])
    if i % 10 == 7:
        model.eval()
        with torch.no_grad():
            model(x, **kw)
        model.train()


def _live_tensors():
    gc.collect()
    ts = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    return len(ts), sum(t.untyped_storage().nbytes() for t in ts if t.device.type == "cpu")


def _check_caches(model):
    router = model.__dict__[_ROUTER_ATTR]
    assert len(router._by_names) <= 9, len(router._by_names)
    for routing in [router.current, *router._by_names.values()]:  # cached routings keep their layouts
        if routing is None:
            continue
        assert len(routing.layouts) <= 17
        for segs in routing.layouts.values():
            assert len(segs.cache) <= 8, list(segs.cache)
    for m in model.modules():
        t = m.__dict__.get("_fml_state")
        assert t is None or isinstance(t, LayerState)  # one entry per layer, replaced, never a list


@pytest.mark.parametrize("backend, warm, steps, traced", [
    pytest.param("torch", 200, 1000, 150, id="torch-1000", marks=pytest.mark.slow),
    pytest.param("triton", 8, 20, 10, id="triton-20",
                 marks=[pytest.mark.interpreter,
                        pytest.mark.skipif(not HAS_TRITON_BWD, reason="Triton backward not exported")]),
])
def test_no_growth_over_many_steps(backend, warm, steps, traced):
    """``steps`` steps after warm-up; the last ``traced`` of them under tracemalloc (it slows Python ~10x)."""
    model = _model(backend)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    g = torch.Generator().manual_seed(0)
    for i in range(warm):  # every shape / name kind / cache path seen, the bounded caches filled
        _step(model, opt, i, g)
    n0, bytes0 = _live_tensors()
    objs0, blocks0 = len(gc.get_objects()), sys.getallocatedblocks()
    n_sub, n_backends = len(_SUBCLASSES), len(_BACKENDS)
    for i in range(warm, warm + steps - traced):
        _step(model, opt, i, g)
        if i % 100 == 0:
            _check_caches(model)
    tracemalloc.start()
    try:
        for i in range(warm + steps - traced, warm + steps):
            _step(model, opt, i, g)
        gc.collect()
        py_growth, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    n1, bytes1 = _live_tensors()
    objs1, blocks1 = len(gc.get_objects()), sys.getallocatedblocks()
    _check_caches(model)
    assert len(_SUBCLASSES) == n_sub and len(_BACKENDS) == n_backends
    # the bounded caches fluctuate (up to 9 routings per name tuple, each with its plans): a few dozen small
    # tensors / a few hundred memory blocks either way; a leak of one object per step exceeds these
    assert n1 - n0 <= 48, f"live tensors {n0} -> {n1}"
    assert bytes1 - bytes0 <= 64 * 1024, f"live tensor bytes {bytes0} -> {bytes1}"
    assert objs1 - objs0 <= 500, f"gc objects {objs0} -> {objs1}"
    assert blocks1 - blocks0 <= 2000, f"Python memory blocks {blocks0} -> {blocks1}"
    assert py_growth <= 256 * 1024, f"{py_growth} bytes of Python allocations still live after {traced} steps"


def test_plan_and_name_caches_are_bounded():
    """Many shapes in one routing (e.g. a long generate()) and many name tuples straight to layers."""
    model = _model("torch")
    router = model.__dict__[_ROUTER_ATTR]
    up = model.base_model.model.up
    g = torch.Generator().manual_seed(1)
    with torch.no_grad(), fast_multilora.route(model, ["a0", "a1"]):
        for T in range(1, 60):
            up(torch.randn(2, T, 16, generator=g))
            assert len(router.current.layouts) <= 17
    with torch.no_grad():
        for i in range(60):
            names = [NAMES[(i >> k) % 4] for k in range(3)]
            up(torch.randn(3, 16, generator=g), adapter_names=names)
            assert len(router._by_names) <= 9
