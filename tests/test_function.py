"""``function.LoraLinear``, the one layer Function: float64 gradcheck along every path (base added or fused,
``lora_bias``, dropout), dropout semantics, stored and redrawn masks, zero
grads for absent adapters, per-adapter gradient splits, and no reads of unwritten memory."""

import os
from types import SimpleNamespace

import pytest
import torch
from helpers import make_segments, make_table, random_token_slots

from fast_multilora.function import LayerCall, LoraLinear, get_backend

CPU = torch.device("cpu")
BACKENDS = ["torch", "triton"]
FAMILIES = [pytest.param(False, id="sgemm"), pytest.param(True, id="chunked")]


def _call(ts, ranks, grouped, backend="torch", dropout=None, seed=None, scales=None, **kw):
    table = make_table(ranks, scales=scales, dropout=dropout)._replace(
        slots=tuple(i for i, r in enumerate(ranks) if r > 0))
    return LayerCall(backend=get_backend(backend, CPU), segs=make_segments(ts, grouped), table=table,
                     ranks=tuple(r for r in ranks if r > 0), seed=seed, **kw)


def delta(x, y, call, *w):
    """``y + delta``, the base output given (the unfused path)."""
    return LoraLinear.apply(x, y, None, None, call, *w)


def fused(x, W, b, call, *w):
    """``x Wᵀ + b + delta`` with the base GEMM inside the Function."""
    return LoraLinear.apply(x, None, W, b, call, *w)


def _need_interpreter(backend):
    """These tests build CPU tensors: the Triton backend runs them only under the interpreter."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")


def _weights(ranks, K, N, dtype, g):
    As = [torch.randn(r, K, generator=g, dtype=dtype).requires_grad_() for r in ranks if r > 0]
    Bs = [torch.randn(N, r, generator=g, dtype=dtype).requires_grad_() for r in ranks if r > 0]
    return As, Bs


def _gradcheck(fn, inputs, backend):
    """float64 gradcheck of ``fn`` with respect to every one of ``inputs``.

    Through the Triton interpreter (each layer call costs a second of a core): fast mode (a random projection
    ``v^T J u`` of the Jacobian instead of every entry) of the inputs laid end to end in one vector, so that one
    perturbation moves them all -- two calls of ``fn`` where fast mode per input makes two per input. The projection
    is then a sum over the inputs, so the relative bound is 1e-6 of it (gradcheck's default 1e-3 is per input): a
    wrong gradient of any input moves the sum by its own error, and fp64 central differences of these cubic functions
    are exact to ~1e-9 relative."""
    if backend != "triton":
        return torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)
    assert all(t.requires_grad for t in inputs), "every input is checked: each must require grad"
    shapes = [t.shape for t in inputs]
    flat = torch.cat([t.detach().reshape(-1) for t in inputs]).requires_grad_()

    def on_flat(v):
        return fn(*(part.view(shape) for part, shape in zip(v.split([s.numel() for s in shapes]), shapes,
                                                             strict=True)))

    return torch.autograd.gradcheck(on_flat, (flat,), eps=1e-6, atol=1e-7, rtol=1e-6, fast_mode=True)


def _seeded(fn):
    """The torch backend draws its dropout mask from torch's RNG: a fixed RNG state makes one fixed function."""
    def wrapped(*args):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return fn(*args)
    return wrapped


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("dropout", [False, True], ids=["p0", "dropout"])
def test_gradcheck_float64_unfused_and_fused(grouped, backend, dropout):
    """float64 gradcheck of x, y, every A and every B; the fused path equals the base linear plus the delta."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(0)
    S, K, N, ranks = 13, 5, 6, [2, 0, 1, 3]
    ts = random_token_slots(S, len(ranks), g)
    call = _call(ts, ranks, grouped, backend, dropout=[0.5, 0, 0.25, 0.1] if dropout else None,
                 seed=1234 if dropout else None)
    As, Bs = _weights(ranks, K, N, torch.float64, g)
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(S, N, generator=g, dtype=torch.float64, requires_grad=True)
    W, b = torch.randn(N, K, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    f_delta = _seeded(lambda x, y, *w: delta(x, y.clone(), call, *w))  # the Function adds into y in place
    assert _gradcheck(f_delta, (x, y, *As, *Bs), backend)
    fcall = _call(ts, ranks, grouped, backend, dropout=[0.5, 0, 0.25, 0.1] if dropout else None,
                  seed=1234 if dropout else None, fused=True)
    f_fused = _seeded(lambda x, *w: fused(x, W, b, fcall, *w))
    assert _gradcheck(f_fused, (x, *As, *Bs), backend)
    torch.testing.assert_close(f_fused(x, *As, *Bs), f_delta(x, torch.nn.functional.linear(x, W, b), *As, *Bs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64_lora_bias(backend):
    """``lora_bias``: each adapter's B bias, scaled, on its tokens only; gradcheck of x, A, B and the biases."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(2)
    S, K, N, ranks = 10, 4, 3, [2, 1, 0]
    ts = random_token_slots(S, len(ranks), g)
    bias_rows = torch.where(ts == 0, 0, torch.where(ts == 1, 1, 2))
    call = _call(ts, ranks, False, backend, has_bias=True, bias_rows=bias_rows)
    As, Bs = _weights(ranks, K, N, torch.float64, g)
    biases = [torch.randn(N, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    fn = lambda x, *w: delta(x, torch.zeros(S, N, dtype=torch.float64), call, *w)
    assert _gradcheck(fn, (x, *As, *Bs, *biases), backend)
    out = fn(x, *As, *Bs, *biases)
    plain = delta(x, torch.zeros(S, N, dtype=torch.float64), _call(ts, ranks, False, backend), *As, *Bs)
    scales = call.table.scales.double()
    want = plain + torch.stack([scales[0] * biases[0], scales[1] * biases[1], torch.zeros(N, dtype=torch.float64)])[
        bias_rows]
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_keep_rate_and_consistency(backend):
    """Reproducible under a seed (Triton) or an RNG state (torch), keep-rate ~ 1-p, and the gradient uses the
    forward's mask (Triton: the mask the forward stored, packed)."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(2)
    S, K, N, p = 64, 64, 8, 0.3
    ts = torch.zeros(S, dtype=torch.long)
    As, Bs = _weights([1], K, N, torch.float64, g)
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    y0 = torch.zeros(S, N, dtype=torch.float64)
    call = _call(ts, [1], False, backend, dropout=[p], seed=77, store_mask=True)
    torch.manual_seed(5)
    out1 = delta(x, y0.clone(), call, *As, *Bs)
    torch.manual_seed(5)
    out2 = delta(x, y0.clone(), call, *As, *Bs)
    assert torch.equal(out1, out2)
    other = delta(x, y0.clone(), _call(ts, [1], False, backend, dropout=[p], seed=78), *As, *Bs)
    assert not torch.equal(out1, other)
    # rank-1 adapter with B = e_0: out[t, 0] = scale * sum_k x~[t,k] A[0,k]; recover the mask from dx
    dy = torch.zeros(S, N, dtype=torch.float64)
    dy[:, 0] = 1
    (dx,) = torch.autograd.grad(out1, x, dy)
    kept = dx != 0
    rate = kept.double().mean().item()
    assert abs(rate - (1 - p)) < 0.03, rate
    scale = call.table.scales[0].item()
    want = scale * ((x.detach() * kept / (1 - p)) @ As[0].detach().T) @ Bs[0].detach().T
    torch.testing.assert_close(out1.detach(), want)


def test_absent_adapters_get_zero_gradients():
    g = torch.Generator().manual_seed(3)
    S, K, N, ranks = 9, 4, 5, [2, 3, 1]
    ts = torch.tensor([0, 0, 2, -1, 0, 2, 2, -1, 0])  # slot 1 has no tokens
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g, requires_grad=True)
    delta(x, torch.zeros(S, N), _call(ts, ranks, False), *As, *Bs).sum().backward()
    assert torch.count_nonzero(As[1].grad) == 0 and torch.count_nonzero(Bs[1].grad) == 0
    assert torch.count_nonzero(As[0].grad) > 0 and torch.count_nonzero(Bs[2].grad) > 0
    assert torch.count_nonzero(x.grad[3]) == 0  # base rows get no LoRA input gradient


@pytest.mark.parametrize("group", [False, True], ids=["one_process", "process_group"])
@pytest.mark.parametrize("model_kind", ["llama", "moe"])
def test_the_per_parameter_path_gives_adapters_without_rows_no_gradient(model_kind, group, monkeypatch):
    """A patched model on the per-parameter path (``adapter_store=False``; so are ``lora_bias`` layers and
    FSDP2-sharded ones), Linear layers and MoE expert wrappers: an adapter without rows in the batch gets no gradient
    (``.grad`` ``None``, as under stock PEFT: torch's optimizers skip it), the batch's adapters theirs; under a
    process group (DDP and FSDP2 reduce every parameter they hold, on every rank alike) exact zeros instead."""
    from test_moe import moe_model
    from test_store import many_model

    import fast_multilora

    model = many_model(4) if model_kind == "llama" else moe_model("mixtral", "eager")
    fast_multilora.patch(model, backend="torch", adapter_store=False)
    model.train()
    if group:
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    names = sorted(model.peft_config)
    rows = [names[0], names[2], "__base__"] if model_kind == "llama" else [names[1], "__base__", names[1]]
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(0))
    fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=rows).logits, ids, rows).backward()
    seen = set()
    for n, p in model.named_parameters():
        if "lora_" not in n:
            continue
        name = next(a for a in names if f".{a}." in n)
        seen.add(name)
        if name in rows:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        elif group:
            assert p.grad is not None and not p.grad.any(), n
        else:
            assert p.grad is None, n
    assert seen == set(names)


@pytest.mark.parametrize("ranks", [[4, 4, 4], [2, 5, 3]], ids=["equal-ranks", "mixed-ranks"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float16], ids=["fp32-weights", "fp16-weights"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_split_per_adapter(ranks, wdtype, backend):
    """Per-adapter gradients come out of one buffer: right values, each parameter's dtype, shape and layout."""
    _need_interpreter(backend)
    g = torch.Generator().manual_seed(4)
    S, K, N = 23, 7, 9
    ts = random_token_slots(S, len(ranks), g)
    call = _call(ts, ranks, False, backend, in_place=True)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g)
    dy = torch.randn(S, N, generator=g)
    delta(x, torch.zeros(S, N), call, *As, *Bs).backward(dy)
    low = [w.detach().to(wdtype).requires_grad_() for w in [*As, *Bs]]
    delta(x.to(wdtype), torch.zeros(S, N, dtype=wdtype), call, *low).backward(dy.to(wdtype))
    tol = 1e-5 if wdtype == torch.float32 else 2e-2
    for w_ref, w in zip([*As, *Bs], low, strict=True):
        assert w.grad.dtype == w.dtype and w.grad.shape == w.shape and w.grad.is_contiguous()
        torch.testing.assert_close(w.grad.float(), w_ref.grad, rtol=tol, atol=tol * w_ref.grad.abs().max().item())


@pytest.fixture
def mask_buffers(monkeypatch):
    """Shapes of the packed dropout-mask buffers the Triton backend allocates, in call order."""
    from fast_multilora.kernels import dropout as D

    buffers = []
    monkeypatch.setattr(get_backend("triton", CPU).k, "keep_bits_buffer",
                        lambda t: buffers.append(t.shape) or D.keep_bits_buffer(t))
    return buffers


@pytest.mark.parametrize("fuse", [False, True], ids=["added", "fused"])
@pytest.mark.parametrize("in_place", [False, True], ids=["concatenated", "in-place"])
@pytest.mark.interpreter
def test_stored_dropout_mask_equals_redrawn(fuse, in_place, mask_buffers):
    """With ``store_mask`` the Triton backend's forward stores the dropout mask and its backward reads it; without,
    the backward redraws it from the seed. Both give the same output and gradients, with the weights read in place
    or concatenated."""
    _need_interpreter("triton")
    g = torch.Generator().manual_seed(5)
    S, K, N, ranks = 21, 19, 7, [2, 0, 3]  # K not a multiple of 8: a partial mask byte per row
    ts = random_token_slots(S, len(ranks), g)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g, requires_grad=True)
    W, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    y0 = torch.randn(S, N, generator=g)
    dy = torch.randn(S, N, generator=g)

    def run(store):
        call = _call(ts, ranks, True, "triton", dropout=[0.3, 0.0, 0.5], seed=4321, store_mask=store, fused=fuse,
                     in_place=in_place)
        out = fused(x, W, b, call, *As, *Bs) if fuse else delta(x, y0.clone(), call, *As, *Bs)
        return (out, *torch.autograd.grad(out, (x, *As, *Bs), dy))

    stored = run(True)
    assert len(mask_buffers) == 1, "the forward did not store its mask"
    redrawn = run(False)
    assert len(mask_buffers) == 1, "a mask buffer was allocated without store_mask"
    for a, r in zip(stored, redrawn, strict=True):
        assert torch.equal(a, r)


@pytest.mark.interpreter
def test_patched_layers_store_masks_only_when_training(mask_buffers):
    """A patched model with active LoRA dropout stores masks in a forward that autograd records, not under
    ``torch.no_grad`` (evaluation with dropout modules left in train mode), and not with
    ``PatchConfig(store_dropout_mask=False)``."""
    _need_interpreter("triton")
    from models import peft_model

    import fast_multilora

    model = peft_model("llama", dropout=0.3)
    fast_multilora.patch(model, backend="triton")
    model.train()
    ids = torch.randint(0, 97, (3, 5), generator=torch.Generator().manual_seed(0))
    names = ["a0", "__base__", "a1"]
    with torch.no_grad():
        model(input_ids=ids, adapter_names=names)
    assert mask_buffers == [], "masks stored under torch.no_grad"
    model(input_ids=ids, adapter_names=names).logits.sum().backward()
    assert len(mask_buffers) == 2 * 7, "every LoRA Linear of both layers stores its mask in a training forward"
    fast_multilora.patch(model, backend="triton", store_dropout_mask=False)
    model(input_ids=ids, adapter_names=names).logits.sum().backward()
    assert len(mask_buffers) == 2 * 7, "a mask stored with store_dropout_mask=False"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_grad_runs_the_forward_without_apply(backend, monkeypatch):
    """With autograd off, ``function.run`` calls the Function's forward directly (no ``apply``): the same outputs
    as through ``apply``, nothing recorded, and ``apply`` itself not called."""
    _need_interpreter(backend)
    from fast_multilora import function as F

    g = torch.Generator().manual_seed(7)
    S, K, N, ranks = 19, 6, 5, [2, 0, 3]
    ts = random_token_slots(S, len(ranks), g)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x, y, W = torch.randn(S, K, generator=g), torch.randn(S, N, generator=g), torch.randn(N, K, generator=g)
    c_add, c_fused = _call(ts, ranks, False, backend), _call(ts, ranks, False, backend, fused=True)
    with torch.no_grad():  # the reference: through apply (a spy would not see a direct forward call)
        want_fused = fused(x, W, None, c_fused, *As, *Bs)
        want_delta = delta(x, y.clone(), c_add, *As, *Bs)
    calls = []
    monkeypatch.setattr(LoraLinear, "apply", lambda *a: calls.append(a))
    with torch.no_grad():
        got_fused = F.run(LoraLinear, x, None, W, None, c_fused, *As, *Bs)
        y2 = y.clone()
        got_delta = F.run(LoraLinear, x, y2, None, None, c_add, *As, *Bs)
    assert not calls
    assert got_delta is y2, "the delta is added into y in place"
    assert torch.equal(got_fused, want_fused) and torch.equal(got_delta, want_delta)
    assert got_fused.grad_fn is None and not got_fused.requires_grad
    with torch.enable_grad():  # autograd on: through apply
        F.run(LoraLinear, x, None, W, None, c_fused, *As, *Bs)
    assert len(calls) == 1


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


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("stored", [False, True], ids=["params", "stored"])
def test_triton_function_with_nan_filled_allocations(grouped, stored, monkeypatch):
    """Every float buffer ``torch.empty`` hands out while the Triton-backed Function runs forward and backward is
    NaN-filled (as uninitialised memory may be): outputs and gradients still equal the torch backend's, so no kernel
    reads a cell it did not write (``dh`` of a lone call is allocated without a zero fill)."""
    _need_interpreter("triton")
    g = torch.Generator().manual_seed(11)
    S, K, N, ranks = 23, 7, 9, [3, 0, 2, 3]
    ts = random_token_slots(S, len(ranks), g)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    A2, B2 = _weights(ranks, K, N, torch.float32, g)
    W = torch.randn(N, K, generator=g)
    x = torch.randn(S, K, generator=g)
    dy = torch.randn(S, N, generator=g)

    def run(backend):
        xx = x.clone().requires_grad_()
        if not stored:
            out = fused(xx, W, None, _call(ts, ranks, grouped, backend, fused=True, in_place=True), *As, *Bs)
            return out.detach(), torch.autograd.grad(out, (xx, *As, *Bs), dy)
        # the adapter store's two leaves: A_cat [total_rank, K] and the packed B block (adapter a's [N, r_a] at N * off)
        present = [r for r in ranks if r > 0]
        slots = SimpleNamespace(ranks=tuple(present), N=N, experts=1, b_cat=lambda b: torch.cat(
            [p.view(N, r) for p, r in zip(b.split([N * r for r in present]), present, strict=True)], 1),
            packed_grad=lambda g: torch.cat([p.reshape(-1) for p in g.split(present, 1)]))
        a_leaf = torch.cat([a.detach() for a in A2]).requires_grad_()
        b_leaf = torch.cat([b.detach().reshape(-1) for b in B2]).requires_grad_()
        out = fused(xx, W, None, _call(ts, ranks, grouped, backend, fused=True, stored=slots), a_leaf, b_leaf)
        return out.detach(), torch.autograd.grad(out, (xx, a_leaf, b_leaf), dy)

    want_out, want_grads = run("torch")
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    out, grads = run("triton")
    monkeypatch.undo()
    torch.testing.assert_close(out, want_out, rtol=2e-5, atol=2e-5)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
