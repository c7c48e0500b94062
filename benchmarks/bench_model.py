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
* ``fast_multilora_unfused`` (layers, 8-adapter step, eval; ``_p0_unfused`` at dropout 0): ``patch(...,
                       fuse_base=False)``, the base layer run by itself and the delta added in place afterwards
* ``peft_single``      stock PEFT, one adapter active, the same tokens
* ``peft_sequential``  stock PEFT, the N adapters trained one after another on their share of the batch
                       (8 adapters: 2 x 1024 tokens each), one optimizer per adapter (``anchor_peft.py``)
* ``peft_mixed_loop``  stock PEFT's own per-adapter mixed-batch loop (``adapter_names`` injected into every LoRA
                       layer by a forward pre-hook), forced into training (``anchor_loop.py``); in eval it is PEFT's
                       ordinary ``adapter_names`` path
* ``frozen``           no LoRA: the base model (train: forward + backward to the input embeddings only, as the anchor
                       measured it; eval: the PEFT model with its adapters disabled)

Scenarios (keys of the JSON): ``layer_4096`` (4096x4096 Linear, 8 x 1024 tokens), ``layer_2048`` (2048x2048,
16 x 1024 tokens) -- forward + backward, r=16, alpha 32, dropout 0.05, 8 adapters; ``train_step_8``, ``train_step_1``,
``train_step_32`` -- one optimizer step (AdamW) of the anchors' Llama-shaped model (8 layers, hidden 2048,
intermediate 5632, 32/4 heads, vocab 32000, random init, bf16; LoRA r=16, alpha 32, dropout 0.05 on all 7
projections) on 16 x 1024 tokens (32 adapters: 32 x 512, one row per adapter); ``eval_8`` -- a forward of 16 x 1024
tokens, 8 adapters and ``__base__`` rows mixed.

Each provider's entry is ``{"ms": median of CUDA-event timings after warm-up, "peak_mib": max_memory_allocated
of the timed calls, ...}``; a provider that raised has ``"error"`` and ``"ms": null``.

    python benchmarks/bench_model.py                                   # GPU, full sizes
    python benchmarks/bench_model.py --quick --out /tmp/q/h200.json    # CPU dry run, tiny sizes, torch backend
    python benchmarks/bench_model.py --from-json benchmarks/results/h200.json   # re-render markdown + plot only

Writes ``--out`` (JSON) and, beside it or in ``--md-dir``, ``<stem>.md`` and ``<stem>.png``, after every scenario.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
SCENARIOS = ("layer_4096", "layer_2048", "train_step_8", "eval_8", "train_step_1", "train_step_32")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU, torch backend: a dry run")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "h200.json"), help="JSON path")
    ap.add_argument("--md-dir", default=None, help="folder for <stem>.md and <stem>.png (default: beside --out)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset, in this order")
    ap.add_argument("--backend", default=None, help="fast_multilora backend (default: triton on GPU, torch on CPU)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no scenario/provider past this many seconds")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
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
            self.batch, self.T = 16, 16
            self.dtype = "float32"  # bf16 matmuls crawl on CPUs
            self.warm, self.iters, self.slow_warm, self.slow_iters = 1, 2, 1, 1
            self.layer_warm, self.layer_iters = 1, 3
            self.est = dict.fromkeys(SCENARIOS, 5.0)
            self.est_provider = 1.0
        else:
            self.layers = {"layer_4096": (4096, 4096, 8, 1024), "layer_2048": (2048, 2048, 16, 1024)}
            self.model = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                              num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)
            self.batch, self.T = 16, 1024
            self.dtype = "bfloat16"
            # host-bound steps vary by several ms from call to call: medians over 11
            self.warm, self.iters, self.slow_warm, self.slow_iters = 3, 11, 1, 3
            self.layer_warm, self.layer_iters = 5, 30
            # rough H200 seconds per scenario incl. model build and first-call Triton compiles (budget planning)
            self.est = {"layer_4096": 12, "layer_2048": 10, "train_step_8": 80, "eval_8": 14, "train_step_1": 16,
                        "train_step_32": 55}
            self.est_provider = 5.0


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
        self.dtype = getattr(torch, self.sz.dtype)
        self.backend = args.backend or ("torch" if args.quick else "triton")
        if args.quick:
            torch.set_num_threads(1)  # tiny ops: threads only add contention on a shared CPU
        from harness import Budget

        self.budget = Budget(args.budget_s)
        self.res = {name: {} for name in SCENARIOS}
        self.res["meta"] = None
        if self.device == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # as the anchors

    # -- helpers ------------------------------------------------------------------------------------------------------
    def measure(self, scenario: str, provider: str, fn, *, slow=False, layer=False, split=False, setup=None,
                teardown=None, verify=None, **extra):
        """Time ``fn`` (after ``setup()``), store ``{"ms", "peak_mib", ...}``; a raising provider is recorded, not
        fatal. ``verify()`` (after the timing) returns fields to record; ``teardown`` always runs. Layer calls and
        ``split`` rows also record ``gpu_ms`` / ``host_ms`` (``harness.split_call``): whether the row is bound by
        the GPU or by the host."""
        from harness import split_call, time_steps

        est = self.sz.est_provider * (2 if slow else 1)
        if not self.budget.allows(est):
            self.res[scenario][provider] = {"ms": None, "peak_mib": None, "skipped": "time budget"}
            print(f"  {provider:28s} skipped (time budget)", flush=True)
            return
        if layer:
            warm, iters = self.sz.layer_warm, self.sz.layer_iters
        elif slow:
            warm, iters = self.sz.slow_warm, self.sz.slow_iters
        else:
            warm, iters = self.sz.warm, self.sz.iters
        try:
            if setup is not None:
                setup()
            r = time_steps(fn, self.device, warm=warm, iters=iters)
            if layer or split:  # how much of a call is kernel time, how much the host's
                r.update(split_call(fn, self.device))
            r.update(extra)
            if verify is not None:
                r.update(verify())
            print(f"  {provider:28s} {r['ms']:9.2f} ms   peak {r['peak_mib'] or 0:9.0f} MiB", flush=True)
        except Exception as e:
            traceback.print_exc()
            r = {"ms": None, "peak_mib": None, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"  {provider:28s} ERROR {r['error']}", flush=True)
        finally:
            if teardown is not None:
                try:
                    teardown()
                except Exception:
                    traceback.print_exc()
            self.free()
        self.res[scenario][provider] = r

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

    def mixed_loop_hooks(self, model, names):
        """PEFT's own per-adapter loop in every LoRA layer, in training too (``anchor_loop.py``)."""
        from peft.tuners.lora import Linear as LoraLinear

        hooks = []
        for m in model.modules():
            if isinstance(m, LoraLinear):
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

    def peft_model(self, base, n_adapters, targets, dropout=0.05):
        from peft import LoraConfig, get_peft_model

        def cfg():
            return LoraConfig(r=16, lora_alpha=32, lora_dropout=dropout, target_modules=targets)

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

        def adamw(params):
            return torch.optim.AdamW(params, lr=1e-4)

        # stock PEFT, one adapter on all tokens
        def single_setup():
            pm.set_adapter("a0")
            opt["o"] = adamw([p for p in pm.parameters() if p.requires_grad])

        def single():
            pm(input_ids=ids, labels=ids).loss.backward()
            opt["o"].step()
            opt["o"].zero_grad(set_to_none=True)

        self.measure(scenario, "peft_single", single, setup=single_setup, teardown=opt.clear,
                     split=scenario == "train_step_8")

        # stock PEFT, adapters one after another on their own rows
        if n_adapters > 1:
            per = rows // n_adapters
            small = [ids[i * per:(i + 1) * per] for i in range(n_adapters)]

            def seq_setup():
                self.all_lora_trainable(pm)
                for i in range(n_adapters):
                    opt[i] = adamw(self.lora_params(pm, f"a{i}"))

            def sequential():
                for i in range(n_adapters):
                    pm.set_adapter(f"a{i}")
                    pm(input_ids=small[i], labels=small[i]).loss.backward()
                    opt[i].step()
                    opt[i].zero_grad(set_to_none=True)

            self.measure(scenario, "peft_sequential", sequential, slow=True, setup=seq_setup, teardown=opt.clear,
                         rows_per_adapter=per, tokens_per_row=T)

            # stock PEFT's per-adapter loop in every layer, forced into training
            hooks = []

            def loop_setup():
                self.all_lora_trainable(pm)
                hooks.extend(self.mixed_loop_hooks(pm, names))
                opt["o"] = adamw(self.lora_params(pm))

            def loop_teardown():
                for h in hooks:
                    h.remove()
                opt.clear()

            self.measure(scenario, "peft_mixed_loop", single, slow=True, setup=loop_setup, teardown=loop_teardown)

        # fast_multilora: one mixed batch, every adapter trained in the same step
        def fast_setup():
            self.all_lora_trainable(pm)
            self.patch(pm)
            opt["o"] = adamw(self.lora_params(pm))

        def fast_teardown():
            self.unpatch(pm)
            opt.clear()

        def fast():
            out = pm(input_ids=ids, adapter_names=names)
            fast_multilora.per_adapter_loss(out.logits, ids, names).backward()
            opt["o"].step()
            opt["o"].zero_grad(set_to_none=True)

        def fast_plain():
            pm(input_ids=ids, labels=ids, adapter_names=names).loss.backward()
            opt["o"].step()
            opt["o"].zero_grad(set_to_none=True)

        def grads_check():  # the timed steps trained every adapter (B moved off zero, so A gets gradients too)
            out = pm(input_ids=ids, adapter_names=names)
            loss = fast_multilora.per_adapter_loss(out.logits, ids, names)
            loss.backward()
            got = [any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in self.lora_params(pm, f"a{i}"))
                   for i in range(n_adapters)]
            opt["o"].zero_grad(set_to_none=True)
            return {"loss": loss.item(), "all_adapters_got_grads": all(got)}

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

            def unshared_setup(**kw):
                self.all_lora_trainable(pm)
                self.patch(pm, share_shrink=False, **kw)
                opt["o"] = adamw(self.lora_params(pm))

            def unfused_setup():
                self.all_lora_trainable(pm)
                self.patch(pm, fuse_base=False)
                opt["o"] = adamw(self.lora_params(pm))

            self.measure(scenario, "fast_multilora_unfused", fast, setup=unfused_setup, teardown=fast_teardown)

            def share_dropout_setup():
                self.all_lora_trainable(pm)
                self.patch(pm, share_dropout=True)
                opt["o"] = adamw(self.lora_params(pm))

            self.measure(scenario, "fast_multilora_share_dropout", fast, setup=share_dropout_setup,
                         teardown=fast_teardown)

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

            self.measure(scenario, "peft_single_p0", single, setup=p0(single_setup), teardown=p_back(opt.clear))
            self.measure(scenario, "fast_multilora_p0", fast, setup=p0(fast_setup), teardown=p_back(fast_teardown))
            self.measure(scenario, "fast_multilora_p0_unshared", fast, setup=p0(unshared_setup),
                         teardown=p_back(fast_teardown))
            self.measure(scenario, "fast_multilora_p0_unfused", fast, setup=p0(unfused_setup),
                         teardown=p_back(fast_teardown))
        if eval_after and self.start("eval_8"):
            self.done(scenario)
            self.eval_mixed("eval_8", pm, ids)

    def eval_mixed(self, scenario: str, pm, ids):
        torch = self.torch
        rows = ids.shape[0]
        names = sorted([f"a{i % 8}" for i in range(rows - 2)] + ["__base__"] * 2)  # 8 adapters + 2 base rows
        pm.eval()
        state = {}
        with torch.no_grad():  # B off zero (PEFT initialises it to 0), so the check below compares real deltas
            g = torch.Generator(device=self.device).manual_seed(2)
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g, device=self.device) * 0.02)

        def no_grad(fn):
            def wrapped():
                with torch.no_grad():
                    fn()
            return wrapped

        # the base forward: adapters disabled around the timed calls, not inside them (PEFT's disable_adapter() walks
        # every module on enter and exit, host time that is not the forward's)
        disabled = {}

        def disable():
            disabled["cm"] = pm.disable_adapter()
            disabled["cm"].__enter__()

        def enable():
            disabled.pop("cm").__exit__(None, None, None)

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

    # -- driver -------------------------------------------------------------------------------------------------------
    def start(self, scenario: str) -> bool:
        if scenario not in self.wanted:
            return False
        if not self.budget.allows(self.sz.est[scenario]):
            self.skipped.append(scenario)
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
        write_json(self.args.out, self.res)
        render(self.res, self.args.out, self.args.md_dir)

    def main(self) -> int:
        from harness import run_meta

        torch = self.torch
        if self.device == "cuda" and not torch.cuda.is_available():
            print("bench_model: no CUDA device; use --quick for a CPU dry run", file=sys.stderr)
            return 2
        self.wanted = [s for s in self.args.scenarios.split(",") if s]
        unknown = [s for s in self.wanted if s not in SCENARIOS]
        if unknown:
            print(f"bench_model: unknown scenario(s) {unknown}; choose from {SCENARIOS}", file=sys.stderr)
            return 2
        self.skipped = [s for s in SCENARIOS if s not in self.wanted]
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
        print(f"bench_model: {self.res['meta'].get('gpu') or self.device}, backend {self.backend}", flush=True)
        for scenario in ("layer_4096", "layer_2048"):
            if self.start(scenario):
                self.layer(scenario)
                self.done(scenario)
        if self.start("train_step_8"):
            self.train("train_step_8", 8, eval_after=True)
            self.done("train_step_8")
        elif "eval_8" in self.wanted and self.start("eval_8"):  # eval alone: build the 8-adapter model for it
            self.wanted_eval_only()
        for scenario, n in (("train_step_1", 1), ("train_step_32", 32)):
            if self.start(scenario):
                self.train(scenario, n)
                self.done(scenario)
        self.res["meta"]["patch"] = self.patch_info
        self.save()
        print(f"bench_model: wrote {self.args.out} in {self.budget.elapsed():.0f} s", flush=True)
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
        return d

    def wanted_eval_only(self):
        base = self.base_model()
        pm = self.peft_model(base, 8, TARGET_MODULES)
        self.eval_mixed("eval_8", pm, self.token_ids(self.sz.batch, self.sz.T))
        del pm, base
        self.free()


# ---------------------------------------------------------------------------------------------------------------------
# report

ORDER = ("fast_multilora", "fast_multilora_plain_loss", "peft_single", "peft_sequential", "peft_mixed_loop", "frozen")


def _ms(res, scenario, provider):
    return (res.get(scenario) or {}).get(provider, {}).get("ms")


def _ratio(a, b):
    return a / b if a and b else None


def targets(res) -> list:
    """Issue 4's targets: (what, target, measured, met)."""
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
             f"fast_multilora's loss: {m.get('fast_multilora_loss')}.", ""]
    tg = targets(res)
    if any(v != "-" for _, _, v, _ in tg):
        lines += ["## Targets (issue 4)", "", "| what | target | measured | met |", "|---|---|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in tg]
        lines.append("")
    for sc in SCENARIOS:
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
                note += f"{e['optimizer']} "
            if "gpu_ms" in e:
                note += f"kernels {e['gpu_ms']:.2f} ms, host {e['host_ms']:.2f} ms per call "
            if "all_adapters_got_grads" in e:
                note += f"every adapter got gradients: {'yes' if e['all_adapters_got_grads'] else 'NO'}"
            if "diff_rms_over_lora_effect_rms" in e:
                note += (f"vs PEFT logits: max abs diff {e['max_abs_diff_vs_peft']:.3g}, diff RMS / LoRA-effect RMS "
                         f"{e['diff_rms_over_lora_effect_rms']:.3g}")
            ms = e.get("ms")
            lines.append(f"| {prov} | {_f(ms, 2)} | {_f(_ratio(ms, fz), 2)} | {_f(_ratio(ms, ps), 2)} | "
                         f"{_f(e.get('peak_mib'), 0)} | {str(note).replace('|', '/')} |")
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
    scen = [s for s in SCENARIOS if any(v.get("ms") for v in (res.get(s) or {}).values())]
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
