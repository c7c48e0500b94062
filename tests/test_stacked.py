"""Siblings declared at patch time (q/k/v, gate/up) share one shrink pass when called on one input
(``fast_multilora.stacked``).

Every check compares against ``share_shrink=False`` (each layer alone) and, where it applies, against stock PEFT
running each sample with its adapter alone; a spy on the backends' ``shrink`` proves which path ran.
"""

import warnings

import pytest
import torch
from models import LLAMA_TARGETS, peft_model, twin
from peft import LoraConfig, get_peft_model

import fast_multilora
from fast_multilora.function import LoraLinear, TorchBackend, TritonBackend

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]  # unsorted, repeated, with a base row
SHARED_PER_LAYER = [3, 1, 2, 1]  # stack_num of each shrink of a decoder layer: q/k/v, o, gate/up, down
UNSHARED_PER_LAYER = [1] * 7


def configs(dropout=0.0, rank_pattern=None):
    """Three adapters with different ranks and scalings on every sibling of a group (so q/k/v and gate/up agree)."""
    common = dict(init_lora_weights=False, lora_dropout=dropout)
    return {
        "a0": LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_TARGETS, rank_pattern=rank_pattern or {}, **common),
        "a1": LoraConfig(r=8, lora_alpha=4, target_modules=LLAMA_TARGETS, use_rslora=True, **common),
        "a2": LoraConfig(r=2, lora_alpha=3, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
                         **common),
    }


def models(backend, share_dropout=False, **cfg):
    """(shared, unshared, stock PEFT) copies of one model with the same weights."""
    shared = peft_model(configs=configs(**cfg))
    unshared, ref = twin(shared), twin(shared)
    fast_multilora.patch(shared, backend=backend, share_dropout=share_dropout)
    fast_multilora.patch(unshared, backend=backend, share_shrink=False)
    return shared, unshared, ref


@pytest.fixture
def shrinks(monkeypatch):
    """The ``stack_num`` of every shrink the backends run, in call order."""
    calls = []
    for cls in (TorchBackend, TritonBackend):
        def spy(self, x, A_cat, segs, table, stack_num, seed, *rest, _orig=cls.shrink, **kw):
            calls.append(stack_num)
            return _orig(self, x, A_cat, segs, table, stack_num, seed, *rest, **kw)

        monkeypatch.setattr(cls, "shrink", spy)
    return calls


def inputs(seed=3, T=9):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (len(NAMES), T), generator=g)
    w = torch.randn(len(NAMES), T, 97, generator=g)  # a different loss weight per logit: every grad path counts
    return ids, w


def embeds(model, ids):
    return model.get_input_embeddings()(ids).detach().requires_grad_()


def lora_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if "lora_" in n and p.grad is not None}


def step(model, ids, w):
    """One weighted forward/backward from input embeddings: (logits, LoRA grads, input grads)."""
    model.zero_grad(set_to_none=True)
    emb = embeds(model, ids)
    out = model(inputs_embeds=emb, adapter_names=NAMES).logits
    (out * w).sum().backward()
    return out.detach(), lora_grads(model), emb.grad


def warm(model, ids):
    """A forward call before the measured one (the path of a call does not depend on earlier calls)."""
    with torch.no_grad():
        model(input_ids=ids, adapter_names=NAMES)


def peft_per_sample(ref, ids, w):
    """Stock PEFT, one sample at a time with its adapter alone: (logits, summed LoRA grads, input grads)."""
    outs, dx = [], []
    for n, p in ref.named_parameters():
        p.requires_grad_("lora_" in n)
    for i, name in enumerate(NAMES):
        emb = embeds(ref, ids[i : i + 1])
        if name == "__base__":
            with ref.disable_adapter():
                out = ref(inputs_embeds=emb).logits
        else:
            ref.set_adapter(name)
            for n, p in ref.named_parameters():  # set_adapter freezes the other adapters
                p.requires_grad_("lora_" in n)
            out = ref(inputs_embeds=emb).logits
        (out * w[i : i + 1]).sum().backward()
        outs.append(out.detach())
        dx.append(emb.grad)
    return torch.cat(outs), lora_grads(ref), torch.cat(dx)


def close(got, want, exact=False, name=""):
    """fp32 closeness; absolute slack scales with the tensor (gradients up to ~1e2 here, summed in another order)."""
    if exact:
        assert torch.equal(got, want), name
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 + 2e-6 * float(want.abs().max()),
                                   msg=lambda m: f"{name}: {m}")


def assert_same(got, want, exact=False):
    out, grads, dx = got
    w_out, w_grads, w_dx = want
    close(out, w_out, exact)
    close(dx, w_dx, exact)
    for n, g in w_grads.items():
        close(grads[n], g, exact, name=n)
    for n in set(grads) - set(w_grads):  # stock PEFT leaves no grad where an adapter saw no token
        assert torch.count_nonzero(grads[n]) == 0, n


def test_groups_declared_and_first_call_shares(shrinks):
    """Groups come from the module tree at patch time (no o_proj: it is in no sibling set); the first forward call
    already shares, and equals the second bit for bit."""
    shared = peft_model(configs=configs())
    unshared = twin(shared)
    report = fast_multilora.patch(shared, backend="torch")
    prefix = "base_model.model.model.layers"
    assert report.shared == [g for i in range(2) for g in (
        tuple(f"{prefix}.{i}.self_attn.{p}_proj" for p in "qkv"),
        (f"{prefix}.{i}.mlp.gate_proj", f"{prefix}.{i}.mlp.up_proj"),
    )]
    assert "sibling group(s) share one shrink pass" in str(report)
    assert fast_multilora.patch(unshared, backend="torch", share_shrink=False).shared == []

    ids, w = inputs()
    first = step(shared, ids, w)
    assert shrinks == SHARED_PER_LAYER * 2  # 7 -> 4 shrinks per decoder layer, from the first call on
    shrinks.clear()
    assert_same(step(shared, ids, w), first, exact=True)
    assert shrinks == SHARED_PER_LAYER * 2
    shrinks.clear()
    warm(unshared, ids)
    assert shrinks == UNSHARED_PER_LAYER * 2


def test_member_called_on_another_input_runs_its_own_stack(shrinks):
    """A declared member called on another tensor than its lead's (as a cross-attention's k/v on the encoder's
    states) takes no slice of the lead's stack: it leads a stack of its own; results equal the unshared path."""

    class CrossToy(_Toy):
        def forward(self, x, mem):
            return self.q(x), self.k(mem), self.v(mem)

    torch.manual_seed(0)
    models_ = []
    for share in (True, False):
        torch.manual_seed(0)
        m = get_peft_model(CrossToy(), LoraConfig(r=4, target_modules=["q", "k", "v"], init_lora_weights=False))
        m.add_adapter("b", LoraConfig(r=4, lora_alpha=5, target_modules=["q", "k", "v"], init_lora_weights=False))
        fast_multilora.patch(m, backend="torch", share_shrink=share)
        models_.append(m)
    names = ["b", "default", "__base__", "b"]
    g = torch.Generator().manual_seed(1)
    x, mem = torch.randn(4, 5, 16, generator=g), torch.randn(4, 5, 16, generator=g)
    outs = []
    for m in models_:
        shrinks.clear()
        q, k, v = m(x, mem, adapter_names=names)
        (q.sum() + (k * v).sum()).backward()
        outs.append(((q, k, v), lora_grads(m), list(shrinks)))
    (o_s, g_s, sh_s), (o_u, g_u, sh_u) = outs
    assert sh_s == [3, 3] and sh_u == [1, 1, 1]  # q leads one stack, k another (v takes k's slice)
    for a, b in zip(o_s, o_u, strict=True):
        torch.testing.assert_close(a, b)
    assert set(g_s) == set(g_u)
    for n in g_u:
        torch.testing.assert_close(g_s[n], g_u[n], msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_outputs_and_grads_match_per_module_and_peft(backend, train, shrinks):
    shared, unshared, ref = models(backend)
    ids, w = inputs()
    for m in (shared, unshared, ref):
        m.train(train)
    warm(shared, ids)
    shrinks.clear()
    got = step(shared, ids, w)
    assert shrinks == SHARED_PER_LAYER * 2
    assert set(got[1]) == {n for n, p in shared.named_parameters() if "lora_" in n}  # every adapter gets a grad
    assert_same(got, step(unshared, ids, w))
    assert_same(got, peft_per_sample(ref, ids, w))


def test_dropout_shares_only_when_asked(shrinks):
    """Under active dropout siblings run the per-module path by default (identical to share_shrink=False for the
    same seeds); with share_dropout=True they share one shrink, a mask per slice; in eval, where dropout is off, the
    shared path equals the per-module one."""
    shared, unshared, _ = models("torch", dropout=0.2)
    ids, w = inputs()
    warm(shared, ids)
    for m in (shared, unshared):
        m.train()
    shrinks.clear()
    torch.manual_seed(7)
    got = step(shared, ids, w)
    assert shrinks == UNSHARED_PER_LAYER * 2
    torch.manual_seed(7)  # the same per-module dropout seeds: identical to share_shrink=False
    assert_same(got, step(unshared, ids, w), exact=True)

    fast_multilora.patch(shared, backend="torch", share_dropout=True)
    warm(shared, ids)
    shrinks.clear()
    out, grads, dx = step(shared, ids, w)
    assert shrinks == SHARED_PER_LAYER * 2
    assert torch.isfinite(out).all() and torch.isfinite(dx).all()
    assert set(grads) == {n for n, p in shared.named_parameters() if "lora_" in n}

    for m in (shared, unshared):
        m.eval()
    shrinks.clear()
    got = step(shared, ids, w)
    assert shrinks == SHARED_PER_LAYER * 2
    assert_same(got, step(unshared, ids, w))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stacked_dropout_gradcheck_float64(backend, stacked_kinds):
    """float64 gradcheck of the input through stacked siblings under dropout: each call reseeds the CPU RNG, so
    every evaluation draws the same per-slice masks, and the backward must regenerate exactly those."""
    torch.manual_seed(0)
    model = get_peft_model(_Toy(), LoraConfig(r=4, target_modules=["q", "k", "v"], init_lora_weights=False,
                                              lora_dropout=0.4))
    model.add_adapter("b", LoraConfig(r=2, lora_alpha=5, target_modules=["q", "k", "v"], init_lora_weights=False,
                                      lora_dropout=0.25))
    model = model.double()
    fast_multilora.patch(model, backend=backend, share_dropout=True)
    model.train()
    names = ["b", "default", "__base__", "b"]
    x = torch.randn(4, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    stacked_kinds.clear()

    def fn(x):
        torch.manual_seed(11)
        q, k, v = model(x, adapter_names=names)
        return q.sum(-1) * 2 + k.sum(-1) - v.pow(2).sum(-1)

    fn(x)
    assert stacked_kinds == ["fused"] * 3
    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stacked_dropout_masks_differ_per_slice(backend):
    """Slices of one stack with the same A weights give different h under dropout (independent masks, as PEFT's
    separate dropout modules), and equal h without it."""
    from fast_multilora.kernels.segments import segments_from_token_slots
    from helpers import make_table

    from fast_multilora.function import get_backend

    be = get_backend(backend, torch.device("cpu"))
    S, K, r = 24, 32, 4
    ts = torch.tensor([0] * 12 + [1] * 12)
    segs = segments_from_token_slots(ts, grouped=False)
    x = torch.randn(S, K)
    A = torch.randn(2 * r, K)
    A_stack = torch.cat([A[:r], A[:r], A[r:], A[r:]])  # slot 0: slices 0 and 1 equal; slot 1 likewise
    for p, same in ((0.0, True), (0.5, False)):
        table = make_table([r, r], dropout=[p, p])
        h, _ = be.shrink(x, A_stack, segs, table, 2, 1234)
        assert torch.allclose(h[:, :r], h[:, r:]) == same, (p, backend)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unequal_ranks_are_not_stacked(backend, shrinks):
    shared, unshared, ref = models(backend, rank_pattern={"k_proj": 6})  # a0: rank 6 on k_proj, 4 on q/v
    ids, w = inputs()
    warm(shared, ids)
    shrinks.clear()
    got = step(shared, ids, w)
    assert shrinks == [2, 1, 1, 2, 1] * 2  # q+v stacked, k alone, o, gate+up, down
    assert_same(got, step(unshared, ids, w))
    assert_same(got, peft_per_sample(ref, ids, w))


@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["p0", "p0.2"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing(reentrant, dropout, shrinks):
    """Recomputation stacks the same siblings and, under dropout, redraws the same per-slice masks (the stack's seed
    comes from the CPU RNG, which checkpointing restores)."""
    shared, unshared, _ = models("torch", dropout=dropout, share_dropout=True)
    ck = twin(shared)
    fast_multilora.patch(ck, backend="torch", share_dropout=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it activation_checkpointing_enable
        ck.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids, w = inputs()
    for m in (shared, unshared, ck):
        m.train()
    warm(shared, ids)
    warm(ck, ids)
    shrinks.clear()
    torch.manual_seed(3)
    got = step(ck, ids, w)
    assert shrinks == SHARED_PER_LAYER * 4  # forward, then the same stacks again in the recompute
    torch.manual_seed(3)
    assert_same(got, step(shared, ids, w))
    if not dropout:  # the per-module path draws other masks
        assert_same(got, step(unshared, ids, w))


class _Toy(torch.nn.Module):
    """Three siblings on one input, with different output widths."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(16, 12), torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.q(x), self.k(x), self.v(x)


def _toy(share):
    torch.manual_seed(0)
    model = get_peft_model(_Toy(), LoraConfig(r=4, target_modules=["q", "k", "v"], init_lora_weights=False))
    model.add_adapter("b", LoraConfig(r=2, lora_alpha=5, target_modules=["q", "k", "v"], init_lora_weights=False))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    fast_multilora.patch(model, backend="torch", share_shrink=share)
    return model


def test_partial_and_repeated_backward_passes(shrinks):
    """A sibling whose output is unused, ``autograd.grad`` for the B weights only, then a second backward pass
    through the retained graph: each pass's gradients equal the unshared path's (a member whose output a pass does
    not use gets no gradient from it)."""
    names = ["b", "default", "__base__", "b"]
    x0 = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for share in (True, False):
        model = _toy(share)
        with torch.no_grad():
            model(x0, adapter_names=names)
        shrinks.clear()
        x = x0.clone().requires_grad_()
        q, k, v = model(x, adapter_names=names)
        assert shrinks == ([3] if share else [1, 1, 1])
        bs = [p for n, p in model.named_parameters() if "lora_B" in n and ".k." not in n]  # q, v
        g_b = torch.autograd.grad((q * q).sum() + v.sum(), bs, retain_graph=True)
        ((q * 2).sum() + (k * k).sum()).backward()  # v unused in this pass
        results.append((g_b, x.grad, lora_grads(model)))
    (gb_s, dx_s, g_s), (gb_u, dx_u, g_u) = results
    for a, b in zip(gb_s, gb_u, strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(dx_s, dx_u)
    assert set(g_s) == set(g_u)
    for n in g_u:
        torch.testing.assert_close(g_s[n], g_u[n], msg=lambda m, n=n: f"{n}: {m}")


@pytest.fixture
def stacked_kinds(monkeypatch):
    """How each stacked member ran: ``"fused"`` (its base GEMM inside the Function) or ``"added"`` (the delta added
    to the base layer's output), in call order."""
    kinds = []
    orig = LoraLinear.forward

    def spy(ctx, x, y, W, b, h, call, *weights):
        if call.stack_num > 1:
            kinds.append("fused" if call.fused else "added")
        return orig(ctx, x, y, W, b, h, call, *weights)

    monkeypatch.setattr(LoraLinear, "forward", staticmethod(spy))
    return kinds


def _keep_output(module, args, out):
    return out


@pytest.mark.parametrize("case", ["fused", "one member hooked", "fuse_base=False"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stacked_members_fuse_their_base(backend, case, shrinks, stacked_kinds):
    """A member whose base is a plain frozen nn.Linear runs its base GEMM with its expand; a member whose base does
    not qualify (here: a forward hook) adds its delta to the
    base output in the same stack. Both mixes equal the per-module path and stock PEFT per sample."""
    shared = peft_model(configs=configs())
    unshared, ref = twin(shared), twin(shared)
    if case == "one member hooked":
        shared.base_model.model.model.layers[0].self_attn.k_proj.base_layer.register_forward_hook(_keep_output)
    fast_multilora.patch(shared, backend=backend, fuse_base=case != "fuse_base=False")
    fast_multilora.patch(unshared, backend=backend, share_shrink=False)
    ids, w = inputs()
    for m in (shared, unshared, ref):
        m.train()
    warm(shared, ids)
    shrinks.clear()
    stacked_kinds.clear()
    got = step(shared, ids, w)
    assert shrinks == SHARED_PER_LAYER * 2
    want_kinds = {"fused": ["fused"] * 10, "fuse_base=False": ["added"] * 10,
                  "one member hooked": ["fused", "added", "fused"] + ["fused"] * 7}[case]
    assert stacked_kinds == want_kinds
    assert_same(got, step(unshared, ids, w))
    assert_same(got, peft_per_sample(ref, ids, w))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stacked_fused_gradcheck_float64(backend, stacked_kinds):
    """float64 gradcheck of the input through a stack of fused members (biased bases)."""
    model = _toy(True).double()
    fast_multilora.patch(model, backend=backend)
    names = ["b", "default", "__base__", "b"]
    x = torch.randn(4, 3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with torch.no_grad():
        model(x, adapter_names=names)
    stacked_kinds.clear()

    def fn(x):
        q, k, v = model(x, adapter_names=names)
        return q.sum(-1) * 2 + k.sum(-1) - v.pow(2).sum(-1)

    assert torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7, fast_mode=backend == "triton")
    assert stacked_kinds[:3] == ["fused"] * 3
