"""QLoRA: PEFT's LoRA layers over bitsandbytes 4-bit (nf4, fp4 with double quantization) and 8-bit bases run our layer
Function (in training a 4-bit base whose compute dtype is the input's is fused into it, its weight dequantized as
bitsandbytes' autograd function does; otherwise the base layer runs opaque and the delta is added), on CPU
(bitsandbytes runs its 4-bit and 8-bit layers there). Parity with stock PEFT running each sample with its adapter
alone: outputs, input and LoRA gradients, train and eval, three adapters with different ranks and targets,
``__base__`` rows; the report lists the quantized layers as patched. Tolerance: fp32 compute, the same quantized base
in both runs, so fp32-tight (1e-4 of the largest entry: the delta is added once in fp32, PEFT's per-adapter path sums
in another order).

16-bit compute dtypes (bf16 on the torch backend only: the Triton interpreter cannot do bf16 dots) and 16-bit
activations or adapters: each layer's output dtype equals PEFT's, and ours and PEFT's results are compared with the
exact math of the same stored weights (the model converted to fp32 compute, quantized weights untouched): ours is at
most twice PEFT's own error plus the low precision's unit roundoff (test_errors.py's rule, in relative RMSE)."""

import warnings
from functools import partial

import pytest
import torch
from helpers import CPU_BACKENDS
from models import adapter_configs
from test_paths import assert_matches_peft

import fast_multilora

try:
    import bitsandbytes as bnb
except ImportError:  # the qlora extra
    bnb = None
needs_bnb = pytest.mark.skipif(bnb is None, reason="needs bitsandbytes (the qlora extra)")
try:
    import torchao
except ImportError:
    torchao = None
needs_torchao = pytest.mark.skipif(torchao is None, reason="needs torchao")

NAMES = ["a1", "__base__", "a0", "a2", "a0", "a1", "a2"]
QUANT = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4-double-quant": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama saved once; bitsandbytes' CPU 4-bit layers need in_features >= its block size (64). One
    decoder layer: its seven projections (LoRA layers of four shapes) are every kind of quantized layer call."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def quantized_base(path, quant, dtype=torch.float32, device="cpu"):
    """The checkpoint loaded in ``quant`` (a ``QUANT`` key or ``BitsAndBytesConfig`` kwargs), other weights in
    ``dtype``, on ``device``."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    kwargs = QUANT[quant] if isinstance(quant, str) else quant
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bitsandbytes' notes about CPU kernels and casts
        return LlamaForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**kwargs), dtype=dtype,
                                                device_map=device)


def qlora_model(path, quant, kbit_training=False, dtype=torch.float32, lora_dtype=None, device="cpu", b_scale=1.0):
    """Three adapters on :func:`quantized_base`; the LoRA weights in ``lora_dtype`` (default: PEFT's, fp32), every
    ``lora_B`` multiplied by ``b_scale``."""
    from peft import prepare_model_for_kbit_training

    base = quantized_base(path, quant, dtype, device)
    if kbit_training:
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=True,
                                               gradient_checkpointing_kwargs={"use_reentrant": False})
    return with_adapters(base, lora_dtype, b_scale)


def with_adapters(base, lora_dtype=None, b_scale=1.0):
    from peft import get_peft_model

    cfgs = adapter_configs("llama")
    torch.manual_seed(1)  # the same LoRA weights in every copy
    model = get_peft_model(base, cfgs["a0"], adapter_name="a0")
    for name in ("a1", "a2"):
        model.add_adapter(name, cfgs[name])
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
        if "lora_B" in n and b_scale != 1.0:
            p.data = p.data * b_scale
        if "lora_" in n and lora_dtype is not None:
            p.data = p.data.to(lora_dtype)
    return model


@needs_bnb
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_qlora_4bit_base_fused_in_training_only(checkpoint, monkeypatch):
    """A 4-bit base runs inside the layer op in training (bitsandbytes' own forward is not called, its weight is
    dequantized once per layer call in the forward and once in the backward), and runs itself in eval; the fused
    step equals the unfused one (``PatchConfig(fuse_base=False)``) up to the fp32 order of the sums (the delta
    written first and the GEMM accumulated onto it, against the GEMM's output plus the delta)."""
    import fast_multilora.patching as patching

    ids = torch.randint(0, 97, (len(NAMES), 6), generator=torch.Generator().manual_seed(0))
    bnb_calls, dequant = [0], [0]
    forward, dequantize = bnb.nn.Linear4bit.forward, patching._dequantize_4bit

    def counted_forward(self, x):
        bnb_calls[0] += 1
        return forward(self, x)

    def counted_dequantize(W, dtype):
        dequant[0] += 1
        return dequantize(W, dtype)

    monkeypatch.setattr(bnb.nn.Linear4bit, "forward", counted_forward)
    monkeypatch.setattr(patching, "_dequantize_4bit", counted_dequantize)
    runs = {}
    for fuse in (True, False):
        model = qlora_model(checkpoint, "nf4")
        fast_multilora.patch(model, fast_multilora.PatchConfig(backend="torch", fuse_base=fuse))
        model.train()
        bnb_calls[0] = dequant[0] = 0
        emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        out = model(inputs_embeds=emb, adapter_names=NAMES).logits
        assert (bnb_calls[0], dequant[0]) == ((0, 7) if fuse else (7, 0))
        out.square().mean().backward()
        assert dequant[0] == (14 if fuse else 0)  # the backward's dx of each fused layer
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert grads.keys() == {n for n, p in model.named_parameters() if p.requires_grad}  # every adapter trains
        runs[fuse] = (out.detach(), emb.grad, grads)
        model.eval()
        bnb_calls[0] = dequant[0] = 0
        with torch.no_grad():
            model(input_ids=ids, adapter_names=NAMES)
        assert (bnb_calls[0], dequant[0]) == (7, 0)
    (out, dx, grads), (out_u, dx_u, grads_u) = runs[True], runs[False]
    torch.testing.assert_close(out, out_u, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_u, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_u.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], grads_u[n], rtol=1e-4, atol=1e-6, msg=n)


@needs_bnb
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("quant", list(QUANT))
def test_qlora_mixed_batch_matches_peft(checkpoint, quant, backend, train):
    model, ref = qlora_model(checkpoint, quant), qlora_model(checkpoint, quant)
    report = fast_multilora.patch(model, backend=backend)
    assert not report.fallback, report.fallback
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__module__.startswith("bitsandbytes")
    assert "base_model.model.model.layers.0.self_attn.q_proj" in report.patched
    model.train(train)
    ref.train(train)
    assert_matches_peft(model, ref, quant, adapter_names=NAMES)


def _4bit(quant_type, compute, double_quant=False):
    return dict(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=compute,
                bnb_4bit_use_double_quant=double_quant)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
# (quantization, dtype of the non-quantized weights = the activations, LoRA dtype (None: PEFT's fp32), autocast)
DTYPE_CASES = [
    pytest.param("torch", _4bit("nf4", BF16, True), BF16, None, None, id="torch-nf4-dq-bf16"),
    pytest.param("torch", _4bit("fp4", FP16), FP16, None, None, id="torch-fp4-fp16"),
    pytest.param("triton", _4bit("fp4", FP16), FP16, None, None, id="triton-fp4-fp16",
                 marks=pytest.mark.interpreter),
    # fp32 activations, 16-bit adapters: PEFT casts the input to the adapters' dtype, the delta back to fp32
    pytest.param("torch", _4bit("nf4", BF16), FP32, BF16, None, id="torch-nf4-bf16compute-fp32act-bf16lora"),
    pytest.param("triton", _4bit("fp4", FP16, True), FP32, FP16, None,
                 id="triton-fp4-dq-fp16compute-fp32act-fp16lora",
                 marks=pytest.mark.interpreter),  # dy fp32, B fp16 in the expand backward
    # under autocast PEFT's bnb layers cast nothing (the LoRA matmuls run in bf16, ours in fp32 from the same inputs)
    pytest.param("torch", _4bit("nf4", BF16), FP32, None, BF16, id="torch-nf4-bf16compute-autocast"),
    pytest.param("torch", dict(load_in_8bit=True), BF16, None, None, id="torch-int8-bf16"),
    pytest.param("triton", dict(load_in_8bit=True), FP16, None, None, id="triton-int8-fp16",
                 marks=pytest.mark.interpreter),
]


def exact_twin(model):
    """``model`` computing in fp32 from the same stored weights: 4-bit layers dequantize and multiply in fp32, every
    non-quantized weight (norms, embeddings, LoRA) upcast; quantized weights untouched."""
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.compute_dtype, m.compute_type_is_set = torch.float32, True
            m.weight.quant_state.dtype = torch.float32
    for p in model.parameters():
        if p.is_floating_point() and not isinstance(p, (bnb.nn.Params4bit, bnb.nn.Int8Params)):
            p.data = p.data.float()
    return model


def _output_dtypes(model, run):
    """``{module name: output dtype}`` of every LoRA layer during ``run()``."""
    from peft.tuners.lora import LoraLayer

    seen, hooks = {}, []

    def record(name, module, args, out):
        seen[name] = out.dtype

    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            hooks.append(m.register_forward_hook(partial(record, name)))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


@needs_bnb
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend, quant, dtype, lora_dtype, autocast", DTYPE_CASES)
def test_qlora_compute_dtypes_match_peft(checkpoint, backend, quant, dtype, lora_dtype, autocast, train):
    """16-bit compute, activations and adapters match PEFT (:func:`check_dtypes_match_peft`)."""
    check_dtypes_match_peft(checkpoint, backend, quant, dtype, lora_dtype, autocast, train)


def check_dtypes_match_peft(checkpoint, backend, quant, dtype, lora_dtype, autocast, train, device="cpu"):
    """16-bit compute, activations and adapters: every layer's output dtype is PEFT's; logits, input and LoRA
    gradients (relative RMSE, fla's measure: the max error of one entry is chaotic at 16 bits, a 1-ulp change in a
    layer moves single gradients by several) are at most twice as far from the exact result as stock PEFT's
    per-sample runs, plus the low precision's unit roundoff (see ``slack``)."""
    from test_paths import NAMES as ROWS
    from test_paths import _inputs, _peft_per_sample, _step

    # lora_B scaled by 0.3: PEFT's init_lora_weights=False gives deltas larger than this tiny random base's own
    # outputs, and in 16 bits the per-sample results then turn chaotic (stock PEFT's own input-grad error 13 % with a
    # bf16 fp4 base on the CPU, ours 2 %; on an H200 the other way round), so the rule would compare noise; at 0.3 both
    # errors are ~1 %, while a wrong slot or row still moves results by the delta itself
    model, ref, exact = (qlora_model(checkpoint, quant, dtype=dtype, lora_dtype=lora_dtype, device=device,
                                     b_scale=0.3) for _ in range(3))
    exact = exact_twin(exact)
    report = fast_multilora.patch(model, backend=backend)
    assert not report.fallback and len(report.patched) == 7, report
    for m in (model, ref, exact):
        m.train(train)
    ids, w = (t.to(device) for t in _inputs(5))
    ctx = (lambda: torch.autocast(device, dtype=autocast)) if autocast else torch.enable_grad
    with ctx():
        got_dtypes = _output_dtypes(model, lambda: model(inputs_embeds=model.get_input_embeddings()(ids),
                                                         adapter_names=ROWS))
        ref.set_adapter("a1")  # on every target
        want_dtypes = _output_dtypes(ref, lambda: ref(inputs_embeds=ref.get_input_embeddings()(ids[:1])))
        assert got_dtypes == want_dtypes
        got = _step(model, ids, w, adapter_names=ROWS)
        want = _peft_per_sample(ref, ids, w, ROWS)
    truth = _peft_per_sample(exact, ids, w, ROWS)
    assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
    assert set(got[2]) == set(want[2]) == set(truth[2])
    lowp = next(d for d in (autocast, lora_dtype, dtype, quant.get("bnb_4bit_compute_dtype")) if d in (BF16, FP16))
    # the torch backend's LoRA math is fp32 (one rounding into the output); the Triton kernels feed their dots 16-bit
    # operands (A, B, h and dh rounded to the activation dtype: three roundings more than PEFT's fp32 LoRA math)
    slack = torch.finfo(lowp).eps * (1 if backend == "torch" else 4)
    if quant.get("load_in_8bit"):  # LLM.int8() rounds activations to 1/127 of a row's absmax: a 1-ulp change can
        slack += 1 / 127  # move one step
    grads = list(truth[2])
    for what, g, p, t in [("logits", got[0], want[0], truth[0]), ("input grad", got[1], want[1], truth[1]),
                          ("LoRA grads", [got[2][n] for n in grads], [want[2][n] for n in grads],
                           [truth[2][n] for n in grads])]:
        err, peft_err = _rel_rmse(g, t), _rel_rmse(p, t)
        assert err <= 2 * peft_err + slack, f"{what}: error {err:.3g} vs PEFT's {peft_err:.3g} (slack {slack:.3g})"


def _rel_rmse(got, truth):
    """fla's relative RMSE ``|got - truth| / |truth|``; for lists the root mean square over the tensors."""
    if isinstance(got, list):
        return (sum(_rel_rmse(g, t) ** 2 for g, t in zip(got, truth, strict=True)) / len(got)) ** 0.5
    return ((got.double() - truth.double()).norm() / truth.double().norm()).item()


@needs_bnb
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_qlora_kbit_training_with_checkpointing(checkpoint):
    """``prepare_model_for_kbit_training`` (norms in fp32, input grads, gradient checkpointing), then a mixed
    training step: equal to stock PEFT per sample; ``merge_and_unload`` still works on the patched model."""
    model = qlora_model(checkpoint, "nf4", kbit_training=True)
    ref = qlora_model(checkpoint, "nf4", kbit_training=True)
    fast_multilora.patch(model)
    model.train()
    ref.train()
    assert_matches_peft(model, ref, "kbit", adapter_names=NAMES)
    model.set_adapter("a1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merging into 4-bit weights rounds: bitsandbytes / PEFT say so
        merged = model.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())


def torchao_model(path, dtype=torch.float32):
    """The checkpoint with torchao int8 weight-only linears (as transformers loads it), three adapters."""
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import LlamaForCausalLM, TorchAoConfig

    base = LlamaForCausalLM.from_pretrained(path, quantization_config=TorchAoConfig(quant_type=Int8WeightOnlyConfig()),
                                            dtype=dtype, device_map="cpu")
    return with_adapters(base)


@needs_torchao
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torchao_int8_mixed_batch_matches_peft(checkpoint, backend, train):
    """PEFT's ``TorchaoLoraLinear`` (a ``lora.Linear`` over an int8 weight-only base) runs our Function, the torchao
    linear called as PEFT calls it: parity with stock PEFT per sample (fp32, the same int8 weights: fp32-tight)."""
    from peft.tuners.lora.torchao import TorchaoLoraLinear

    model, ref = torchao_model(checkpoint), torchao_model(checkpoint)
    report = fast_multilora.patch(model, backend=backend)
    assert not report.fallback and len(report.patched) == 7, report
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, TorchaoLoraLinear)
    assert isinstance(q_proj.base_layer.weight, torchao.utils.TorchAOBaseTensor)
    model.train(train)
    ref.train(train)
    assert_matches_peft(model, ref, "torchao", adapter_names=NAMES)


@needs_torchao
def test_torchao_merge_and_unload_unaffected(checkpoint):
    """After mixed steps on our path, ``merge_and_unload`` (PEFT re-quantizes the merged weight) gives stock PEFT's
    merged model."""
    model, ref = torchao_model(checkpoint), torchao_model(checkpoint)
    fast_multilora.patch(model)
    model.eval()
    ids = torch.randint(0, 97, (len(NAMES), 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids, adapter_names=NAMES)
    merged = []
    for m in (model, ref):
        m.set_adapter("a1")
        merged.append(m.merge_and_unload())
    assert not any("lora_" in n for n, _ in merged[0].named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(merged[0](input_ids=ids).logits, merged[1](input_ids=ids).logits, rtol=0, atol=0)


class _FakeGPTQ(torch.nn.Module):
    """Stands in for a GPTQ ``QuantLinear`` (PEFT reads ``infeatures`` / ``outfeatures``); gptqmodel is not a test
    dependency."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.infeatures, self.outfeatures = n_in, n_out
        self.qweight = torch.nn.Parameter(torch.randn(n_out, n_in), requires_grad=False)

    def forward(self, x):
        return x @ self.qweight.T


def test_layers_peft_cannot_mix_raise_clearly():
    """PEFT's GPTQ / AWQ / AQLM / EETQ layers take no ``adapter_names`` (stock PEFT cannot mix adapters there): they
    stay on PEFT's path, the report says why, a mixed batch raises naming the layer, an unrouted call runs PEFT's."""
    from peft import LoraConfig
    from peft.tuners.lora.gptq import GPTQLoraLinear

    layer = GPTQLoraLinear(_FakeGPTQ(16, 8), "a0", config=LoraConfig(r=2, init_lora_weights=False), r=2, lora_alpha=4)
    tree = torch.nn.Sequential(layer)
    x = torch.randn(3, 16)
    want = layer(x)
    with pytest.warns(UserWarning, match="PEFT's per-sample"):
        report = fast_multilora.patch(tree)
    assert not report.patched and "GPTQ" in report.fallback["0"] and "takes no adapter_names" in str(report)
    with pytest.raises(ValueError, match="GPTQLoraLinear cannot run a mixed batch"):
        tree(x, adapter_names=["a0", "__base__", "a0"])
    torch.testing.assert_close(tree(x), want)


def _row_losses(model, ids, **route):
    """Each row's causal-LM loss (mean over its tokens), summed: every adapter's gradient is the sum of its rows'."""
    logits = model(input_ids=ids, **route).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").mean(1).sum()


def _adapter_groups(model, lrs):
    """One optimizer parameter group per adapter (its own learning rate), as multi-adapter trainers build them."""
    return [{"params": [p for n, p in model.named_parameters() if "lora_" in n and f".{name}." in n], "lr": lr}
            for name, lr in lrs.items()]


@needs_bnb
@pytest.mark.filterwarnings("ignore::UserWarning")  # bitsandbytes: paged optimizers fall back to unpaged on CPU
def test_qlora_training_recipe(checkpoint, tmp_path):
    """QLoRA as people run it, three adapters at once: ``prepare_model_for_kbit_training`` with gradient
    checkpointing, bitsandbytes' ``PagedAdamW8bit`` (unpaged on CPU: bitsandbytes pages on CUDA only; the paged run
    is in test_quantized_gpu.py) with one parameter group per adapter, three mixed steps. Stock PEFT, each row
    run alone with its adapter and the same optimizer stepping on the summed gradients, ends with the same weights;
    each adapter saved with ``save_pretrained`` loads into stock PEFT with those weights; ``merge_and_unload`` of
    the trained model equals stock PEFT's merge of the saved adapter."""
    run_qlora_recipe(checkpoint, tmp_path)


def run_qlora_recipe(checkpoint, tmp_path, device="cpu"):
    """The body of :func:`test_qlora_training_recipe` on ``device`` (CUDA: paged optimizer states)."""
    from peft import PeftModel
    from test_paths import NAMES as ROWS

    model = qlora_model(checkpoint, "nf4", kbit_training=True, device=device)
    ref = qlora_model(checkpoint, "nf4", kbit_training=True, device=device)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.base_model.model.modules())
    report = fast_multilora.patch(model)
    assert not report.fallback and len(report.patched) == 7
    lrs = {"a0": 2e-2, "a1": 1e-2, "a2": 5e-3}
    opts = [bnb.optim.PagedAdamW8bit(_adapter_groups(m, lrs), min_8bit_size=64) for m in (model, ref)]
    assert all(st.numel() >= 64 for g in opts[0].param_groups for st in g["params"])  # every state is 8-bit
    g = torch.Generator().manual_seed(5)
    model.train()
    ref.train()
    for _ in range(3):
        ids = torch.randint(0, 97, (len(ROWS), 6), generator=g).to(device)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        _row_losses(model, ids, adapter_names=ROWS).backward()
        for i, name in enumerate(ROWS):  # stock PEFT: row by row, its adapter alone; the gradients add up
            if name == "__base__":
                continue  # no LoRA gradient
            ref.set_adapter(name)
            for n, p in ref.named_parameters():
                p.requires_grad_("lora_" in n)
            _row_losses(ref, ids[i : i + 1]).backward()
        for opt in opts:
            opt.step()
    assert opts[0].state[opts[0].param_groups[0]["params"][0]]["state1"].dtype == torch.uint8
    trained = {n: p.detach().cpu() for n, p in model.named_parameters() if "lora_" in n}
    want = {n: p.detach().cpu() for n, p in ref.named_parameters() if "lora_" in n}
    start = {n: p.detach() for n, p in qlora_model(checkpoint, "nf4").named_parameters() if "lora_" in n}
    for n, w in want.items():  # the same updates up to the 8-bit states' rounding of the same (fp32-close) grads
        step = (w - start[n]).abs().max().item()
        assert step > 0, n
        torch.testing.assert_close(trained[n], w, rtol=0, atol=0.02 * step, msg=lambda m, n=n: f"{n}: {m}")

    model.save_pretrained(tmp_path)
    for name in lrs:  # PEFT saves each adapter in a subfolder named after it
        loaded = PeftModel.from_pretrained(quantized_base(checkpoint, "nf4", device=device), tmp_path / name,
                                           adapter_name=name)
        got = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        assert got and set(got) == {n for n in trained if f".{name}." in n}
        for n, p in got.items():
            assert torch.equal(p.cpu(), trained[n]), n
        if name == "a1":
            loaded.set_adapter(name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                theirs = loaded.merge_and_unload()
                model.set_adapter(name)
                ours = model.merge_and_unload()
            ids = torch.randint(0, 97, (2, 6), generator=g).to(device)
            ours.eval()  # bitsandbytes' CPU 4-bit layers repack their weights in eval mode: the same mode for both
            theirs.eval()
            with torch.no_grad():
                assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
