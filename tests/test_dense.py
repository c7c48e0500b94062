"""The autograd-off dense expand (``function.dense_scale``): the shrink writes a block-diagonal h
(``lora_shrink(block_diag=True)``) and each layer's delta is one cuBLAS GEMM from it.

Checked: the block-diagonal shrink against the reference (odd shapes, rank 0 and 1 slots, base rows, stacks, both
families, dropout), and whole eval forwards -- fused bases, stacked siblings, a non-``nn.Linear`` base (GPT-2's
``Conv1D``) -- against stock PEFT's own mixed-batch forward and against the expand kernel's path; a spy proves
which path ran, and the cases that must not take it (several scales, autograd on, a total rank above the bound)
do not.
"""

from __future__ import annotations

import pytest
import torch
from fast_multilora.kernels import lora_shrink
from fast_multilora.kernels.dropout import dropout_keep_mask
from helpers import KERNEL_DTYPES, make_segments, make_table, random_token_slots
from models import LLAMA_TARGETS, peft_model, twin
from peft import LoraConfig

import fast_multilora
from fast_multilora import function
from fast_multilora import reference as ref
from fast_multilora.function import TritonBackend

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]  # unsorted, repeated, with a base row


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("stack", [1, 3])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("seed", [None, 11], ids=["p0", "dropout"])
def test_block_diag_shrink_matches_reference(grouped, stack, dtype, seed, device):
    g = torch.Generator().manual_seed(5)
    ranks = [4, 0, 8, 1, 16]  # an empty adapter, rank 1
    table = make_table(ranks, dropout=[0.25, 0.0, 0.5, 0.1, 0.0], device=device)
    S, K = 37, 123
    ts = random_token_slots(S, len(ranks), g)  # base rows included
    ts[3] = 3  # a 1-token segment of the rank-1 slot
    segs = make_segments(ts, grouped, device=device)
    x = torch.randn(S, K, generator=g).to(device, dtype)
    A = (torch.randn(stack * sum(ranks), K, generator=g) / 8).to(device, dtype)
    got = lora_shrink(x, A, segs, table, stack_num=stack, seed=seed, block_diag=True)
    assert got.dtype == dtype and got.shape == (S, stack * sum(ranks))
    keep = None if seed is None else dropout_keep_mask(seed, segs, table, K, stack_num=stack)
    h = ref.lora_shrink(x.float(), A.float(), segs, table, stack_num=stack, keep=keep)
    want = torch.zeros(S, stack * sum(ranks), device=device)
    offsets, R = [sum(ranks[:a]) for a in range(len(ranks))], sum(ranks)
    for t in range(S):
        a = int(ts[t])
        if a < 0:
            continue
        for s in range(stack):
            want[t, s * R + offsets[a] : s * R + offsets[a] + ranks[a]] = h[t, s * ranks[a] : (s + 1) * ranks[a]]
    # h is rounded to x's dtype once: fp32 ~1e-6 (summation order), 16-bit half an ulp of its dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * float(want.abs().max()))
    off_block = torch.ones_like(want, dtype=torch.bool)  # every cell outside the blocks is exactly zero
    for t in range(S):
        a = int(ts[t])
        if a >= 0:
            for s in range(stack):
                off_block[t, s * R + offsets[a] : s * R + offsets[a] + ranks[a]] = False
    assert torch.count_nonzero(got[off_block]) == 0


def one_scale_configs(targets=LLAMA_TARGETS, **extra):
    """Three adapters of different ranks and one scale (alpha / r = 2), B != 0."""
    common = dict(init_lora_weights=False, target_modules=targets, **extra)
    return {"a0": LoraConfig(r=4, lora_alpha=8, **common), "a1": LoraConfig(r=8, lora_alpha=16, **common),
            "a2": LoraConfig(r=2, lora_alpha=4, **common)}


@pytest.fixture
def dense_calls(monkeypatch):
    """The stack_num of every block-diagonal shrink the Triton backend runs."""
    calls = []

    def spy(self, x, A_cat, segs, table, stack_num, seed, _orig=TritonBackend.shrink_block_diag):
        calls.append(stack_num)
        return _orig(self, x, A_cat, segs, table, stack_num, seed)

    monkeypatch.setattr(TritonBackend, "shrink_block_diag", spy)
    return calls


def eval_logits(model, ids, **kw):
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, **kw)  # first call: records which siblings read one input (they stack from the next)
        return model(input_ids=ids, **kw).logits


def ids_for(device, T=9):
    return torch.randint(0, 97, (len(NAMES), T), generator=torch.Generator().manual_seed(3)).to(device)


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("gpt2", torch.float32), ("llama", torch.float16)])
def test_eval_forward_matches_peft_and_the_kernel_path(arch, dtype, dense_calls, monkeypatch, device):
    """float16: PEFT keeps the adapters in float32 (``autocast_adapter_dtype``), concatenated in x's dtype here."""
    targets = LLAMA_TARGETS if arch == "llama" else ["c_attn", "c_proj", "c_fc"]
    extra = {} if arch == "llama" else {"fan_in_fan_out": True}
    model = peft_model(arch, dtype=dtype, configs=one_scale_configs(targets, **extra)).to(device)
    stock, kernel_path = twin(model), twin(model)
    ids = ids_for(device)
    want = eval_logits(stock, ids, adapter_names=NAMES)  # stock PEFT's own mixed-batch inference
    fast_multilora.patch(model, backend="triton")
    fast_multilora.patch(kernel_path, backend="triton")
    got = eval_logits(model, ids, adapter_names=NAMES)
    assert dense_calls, "the dense path did not run"
    if arch == "llama":
        assert 3 in dense_calls and 2 in dense_calls  # q/k/v and gate/up stacks ran dense
    dense_calls.clear()
    monkeypatch.setattr(function, "DENSE_MAX_RANK", 0)
    base = eval_logits(kernel_path, ids, adapter_names=NAMES)
    assert not dense_calls
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got, base, rtol=1e-4, atol=1e-5)
    else:  # 16-bit: both of ours round h and B to x's dtype (the order of their sums differs); PEFT runs the LoRA
        # path in its float32 adapters' dtype
        scale = float(want.float().abs().max())
        torch.testing.assert_close(got.float(), base.float(), rtol=0, atol=4e-3 * scale)
        torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2 * scale)


def test_not_taken_with_several_scales_autograd_or_a_large_total_rank(dense_calls, monkeypatch, device):
    cfgs = one_scale_configs()
    cfgs["a2"] = LoraConfig(r=2, lora_alpha=3, init_lora_weights=False, target_modules=LLAMA_TARGETS)
    model = peft_model(configs=cfgs).to(device)
    fast_multilora.patch(model, backend="triton")
    ids = ids_for(device)
    eval_logits(model, ids, adapter_names=NAMES)
    assert not dense_calls  # several scales: the expand kernel applies each
    uniform = peft_model(configs=one_scale_configs()).to(device)
    fast_multilora.patch(uniform, backend="triton")
    uniform.eval()
    uniform(input_ids=ids, adapter_names=NAMES).logits.sum().backward()  # autograd on
    assert not dense_calls
    monkeypatch.setattr(function, "DENSE_MAX_RANK", 13)  # below the total rank 14
    eval_logits(uniform, ids, adapter_names=NAMES)
    assert not dense_calls
    monkeypatch.setattr(function, "DENSE_MAX_RANK", 14)
    eval_logits(uniform, ids, adapter_names=NAMES)
    assert dense_calls
