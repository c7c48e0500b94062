"""Determinism: two training runs from the same seed give bit-identical adapter weights after N steps (dropout on,
mixed batches and packed rows). CPU: torch backend and Triton under the interpreter. GPU (``gpu`` marker,
``FML_TEST_DEVICE=cuda``): Triton kernels compiled, fp32 and bf16 models, both kernel families; eager attention so
the base model's own backward is deterministic too (our kernels use no atomics: fixed-order reductions)."""

import pytest
import torch
from fast_multilora.kernels import api as kernels
from trainloop import Data, lora_weights, make_model, make_optim, train

import fast_multilora

HAS_TRITON_BWD = hasattr(kernels, "lora_expand_bwd") and hasattr(kernels, "lora_shrink_bwd")


def _run(backend, steps, seed, device="cpu", dtype=torch.float32, family="auto"):
    torch.manual_seed(seed)
    model = make_model(backend, device=device, dtype=dtype)
    if family != "auto":
        fast_multilora.patch(model, backend=backend, family=family)
    if device == "cuda":
        model.base_model.model.set_attn_implementation("eager")
    opt, sched = make_optim(model)
    torch.manual_seed(seed + 1)
    train(model, opt, sched, Data(device=device), steps)
    return lora_weights(model)


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(_bits(a[n]), _bits(b[n])), f"{n}: bits differ between two runs"


@pytest.mark.parametrize("backend, steps", [
    pytest.param("torch", 4, id="torch"),
    pytest.param("triton", 2, id="triton",
                 marks=[pytest.mark.interpreter,
                        pytest.mark.skipif(not HAS_TRITON_BWD, reason="Triton backward not exported")]),
])
def test_two_runs_same_seed_bit_identical_cpu(backend, steps):
    first = _run(backend, steps, seed=0)
    _assert_same_bits(first, _run(backend, steps, seed=0))
    if backend == "torch":  # and a different seed does change them (the check can fail)
        assert any(not torch.equal(v, first[n]) for n, v in _run(backend, steps, seed=5).items())


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sgemm", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_two_runs_same_seed_bit_identical_gpu(dtype, family):
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        first = _run("triton", 6, seed=0, device="cuda", dtype=dtype, family=family)
        _assert_same_bits(first, _run("triton", 6, seed=0, device="cuda", dtype=dtype, family=family))
    finally:
        torch.use_deterministic_algorithms(prev)
