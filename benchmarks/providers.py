"""Providers: how a user configures each contender, as data (``PROVIDERS``), and the call each one times per scenario
kind (``prepare``).

A provider is a family (``frozen``: the base model, no LoRA; ``peft_single``: stock PEFT, one adapter on every row;
``peft_sequential``: stock PEFT, the adapters trained one after another on their own rows; ``peft_mixed_loop``: PEFT's
own per-sample mixed-batch loop; ``fast``: the PEFT model after ``fast_multilora.patch``, one mixed batch) plus the
optimizer the user builds, whether the model is ``torch.compile``d, and ``PatchConfig`` settings.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

import workloads as M


@dataclass(frozen=True)
class Provider:
    name: str
    family: str  # frozen | peft_single | peft_sequential | peft_mixed_loop | peft_add_adapter | fast
    doc: str
    optimizer: str = "adamw"  # adamw | adamw_fused | paged_adamw8bit | store
    compiled: bool = False
    patch: tuple = ()  # PatchConfig overrides, (name, value) pairs
    needs: str | None = None  # a module the provider imports; without it the row is skipped with that reason
    prefetch: bool = False  # paging: fast_multilora.prefetch of the next step's adapters while a step runs


OPTIMIZERS = {
    "adamw": "torch.optim.AdamW(model.parameters(), lr) (torch defaults: foreach)",
    "adamw_fused": "torch.optim.AdamW(model.parameters(), lr, fused=True)",
    "paged_adamw8bit": "bitsandbytes.optim.PagedAdamW8bit(model.parameters(), lr)",
    "store": "fast_multilora.AdamW(model, lr) (adapter store: one launch for every adapter)",
}

PROVIDERS = {p.name: p for p in (
    Provider("frozen", "frozen", "the base model without LoRA (train: forward + backward to the input embeddings, no "
                                 "optimizer): the floor"),
    Provider("frozen_compiled", "frozen", "frozen under torch.compile(model) (default mode): the compiled rows' floor",
             compiled=True),
    Provider("peft_single", "peft_single", "stock PEFT, eager, one adapter active on every row"),
    Provider("peft_single_fused_adamw", "peft_single", "peft_single with AdamW(fused=True)", optimizer="adamw_fused"),
    Provider("peft_single_compiled", "peft_single", "peft_single under torch.compile(model) (default mode)",
             compiled=True),
    Provider("peft_sequential", "peft_sequential", "stock PEFT, each adapter trained on its own rows one after "
                                                   "another, an AdamW per adapter"),
    Provider("peft_mixed_loop", "peft_mixed_loop", "PEFT's own per-sample mixed batch (adapter_names: a loop over "
                                                   "adapters in every LoRA layer); in training injected by a "
                                                   "pre-hook, as PEFT allows it only at inference"),
    Provider("peft_add_adapter", "peft_add_adapter", "create_adapters' reference: PEFT's own loop, "
                                                     "PeftModel.add_adapter(name, LoraConfig) per adapter"),
    Provider("fast_multilora", "fast", "fast_multilora.patch(model), one mixed batch of every adapter, the user's "
                                       "own torch.optim.AdamW(model.parameters(), lr); create_adapters: "
                                       "fast_multilora.add_adapters(model, {name: LoraConfig})"),
    Provider("fast_multilora_fused_adamw", "fast", "fast_multilora with AdamW(fused=True)", optimizer="adamw_fused"),
    Provider("fast_multilora_paged_adamw8bit", "fast", "fast_multilora with bitsandbytes' PagedAdamW8bit",
             optimizer="paged_adamw8bit", needs="bitsandbytes"),
    Provider("fast_multilora_compiled", "fast", "fast_multilora under torch.compile(model) (default mode)",
             compiled=True),
    Provider("fast_multilora_store_adamw", "fast", "fast_multilora with fast_multilora.AdamW(model, lr)",
             optimizer="store"),
    Provider("fast_multilora_paged", "fast", "fast_multilora with paging: PatchConfig(resident_adapters=0) (on the "
                                             "device only the step's adapters and those prefetched; the others' "
                                             "weights and AdamW states in pinned host memory), "
                                             "fast_multilora.prefetch(model, next step's names) after each forward, "
                                             "torch.optim.AdamW(fused=True) (paging refuses fast_multilora.AdamW)",
             optimizer="adamw_fused", patch=(("resident_adapters", 0),), prefetch=True),
    Provider("fast_multilora_paged_default_adamw", "fast", "fast_multilora_paged with the user's default "
                                                           "torch.optim.AdamW(model.parameters(), lr) (foreach; its "
                                                           "step counts stay on the host)",
             optimizer="adamw", patch=(("resident_adapters", 0),), prefetch=True),
    Provider("fast_multilora_paged_no_prefetch", "fast", "fast_multilora_paged without prefetch: the step's "
                                                         "adapters are paged in at the forward's entry",
             optimizer="adamw_fused", patch=(("resident_adapters", 0),)),
    Provider("fast_multilora_paged_params", "fast", "fast_multilora_paged on the per-parameter path "
                                                    "(PatchConfig(adapter_store=False)): no store re-layout when "
                                                    "adapters move; each layer call takes the resident adapters' "
                                                    "PEFT parameters",
             optimizer="adamw_fused", patch=(("resident_adapters", 0), ("adapter_store", False)), prefetch=True),
    Provider("fast_multilora_params", "fast", "fast_multilora with PatchConfig(adapter_store=False): every layer call "
                                              "takes PEFT's per-adapter parameters (the path before the store)",
             patch=(("adapter_store", False),)),
)}


class Step(NamedTuple):
    """What a row times: ``fn()`` (one call); ``check()`` after the timing returns fields to record; ``teardown()``
    always runs; ``first`` is set when the first call compiles (its wall time is recorded as ``compile_s``). With
    ``setup``, every call is ``fn(setup())`` on fresh state, ``iters`` times (``harness.time_fresh``). With
    ``timed``, the row times itself: ``timed()`` returns the row's timing fields (``wall_ms`` ...; other keys go to
    its extra) and ``fn`` is not called."""
    fn: Callable
    teardown: Callable
    check: Callable
    info: dict
    first: bool = False
    setup: Callable | None = None
    iters: int = 1
    timed: Callable | None = None


def _nothing():
    return {}


def optimizer(kind: str, model):
    import torch

    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=M.LR)
    if kind == "adamw_fused":
        return torch.optim.AdamW(model.parameters(), lr=M.LR, fused=True)
    if kind == "paged_adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(model.parameters(), lr=M.LR)
    if kind == "store":
        import fast_multilora

        return fast_multilora.AdamW(model, lr=M.LR)
    raise ValueError(f"unknown optimizer {kind!r}; expected one of {sorted(OPTIMIZERS)}")


def mixed_loop_hooks(model, names, layer_types) -> list:
    """PEFT's per-adapter loop in every LoRA layer of ``layer_types``, in training too: ``adapter_names`` handed to
    each layer's forward by a pre-hook (PEFT's model-level ``adapter_names`` refuses training)."""
    return [m.register_forward_pre_hook(lambda mod, a, kw: (a, {**kw, "adapter_names": list(names)}),
                                        with_kwargs=True)
            for m in model.modules() if isinstance(m, layer_types)]


def _patch(ctx, pm, p: Provider):
    import fast_multilora

    report = fast_multilora.patch(pm, backend=ctx.backend, **dict(p.patch))
    return {"patched": len(report.patched), "fallback": len(report.fallback)}


def _unpatch(pm):
    import fast_multilora

    fast_multilora.unpatch(pm)


def _model(ctx, pm, p: Provider):
    return ctx.compile(pm) if p.compiled else pm


def prepare(ctx, p: Provider, variant: str) -> Step:
    """The timed call of provider ``p`` in ``ctx``'s scenario (``ctx.kind``: train, scale, eval, generate, layer)."""
    kind = "train" if ctx.kind == "scale" else ctx.kind
    return {"train": _train, "eval": _eval, "generate": _generate, "layer": _layer, "head": _head,
            "create": _create, "churn": _churn, "paged": _paged}[kind](ctx, p, variant)


# -- training steps ----------------------------------------------------------------------------------------------------

def _train(ctx, p: Provider, variant: str) -> Step:
    b = ctx.batch(variant)
    ids = b["ids"]
    if p.family == "frozen":
        base = ctx.base()
        base.requires_grad_(False)
        model = ctx.compile(base) if p.compiled else base

        def frozen():
            emb = base.get_input_embeddings()(ids).detach().requires_grad_(True)
            model(inputs_embeds=emb, labels=ids).loss.backward()

        return Step(frozen, _nothing, _nothing, {}, first=p.compiled)
    pm = ctx.peft(b.get("adapters"))
    pm.train()
    if p.family == "peft_single":
        pm.set_adapter(ctx.first_adapter())  # PEFT: one adapter active and trainable on every row
        opt, model = optimizer(p.optimizer, pm), _model(ctx, pm, p)

        def single():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Step(single, lambda: M.all_lora_trainable(pm), _nothing, {"optimizer": OPTIMIZERS[p.optimizer]},
                    first=p.compiled)
    names = b["names"]
    M.all_lora_trainable(pm)
    if p.family == "peft_sequential":
        order = list(dict.fromkeys(n for n in names if n != "__base__"))
        rows = {a: [i for i, n in enumerate(names) if n == a] for a in order}
        opts = {a: ctx.torch.optim.AdamW(M.lora_params(pm, a), lr=M.LR) for a in order}

        def sequential():
            for a in order:
                pm.set_adapter(a)
                x = ids[rows[a]]
                pm(input_ids=x, labels=x).loss.backward()
                opts[a].step()
                opts[a].zero_grad(set_to_none=True)

        return Step(sequential, lambda: M.all_lora_trainable(pm), _nothing,
                    {"optimizer": "torch.optim.AdamW per adapter", "rows_per_adapter": len(ids) // len(order)})
    if p.family == "peft_mixed_loop":
        hooks = mixed_loop_hooks(pm, names, ctx.lora_layer_types())
        opt = optimizer(p.optimizer, pm)

        def loop():
            pm(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Step(loop, lambda: [h.remove() for h in hooks], _nothing, {"optimizer": OPTIMIZERS[p.optimizer]})
    # fast_multilora: every adapter trained in one mixed batch
    info = {"patch": _patch(ctx, pm, p), "optimizer": OPTIMIZERS[p.optimizer]}
    opt = optimizer(p.optimizer, pm)
    model = _model(ctx, pm, p)
    route = {k: b[k] for k in ("adapter_ids", "position_ids") if k in b}
    if "position_ids" in route:  # packed rows: no KV cache, as PackedCollator's batch (a cache turns off packing)
        route["use_cache"] = False
    if variant in ("per_adapter_loss", "logits"):
        import fast_multilora

        info["loss_call"] = "fast_multilora.per_adapter_loss(model(...).logits, ...)" + (
            ", packed rows (adapter_ids)" if route else ", rows grouped by adapter")
        kw = {**route, "use_cache": False} if variant == "logits" else route  # logits: as fused_causal_lm_loss

        def loss():
            return fast_multilora.per_adapter_loss(model(input_ids=ids, adapter_names=names, **kw).logits, ids,
                                                   names, adapter_ids=route.get("adapter_ids"))
    elif variant == "fused":
        import fast_multilora

        info["loss_call"] = "fast_multilora.fused_causal_lm_loss(model, batch): no logits built" + (
            ", packed rows (adapter_ids)" if route else "")
        batch = {"input_ids": ids, "labels": ids, "adapter_names": names, **route}

        def loss():
            return fast_multilora.fused_causal_lm_loss(model, batch)
    else:
        info["loss_call"] = "HF labels= loss" + (", packed rows (adapter_ids)" if route else ", rows interleaved")

        def loss():
            return model(input_ids=ids, labels=ids, adapter_names=names, **route).loss

    def fast():
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    trained = [n for n in dict.fromkeys(names) if n != "__base__"]
    if variant in ("labels", "logits", "fused"):  # what the fused loss saves: the fp32 logits of the batch
        info["logits_fp32_mib"] = round(ids.numel() * pm.get_output_embeddings().weight.shape[0] * 4 / 2**20, 1)

    def check():  # the timed steps trained every adapter of the batch (B moved off zero: A gets gradients too)
        value = loss()
        value.backward()
        got = M.adapters_with_grads(pm, trained)
        opt.zero_grad(set_to_none=True)
        out = {"loss": float(value.detach()), "adapters_in_batch": len(trained), "adapters_with_grads": got}
        if variant == "fused":
            out.update(_fused_vs_logits(pm, model, batch))
        return out

    return Step(fast, lambda: _unpatch(pm), check, info, first=p.compiled)


def _fused_vs_logits(pm, model, batch) -> dict:
    """The fused loss against ``per_adapter_loss`` of the model's logits, on the same weights, dropout off."""
    import torch

    import fast_multilora

    route = {k: batch[k] for k in ("adapter_ids", "position_ids") if k in batch}
    pm.eval()
    try:
        with torch.no_grad():
            fused = fast_multilora.fused_causal_lm_loss(model, batch)
            logits = model(input_ids=batch["input_ids"], adapter_names=batch["adapter_names"], use_cache=False,
                           **route).logits
            ref = fast_multilora.per_adapter_loss(logits, batch["labels"], batch["adapter_names"],
                                                  adapter_ids=route.get("adapter_ids"))
    finally:
        pm.train()
    return {"eval_loss_logits": float(ref), "eval_loss_fused_minus_logits": float(fused - ref)}


# -- inference ---------------------------------------------------------------------------------------------------------

def _eval(ctx, p: Provider, variant: str) -> Step:
    torch = ctx.torch
    b = ctx.batch(variant)
    ids, names = b["ids"], b["names"]

    def no_grad(model, **kw):
        def fn():
            with torch.no_grad():
                return model(input_ids=ids, **kw).logits
        return fn

    if p.family == "frozen":
        base = ctx.base()
        return Step(no_grad(ctx.compile(base) if p.compiled else base), _nothing, _nothing, {}, first=p.compiled)
    pm = ctx.peft()
    pm.eval()
    if p.family == "peft_single":
        pm.set_adapter(ctx.first_adapter())
        return Step(no_grad(_model(ctx, pm, p)), lambda: M.all_lora_trainable(pm), _nothing, {}, first=p.compiled)
    if p.family == "peft_mixed_loop":
        return Step(no_grad(pm, adapter_names=names), _nothing, _nothing, {})
    ref = ctx.cached("peft_logits", lambda: _peft_logits(pm, ids, names))  # before patching: PEFT's own numbers
    info = {"patch": _patch(ctx, pm, p)}
    fn = no_grad(_model(ctx, pm, p), adapter_names=names)

    def check():
        """The mixed batch's logits against PEFT's ``adapter_names`` path: max |diff| and diff RMS over the RMS of
        the LoRA effect (PEFT's logits minus the base's)."""
        got = fn().float().cpu()
        want, base = ref
        diff = got - want
        return {"max_abs_diff_vs_peft": float(diff.abs().max()),
                "diff_rms_over_lora_effect_rms": float(diff.pow(2).mean().sqrt() / (want - base).pow(2).mean().sqrt())}

    return Step(fn, lambda: _unpatch(pm), check, info, first=p.compiled)


def _peft_logits(pm, ids, names):
    import torch

    with torch.no_grad():
        want = pm(input_ids=ids, adapter_names=names).logits.float().cpu()
        with pm.disable_adapter():
            base = pm(input_ids=ids).logits.float().cpu()
    return want, base


def _generate(ctx, p: Provider, variant: str) -> Step:
    torch = ctx.torch
    b = ctx.batch(variant)
    kw, names, T = b["generate"], b["names"], b["ids"].shape[1]
    out = {}

    def gen(model, **more):
        def fn():
            with torch.no_grad():
                out["tokens"] = model.generate(**kw, **more)
        return fn

    info = {"cache": "static (transformers compiles the decode step)" if "compile_config" in kw else "dynamic"}
    if p.family == "frozen":
        return Step(gen(ctx.base()), _nothing, _nothing, info, first="compile_config" in kw)
    pm = ctx.peft()
    pm.eval()
    dyn = {k: v for k, v in kw.items() if k not in ("cache_implementation", "compile_config")}

    def peft_tokens():
        with torch.no_grad():
            return pm.generate(**dyn, adapter_names=names).cpu()

    if p.family == "peft_mixed_loop":
        return Step(gen(pm, adapter_names=names), _nothing, _nothing, info, first="compile_config" in kw)
    ref = ctx.cached("peft_tokens", peft_tokens)  # before patching
    info["patch"] = _patch(ctx, pm, p)

    def check():
        """Greedy tokens against PEFT's mixed dynamic-cache generate: equal, and the share of each row's new tokens
        before its first difference (bf16 rounding can flip a near tie of the random model)."""
        got, want = out.pop("tokens")[:, T:].cpu(), ref[:, T:]
        prefix = (got == want).int().cumprod(dim=1).sum(dim=1).float().mean() / want.shape[1]
        return {"tokens_equal_peft": bool(torch.equal(got, want)), "tokens_common_prefix_frac": float(prefix)}

    return Step(gen(pm, adapter_names=names), lambda: _unpatch(pm), check, info, first="compile_config" in kw)


# -- one layer ---------------------------------------------------------------------------------------------------------

def _layer(ctx, p: Provider, variant: str) -> Step:
    b = ctx.batch(variant)
    x, gy, names = b["x"], b["gy"], b["names"]

    def call(model, **kw):
        params = [q for q in model.parameters() if q.requires_grad]

        def fn():
            x.grad = None
            for q in params:
                q.grad = None
            model(x, **kw).backward(gy)
        return fn

    if p.family == "frozen":
        return Step(call(ctx.base()), _nothing, _nothing, {})
    pm = ctx.peft()
    if p.family == "peft_single":
        pm.set_adapter(ctx.first_adapter())
        return Step(call(pm), lambda: M.all_lora_trainable(pm), _nothing, {})
    if p.family == "peft_mixed_loop":
        hooks = mixed_loop_hooks(pm, names, ctx.lora_layer_types())
        return Step(call(pm), lambda: [h.remove() for h in hooks], _nothing, {})
    info = {"patch": _patch(ctx, pm, p)}
    return Step(call(pm, adapter_names=names), lambda: _unpatch(pm), _nothing, info)


def _head(ctx, p: Provider, variant: str) -> Step:
    """The LM head and loss, forward + backward to the hidden states: HF's mean cross-entropy of the logits (frozen),
    ``per_adapter_loss`` of the logits or ``per_adapter_loss_from_hidden`` (the variants). The fast rows' check
    compares the two per-adapter losses and their hidden-state gradients."""
    import torch.nn.functional as F

    import fast_multilora

    b = ctx.batch(variant)
    head, hidden, labels, names, aid = ctx.base(), b["hidden"], b["labels"], b["names"], b["adapter_ids"]

    def logits_loss():
        return fast_multilora.per_adapter_loss(head(hidden), labels, names, adapter_ids=aid)

    chunk = int(variant.split("chunk=")[1]) if "chunk=" in variant else None  # (None: the default chunk)

    def fused_loss():
        return fast_multilora.per_adapter_loss_from_hidden(hidden, head, labels, names, adapter_ids=aid,
                                                           chunk_size=chunk)

    def frozen_loss():  # transformers' ForCausalLMLoss: shift, fp32 upcast, mean over the tokens
        z = head(hidden)[:, :-1].float()
        return F.cross_entropy(z.reshape(-1, z.shape[-1]), labels[:, 1:].reshape(-1))

    loss = {"": frozen_loss, "logits": logits_loss, "fused": fused_loss}[
        variant.split("/")[0] if p.family == "fast" else ""]

    def fn():
        hidden.grad = None
        loss().backward()

    info = {"logits_fp32_mib": round(labels.numel() * head.weight.shape[0] * 4 / 2**20, 1)}
    if variant.startswith("fused"):
        from fast_multilora.fused_loss import chunk_tokens

        info["chunk_tokens"] = chunk or chunk_tokens(labels.numel(), hidden.shape[-1], head.weight.shape[0],
                                                     gpu=hidden.device.type == "cuda")

    def check():
        out = {}
        if p.family == "fast":
            got = {}
            for v, f in (("logits", logits_loss), ("fused", fused_loss)):
                hidden.grad = None
                value = f()
                value.backward()
                got[v] = (value.detach().float(), hidden.grad.float())
            (l0, g0), (l1, g1) = got["logits"], got["fused"]
            out = {"loss_fused_minus_logits": float(l1 - l0),
                   "dhidden_rel_err": float((g1 - g0).abs().max() / g0.abs().max().clamp_min(1e-30))}
            hidden.grad = None
        return out

    return Step(fn, _nothing, check, info)


# -- creating adapters -------------------------------------------------------------------------------------------------

def _create(ctx, p: Provider, variant: str) -> Step:
    """Create ``n`` adapters (``b0 ..``) on a fresh PeftModel holding ``a0``: ``fast_multilora.add_adapters`` or PEFT's
    ``add_adapter`` loop. The fast row's check times ``save_adapters`` of them and ``load_adapters`` into a fresh
    model, and compares the loaded weights with the created ones."""
    from peft import get_peft_model

    import fast_multilora

    n = ctx.batch(variant)["adapters"]
    names = [f"b{i}" for i in range(n)]
    hold = {}

    def fresh():  # the base with a0, and the configs to add (untimed)
        hold.clear()
        ctx.free()
        cfg = dict(rank=ctx.sizes.rank, dropout=ctx.sc.dropout)
        hold["pm"] = get_peft_model(M.llama(ctx.sizes, ctx.device, ctx.dtype), M.lora_config(**cfg), adapter_name="a0")
        return hold["pm"], {a: M.lora_config(**cfg) for a in names}

    def fast(state):
        hold["fallback"] = fast_multilora.add_adapters(*state)

    def peft_loop(state):
        pm, cfgs = state
        for a, cfg in cfgs.items():
            pm.add_adapter(a, cfg)

    small = n <= 32 or (p.family == "fast" and n <= 128)
    info = {"adapters_created": n, "call": "fast_multilora.add_adapters(model, configs)" if p.family == "fast"
            else "for name, cfg in configs.items(): model.add_adapter(name, cfg)"}

    def check():
        pm = hold["pm"]
        got = {"adapters_in_model": len(pm.peft_config),
               "lora_mib": round(sum(q.numel() * q.element_size() for q in M.lora_params(pm)) / 2**20)}
        if p.family == "fast":
            got["fallback"] = len(hold["fallback"])
            got.update(_save_load(ctx, pm, names, fresh))
        return got

    return Step(fast if p.family == "fast" else peft_loop, hold.clear, check, info,
                setup=fresh, iters=3 if small else 1)


def _save_load(ctx, pm, names, fresh) -> dict:
    """Seconds of ``fast_multilora.save_adapters(pm, folder, names)`` and of ``load_adapters`` of the saved folders
    into a fresh model, and whether the loaded weights equal the saved ones (every LoRA tensor of the first and last
    adapter); skipped when the temporary disk lacks twice the adapters' size."""
    import shutil
    import tempfile

    import harness
    import torch

    import fast_multilora

    size = sum(q.numel() * q.element_size() for q in M.lora_params(pm)) * len(names) // (len(names) + 1)
    with tempfile.TemporaryDirectory() as folder:
        free = shutil.disk_usage(folder).free
        if free < 2 * size:
            return {"save_load": f"skipped: {free / 2**30:.1f} GiB free in {folder}, the adapters take "
                                 f"{size / 2**30:.1f} GiB"}
        want = {k: v.detach().cpu() for k, v in pm.state_dict().items()
                if "lora_" in k and any(f".{a}." in k for a in (names[0], names[-1]))}
        save_s = harness.wall_s(lambda: fast_multilora.save_adapters(pm, folder, names), ctx.device)
        pm2, _ = fresh()
        load_s = harness.wall_s(lambda: fast_multilora.load_adapters(pm2, {a: f"{folder}/{a}" for a in names}),
                                ctx.device)
        state = pm2.state_dict()
        equal = bool(want) and all(torch.equal(state[k].cpu(), v) for k, v in want.items())
    return {"save_s": round(save_s, 3), "load_s": round(load_s, 3), "saved_mib": round(size / 2**20),
            "loaded_equal_created": equal}


# -- adapter churn -----------------------------------------------------------------------------------------------------

def _churn(ctx, p: Provider, variant: str) -> Step:
    """A PeftModel of ``n`` adapters (``M.CHURN_MODEL``, ``M.CHURN_LORA``) on which rounds of: a training step of 8
    adapters, one adapter added, the step that trains it with 7 of the others, the adapter deleted, the next step.
    ``fast``: ``fast_multilora.add_adapters`` and ``fast_multilora.delete_adapters`` on the patched model, steps with
    ``p.optimizer`` (``fast_multilora.AdamW`` follows adds and deletes by itself); ``peft_add_adapter``: stock PEFT's
    ``add_adapter`` and ``delete_adapter`` on the unpatched model (no steps: stock PEFT trains no mixed batch).
    Adapters are created in the base's dtype (``autocast_adapter_dtype=False``), as the registry's others."""
    import harness
    from peft import get_peft_model

    import fast_multilora

    n = ctx.batch(variant)["adapters"]
    ctx.free()
    cfg = M.CHURN_LORA
    pm = get_peft_model(M.llama(ctx.sizes, ctx.device, ctx.dtype, M.CHURN_MODEL), M.lora_config(**cfg),
                        adapter_name="a0", autocast_adapter_dtype=False)
    fast_multilora.add_adapters(pm, {f"a{i}": M.lora_config(**cfg) for i in range(1, n)}, autocast_adapter_dtype=False)
    M.all_lora_trainable(pm)
    pm.train()
    ids = M.token_ids(*M.CHURN_TOKENS, M.CHURN_MODEL["vocab_size"], ctx.device)
    batch = [f"a{i}" for i in range(M.CHURN_TOKENS[0])]
    fast = p.family == "fast"
    info = {"registered": n, "add": "fast_multilora.add_adapters(model, {name: LoraConfig})" if fast
            else "model.add_adapter(name, LoraConfig)",
            "delete": "fast_multilora.delete_adapters(model, [name])" if fast else "model.delete_adapter(name)"}
    hold = {"pm": pm}
    if fast:
        info["patch"] = _patch(ctx, pm, p)
        info["optimizer"] = OPTIMIZERS[p.optimizer]
        hold["opt"] = opt = optimizer(p.optimizer, pm)

    def step(names):
        out = pm(input_ids=ids, adapter_names=names).logits
        fast_multilora.per_adapter_loss(out, ids, names).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def add(name):
        if fast:
            fast_multilora.add_adapters(pm, {name: M.lora_config(**cfg)}, autocast_adapter_dtype=False)
        else:
            pm.add_adapter(name, M.lora_config(**cfg), autocast_adapter_dtype=False)

    def delete(name):
        if fast:
            fast_multilora.delete_adapters(pm, [name])
        else:
            pm.delete_adapter(name)

    def wall_ms(fn):
        return harness.wall_s(fn, ctx.device) * 1e3

    def timed():
        if fast:
            for _ in range(2):
                step(batch)
        got = {k: [] for k in (("step", "add", "add_step", "delete", "delete_step") if fast else ("add", "delete"))}
        trained = []
        for rep in range(ctx.sizes.churn_reps):
            new = f"z{rep}"
            if fast:
                got["step"].append(wall_ms(lambda: step(batch)))
            got["add"].append(wall_ms(lambda new=new: add(new)))
            if fast:
                for q in M.lora_params(pm, new):
                    q.requires_grad_(True)
                before = [q.detach().clone() for q in M.lora_params(pm, new)]
                got["add_step"].append(wall_ms(lambda new=new: step(batch[:-1] + [new])))
                after = M.lora_params(pm, new)
                trained.append(len(after) == len(before) > 0
                               and all(not ctx.torch.equal(a, q) for a, q in zip(before, after, strict=True)))
            got["delete"].append(wall_ms(lambda new=new: delete(new)))
            if fast:
                got["delete_step"].append(wall_ms(lambda: step(batch)))
        med = {f"{k}_ms": statistics.median(v) for k, v in got.items()}
        hold["trained"] = trained
        return {"wall_ms": med["add_ms"], "host_ms": med["add_ms"] if ctx.device != "cuda" else None,
                "iters": ctx.sizes.churn_reps, **{k: round(v, 3) for k, v in med.items()}}

    def check():
        out = {"adapters_after": len(pm.peft_config),
               "churned_left": sorted(a for a in pm.peft_config if a.startswith("z"))}
        if fast:  # each added adapter trained by the step after its add (its A and B moved)
            out["added_adapters_trained"] = f"{sum(hold['trained'])}/{len(hold['trained'])}"
        return out

    def teardown():
        if fast:
            _unpatch(pm)
        hold.clear()

    return Step(lambda: None, teardown, check, info, timed=timed)


# -- paging ------------------------------------------------------------------------------------------------------------

def _paged(ctx, p: Provider, variant: str) -> Step:
    """Training steps on a PEFT model of ``n`` registered adapters, ``m`` of them per step, a different set each step
    (the registry's consecutive slices of ``m``, in turn), HF ``labels=`` loss. Fully resident
    (``fast_multilora_fused_adamw``, ``fast_multilora``) or paged (``p.patch``'s ``resident_adapters``), with the
    provider's optimizer (``torch.optim.AdamW(fused=True)``, or its defaults). The check runs one more step and
    records the adapters that got gradients and, paged, how many adapters are paged out after it."""
    import fast_multilora

    b = ctx.batch(variant)
    n, m, ids = b["adapters"], b["per_step"], b["ids"]
    pm = ctx.peft(n)
    M.all_lora_trainable(pm)
    pm.train()
    sets = [[f"a{i}" for i in range(s, s + m)] for s in range(0, n - m + 1, m)]
    route = {k: b[k] for k in ("adapter_ids", "position_ids") if k in b}
    if route:
        route["use_cache"] = False
    info = {"patch": _patch(ctx, pm, p), "optimizer": OPTIMIZERS[p.optimizer], "registered": n, "per_step": m,
            "sets": len(sets), "prefetch": p.prefetch,
            "lora_mib_per_adapter": round(sum(q.numel() * q.element_size() for q in M.lora_params(pm, "a0")) / 2**20,
                                          2)}
    hold = {"opt": optimizer(p.optimizer, pm), "i": 0}

    def names_of(i):
        pick = sets[i % len(sets)]
        return pick if route else M.interleaved(m, len(ids), pick=pick)

    def step():
        i = hold["i"]
        names = names_of(i)
        loss = pm(input_ids=ids, labels=ids, adapter_names=names, **route).loss
        if p.prefetch:
            fast_multilora.prefetch(pm, sets[(i + 1) % len(sets)])
        loss.backward()
        hold["grads"] = M.adapters_with_grads(pm, sets[i % len(sets)]) if hold.get("count") else None
        hold["opt"].step()
        hold["opt"].zero_grad(set_to_none=True)
        hold["i"] = i + 1

    # one full cycle of the sets, untimed, before the row's own warm-up: each adapter's first page-out allocates its
    # pinned host page (weights, and its optimizer states once it has stepped: page-locking ~1 GiB a step at 1024/64),
    # a cost of the first cycle only; the row times the steady state and records the cycle's steps apart
    sync = ctx.torch.cuda.synchronize if ctx.device == "cuda" else (lambda: None)
    first = []
    for _ in range(len(sets)):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        first.append((time.perf_counter() - t0) * 1e3)
    info["first_cycle_ms"] = {"median": round(statistics.median(first), 1), "max": round(max(first), 1),
                              "steps": len(first)}

    def check():
        hold["count"] = True
        step()
        out = {"adapters_in_batch": m, "adapters_with_grads": hold["grads"], "steps": hold["i"]}
        pager = fast_multilora.paging._router(pm).pager
        out["paged_out_after_step"] = 0 if pager is None else len(pager.absent)
        return out

    def teardown():
        hold.clear()
        _unpatch(pm)

    return Step(step, teardown, check, info)
