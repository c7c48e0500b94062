"""Scenarios as data (``SCENARIOS``), the state one scenario's rows share (``Context``: models built once, lazily,
batches per variant) and the in-process measurement of one provider's rows (``measure``).

A scenario runs its providers in table order (``frozen`` first, on the base model before PEFT wraps it). Variants:
``""`` (every provider) and others (the ``fast`` family only, e.g. ``per_adapter_loss``); a scenario whose variants are
all non-empty (``train_step_scale``'s adapter counts) runs ``frozen`` once and its other providers per variant.
``create_adapters``' counts run PEFT's quadratic loop only at the small ones (``shared_variants``); ``churn``'s run
PEFT's add/delete at every count. ``churn`` rows time themselves (several operations per row, ``Step.timed``);
``train_step_paged`` rows compare paging with the fully resident row (``Scenario.refs``: its ratios).
"""

from __future__ import annotations

import gc
import traceback
from dataclasses import dataclass

import harness
import workloads as M
from providers import PROVIDERS, Step, prepare

TRAIN = ("frozen", "frozen_compiled", "peft_single", "peft_single_fused_adamw", "peft_single_compiled",
         "peft_sequential", "peft_mixed_loop", "fast_multilora", "fast_multilora_fused_adamw",
         "fast_multilora_paged_adamw8bit", "fast_multilora_compiled", "fast_multilora_store_adamw",
         "fast_multilora_params")
EVAL = ("frozen", "frozen_compiled", "peft_single", "peft_single_compiled", "peft_mixed_loop", "fast_multilora",
        "fast_multilora_compiled", "fast_multilora_params")
GENERATE = ("frozen", "peft_mixed_loop", "fast_multilora", "fast_multilora_params")
LAYER = ("frozen", "peft_single", "peft_mixed_loop", "fast_multilora")
PAGED = ("fast_multilora", "fast_multilora_fused_adamw", "fast_multilora_paged", "fast_multilora_paged_default_adamw",
         "fast_multilora_paged_no_prefetch", "fast_multilora_paged_params")


@dataclass(frozen=True)
class Scenario:
    name: str
    kind: str  # train | scale | eval | generate | layer | head | create | churn | paged | declared
    model: str  # llama | llama8b | qlora | moe | readme | layer | head8b | churn
    description: str
    providers: tuple = ()
    variants: tuple = ("",)
    skip: tuple = ()  # (provider, reason): rows recorded as skipped
    not_implemented: str | None = None  # declared slot: no measurement until the library has the feature
    needs: str | None = None  # a module the scenario needs (bitsandbytes)
    dropout: float = 0.05
    default: bool = True  # in run.py's default list
    lora: tuple = ()  # more LoraConfig settings, (name, value) pairs
    liger: bool = False  # Liger Kernel's patches (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy) on the base
    timing: str = ""  # how the rows are timed, where it differs from run.py's default note
    refs: tuple = ()  # more reference providers for the rows' ratios (harness.add_ratios)


_LLAMA = "Llama-shaped model (full: 8 layers, hidden 2048, intermediate 5632, 32/4 heads, vocab 32000, ~0.5 B), bf16"
_TOK = "16 x 1024 tokens (tiny: 16 x 16)"
SCENARIOS = {s.name: s for s in (
    Scenario("train_step_8", "train", "llama",
             f"{_LLAMA}, {_TOK}, 8 adapters r=16 alpha 32 dropout 0.05 on all 7 projections, one optimizer step; "
             "variant '': HF labels= loss, rows interleaved a0,a1,..; per_adapter_loss: fast_multilora."
             "per_adapter_loss, rows grouped by adapter", TRAIN, ("", "per_adapter_loss")),
    Scenario("qlora_step_8", "train", "qlora",
             "train_step_8 on the same model saved and loaded in 4-bit (bitsandbytes nf4, double quantization, bf16 "
             "compute); LoRA bf16", TRAIN, ("", "per_adapter_loss"), needs="bitsandbytes"),
    Scenario("moe_step_8", "train", "moe",
             "Qwen3-MoE-shaped model (full: 8 layers, hidden 2048, 16 experts x intermediate 768, top-2, grouped_mm), "
             f"{_TOK}, 8 adapters r=16 dropout 0 on q/k/v/o + experts (PEFT target_parameters)", TRAIN,
             ("", "per_adapter_loss"),
             skip=(("peft_mixed_loop", "PEFT's expert LoRA (lora.ParamWrapper) refuses adapter_names"),), dropout=0.0),
    Scenario("layer_4096", "layer", "layer",
             "one nn.Linear 4096x4096 (tiny: 64x64), 8 x 1024 tokens, forward + backward (dx and LoRA grads), 8 "
             "adapters r=16 mixed, no optimizer", LAYER),
    Scenario("eval_8", "eval", "llama", f"{_LLAMA}, forward only, {_TOK}: 8 adapters over 14 rows + 2 base rows",
             EVAL),
    Scenario("generate_static", "generate", "llama",
             f"{_LLAMA}, generate 16 prompts x 128 tokens (tiny: 8), 64 new tokens (tiny: 4), greedy, 8 adapters over "
             "12 rows + 4 base rows, cache_implementation='static' (transformers compiles the decode step)", GENERATE,
             dropout=0.0),
    Scenario("generate_dynamic", "generate", "llama", "generate_static with the default dynamic cache, eager",
             GENERATE, dropout=0.0),
    Scenario("train_step_scale", "scale", "llama",
             "train_step_8's model and tokens; n adapters resident and in the optimizer, 8 or 64 of them in the batch "
             "(8: 2 rows each, adapter_names; 64: packed rows of 4 samples, adapter_ids), HF labels= loss",
             ("frozen", "fast_multilora", "fast_multilora_store_adamw"), variants=("scale",)),
    Scenario("readme_step_cpu", "train", "readme",
             "the README's quick-start step on a CPU: tiny Llama (hidden 64, 2 layers, vocab 256), adapters sql (r 8, "
             "all 7), chat (r 4, attention), code (r 16, MLP, dropout 0.1), 4 x 32 tokens, rows chat/sql/base/code; "
             "torch backend", ("frozen", "peft_single", "peft_mixed_loop", "fast_multilora",
                               "fast_multilora_store_adamw"), ("", "per_adapter_loss"), default=False,
             timing="every row warm-up/iterations 3/21 (steps of milliseconds)"),
    Scenario("create_adapters", "create", "llama",
             f"{_LLAMA}, as a PeftModel holding one adapter; seconds to create n more (r=16 "
             "alpha 32 dropout 0.05 on all 7 projections, PEFT's default init, weights fp32 as PEFT's "
             "autocast_adapter_dtype makes them): fast_multilora.add_adapters(model, {name: LoraConfig}) at every n, "
             "PEFT's own loop (PeftModel.add_adapter per adapter, quadratic in n) at the small n; fast rows also "
             "time save_adapters of the n adapters and load_adapters of them into a fresh model (extra save_s, "
             "load_s). Variants n=<count> (full: 32, 128, 256, 512, 1024; tiny: 8, 32). Target: n=1024 created in "
             "<= 30 s on the H200", ("fast_multilora", "peft_add_adapter"), ("create",), default=False,
             timing="wall clock between synchronizes, one creation per repetition on a fresh model (setup untimed), "
                    "no warm-up; 3 repetitions up to n=128 (PEFT's loop: n=32), 1 above"),
    Scenario("train_step_8_liger", "train", "llama",
             "train_step_8 with Liger Kernel's patches on the base (apply_liger_kernel_to_llama: RMSNorm, SwiGLU, "
             "RoPE, fused linear cross-entropy for the HF labels= loss) for every provider: Liger + stock PEFT (one "
             "adapter) beside Liger + fast_multilora (8 mixed)", ("frozen", "peft_single", "fast_multilora",
                                                                   "fast_multilora_fused_adamw"),
             ("", "per_adapter_loss"), needs="liger_kernel", liger=True, default=False),
    Scenario("train_step_paged", "paged", "llama",
             "train_step_8's model and tokens; n adapters registered (r=16 alpha 32 dropout 0.05 on all 7 "
             "projections), m of them per step, a different set each step (consecutive slices of m in turn; m=64: "
             "packed rows of 4 samples, adapter_ids), HF labels= loss, torch.optim.AdamW(fused=True) (the "
             "*_default_adamw row and fast_multilora, its resident reference: torch.optim.AdamW's defaults); paged "
             "(PatchConfig(resident_adapters=0): the step's adapters and the prefetched next ones on the device) with "
             "and without fast_multilora.prefetch, and on the per-parameter path (*_paged_params), against every "
             "adapter resident. Variants n=<registered>/batch=<per "
             "step> (full: 1024/64; tiny: 32/4). Target: paged step <= 1.15 x fully resident, peak memory that of "
             "~64 resident adapters", PAGED, ("paged",), refs=("fast_multilora_fused_adamw", "fast_multilora"),
             default=False,
             timing="steady state: one full cycle of the sets first, untimed (each adapter's first page-out "
                    "allocates its pinned host page; those steps' wall times go to extra.first_cycle_ms), then "
                    "run.py's warm-up and iterations"),
    Scenario("train_step_paged_8b", "paged", "llama8b",
             "train_step_paged on the Llama-3-8B-shaped model of step_8b_fused_loss (tiny: 2 layers, hidden 64) and "
             "its 4 x 2048 tokens (tiny: 4 x 32) as packed rows of 2 samples; adapters r=16 alpha 32 dropout 0.05 on "
             "the attention projections (q/k/v/o); variants n=<registered>/batch=<per step> (full: 128/8; tiny: 32/8)",
             PAGED, ("paged",), refs=("fast_multilora_fused_adamw", "fast_multilora"), default=False,
             lora=(("targets", M.ATTN),), timing="as train_step_paged's"),
    Scenario("churn", "churn", "churn",
             "adapter churn in a registry of n adapters: a tiny Llama at every size (hidden 32, intermediate 48, 2 "
             "layers, 4/2 heads, vocab 97: the cost measured is the host's bookkeeping), r=4 alpha 8 on "
             "q/v/gate (B off zero), 8 x 16 tokens of 8 adapters, fast_multilora.per_adapter_loss; each round: a "
             "step (step_ms), one adapter added (add_ms: fast_multilora.add_adapters on the patched model; "
             "peft_add_adapter: stock PEFT's add_adapter, unpatched), the step training it with 7 others "
             "(add_step_ms), it deleted (delete_ms: fast_multilora.delete_adapters; peft_add_adapter: "
             "PeftModel.delete_adapter), the next step (delete_step_ms); "
             "the fast rows' optimizer is fast_multilora.AdamW(model, lr), which follows adds and deletes by itself "
             "(no re-creation). wall_ms: add_ms. Variants n=<registered> (full: 128, 512, 1024; tiny: 8, 32)",
             ("fast_multilora_store_adamw", "peft_add_adapter"), ("churn",), default=False,
             timing="wall clock between synchronizes per operation, medians of 3 churn rounds after 2 steps"),
    Scenario("dora_step_8", "train", "llama",
             "train_step_8 with DoRA adapters (use_dora=True): stock PEFT trains one, fast_multilora 8 in one mixed "
             "batch", ("frozen", "peft_single", "peft_single_fused_adamw", "fast_multilora",
                       "fast_multilora_fused_adamw"), ("", "per_adapter_loss"), lora=(("use_dora", True),),
             default=False),
    Scenario("step_8b_fused_loss", "train", "llama8b",
             "Llama-3-8B-shaped model (full: 32 layers, hidden 4096, intermediate 14336, 32/8 heads, vocab 128256, "
             "rope theta 500000, ~8.0 B; tiny: 2 layers, hidden 64, vocab 512), bf16, random init on the device; 4 x "
             "2048 tokens (tiny: 4 x 32) as packed rows of 2 samples (adapter_ids, position_ids), 8 adapters r=16 "
             "alpha 32 dropout 0.05 on all 7 projections in one mixed batch, one step with torch.optim.AdamW; "
             "variant labels: HF's own labels= loss (model(..., labels=).loss: the full logits upcast to fp32, one "
             "mean over the batch); logits: fast_multilora.per_adapter_loss(model(...).logits, ...) (bf16 logits, its "
             "cross-entropy kernels, no fp32 copy); fused: fast_multilora.fused_causal_lm_loss(model, batch) (no "
             "logits built). Target: fused peak below the full logits' by at least the fp32 logits (extra "
             "logits_fp32_mib: 4008 MiB full), step time no worse",
             ("fast_multilora",), ("labels", "logits", "fused"), default=False),
    Scenario("head_loss_8b", "head", "head8b",
             "the loss end of step_8b_fused_loss alone: its LM head (4096 -> 128256, bf16; tiny: 64 -> 512) and "
             "loss over 4 x 2048 tokens (tiny: 4 x 32) of hidden states (random, requires grad), packed rows of 8 "
             "adapters (adapter_ids), forward + backward to the hidden states, no optimizer; frozen: the head and "
             "HF's mean cross-entropy of its logits (one loss); fast_multilora[logits]: fast_multilora."
             "per_adapter_loss of the logits; [fused]: fast_multilora.per_adapter_loss_from_hidden (no logits "
             "built; [fused/chunk=<tokens>]: the same with that many tokens per chunk, the default's A/B). Any "
             "card: the 8B step's variants differ only here", ("frozen", "fast_multilora"),
             ("logits", "fused", "fused/chunk=256", "fused/chunk=1024"), default=False),
)}


def variants_of(sc: Scenario, sizes: M.Sizes) -> list:
    if sc.variants == ("scale",):
        return [f"n={n}/batch={m}" for n, m in sizes.scale]
    if sc.variants == ("create",):
        return [f"n={n}" for n in sizes.create]
    if sc.variants == ("churn",):
        return [f"n={n}" for n in sizes.churn]
    if sc.variants == ("paged",):
        n, m = sizes.paged_8b if sc.model == "llama8b" else sizes.paged
        return [f"n={n}/batch={m}"]
    return list(sc.variants)


def shared_variants(sc: Scenario, sizes: M.Sizes) -> list:
    """The variants every provider runs (the others: the ``fast`` family only)."""
    if sc.variants == ("create",):
        return [f"n={n}" for n in sizes.create_peft]
    if sc.variants == ("churn",):  # one add and one delete per round: cheap at every count
        return [f"n={n}" for n in sizes.churn]
    return [""]


def rows_of(sc: Scenario, providers, sizes: M.Sizes, variants=None) -> list:
    """``(provider, variant)`` pairs ``sc`` measures among ``providers``, in run order (variant-major)."""
    vs = [v for v in variants_of(sc, sizes) if variants is None or v in variants]
    out = []
    for v in vs:
        for name in sc.providers:
            fam = PROVIDERS[name].family
            if name not in providers:
                continue
            if fam == "frozen":
                if v == vs[0]:
                    out.append((name, ""))
            elif fam == "fast" or v in shared_variants(sc, sizes):
                out.append((name, v))
    return out


class Context:
    """One scenario's shared state on one device: the base model, the PEFT model (built on first use), batches."""

    def __init__(self, sc: Scenario, device: str, size: str, backend: str, compile_backend: str):
        import torch

        self.torch, self.sc, self.kind, self.device = torch, sc, sc.kind, device
        self.sizes = M.Sizes(size)
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32  # bf16 matmuls crawl on CPUs
        self.backend, self.compile_backend = backend, compile_backend
        self._base = self._pm = None
        self._wrapped = False
        self._cache = {}

    def base(self):
        if self._wrapped:
            raise RuntimeError(f"{self.sc.name}: frozen must run before the PEFT model wraps the base")
        if self._base is None:
            s, dev, dt = self.sizes, self.device, self.dtype
            self._base = {"llama": lambda: M.llama(s, dev, dt), "llama8b": lambda: M.llama8b(s, dev, dt),
                          "moe": lambda: M.moe(s, dev, dt),
                          "qlora": lambda: M.qlora_base(s, dev, dt), "layer": lambda: M.layer_base(s, dev, dt),
                          "head8b": lambda: M.head_8b(s, dev, dt),
                          "readme": lambda: M.llama(s, dev, dt, M.README_MODEL)}[self.sc.model]()
            if self.sc.liger and dev != "meta":
                from liger_kernel.transformers import apply_liger_kernel_to_llama

                apply_liger_kernel_to_llama(model=self._base)
        return self._base

    def peft(self, n_adapters=None):
        """The PEFT model (built from the base on first use; grown to ``n_adapters`` adapters when given)."""
        if self._pm is None:
            if self.sc.model == "readme":
                self._pm = M.readme_model(self.device, self.dtype)
            else:
                lora = dict(dropout=self.sc.dropout, rank=self.sizes.rank)
                if self.sc.model == "moe":
                    lora.update(targets=M.ATTN, target_parameters=M.MOE_PARAMETERS)
                if self.sc.model == "layer":
                    lora.update(targets=["0"])
                if self.kind == "generate":
                    lora.update(init_lora_weights=False)
                lora.update(dict(self.sc.lora))
                self._pm = M.peft_model(self.base(), n_adapters or 8, self.device, self.dtype, **lora)
                if self.kind == "eval" and self.device != "meta":
                    M.lora_b_off_zero(self._pm)
            self._wrapped = True
        elif n_adapters:
            M.grow(self._pm, n_adapters)
            M.peft_model_dtype(self._pm, self.device, self.dtype)
        return self._pm

    def first_adapter(self) -> str:
        """The adapter stock PEFT's single-adapter rows train (a0; the README's first, sql)."""
        return next(iter(self.peft().peft_config))

    def cached(self, key, fn):
        if key not in self._cache:
            self._cache[key] = fn()
        return self._cache[key]

    def lora_layer_types(self) -> tuple:
        from peft.tuners.lora import Linear

        if self.sc.model == "qlora":
            from peft.tuners.lora.bnb import Linear4bit

            return (Linear4bit,)
        return (Linear,)

    def compile(self, model):
        if self.compile_backend == "inductor":
            return self.torch.compile(model)
        return self.torch.compile(model, backend=self.compile_backend)

    def batch(self, variant: str) -> dict:
        return self.cached(("batch", variant), lambda: self._batch(variant))

    def _batch(self, variant: str) -> dict:
        s, dev = self.sizes, self.device
        if self.sc.model == "readme":
            ids = M.token_ids(*M.README_TOKENS, M.README_MODEL["vocab_size"], dev)
            names = M.grouped(M.README_NAMES) if variant == "per_adapter_loss" else list(M.README_NAMES)
            return {"ids": ids, "names": names}
        if self.kind == "layer":
            K, N, rows, T = s.layer
            g = self.torch.Generator(device="cpu").manual_seed(0)
            x = self.torch.randn(rows, T, K, generator=g).to(dev, self.dtype).requires_grad_(True)
            gy = self.torch.randn(rows, T, N, generator=g).to(dev, self.dtype)
            return {"x": x, "gy": gy, "names": M.interleaved(8, rows)}
        if self.kind == "head":  # hidden states of the 8B step's tokens, their labels and packed routing
            H, V = s.llama8b["hidden_size"], s.llama8b["vocab_size"]
            g = self.torch.Generator(device="cpu").manual_seed(0)
            hidden = self.torch.randn(s.rows_8b, s.T_8b, H, generator=g).to(dev, self.dtype).requires_grad_(True)
            pick = M.interleaved(8, 8)
            adapter_ids, _ = M.packed_rows(pick, s.rows_8b, s.T_8b, dev)
            return {"hidden": hidden, "labels": M.token_ids(s.rows_8b, s.T_8b, V, dev), "names": pick,
                    "adapter_ids": adapter_ids}
        if self.kind in ("create", "churn"):
            return {"adapters": int(variant.split("=")[1])}
        if self.kind == "paged":  # the first set's routing; the step renames the adapters per set
            n, m = (int(kv.split("=")[1]) for kv in variant.split("/"))
            rows, T, vocab = ((s.rows_8b, s.T_8b, s.llama8b["vocab_size"]) if self.sc.model == "llama8b"
                              else (s.rows, s.T, s.llama["vocab_size"]))
            ids = M.token_ids(rows, T, vocab, dev)
            pick = [f"a{i}" for i in range(m)]
            if m <= rows:
                return {"ids": ids, "names": M.interleaved(m, rows, pick=pick), "adapters": n, "per_step": m}
            adapter_ids, pos = M.packed_rows(pick, rows, T, dev)
            return {"ids": ids, "names": pick, "adapter_ids": adapter_ids, "position_ids": pos, "adapters": n,
                    "per_step": m}
        if self.sc.model == "llama8b":  # 8 adapters over 4 rows: packed rows of 2 samples
            ids = M.token_ids(s.rows_8b, s.T_8b, s.llama8b["vocab_size"], dev)
            pick = M.interleaved(8, 8)
            adapter_ids, pos = M.packed_rows(pick, s.rows_8b, s.T_8b, dev)
            return {"ids": ids, "names": pick, "adapter_ids": adapter_ids, "position_ids": pos}
        vocab = (s.moe if self.sc.model == "moe" else s.llama)["vocab_size"]
        if self.kind == "generate":
            rows, T = s.rows, s.gen_prompt
            ids = M.token_ids(rows, T, vocab, dev)
            kw = dict(input_ids=ids, attention_mask=self.torch.ones_like(ids), max_new_tokens=s.gen_new,
                      min_new_tokens=s.gen_new, do_sample=False, pad_token_id=0)
            if self.sc.name == "generate_static":
                from transformers import CompileConfig

                if self.compile_backend == "inductor":
                    cc = CompileConfig()  # what generate uses by itself (reduce-overhead)
                else:
                    cc = CompileConfig(backend=self.compile_backend, mode=None)
                    cc._compile_all_devices = True  # transformers compiles on a CPU only when told to
                kw.update(cache_implementation="static", compile_config=cc)
            return {"ids": ids, "names": M.interleaved(8, rows, base_rows=rows // 4), "generate": kw}
        ids = M.token_ids(s.rows, s.T, vocab, dev)
        if self.kind == "eval":
            return {"ids": ids, "names": M.interleaved(8, s.rows, base_rows=2)}
        if self.kind == "scale":
            variant = variant or variants_of(self.sc, s)[0]  # frozen: the first count's tokens
            n, m = (int(kv.split("=")[1]) for kv in variant.split("/"))
            pick = M.spread(n, m)
            if m <= s.rows:
                return {"ids": ids, "names": M.interleaved(m, s.rows, pick=pick), "adapters": n}
            adapter_ids, pos = M.packed_rows(pick, s.rows, s.T, dev)
            return {"ids": ids, "names": pick, "adapter_ids": adapter_ids, "position_ids": pos, "adapters": n}
        names = M.interleaved(8, s.rows)
        return {"ids": ids, "names": M.grouped(names) if variant == "per_adapter_loss" else names}

    def free(self):
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()


def measure(ctx: Context, name: str, variant: str) -> dict:
    """One row: ``name``'s call prepared, timed and checked in this process; a raising provider is recorded."""
    p = PROVIDERS[name]
    skip = dict(ctx.sc.skip).get(name)
    if skip:
        return harness.make_row(name, variant, "skipped", skip)
    if p.needs:
        try:
            __import__(p.needs)
        except Exception as e:  # noqa: BLE001
            return harness.make_row(name, variant, "skipped", f"{p.needs} unavailable ({type(e).__name__}: {e})")
    torch = ctx.torch
    slow = p.family in ("peft_sequential", "peft_mixed_loop") or ctx.kind == "generate"
    warm, iters = (ctx.sizes.slow_warm, ctx.sizes.slow_iters) if slow else (ctx.sizes.warm, ctx.sizes.iters)
    if ctx.sc.model == "readme":  # the README's steps take milliseconds on a CPU: medians of many
        warm, iters = 3, 21
    step: Step | None = None
    try:
        if p.compiled or (ctx.kind == "generate" and ctx.sc.name == "generate_static"):
            torch._dynamo.reset()
            from torch._dynamo.utils import counters

            counters.clear()
        step = prepare(ctx, p, variant)
        extra = dict(step.info)
        if step.first:  # compile + first call, timed alone
            extra["compile_s"] = round(harness.wall_s(step.fn, ctx.device), 2)
            extra["compile_backend"] = ctx.compile_backend
        if step.timed is not None:  # the row times itself
            t = step.timed()
        elif step.setup is not None:  # each call on fresh state
            t = harness.time_fresh(step.fn, step.setup, ctx.device, iters=step.iters)
        else:
            t = harness.time_step(step.fn, ctx.device, warm=warm, iters=iters)
        if p.compiled:
            from torch._dynamo.utils import counters

            extra.update(graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))
        extra.update(step.check())
        row = harness.make_row(name, variant, **t, **extra)
    except Exception as e:  # noqa: BLE001 - recorded in the row, the run goes on
        traceback.print_exc()
        msg = f"{type(e).__name__}: {str(e)[:400]}"
        status = "error"
        if ctx.device == "cuda" and isinstance(e, torch.cuda.OutOfMemoryError):
            msg = "out of memory: " + msg
        row = harness.make_row(name, variant, status, msg)
    finally:
        if step is not None:
            try:
                step.teardown()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
        if p.compiled:
            torch._dynamo.reset()
        ctx.free()
    return row
