"""MoE experts LoRA (PEFT ``target_parameters`` on fused 3-D expert weights, ``fast_multilora.moe``) in mixed
batches: tiny Qwen3-MoE and Mixtral against stock PEFT running each sample with its adapter alone (outputs, input
and every LoRA gradient), train and eval, both backends (Triton through the interpreter); the virtual-expert delta
against PEFT's own delta weights and float64 gradcheck; the patch report; a clear error for a ParamWrapper this
path cannot run."""

import pytest
import torch
from helpers import CPU_BACKENDS
from models import twin, with_adapters
from peft import LoraConfig, get_peft_model
from test_paths import NAMES, assert_matches_peft
from test_paths import _inputs as path_inputs

import fast_multilora
from fast_multilora import moe
from fast_multilora.function import get_backend
from fast_multilora.store import AdapterStore

EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def configs(experts=EXPERTS):
    """a0: attention and experts; a1: experts only (rsLoRA); a2: attention only -- ranks 4 / 8 / 2."""
    common = dict(init_lora_weights=False)
    return {"a0": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=experts,
                             **common),
            "a1": LoraConfig(r=8, lora_alpha=4, use_rslora=True, target_modules=[], target_parameters=experts,
                             **common),
            "a2": LoraConfig(r=2, lora_alpha=3, target_modules=ATTN, **common)}


def tiny_moe(arch, impl, seed=0, dtype=torch.float32, hidden=32, inter=24, experts=None, layers=2):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=hidden // 4, vocab_size=97, max_position_embeddings=64, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                                   num_experts=experts or 8, **common))
    else:
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=inter, num_local_experts=experts or 4, **common))
    model.config._experts_implementation = impl
    return model.to(dtype)


def moe_model(arch, impl, cfgs=None, dtype=torch.float32, **sizes):
    return with_adapters(tiny_moe(arch, impl, dtype=dtype, **sizes), cfgs or configs())


# (arch, the model's experts implementation): the base GEMMs follow it (grouped_mm, or a loop per expert)
MODELS = [pytest.param("qwen3_moe", "grouped_mm", id="qwen3_moe-grouped_mm"),
          pytest.param("mixtral", "eager", id="mixtral-eager")]


def test_patch_report_lists_the_experts():
    model = moe_model("qwen3_moe", "grouped_mm")
    report = fast_multilora.patch(model, backend="torch")
    experts = [n for n in report.patched if n.endswith("mlp.experts") or n.endswith("mlp.experts.base_layer")]
    assert len(experts) == 4  # 2 layers x (down_proj wrapper, gate_up_proj wrapper)
    assert not report.fallback and not report.unsupported
    assert report.experts == experts
    assert "8 LoRA Linear module(s) and 4 MoE expert-weight wrapper(s) patched" in str(report)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("arch,impl", MODELS)
def test_mixed_batch_matches_peft(arch, impl, backend, mode):
    """Rows of three adapters (attention + experts, experts only, attention only) and the base, unsorted: logits,
    input gradients and every LoRA gradient equal stock PEFT per sample; in eval also the no-grad forward. The
    Triton cases (the interpreter runs each kernel program in Python) take one decoder layer: a second one of the same
    shapes repeats every launch; the torch cases keep two."""
    model = moe_model(arch, impl, layers=1 if backend == "triton" else 2)
    ref = twin(model)
    fast_multilora.patch(model, backend=backend)
    getattr(model, mode)()
    getattr(ref, mode)()
    assert_matches_peft(model, ref, f"{arch} {backend} {mode}", adapter_names=NAMES)
    if mode == "eval":
        ids, _ = path_inputs(5)
        emb = model.get_input_embeddings()(ids)
        with torch.no_grad():
            got = model(inputs_embeds=emb, adapter_names=NAMES).logits
            want = model(inputs_embeds=emb, adapter_names=NAMES).logits
        with torch.enable_grad():
            with_grad = model(inputs_embeds=emb, adapter_names=NAMES).logits.detach()
        assert torch.equal(got, want)
        torch.testing.assert_close(got, with_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["batched_mm", "grouped_mm"])
def test_packed_rows_and_one_projection(impl):
    """Packed rows (``adapter_ids``) through the experts, adapters targeting only ``down_proj``."""
    cfgs = configs(experts=["experts.down_proj"])
    model = moe_model("qwen3_moe", impl, cfgs)
    ref = twin(model)
    fast_multilora.patch(model, backend="torch")
    vocab = ["a2", "a0", "a1"]
    a_ids = torch.tensor([vocab.index(n) if n != "__base__" else -1 for n in NAMES])[:, None].expand(-1, 5)
    assert_matches_peft(model, ref, "packed", adapter_names=vocab, adapter_ids=a_ids)


def _standalone_experts(dtype):
    """A Qwen3-MoE experts module (6 experts) under PEFT ParamWrappers of three adapters (ranks 3, 1, 2)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=6, moe_intermediate_size=5, num_experts=6)
    cfg._experts_implementation = "eager"

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Qwen3MoeExperts(cfg)
            torch.nn.init.normal_(self.experts.gate_up_proj)
            torch.nn.init.normal_(self.experts.down_proj)

        def forward(self, x, idx, w):
            return self.experts(x, idx, w)

    torch.manual_seed(0)
    model = Block().to(dtype)
    for i, (name, r) in enumerate([("z", 3), ("b", 1), ("m", 2)]):
        c = LoraConfig(r=r, lora_alpha=2 * r + i, target_parameters=EXPERTS, init_lora_weights=False)
        model = get_peft_model(model, c, adapter_name=name) if i == 0 else model
        if i:
            model.add_adapter(name, c)
    return model


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_expert_delta_equals_peft_delta_weight_and_gradchecks(backend):
    """The virtual-expert delta of one projection equals ``u @ ΔW_e.T`` per pair with PEFT's own
    ``get_delta_weight`` (its 3-D layout and scale), base pairs and absent slots untouched; float64 gradcheck of
    the pairs' input, the base output and every A and B."""
    model = _standalone_experts(torch.float64)
    wrapper = model.base_model.model.experts  # the down_proj wrapper, outermost
    assert wrapper.parameter_name == "down_proj"
    slot_names = ("b", "m", "q", "z")  # "q": a slot of the model that this layer lacks
    E, n = 6, len(slot_names)
    ps = moe._proj_state(wrapper, slot_names, E)
    g = torch.Generator().manual_seed(0)
    S, K, N = 23, 5, 6
    expert_ids = torch.randint(0, E, (S,), generator=g)
    pair_slots = torch.randint(-1, n, (S,), generator=g)
    order, segs, offs = moe.pair_layout(expert_ids, pair_slots, E, n)
    assert offs.tolist() == torch.bincount(expert_ids, minlength=E).cumsum(0).tolist()
    e_s, a_s = expert_ids[order], pair_slots[order]
    u = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(S, N, generator=g, dtype=torch.float64, requires_grad=True)
    a_w, b_w, _ = moe.lora_weights(ps)
    be = get_backend(backend, torch.device("cpu"))

    def f(u, y, *w):
        return moe.expert_delta(be, segs, ps, u, y.clone(), w[: len(a_w)], w[len(a_w):], E)

    want = y.detach().clone()
    for p in range(S):
        name = slot_names[a_s[p]] if a_s[p] >= 0 else None
        if name in wrapper.lora_A:
            want[p] += u[p].detach() @ wrapper.get_delta_weight(name)[e_s[p]].T
    torch.testing.assert_close(f(u, y, *a_w, *b_w), want)
    leaves = [w.detach().clone().requires_grad_() for w in (*a_w, *b_w)]
    assert torch.autograd.gradcheck(f, (u, y, *leaves), eps=1e-6, atol=1e-7, fast_mode=backend == "triton")


def test_experts_forward_gradcheck_float64():
    """The whole routed experts forward (base loop per expert, gate, both deltas, routing weights, the top-k sum)
    in float64: gradcheck of the hidden states and the routing weights, and equal to stock PEFT per token."""
    model = _standalone_experts(torch.float64)
    ref = twin(model)
    fast_multilora.patch(model, backend="torch")
    g = torch.Generator().manual_seed(1)
    names = ["m", "__base__", "z", "b"]  # rows of 2 tokens each
    T, k = 8, 2
    x = torch.randn(T, 6, generator=g, dtype=torch.float64, requires_grad=True)
    idx = torch.stack([torch.randperm(6, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g, dtype=torch.float64, requires_grad=True)
    experts = model.base_model.model.experts

    def f(x, w):
        with fast_multilora.route(model, names):
            return experts(x, idx, w)

    assert torch.autograd.gradcheck(f, (x, w), eps=1e-6, atol=1e-7)
    with fast_multilora.route(model, names), pytest.raises(ValueError, match="7 tokens, not a multiple of the batch"):
        experts(x[:7], idx[:7], w[:7])
    out = f(x, w)
    for i, name in enumerate(names):
        rows = slice(2 * i, 2 * i + 2)
        if name == "__base__":
            with ref.disable_adapter():
                want = ref(x[rows], idx[rows], w[rows])
        else:
            ref.set_adapter(name)
            want = ref(x[rows], idx[rows], w[rows])
        torch.testing.assert_close(out[rows], want, msg=name)


def test_unsupported_param_wrapper_raises_a_clear_error():
    """A ParamWrapper on a parameter that is not a fused expert weight (here the router's): listed as unsupported,
    warned about, and a mixed batch names the module and what is missing -- not PEFT's length message."""
    cfgs = {"a0": LoraConfig(r=2, target_modules=["q_proj"], target_parameters=["mlp.gate.weight"],
                             init_lora_weights=False),
            "a1": LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)}
    model = moe_model("qwen3_moe", "grouped_mm", cfgs)
    with pytest.warns(UserWarning, match="cannot run a mixed batch"):
        report = fast_multilora.patch(model, backend="torch")
    assert report.unsupported and all(n.endswith("mlp.gate") for n in report.unsupported)
    ids = torch.randint(0, 97, (2, 5))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate .*not a transformers experts module") as e:
        model(input_ids=ids, adapter_names=["a0", "a1"])
    assert "Length of" not in str(e.value)
    model(input_ids=ids)  # without adapter_names: PEFT's own path


def test_disabled_adapters_and_base_only_batches():
    """``disable_adapter()`` with names gives the base model's output; a batch without expert adapters runs the
    experts module itself."""
    model = moe_model("mixtral", "eager")
    ref = twin(model)
    fast_multilora.patch(model, backend="torch")
    ids = torch.randint(0, 97, (3, 5))
    with ref.disable_adapter():
        base = ref(input_ids=ids).logits
    with model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids, adapter_names=["a0", "a1", "a2"]).logits, base)
    torch.testing.assert_close(model(input_ids=ids, adapter_names=["__base__"] * 3).logits, base)
    ref.set_adapter("a2")
    torch.testing.assert_close(model(input_ids=ids, adapter_names=["a2"] * 3).logits, ref(input_ids=ids).logits)


# ---------------------------------------------------------------------------------------------------------------------
# GPU (FML_TEST_DEVICE=cuda): compiled Triton kernels, transformers' grouped_mm on CUDA


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_experts_one_graph_equal_to_eager(backend):
    """``torch.compile(model, backend="aot_eager")`` of a patched Qwen3-MoE training step: one graph, no graph break,
    no recompilation over three adapter mixes; logits and every LoRA gradient equal eager's (fp32-tight)."""
    from torch._dynamo.utils import counters

    base_graphs = _base_graphs("qwen3_moe", "grouped_mm")
    if base_graphs != 1:  # (transformers 5.17's CPU grouped_mm fallback: its backward reads offs.tolist())
        pytest.skip(f"the base model alone compiles to {base_graphs} graphs here, without any adapter: nothing to "
                    "check one graph against")
    model = moe_model("qwen3_moe", "grouped_mm")
    eager = twin(model)
    for m in (model, eager):
        fast_multilora.patch(m, backend=backend)
        m.train()
    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(2)
    ids, w = torch.randint(0, 97, (4, 7), generator=g), torch.randn(4, 7, 97, generator=g)
    for names in (["a0", "__base__", "a1", "a2"], ["a2", "a2", "a0", "a1"], ["__base__", "a1", "a1", "a0"]):
        got = []
        for fn, m in ((compiled, model), (eager, eager)):
            m.zero_grad(set_to_none=True)
            out = fn(input_ids=ids, adapter_names=names).logits
            (out * w).sum().backward()
            got.append((out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
        (out, grads), (want, want_grads) = got
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6 * max(1.0, want.abs().max().item()))
        assert set(grads) == set(want_grads)
        # fp32 summation-order error scales with the terms a gradient sums, not with its result: against a float64
        # run, eager and compiled are both ~1e-5 off at gradient scales ~10, also in tensors whose own largest
        # entry is < 1 (cancellation); so the bound is relative to the step's largest gradient
        scale = max(1.0, max(gw.abs().max().item() for gw in want_grads.values()))
        for n, gw in want_grads.items():
            torch.testing.assert_close(grads[n], gw, rtol=1e-5, atol=1e-6 * scale,
                                       msg=lambda m, n=n, names=names: f"{names} {n}: {m}")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _base_graphs(arch, impl) -> int:
    """Graphs of the unpatched base model's compiled training step (``aot_eager``; Dynamo reset after)."""
    from torch._dynamo.utils import counters

    base = tiny_moe(arch, impl)
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(0))
    torch.compile(base, backend="aot_eager")(input_ids=ids).logits.sum().backward()
    n = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    return n


def _device_step(model, ids, w, **route):
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_()
    out = model(inputs_embeds=emb, **route).logits
    (out.float() * w).sum().backward()
    return out.detach().float(), emb.grad.float(), {n: p.grad.float() for n, p in model.named_parameters()
                                                    if "lora_" in n and p.grad is not None}


def _peft_rows(ref, ids, w, names):
    """Stock PEFT, one row at a time with its adapter alone (on the rows' device)."""
    outs, dxs = [], []
    ref.zero_grad(set_to_none=True)
    for i, name in enumerate(names):
        emb = ref.get_input_embeddings()(ids[i : i + 1]).detach().requires_grad_()
        if name == "__base__":
            with ref.disable_adapter():
                out = ref(inputs_embeds=emb).logits
                (out.float() * w[i : i + 1]).sum().backward()
        else:
            ref.set_adapter(name)
            for n, p in ref.named_parameters():
                p.requires_grad_("lora_" in n)
            out = ref(inputs_embeds=emb).logits
            (out.float() * w[i : i + 1]).sum().backward()
        outs.append(out.detach().float())
        dxs.append(emb.grad.float())
    return torch.cat(outs), torch.cat(dxs), {n: p.grad.float() for n, p in ref.named_parameters()
                                            if "lora_" in n and p.grad is not None}


def _gpu_inputs(rows, T, device):
    g = torch.Generator().manual_seed(3)
    return (torch.randint(0, 97, (rows, T), generator=g).to(device),
            torch.randn(rows, T, 97, generator=g).to(device))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_gpu_mixed_batch_matches_peft_fp32(arch, impl):
    """On CUDA in fp32 (ieee dots): 16 experts, hidden 128, the three adapters and base rows unsorted; logits, input
    gradients and every LoRA gradient equal stock PEFT per sample."""
    model = moe_model(arch, impl, hidden=128, inter=96, experts=16).cuda()
    ref = twin(model)
    report = fast_multilora.patch(model, backend="triton")
    assert len(report.experts) == 4
    ids, w = _gpu_inputs(len(NAMES), 24, "cuda")
    got = _device_step(model, ids, w, adapter_names=NAMES)
    want = _peft_rows(ref, ids, w, NAMES)
    for a, b, what in ((got[0], want[0], "logits"), (got[1], want[1], "input grad")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * max(1.0, b.abs().max().item()), msg=what)
    assert set(got[2]) == {n for n, p in model.named_parameters() if "lora_" in n}
    for n, g in want[2].items():
        torch.testing.assert_close(got[2][n], g, rtol=1e-4, atol=1e-4 * max(1.0, g.abs().max().item()), msg=n)


@pytest.mark.gpu
def test_gpu_bf16_experts_error_within_twice_peft():
    """bf16 with transformers' grouped_mm on CUDA, at the experts module (fixed routing, so no top-k flips): against
    stock PEFT in fp32 (eager experts), ours errs at most twice as much as stock PEFT in bf16 (+ a bf16 ulp floor),
    for the output and every LoRA gradient."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=256, moe_intermediate_size=128, num_experts=16)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = Qwen3MoeExperts(cfg)
            torch.nn.init.normal_(self.experts.gate_up_proj, std=0.05)
            torch.nn.init.normal_(self.experts.down_proj, std=0.05)

        def forward(self, x, idx, w):
            return self.experts(x, idx, w)

    torch.manual_seed(0)
    model = Block()
    for i, (name, r) in enumerate([("z", 16), ("b", 8), ("m", 4)]):
        c = LoraConfig(r=r, lora_alpha=16, target_parameters=EXPERTS, init_lora_weights=False)
        model = get_peft_model(model, c, adapter_name=name) if i == 0 else model
        if i:
            model.add_adapter(name, c)
    model = model.cuda()
    names = ["m", "__base__", "z", "b", "z", "m", "b", "__base__"]
    T, k = 8 * 64, 2
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, 256, generator=g).cuda()
    idx = torch.stack([torch.randperm(16, generator=g)[:k] for _ in range(T)]).cuda()
    wt = torch.rand(T, k, generator=g).cuda()
    gy = torch.randn(T, 256, generator=g).cuda()

    def set_impl(m, impl):
        for mod in m.modules():
            if isinstance(mod, Qwen3MoeExperts):
                mod.config._experts_implementation = impl

    def peft_run(m, dtype, impl):
        set_impl(m, impl)
        outs = []
        m.zero_grad(set_to_none=True)
        for i, name in enumerate(names):
            rows = slice(64 * i, 64 * (i + 1))
            xi = x[rows].to(dtype)
            if name == "__base__":
                with m.disable_adapter():
                    out = m(xi, idx[rows], wt[rows].to(dtype))
            else:
                m.set_adapter(name)  # only this adapter trainable: the others' grads accumulate untouched
                out = m(xi, idx[rows], wt[rows].to(dtype))
                (out.float() * gy[rows]).sum().backward()
            outs.append(out.detach().float())
        return torch.cat(outs), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    exact, exact_g = peft_run(twin(model), torch.float32, "eager")
    low = twin(model).to(torch.bfloat16)
    peft_bf16, peft_bf16_g = peft_run(low, torch.bfloat16, "grouped_mm")
    ours_m = twin(model).to(torch.bfloat16)
    fast_multilora.patch(ours_m, backend="triton")
    for n, p in ours_m.named_parameters():
        p.requires_grad_("lora_" in n)
    set_impl(ours_m, "grouped_mm")
    with fast_multilora.route(ours_m, names):
        out = ours_m.base_model.model.experts(x.bfloat16(), idx, wt.bfloat16())
        (out.float() * gy).sum().backward()
    ours_g = {n: p.grad.float() for n, p in ours_m.named_parameters() if p.grad is not None}

    def err(a, b):
        return (a - b).float().pow(2).mean().sqrt().item()

    floor = 2.0**-8 * exact.abs().mean().item()
    assert err(out.float(), exact) <= 2 * err(peft_bf16, exact) + floor, (err(out.float(), exact),
                                                                          err(peft_bf16, exact))
    assert set(ours_g) == set(exact_g)
    for n, ge in exact_g.items():
        e_ours, e_peft = err(ours_g[n], ge), err(peft_bf16_g[n], ge)
        assert e_ours <= 2 * e_peft + 2.0**-8 * ge.abs().mean().item(), (n, e_ours, e_peft)


def _store_configs(uniform: bool):
    """Experts adapters of equal ranks (one cell rank per projection: the store's one-view path) or unequal ones
    (rank 1 among them: per-cell pieces), plus an attention-only adapter."""
    common = dict(init_lora_weights=False)
    r1 = 4 if uniform else 1
    return {"a0": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS, **common),
            "a1": LoraConfig(r=r1, lora_alpha=3, use_rslora=True, target_modules=[], target_parameters=EXPERTS,
                             **common),
            "a2": LoraConfig(r=2, lora_alpha=3, target_modules=ATTN, **common)}


def _held_ids(model) -> set:
    return {id(p) for a in AdapterStore.of(model).arenas.values() for _, _, p in a.blocks.values()}


# equal ranks change only the torch backend's B_cat (one view instead of a piece per cell); the Triton kernels read
# the packed block the same way for both, so they run the unequal case alone (~25 s of interpreter; with -m slow:
# tests/conftest.py)
@pytest.mark.parametrize("backend,uniform", [("torch", True), ("torch", False),
                                             pytest.param("triton", False, marks=pytest.mark.interpreter)],
                         ids=["torch-equal-ranks", "torch-unequal-ranks", "triton-unequal-ranks"])
def test_experts_in_the_store_train_like_peft_per_adapter(backend, uniform):
    """The adapter store holds the expert wrappers' weights too (PEFT's parameters are views of its arena, each
    adapter's ``[E*r, in]`` A rows and ``[out, r*E]`` B block in PEFT's layout): ``fast_multilora.AdamW`` on mixed
    batches trains every adapter as stock PEFT trains it alone with ``torch.optim.AdamW``; then an experts adapter
    deleted and another added (a hole, then reused) train on, equal to PEFT per sample."""
    from test_store import _assert_same_weights, _batches, _hyper, _per_adapter_reference, _train

    model = with_adapters(tiny_moe("qwen3_moe", "grouped_mm"), _store_configs(uniform))
    ref = twin(model)
    fast_multilora.patch(model, backend=backend)
    names = sorted(model.peft_config)
    hyper = _hyper(names)
    opt = fast_multilora.AdamW(model, settings=hyper)
    expert_params = {n: p for n, p in model.named_parameters() if "lora_" in n and ".experts" in n}
    assert len(expert_params) == 2 * 2 * 2 * 2  # 2 layers x 2 projections x (A, B) x 2 adapters
    held = _held_ids(model)
    assert all(id(p) in held for p in expert_params.values()), [n for n, p in expert_params.items()
                                                                 if id(p) not in held]
    model.train()
    ref.train()
    batches = _batches(names, steps=3, seed=4)
    _train(model, opt, batches)
    _per_adapter_reference(ref, batches, hyper)
    _assert_same_weights(model, ref, rtol=1e-4, atol=1.2e-4)

    # churn: a1 (experts only) deleted leaves a hole in each experts region, a new a1 of its rank takes it
    old = {id(p) for n, p in model.named_parameters() if ".a1." in n}
    for m in (model, ref):
        m.delete_adapter("a1")
        m.add_adapter("a1", _store_configs(uniform)["a1"])
        for n, p in m.named_parameters():
            p.requires_grad_("lora_" in n)
    with torch.no_grad():  # (B != 0: init_lora_weights=False draws them; the twin takes the same values)
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
            if ".a1." in n:
                assert id(p) not in old
                q.copy_(p)
    ref.zero_grad(set_to_none=True)
    assert_matches_peft(model, ref, f"churned {backend}", adapter_names=NAMES)
    held = _held_ids(model)
    assert all(id(p) in held for n, p in model.named_parameters() if ".a1." in n and ".experts" in n)


@pytest.mark.parametrize("ranks,cap", [((3, 3, 3), 12), ((3, 1, 2), 8)], ids=["one-view", "per-cell"])
def test_store_b_cat_of_an_experts_layer_is_the_expert_major_concatenation(ranks, cap):
    """The torch backend's ``B_cat`` of an experts layer's packed block: each cell (an adapter of rank ``E*r`` in
    PEFT's layout) expert-major, at its own columns -- equal ranks with free rows of that rank take one view, others
    a piece per cell -- and ``packed_grad`` its exact inverse."""
    from fast_multilora.store import LayerSlots

    E, N = 4, 5
    cells, off = [], 0
    for i, r in enumerate(ranks):
        cells.append([f"a{i}", E * r, off, None, None])
        off += E * r
    cap *= E
    g = torch.Generator().manual_seed(0)
    packed = torch.randn(cap * N, generator=g, dtype=torch.float64)
    s = LayerSlots(tuple(c[0] for c in cells), tuple(c[1] for c in cells), 3, N, None, packed, (), (), None,
                   cap=cap, end=off, cells=cells, experts=E)
    s._shape()
    assert bool(s.uniform) == (len(set(ranks)) == 1)
    got = s.b_cat(packed)
    assert got.shape == (N, cap)
    for name, R, o, _, _ in cells:
        weight = packed[o * N : (o + R) * N].view(N, R)  # PEFT's lora_B.weight [N, r*E]
        torch.testing.assert_close(got[:, o : o + R], moe.expert_major_b(weight, E), rtol=0, atol=0, msg=name)
    back = s.packed_grad(got)
    torch.testing.assert_close(back[: off * N], packed[: off * N], rtol=0, atol=0)
