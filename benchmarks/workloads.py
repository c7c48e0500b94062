"""Models and batches of the benchmark scenarios: the Llama-shaped model (~0.5 B, random init), its QLoRA form
(bitsandbytes nf4, double quantization), a Qwen3-MoE-shaped model, the README's tiny Llama, one 4096² layer; PEFT
models with N adapters; token batches and routing (adapter names per row, packed rows).

``Sizes("full")`` are the GPU shapes the results name; ``Sizes("tiny")`` the same structure small enough for a CPU
(what ``--device cpu`` runs and the tests check).
"""

from __future__ import annotations

import copy
import tempfile

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL7 = ATTN + MLP
MOE_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]  # PEFT target_parameters (expert LoRA)
LR = 1e-4

# the README's quick-start model and adapters (fast_multilora's README, "runs as it is")
README_MODEL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256)
README_ADAPTERS = {"sql": dict(r=8, target_modules=ALL7), "chat": dict(r=4, target_modules=ATTN),
                   "code": dict(r=16, target_modules=MLP, lora_dropout=0.1)}
README_NAMES = ["chat", "sql", "__base__", "code"]
README_TOKENS = (4, 32)

# churn: a tiny Llama at every size (the cost measured is the host's bookkeeping, which grows with the registry),
# r 4 on q/v/gate, 8 rows x 16 tokens of 8 adapters
CHURN_MODEL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
CHURN_LORA = dict(rank=4, targets=["q_proj", "v_proj", "gate_proj"], dropout=0.0, init_lora_weights=False)
CHURN_TOKENS = (8, 16)


class Sizes:
    """Shapes of one size (``full``: the GPU benchmark; ``tiny``: the same structure for a CPU)."""

    def __init__(self, size: str):
        if size not in ("full", "tiny"):
            raise ValueError(f"size {size!r}; expected 'full' or 'tiny'")
        self.size = size
        full = size == "full"
        self.llama = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096) if full else \
            dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
        self.moe = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=16,
                        num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                        head_dim=128, vocab_size=32000, max_position_embeddings=4096) if full else \
            dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=16,
                 num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, vocab_size=128, max_position_embeddings=128)
        self.layer = (4096, 4096, 8, 1024) if full else (64, 64, 8, 16)  # K, N, rows, tokens per row
        self.rows, self.T = (16, 1024) if full else (16, 16)
        self.gen_prompt, self.gen_new = (128, 64) if full else (8, 4)
        # step_8b_fused_loss: Llama-3-8B's shapes (tiny: the same structure), rows x tokens, 2 packed samples per row
        self.llama8b = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                            rope_theta=500000.0, rms_norm_eps=1e-5) if full else \
            dict(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, vocab_size=512, max_position_embeddings=128, rope_theta=500000.0,
                 rms_norm_eps=1e-5)
        self.rows_8b, self.T_8b = (4, 2048) if full else (4, 32)
        self.rank = 16
        # create_adapters: adapter counts created by fast_multilora.add_adapters, and the (fewer) by PEFT's own loop
        self.create = (32, 128, 256, 512, 1024) if full else (8, 32)
        self.create_peft = (32, 128) if full else (8,)
        # train_step_scale: (adapters resident, adapters in the batch), equal tokens
        self.scale = ((8, 8), (64, 8), (64, 64), (256, 8), (256, 64), (1024, 8), (1024, 64)) if full else \
            ((8, 8), (32, 8), (32, 32))
        # churn: registry sizes (PEFT's add_adapter / delete_adapter reference at each), churn rounds per row
        self.churn = (128, 512, 1024) if full else (8, 32)
        self.churn_reps = 3
        # train_step_paged: (adapters registered, adapters per step); the 8B-shaped case: attention projections only
        self.paged = (1024, 64) if full else (32, 4)
        self.paged_8b = (128, 8) if full else (32, 8)
        self.warm, self.iters = (3, 11) if full else (1, 3)  # host-bound steps vary call to call: medians of 11
        self.slow_warm, self.slow_iters = (1, 3) if full else (1, 2)  # PEFT's loops, generation


def lora_config(rank=16, targets=ALL7, dropout=0.05, init_lora_weights=True, target_parameters=None, **kw):
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=targets,
                      init_lora_weights=init_lora_weights, target_parameters=target_parameters, **kw)


def all_lora_trainable(model) -> None:
    """Every adapter's LoRA weights trainable (PEFT trains only the active adapter), nothing else."""
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)


def lora_params(model, adapter=None) -> list:
    return [p for n, p in model.named_parameters() if "lora_" in n and (adapter is None or f".{adapter}." in n)]


def adapters_with_grads(model, names) -> int:
    """How many of ``names`` got a nonzero gradient on some LoRA weight."""
    return sum(any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in lora_params(model, a)) for a in names)


def lora_b_off_zero(model, seed=2) -> None:
    """B off zero (PEFT initialises it to 0), so comparisons with other paths compare real deltas."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                g = torch.Generator(device=p.device).manual_seed(seed)
                p.copy_(torch.randn(p.shape, generator=g, device=p.device) * 0.02)


def _init_on(device, build):
    import torch

    torch.manual_seed(0)
    if device == "meta":
        with torch.device("meta"):
            return build()
    try:
        with torch.device(device):  # init on the GPU: seconds instead of minutes on a few host cores
            return build()
    except Exception:  # noqa: BLE001 - a model class that refuses device init: build on the CPU and move
        return build().to(device)


def llama(sizes: Sizes, device, dtype, config=None):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**(config or sizes.llama))
    return _init_on(device, lambda: LlamaForCausalLM(cfg)).to(dtype)


def head_8b(sizes: Sizes, device, dtype):
    """The LM head of :func:`llama8b` (``nn.Linear(hidden, vocab, bias=False)``), frozen, LlamaForCausalLM's init
    (normal, std 0.02)."""
    import torch

    cfg = sizes.llama8b
    g = torch.Generator(device="cpu").manual_seed(0)
    head = torch.nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, 0.02, generator=g)
    return head.to(device, dtype).requires_grad_(False)


def llama8b(sizes: Sizes, device, dtype):
    """Llama-3-8B-shaped model (random init), built in ``dtype`` directly on ``device`` (an fp32 build then a cast
    would hold 32 GB + 16 GB at once; on the GPU the init takes seconds, on a few host cores minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**sizes.llama8b)
    return _init_on(device, lambda: LlamaForCausalLM._from_config(cfg, dtype=dtype))


def moe(sizes: Sizes, device, dtype):
    """Qwen3-MoE-shaped model, experts on transformers' ``grouped_mm``."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    base = _init_on(device, lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**sizes.moe)))
    base.config._experts_implementation = "grouped_mm"
    return base.to(dtype)


def qlora_base(sizes: Sizes, device, dtype):
    """The Llama-shaped model saved and loaded back in 4-bit (nf4, double quantization), as QLoRA bases are loaded."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    with tempfile.TemporaryDirectory() as folder:
        llama(sizes, device, dtype).save_pretrained(folder)
        return LlamaForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=dtype, device_map=device)


def layer_base(sizes: Sizes, device, dtype):
    import torch

    K, N, _, _ = sizes.layer
    lin = _init_on(device, lambda: torch.nn.Sequential(torch.nn.Linear(K, N, bias=False))).to(dtype)
    lin.requires_grad_(False)
    return lin


def peft_model(base, n_adapters, device, dtype, **lora):
    """``base`` with adapters ``a0 .. a{n-1}`` (``lora_config(**lora)``), LoRA weights in ``dtype``, all trainable."""
    from peft import get_peft_model

    cfg = lora_config(**lora)
    pm = get_peft_model(base, cfg, adapter_name="a0")
    grow(pm, n_adapters)
    peft_model_dtype(pm, device, dtype)
    all_lora_trainable(pm)
    return pm


def peft_model_dtype(pm, device, dtype) -> None:
    """LoRA weights on ``device`` in ``dtype`` (a quantized base stays as loaded)."""
    if device == "meta":
        return
    for n, p in pm.named_parameters():
        if "lora_" in n and (p.device.type != device or p.dtype != dtype):
            p.data = p.data.to(device, dtype)


def grow(pm, n_adapters) -> None:
    """Add adapters to ``pm`` until it has ``a0 .. a{n-1}`` (configs copied from ``a0``), by
    ``fast_multilora.add_adapters`` (one walk of the model: PEFT's ``add_adapter`` loop is quadratic in n; the model
    ends the same)."""
    import fast_multilora

    more = {f"a{i}": copy.deepcopy(pm.peft_config["a0"]) for i in range(n_adapters) if f"a{i}" not in pm.peft_config}
    if more:
        fast_multilora.add_adapters(pm, more)


def readme_model(device, dtype):
    """The README's quick start: a tiny Llama with adapters sql (r 8, all 7), chat (r 4, attention), code (r 16, MLP,
    dropout 0.1), all trainable."""
    from peft import get_peft_model

    base = llama(None, device, dtype, README_MODEL)
    first, *rest = README_ADAPTERS
    pm = get_peft_model(base, _readme_cfg(first), adapter_name=first)
    for name in rest:
        pm.add_adapter(name, _readme_cfg(name))
    all_lora_trainable(pm)
    return pm


def _readme_cfg(name):
    from peft import LoraConfig

    return LoraConfig(**README_ADAPTERS[name])


def token_ids(rows, T, vocab, device, seed=1):
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, vocab, (rows, T), generator=g).to(device)


def interleaved(n_adapters, rows, base_rows=0, pick=None):
    """Adapter names per row, cycling through ``pick`` (default ``a0 .. a{n-1}``), then ``base_rows`` base rows."""
    pick = pick or [f"a{i}" for i in range(n_adapters)]
    return [pick[i % len(pick)] for i in range(rows - base_rows)] + ["__base__"] * base_rows


def grouped(names):
    """The same names, rows of one adapter next to each other (base rows last)."""
    return sorted(names, key=lambda n: (n == "__base__", n))


def spread(n_resident, n_batch):
    """``n_batch`` of ``a0 .. a{n_resident-1}``, evenly spaced (the adapters a scale step's batch trains)."""
    step = n_resident // n_batch
    return [f"a{i * step}" for i in range(n_batch)]


def packed_rows(pick, rows, T, device):
    """``(adapter_ids [rows, T], position_ids [rows, T])`` of packed rows: ``len(pick) // rows`` samples per row (at
    least 1), each with its own positions, sample ``s`` on ``pick[s % len(pick)]`` (ids index ``pick``)."""
    import torch

    per_row = max(1, -(-len(pick) // rows))
    seg = T // per_row
    j = (torch.arange(T) // seg).clamp(max=per_row - 1)  # [T] sample of each position in its row
    sample = torch.arange(rows)[:, None] * per_row + j  # [rows, T]
    pos = (torch.arange(T) - j * seg).expand(rows, T)
    return (sample % len(pick)).contiguous().to(device), pos.contiguous().to(device)
