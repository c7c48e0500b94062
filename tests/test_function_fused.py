"""The fused base: a frozen ``nn.Linear`` base run inside ``LoraLinear`` (SGEMM family: delta written first, the base
GEMM accumulated into it by ``addmm_``; chunked family: the GEMM first, the delta added; ``dx``: the shrink
backward's, ``dy W`` accumulated into it). Compared with the unfused path (``patch(...,
fuse_base=False)``: base layer, then the delta added in place) on outputs, input gradients and
every LoRA gradient, with and without dropout, on both backends; and the cases that must not take it.

Tolerances: fp32 end to end; the two paths sum the same terms in another order (GEMM epilogue vs a separate add), so
they agree to a few fp32 ulp of each tensor's largest entry (atol 1e-5 x max|reference|, rtol 1e-5).
"""

import pytest
import torch
from models import peft_model, twin

import fast_multilora
from fast_multilora import function

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]


@pytest.fixture
def fused_calls(monkeypatch):
    """Shapes of the base weights of the layer calls that ran fused, in call order."""
    calls = []
    orig = function.LoraLinear.forward

    def spy(ctx, x, y, W, b, call, *weights):
        if call.fused:
            calls.append(tuple(W.shape))
        return orig(ctx, x, y, W, b, call, *weights)

    monkeypatch.setattr(function.LoraLinear, "forward", staticmethod(spy))
    return calls


def _run(model, ids, w, seed=11):
    torch.manual_seed(seed)  # the per-call dropout seeds come from torch's CPU generator
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    out = model(inputs_embeds=emb, adapter_names=NAMES).logits
    (out * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), emb.grad.detach(), grads


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["p0", "p0.3"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_matches_per_module_path(backend, dropout, fused_calls, device):
    fused = peft_model("llama", dropout=dropout, layers=1).to(device)  # its 7 LoRA Linears: every kind of call
    plain = twin(fused)
    fast_multilora.patch(fused, backend=backend)
    fast_multilora.patch(plain, backend=backend, fuse_base=False)
    fused.train()
    plain.train()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 97, (len(NAMES), 9), generator=g).to(device)
    w = torch.randn(len(NAMES), 9, 97, generator=g).to(device)
    got = _run(fused, ids, w)
    n_fused = len(fused_calls)
    want = _run(plain, ids, w)
    assert n_fused == 7 and len(fused_calls) == n_fused  # every LoRA Linear of the layer; none when off
    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item(), msg=lambda m: f"{what}: {m}")

    if device == "cuda" and backend == "triton":  # the two paths' kernels sum in another order than cuBLAS's GEMM
        def close(a, b, what):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item(),
                                       msg=lambda m: f"{what}: {m}")

    close(got[0], want[0], "logits")
    close(got[1], want[1], "input grad")
    assert set(got[2]) == set(want[2]) and got[2]
    for n, g_ in want[2].items():
        close(got[2][n], g_, n)


def test_every_layer_fuses_from_the_first_call(fused_calls):
    """Every LoRA Linear of a plain frozen base runs fused, from the first forward call on."""
    model = peft_model("llama")
    fast_multilora.patch(model, backend="torch")
    model.eval()
    ids = torch.randint(0, 97, (len(NAMES), 5))
    with torch.no_grad():
        model(input_ids=ids, adapter_names=NAMES)
        first = len(fused_calls)
        model(input_ids=ids, adapter_names=NAMES)
    assert first == 14 and len(fused_calls) == 28


def _frozen_hook(module, args, out):
    return out


@pytest.mark.parametrize("case", ["fuse_base=False", "base hook", "trainable base", "autocast", "lora_bias"])
def test_cases_that_keep_the_per_module_path(case, fused_calls):
    model = peft_model("llama")
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    if case == "base hook":
        layer.base_layer.register_forward_hook(_frozen_hook)
    if case == "trainable base":
        layer.base_layer.weight.requires_grad_(True)
    if case == "lora_bias":
        model = peft_model("llama", configs={"a0": __import__("peft").LoraConfig(
            r=4, target_modules=["q_proj"], lora_bias=True, init_lora_weights=False)})
        layer = model.base_model.model.model.layers[0].self_attn.q_proj
    fast_multilora.patch(model, backend="torch", fuse_base=case != "fuse_base=False")
    names = ["a0"] * 3 if case == "lora_bias" else NAMES[:3]
    ids = torch.randint(0, 97, (len(names), 5))
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if case == "autocast" else torch.enable_grad()
    with ctx:
        out = model(input_ids=ids, adapter_names=names).logits
    out.float().sum().backward()
    q_shape = tuple(layer.base_layer.weight.shape)
    if case in ("base hook", "trainable base"):  # only that layer leaves the fused path
        assert len(fused_calls) == 13 and q_shape in fused_calls  # the other layer's q_proj has the same shape
    else:
        assert fused_calls == []
    if case == "trainable base":
        assert layer.base_layer.weight.grad is not None and layer.base_layer.weight.grad.abs().sum() > 0


class _BiasMLP(torch.nn.Module):
    """Linear layers with biases (as Qwen's q/k/v): the bias is folded into the write-mode expand."""

    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(24, 40), torch.nn.Linear(40, 24)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_with_base_bias_matches_peft_per_sample(backend, fused_calls, device):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_BiasMLP().to(device), LoraConfig(r=4, target_modules=["up", "down"],
                                                             init_lora_weights=False), adapter_name="a0")
    model.add_adapter("a1", LoraConfig(r=2, lora_alpha=5, target_modules=["up"], init_lora_weights=False))
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    ref = twin(model)
    fast_multilora.patch(model, backend=backend)
    names = ["a1", "__base__", "a0", "a1"]
    x = torch.randn(len(names), 5, 24).to(device)
    w = torch.randn(len(names), 5, 24).to(device)
    out = model(x, adapter_names=names)
    (out * w).sum().backward()
    assert len(fused_calls) == 2  # both layers, their biases included
    # fp32 throughout; on the GPU cuBLAS and the kernels sum in other orders than PEFT's separate GEMMs (TF32 off)
    tol = 1e-4 if device == "cuda" else 1e-5
    for i, name in enumerate(names):  # stock PEFT, one sample at a time with its adapter alone
        if name == "__base__":
            with ref.disable_adapter():
                want = ref(x[i : i + 1])
        else:
            ref.set_adapter(name)
            for n, p in ref.named_parameters():
                p.requires_grad_("lora_" in n)
            want = ref(x[i : i + 1])
            (want * w[i : i + 1]).sum().backward()
        torch.testing.assert_close(out[i : i + 1].detach(), want.detach(), rtol=tol, atol=tol / 10)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want_g = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert set(got) == set(want_g)
    for n, g in want_g.items():
        torch.testing.assert_close(got[n], g, rtol=tol, atol=tol / 10, msg=lambda m, n=n: f"{n}: {m}")
