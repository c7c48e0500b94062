"""The LoraDelta and FusedLinearDelta autograd Functions: float64 gradcheck, dropout semantics, zero grads for absent
adapters."""

import dataclasses
import os

import pytest
import torch
from helpers import make_segments, make_table, random_token_slots

from fast_multilora.function import DeltaSpec, FusedLinearDelta, LoraDelta, get_backend


def _spec(ts, ranks, grouped, backend="torch", dropout=None, seed=None, device="cpu"):
    table = make_table(ranks, dropout=dropout, device=device)
    segs = make_segments(ts, grouped, device=device)
    present = tuple(r for r in ranks if r > 0)
    return DeltaSpec(segs=segs, table=table, backend=get_backend(backend, torch.device(device)), seed=seed,
                     num_adapters=len(present), ranks=present, has_bias=False)


def _need_interpreter(backend):
    """These tests build CPU tensors: the Triton backend runs them only under the interpreter."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")


def _weights(ranks, K, N, dtype, g, device="cpu"):
    As = [torch.randn(r, K, generator=g, dtype=dtype).to(device).requires_grad_() for r in ranks if r > 0]
    Bs = [torch.randn(N, r, generator=g, dtype=dtype).to(device).requires_grad_() for r in ranks if r > 0]
    return As, Bs


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_gradcheck_float64(grouped, backend):
    """float64 gradcheck of x, y, every A and every B, on the reference ops and through the Triton kernels."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(0)
    S, K, N, ranks = 13, 5, 6, [2, 0, 1, 3]
    ts = random_token_slots(S, len(ranks), g)
    spec = _spec(ts, ranks, grouped, backend=backend)
    As, Bs = _weights(ranks, K, N, torch.float64, g)
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(S, N, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda x, y, *w: LoraDelta.apply(x, y.clone(), spec, *w)  # the Function adds into y in place
    assert torch.autograd.gradcheck(fn, (x, y, *As, *Bs), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gradcheck_float64_with_dropout(backend):
    """The dropout mask is regenerated in backward from the seed: gradcheck sees one fixed function."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(1)
    S, K, N, ranks = 11, 4, 3, [2, 3]
    ts = random_token_slots(S, len(ranks), g)
    spec = _spec(ts, ranks, True, dropout=[0.5, 0.25], seed=1234, backend=backend)
    As, Bs = _weights(ranks, K, N, torch.float64, g)
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(S, N, generator=g, dtype=torch.float64)
    fn = lambda x, *w: LoraDelta.apply(x, y.clone(), spec, *w)
    assert torch.autograd.gradcheck(fn, (x, *As, *Bs), eps=1e-6, atol=1e-7)


_DROP = [0.5, 0.0, 0.25, 0.1]


@pytest.mark.parametrize("backend,grouped,dropout", [
    pytest.param("torch", False, None, id="torch-sgemm-p0"),
    pytest.param("torch", True, _DROP, id="torch-chunked-drop"),
    pytest.param("triton", False, _DROP, id="triton-sgemm-drop"),
    pytest.param("triton", True, None, id="triton-chunked-p0"),
])
def test_fused_linear_gradcheck_float64(backend, grouped, dropout):
    """FusedLinearDelta (frozen W and bias, written delta + accumulated GEMM): float64 gradcheck of x and every
    A and B, with base rows (slot -1) and a rank-0 slot; equal to the base linear plus LoraDelta."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(4)
    S, K, N, ranks = 13, 5, 6, [2, 0, 1, 3]
    ts = random_token_slots(S, len(ranks), g)
    spec = _spec(ts, ranks, grouped, backend=backend, dropout=dropout, seed=99 if dropout else None)
    As, Bs = _weights(ranks, K, N, torch.float64, g)
    W = torch.randn(N, K, generator=g, dtype=torch.float64)
    b = torch.randn(N, generator=g, dtype=torch.float64)
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda x, *w: FusedLinearDelta.apply(x, W, b, spec, *w)
    assert torch.autograd.gradcheck(fn, (x, *As, *Bs), eps=1e-6, atol=1e-7)
    want = LoraDelta.apply(x, torch.nn.functional.linear(x, W, b), spec, *As, *Bs)
    torch.testing.assert_close(fn(x, *As, *Bs), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dropout_keep_rate_seed_and_consistency(backend):
    """Reproducible under a seed, keep-rate ~ 1-p, and the gradient uses the forward's mask (Triton: the mask the
    forward stored, packed)."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(2)
    S, K, N, p = 64, 64, 8, 0.3
    ts = torch.zeros(S, dtype=torch.long)
    As, Bs = _weights([1], K, N, torch.float64, g)
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    y0 = torch.zeros(S, N, dtype=torch.float64)
    spec = _spec(ts, [1], False, dropout=[p], seed=77, backend=backend)
    out1 = LoraDelta.apply(x, y0.clone(), spec, *As, *Bs)
    out2 = LoraDelta.apply(x, y0.clone(), spec, *As, *Bs)
    assert torch.equal(out1, out2)
    other = LoraDelta.apply(x, y0.clone(), _spec(ts, [1], False, dropout=[p], seed=78, backend=backend), *As, *Bs)
    assert not torch.equal(out1, other)
    # rank-1 adapter with B = e_0: out[t, 0] = scale * sum_k x~[t,k] A[0,k]; recover the mask from dx
    dy = torch.zeros(S, N, dtype=torch.float64)
    dy[:, 0] = 1
    (dx,) = torch.autograd.grad(out1, x, dy)
    kept = dx != 0
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 0.03, rate
    # dx[t,k] = scale * B[0,0] * A[0,k] * keep / (1-p): the forward with that mask reproduces out1
    scale = spec.table.scales[0].item()
    x_dropped = x.detach() * kept / (1 - p)
    want = scale * (x_dropped @ As[0].detach().T) @ Bs[0].detach().T
    torch.testing.assert_close(out1.detach(), want)


def test_absent_adapters_get_zero_gradients():
    g = torch.Generator().manual_seed(3)
    S, K, N, ranks = 9, 4, 5, [2, 3, 1]
    ts = torch.tensor([0, 0, 2, -1, 0, 2, 2, -1, 0])  # slot 1 has no tokens
    spec = _spec(ts, ranks, False)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g, requires_grad=True)
    out = LoraDelta.apply(x, torch.zeros(S, N), spec, *As, *Bs)
    out.sum().backward()
    assert torch.count_nonzero(As[1].grad) == 0 and torch.count_nonzero(Bs[1].grad) == 0
    assert torch.count_nonzero(As[0].grad) > 0 and torch.count_nonzero(Bs[2].grad) > 0
    assert torch.count_nonzero(x.grad[3]) == 0  # base rows get no LoRA input gradient


@pytest.mark.parametrize("ranks", [[4, 4, 4], [2, 5, 3]], ids=["equal-ranks", "mixed-ranks"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16], ids=["fp32-weights", "fp16-weights"])
def test_gradients_split_per_adapter(ranks, wdtype):
    """Per-adapter gradients come out of one buffer: right values, each parameter's dtype, shape and layout."""
    g = torch.Generator().manual_seed(4)
    S, K, N = 23, 7, 9
    ts = random_token_slots(S, len(ranks), g)
    spec = _spec(ts, ranks, False)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g)
    dy = torch.randn(S, N, generator=g)
    LoraDelta.apply(x, torch.zeros(S, N), spec, *As, *Bs).backward(dy)
    low = [w.detach().to(wdtype).requires_grad_() for w in [*As, *Bs]]
    LoraDelta.apply(x, torch.zeros(S, N), spec, *low).backward(dy)
    tol = 1e-5 if wdtype == torch.float32 else 2e-2
    for w_ref, w in zip([*As, *Bs], low, strict=True):
        assert w.grad.dtype == w.dtype and w.grad.shape == w.shape and w.grad.is_contiguous()
        torch.testing.assert_close(w.grad.float(), w_ref.grad, rtol=tol, atol=tol)


@pytest.fixture
def mask_buffers(monkeypatch):
    """Shapes of the packed dropout-mask buffers the Triton backend allocates, in call order."""
    from fast_multilora.kernels import dropout as D

    buffers = []
    monkeypatch.setattr(get_backend("triton", torch.device("cpu")).k, "keep_bits_buffer",
                        lambda t: buffers.append(t.shape) or D.keep_bits_buffer(t))
    return buffers


@pytest.mark.parametrize("fused", [False, True], ids=["LoraDelta", "FusedLinearDelta"])
def test_stored_dropout_mask_equals_redrawn(fused, mask_buffers, monkeypatch):
    """The Triton backend's training forward stores the dropout mask and its backward reads it; with
    ``FML_STORE_DROPOUT_MASK=0`` (``function.STORE_DROPOUT_MASK``) the backward redraws it from the seed. Both give
    the same output and gradients; the mask buffer is allocated only when a gradient will be taken."""
    _need_interpreter("triton")
    from fast_multilora import function as F

    g = torch.Generator().manual_seed(5)
    S, K, N, ranks = 21, 19, 7, [2, 0, 3]  # K not a multiple of 8: a partial mask byte per row
    ts = random_token_slots(S, len(ranks), g)
    spec = _spec(ts, ranks, True, backend="triton", dropout=[0.3, 0.0, 0.5], seed=4321)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g, requires_grad=True)
    W, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    y0 = torch.randn(S, N, generator=g)
    dy = torch.randn(S, N, generator=g)
    buffers = mask_buffers

    def run():
        out = (FusedLinearDelta.apply(x, W, b, spec, *As, *Bs) if fused
               else LoraDelta.apply(x, y0.clone(), spec, *As, *Bs))
        return (out, *torch.autograd.grad(out, (x, *As, *Bs), dy))

    stored = run()
    assert len(buffers) == 1, "the training forward did not store its mask"
    monkeypatch.setattr(F, "STORE_DROPOUT_MASK", False)
    redrawn = run()
    assert len(buffers) == 1, "a mask buffer was allocated with FML_STORE_DROPOUT_MASK=0"
    for a, r in zip(stored, redrawn, strict=True):
        assert torch.equal(a, r)
    monkeypatch.setattr(F, "STORE_DROPOUT_MASK", True)
    with torch.no_grad():  # no gradient: nothing to store (the patched layers set spec.grad from the grad mode)
        LoraDelta.apply(x, y0.clone(), dataclasses.replace(spec, grad=False), *As, *Bs)
    assert len(buffers) == 1, "a mask buffer was allocated without a gradient to take"


def test_patched_layers_store_masks_only_when_training(mask_buffers):
    """A patched model with active LoRA dropout stores masks in a forward that autograd records, not under
    ``torch.no_grad`` (evaluation with dropout modules left in train mode)."""
    _need_interpreter("triton")
    from models import peft_model

    import fast_multilora

    model = peft_model("llama", dropout=0.3)
    fast_multilora.patch(model, backend="triton", share_shrink=False)
    model.train()
    buffers = mask_buffers
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(0))
    names = ["a0", "__base__", "a1"]
    with torch.no_grad():
        model(input_ids=ids, adapter_names=names)
    assert buffers == [], "masks stored under torch.no_grad"
    model(input_ids=ids, adapter_names=names).logits.sum().backward()
    assert len(buffers) == 2 * 7, "every LoRA Linear of both layers stores its mask in a training forward"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_grad_runs_the_forward_without_the_function(backend, monkeypatch):
    """With autograd off, ``function.run`` calls a Function's forward directly (no ``apply``): the same outputs as
    through ``apply``, nothing recorded, and ``apply`` itself not called."""
    _need_interpreter(backend)
    from fast_multilora import function as F

    g = torch.Generator().manual_seed(7)
    S, K, N, ranks = 19, 6, 5, [2, 0, 3]
    ts = random_token_slots(S, len(ranks), g)
    spec = _spec(ts, ranks, False, backend=backend, dropout=[0.25, 0.0, 0.5], seed=99)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g)
    y = torch.randn(S, N, generator=g)
    W = torch.randn(N, K, generator=g)
    with torch.no_grad():  # the reference: through apply (a spy would not see a direct forward call)
        want_fused = FusedLinearDelta.apply(x, W, None, dataclasses.replace(spec, grad=False), *As, *Bs)
        want_delta = LoraDelta.apply(x, y.clone(), dataclasses.replace(spec, grad=False), *As, *Bs)
    calls = []
    for cls in (FusedLinearDelta, LoraDelta):
        monkeypatch.setattr(cls, "apply", lambda *a, _c=cls: calls.append(_c))
    with torch.no_grad():
        got_fused = F.run(FusedLinearDelta, x, W, None, dataclasses.replace(spec, grad=False), *As, *Bs)
        y2 = y.clone()
        got_delta = F.run(LoraDelta, x, y2, dataclasses.replace(spec, grad=False), *As, *Bs)
    assert not calls
    assert got_delta is y2, "LoraDelta adds into y in place"
    assert torch.equal(got_fused, want_fused) and torch.equal(got_delta, want_delta)
    assert got_fused.grad_fn is None and not got_fused.requires_grad
    with torch.enable_grad():  # autograd on: through apply
        F.run(FusedLinearDelta, x, W, None, spec, *As, *Bs)
    assert calls == [FusedLinearDelta]


@pytest.mark.parametrize("ranks", [(4, 4, 4), (2, 5, 1)], ids=["equal", "unequal"])
def test_split_grads_of_a_blocked_buffer(ranks):
    """A flat blocked dB (adapter a's [N, r_a] gradient contiguous at offset sum(r_<a) * N) splits into views of the
    buffer, each [N, r_a], contiguous, in the buffer's dtype; another parameter dtype casts that piece."""
    from fast_multilora.function import _split_grads

    N = 6
    flat = torch.randn(sum(ranks) * N, dtype=torch.bfloat16)
    got = _split_grads(flat, ranks, [torch.bfloat16] * len(ranks), dim=1, n_rows=N)
    off = 0
    for g, r in zip(got, ranks, strict=True):
        assert g.shape == (N, r) and g.is_contiguous() and g.dtype == torch.bfloat16
        assert g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr(), "a copy, not a view"
        assert torch.equal(g, flat[off * N : (off + r) * N].view(N, r))
        off += r
    mixed = _split_grads(flat, ranks, [torch.float32] + [torch.bfloat16] * (len(ranks) - 1), dim=1, n_rows=N)
    assert mixed[0].dtype == torch.float32 and torch.equal(mixed[0], got[0].float())


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_triton_functions_with_nan_filled_allocations(grouped, monkeypatch):
    """Every float buffer ``torch.empty`` hands out while the Triton-backed Functions run forward and backward is
    NaN-filled (as uninitialised memory may be): the outputs and gradients still equal the torch backend's, so no
    kernel reads a cell it did not write (``dh`` is allocated without a zero fill on this path)."""
    _need_interpreter("triton")
    g = torch.Generator().manual_seed(11)
    S, K, N, ranks = 23, 7, 9, [3, 0, 2, 3]
    ts = random_token_slots(S, len(ranks), g)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    W = torch.randn(N, K, generator=g)
    x = torch.randn(S, K, generator=g)
    dy = torch.randn(S, N, generator=g)

    def run_fused(backend):
        spec = _spec(ts, ranks, grouped, backend=backend)
        xx = x.clone().requires_grad_()
        out = FusedLinearDelta.apply(xx, W, None, spec, *As, *Bs)
        grads = torch.autograd.grad(out, (xx, *As, *Bs), dy)
        return out.detach(), grads

    want_out, want_grads = run_fused("torch")
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    out, grads = run_fused("triton")
    monkeypatch.undo()
    torch.testing.assert_close(out, want_out, rtol=2e-5, atol=2e-5)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
