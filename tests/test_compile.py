"""``torch.library`` custom ops (``fast_multilora.ops``): opcheck, and ``torch.compile`` without graph breaks.

Runs on CPU with the Triton interpreter (tests/conftest.py). ``backend="aot_eager"``: AOTAutograd traces the forward
and backward graphs through the ops' fake implementations and runs them eagerly (Inductor would need a C++ compiler
for the CPU graph around the ops and adds nothing the ops themselves could be tested for).

* opcheck runs its four checks (schema, autograd registration, fake tensors, AOT dispatch with dynamic shapes) on
  every op, both segment families, including ``lora_expand``, which mutates ``y``: AOT dispatch functionalises it
  (``auto_functionalized_v2``), so every check applies. The building-block ops are not differentiable (only
  ``lora_delta`` is), so their inputs do not require grad.
* Compiled results equal eager ones bitwise (the same kernels run on the same values) and the reference within fp32
  tolerance (rtol 1e-5, atol 1e-5 of max|ref|: dot products of <= 23 terms, see tests/test_kernels_forward.py).
"""

import pytest
import torch
from fast_multilora.kernels.dropout import dropout_keep_mask
from functorch.compile import make_boxed_func
from helpers import make_segments, make_table
from models import peft_model, twin

import fast_multilora
from fast_multilora import ops
from fast_multilora import reference as ref

S, K, N = 37, 23, 29
RANKS = [1, 4, 0, 3]
DROPOUT = [0.0, 0.3, 0.0, 0.1]
SEED = 1234
FAMILIES = [pytest.param(False, id="sgemm"), pytest.param(True, id="chunked")]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _token_slots():
    """Interleaved, unsorted token -> slot layout with base tokens (-1) and tokens of the rank-0 slot."""
    g = torch.Generator().manual_seed(5)
    return torch.randint(-1, len(RANKS), (S,), generator=g)


def _problem(grouped, device, dropout=False):
    g = torch.Generator().manual_seed(7)
    ts = _token_slots()
    R = sum(RANKS)
    t = {
        "x": torch.randn(S, K, generator=g), "y": torch.randn(S, N, generator=g),
        "A": torch.randn(R, K, generator=g) / K**0.5, "B": torch.randn(N, R, generator=g),
        "h": torch.randn(S, max(RANKS), generator=g), "dy": torch.randn(S, N, generator=g),
    }
    t = {k: v.to(device) for k, v in t.items()}
    table = make_table(RANKS, dropout=DROPOUT if dropout else None, device=device)
    return t, make_segments(ts, grouped, device=device), table


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("op", ["lora_shrink", "lora_expand", "lora_expand_bwd", "lora_shrink_bwd", "lora_delta"])
def test_opcheck(op, grouped, device):
    t, segs, table = _problem(grouped, device, dropout=True)
    L = ops._layout(segs, table)
    if op == "lora_delta":
        for k in ("x", "y", "A", "B"):
            t[k].requires_grad_()
    args = {
        "lora_shrink": (t["x"], t["A"], *L, 1, SEED),
        "lora_expand": (t["h"], t["B"], t["y"], *L, 1, 0),
        "lora_expand_bwd": (t["dy"], t["h"], t["B"], *L, 1, 0, None),
        "lora_shrink_bwd": (t["h"], t["x"], t["A"], *L, 1, SEED, True),
        "lora_delta": (t["x"], t["y"], t["A"], t["B"], *L, SEED),
    }[op]
    result = torch.library.opcheck(getattr(torch.ops.fast_multilora, op), args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("grouped", FAMILIES)
def test_opcheck_optional_outputs(grouped, device):
    """``lora_shrink_bwd`` without ``need_dx`` (empty ``dx``) and ``lora_expand_bwd`` with a starting ``dh``."""
    t, segs, table = _problem(grouped, device)
    L = ops._layout(segs, table)
    for op, args in ((torch.ops.fast_multilora.lora_shrink_bwd, (t["h"], t["x"], t["A"], *L, 1, None, False)),
                     (torch.ops.fast_multilora.lora_expand_bwd, (t["dy"], t["h"], t["B"], *L, 1, 0, t["h"]))):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
@pytest.mark.parametrize("grouped", FAMILIES)
def test_compiled_delta_fullgraph(grouped, dropout, device):
    """``torch.compile(fullgraph=True)`` of delta + loss: the output and (x, A, B) grads of eager and the reference."""
    t, segs, table = _problem(grouped, device, dropout)
    seed = SEED if dropout else None
    w = torch.randn(S, N, generator=torch.Generator().manual_seed(9)).to(device)

    def fn(x, A, B):
        out = ops.lora_delta(x, t["y"], A, B, segs, table, seed)
        return out, (out * w).square().sum()

    def run(f):
        leaves = [t[k].clone().requires_grad_() for k in ("x", "A", "B")]
        out, loss = f(*leaves)
        return out.detach(), torch.autograd.grad(loss, leaves)

    got_out, got_grads = run(torch.compile(fn, fullgraph=True, backend="aot_eager"))
    eager_out, eager_grads = run(fn)
    assert torch.equal(got_out, eager_out)
    for got, want in zip(got_grads, eager_grads, strict=True):
        assert torch.equal(got, want)

    keep = dropout_keep_mask(seed, segs, table, K) if dropout else None

    def reference(x, A, B):
        out = ref.lora_expand(ref.lora_shrink(x, A, segs, table, keep=keep), B, segs, table, t["y"].clone())
        return out, (out * w).square().sum()

    want_out, want_grads = run(reference)
    for got, want in zip((got_out, *got_grads), (want_out, *want_grads), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())

    explanation = torch._dynamo.explain(fn)(*(t[k].clone().requires_grad_() for k in ("x", "A", "B")))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compiled_patched_model(device):
    """A whole patched tiny Llama under ``torch.compile`` (default ``fullgraph=False``, AOTAutograd), first forward
    call: logits and LoRA grads equal eager bitwise, and the compiled forward and backward graphs hold all four
    custom ops, so the LoRA delta is traced, not run eagerly between graphs. The graph breaks of this call (where the
    batch plan is built on the host, and ``Tensor.backward``) are listed in docs/usage.md."""
    from torch._dynamo.backends.common import aot_autograd

    names = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]
    model = peft_model("llama").to(device)
    eager = twin(model)
    fast_multilora.patch(model, backend="triton")
    # traced calls take the per-module path (LoraDelta through the ops; FusedLinearDelta is eager only), so the
    # bitwise comparison is with that path run eagerly
    fast_multilora.patch(eager, backend="triton", fuse_base=False)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (len(names), 11), generator=g).to(device)
    w = torch.randn(len(names), 11, 97, generator=g).to(device)

    def step(m):
        out = m(input_ids=ids, adapter_names=names).logits
        (out * w).sum().backward()
        return out.detach()

    seen = set()

    def record(gm, _example_inputs):
        for node in gm.graph.nodes:
            for target in (node.target, *node.args[:1]):  # a mutating op sits under auto_functionalized_v2
                if isinstance(target, torch._ops.OpOverload) and target.namespace == "fast_multilora":
                    seen.add(target.name())
        return make_boxed_func(gm)

    got = torch.compile(step, backend=aot_autograd(fw_compiler=record, bw_compiler=record))(model)
    want = step(eager)
    assert torch.equal(got, want)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want_grads = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert set(grads) == set(want_grads) and grads
    for n, gw in want_grads.items():
        assert torch.equal(grads[n], gw), n
    assert seen == {f"fast_multilora::{op}" for op in ("lora_shrink", "lora_expand", "lora_expand_bwd",
                                                       "lora_shrink_bwd")}
