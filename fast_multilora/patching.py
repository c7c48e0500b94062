"""``patch`` / ``unpatch``: run a PEFT model's LoRA Linear layers through the mixed-batch Function.

Patching swaps each LoRA layer's class for a subclass of the same name (so ``repr``, ``isinstance`` and every PEFT
method behave as before) whose ``forward`` routes mixed batches. Parameters, buffers and module objects are not
touched, so ``state_dict``, optimizers, ``save_pretrained`` and ``PeftModel.from_pretrained`` are unaffected.

* ``peft.tuners.lora.Linear`` (vanilla LoRA adapters, incl. rsLoRA, ``lora_bias``, ``fan_in_fan_out`` Conv1D bases):
  the delta runs on our backends.
* Every other LoRA layer (Embedding, Conv, quantized layers, ...) and PEFT's auxiliary wrappers
  (``modules_to_save``, trainable tokens): PEFT's own per-sample mixed-batch loop, which we call in training too.
  Listed in the report's ``fallback``.
* Adapters with a LoRA variant (DoRA, aLoRA, ...): a mixed batch that names them raises (PEFT does not mix DoRA
  adapters in a batch either); without ``adapter_names`` PEFT's forward runs as usual.
* Sibling LoRA Linear layers called on one input (q/k/v, gate/up) share one shrink pass (``fast_multilora.stacked``);
  ``patch(..., share_shrink=False)`` turns that off.
"""

from __future__ import annotations

import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from torch.nn.modules import module as _nn_module  # its global forward hooks are read per call

from . import stacked
from .function import DeltaSpec, FusedLinearDelta, LoraDelta, get_backend, lora_dropout_rate, own_storage, run
from .kernels.segments import AdapterTable
from .plan import BASE, Router

_ROUTER_ATTR = "_fml_router"
_HOOKS_ATTR = "_fml_hooks"


@dataclass
class PatchReport:
    """What :func:`patch` did: modules on our kernels, modules left on PEFT's path and why, and the sibling groups
    (``shared``, tuples of names) whose members share one shrink pass when called on the same input."""

    backend: str
    patched: list = field(default_factory=list)
    fallback: dict = field(default_factory=dict)
    shared: list = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fast_multilora: {len(self.patched)} LoRA Linear module(s) patched (backend={self.backend!r})"]
        if self.shared:
            lines.append(f"{len(self.shared)} sibling group(s) share one shrink pass among members called on the same "
                         "input, e.g.:")
            lines += [f"  {', '.join(group)}" for group in self.shared[:3]]
        if self.fallback:
            lines.append(f"{len(self.fallback)} module(s) run PEFT's own mixed-batch path:")
            lines += [f"  {name}: {why}" for name, why in self.fallback.items()]
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# layer mixins


def _routing(module, kwargs):
    """The active routing for this call: PEFT's injected ``adapter_names`` kwarg first, else the model's router."""
    router: Router = module.__dict__.get(_ROUTER_ATTR)
    names = kwargs.pop("adapter_names", None)
    if router is None:
        return None, names
    if names is not None:
        return router.routing_for_names(names), None
    return router.current, None


class _FastLinearMixin:
    """Mixed-batch forward for ``peft.tuners.lora.Linear``."""

    def forward(self, x, *args, **kwargs):
        routing, names = _routing(self, kwargs)
        if routing is None:
            if names is not None:
                kwargs["adapter_names"] = names
            return super().forward(x, *args, **kwargs)
        if self.disable_adapters:  # PEFT: disabled adapters ignore adapter_names
            if self.merged:
                self.unmerge()
            return self.base_layer(x, *args, **kwargs)
        if self.merged:
            raise ValueError(
                "Cannot pass `adapter_names` when there are merged adapters, please call `unmerge_adapter` first."
            )
        router: Router = self.__dict__[_ROUTER_ATTR]
        plan = router.plan_for(routing, x)
        table, present, bias_row = _layer_table(self, plan, x.device)
        share = stacked.may_share(self, x, table, present, router)  # records the call: always first
        base = _fused_base(self, x, args, kwargs, present, router)
        if base is not None:  # the base GEMM runs inside our Function, after the delta's expand wrote y
            out = stacked.shared_delta(self, x, None, plan, table, present, router, base) if share else None
            if out is not None:
                return out
            x_d, spec, weights = _delta_inputs(self, x, plan, table, present, bias_row, router)
            return run(FusedLinearDelta, x_d, base.weight, base.bias, spec, *weights)
        result = self.base_layer(x, *args, **kwargs)
        if share:
            out = stacked.shared_delta(self, x, result, plan, table, present, router)
            if out is not None:
                return out
        if not present:
            return result
        return _apply_delta(self, x, result, plan, table, present, bias_row, router)


def _layer_table(layer, plan, device):
    """Per-slot ranks/offsets/scales/dropout for this layer, cached until the layer's adapters change."""
    used = [plan.slot_names[s] for s in sorted(plan.used_slots)]
    for name in used:
        if name in layer.lora_variant:
            kind = type(layer.lora_variant[name]).__name__
            peft_msg = "Cannot pass `adapter_names` when DoRA is enabled. " if "Dora" in kind else ""  # PEFT's words
            raise ValueError(
                f"{peft_msg}adapter {name!r} uses a LoRA variant ({kind}) in module {type(layer.base_layer).__name__}; "
                "mixed batches run vanilla LoRA adapters only (PEFT does not mix DoRA adapters in a batch either)"
            )
    # everything the table depends on, read through the module dicts (no nn.Module.__getattr__: this runs per call)
    mods = layer._modules
    a_mods, b_mods, drops = mods["lora_A"]._modules, mods["lora_B"]._modules, mods["lora_dropout"]._modules
    r, scaling, lora_bias = layer.r, layer.scaling, layer.lora_bias
    sig = (
        plan.slot_names,
        device,
        layer.training,
        tuple((n, a, b_mods[n], r[n], scaling[n], drops[n].__dict__.get("p", 0.0), drops[n].training, lora_bias[n])
              for n, a in a_mods.items()),
    )
    cache = layer.__dict__.get("_fml_table")
    if cache is not None and cache[0] == sig:
        return cache[1], cache[2], cache[3]
    ranks, scales, ps, present, slots = [], [], [], [], []
    for slot, name in enumerate(plan.slot_names):
        if name in layer.lora_A and name not in layer.lora_variant:
            slots.append(slot)
            ranks.append(layer.r[name])
            scales.append(float(layer.scaling[name]))
            # the kernels draw the mask at 2^-16 resolution: the table holds the rate they draw exactly
            ps.append(lora_dropout_rate(layer.lora_dropout[name]))
            present.append(name)
        else:
            ranks.append(0)
            scales.append(0.0)
            ps.append(0.0)
    offsets, acc = [], 0
    for r in ranks:
        offsets.append(acc)
        acc += r
    host = torch.tensor([ranks, offsets], dtype=torch.int32)
    fl = torch.tensor([scales, ps], dtype=torch.float32)
    table = AdapterTable(
        ranks=host[0].to(device, non_blocking=True), offsets=host[1].to(device, non_blocking=True),
        scales=fl[0].to(device, non_blocking=True), dropout=fl[1].to(device, non_blocking=True),
        max_rank=max(ranks, default=0), total_rank=acc, has_dropout=any(p > 0 for p in ps), slots=tuple(slots),
    )
    # row of each slot among present adapters (for lora_bias), last row = none
    row = {n: i for i, n in enumerate(present)}
    bias_row = torch.tensor([row.get(n, len(present)) for n in plan.slot_names] + [len(present)], dtype=torch.int64)
    layer.__dict__["_fml_table"] = (sig, table, present, bias_row)
    return table, present, bias_row


def _fused_base(layer, x, args, kwargs, present, router):
    """The base ``nn.Linear`` when this call can run :class:`FusedLinearDelta` (base GEMM and LoRA delta in one
    Function), else ``None``: a plain, hook-free, frozen ``torch.nn.Linear`` of the input's dtype and device, eager
    mode without autocast, adapters without ``lora_bias`` whose dtype needs no input cast. Anything else runs the
    base layer itself and adds the delta (:class:`LoraDelta`)."""
    if not router.fuse_base or not present or args or kwargs:
        return None
    base = layer._modules["base_layer"]
    if type(base) is not torch.nn.Linear or "forward" in base.__dict__:  # accelerate hooks replace forward
        return None
    if base._forward_hooks or base._forward_pre_hooks or _nn_module._global_forward_hooks or \
            _nn_module._global_forward_pre_hooks:
        return None
    W, b = base._parameters["weight"], base._parameters.get("bias")
    if W.requires_grad or (b is not None and b.requires_grad) or type(W) is not torch.nn.Parameter:
        return None
    if x.dtype != W.dtype or x.device != W.device or (b is not None and b.dtype != W.dtype):
        return None
    if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
        return None
    if any(layer.lora_bias[n] for n in present):
        return None
    lora_dtype = layer._modules["lora_A"]._modules[present[0]]._parameters["weight"].dtype
    if x.dtype == torch.float32 and lora_dtype in (torch.float16, torch.bfloat16):
        return None  # PEFT feeds the adapters a cast input: the per-module path does the same
    return base


def _apply_delta(layer, x, result, plan, table, present, bias_row, router):
    x, spec, weights = _delta_inputs(layer, x, plan, table, present, bias_row, router)
    return run(LoraDelta, x, own_storage(result), spec, *weights)  # the delta is added in place


def _delta_inputs(layer, x, plan, table, present, bias_row, router):
    """``(x, spec, weights)`` for the delta Functions: the input (cast as PEFT casts it), the :class:`DeltaSpec`
    and the present adapters' A, B (and lora_bias) weights."""
    a_mods, b_mods = layer._modules["lora_A"]._modules, layer._modules["lora_B"]._modules
    weights = [a_mods[n]._parameters["weight"] for n in present] + [b_mods[n]._parameters["weight"] for n in present]
    lora_w = weights[0]
    if x.device != lora_w.device:
        raise ValueError(
            f"input is on {x.device} but the LoRA weights of this layer are on {lora_w.device}; move the batch to "
            "the model's device"
        )
    lora_dtype = lora_w.dtype
    if x.dtype == torch.float32 and lora_dtype in (torch.float16, torch.bfloat16):
        # PEFT casts the input to the adapter dtype; with adapters of several dtypes in the layer keep fp32 (the
        # weights are concatenated in the promoted dtype), so fp32 adapters are not fed a 16-bit input
        if all(w.dtype == lora_dtype for w in weights[: len(present)]):
            x = x.to(lora_dtype)
    backend = get_backend(router.backend, x.device)
    seed = None
    if table.has_dropout:
        seed = int(torch.randint(0, 2**31 - 1, (1,)))  # CPU RNG: no device sync; restored by checkpoint recompute
    has_bias = any(layer.lora_bias[n] for n in present)
    bias_slots = None
    if has_bias:
        for n in present:
            if layer.lora_B[n].bias is None:
                raise ValueError(f"adapter {n!r}: mixed lora_bias settings in one layer are not supported")
        weights += [layer.lora_B[n].bias for n in present]
        # slot -1 (base) indexes the trailing "none" row
        bias_slots = bias_row[plan.token_slots].to(x.device, non_blocking=True)
    spec = DeltaSpec(
        segs=plan.segments, table=table, backend=backend, seed=seed, num_adapters=len(present),
        ranks=tuple(w.shape[0] for w in weights[: len(present)]), has_bias=has_bias, bias_slots=bias_slots,
        grad=torch.is_grad_enabled(),
    )
    return x, spec, weights


class _FallbackMixin:
    """PEFT's own per-sample mixed-batch loop for layers we do not run (it works in training at layer level)."""

    def forward(self, *args, **kwargs):
        routing, names = _routing(self, kwargs)
        if routing is not None:
            x = args[0] if args else next(iter(kwargs.values()))
            names = routing.row_names(x)
        if names is not None:
            kwargs["adapter_names"] = names
        return super().forward(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------------------
# class swapping

_SUBCLASSES: dict = {}


def _patched_class(cls, mixin):
    key = (cls, mixin)
    sub = _SUBCLASSES.get(key)
    if sub is None:
        attr = f"_Fast_{cls.__module__.replace('.', '_')}_{cls.__qualname__.replace('.', '_')}"
        # same __name__ as PEFT's class so repr() is unchanged; importable __qualname__ so pickling works
        sub = type(cls.__name__, (mixin, cls), {"__module__": __name__, "__qualname__": attr, "_fml_base": cls})
        setattr(sys.modules[__name__], attr, sub)
        _SUBCLASSES[key] = sub
    return sub


def _is_patched(module) -> bool:
    return "_fml_base" in type(module).__dict__


def _original_class(module):
    return type(module)._fml_base if _is_patched(module) else type(module)


def _fallback_reason(module):
    """``None`` when our Function runs this LoRA layer, else why PEFT's path does."""
    cls = _original_class(module)
    if cls is not LoraLinear:
        return f"{cls.__module__}.{cls.__qualname__} is not peft.tuners.lora.Linear"
    base = module.get_base_layer()
    if not isinstance(base, torch.nn.Linear) and type(base).__name__ != "Conv1D":
        return f"base layer {type(base).__name__} is not nn.Linear/Conv1D"
    return None


def _aux_wrapper_types():
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # pragma: no cover - older PEFT
        return ()
    return (AuxiliaryTrainingWrapper,)


def patch(model: torch.nn.Module, backend: str = "auto", family: str = "auto",
          share_shrink: bool = True, fuse_base: bool = True, share_dropout: bool = False) -> PatchReport:
    """Run ``model``'s PEFT LoRA Linear layers through fast_multilora; returns a :class:`PatchReport`.

    ``model``: a ``PeftModel``, a ``LoraModel`` or any module tree holding PEFT LoRA layers. After patching,
    ``model(**batch, adapter_names=[...])`` (one name per sample, ``"__base__"`` for none) works in training and
    eval; packed rows pass ``adapter_ids`` (``[batch, seq]`` indices into ``adapter_names``, -1 = base).
    ``backend``: ``"torch"``, ``"triton"`` or ``"auto"`` (Triton for CUDA tensors, torch otherwise).
    ``family``: kernel family, ``"sgemm"``, ``"chunked"`` or ``"auto"`` (by batch layout). Patching twice updates
    the settings and patches layers added since.
    ``share_shrink``: siblings (same parent module, ``in_features`` and device) called on the same input share one
    shrink pass where their adapters allow (see ``fast_multilora.stacked``; the report lists the groups).
    ``fuse_base``: a layer whose base is a plain frozen ``nn.Linear`` runs base GEMM and LoRA delta in one Function
    (``function.FusedLinearDelta``: the delta written first, cuBLAS accumulating the GEMM into it, the same for
    ``dx`` in backward; stacked siblings likewise, ``stacked.StackedLinear``).
    ``share_dropout``: siblings under active LoRA dropout share their shrink too, each slice drawing its own mask
    (as PEFT's separate dropout modules); off by default, as it measured slower than one shrink per sibling on an
    H200 (``docs/benchmarks.md``).
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown backend {backend!r}; expected 'auto', 'torch' or 'triton'")
    if family not in ("auto", "sgemm", "chunked"):
        raise ValueError(f"unknown family {family!r}; expected 'auto', 'sgemm' or 'chunked'")
    router = model.__dict__.get(_ROUTER_ATTR)
    if router is None and not any(isinstance(m, LoraLayer) for m in model.modules()):
        # e.g. a PeftModel of another tuner (RoAd, IA3, ...): routing would take its adapter_names away from PEFT
        warnings.warn(
            f"fast_multilora.patch: {type(model).__name__} has no PEFT LoRA layers; the model is left unpatched",
            stacklevel=2,
        )
        return PatchReport(backend=backend)
    if router is None:
        router = Router(model)
        model.__dict__[_ROUTER_ATTR] = router
        hooks = [model.register_forward_pre_hook(_model_pre_hook, with_kwargs=True)]
        tuner = _lora_tuner(model)
        if tuner is not None:
            # PeftModel.forward/generate hand adapter_names to the tuner's _enable_peft_forward_hooks, which raises
            # in training mode; ours routes them instead (shadowing the method on this instance only)
            tuner.__dict__["_enable_peft_forward_hooks"] = partial(_enable_routing, router)
            hooks.append(_InstanceAttr(tuner, "_enable_peft_forward_hooks"))
        model.__dict__[_HOOKS_ATTR] = hooks
    router.backend = backend
    router.family = family
    router.share_shrink = share_shrink
    router.share_dropout = share_dropout
    router.fuse_base = fuse_base
    router.tuner = _lora_tuner(model)
    router.config_key = tuple(sorted(getattr(router.tuner, "peft_config", {}).keys()))
    router.repatch = partial(_repatch, model)
    router.layers = []
    report = PatchReport(backend=backend)
    aux = _aux_wrapper_types()
    variant_warned = []
    fast = []  # (name, module) on our Function
    for name, module in model.named_modules():
        if module is model:
            continue
        if isinstance(module, LoraLayer):
            router.layers.append(module)
            reason = _fallback_reason(module)
            if reason is None:
                _swap(module, _FastLinearMixin, router)
                report.patched.append(name)
                fast.append((name, module))
                variants = sorted(module.lora_variant)
                if variants:
                    variant_warned.append(f"{name}: {variants}")
            else:
                _swap(module, _FallbackMixin, router)
                report.fallback[name] = reason
        elif aux and isinstance(module, aux):
            _swap(module, _FallbackMixin, router)
            report.fallback[name] = f"{type(module).__name__}: PEFT's per-sample loop"
    if share_shrink:
        report.shared = stacked.group_siblings(fast, _layer_table)
    if report.fallback:
        warnings.warn(
            f"fast_multilora.patch: {len(report.fallback)} module(s) run PEFT's per-sample mixed-batch loop instead "
            f"of our kernels (see the returned report), e.g. {next(iter(report.fallback.items()))}",
            stacklevel=2,
        )
    if variant_warned:
        warnings.warn(
            "fast_multilora.patch: adapters with LoRA variants (e.g. DoRA) cannot be mixed in a batch; naming them "
            f"in adapter_names raises: {variant_warned[:3]}",
            stacklevel=2,
        )
    return report


def _swap(module, mixin, router):
    module.__class__ = _patched_class(_original_class(module), mixin)
    module.__dict__[_ROUTER_ATTR] = router
    module.__dict__.pop("_fml_table", None)
    module.__dict__.pop(stacked.GROUP_ATTR, None)


def unpatch(model: torch.nn.Module) -> None:
    """Restore stock PEFT behaviour: original classes, no hooks, no routing state."""
    for module in model.modules():
        if _is_patched(module):
            module.__class__ = type(module)._fml_base
        module.__dict__.pop(_ROUTER_ATTR, None)
        module.__dict__.pop("_fml_table", None)
        module.__dict__.pop(stacked.GROUP_ATTR, None)
    for h in model.__dict__.pop(_HOOKS_ATTR, []):
        h.remove()
    model.__dict__.pop(_ROUTER_ATTR, None)


class _InstanceAttr:
    """A removable instance attribute (so ``unpatch`` can treat it like a hook handle)."""

    def __init__(self, obj, name):
        self.obj, self.name = obj, name

    def remove(self):
        self.obj.__dict__.pop(self.name, None)


def _repatch(model):
    router: Router = model.__dict__[_ROUTER_ATTR]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first patch() already warned about fallbacks
        patch(model, backend=router.backend, family=router.family, share_shrink=router.share_shrink,
              fuse_base=router.fuse_base, share_dropout=router.share_dropout)


def _lora_tuner(model):
    """The PEFT tuner (``LoraModel``) of a ``PeftModel`` or the model itself, else ``None``."""
    from peft.tuners.tuners_utils import BaseTuner

    if isinstance(model, BaseTuner):
        return model
    base = getattr(model, "base_model", None)
    return base if isinstance(base, BaseTuner) else None


def _is_peft_model(model) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


def _model_pre_hook(model, args, kwargs):
    router: Router = model.__dict__[_ROUTER_ATTR]
    ids = kwargs.pop("adapter_ids", None)
    if _is_peft_model(model):
        # PeftModel.forward passes adapter_names on to the tuner's hook context (ours, see patch()); it skips that
        # context while adapters are disabled, so start from "no routing" here
        router.begin(None)
        if ids is not None and kwargs.get("adapter_names") is None:
            raise ValueError("`adapter_ids` needs `adapter_names` (the names its values index)")
        router.pending_ids = ids
        return args, kwargs
    router.begin(kwargs.pop("adapter_names", None), ids)
    return args, kwargs


@contextmanager
def _enable_routing(router: Router, *args, **kwargs):
    names = kwargs.pop("adapter_names", None)
    ids = kwargs.pop("adapter_ids", None)
    if ids is None:
        ids, router.pending_ids = router.pending_ids, None
    if kwargs.get("alora_offsets") is not None:
        if names is not None or ids is not None:
            raise ValueError("fast_multilora does not route aLoRA (`alora_offsets`) in a mixed batch; call the model "
                             "without `adapter_names` for aLoRA (PEFT's own path)")
        router.begin(None)  # no routing: PEFT's aLoRA hooks, as on a stock model
        tuner = router.tuner
        with type(tuner)._enable_peft_forward_hooks(tuner, *args, **kwargs):
            yield
        return
    router.begin(names, ids)
    yield


class route:
    """Context manager routing calls that bypass the patched model's own forward (e.g. calling a submodule)::

        with fast_multilora.route(model, adapter_names):
            out = model.base_model.model(input_ids)
    """

    def __init__(self, model, adapter_names, adapter_ids=None):
        self.router: Router = model.__dict__.get(_ROUTER_ATTR)
        if self.router is None:
            raise ValueError("fast_multilora.route: the model is not patched; call fast_multilora.patch(model) first")
        self.names, self.ids = adapter_names, adapter_ids

    def __enter__(self):
        self.router.begin(self.names, self.ids)
        return self

    def __exit__(self, *exc):
        self.router.begin(None)
        return False


__all__ = ["PatchReport", "patch", "unpatch", "route", "BASE"]
