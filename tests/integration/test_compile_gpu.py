"""``torch.compile`` on the GPU (marked ``gpu``; run by ``benchmarks/gpu_run.sh``): Inductor in the modes users
pick -- default, ``"reduce-overhead"`` (CUDA graphs), ``"max-autotune-no-cudagraphs"`` -- for a training step and
for eval, static-cache generation, and CUDA-graph replay with dropout. Each compiles one graph that serves every
adapter mix of the same shapes and equals eager: fp32 within 1e-4 of the largest entry (Inductor fuses the model's
own ops and reorders sums; the LoRA kernels are the same)."""

import pytest
import torch
from models import peft_model, twin
from peft import LoraConfig, get_peft_model
from torch._dynamo.utils import counters

import fast_multilora

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fresh_dynamo")]

MODES = ["default", "reduce-overhead", "max-autotune-no-cudagraphs"]
MIXES = [["a1", "__base__", "a0", "a2"], ["a1", "a1", "a0", "a2"], ["__base__"] * 4, ["a2", "a0", "a1", "a1"],
         ["a0"] * 4, ["a2", "__base__", "a2", "a0"]]


def _close(got, want, what=""):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * max(1.0, want.abs().max().item()),
                               msg=lambda m: f"{what}: {m}")


def _one_graph():
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mode", MODES)
def test_compiled_modes_equal_eager(mode, train):
    model = peft_model("llama").cuda()
    eager = twin(model)
    fast_multilora.patch(model)
    fast_multilora.patch(eager)
    compiled = torch.compile(model, mode=mode)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (4, 16), generator=g).cuda()
    w = torch.randn(4, 16, 97, generator=g).cuda()
    for m in (model, eager):
        m.train(train)
    for names in MIXES:
        outs = []
        for fn, m in ((compiled, model), (eager, eager)):
            m.zero_grad(set_to_none=True)
            with torch.set_grad_enabled(train):
                out = fn(input_ids=ids, adapter_names=names).logits
            if train:
                (out * w).sum().backward()
            outs.append((out.detach().clone(), {n: p.grad.clone() for n, p in m.named_parameters()
                                                if p.grad is not None}))
        (got, grads), (want, want_grads) = outs
        _close(got, want, f"{mode} logits {names}")
        assert set(grads) == set(want_grads)
        for n, gw in want_grads.items():
            _close(grads[n], gw, n)
    _one_graph()


def test_static_cache_generation_equals_eager():
    """``generate(..., cache_implementation="static")`` (transformers compiles the decode step) with a mixed batch
    gives eager's tokens (fp32, greedy), for two mixes without recompiling."""
    model = peft_model("llama").cuda().eval()
    fast_multilora.patch(model)
    ids = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(4)).cuda()
    for names in MIXES[:2]:
        want = model.generate(input_ids=ids, adapter_names=names, max_new_tokens=8, do_sample=False)
        got = model.generate(input_ids=ids, adapter_names=names, max_new_tokens=8, do_sample=False,
                             cache_implementation="static")
        assert torch.equal(got, want), names


class _One(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(64, 8, bias=False)

    def forward(self, x):
        return self.lin(x)


def test_cuda_graph_replays_draw_fresh_masks_and_backward_uses_them():
    """A reduce-overhead (CUDA graph) training step under LoRA dropout: replays with new mixes need no new graph,
    every replay draws a fresh mask, and the backward uses the forward's: with a rank-1 adapter and B = e_0,
    ``out[t, 0] = scale * sum_k x~[t, k] A[0, k]``, so the mask read off ``dx`` reproduces the output."""
    torch.manual_seed(0)
    model = get_peft_model(_One(), LoraConfig(r=1, lora_alpha=1, target_modules=["lin"], lora_dropout=0.3,
                                              init_lora_weights=False), adapter_name="a")
    model.add_adapter("b", LoraConfig(r=1, lora_alpha=1, target_modules=["lin"], lora_dropout=0.3,
                                      init_lora_weights=False))
    model.cuda().train()
    for name in ("a", "b"):
        with torch.no_grad():
            model.base_model.model.lin.lora_B[name].weight.zero_()
            model.base_model.model.lin.lora_B[name].weight[0, 0] = 1.0
    fast_multilora.patch(model)
    step = torch.compile(model, mode="reduce-overhead")  # the model itself: its entry hook runs outside
    W = model.base_model.model.lin.base_layer.weight
    masks = []
    for names in (["a", "b", "__base__", "a"], ["b", "b", "a", "__base__"], ["a", "b", "__base__", "a"]):
        x = torch.randn(4, 32, 64, device="cuda", requires_grad=True)
        out = step(x, adapter_names=names)
        dy = torch.zeros_like(out)
        dy[..., 0] = 1
        (dx,) = torch.autograd.grad(out, x, dy)
        lora_dx = (dx - dy @ W).detach()  # the base part of dx removed
        for i, name in enumerate(names):
            if name == "__base__":
                assert torch.count_nonzero(lora_dx[i]) == 0
                continue
            A = model.base_model.model.lin.lora_A[name].weight
            kept = lora_dx[i] != 0
            want = ((x[i].detach() * kept / 0.7) @ A.detach().T)[:, 0]
            torch.testing.assert_close(out[i, :, 0].detach() - (x[i].detach() @ W.T)[:, 0], want, rtol=1e-4,
                                       atol=1e-4)
            rate = kept.float().mean().item()
            assert abs(rate - 0.7) < 0.05, rate
        masks.append((lora_dx != 0).clone())
    assert not torch.equal(masks[0], masks[2]), "a replay reused the previous mask"
    _one_graph()
