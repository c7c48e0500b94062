"""Issue 4's harness: fast_multilora against stock PEFT, layer and model level, providers side by side in one run.

Providers (every scenario runs the ones that make sense for it):

* ``fast_multilora``   PEFT model with N adapters, ``fast_multilora.patch(model, backend="triton")``, one mixed batch
                       (``adapter_names`` one per row, interleaved then sorted); train steps use
                       ``fast_multilora.per_adapter_loss`` (each adapter's mean token loss, summed)
* ``fast_multilora_plain_loss``  the same step with HF's ``.loss`` (mean over all tokens): what the loss costs
* ``fast_multilora_share_dropout`` (8-adapter step): ``patch(..., share_dropout=True)``, q/k/v and gate/up sharing
                       their shrink under dropout (a mask per slice)
* ``fast_multilora_unshared`` (eval), ``fast_multilora_p0`` / ``fast_multilora_p0_unshared`` /
                       ``peft_single_p0`` (8-adapter train step with LoRA dropout 0): the shared shrink of sibling
                       layers on and off
* ``peft_single_fused_adamw`` / ``fast_multilora_fused_adamw`` (8-adapter step): both with ``AdamW(fused=True)``
* ``fast_multilora_adamw`` (8-adapter step, eager and compiled): ``fast_multilora.AdamW`` (the adapter store: two
                       tensors per layer call through autograd, one optimizer launch)
* ``fast_multilora_store`` (generation): ``patch(..., adapter_store=True)``, the adapters in the store (two weight
                       tensors per layer call: in a compiled decode step two graph inputs per layer, no weight copies)
* ``fast_multilora_unfused`` (layers, 8-adapter step, eval; ``_p0_unfused`` at dropout 0): ``patch(...,
                       fuse_base=False)``, the base layer run by itself and the delta added in place afterwards
* ``peft_single``      stock PEFT, one adapter active, the same tokens
* ``peft_sequential``  stock PEFT, the N adapters trained one after another on their share of the batch
                       (8 adapters: 2 x 1024 tokens each), one optimizer per adapter (``anchor_peft.py``)
* ``peft_mixed_loop``  stock PEFT's own per-adapter mixed-batch loop (``adapter_names`` injected into every LoRA
                       layer by a forward pre-hook), forced into training (``anchor_loop.py``); in eval it is PEFT's
                       ordinary ``adapter_names`` path
* ``peft_mixed``       (generation) stock PEFT's own mixed-batch ``generate(..., adapter_names=...)``
* ``frozen``           no LoRA: the base model (train: forward + backward to the input embeddings only, as the anchor
                       measured it; eval: the PEFT model with its adapters disabled; generation: the base model before
                       PEFT wraps it)

Scenarios (keys of the JSON): ``layer_4096`` (4096x4096 Linear, 8 x 1024 tokens), ``layer_2048`` (2048x2048,
16 x 1024 tokens) -- forward + backward, r=16, alpha 32, dropout 0.05, 8 adapters; ``train_step_8``, ``train_step_1``,
``train_step_32`` -- one optimizer step (AdamW) of the anchors' Llama-shaped model (8 layers, hidden 2048,
intermediate 5632, 32/4 heads, vocab 32000, random init, bf16; LoRA r=16, alpha 32, dropout 0.05 on all 7
projections) on 16 x 1024 tokens (32 adapters: 32 x 512, one row per adapter); ``eval_8`` -- a forward of 16 x 1024
tokens, 8 adapters and ``__base__`` rows mixed.

``moe_step_8`` (opt-in) -- one AdamW step of a Qwen3-MoE-shaped model (random init, bf16, 8 layers, hidden 2048,
16 experts of intermediate 768, top-2, 32/4 heads of 128, vocab 32000; transformers' ``grouped_mm`` experts) on
16 x 1024 tokens, LoRA r=16, alpha 32, dropout 0 on q/k/v/o and both expert weights (PEFT ``target_parameters``:
``experts.gate_up_proj``, ``experts.down_proj``); providers ``fast_multilora`` (8 adapters mixed, 2 rows each),
``peft_single``, ``peft_sequential``, ``frozen``. Stock PEFT has no mixed-batch path for expert LoRA
(``lora.ParamWrapper`` refuses ``adapter_names``), so there is no ``peft_mixed_loop`` row.

``qlora_step_8`` and ``qlora_eval_8`` (opt-in; need bitsandbytes) -- QLoRA: the issue-4 model saved and loaded back in
4-bit (``BitsAndBytesConfig``: nf4, double quantization, bf16 compute), LoRA (bf16) as in ``train_step_8``:
one AdamW step on 16 x 1024 tokens, ``fast_multilora`` with 8 adapters mixed (2 rows each) against ``peft_single``
(stock PEFT QLoRA, one adapter on all tokens) and ``peft_mixed_loop`` (PEFT's per-adapter loop in every
``lora.bnb.Linear4bit``, forced into training); ``qlora_eval_8``: a forward of the same tokens, 8 adapters + 2
``__base__`` rows. Both also time ``frozen`` (the 4-bit base alone). ``--quick`` loads a 64-wide model (bitsandbytes'
CPU 4-bit layers need 64 input features).

``train_step_scale`` (opt-in; issue 18) -- ``train_step_8``'s model and 16 x 1024 tokens in packed rows
(``adapter_ids``: at least 4 samples per row, every resident adapter on one sample at least, positions per sample)
with 8, 32, 64, 128 and 256 adapters resident and trained (providers ``fast_8`` ... ``fast_256``; ``--quick``: 2, 8,
32), AdamW over all of them; each row records its host / GPU split and how many adapters got gradients.
``train_step_scale_compiled`` (opt-in): the same steps under ``torch.compile(model)`` (``--compile-mode``), compiled
afresh per adapter count.

Opt-in scenarios (run only when named in ``--scenarios``; compiling takes 40-90 s per provider on the GPU):
``train_step_8_compiled`` and ``eval_8_compiled`` -- ``train_step_8``'s step and ``eval_8``'s forward with
``torch.compile(model)`` (``--compile-mode``; the loss and the AdamW step stay eager), providers ``fast_multilora``,
``peft_single``, ``frozen``; ``generate_static`` and ``generate_dynamic`` -- ``model.generate`` of 16 prompts x 128
tokens, 64 new tokens, greedy, with ``cache_implementation="static"`` (transformers then compiles the decode step
itself, with its own ``CompileConfig``) or the default dynamic cache, providers ``fast_multilora``, ``peft_mixed``,
``frozen``, 8 adapters and ``__base__`` rows mixed. Dynamo is reset between their providers. ``--quick`` compiles
with ``backend="aot_eager"`` (inductor needs a GPU or a C++ toolchain).

Each provider's entry is ``{"ms": median of CUDA-event timings after warm-up, "peak_mib": max_memory_allocated
of the timed calls, ...}``; a provider that raised has ``"error"`` and ``"ms": null``. The opt-in scenarios' entries
also carry ``"compile_s"`` (wall time of compile + first call; null for an eager provider).

    python benchmarks/bench_model.py                                   # GPU, full sizes
    python benchmarks/bench_model.py --quick --out /tmp/q/h200.json    # CPU dry run, tiny sizes, torch backend
    python benchmarks/bench_model.py --from-json benchmarks/results/h200.json   # re-render markdown + plot only
    python benchmarks/bench_model.py --merge --scenarios train_step_8_compiled,eval_8_compiled,generate_static,\
        generate_dynamic                                               # add the opt-in scenarios to --out

Writes ``--out`` (JSON) and, beside it or in ``--md-dir``, ``<stem>.md`` and ``<stem>.png``, after every scenario
(and after every compiled provider); ``--merge`` keeps the scenarios of an existing ``--out`` that this run does not
measure.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("layer_4096", "layer_2048", "train_step_8", "eval_8", "train_step_1", "train_step_32")  # the default
OPT_IN = ("train_step_8_compiled", "eval_8_compiled", "generate_static", "generate_dynamic", "moe_step_8",
          "qlora_step_8", "qlora_eval_8", "train_step_scale", "train_step_scale_compiled")  # when named
ALL_SCENARIOS = SCENARIOS + OPT_IN
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_TARGET_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU, torch backend: a dry run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "h200.json"), help="JSON path")
    ap.add_argument("--md-dir", default=None, help="folder for <stem>.md and <stem>.png (default: beside --out)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma-separated, run in this order; opt-in (not in the default): {','.join(OPT_IN)}")
    ap.add_argument("--compile-mode", default="default", choices=COMPILE_MODES,
                    help="torch.compile mode of the *_compiled scenarios")
    ap.add_argument("--merge", action="store_true",
                    help="add this run's scenarios to an existing --out JSON instead of overwriting it")
    ap.add_argument("--backend", default=None, help="fast_multilora backend (default: triton on GPU, torch on CPU)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no scenario/provider past this many seconds (exit status 3 when one was left out)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--scale-counts", default=None,
                    help="train_step_scale's adapter counts, e.g. 8,64,256 (default 8,32,64,128,256; quick 2,8,32)")
    ap.add_argument("--no-scale-torch-adamw", action="store_true",
                    help="train_step_scale without its torch.optim.AdamW comparison rows")
    ap.add_argument("--from-json", default=None, help="only re-render markdown and plot from this JSON")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------------
# sizes


class Sizes:
    def __init__(self, quick: bool):
        if quick:
            self.layers = {"layer_4096": (64, 64, 8, 16), "layer_2048": (32, 32, 16, 16)}  # K, N, rows, T
            self.model = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
            self.moe = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=24, num_experts=8,
                            num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, vocab_size=128, max_position_embeddings=64)
            self.qlora = dict(self.model, hidden_size=64, intermediate_size=128)  # bnb's CPU 4-bit: K >= 64
            self.batch, self.T = 16, 16
            self.dtype = "float32"  # bf16 matmuls crawl on CPUs
            self.warm, self.iters, self.slow_warm, self.slow_iters = 1, 2, 1, 1
            self.layer_warm, self.layer_iters = 1, 3
            self.gen_prompt, self.gen_new = 8, 4  # generation: batch x gen_prompt tokens, gen_new new tokens
            self.est = dict.fromkeys(ALL_SCENARIOS, 5.0)
            self.scale_counts = (2, 8, 32)
            self.est_scale_count = {}  # dry runs: every scenario's est stays 5 s, whatever the counts
            self.est_provider, self.est_compiled = 1.0, 3.0
        else:
            self.layers = {"layer_4096": (4096, 4096, 8, 1024), "layer_2048": (2048, 2048, 16, 1024)}
            self.model = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
            self.moe = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=16,
                            num_experts_per_tok=2, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4,
                            head_dim=128, vocab_size=32000, max_position_embeddings=4096)
            self.qlora = self.model
            self.batch, self.T = 16, 1024
            self.dtype = "bfloat16"
            # host-bound steps vary by several ms from call to call: medians over 11
            self.warm, self.iters, self.slow_warm, self.slow_iters = 3, 11, 1, 3
            self.layer_warm, self.layer_iters = 5, 30
            # rough H200 seconds per scenario incl. model build and first-call Triton compiles (budget planning)
            self.gen_prompt, self.gen_new = 128, 64
            self.est = {"layer_4096": 12, "layer_2048": 10, "train_step_8": 88, "eval_8": 14, "train_step_1": 16,
                        "train_step_32": 55, "train_step_8_compiled": 200, "eval_8_compiled": 90,
                        "generate_static": 280, "generate_dynamic": 60,  # opt-in ones: one H200 run, inductor
                        "moe_step_8": 90, "qlora_step_8": 90, "qlora_eval_8": 20}  # one H200 run each
            self.scale_counts = (8, 32, 64, 128, 256)
            # the scale scenarios per adapter count (Run sets their est from the counts): 52698c4's eager run took
            # ~325 s for 4 counts with 2 AdamW rows; compiled, one compile of ~60-80 s per count
            self.est_scale_count = {"train_step_scale": 82, "train_step_scale_compiled": 90}
            self.est_provider, self.est_compiled = 5.0, 90.0  # compiled: compile + first call, 40-90 s on an H200


# ---------------------------------------------------------------------------------------------------------------------
# the run


class Run:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.args = args
        self.quick = args.quick
        self.device = "cpu" if args.quick else "cuda"
        self.sz = Sizes(args.quick)
        if args.scale_counts:
            self.sz.scale_counts = tuple(int(c) for c in args.scale_counts.split(","))
        for sc, per_count in self.sz.est_scale_count.items():
            self.sz.est[sc] = per_count * len(self.sz.scale_counts)
        self.dtype = getattr(torch, self.sz.dtype)
        self.backend = args.backend or ("torch" if args.quick else "triton")
        if args.quick:
            torch.set_num_threads(1)  # tiny ops: threads only add contention on a shared CPU
        from harness import Budget

        self.budget = Budget(args.budget_s)
        self.res = {name: {} for name in SCENARIOS}
        self.res["meta"] = None
        self.prev = None  # --merge: the existing --out this run adds its scenarios to
        if self.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # as the anchors
        # inductor needs a GPU (or a C++ toolchain on the CPU); aot_eager still traces forward and backward graphs
        self.compile_backend = "inductor" if self.device == "cuda" and torch.cuda.is_available() else "aot_eager"

    # -- helpers ------------------------------------------------------------------------------------------------------
    def measure(self, scenario: str, provider: str, fn, *, slow=False, layer=False, split=False, compiled=None,
                setup=None, teardown=None, verify=None, **extra):
        """Time ``fn`` (after ``setup()``), store ``{"ms", "peak_mib", ...}``; a raising provider is recorded, not
        fatal. ``verify()`` (after the timing) returns fields to record; ``teardown`` always runs. Layer calls and
        ``split`` rows also record ``gpu_ms`` / ``host_ms`` (``harness.split_call``): whether the row is bound by
        the GPU or by the host. ``compiled=True`` (opt-in scenarios): dynamo is reset before and after, the first
        call is timed alone as ``compile_s`` (compile + first call, wall clock), dynamo's graph and graph-break
        counts are recorded, and the results are saved right away; ``compiled=False``: ``compile_s`` null."""
        from harness import split_call, time_steps

        est = self.sz.est_compiled if compiled else self.sz.est_provider * (2 if slow else 1)
        if not self.budget.allows(est):
            self.res[scenario][provider] = {"ms": None, "peak_mib": None, "skipped": "time budget"}
            if compiled is not None:
                self.res[scenario][provider]["compile_s"] = None
            print(f"  {provider:28s} skipped (time budget)", flush=True)
            self.budget_skipped.append(f"{scenario}/{provider}")
            return
        if layer:
            warm, iters = self.sz.layer_warm, self.sz.layer_iters
        elif slow:
            warm, iters = self.sz.slow_warm, self.sz.slow_iters
        else:
            warm, iters = self.sz.warm, self.sz.iters
        try:
            if compiled:
                self.dynamo_reset()
            if setup is not None:
                setup()
            first = self.wall_s(fn) if compiled else None
            r = time_steps(fn, self.device, warm=warm, iters=iters)
            if layer or split:  # how much of a call is kernel time, how much the host's
                r.update(split_call(fn, self.device))
            if compiled is not None:
                r.update(compile_s=first, **(self.dynamo_stats() if compiled else {}))
            r.update(extra)
            if verify is not None:
                r.update(verify())
            print(f"  {provider:28s} {r['ms']:9.2f} ms   peak {r['peak_mib'] or 0:9.0f} MiB", flush=True)
        except Exception as e:
            traceback.print_exc()
            r = {"ms": None, "peak_mib": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if compiled is not None:
                r.update(compile_s=None, **(self.dynamo_stats() if compiled else {}), **extra)
            print(f"  {provider:28s} ERROR {r['error']}", flush=True)
        finally:
            if teardown is not None:
                try:
                    teardown()
                except Exception:
                    traceback.print_exc()
            if compiled:
                self.dynamo_reset()
            self.free()
        self.res[scenario][provider] = r
        if compiled:  # a minute or more per provider: keep what is measured should the stage's limit hit
            self.save()

    def wall_s(self, fn) -> float:
        """Seconds of one call of ``fn``, device work included."""
        sync = self.torch.cuda.synchronize if self.device == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return round(time.perf_counter() - t0, 2)

    def compile(self, model):
        """``torch.compile(model)`` with ``--compile-mode`` (aot_eager on the CPU: it has no modes)."""
        if self.compile_backend == "aot_eager":
            return self.torch.compile(model, backend="aot_eager")
        mode = self.args.compile_mode
        return self.torch.compile(model, mode=None if mode == "default" else mode)

    def compile_info(self) -> dict:
        return {"compile_mode": self.args.compile_mode, "compile_backend": self.compile_backend}

    def dynamo_reset(self):
        """Compile state of one provider apart from the next: caches and dynamo's counters."""
        from torch._dynamo.utils import counters

        self.torch._dynamo.reset()
        counters.clear()

    def dynamo_stats(self) -> dict:
        """Graphs dynamo compiled (recompiles included) and graph breaks, since the last ``dynamo_reset``."""
        from torch._dynamo.utils import counters

        return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}

    def free(self):
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    def lora_params(self, model, adapter=None):
        return [p for n, p in model.named_parameters()
                if "lora_" in n and (adapter is None or f".{adapter}." in n)]

    def all_lora_trainable(self, model):
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)

    def mixed_loop_hooks(self, model, names, layer_type=None):
        """PEFT's own per-adapter loop in every LoRA layer (``layer_type``, default ``lora.Linear``), in training too
        (``anchor_loop.py``)."""
        from peft.tuners.lora import Linear as LoraLinear

        hooks = []
        for m in model.modules():
            if isinstance(m, layer_type or LoraLinear):
                hooks.append(m.register_forward_pre_hook(
                    lambda mod, args, kw: (args, {**kw, "adapter_names": list(names)}), with_kwargs=True))
        return hooks

    def patch(self, model, **kwargs):
        import fast_multilora

        report = fast_multilora.patch(model, backend=self.backend, **kwargs)
        self.patch_info = {"patched": len(report.patched), "fallback": len(report.fallback)}
        return report

    def unpatch(self, model):
        import fast_multilora

        fast_multilora.unpatch(model)

    def peft_model(self, base, n_adapters, targets, dropout=0.05, init_lora_weights=True, target_parameters=None):
        from peft import LoraConfig, get_peft_model

        def cfg():
            return LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=targets,
                              init_lora_weights=init_lora_weights, target_parameters=target_parameters)

        pm = get_peft_model(base, cfg(), adapter_name="a0")
        for i in range(1, n_adapters):
            pm.add_adapter(f"a{i}", cfg())
        pm.to(self.device, self.dtype)
        self.all_lora_trainable(pm)
        return pm

    # -- layer level --------------------------------------------------------------------------------------------------
    def frozen_layer(self, scenario, K, N, x, gy):
        lin = self.torch.nn.Sequential(self.torch.nn.Linear(K, N, bias=False)).to(self.device, self.dtype)
        lin.requires_grad_(False)

        def frozen():
            x.grad = None
            lin(x).backward(gy)

        self.measure(scenario, "frozen", frozen, layer=True)

    def layer(self, scenario: str):
        torch = self.torch
        K, N, rows, T = self.sz.layers[scenario]
        dev, dt = self.device, self.dtype
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(rows, T, K, device=dev, generator=g).to(dt).requires_grad_(True)
        gy = torch.randn(rows, T, N, device=dev, generator=g).to(dt)
        names = sorted(f"a{i % 8}" for i in range(rows))

        self.frozen_layer(scenario, K, N, x, gy)  # its own scope: the frozen Linear is freed before the others run
        base = torch.nn.Sequential(torch.nn.Linear(K, N, bias=False)).to(dev, dt)
        base.requires_grad_(False)
        pm = self.peft_model(base, 8, ["0"])
        params = self.lora_params(pm)

        def step(call):
            def fn():
                x.grad = None
                for p in params:
                    p.grad = None
                call().backward(gy)
            return fn

        pm.set_adapter("a0")  # stock PEFT: only a0 active and trainable
        self.measure(scenario, "peft_single", step(lambda: pm(x)), layer=True)
        self.all_lora_trainable(pm)
        hooks = []
        self.measure(scenario, "peft_mixed_loop", step(lambda: pm(x)), layer=True,
                     setup=lambda: hooks.extend(self.mixed_loop_hooks(pm, names)),
                     teardown=lambda: [h.remove() for h in hooks])
        self.measure(scenario, "fast_multilora", step(lambda: pm(x, adapter_names=names)), layer=True,
                     setup=lambda: self.patch(pm), teardown=lambda: self.unpatch(pm), adapters=8)
        self.measure(scenario, "fast_multilora_unfused", step(lambda: pm(x, adapter_names=names)), layer=True,
                     setup=lambda: self.patch(pm, fuse_base=False), teardown=lambda: self.unpatch(pm), adapters=8)

    # -- model level --------------------------------------------------------------------------------------------------
    def base_model(self):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch = self.torch
        cfg = LlamaConfig(**self.sz.model)
        torch.manual_seed(0)
        try:
            with torch.device(self.device):  # init on the GPU: seconds instead of minutes on a few host cores
                base = LlamaForCausalLM(cfg)
        except Exception:
            traceback.print_exc()
            print("bench_model: model init on the device failed; initialising on the CPU", flush=True)
            base = LlamaForCausalLM(cfg).to(self.device)
        return base.to(self.dtype)

    def token_ids(self, rows, T, seed=1):
        g = self.torch.Generator(device=self.device).manual_seed(seed)
        return self.torch.randint(0, self.sz.model["vocab_size"], (rows, T), device=self.device, generator=g)

    def frozen_step(self, scenario, base, ids):
        base.requires_grad_(False)

        def frozen():
            emb = base.model.embed_tokens(ids).detach().requires_grad_(True)
            base(inputs_embeds=emb, labels=ids).loss.backward()

        self.measure(scenario, "frozen", frozen, split=scenario == "train_step_8")

    def adamw(self, params):
        return self.torch.optim.AdamW(params, lr=1e-4)

    @staticmethod
    def opt_step(opt, loss_fn):
        """A timed train step: ``loss_fn()``'s backward, then ``opt["o"]``'s step and its grads back to None."""
        def step():
            loss_fn().backward()
            opt["o"].step()
            opt["o"].zero_grad(set_to_none=True)
        return step

    def fast_setup(self, pm, opt, on_patch=None, store=False, **settings):
        """Setup of a fast_multilora train provider: every LoRA weight trainable, ``pm`` patched with ``settings``
        (its report handed to ``on_patch``), AdamW over every adapter in ``opt["o"]``: torch's, or with ``store``
        ``fast_multilora.AdamW`` (the adapter store's one-launch step; the layers then take the store's leaves)."""
        def setup():
            import fast_multilora

            self.all_lora_trainable(pm)
            report = self.patch(pm, **settings)
            if on_patch is not None:
                on_patch(report)
            opt["o"] = fast_multilora.AdamW(pm, lr=1e-4) if store else self.adamw(self.lora_params(pm))
        return setup

    def fast_teardown(self, pm, opt):
        def teardown():
            self.unpatch(pm)
            opt.clear()
        return teardown

    def mixed_loop_setup(self, pm, names, opt, layer_type=None) -> tuple:
        """``(setup, teardown)`` of ``peft_mixed_loop``: PEFT's per-adapter loop hooked into every LoRA layer of
        ``layer_type`` (:meth:`mixed_loop_hooks`), AdamW over every adapter in ``opt["o"]``."""
        hooks = []

        def setup():
            self.all_lora_trainable(pm)
            hooks.extend(self.mixed_loop_hooks(pm, names, layer_type))
            opt["o"] = self.adamw(self.lora_params(pm))

        def teardown():
            for h in hooks:
                h.remove()
            hooks.clear()
            opt.clear()

        return setup, teardown

    def adapters_got_grads(self, pm, n_adapters) -> list:
        """Per adapter ``a0 .. a{n-1}``: whether any of its LoRA weights got a nonzero gradient."""
        return [any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in self.lora_params(pm, f"a{i}"))
                for i in range(n_adapters)]

    def peft_steps(self, scenario, pm, ids, opt, n_adapters, split):
        """Stock PEFT's providers of a train scenario: ``peft_single`` (adapter a0 on all rows) and, with several
        adapters, ``peft_sequential`` (each adapter on its own rows, one after another). Returns the single step and
        its setup."""
        rows, T = ids.shape

        def single_setup():
            pm.set_adapter("a0")
            opt["o"] = self.adamw([p for p in pm.parameters() if p.requires_grad])

        single = self.opt_step(opt, lambda: pm(input_ids=ids, labels=ids).loss)
        self.measure(scenario, "peft_single", single, setup=single_setup, teardown=opt.clear, split=split)
        if n_adapters > 1:
            per = rows // n_adapters
            small = [ids[i * per:(i + 1) * per] for i in range(n_adapters)]

            def seq_setup():
                self.all_lora_trainable(pm)
                for i in range(n_adapters):
                    opt[i] = self.adamw(self.lora_params(pm, f"a{i}"))

            def sequential():
                for i in range(n_adapters):
                    pm.set_adapter(f"a{i}")
                    pm(input_ids=small[i], labels=small[i]).loss.backward()
                    opt[i].step()
                    opt[i].zero_grad(set_to_none=True)

            self.measure(scenario, "peft_sequential", sequential, slow=True, setup=seq_setup, teardown=opt.clear,
                         rows_per_adapter=per, tokens_per_row=T)
        return single, single_setup

    def train(self, scenario: str, n_adapters: int, eval_after: bool = False):
        torch = self.torch
        import fast_multilora

        if n_adapters <= self.sz.batch:
            rows, T = self.sz.batch, self.sz.T
        else:  # one row per adapter, same token count
            rows, T = n_adapters, self.sz.batch * self.sz.T // n_adapters
        ids = self.token_ids(rows, T)
        names = sorted(f"a{i % n_adapters}" for i in range(rows))  # interleaved, then sorted: contiguous runs
        base = self.base_model()
        self.frozen_step(scenario, base, ids)
        pm = self.peft_model(base, n_adapters, TARGET_MODULES)
        pm.train()
        opt = {}
        single, single_setup = self.peft_steps(scenario, pm, ids, opt, n_adapters, split=scenario == "train_step_8")
        if n_adapters > 1:  # stock PEFT's per-adapter loop in every layer, forced into training
            loop_setup, loop_teardown = self.mixed_loop_setup(pm, names, opt)
            self.measure(scenario, "peft_mixed_loop", single, slow=True, setup=loop_setup, teardown=loop_teardown)

        # fast_multilora: one mixed batch, every adapter trained in the same step
        fast_setup, fast_teardown = self.fast_setup(pm, opt), self.fast_teardown(pm, opt)

        def loss():
            return fast_multilora.per_adapter_loss(pm(input_ids=ids, adapter_names=names).logits, ids, names)

        fast = self.opt_step(opt, loss)
        fast_plain = self.opt_step(opt, lambda: pm(input_ids=ids, labels=ids, adapter_names=names).loss)

        def grads_check():  # the timed steps trained every adapter (B moved off zero, so A gets gradients too)
            value = loss()
            value.backward()
            got = self.adapters_got_grads(pm, n_adapters)
            opt["o"].zero_grad(set_to_none=True)
            return {"loss": value.item(), "all_adapters_got_grads": all(got)}

        self.measure(scenario, "fast_multilora", fast, setup=fast_setup, teardown=fast_teardown,
                     verify=grads_check, adapters=n_adapters, loss_fn="per_adapter_loss",
                     split=scenario == "train_step_8")
        if n_adapters == 8:
            self.measure(scenario, "fast_multilora_plain_loss", fast_plain, setup=fast_setup,
                         teardown=fast_teardown, adapters=n_adapters, loss_fn="HF .loss (mean over all tokens)")
            # LoRA dropout 0 (PEFT's default): q/k/v and gate/up then share one shrink; the same without sharing and
            # PEFT's single adapter at p = 0 beside it
            saved_p = {}

            def p0(setup):
                def go():
                    for name, m in pm.named_modules():
                        if isinstance(m, torch.nn.Dropout) and "lora_dropout" in name:
                            saved_p[name] = m.p
                            m.p = 0.0
                    setup()
                return go

            def p_back(teardown):
                def go():
                    teardown()
                    for name, m in pm.named_modules():
                        if name in saved_p:
                            m.p = saved_p.pop(name)
                return go

            unshared_setup = self.fast_setup(pm, opt, share_shrink=False)
            unfused_setup = self.fast_setup(pm, opt, fuse_base=False)
            self.measure(scenario, "fast_multilora_unfused", fast, setup=unfused_setup, teardown=fast_teardown)

            self.measure(scenario, "fast_multilora_share_dropout", fast,
                         setup=self.fast_setup(pm, opt, share_dropout=True), teardown=fast_teardown)

            # the optimizer's host time grows with its tensor count (8 x 112 LoRA tensors here vs PEFT's 112):
            # AdamW(fused=True) for both, beside the anchors' default (foreach) AdamW
            def fused_adamw(setup):
                def go():
                    setup()
                    opt["o"] = torch.optim.AdamW(opt["o"].param_groups[0]["params"], lr=1e-4, fused=True)
                return go

            self.measure(scenario, "peft_single_fused_adamw", single, setup=fused_adamw(single_setup),
                         teardown=opt.clear, optimizer="AdamW(fused=True)")
            self.measure(scenario, "fast_multilora_fused_adamw", fast, setup=fused_adamw(fast_setup),
                         teardown=fast_teardown, optimizer="AdamW(fused=True)")
            self.measure(scenario, "fast_multilora_adamw", fast, setup=self.fast_setup(pm, opt, store=True),
                         teardown=fast_teardown, optimizer="fast_multilora.AdamW")

            self.measure(scenario, "peft_single_p0", single, setup=p0(single_setup), teardown=p_back(opt.clear))
            self.measure(scenario, "fast_multilora_p0", fast, setup=p0(fast_setup), teardown=p_back(fast_teardown))
            self.measure(scenario, "fast_multilora_p0_unshared", fast, setup=p0(unshared_setup),
                         teardown=p_back(fast_teardown))
            self.measure(scenario, "fast_multilora_p0_unfused", fast, setup=p0(unfused_setup),
                         teardown=p_back(fast_teardown))
        if eval_after and self.start("eval_8"):
            self.done(scenario)
            self.eval_mixed("eval_8", pm, ids)

    def scale(self, scenario: str, compiled: bool = False):
        """The train step at equal tokens with each of ``Sizes.scale_counts`` adapters resident and trained: packed rows
        (``adapter_ids``), every adapter on at least one sample (``max(4, n // rows)`` samples per row, each with its
        own positions), ``fast_multilora.AdamW`` over every adapter. One PEFT model grows by ``add_adapter`` from
        one count to the next and is re-patched; per provider ``ms``, ``peak_mib`` and the host / GPU split.
        ``compiled``: the model under ``torch.compile`` (``--compile-mode``; compiled afresh per count, loss and
        optimizer eager), without the eager-only rows (the layer call's host time, torch's AdamW)."""
        rows, T = self.sz.batch, self.sz.T
        ids = self.token_ids(rows, T)
        layer_us = {} if compiled else self.layer_host_scale(rows, T)
        pm = self.peft_model(self.base_model(), self.sz.scale_counts[0], TARGET_MODULES)
        opt, cm = {}, {}  # the optimizer, the compiled model
        for n in self.sz.scale_counts:
            for i in range(n):
                if f"a{i}" not in pm.peft_config:
                    pm.add_adapter(f"a{i}", copy.deepcopy(pm.peft_config["a0"]))
            pm.to(self.device, self.dtype)
            per_row, adapter_ids, pos = self.packed_rows(n, rows, T)
            names = [f"a{i}" for i in range(n)]

            def loss(names=names, adapter_ids=adapter_ids, pos=pos):
                return cm.get("m", pm)(input_ids=ids, labels=ids, adapter_names=names, adapter_ids=adapter_ids,
                                       position_ids=pos).loss

            def trained(n=n, loss=loss, names=names, adapter_ids=adapter_ids):  # every resident adapter trains
                from harness import time_steps

                import fast_multilora

                loss().backward()
                got = sum(self.adapters_got_grads(pm, n))
                # the optimizer step alone, on these gradients (the weights move by ~lr per call: the time does not
                # depend on their values)
                out = {"adapters_with_grads": got,
                       "optimizer_ms": round(time_steps(opt["o"].step, self.device, warm=2, iters=10)["ms"], 3)}
                opt["o"].zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                opt["o"].step()  # nothing seen since zero_grad: the host cost of the step's bookkeeping alone
                out["optimizer_idle_host_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
                if not compiled:
                    with fast_multilora.route(pm, names, adapter_ids):
                        out["layer_host_us_in_model"] = self.layer_host_us(pm, rows, T)
                return out

            setup = self.fast_setup(pm, opt, store=True)
            teardown = self.fast_teardown(pm, opt)
            if compiled:
                setup = (lambda s=setup: (s(), cm.update(m=self.compile(pm))))
                teardown = (lambda t=teardown: (cm.clear(), t()))
            self.measure(scenario, f"fast_{n}", self.opt_step(opt, loss), setup=setup, teardown=teardown,
                         verify=trained, split=True, compiled=compiled or None, adapters=n, samples_per_row=per_row,
                         **({"layer_host_us": layer_us[n]} if n in layer_us else {}),
                         optimizer="fast_multilora.AdamW", **(self.compile_info() if compiled else {}))
            self.save()  # a minute or more per adapter count: keep what is measured should the stage's limit hit
            compare = n in (self.sz.scale_counts[0], 64) or (self.quick and n == self.sz.scale_counts[-1])
            if compare and not compiled and not self.args.no_scale_torch_adamw:
                self.measure(scenario, f"fast_{n}_torch_adamw", self.opt_step(opt, loss),
                             setup=self.fast_setup(pm, opt), teardown=self.fast_teardown(pm, opt), split=True,
                             adapters=n, optimizer="torch.optim.AdamW (foreach), per-parameter layer path")
        pm = None  # the model's memory back before the next scenario
        self.free()

    def packed_rows(self, n, rows, T) -> tuple:
        """``(samples per row, adapter_ids [rows, T], position_ids [rows, T])`` of the scale step's packed rows:
        ``max(4, n // rows)`` samples per row, each with its own positions, sample ``i`` on adapter ``i % n``."""
        torch = self.torch
        per_row = max(4, -(-n // rows))
        seg = T // per_row
        j = (torch.arange(T, device=self.device) // seg).clamp(max=per_row - 1)  # [T] sample of each position
        sample = torch.arange(rows, device=self.device)[:, None] * per_row + j  # [rows, T]
        pos = (torch.arange(T, device=self.device) - j * seg).expand(rows, T)
        return per_row, (sample % n).contiguous(), pos

    def layer_host_scale(self, rows, T, rounds=5, calls=30) -> dict:
        """``{count: µs}``: the median host time of one patched layer call (``q_proj``'s shape, forward + backward
        of a random input, packed rows as the scale step routes them) with each of ``Sizes.scale_counts`` adapters
        resident -- one single-layer PEFT model per count, each on the adapter store with ``fast_multilora.AdamW``,
        measured in ``rounds`` interleaved rounds (``harness.host_ms`` of ``calls`` calls per count and round), so
        the counts share the machine's state instead of being minutes apart. The median over rounds."""
        import statistics

        from harness import host_ms

        import fast_multilora

        torch = self.torch
        hid = self.sz.model["hidden_size"]
        calls_by_n, keep = {}, []
        for n in self.sz.scale_counts:
            torch.manual_seed(0)
            pm = self.peft_model(torch.nn.Sequential(torch.nn.Linear(hid, hid, bias=False)), n, ["0"])
            self.patch(pm)
            opt = fast_multilora.AdamW(pm, lr=1e-4)  # the store, as the scale step's
            _, adapter_ids, _ = self.packed_rows(n, rows, T)
            x = torch.randn(rows, T, hid, device=self.device, dtype=self.dtype, requires_grad=True)
            gy = torch.randn(rows, T, hid, device=self.device, dtype=self.dtype)
            route = (pm, [f"a{i}" for i in range(n)], adapter_ids)
            layer = pm.base_model.model[0]
            with fast_multilora.route(*route):
                for _ in range(10):
                    layer(x).backward(gy)
            calls_by_n[n] = (route, lambda layer=layer, x=x, gy=gy: layer(x).backward(gy))
            keep.append((pm, opt))
        got = {n: [] for n in calls_by_n}
        for _ in range(rounds):
            for n, (route, call) in calls_by_n.items():
                with fast_multilora.route(*route):
                    got[n].append(host_ms(call, calls) * 1e3)
        for pm, _ in keep:
            self.unpatch(pm)
        keep.clear()
        calls_by_n.clear()  # their inputs and gradients too: the first count's peak memory must not include them
        self.free()
        out = {n: round(statistics.median(v), 1) for n, v in got.items()}
        print(f"  layer call host time by adapter count (interleaved, µs): {out}", flush=True)
        return out

    def layer_host_us(self, pm, rows, T) -> float:
        """Median host microseconds of one patched ``q_proj`` call in layer 0 (forward + backward of a random
        input under the active routing; ``harness.host_ms``: each call after a sync, 10 warm-up calls first)."""
        from harness import host_ms

        torch = self.torch
        layer = pm.base_model.model.model.layers[0].self_attn.q_proj
        x = torch.randn(rows, T, layer.in_features, device=self.device, dtype=self.dtype, requires_grad=True)
        gy = torch.randn(rows, T, layer.out_features, device=self.device, dtype=self.dtype)
        for _ in range(10):
            layer(x).backward(gy)
        return round(host_ms(lambda: layer(x).backward(gy), 30) * 1e3, 1)

    def moe_base(self):
        """The Qwen3-MoE-shaped model of ``moe_step_8`` (random init), experts on transformers' ``grouped_mm``."""
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        torch = self.torch
        cfg = Qwen3MoeConfig(**self.sz.moe)
        torch.manual_seed(0)
        with torch.device(self.device):
            base = Qwen3MoeForCausalLM(cfg)
        base.config._experts_implementation = "grouped_mm"
        return base.to(self.dtype)

    def moe_train(self, scenario: str):
        """8 adapters on attention and expert weights in one mixed batch against stock PEFT training one adapter (and
        the 8 one after another) on the same tokens."""
        torch = self.torch
        import fast_multilora

        n_adapters, rows, T = 8, self.sz.batch, self.sz.T
        ids = self.token_ids(rows, T)
        names = sorted(f"a{i % n_adapters}" for i in range(rows))
        base = self.moe_base()
        self.frozen_step(scenario, base, ids)
        pm = self.peft_model(base, n_adapters, MOE_TARGET_MODULES, dropout=0.0,
                             target_parameters=MOE_TARGET_PARAMETERS)
        pm.train()
        opt = {}
        self.peft_steps(scenario, pm, ids, opt, n_adapters, split=True)

        def record(report):
            self.patch_info_moe = {"patched": len(report.patched), "experts": len(report.experts),
                                   "fallback": len(report.fallback), "unsupported": len(report.unsupported)}

        def loss():
            return fast_multilora.per_adapter_loss(pm(input_ids=ids, adapter_names=names).logits, ids, names)

        def check():
            """Every adapter (its expert weights too) got gradients; then, B off zero, two rows of a0 against stock
            PEFT's a0 (the patched model without adapter_names runs PEFT's own path)."""
            value = loss()
            value.backward()
            params = [(n, p) for n, p in pm.named_parameters() if "lora_" in n]
            got = self.adapters_got_grads(pm, n_adapters)
            experts_got = all(p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in params
                              if "experts" in n)
            opt["o"].zero_grad(set_to_none=True)
            self.lora_b_off_zero(pm)
            few = ids[:2]
            with torch.no_grad():
                mine = pm(input_ids=few, adapter_names=["a0", "a0"]).logits.float()
                pm.set_adapter("a0")
                want = pm(input_ids=few).logits.float()
                with pm.disable_adapter():
                    base_logits = pm(input_ids=few).logits.float()
            effect = (want - base_logits).pow(2).mean().sqrt()
            diff = mine - want
            return {"loss": value.item(), "all_adapters_got_grads": all(got) and experts_got,
                    "max_abs_diff_vs_peft": diff.abs().max().item(),
                    "diff_rms_over_lora_effect_rms": (diff.pow(2).mean().sqrt() / effect).item(),
                    "patch": self.patch_info_moe}

        self.measure(scenario, "fast_multilora", self.opt_step(opt, loss), setup=self.fast_setup(pm, opt, record),
                     teardown=self.fast_teardown(pm, opt), verify=check, adapters=n_adapters,
                     loss_fn="per_adapter_loss", split=True)

    # -- QLoRA (opt-in) ------------------------------------------------------------------------------------------------
    def qlora_base(self, folder):
        """The issue-4 model (random init, saved to ``folder``) loaded back in 4-bit, as people load QLoRA bases."""
        from transformers import BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

        torch = self.torch
        torch.manual_seed(0)
        with torch.device(self.device):
            LlamaForCausalLM(LlamaConfig(**self.sz.qlora)).to(self.dtype).save_pretrained(folder)
        self.free()
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=self.dtype)
        return LlamaForCausalLM.from_pretrained(folder, quantization_config=quant, dtype=self.dtype,
                                                device_map=self.device)

    def qlora_peft_model(self, base, n_adapters):
        """``peft_model`` for a 4-bit base: LoRA weights cast to the run's dtype, the base left as loaded."""
        from peft import LoraConfig, get_peft_model

        cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGET_MODULES)
        pm = get_peft_model(base, cfg, adapter_name="a0")
        for i in range(1, n_adapters):
            pm.add_adapter(f"a{i}", cfg)
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(self.dtype)
        self.all_lora_trainable(pm)
        return pm

    def qlora(self):
        """``qlora_step_8`` / ``qlora_eval_8``: 8 adapters mixed over a 4-bit base against stock PEFT QLoRA."""
        import tempfile

        from peft.tuners.lora import bnb as peft_bnb

        import fast_multilora

        torch = self.torch
        n_adapters, rows, T = 8, self.sz.batch, self.sz.T
        g = torch.Generator(device=self.device).manual_seed(1)
        ids = torch.randint(0, self.sz.qlora["vocab_size"], (rows, T), device=self.device, generator=g)
        names = sorted(f"a{i % n_adapters}" for i in range(rows))
        with tempfile.TemporaryDirectory() as folder:
            base = self.qlora_base(folder)
        self.qlora_info = {"quantization": "bitsandbytes 4-bit nf4, double quantization, compute " + self.sz.dtype,
                           "bitsandbytes": __import__("bitsandbytes").__version__}
        scenario = "qlora_step_8"
        train = self.start(scenario)
        if train:
            self.frozen_step(scenario, base, ids)  # before PEFT wraps the base
        pm = self.qlora_peft_model(base, n_adapters)
        opt = {}

        def loss():
            return fast_multilora.per_adapter_loss(pm(input_ids=ids, adapter_names=names).logits, ids, names)

        loop_setup, loop_teardown = self.mixed_loop_setup(pm, names, opt, peft_bnb.Linear4bit)

        def record(report):
            self.qlora_info["patch"] = {"patched": len(report.patched), "fallback": len(report.fallback)}

        def check():
            """Every adapter got gradients; then (B off zero) two rows of a0 against stock PEFT's a0 (the patched
            model without adapter_names runs PEFT's own path)."""
            value = loss()
            value.backward()
            got = self.adapters_got_grads(pm, n_adapters)
            opt["o"].zero_grad(set_to_none=True)
            return {"loss": value.item(), "all_adapters_got_grads": all(got), **self.qlora_vs_peft(pm, ids),
                    **self.qlora_info}

        if train:
            pm.train()
            single, _ = self.peft_steps(scenario, pm, ids, opt, 1, split=True)  # peft_single alone
            self.measure(scenario, "peft_mixed_loop", single, slow=True, setup=loop_setup, teardown=loop_teardown)
            self.measure(scenario, "fast_multilora", self.opt_step(opt, loss), setup=self.fast_setup(pm, opt, record),
                         teardown=self.fast_teardown(pm, opt), verify=check, adapters=n_adapters,
                         loss_fn="per_adapter_loss", split=True)
            self.done(scenario)
        scenario = "qlora_eval_8"
        if self.start(scenario):
            names = self.eval_names(rows)
            pm.eval()
            self.lora_b_off_zero(pm)
            no_grad = self.no_grad
            disable, enable = self.disabler(pm)
            self.measure(scenario, "frozen", no_grad(lambda: pm(input_ids=ids)), setup=disable, teardown=enable)
            self.measure(scenario, "peft_single", no_grad(lambda: pm(input_ids=ids)),
                         setup=lambda: pm.set_adapter("a0"))
            self.measure(scenario, "peft_mixed_loop", no_grad(lambda: pm(input_ids=ids, adapter_names=names)))
            state = {}

            def reference():  # stock PEFT's own adapter_names path (eval) on the same mixed batch, before patching
                with torch.no_grad():
                    state["ref"] = pm(input_ids=ids, adapter_names=names).logits.cpu()
                    with pm.disable_adapter():
                        state["base"] = pm(input_ids=ids).logits.cpu()

            def compare():
                with torch.no_grad():
                    got = pm(input_ids=ids, adapter_names=names).logits.float()
                want, base_logits = (state.pop(k).to(got.device).float() for k in ("ref", "base"))
                diff = got - want
                effect = (want - base_logits).pow(2).mean().sqrt()
                return {"max_abs_diff_vs_peft": float(diff.abs().max()),
                        "diff_rms_over_lora_effect_rms": float(diff.pow(2).mean().sqrt() / effect), **self.qlora_info}

            self.measure(scenario, "fast_multilora", no_grad(lambda: pm(input_ids=ids, adapter_names=names)),
                         setup=lambda: (reference(), self.patch(pm)), teardown=lambda: self.unpatch(pm),
                         verify=compare, adapters=n_adapters, base_rows=2, split=True)
            self.done(scenario)
        self.unpatch(pm)

    def qlora_vs_peft(self, pm, ids):
        """B off zero, in eval mode: a row of a0 and a ``__base__`` row on the patched model against stock PEFT's
        a0 and base (the patched model without adapter_names runs PEFT's own path): max |diff| and the difference's
        RMS over the LoRA effect's RMS."""
        torch = self.torch
        self.lora_b_off_zero(pm)
        few = ids[:2]
        pm.eval()  # no LoRA dropout: both sides compute the same function
        with torch.no_grad():
            mine = pm(input_ids=few, adapter_names=["a0", "__base__"]).logits.float()
            pm.set_adapter("a0")
            want = pm(input_ids=few[:1]).logits.float()
            with pm.disable_adapter():
                base_logits = pm(input_ids=few).logits.float()
        pm.train()
        self.all_lora_trainable(pm)
        want = torch.cat([want, base_logits[1:]])
        effect = (want[:1] - base_logits[:1]).pow(2).mean().sqrt()
        diff = mine - want
        return {"max_abs_diff_vs_peft": diff.abs().max().item(),
                "diff_rms_over_lora_effect_rms": (diff.pow(2).mean().sqrt() / effect).item()}

    def eval_names(self, rows):
        return sorted([f"a{i % 8}" for i in range(rows - 2)] + ["__base__"] * 2)  # 8 adapters + 2 base rows

    def lora_b_off_zero(self, pm):
        """B off zero (PEFT initialises it to 0), so checks against other paths compare real deltas."""
        torch = self.torch
        with torch.no_grad():
            g = torch.Generator(device=self.device).manual_seed(2)
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g, device=self.device) * 0.02)

    def no_grad(self, fn):
        def wrapped():
            with self.torch.no_grad():
                fn()
        return wrapped

    def disabler(self, pm):
        """(disable, enable): adapters disabled around the timed calls, not inside them (PEFT's disable_adapter()
        walks every module on enter and exit, host time that is not the forward's)."""
        disabled = {}

        def disable():
            disabled["cm"] = pm.disable_adapter()
            disabled["cm"].__enter__()

        def enable():
            disabled.pop("cm").__exit__(None, None, None)

        return disable, enable

    def eval_mixed(self, scenario: str, pm, ids):
        torch = self.torch
        names = self.eval_names(ids.shape[0])
        pm.eval()
        state = {}
        self.lora_b_off_zero(pm)
        no_grad = self.no_grad
        disable, enable = self.disabler(pm)  # the base forward
        self.measure(scenario, "frozen", no_grad(lambda: pm(input_ids=ids)), setup=disable, teardown=enable,
                     split=True)
        self.measure(scenario, "peft_single", no_grad(lambda: pm(input_ids=ids)), setup=lambda: pm.set_adapter("a0"),
                     split=True)
        self.measure(scenario, "peft_mixed_loop", no_grad(lambda: pm(input_ids=ids, adapter_names=names)))
        def reference():  # stock PEFT's logits for the same mixed batch (and the base's), before patching; kept in
            # host memory, so the timed calls' peak is the forward's own
            with torch.no_grad():
                state["ref"] = pm(input_ids=ids, adapter_names=names).logits.cpu()
                with pm.disable_adapter():
                    state["base"] = pm(input_ids=ids).logits.cpu()

        def compare():
            """fast_multilora's logits against stock PEFT's: max |diff|, and the RMS of the difference relative to
            the RMS of the LoRA effect (PEFT's logits minus the base's)."""
            with torch.no_grad():
                got = pm(input_ids=ids, adapter_names=names).logits.float()
                want, base = (state.pop(k).to(got.device).float() for k in ("ref", "base"))
                diff = got - want
                effect = (want - base).pow(2).mean().sqrt()
                return {"max_abs_diff_vs_peft": float(diff.abs().max()),
                        "diff_rms_over_lora_effect_rms": float(diff.pow(2).mean().sqrt() / effect)}

        self.measure(scenario, "fast_multilora", no_grad(lambda: pm(input_ids=ids, adapter_names=names)),
                     setup=lambda: (reference(), self.patch(pm)), teardown=lambda: self.unpatch(pm),
                     verify=compare, adapters=8, base_rows=2, split=True)
        # the same without the shared shrink of sibling layers (q/k/v, gate/up; active in eval): that lever alone
        self.measure(scenario, "fast_multilora_unshared", no_grad(lambda: pm(input_ids=ids, adapter_names=names)),
                     setup=lambda: self.patch(pm, share_shrink=False), teardown=lambda: self.unpatch(pm))
        self.measure(scenario, "fast_multilora_unfused", no_grad(lambda: pm(input_ids=ids, adapter_names=names)),
                     setup=lambda: self.patch(pm, fuse_base=False), teardown=lambda: self.unpatch(pm))
        self.done(scenario)

    # -- compiled and generation (opt-in) ----------------------------------------------------------------------------
    def train_compiled(self, scenario: str, eval_after: bool = False):
        """``train_step_8``'s step with ``torch.compile(model)``: the same model, tokens, loss and AdamW (eager)."""
        torch = self.torch
        rows, T = self.sz.batch, self.sz.T
        ids = self.token_ids(rows, T)
        names = sorted(f"a{i % 8}" for i in range(rows))
        base = self.base_model()
        base.requires_grad_(False)
        cm, opt = {}, {}  # the compiled model, the optimizer of the provider being measured

        def frozen():
            emb = base.model.embed_tokens(ids).detach().requires_grad_(True)
            cm["m"](inputs_embeds=emb, labels=ids).loss.backward()

        self.measure(scenario, "frozen", frozen, compiled=True, setup=lambda: cm.update(m=self.compile(base)),
                     teardown=cm.clear, **self.compile_info())
        pm = self.peft_model(base, 8, TARGET_MODULES)
        pm.train()

        def single_setup():
            pm.set_adapter("a0")
            opt["o"] = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4)
            cm["m"] = self.compile(pm)

        def single():
            cm["m"](input_ids=ids, labels=ids).loss.backward()
            opt["o"].step()
            opt["o"].zero_grad(set_to_none=True)

        def fast_setup():
            self.all_lora_trainable(pm)
            self.patch(pm)
            opt["o"] = torch.optim.AdamW(self.lora_params(pm), lr=1e-4)
            cm["m"] = self.compile(pm)

        def fast():
            import fast_multilora  # here: an import error is this provider's, recorded by measure

            out = cm["m"](input_ids=ids, adapter_names=names)
            fast_multilora.per_adapter_loss(out.logits, ids, names).backward()
            opt["o"].step()
            opt["o"].zero_grad(set_to_none=True)

        def clear():
            cm.clear()
            opt.clear()

        self.measure(scenario, "peft_single", single, compiled=True, setup=single_setup, teardown=clear,
                     **self.compile_info())
        self.measure(scenario, "fast_multilora", fast, compiled=True, setup=fast_setup,
                     teardown=lambda: (clear(), self.unpatch(pm)), adapters=8, loss_fn="per_adapter_loss",
                     **self.compile_info())

        def store_setup():  # the recommended optimizer: the layers take the adapter store's two leaves per call
            import fast_multilora

            self.all_lora_trainable(pm)
            self.patch(pm)
            opt["o"] = fast_multilora.AdamW(pm, lr=1e-4)
            cm["m"] = self.compile(pm)

        self.measure(scenario, "fast_multilora_adamw", fast, compiled=True, setup=store_setup,
                     teardown=lambda: (clear(), self.unpatch(pm)), adapters=8, loss_fn="per_adapter_loss",
                     optimizer="fast_multilora.AdamW", **self.compile_info())
        if eval_after and self.start("eval_8_compiled"):
            self.done(scenario)
            self.eval_compiled("eval_8_compiled", pm, ids)

    def eval_compiled(self, scenario: str, pm, ids):
        """``eval_8``'s forward with ``torch.compile(model)``; each provider's logits against its own eager ones."""
        torch = self.torch
        names = self.eval_names(ids.shape[0])
        pm.eval()
        self.lora_b_off_zero(pm)
        cm = {}
        disable, enable = self.disabler(pm)

        def fwd(model, **kw):
            return model(input_ids=ids, **kw).logits

        def vs_eager(**kw):
            def check():
                with torch.no_grad():
                    got = fwd(cm["m"], **kw).float()
                    return {"max_abs_diff_vs_eager": float((got - fwd(pm, **kw).float()).abs().max())}
            return check

        def compiled(setup=None):
            def go():
                if setup is not None:
                    setup()
                cm["m"] = self.compile(pm)
            return go

        self.measure(scenario, "frozen", self.no_grad(lambda: fwd(cm["m"])), compiled=True, setup=compiled(disable),
                     teardown=lambda: (cm.clear(), enable()), verify=vs_eager(), **self.compile_info())
        self.measure(scenario, "peft_single", self.no_grad(lambda: fwd(cm["m"])), compiled=True,
                     setup=compiled(lambda: pm.set_adapter("a0")), teardown=cm.clear, verify=vs_eager(),
                     **self.compile_info())
        self.measure(scenario, "fast_multilora", self.no_grad(lambda: fwd(cm["m"], adapter_names=names)),
                     compiled=True, setup=compiled(lambda: self.patch(pm)),
                     teardown=lambda: (cm.clear(), self.unpatch(pm)), verify=vs_eager(adapter_names=names),
                     adapters=8, base_rows=2, **self.compile_info())
        self.done(scenario)

    def generation(self, scenario: str):
        """``model.generate`` of ``batch`` prompts, greedy, a fixed number of new tokens (``min_new_tokens`` too: no
        early stop), 8 adapters and ``__base__`` rows mixed; ``generate_static``: static KV cache, whose decode step
        transformers compiles itself (its ``CompileConfig``: inductor, "reduce-overhead", on a GPU; ``aot_eager`` on
        the CPU, where transformers compiles only when told to)."""
        torch = self.torch
        from transformers import CompileConfig

        static = scenario == "generate_static"
        rows, T, new = self.sz.batch, self.sz.gen_prompt, self.sz.gen_new
        prompts = self.token_ids(rows, T)
        names = [f"a{i % 8}" for i in range(rows - rows // 4)] + ["__base__"] * (rows // 4)  # 12 rows + 4 base
        kw = dict(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                  do_sample=False, pad_token_id=0)
        info = {}
        if static:
            if self.compile_backend == "inductor":
                cc = CompileConfig()  # what generate uses by itself: the anchor's setting
            else:
                cc = CompileConfig(backend="aot_eager", mode=None)
                cc._compile_all_devices = True  # transformers compiles on a CPU only when told to
            kw.update(cache_implementation="static", compile_config=cc)
            info = {"compile_mode": cc.mode or "default", "compile_backend": cc.backend,
                    "compiled_by": "transformers generate (CompileConfig)"}
        state = {}

        def gen(model, **more):
            def fn():
                with torch.no_grad():
                    state["out"] = model.generate(**kw, **more)
            return fn

        def tokens(vs, want):
            """Greedy rows diverge after their first different token (bf16 rounding can flip a near tie): the share
            of each row's new tokens before its first difference, averaged over rows."""
            got, want = state.pop("out")[:, T:], want[:, T:]
            prefix = (got == want).int().cumprod(dim=1).sum(dim=1)
            return {"tokens_vs": vs, "tokens_equal": bool(torch.equal(got, want)),
                    "tokens_common_prefix_frac": float(prefix.float().mean() / new)}

        def vs_dynamic(model, **more):  # the same provider eager, with the default dynamic cache
            def check():
                with torch.no_grad():
                    dyn = {k: v for k, v in kw.items() if k not in ("cache_implementation", "compile_config")}
                    return tokens("its own dynamic-cache generate", model.generate(**dyn, **more))
            return check

        def keep_ref():  # peft_mixed's tokens: the reference of fast_multilora's (dynamic cache)
            state["ref"] = state.pop("out")
            return {}

        def vs_peft():  # (kept for every fast_multilora provider)
            return tokens("peft_mixed", state["ref"]) if "ref" in state else {}

        base = self.base_model().eval()
        self.measure(scenario, "frozen", gen(base), slow=True, compiled=static,
                     verify=vs_dynamic(base) if static else None, **info)
        pm = self.peft_model(base, 8, TARGET_MODULES, dropout=0.0, init_lora_weights=False)
        pm.eval()
        self.measure(scenario, "peft_mixed", gen(pm, adapter_names=names), slow=True, compiled=static,
                     verify=vs_dynamic(pm, adapter_names=names) if static else keep_ref, **info)

        def fast_setup():
            self.patch(pm)
            pm.eval()

        self.measure(scenario, "fast_multilora", gen(pm, adapter_names=names), slow=True, compiled=static,
                     setup=fast_setup, teardown=lambda: self.unpatch(pm),
                     verify=vs_dynamic(pm, adapter_names=names) if static else vs_peft,
                     adapters=8, base_rows=rows // 4, **info)

        def store_setup():  # the adapter store: two weight tensors per layer call, read as they lie
            self.patch(pm, adapter_store=True)
            pm.eval()

        self.measure(scenario, "fast_multilora_store", gen(pm, adapter_names=names), slow=True, compiled=static,
                     setup=store_setup, teardown=lambda: self.unpatch(pm),
                     verify=vs_dynamic(pm, adapter_names=names) if static else vs_peft,
                     adapters=8, base_rows=rows // 4, patch_config="adapter_store=True", **info)

    # -- driver -------------------------------------------------------------------------------------------------------
    def start(self, scenario: str) -> bool:
        if scenario not in self.wanted:
            return False
        if not self.budget.allows(self.sz.est[scenario]):
            self.skipped.append(scenario)
            self.budget_skipped.append(scenario)
            print(f"== {scenario}: skipped (time budget, {self.budget.elapsed():.0f} s used)", flush=True)
            return False
        print(f"== {scenario} ({self.budget.elapsed():.0f} s)", flush=True)
        return True

    def done(self, scenario: str):
        self.free()
        self.save()

    def save(self):
        from harness import write_json

        self.res["meta"]["elapsed_s"] = round(self.budget.elapsed(), 1)
        self.res["meta"]["skipped_scenarios"] = list(self.skipped)
        res = self.merged() if self.prev is not None else self.res
        write_json(self.args.out, res)
        render(res, self.args.out, self.args.md_dir)

    def merged(self) -> dict:
        """The earlier ``--out`` with this run's measured scenarios in place of its own; its meta stays the header,
        this run's goes to ``meta["merged_runs"]``."""
        res = {k: v for k, v in self.prev.items() if k != "meta"}
        res.update({k: v for k, v in self.res.items() if k != "meta" and v})
        meta = dict(self.prev.get("meta") or {})
        mine = self.res["meta"]
        meta["scenarios"] = {**(meta.get("scenarios") or {}), **mine["scenarios"]}
        skipped = set(meta.get("skipped_scenarios") or ()) | set(mine["skipped_scenarios"])
        meta["skipped_scenarios"] = [s for s in ALL_SCENARIOS if s in skipped and not res.get(s)]
        ran = [s for s in ALL_SCENARIOS if self.res.get(s)]
        meta["merged_runs"] = list(meta.get("merged_runs") or ()) + [{**mine, "scenarios": ran}]
        return {**res, "meta": meta}

    def main(self) -> int:
        from harness import run_meta

        torch = self.torch
        if self.device == "cuda" and not torch.cuda.is_available():
            print("bench_model: no CUDA device; use --quick for a CPU dry run", file=sys.stderr)
            return 2
        self.wanted = [s for s in self.args.scenarios.split(",") if s]
        unknown = [s for s in self.wanted if s not in ALL_SCENARIOS]
        if unknown:
            print(f"bench_model: unknown scenario(s) {unknown}; choose from {ALL_SCENARIOS}", file=sys.stderr)
            return 2
        for s in self.wanted:
            self.res.setdefault(s, {})
        if self.args.merge and os.path.exists(self.args.out):
            with open(self.args.out) as f:
                self.prev = json.load(f)
            print(f"bench_model: merging into {self.args.out}", flush=True)
        self.skipped = [s for s in SCENARIOS if s not in self.wanted]
        self.budget_skipped = []  # requested scenarios / providers that --budget-s left out (exit status 3)
        self.patch_info = None
        self.res["meta"] = run_meta(
            self.device, self.args.commit, quick=self.quick, backend=self.backend, dtype=self.sz.dtype,
            model=self.sz.model, tokens=f"{self.sz.batch} x {self.sz.T}",
            lora="r=16, alpha=32, dropout=0.05, " + "/".join(TARGET_MODULES),
            fast_multilora_loss="fast_multilora.per_adapter_loss (sum over adapters of each adapter's mean token "
                                "cross-entropy); fast_multilora_plain_loss: HF .loss",
            timing=f"median of CUDA-event timings; warm-up/iterations: layers {self.sz.layer_warm}/"
                   f"{self.sz.layer_iters}, steps {self.sz.warm}/{self.sz.iters}, sequential and mixed loop "
                   f"{self.sz.slow_warm}/{self.sz.slow_iters}",
            scenarios=self.describe())
        if any(s in OPT_IN for s in self.wanted):
            self.res["meta"].update(compile_backend=self.compile_backend, compile_mode=self.args.compile_mode,
                                    timing_opt_in=f"compiled providers: the first call alone (compile_s, wall "
                                                  f"clock), then steps {self.sz.warm}/{self.sz.iters}; generation "
                                                  f"{self.sz.slow_warm}/{self.sz.slow_iters}")
        print(f"bench_model: {self.res['meta'].get('gpu') or self.device}, backend {self.backend}", flush=True)
        for scenario in ("layer_4096", "layer_2048"):
            if self.start(scenario):
                self.layer(scenario)
                self.done(scenario)
        if self.start("train_step_8"):
            self.train("train_step_8", 8, eval_after=True)
            self.done("train_step_8")
        elif "eval_8" in self.wanted and self.start("eval_8"):  # eval alone: build the 8-adapter model for it
            self.wanted_eval_only("eval_8")
        for scenario, n in (("train_step_1", 1), ("train_step_32", 32)):
            if self.start(scenario):
                self.train(scenario, n)
                self.done(scenario)
        if self.start("train_step_8_compiled"):
            self.train_compiled("train_step_8_compiled", eval_after=True)
            self.done("train_step_8_compiled")
        elif "eval_8_compiled" in self.wanted and self.start("eval_8_compiled"):
            self.wanted_eval_only("eval_8_compiled")
        for scenario in ("generate_static", "generate_dynamic"):
            if self.start(scenario):
                self.generation(scenario)
                self.done(scenario)
        if self.start("moe_step_8"):
            self.moe_train("moe_step_8")
            self.done("moe_step_8")
        if "qlora_step_8" in self.wanted or "qlora_eval_8" in self.wanted:
            self.qlora()
        if self.start("train_step_scale"):
            self.scale("train_step_scale")
            self.done("train_step_scale")
        if self.start("train_step_scale_compiled"):
            self.scale("train_step_scale_compiled", compiled=True)
            self.done("train_step_scale_compiled")
        self.res["meta"]["patch"] = self.patch_info
        self.save()
        print(f"bench_model: wrote {self.args.out} in {self.budget.elapsed():.0f} s", flush=True)
        if self.budget_skipped:  # a partial run must not read as a complete one (gpu_check.sh reports the rc)
            print(f"bench_model: skipped for the time budget: {', '.join(self.budget_skipped)}", flush=True)
            return 3
        return 0

    def describe(self) -> dict:
        L, m, B, T = self.sz.layers, self.sz.model, self.sz.batch, self.sz.T
        model = (f"Llama-shaped model ({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, intermediate "
                 f"{m['intermediate_size']}, {m['num_attention_heads']}/{m['num_key_value_heads']} heads, vocab "
                 f"{m['vocab_size']})")
        d = {sc: f"nn.Linear {K}x{N}, {rows} x {t} tokens, fwd+bwd (dx and LoRA grads), 8 adapters mixed "
                 f"({rows // 8} row(s) each)" for sc, (K, N, rows, t) in L.items()}
        d["train_step_8"] = f"{model}, {B} x {T} tokens, 8 adapters ({B // 8} rows each), AdamW step"
        d["train_step_1"] = f"same model and tokens, 1 adapter on all {B} rows"
        d["train_step_32"] = f"same model, {32} x {B * T // 32} tokens (one row per adapter), 32 adapters"
        d["eval_8"] = f"forward only, {B} x {T} tokens: 8 adapters over {B - 2} rows + 2 __base__ rows"
        comp = f"torch.compile(model) ({self.compile_backend}, mode {self.args.compile_mode})"
        d["train_step_8_compiled"] = f"train_step_8's step, {comp}; loss and AdamW step eager"
        d["eval_8_compiled"] = f"eval_8's forward, {comp}; max_abs_diff_vs_eager: against the same model eager"
        gen = (f"{B} prompts x {self.sz.gen_prompt} tokens, model.generate(max_new_tokens={self.sz.gen_new}, "
               f"min_new_tokens={self.sz.gen_new}, do_sample=False), 8 adapters over {B - B // 4} rows + "
               f"{B // 4} __base__ rows")
        d["generate_static"] = (f"{gen}, cache_implementation='static' (transformers compiles the decode step: "
                                f"{'inductor, reduce-overhead' if self.compile_backend == 'inductor' else 'aot_eager'})"
                                f"; tokens vs each provider's own dynamic-cache generate")
        d["generate_dynamic"] = f"{gen}, default dynamic cache, eager; fast_multilora's tokens vs peft_mixed's"
        mo = self.sz.moe
        d["moe_step_8"] = (f"Qwen3-MoE-shaped model ({mo['num_hidden_layers']} layers, hidden {mo['hidden_size']}, "
                           f"{mo['num_experts']} experts x intermediate {mo['moe_intermediate_size']}, top-"
                           f"{mo['num_experts_per_tok']}, grouped_mm experts), {B} x {T} tokens, LoRA r=16 dropout 0 "
                           f"on {'/'.join(MOE_TARGET_MODULES)} + {'/'.join(MOE_TARGET_PARAMETERS)}, 8 adapters "
                           f"({B // 8} rows each), AdamW step; stock PEFT has no mixed path for expert LoRA")
        q = self.sz.qlora
        d["qlora_step_8"] = (f"QLoRA: Llama-shaped model ({q['num_hidden_layers']} layers, hidden {q['hidden_size']}, "
                             f"intermediate {q['intermediate_size']}) loaded in 4-bit (bitsandbytes nf4, double "
                             f"quantization, compute {self.sz.dtype}), {B} x {T} tokens, LoRA r=16 on all 7 "
                             f"projections, 8 adapters ({B // 8} rows each), AdamW step")
        d["qlora_eval_8"] = f"qlora_step_8's model, forward only: 8 adapters over {B - 2} rows + 2 __base__ rows"
        d["train_step_scale"] = (f"train_step_8's model and tokens ({B} x {T}), packed rows (adapter_ids; at least 4 "
                                 f"samples per row, every resident adapter on one at least), "
                                 f"{'/'.join(map(str, self.sz.scale_counts))} adapters resident and trained, AdamW "
                                 f"step; fast_N: N adapters")
        d["train_step_scale_compiled"] = (f"train_step_scale's step, {comp} compiled afresh per adapter count; loss "
                                          f"and fast_multilora.AdamW step eager")
        return d

    def wanted_eval_only(self, scenario):
        base = self.base_model()
        pm = self.peft_model(base, 8, TARGET_MODULES)
        run = self.eval_compiled if scenario == "eval_8_compiled" else self.eval_mixed
        run(scenario, pm, self.token_ids(self.sz.batch, self.sz.T))
        del pm, base
        self.free()


# ---------------------------------------------------------------------------------------------------------------------
# report

ORDER = ("fast_multilora", "fast_multilora_plain_loss", "peft_single", "peft_sequential", "peft_mixed_loop",
         "peft_mixed", "frozen")


def _ms(res, scenario, provider):
    return (res.get(scenario) or {}).get(provider, {}).get("ms")


def _ratio(a, b):
    return a / b if a and b else None


def targets(res) -> list:
    """The issues' targets: (what, target, measured, met)."""
    out = []

    def add(what, target, val, ok):
        out.append((what, target, "-" if val is None else val, "-" if val is None else ("yes" if ok else "no")))

    for sc, lim in (("layer_4096", 1.15), ("layer_2048", 1.35)):
        r = _ratio(_ms(res, sc, "fast_multilora"), _ms(res, sc, "frozen"))
        p = _ratio(_ms(res, sc, "peft_single"), _ms(res, sc, "frozen"))
        add(f"{sc}: fast_multilora (8 adapters) / frozen", f"≤ ×{lim}", r and f"×{r:.2f} (peft_single ×{p:.2f})"
            if p else r and f"×{r:.2f}", r is not None and r <= lim)
    f8 = _ms(res, "train_step_8", "fast_multilora")
    r = _ratio(f8, _ms(res, "train_step_8", "peft_single"))
    add("train_step_8: fast_multilora / peft_single", "≤ 0.9", r and f"{r:.2f}", r is not None and r <= 0.9)
    r2 = _ratio(_ms(res, "train_step_8", "fast_multilora_fused_adamw"),
                _ms(res, "train_step_8", "peft_single_fused_adamw"))
    add("train_step_8, both with AdamW(fused=True): fast_multilora / peft_single", "≤ 0.9", r2 and f"{r2:.2f}",
        r2 is not None and r2 <= 0.9)
    for prov, lim in (("peft_sequential", 6), ("peft_mixed_loop", 4)):
        r = _ratio(_ms(res, "train_step_8", prov), f8)
        add(f"train_step_8: {prov} / fast_multilora", f"≥ ×{lim}", r and f"×{r:.2f}", r is not None and r >= lim)
    pf = (res.get("train_step_8") or {}).get("fast_multilora", {}).get("peak_mib")
    ps = (res.get("train_step_8") or {}).get("peft_single", {}).get("peak_mib")
    add("train_step_8: peak memory fast_multilora vs peft_single", "≤", pf and ps and f"{pf:.0f} vs {ps:.0f} MiB",
        bool(pf and ps and pf <= ps))
    r = _ratio(_ms(res, "moe_step_8", "fast_multilora"), _ms(res, "moe_step_8", "peft_single"))
    add("moe_step_8: fast_multilora (8 adapters) / peft_single (issue 20)", "≤ 1.0", r and f"{r:.2f}",
        r is not None and r <= 1.0)
    q8 = _ms(res, "qlora_step_8", "fast_multilora")
    r = _ratio(q8, _ms(res, "qlora_step_8", "peft_single"))
    add("qlora_step_8: fast_multilora (8 adapters) / peft_single (issue 19)", "≤ 0.9", r and f"{r:.2f}",
        r is not None and r <= 0.9)
    r = _ratio(_ms(res, "qlora_step_8", "peft_mixed_loop"), q8)
    add("qlora_step_8: peft_mixed_loop / fast_multilora (issue 19)", "≥ ×4", r and f"×{r:.2f}",
        r is not None and r >= 4)
    for sc in ("train_step_scale", "train_step_scale_compiled"):
        s8 = _ms(res, sc, "fast_8")
        for n, lim in ((64, 1.10), (256, 1.30)):
            r = _ratio(_ms(res, sc, f"fast_{n}"), s8)
            add(f"{sc}: fast_{n} / fast_8 (issue 18)", f"≤ ×{lim}", r and f"×{r:.2f}", r is not None and r <= lim)
    o64 = (res.get("train_step_scale", {}).get("fast_64") or {}).get("optimizer_ms")
    add("train_step_scale: fast_multilora.AdamW step, 64 adapters (issue 18)", "≤ 2 ms", o64 and f"{o64:.2f} ms",
        o64 is not None and o64 <= 2.0)
    lay = {n: (res.get("train_step_scale", {}).get(f"fast_{n}") or {}).get("layer_host_us") for n in (8, 256)}
    r = _ratio(lay[256], lay[8])
    add("train_step_scale: layer call host time, 256 / 8 adapters (issue 18)", "×0.90 .. ×1.10",
        r and f"×{r:.2f} ({lay[256]} / {lay[8]} µs)", r is not None and abs(r - 1) <= 0.10)
    c8 = "train_step_8_compiled"
    for prov in ("fast_multilora", "fast_multilora_adamw"):
        for ref, lim in (("peft_single", 0.9), ("frozen", 1.10)):
            r = _ratio(_ms(res, c8, prov), _ms(res, c8, ref))
            add(f"{c8}: {prov} / {ref} compiled (issue 17)", f"≤ ×{lim}", r and f"×{r:.2f}",
                r is not None and r <= lim)
    cs = {p: (res.get(c8) or {}).get(p, {}).get("compile_s")
          for p in ("fast_multilora", "fast_multilora_adamw", "peft_single")}
    for prov in ("fast_multilora", "fast_multilora_adamw"):
        r = _ratio(cs[prov], cs["peft_single"])
        add(f"{c8}: compile time, {prov} / peft_single (issue 17)", "≤ ×1.5",
            r and f"×{r:.2f} ({cs[prov]} / {cs['peft_single']} s)", r is not None and r <= 1.5)
    for sc, lim in (("generate_static", 1.3), ("generate_dynamic", 1.5)):
        p = _ratio(_ms(res, sc, "peft_mixed"), _ms(res, sc, "frozen"))
        for prov in ("fast_multilora", "fast_multilora_store"):
            r = _ratio(_ms(res, sc, prov), _ms(res, sc, "frozen"))
            add(f"{sc}: {prov} (mixed) / base (issue 17)", f"≤ ×{lim}",
                r and (f"×{r:.2f} (peft_mixed ×{p:.2f})" if p else f"×{r:.2f}"), r is not None and r <= lim)
    r = _ratio(_ms(res, "eval_8", "fast_multilora"), _ms(res, "eval_8", "frozen"))
    p = _ratio(_ms(res, "eval_8", "peft_mixed_loop"), _ms(res, "eval_8", "frozen"))
    add("eval_8: fast_multilora / base forward", "≤ ×1.10", r and (f"×{r:.2f} (PEFT adapter_names ×{p:.2f})" if p
                                                                  else f"×{r:.2f}"), r is not None and r <= 1.10)
    return out


def render_md(res) -> str:
    m = res.get("meta") or {}
    lines = ["# fast_multilora vs PEFT: layer and model benchmarks", "",
             f"{m.get('gpu') or m.get('device')} · torch {m.get('torch')} · triton {m.get('triton')} · peft "
             f"{m.get('peft')} · transformers {m.get('transformers')} · backend {m.get('backend')} · commit "
             f"`{m.get('commit')}` · {m.get('date_utc')} UTC"
             + (" · **--quick dry run (CPU, tiny sizes: numbers meaningless)**" if m.get("quick") else ""), "",
             f"Times: {m.get('timing')}. Peak: `torch.cuda.max_memory_allocated` over the timed calls. "
             f"fast_multilora's loss: {m.get('fast_multilora_loss')}."
             + (f" Opt-in scenarios: {m['timing_opt_in']}." if m.get("timing_opt_in") else ""), ""]
    for run in m.get("merged_runs") or ():
        lines += [f"Merged from a later run: {', '.join(run.get('scenarios') or [])} (commit `{run.get('commit')}`, "
                  f"{run.get('date_utc')} UTC, {run.get('gpu') or run.get('device')}, compile "
                  f"{run.get('compile_backend')} / {run.get('compile_mode')}; {run.get('timing_opt_in')}).", ""]
    tg = targets(res)
    if any(v != "-" for _, _, v, _ in tg):
        lines += ["## Targets (the issues')", "", "| what | target | measured | met |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in tg]
        lines.append("")
    for sc in ALL_SCENARIOS:
        rows = res.get(sc) or {}
        if not rows:
            continue
        desc = (m.get("scenarios") or {}).get(sc, "")
        fz, ps = _ms(res, sc, "frozen"), _ms(res, sc, "peft_single")
        lines += [f"## {sc}", "", desc, "", "| provider | ms | × frozen | × peft_single | peak MiB | note |",
                  "|---|---|---|---|---|---|"]
        for prov in sorted(rows, key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER)):
            e = rows[prov]
            note = e.get("error") or e.get("skipped") or ""
            if "optimizer" in e:
                note += f"{e['optimizer']}; "
            if "gpu_ms" in e:
                note += f"kernels {e['gpu_ms']:.2f} ms, host {e['host_ms']:.2f} ms per call; "
            if "all_adapters_got_grads" in e:
                note += f"every adapter got gradients: {'yes' if e['all_adapters_got_grads'] else 'NO'}; "
            if "diff_rms_over_lora_effect_rms" in e:
                note += (f"vs PEFT logits: max abs diff {e['max_abs_diff_vs_peft']:.3g}, diff RMS / LoRA-effect RMS "
                         f"{e['diff_rms_over_lora_effect_rms']:.3g}; ")
            if e.get("compile_s") is not None:
                note += f"compile + first call {e['compile_s']:.1f} s ({e.get('compile_backend')}, " \
                        f"{e.get('compile_mode')}); "
            if "graphs" in e:
                note += f"{e['graphs']} graphs, {e['graph_breaks']} graph breaks; "
            if "max_abs_diff_vs_eager" in e:
                note += f"vs eager logits: max abs diff {e['max_abs_diff_vs_eager']:.3g}; "
            if "tokens_equal" in e:
                note += (f"tokens = {e['tokens_vs']}: {'yes' if e['tokens_equal'] else 'NO'} "
                         f"(common prefix {100 * e['tokens_common_prefix_frac']:.0f} % of the new tokens)")
            ms = e.get("ms")
            lines.append(f"| {prov} | {_f(ms, 2)} | {_f(_ratio(ms, fz), 2)} | {_f(_ratio(ms, ps), 2)} | "
                         f"{_f(e.get('peak_mib'), 0)} | {str(note).strip().rstrip(';').replace('|', '/')} |")
        lines.append("")
    if m.get("skipped_scenarios"):
        lines += ["Not run: " + ", ".join(m["skipped_scenarios"]), ""]
    return "\n".join(lines)


def _f(v, d):
    return "-" if v is None else f"{v:.{d}f}"


def plot(res, path) -> str | None:
    """Bars of ms per provider, one panel per scenario; returns why no plot was drawn, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"matplotlib unavailable ({type(e).__name__})"
    scen = [s for s in ALL_SCENARIOS if any(v.get("ms") for v in (res.get(s) or {}).values())]
    if not scen:
        return "no timings"
    cols = 3
    rows = (len(scen) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.0 * rows), squeeze=False)
    for ax in axes.flat[len(scen):]:
        ax.axis("off")
    for ax, sc in zip(axes.flat, scen, strict=False):
        d = res[sc]
        provs = [p for p in sorted(d, key=lambda p: ORDER.index(p) if p in ORDER else len(ORDER)) if d[p].get("ms")]
        ms = [d[p]["ms"] for p in provs]
        colors = ["tab:green" if p.startswith("fast") else "tab:gray" if p == "frozen" else "tab:blue" for p in provs]
        ax.barh(range(len(provs)), ms, color=colors)
        ax.set_yticks(range(len(provs)), provs, fontsize=8)
        ax.invert_yaxis()
        fz = d.get("frozen", {}).get("ms")
        for i, v in enumerate(ms):
            ax.text(v, i, f" {v:.1f}" + (f" (×{v / fz:.2f})" if fz else ""), va="center", fontsize=7)
        ax.set_xlim(0, max(ms) * 1.45)
        ax.set_title(sc, fontsize=10)
        ax.set_xlabel("ms (median)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
    m = res.get("meta") or {}
    fig.suptitle(f"fast_multilora vs PEFT · {m.get('gpu') or m.get('device')} · {str(m.get('commit'))[:12]}"
                 + (" · quick dry run" if m.get("quick") else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def render(res, json_path, md_dir=None):
    from harness import write_text

    stem = os.path.splitext(os.path.basename(json_path))[0]
    folder = md_dir or os.path.dirname(os.path.abspath(json_path))
    png = os.path.join(folder, f"{stem}.png")
    os.makedirs(folder, exist_ok=True)
    why = plot(res, png)
    md = render_md(res)
    md += f"\n![timings]({stem}.png)\n" if why is None else f"\n(no plot: {why})\n"
    write_text(os.path.join(folder, f"{stem}.md"), md)


def main(argv=None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notes, from PEFT calls
    sys.path.insert(0, HERE)
    if args.from_json:
        with open(args.from_json) as f:
            res = json.load(f)
        render(res, args.from_json, args.md_dir)
        print(f"rendered {args.from_json}")
        return 0
    return Run(args).main()


if __name__ == "__main__":
    sys.exit(main())
