"""Many LoRA adapters at once: create, load and save them in time linear in their number.

PEFT's ``add_adapter`` re-walks the whole model on every call and touches every adapter already present -- the
layer's ``set_adapter`` and ``_move_adapter_to_device_of_base_layer`` iterate all adapters of the layer,
``inject_adapter`` snapshots every parameter's ``requires_grad``, re-runs ``set_adapter`` and
``_mark_only_adapters_as_trainable`` over the model, ``cast_adapter_dtype`` walks every module: a loop of
``add_adapter`` is quadratic in the number of adapters (256 adapters of an 8-layer model: 350 s). ``load_adapter``
and ``save_pretrained`` do the same per adapter through ``model.state_dict()`` and ``load_state_dict`` of the whole
model.

:func:`add_adapters` walks the model once, then for every adapter in order (so the RNG draws come in the loop's order)
and every module it targets calls PEFT's own ``_create_and_replace`` -> ``update_layer`` (PEFT's init, every
``init_lora_weights`` variant, DoRA), with the layer's per-adapter module containers holding only the new adapter
during that call -- or, for a plain config on a ``lora.Linear`` (PEFT 0.21, 0.22), makes what that ``update_layer``
makes directly (the same RNG draws in order, the same entries; no module constructors: ``_Segment._plain_update``) --
and runs PEFT's model-wide bookkeeping (``set_adapter``, ``_mark_only_adapters_as_trainable``) once, with Python's
cyclic garbage collector paused (its collections over the model's many objects were a third of the time).
The model ends as the loop leaves it. Configs it does not take are added by PEFT's ``add_adapter`` in their place in
the order (:data:`FALLBACK` lists why). :func:`load_adapters` and :func:`save_adapters` do the key mapping of PEFT's
``set_peft_model_state_dict`` / ``get_peft_model_state_dict`` from one pass over the model's state dict.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import re
import warnings
from contextlib import contextmanager
from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from .plan import BASE, mark_changed

# The per-adapter module containers of a LoRA layer that PEFT's update_layer iterates in full
# (_move_adapter_to_device_of_base_layer: ``.parameters()`` of the container; set_adapter: every adapter's
# requires_grad). While a new adapter is set up they hold only it (_only_adapter). ``lora_magnitude_vector`` stays:
# DoRA's init tests whether it is empty.
_HIDDEN = ("lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B")
# Last name components of the modules a LoRA layer creates (besides the adapter names): see _minimal_targets.
_INTERNAL = frozenset(_HIDDEN + ("base_layer", "lora_magnitude_vector"))

# Why a config takes PEFT's own add_adapter instead of the one-walk route (each is linear per config except where
# PEFT's own call is not).
FALLBACK = {
    "class": "the PeftModel class overrides add_adapter (task-specific models add classifier modules_to_save)",
    "target_parameters": "target_parameters (MoE ParamWrapper nesting) is set up by PEFT's _inject_parameters",
    "layer_replication": "layer_replication changes the model's structure before injection",
    "aux": "modules_to_save / trainable_token_indices add auxiliary wrappers (PEFT's set_additional_trainable_modules)",
    "variant": "a LoRA variant other than DoRA (its init may read the layer's other adapters)",
    "custom": "custom LoRA module classes registered on the config",
    "first": "the model holds no LoRA layer yet (PEFT's first injection freezes the base model instead)",
    "name": "the adapter name is also a component of a parameter name of the model (PEFT then leaves those "
            "parameters' requires_grad as its bookkeeping sets it, not as they were)",
    "active": "the adapter name is among the active adapters",
    "meta": "the model holds parameters on the meta device",
}


def _peft():
    """PEFT's classes used here."""
    from peft import LoraConfig, PeftModel
    from peft.tuners.lora import LoraLayer, LoraModel

    return LoraConfig, PeftModel, LoraLayer, LoraModel


def _tuner_of(model):
    LoraConfig, PeftModel, LoraLayer, LoraModel = _peft()
    if not isinstance(model, PeftModel):
        raise TypeError(
            f"fast_multilora: expected a peft.PeftModel holding LoRA adapters, got {type(model).__name__}; build one "
            "with peft.get_peft_model(base_model, LoraConfig(...))"
        )
    tuner = model.base_model
    if not isinstance(tuner, LoraModel):
        raise TypeError(
            f"fast_multilora: the PeftModel's tuner is {type(tuner).__name__}, not LoraModel: only LoRA adapters are "
            "created, loaded and saved here"
        )
    return tuner


def _check_name(model, name, seen) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"fast_multilora: adapter names must be non-empty strings, got {name!r}")
    if "." in name:
        raise ValueError(f"fast_multilora: adapter name {name!r} contains '.', which PEFT's module dicts refuse; "
                         "rename it (e.g. with '_')")
    if name == BASE:
        raise ValueError(f"fast_multilora: {BASE!r} is the routing name for rows without an adapter; pick another "
                         "adapter name")
    if name in model.peft_config:
        raise ValueError(f"fast_multilora: adapter {name!r} already exists in the model (Adapter with name "
                         f"'{name}' already exists.); delete it first or pick another name")
    if name in seen:
        raise ValueError(f"fast_multilora: adapter name {name!r} is given twice")
    seen.add(name)


def _variants(cfg) -> tuple:
    """The LoRA variants a config asks for (as ``LoraLayer.resolve_lora_variant`` reads them)."""
    out = []
    for f in dataclasses.fields(cfg):
        if f.name == "init_lora_weights":
            out += [v for v in f.metadata.get("lora_variants", ()) if cfg.init_lora_weights == v]
        elif f.metadata.get("is_lora_variant") and getattr(cfg, f.name):
            out.append(f.name)
    return tuple(sorted(out))


def _config_fallback(model, cfg) -> Optional[str]:
    from peft import PeftModel

    if type(model).add_adapter is not PeftModel.add_adapter:
        return "class"
    if getattr(cfg, "target_parameters", None):
        return "target_parameters"
    if getattr(cfg, "layer_replication", None):
        return "layer_replication"
    if getattr(cfg, "modules_to_save", None) is not None or getattr(cfg, "trainable_token_indices", None) is not None:
        return "aux"
    if set(_variants(cfg)) - {"use_dora"}:
        return "variant"
    if getattr(cfg, "_custom_modules", None):
        return "custom"
    return None


def _check_configs(model, configs: Mapping) -> None:
    """Up-front checks of the whole batch, before the model is touched (PEFT raises these one adapter at a time)."""
    LoraConfig, *_ = _peft()
    if not isinstance(configs, Mapping):
        raise TypeError(f"fast_multilora.add_adapters: `configs` must map adapter names to LoraConfig, got "
                        f"{type(configs).__name__}")
    seen: set = set()
    for name, cfg in configs.items():
        _check_name(model, name, seen)
        if not isinstance(cfg, LoraConfig):
            raise TypeError(f"fast_multilora.add_adapters: adapter {name!r}: expected a peft.LoraConfig, got "
                            f"{type(cfg).__name__}")
        if cfg.peft_type != model.peft_type:
            raise ValueError(f"fast_multilora.add_adapters: adapter {name!r}: Cannot combine adapters with different "
                             f"peft types. Found {model.peft_type} and {cfg.peft_type}.")
    every = list(model.peft_config.values()) + list(configs.values())
    if sum(getattr(c, "bias", "none") != "none" for c in every) > 1:  # LoraModel._check_new_adapter_config
        raise ValueError("LoraModel supports only 1 adapter with bias. When using multiple adapters, set bias to "
                         "'none' for all adapters.")
    kasa = {getattr(c, "kasa_config", None) is not None for c in every}
    if len(kasa) > 1:
        raise ValueError("KaSA cannot be combined with adapters that don't use KaSA, since KaSA modifies the base "
                         "weights: mix of KaSA and non-KaSA adapters in fast_multilora.add_adapters")


def _match_key(value):
    """A hashable stand-in for a config field that target matching reads."""
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value))
    return value


def _match_signature(cfg) -> tuple:
    return tuple(_match_key(getattr(cfg, f, None)) for f in (
        "target_modules", "exclude_modules", "modules_to_save", "layers_to_transform", "layers_pattern",
        "target_parameters", "target_modules_to_tie"))


class _Segment:
    """One run of configs on the one-walk route: state shared by its configs."""

    def __init__(self, peft_model, tuner, autocast):
        self.peft_model, self.tuner, self.model, self.autocast = peft_model, tuner, tuner.model, autocast
        self.keys = []  # the model's module names at the start (named_modules order), LoRA layers' insides left out
        self.skip = set()  # names of LoRA layers present at the start (their subtrees are adapter internals)
        self.layers = []  # those LoRA layers
        self.aux = False  # the model holds auxiliary wrappers (modules_to_save, trainable tokens)
        self.wrapped_at: dict = {}  # module name -> index (in this segment) of the config whose call wrapped it
        self.wrapped_children = False  # a module wrapped here had submodules (their names move under base_layer)
        self.structure = 0  # bumped whenever a new LoRA layer replaces a module
        self.new_names: set = set()
        self.params = None  # (parameter, requires_grad) before the segment, PEFT's restore list: taken when needed
        self.components = set()  # name components (after the first) of the model's parameter names
        self.meta = False
        # a new adapter's tensors take its base layer's (float) dtype, else the default dtype: with none of the
        # dtypes cast_adapter_dtype upcasts among those, there is nothing to cast
        self.may_cast = autocast and torch.get_default_dtype() in _upcast_dtypes()
        self._walk()
        self._all_keys = None
        self.matches: dict = {}
        self.parents: dict = {}
        self.casts: list = []  # (LoRA layer, adapter name) made, in order
        self.cast_done: set = set()  # (id(LoRA layer), adapter name) made in their final dtype (_plain_update)
        from peft.tuners.lora import model as lora_model

        # no tensor parallelism: PEFT's _create_and_replace then only calls a present layer's update_layer
        self.direct = (not getattr(lora_model, "is_transformers_dtensor_tp", False)
                       or getattr(self.model, "_device_mesh", None) is None)
        self.model_config = tuner.get_model_config(self.model)
        self.all_linear = None  # (structure, names) of the last all-linear resolution
        self.targeted: list = []
        self.last_config = None
        self.configs: list = []  # names added in this segment, in order
        self._tied = None

    def _walk(self) -> None:
        """One walk of the model that does not enter the present adapters: the module names (``named_modules``
        order) outside the LoRA layers, and from the parameters' names, devices and dtypes (the base model's, and
        per adapter container of a LoRA layer its name, its adapters' names and its first entry's) the components,
        ``meta`` and ``may_cast``. The other adapters' entries are of the same kind; their count does not matter."""
        from peft.tuners.tuners_utils import BaseTunerLayer

        try:
            from peft.utils.other import AuxiliaryTrainingWrapper
        except ImportError:  # pragma: no cover - older PEFT
            AuxiliaryTrainingWrapper = ()  # noqa: N806
        upcast, autocast = _upcast_dtypes(), self.autocast

        def note(name, t, parameter=True):
            if parameter:
                self.components.update(name.split(".")[1:])
                self.meta = self.meta or t.device.type == "meta"
            self.may_cast = self.may_cast or (autocast and t.dtype in upcast)

        def whole(module, prefix):
            for n, p in module.named_parameters(prefix=prefix):
                note(n, p)
            for n, b in module.named_buffers(prefix=prefix):
                note(n, b, parameter=False)

        seen, stack, shape = set(), [("", self.model)], []
        while stack:
            key, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            self.keys.append(key)
            shape.append((key, type(module)))
            pre = key + "." if key else ""
            self.aux = self.aux or isinstance(module, AuxiliaryTrainingWrapper)
            for n, p in module._parameters.items():
                if p is not None:
                    note(pre + n, p)
            for n, b in module._buffers.items():
                if b is not None:
                    note(pre + n, b, parameter=False)
            if not isinstance(module, BaseTunerLayer):
                stack.extend((pre + n, c) for n, c in reversed(module._modules.items()) if c is not None)
                continue
            self.skip.add(key)
            self.layers.append(module)
            for attr, c in module._modules.items():
                if c is None:
                    continue
                if not isinstance(c, (nn.ModuleDict, nn.ParameterDict)) and type(c).__name__ != "BufferDict":
                    whole(c, pre + attr)  # the base layer, or another module shared by the adapters
                    continue
                first = next(iter(c._modules.items()), None)
                if first is not None:
                    whole(first[1], f"{pre}{attr}.{first[0]}")
                    if any(True for _ in first[1].parameters()):
                        self.components.update((attr, *c._modules))
                for n, p in list(c._parameters.items())[:1]:
                    note(f"{pre}{attr}.{n}", p)
                    self.components.update((attr, *c._parameters))
                for n, b in list(c._buffers.items())[:1]:
                    note(f"{pre}{attr}.{n}", b, parameter=False)
        self.structure_key = tuple(shape)

    def _of_structure(self, what: str, compute):
        """``compute()``, a function of the model's modules outside the adapters (walks of the whole model:
        transformers' weight-conversion mapping, the tied-embedding names), kept on the tuner for the next call while
        those modules (names and classes, :attr:`structure_key`) stay."""
        cache = self.tuner.__dict__.setdefault("_fml_structure_cache", {})
        hit = cache.get(what)
        if hit is None or hit[0] != self.structure_key:
            hit = cache[what] = (self.structure_key, compute())
        return hit[1]

    def snapshot(self) -> None:
        """PEFT's restore list: the ``requires_grad`` of every parameter present at the segment's start (those of the
        adapters made since are left out), taken before the model changes shape."""
        if self.params is None:
            made = {id(t) for layer, name in self.casts for t in _adapter_tensors(layer, name)}
            self.params = [(p, p.requires_grad) for p in self.model.parameters() if id(p) not in made]

    def fallback_reason(self, name) -> Optional[str]:
        if not self.skip:
            return "first"
        if self.meta:
            return "meta"
        if name in self.components:
            return "name"
        if name in self.tuner.active_adapters:
            return "active"
        return None

    # -- per config: PEFT's inject_adapter, one config at a time -------------------------------------------------
    def add(self, name, cfg) -> None:
        from peft.tuners.tuners_utils import _ExcludedModule, _maybe_include_all_linear_layers

        tuner, model = self.tuner, self.model
        index = len(self.configs)
        self.configs.append(name)
        self.peft_model.peft_config[name] = cfg  # PeftModel.add_adapter: before inject_adapter
        cfg = self._prepare(name, cfg)
        if isinstance(cfg.target_modules, str) and cfg.target_modules.lower() == "all-linear":
            if self.all_linear is not None and self.all_linear[0] == self.structure:
                cfg.target_modules = set(self.all_linear[1])  # what _maybe_include_all_linear_layers sets
            else:
                cfg = _maybe_include_all_linear_layers(cfg, model)
                self.all_linear = (self.structure, set(cfg.target_modules))
        self._minimal_targets(cfg)

        from peft.utils.constants import DUMMY_TARGET_MODULES

        if getattr(cfg, "target_modules", None) == DUMMY_TARGET_MODULES:  # PEFT matches nothing and raises nothing
            self.last_config = cfg
            self.new_names.add(name)
            return
        sig = _match_signature(cfg)
        cache = self.matches.setdefault(sig, {})
        excluded, unmatched, targets, to_tie = [], [], [], []
        for key in self.keys:
            if not key or self._internal(key, index):
                continue
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = (tuner._check_target_module_exists(cfg, key),
                                    tuner._check_tied_module_exists(cfg, key))
            result, tied = hit
            if tied:
                to_tie.append(key)
            elif isinstance(result, _ExcludedModule):
                excluded.append(key)
            elif not result:
                unmatched.append(key)
            else:
                targets.append(key)
        targets_all = targets + to_tie
        if not targets_all:
            _raise_no_match(cfg, excluded, unmatched)
        for key in targets_all:
            parent, target, target_name = self._submodules(key)
            tuner._check_target_module_compatiblity(cfg, model, target_name)
            self._create(cfg, name, key, parent, target, target_name, index)
        _warn_like_inject(cfg, excluded, targets_all)
        self.targeted.extend(targets_all)
        self.last_config = cfg
        self.new_names.add(name)

    def _prepare(self, name, cfg):
        """inject_adapter's preparation of the config (in place, as PEFT does)."""
        tuner, model = self.tuner, self.model
        from peft.import_utils import is_transformers_ge_v5

        if is_transformers_ge_v5 and hasattr(getattr(model, "config", None), "model_type"):
            from peft.utils.transformers_weight_conversion import (
                convert_peft_config_for_transformers,
                get_model_conversion_mapping,
            )

            if not hasattr(self, "_conversions"):
                self._conversions = self._of_structure("conversions", lambda: get_model_conversion_mapping(model))
            convert_peft_config_for_transformers(cfg, model=model, conversions=self._conversions)
        # _check_tied_modules reads the model's tied-embedding names, a walk over the whole model; they do not change
        # while LoRA layers are added (PEFT maps base_layer names back), so they are read once per segment.
        if self._tied is None:
            self._tied = self._of_structure("tied", tuner._get_module_names_tied_with_embedding)
        tuner.__dict__["_get_module_names_tied_with_embedding"] = lambda: list(self._tied)
        try:
            tuner._check_tied_modules(model, cfg)
        finally:
            del tuner.__dict__["_get_module_names_tied_with_embedding"]
        cfg = tuner._prepare_adapter_config(cfg, self.model_config)
        tuner._prepare_model(cfg, model)
        return cfg

    def _minimal_targets(self, cfg) -> None:
        """inject_adapter's condensing of a long target_modules list (as PEFT computes it from the module names the
        model has at that call: this segment's first names, unless a name created since could change the answer)."""
        from peft.tuners.tuners_utils import _find_minimal_target_modules
        from peft.utils.constants import MIN_TARGET_MODULES_FOR_OPTIMIZATION
        from peft.utils.peft_types import PeftType

        tm = cfg.target_modules
        if not (isinstance(tm, (list, set)) and len(tm) >= MIN_TARGET_MODULES_FOR_OPTIMIZATION
                and cfg.peft_type != PeftType.IA3):
            return
        internal = _INTERNAL | self.new_names
        if self.wrapped_children or any(t.rsplit(".", 1)[-1] in internal for t in tm):
            key_list = [k for k, _ in self.model.named_modules()]
        else:  # the names PEFT sees at this segment's start, the adapters' insides included
            if self._all_keys is None:
                self._all_keys = [k for k, _ in self.model.named_modules()]
            key_list = self._all_keys
        suffixes = tuple("." + s for s in tm)
        names_no_target = [n for n in key_list if (n not in tm) and not n.endswith(suffixes)]
        new = _find_minimal_target_modules(tm, names_no_target)
        if len(new) < len(tm):
            cfg.target_modules = new

    def _submodules(self, key):
        """PEFT's ``_get_submodules`` (parent, module, attribute name), the parent looked up once per name (a module
        is replaced in its parent, parents stay)."""
        parent = self.parents.get(key)
        if parent is None:
            from peft.tuners.tuners_utils import _get_submodules

            parent, target, target_name = _get_submodules(self.model, key)
            self.parents[key] = parent
            return parent, target, target_name
        target_name = key.rpartition(".")[2]
        return parent, parent._modules[target_name], target_name

    def _internal(self, key, index) -> bool:
        """Whether PEFT's call for the config at ``index`` skips ``key`` as an adapter internal: a descendant of a
        LoRA layer present when that call began."""
        head = key
        while True:
            head, dot, _ = head.rpartition(".")
            if not dot:
                return False
            if head in self.skip or self.wrapped_at.get(head, index) < index:
                return True

    def _create(self, cfg, name, key, parent, target, target_name, index) -> None:
        from peft.tuners.lora import LoraLayer, ParamWrapper

        tuner = self.tuner
        if isinstance(target, LoraLayer) and not isinstance(target, ParamWrapper):
            if self.direct and getattr(target.get_base_layer(), "_hf_tp_plan", None) is None:
                # LoraModel._create_and_replace on a LoRA layer, without tensor parallelism: r and alpha by
                # pattern, then the layer's update_layer (no tied weights for a present layer)
                from peft.utils.other import get_pattern_key

                r = cfg.rank_pattern.get(get_pattern_key(cfg.rank_pattern.keys(), key), cfg.r) \
                    if cfg.rank_pattern else cfg.r
                alpha = cfg.alpha_pattern.get(get_pattern_key(cfg.alpha_pattern.keys(), key), cfg.lora_alpha) \
                    if cfg.alpha_pattern else cfg.lora_alpha
                if not self._plain_update(target, name, r, alpha, cfg):
                    with _only_adapter(target):
                        target.update_layer(name, r, lora_alpha=alpha, target_name=key, config=cfg)
            else:
                with _only_adapter(target):
                    tuner._create_and_replace(cfg, name, target, target_name, parent, current_key=key)
            self.casts.append((target, name))
            return
        self.snapshot()  # a new LoRA layer freezes its base layer's parameters: PEFT's bookkeeping restores them
        tuner._create_and_replace(cfg, name, target, target_name, parent, current_key=key)
        new = parent._modules[target_name]
        self.casts.append((new, name))
        if new is not target and key not in self.wrapped_at and key not in self.skip:
            self.wrapped_at[key] = index
            self.structure += 1
            self.wrapped_children = self.wrapped_children or bool(target._modules)

    def _plain_update(self, layer, name, r, alpha, cfg) -> bool:
        """PEFT's ``LoraLayer.update_layer`` (the releases of ``_MIRRORED``) on a ``lora.Linear`` for a plain config
        (no variant, no ``lora_bias``, ``init_lora_weights`` True, False or "gaussian"), done directly: the same RNG
        draws in the same order (``nn.Linear``'s init of A and of B, then PEFT's reset of A), the same entries in the
        same containers, the adapter moved to its base layer's device and dtype, without ``update_layer``'s module
        constructions (~60 us each, four per call), its walks over the layer's containers and its ``set_adapter`` (the
        segment's bookkeeping sets the flags). False (nothing done) where it does not apply: the caller runs PEFT's
        own."""
        if r <= 0 or not _plain_config(layer, cfg) or hasattr(layer, "lora_arrow"):
            return False
        base = layer.get_base_layer()
        if isinstance(base, nn.MultiheadAttention) or getattr(base, "_hf_device_mesh", None) is not None:
            return False  # (tensor parallel: PEFT's update_layer broadcasts the new weights across the ranks)
        device, dtype = layer._get_base_layer_device_and_dtype(base)
        probe = torch.empty(0)
        if probe.device.type == "meta":  # (PEFT leaves adapters made on the meta device where they are)
            return False
        K, N = layer.in_features, layer.out_features
        init = cfg.init_lora_weights
        a_w, b_w = torch.empty((r, K)), None  # nn.Linear(K, r), nn.Linear(r, N): their inits
        if init is not False and _can_skip_draws():  # (their values are overwritten: the RNG only moves past them)
            _skip_draws(r * K + N * r)
        else:
            b_w = torch.empty((N, r))
            nn.init.kaiming_uniform_(a_w, a=math.sqrt(5))
            nn.init.kaiming_uniform_(b_w, a=math.sqrt(5))
        if init is True:  # PEFT's reset_lora_parameters (B zeros: made below in its final dtype and device)
            nn.init.kaiming_uniform_(a_w, a=math.sqrt(5))
        elif init is not False:  # "gaussian" (_plain_config)
            nn.init.normal_(a_w, std=1 / r)
        dtype_out, device_out, mid = a_w.dtype, a_w.device, None
        if device is not None:  # _move_adapter_to_device_of_base_layer
            mid = dtype if dtype is not None and (dtype.is_floating_point or dtype.is_complex) else None
            dtype_out = mid or dtype_out
            device_out = device
        if self.autocast and dtype_out in _upcast_dtypes():  # finish's cast_adapter_dtype, done here
            dtype_out = torch.float32
        # (moved first, then cast where it lands: on a GPU the two casts of PEFT's steps are two launches there, not
        # a host pass over every element; the values are the same, each cast rounding to nearest even)
        a_w = _through(a_w.to(device_out), mid, dtype_out)
        if init is False:
            b_w = _through(b_w.to(device_out), mid, dtype_out)
        else:
            b_w = torch.zeros((N, r), dtype=dtype_out, device=device_out)
        self.cast_done.add((id(layer), name))
        p = cfg.lora_dropout
        layer.r[name] = r
        layer.lora_alpha[name] = alpha
        layer.lora_dropout[name] = _fresh(("drop", p) if p > 0.0 else ("id",), None)
        layer.lora_A[name] = _fresh(("linear", K, r), nn.Parameter(a_w))
        layer.lora_B[name] = _fresh(("linear", r, N), nn.Parameter(b_w))
        layer.lora_bias[name] = False
        layer.scaling[name] = alpha / math.sqrt(r) if cfg.use_rslora else alpha / r
        layer.use_rslora[name] = cfg.use_rslora
        layer.use_dora[name] = cfg.use_dora
        return True

    # -- once per segment: inject_adapter's housekeeping ---------------------------------------------------------
    def finish(self) -> None:
        from peft.tuners.tuners_utils import _extend_unique

        if not self.configs:
            return
        tuner = self.tuner
        _extend_unique(tuner.targeted_module_names, self.targeted)
        if self.params is None and self._settled():
            self._set_adapter_on_new()
        else:
            self.snapshot()
            tuner.set_adapter(tuner.active_adapters, inference_mode=self.last_config.inference_mode)
            tuner._mark_only_adapters_as_trainable(self.model)
            for p, flag in self.params:  # adding an adapter does not change the trainability of present parameters
                p.requires_grad = flag
        # PeftModel.add_adapter's cast_adapter_dtype, after the bookkeeping as there (a cast ParameterDict entry is a
        # new Parameter, trainable), on each layer with its containers holding only the adapter cast; skipped where
        # there is nothing to cast
        if self.may_cast:
            from peft.tuners.tuners_utils import cast_adapter_dtype

            upcast, done = _upcast_dtypes(), self.cast_done
            for layer, name in self.casts:
                if (id(layer), name) in done or not any(p.dtype in upcast for p in _adapter_tensors(layer, name)):
                    continue
                with _only_adapter(layer, name):
                    cast_adapter_dtype(layer, adapter_name=name, autocast_adapter_dtype=True)


    def _settled(self) -> bool:
        """Whether PEFT's model-wide bookkeeping (``set_adapter`` of the active adapters on every LoRA layer,
        ``_mark_only_adapters_as_trainable``, then every present parameter's flag restored) would change only the new
        adapters' flags and the layers' active-adapter lists: no LoRA layer was created or is merged, no auxiliary
        wrapper, no active adapter trains biases (``bias="all"`` would make a new ``lora_B`` bias trainable)."""
        tuner = self.tuner
        if self.structure or self.aux or any(getattr(m, "merged", False) for m in self.layers):
            return False
        return all(getattr(tuner.peft_config.get(a), "bias", "none") == "none" for a in tuner.active_adapters)

    def _set_adapter_on_new(self) -> None:
        """What that bookkeeping leaves, done on the new adapters only: their parameters frozen (they are not active:
        ``set_adapter`` freezes every inactive adapter), every LoRA layer's and the tuner's active adapters set to the
        tuner's list (``set_adapter``'s assignment)."""
        from peft.utils.other import _set_layer_requires_grad

        tuner = self.tuner
        for layer, name in self.casts:
            for attr in layer.adapter_layer_names:
                container = getattr(layer, attr, None)
                if container is not None and name in container:
                    _set_layer_requires_grad(container[name], False)
        active = tuner.active_adapters
        names = [active] if isinstance(active, str) else active
        for layer in self.layers:
            if isinstance(layer, tuner.tuner_layer_cls):
                layer._active_adapter = names
        tuner.active_adapter = active


_PLAIN: dict = {}  # (LoRA layer class, id(config)) -> (config, whether _Segment._plain_update applies)
_TEMPLATES: dict = {}  # module kind -> a module on the meta device whose attributes a fresh one copies


# PEFT releases whose ``LoraLayer.update_layer`` ``_Segment._plain_update`` mirrors for a plain config (0.22 adds
# inits and a tensor-parallel sync that plain configs on a layer without a device mesh do not reach, and keeps
# ``requires_grad`` through the device move and the dtype cast, which the bookkeeping after them sets anyway;
# tests/test_adapters.py compares the whole state with PEFT's loop on each)
_MIRRORED = ("0.21.", "0.22.")


def _plain_config(layer, cfg) -> bool:
    """Whether ``_Segment._plain_update`` mirrors PEFT's ``update_layer`` of ``layer``'s class for ``cfg``: a PEFT
    release of ``_MIRRORED``, a ``lora.Linear`` with PEFT's own ``update_layer`` and device move, no LoRA variant
    (``resolve_lora_variant``), no ``lora_bias``, ``init_lora_weights`` True, False or "gaussian" (per layer class
    and config; the layer itself is checked by the caller)."""
    cls = type(layer)
    hit = _PLAIN.get((cls, id(cfg)))
    if hit is not None and hit[0] is cfg:
        return hit[1]
    import peft
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear
    from peft.tuners.tuners_utils import BaseTunerLayer

    init = cfg.init_lora_weights
    ok = (peft.__version__.startswith(_MIRRORED) and cls is Linear and cls.update_layer is LoraLayer.update_layer
          and cls._move_adapter_to_device_of_base_layer is BaseTunerLayer._move_adapter_to_device_of_base_layer
          and not cfg.lora_bias and not cfg.use_dora
          and (init is True or init is False or (isinstance(init, str) and init.lower() == "gaussian")))
    if ok:
        ok = layer.resolve_lora_variant(config=cfg) is None
    if len(_PLAIN) > 4096:
        _PLAIN.clear()
    _PLAIN[(cls, id(cfg))] = (cfg, ok)
    return ok


def _through(w: torch.Tensor, mid, out) -> torch.Tensor:
    """``w`` in dtype ``out``, by way of ``mid`` (the base layer's float dtype the device move casts to, or None)
    where ``cast_adapter_dtype`` then upcasts it: the values rounded to ``mid`` first, as PEFT's two steps do."""
    if out is torch.float32 and mid is not None and mid != w.dtype and mid in _upcast_dtypes():
        w = w.to(mid)
    return w.to(out)


_SKIP = {"ok": None, "buf": torch.empty(0, dtype=torch.int64)}


def _can_skip_draws() -> bool:
    """Whether :func:`_skip_draws` moves the default generator exactly as ``uniform_`` of as many float32 elements
    would (the default dtype float32 and device CPU, as ``nn.Linear``'s init then draws; checked once per process on
    a generator of its own: one 32-bit output per float32 element, two per int64 ``random_`` element)."""
    if torch.get_default_dtype() is not torch.float32 or torch.empty(0).device.type != "cpu":
        return False
    if _SKIP["ok"] is None:
        ok = True
        for n in (1, 2, 33, 1000):
            g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
            torch.empty(n).uniform_(-1.0, 1.0, generator=g1)
            torch.empty(n // 2, dtype=torch.int64).random_(generator=g2)
            if n % 2:
                torch.empty(1, dtype=torch.int32).random_(generator=g2)
            ok = ok and torch.equal(g1.get_state(), g2.get_state())
        _SKIP["ok"] = ok
    return _SKIP["ok"]


def _skip_draws(n: int) -> None:
    """Move the default CPU generator past ``n`` float32 ``uniform_`` draws without making them: ``random_`` of
    ``n // 2`` int64 elements (two outputs each; ~1.7x faster per output than ``uniform_``), one int32 for an odd
    ``n``, into a scratch buffer."""
    buf = _SKIP["buf"]
    if buf.numel() < n // 2:
        buf = _SKIP["buf"] = torch.empty(max(n // 2, 2 * buf.numel()), dtype=torch.int64)
    if n // 2:
        buf[: n // 2].random_()
    if n % 2:
        buf[:1].view(torch.int32)[:1].random_()


def _fresh(kind: tuple, weight) -> nn.Module:
    """A new ``nn.Linear`` (``("linear", in, out)``, no bias, ``weight`` its parameter), ``nn.Dropout(p)``
    (``("drop", p)``) or ``nn.Identity()`` as its constructor leaves it, without the constructor's cost: a copy of a
    template's attributes, each container a new one (the template lives on the meta device: making it draws nothing
    from the RNG)."""
    t = _TEMPLATES.get(kind)
    if t is None:
        if kind[0] == "linear":
            t = nn.Linear(kind[1], kind[2], bias=False, device="meta")
        elif kind[0] == "drop":
            t = nn.Dropout(p=kind[1])
        else:
            t = nn.Identity()
        _TEMPLATES[kind] = t
    m = object.__new__(type(t))
    d = m.__dict__
    for k, v in t.__dict__.items():  # (an empty container made anew: OrderedDict.copy costs ~4 us)
        d[k] = (v.copy() if v else type(v)()) if isinstance(v, (dict, set, list)) else v
    if weight is not None:
        d["_parameters"]["weight"] = weight
    return m


def _upcast_dtypes() -> frozenset:
    """The dtypes ``cast_adapter_dtype`` upcasts to float32."""
    global _UPCAST
    if _UPCAST is None:
        from peft.utils import UPCAST_DTYPES

        _UPCAST = frozenset({torch.float16, torch.bfloat16} | {getattr(torch, n) for n in UPCAST_DTYPES
                                                               if getattr(torch, n, None) is not None})
    return _UPCAST


_UPCAST = None


def _adapter_tensors(layer, name):
    """The parameters and buffers of adapter ``name`` in ``layer``'s per-adapter containers."""
    for c in layer._modules.values():
        if isinstance(c, (nn.ModuleDict, nn.ParameterDict)) or type(c).__name__ == "BufferDict":
            item = c._modules.get(name) if isinstance(c, nn.ModuleDict) else (c[name] if name in c else None)
            if isinstance(item, torch.Tensor):
                yield item
            elif item is not None:
                yield from item.parameters()
                yield from item.buffers()


def _no_set_adapter(*args, **kwargs) -> None:
    return None


_EMPTY: dict = {}  # type -> empty containers to lend (Module construction is the costly part of a swap)


@contextmanager
def _only_adapter(layer, name=None):
    """While in the block, ``layer``'s per-adapter module containers hold only adapter ``name`` (``None``: none, for a
    new adapter to be added); afterwards the real containers get the entries the block made or replaced (a new key
    appended, an existing one replaced in place: PEFT's insertion order)."""
    mods = layer._modules
    held = {}
    for attr in _HIDDEN:
        c = mods.get(attr)
        if c is not None and len(c):
            held[attr] = c
            pool = _EMPTY.setdefault(type(c), [])
            tmp = mods[attr] = pool.pop() if pool else type(c)()
            if name is not None and name in c:
                tmp[name] = c[name]
    # update_layer ends with the layer's set_adapter, which the model-wide one of the segment's bookkeeping repeats
    # for every layer (as inject_adapter repeats it after each update_layer): skipped here
    layer.__dict__["set_adapter"] = _no_set_adapter
    try:
        yield
    finally:
        del layer.__dict__["set_adapter"]
        for attr, real in held.items():
            tmp = mods[attr]
            mods[attr] = real
            for k in list(tmp.keys()):
                v = tmp[k]
                if isinstance(real, nn.ModuleDict):  # registered once already (its registration hooks ran then)
                    real._modules[k] = v
                elif k not in real or real[k] is not v:
                    real[k] = v
                del tmp[k]
            if type(tmp) is type(real) and not len(tmp) and not tmp._parameters and not tmp._buffers:
                _EMPTY[type(tmp)].append(tmp)


def _raise_no_match(cfg, excluded, unmatched):
    """inject_adapter's errors for a config that targets nothing (same messages)."""
    from peft.utils.error import NoMatchingPeftModuleError

    layers = ""
    if getattr(cfg, "layers_to_transform", None) is not None:
        layers += f" Note: You specified 'layers_to_transform': {cfg.layers_to_transform}."
    if getattr(cfg, "layers_pattern", None) is not None:
        layers += f" You also specified 'layers_pattern': {cfg.layers_pattern}."
    if excluded and not unmatched:
        raise NoMatchingPeftModuleError("All modules were excluded. This is likely unintended. Check your "
                                        "`target_modules`, `exclude_modules` and `modules_to_save` configuration.")
    if not excluded and unmatched and not cfg.target_modules:
        raise NoMatchingPeftModuleError("No `target_modules` passed but also no `target_parameters` found. Please "
                                        "check the values for these arguments.")
    if not excluded and unmatched:
        raise NoMatchingPeftModuleError(f"Target modules {cfg.target_modules} not found in the base model. Please "
                                        f"check the target modules and try again.{layers}")
    raise NoMatchingPeftModuleError(
        "No modules were targeted for adaptation. This might be caused by a combination of mismatched target modules "
        "and excluded modules. Please check your `target_modules` and `exclude_modules` configuration. You may also "
        f"have only targeted modules that are marked to be saved (`modules_to_save`).{layers}")


def _warn_like_inject(cfg, excluded, targeted) -> None:
    if getattr(cfg, "exclude_modules", None) and not excluded:
        warnings.warn(f"You have passed exclude_modules={cfg.exclude_modules} but no modules were excluded. "
                      "Please check that exclude_modules was set correctly.", stacklevel=4)
    for attr in ("rank_pattern", "alpha_pattern"):
        patterns = getattr(cfg, attr, None)
        if not patterns:
            continue
        matched = {k for k in patterns if any(re.match(rf"(.*\.)?({k})$", m) for m in targeted)}
        unmatched = sorted(set(patterns) - matched)
        if unmatched:
            warnings.warn(f"The following {attr} keys did not match any targeted module and were ignored: "
                          f"{unmatched}.", RuntimeWarning, stacklevel=4)


def add_adapters(model, configs: Mapping, *, autocast_adapter_dtype: bool = True) -> dict:
    """Add every adapter of ``configs`` (``{name: peft.LoraConfig}``, in order) to the ``PeftModel`` ``model``, in time
    linear in their number. The model ends as ``for name, cfg in configs.items(): model.add_adapter(name, cfg,
    autocast_adapter_dtype=...)`` leaves it: the same modules, parameter names, shapes, dtypes, devices, values (with
    the same torch seed before the call, bit for bit), ``requires_grad`` flags, ``peft_config`` entries and active
    adapter. Works on a model patched by :func:`fast_multilora.patch` (its next forward call routes the new adapters).

    Returns ``{name: reason}`` for the configs added by PEFT's own ``add_adapter`` instead (see :data:`FALLBACK`);
    empty when all took the one-walk route. Bad names or configs raise before the model is touched; an error while
    adding removes the adapters this call added.
    """
    from .store import gc_paused

    tuner = _tuner_of(model)
    _check_configs(model, configs)
    with gc_paused():  # (thousands of modules made in a model of many: see gc_paused)
        return _add_adapters(model, tuner, configs, autocast_adapter_dtype)


def _add_adapters(model, tuner, configs: Mapping, autocast_adapter_dtype: bool) -> dict:
    slow: dict = {}
    added: list = []
    segment = None
    structural = False  # a LoRA layer was created (or PEFT's add_adapter ran): the patched model looks again
    try:
        for name, cfg in configs.items():
            if name in "lora_":  # PeftModel.add_adapter's warning
                warnings.warn(f"Adapter name '{name}' should not be contained in the prefix 'lora_'. This may lead "
                              "to reinitialization of the adapter weights during loading.", stacklevel=2)
            reason = _config_fallback(model, cfg)
            if reason is None:
                if segment is None:
                    segment = _Segment(model, tuner, autocast_adapter_dtype)
                reason = segment.fallback_reason(name)
            added.append(name)
            if reason is None:
                segment.add(name, cfg)
                continue
            if segment is not None:
                segment.finish()
                structural = structural or bool(segment.structure)
                segment = None
            slow[name] = FALLBACK[reason]
            structural = True
            model.add_adapter(name, cfg, autocast_adapter_dtype=autocast_adapter_dtype)
        if segment is not None:
            segment.finish()
            structural = structural or bool(segment.structure)
    except BaseException:
        if segment is not None and segment.params is not None:  # new LoRA layers froze their base layers' parameters
            for p, flag in segment.params:
                p.requires_grad = flag
        _roll_back(model, tuner, added)
        mark_changed()
        raise
    if structural:
        mark_changed()
    else:  # the new adapters sit in present LoRA layers, whose setting dicts marked them: no re-patch needed
        from .patching import adapters_added

        adapters_added(model)
    return slow


def delete_adapters(model, names: Sequence[str]) -> None:
    """Delete adapters ``names`` from the ``PeftModel`` ``model``: the model ends as ``for name in names:
    model.delete_adapter(name)`` leaves it (modules, ``peft_config``, active adapters, PEFT's warnings), with one walk
    of the model that does not enter the adapters -- time linear in the adapters deleted, not in the registry (PEFT's
    own ``delete_adapter`` walks every adapter's modules three times per call). Works on a patched model (its next
    forward call drops them). Unknown or merged adapters raise before anything is deleted."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # pragma: no cover - older PEFT
        AuxiliaryTrainingWrapper = ()  # noqa: N806
    tuner = _tuner_of(model)
    if isinstance(names, str):
        raise TypeError("fast_multilora.delete_adapters takes a list of adapter names, not a single string")
    names = list(names)
    unknown = [n for n in names if n not in model.peft_config]
    if unknown:
        raise ValueError(f"Adapter {unknown[0]} does not exist -- fast_multilora.delete_adapters: unknown adapter(s) "
                         f"{unknown}; the model has {len(model.peft_config)} adapters")
    if len(set(names)) != len(names):
        raise ValueError(f"fast_multilora.delete_adapters: an adapter name is given twice in {names}")
    layers, aux = [], []
    prefix = tuner.prefix
    seen, stack = set(), [("", tuner.model)]
    while stack:  # PEFT's named_modules walk (pre-order), without the adapters' containers (PEFT skips their keys)
        key, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        pre = key + "." if key else ""
        if prefix not in key and isinstance(module, tuner.tuner_layer_cls):
            layers.append((key, module))
        if isinstance(module, AuxiliaryTrainingWrapper):
            aux.append((key, module))
        inside = isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))
        stack.extend((pre + n, c) for n, c in reversed(module._modules.items()) if c is not None and not (
            inside and isinstance(c, (nn.ModuleDict, nn.ParameterDict))))
    merged = sorted({n for _, m in layers for n in getattr(m, "merged_adapters", ()) if n in names})
    if merged:
        raise ValueError(f"Cannot delete adapter(s) {merged} while they are merged. Please unmerge them first.")
    for name in names:
        del tuner.peft_config[name]  # BaseTuner.delete_adapter, then tuners_utils.delete_adapter
        new_adapter = None
        for _, layer in layers:
            layer.delete_adapter(name)
            if new_adapter is None:
                new_adapter = layer.active_adapters[:]
        for _, wrapper in aux:
            wrapper.delete_adapter(name, new_active_adapters=new_adapter)
        tuner.active_adapter = new_adapter or []
        active = model.active_adapters  # PeftModel.delete_adapter
        if len(active) == 1:
            model.active_adapter = active[0]


def _roll_back(model, tuner, names) -> None:
    for name in reversed(names):
        if name not in model.peft_config:
            continue
        try:
            tuner.delete_adapter(name)
        except Exception:  # noqa: BLE001 - best effort: a half-made adapter may lack pieces delete_adapter expects
            model.peft_config.pop(name, None)
            for m in tuner.model.modules():
                if hasattr(m, "_all_available_adapter_names") and hasattr(m, "delete_adapter"):
                    try:
                        m.delete_adapter(name)
                    except Exception:  # noqa: BLE001
                        pass


# -- the adapters' state-dict keys, from one pass over the model ------------------------------------------------------
def _tuner_prefixes(peft_model):
    """What PEFT's ``_get_tuner_state_dict_key_prefixes`` collects, from one walk: ``keyed`` {container prefix + "." +
    adapter name: adapter name} for the per-adapter containers, ``shared`` the prefixes of the tuner layers' other
    attributes, ``aux`` the names of the auxiliary wrappers (ModulesToSaveWrapper, ...)."""
    from peft.tuners._buffer_dict import BufferDict
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer, _is_key_under_prefixes
    from peft.utils.other import AuxiliaryTrainingWrapper

    keyed, shared, aux = {}, set(), set()
    for module_name, module in peft_model.named_modules():
        module_name = module_name.removeprefix("_fsdp_wrapped_module.")
        if isinstance(module, AuxiliaryTrainingWrapper):
            aux.add(module_name)
            continue
        if not (isinstance(module, BaseTuner) or (isinstance(module, BaseTunerLayer)
                                                  and not _is_key_under_prefixes(module_name, aux))):
            continue
        attrs = (list(module._modules) + [n for n, _ in module.named_parameters(recurse=False)]
                 + [n for n, _ in module.named_buffers(recurse=False)])
        for attr in attrs:
            if attr in ("base_layer", "model"):
                continue
            prefix = f"{module_name}.{attr}" if module_name else attr
            child = getattr(module, attr)
            if isinstance(child, (nn.ModuleDict, nn.ParameterDict, BufferDict)):
                for a in child.keys():
                    keyed[f"{prefix}.{a}"] = a
                keyed.setdefault(prefix, None)  # the container itself: under it for saving, not for loading
            else:
                shared.add(prefix)
    return keyed, shared, aux


def _owner(key, keyed, shared):
    """``(under_tuner, adapter)``: whether ``key`` lies under a tuner prefix, and the adapter whose container holds it
    (``None``: a shared attribute or no adapter's)."""
    sub = key
    under, adapter = False, None
    while True:
        if sub in keyed:
            under = True
            if adapter is None:
                adapter = keyed[sub]
        elif sub in shared:
            under = True
        sub, dot, _ = sub.rpartition(".")
        if not dot:
            return under, adapter


def save_adapters(model, folder, names: Optional[Sequence[str]] = None, *,
                  save_embedding_layers="auto") -> dict:
    """Save adapters of the ``PeftModel`` ``model`` in PEFT's format, each in ``folder/<name>/``
    (``adapter_config.json`` + ``adapter_model.safetensors``, the files ``model.save_pretrained(...,
    selected_adapters=[name])`` writes, bit for bit), loadable by ``PeftModel.from_pretrained`` and
    :func:`load_adapters`. ``names``: which (default: all, in ``peft_config`` order). One pass over the model's state
    dict for all of them. Returns ``{name: reason}`` for the adapters saved through PEFT's
    ``get_peft_model_state_dict`` instead (bias, auxiliary modules, embedding layers saved, tensor parallelism)."""
    from peft.utils.save_and_load import _get_tp_info, _validate_lora_adapter_state_dict, get_peft_model_state_dict

    tuner = _tuner_of(model)
    if names is None:
        names = list(model.peft_config)
    elif isinstance(names, str):
        raise TypeError("fast_multilora.save_adapters: `names` must be a list of adapter names, not a string")
    names = list(names)
    unknown = [n for n in names if n not in model.peft_config]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"fast_multilora.save_adapters: unknown or repeated adapter names {unknown or names}; the "
                         f"model has {list(model.peft_config)}")
    if os.path.isfile(folder):
        raise ValueError(f"Provided path ({folder}) should be a directory, not a file")
    os.makedirs(folder, exist_ok=True)
    model.create_or_update_model_card(folder)

    state_dict = model.state_dict()
    keyed, shared, aux = _tuner_prefixes(model)
    slow = {}
    if aux:
        slow.update({n: "the model has auxiliary modules (modules_to_save / trainable tokens)" for n in names})
    if _get_tp_info(model) is not None or getattr(model, "_tp_size", None):
        slow.update({n: "tensor parallelism" for n in names})
    embeddings = _EmbeddingCheck(model)
    for n in names:
        cfg = model.peft_config[n]
        if n in slow:
            continue
        if getattr(cfg, "bias", "none") != "none":
            slow[n] = f"bias={cfg.bias!r} saves base-model biases"
        elif embeddings.save(cfg, save_embedding_layers):
            slow[n] = "embedding layers are saved with it"

    every = set(model.peft_config)
    fast = {n: {} for n in names if n not in slow}
    for key, value in state_dict.items():
        under, _ = _owner(key, keyed, shared)
        if not under:
            continue
        present = {c for c in key.split(".")[1:] if c in every}  # PEFT's _filter_state_dict_for_adapter_name
        if len(present) > 1:
            continue
        for n in (present or fast):
            d = fast.get(n)
            if d is not None:
                d[key] = value
    lora_cls = type(tuner)
    for n in names:
        cfg = model.peft_config[n]
        if n in slow:
            out = get_peft_model_state_dict(model, state_dict=state_dict, adapter_name=n,
                                            save_embedding_layers=save_embedding_layers)
        else:
            out = fast[n]
            if cfg.use_dora:  # LoraModel._get_adapter_state_dict: DoRA's checkpoint keys end without ".weight"
                suffix = f"lora_magnitude_vector.{n}.weight"
                out = {k[:-7] if k.endswith(suffix) else k: v for k, v in out.items()}
            out = {lora_cls._remove_adapter_name_from_key(k, n): v for k, v in out.items()}
        _validate_lora_adapter_state_dict(out, adapter_name=n)
        _write_adapter(model, cfg, out, os.path.join(folder, n))
    return slow


def _write_adapter(model, cfg, state, output_dir) -> None:
    """PeftModel.save_pretrained's writing of one adapter (safetensors)."""
    from peft.utils.other import id_tensor_storage
    from safetensors.torch import save_file

    os.makedirs(output_dir, exist_ok=True)
    ptrs = collections.defaultdict(list)
    for name, tensor in state.items():
        ptrs[id_tensor_storage(tensor) if isinstance(tensor, torch.Tensor) else id(tensor)].append(name)
    for shared_names in ptrs.values():
        for name in shared_names[1:]:  # safetensors refuses tensors sharing memory
            state[name] = state[name].clone()
    state = {k: (v if v.is_contiguous() else v.contiguous()) for k, v in state.items()}
    save_file(state, os.path.join(output_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    if cfg.base_model_name_or_path is None:
        cfg.base_model_name_or_path = model.base_model.model.__dict__.get("name_or_path", None) or None
    inference_mode = cfg.inference_mode
    cfg.inference_mode = True
    auto_mapping_dict = None
    if cfg.task_type is None:
        base_model_class = model._get_base_model_class(is_prompt_tuning=False)
        auto_mapping_dict = {"base_model_class": base_model_class.__name__,
                             "parent_library": base_model_class.__module__}
    try:
        cfg.save_pretrained(output_dir, auto_mapping_dict=auto_mapping_dict)
    finally:
        cfg.inference_mode = inference_mode


class _EmbeddingCheck:
    """get_peft_model_state_dict's ``save_embedding_layers="auto"`` decision, its model walks and base-config reads
    done once per call instead of once per adapter."""

    def __init__(self, model):
        self.model = model
        self._names = None
        self._resized = {}

    def save(self, cfg, setting) -> bool:
        from peft.utils import INCLUDE_LINEAR_LAYERS_SHORTHAND
        from peft.utils.constants import EMBEDDING_LAYER_NAMES
        from peft.utils.other import match_target_against_key

        if setting is not True and setting != "auto":
            return False
        if setting is True:
            return True
        tm = getattr(cfg, "target_modules", None)
        targeted = False
        if isinstance(tm, str) and tm != INCLUDE_LINEAR_LAYERS_SHORTHAND:
            if self._names is None:
                base = self.model.get_base_model()
                self._names = [k for k, _ in base.named_modules()
                               if any(re.match(rf"(.*\.)?{e}$", k) for e in EMBEDDING_LAYER_NAMES)]
            targeted = any(match_target_against_key(tm, k) for k in self._names)
        elif tm:
            targeted = any(k in tm for k in EMBEDDING_LAYER_NAMES)
        if targeted and getattr(cfg, "trainable_token_indices", None) is None:
            return True
        return self.resized(getattr(cfg, "base_model_name_or_path", None))

    def resized(self, model_id) -> bool:
        """Whether the model's vocabulary differs from its base model's (PEFT reads the base config per adapter)."""
        if not model_id:
            return False
        if model_id not in self._resized:
            from peft.utils.other import check_file_exists_on_hf_hub

            vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
            exists = os.path.exists(os.path.join(model_id, "config.json")) or check_file_exists_on_hf_hub(
                model_id, "config.json")
            self._resized[model_id] = bool(vocab and exists and vocab != self.model.config.__class__.from_pretrained(
                model_id).vocab_size)
        return self._resized[model_id]


def load_adapters(model, sources: Mapping, *, is_trainable: bool = False, torch_device=None,
                  autocast_adapter_dtype: bool = True, ephemeral_gpu_offload: bool = False) -> dict:
    """Load saved PEFT adapters (``{name: folder or Hub id}``, in order) into the ``PeftModel`` ``model``, in time
    linear in their number (a name the model has already gets the file's weights, its config kept, as PEFT does);
    the model ends as ``for name, path in sources.items(): model.load_adapter(path,
    adapter_name=name, is_trainable=..., ...)`` leaves it (configs, weights, ``requires_grad``, eval mode unless
    trainable). Returns ``{name: (missing_keys, unexpected_keys)}`` as ``torch``'s ``_IncompatibleKeys``: missing are
    the adapter's own parameters the file lacks (PEFT's lists also any other key containing the adapter's name as a
    substring), unexpected the file's keys the model lacks."""
    from peft import PeftConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
    from peft.utils.save_and_load import load_peft_weights

    tuner = _tuner_of(model)
    if not isinstance(sources, Mapping):
        raise TypeError(f"fast_multilora.load_adapters: `sources` must map adapter names to saved adapter folders, "
                        f"got {type(sources).__name__}")
    seen: set = set()
    for name, path in sources.items():
        if name not in model.peft_config:  # a present adapter gets the file's weights (its config stays), as in PEFT
            _check_name(model, name, seen)
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"fast_multilora.load_adapters: adapter {name!r}: expected a folder path, got {path!r}")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise NotImplementedError("fast_multilora.load_adapters: under torch.distributed (tensor-parallel sharding "
                                  "of LoRA weights at load) use PEFT's load_adapter")
    configs = {}
    every = list(model.peft_config.values())
    for name, path in sources.items():
        if name in model.peft_config:
            continue
        cfg = PEFT_TYPE_TO_CONFIG_MAPPING[PeftConfig._get_peft_type(path)].from_pretrained(
            path, ephemeral_gpu_offload=ephemeral_gpu_offload)
        _warn_base_changing(cfg, every)  # PeftModel._check_new_adapter_config
        every.append(cfg)
        cfg.inference_mode = not is_trainable
        configs[name] = cfg
    add_adapters(model, configs, autocast_adapter_dtype=autocast_adapter_dtype)
    found = _adapter_keys(model, list(sources))  # (None: a model whose keys only its state dict tells)
    if is_trainable:
        if found is None:
            model.set_requires_grad(list(configs))
        else:  # PEFT's set_requires_grad on each tuner layer, at the new adapters' entries only
            _set_requires_grad(found[4], list(configs))
    if torch_device is None:
        from peft.utils.other import infer_device

        torch_device = infer_device()

    if found is None:
        keyed, shared, aux = _tuner_prefixes(model)
        own = {n: [] for n in sources}
        shared_keys = []
        model_keys = list(model.state_dict().keys())
        for key in model_keys:
            _, adapter = _owner(key, keyed, shared)
            if adapter in own:
                own[adapter].append(key)
            elif adapter is None and _under(key, shared):
                shared_keys.append(key)
        requires_prefix = any(n.startswith("base_model.model.") for n, _ in model.named_parameters())
        known = set(model_keys)
    else:
        own, shared_keys, requires_prefix, aux = found[0], found[1], found[2], set()
        known = _KnownKeys(model, set(shared_keys).union(*own.values()))
    lora_cls = type(tuner)
    merged, results = {}, {}
    for name, path in sources.items():
        cfg = model.peft_config[name]
        state = _convert_for_transformers(model, cfg, load_peft_weights(path, device=torch_device), name)
        state = _aux_load_keys(model, aux, state, name)
        state = {k + ".weight" if k.endswith("lora_magnitude_vector") else k: v for k, v in state.items()}
        to_model = {}
        for model_key in own[name] + shared_keys:  # BaseTuner._remap_adapter_state_dict_for_load
            ckpt = lora_cls._remove_adapter_name_from_key(model_key, name)
            to_model[ckpt] = model_key
            if not model_key.startswith("base_model.model."):
                to_model["base_model.model." + ckpt] = model_key
        state = {to_model.get(k, k): v for k, v in state.items()}
        if not requires_prefix:
            state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
        merged.update(state)
        results[name] = state
    _load_state(model, merged, None if found is None else found[3])
    out = {}
    for name, state in results.items():
        out[name] = _IncompatibleKeys([k for k in own[name] if k not in state], [k for k in state if k not in known])
    if not is_trainable:
        model.eval()
    # (no mark_changed: add_adapters marked the new adapters, or the model re-patches where it made LoRA layers; the
    # weights went in place, into the store's pieces)
    return out


_CONTAINERS = (nn.ModuleDict, nn.ParameterDict)


def _is_container(m) -> bool:
    return isinstance(m, _CONTAINERS) or type(m).__name__ == "BufferDict"


def _hooks_of(m) -> bool:
    return bool(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks or m._state_dict_hooks
                or m._state_dict_pre_hooks)


def _adapter_keys(model, names: list):
    """What :func:`load_adapters` reads from the whole model's state dict (:func:`_tuner_prefixes`, :func:`_owner`),
    for adapters ``names`` only: one walk of the model that enters no other adapter's entries of the tuner layers'
    per-adapter containers, so its work is the model's structure and these adapters', not the registry. Returns
    ``(own, shared_keys, requires_prefix, hooked, tuner_layers)`` -- ``own``: {name: its keys}, ``shared_keys``: the
    keys of the tuner layers' shared attributes, ``hooked``: whether a module walked has load hooks -- or ``None``
    where the whole state dict is read (auxiliary wrappers, a module with state-dict hooks of its own: they may rename
    keys)."""
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    own = {n: [] for n in names}
    shared_keys, layers = [], []
    hooked, first = False, None
    seen, stack = set(), [("", model)]
    while stack:  # (pre-order, as the state dict: a module's own tensors, then its children in order)
        key, module = stack.pop()
        if type(module) is tuple:  # keys of a tuner layer's attribute, in their place in the order
            owner, keys = module
            (own[owner] if owner is not None else shared_keys).extend(keys)
            continue
        if id(module) in seen:
            continue
        seen.add(id(module))
        if isinstance(module, AuxiliaryTrainingWrapper) or module._state_dict_hooks or module._state_dict_pre_hooks:
            return None
        hooked = hooked or _hooks_of(module)
        pre = key + "." if key else ""
        if first is None:
            first = next((pre + n for n, p in module._parameters.items() if p is not None), None)
        tuner = isinstance(module, (BaseTuner, BaseTunerLayer))
        if isinstance(module, BaseTunerLayer):
            layers.append(module)
        if tuner:  # its own tensors: shared keys
            shared_keys += [pre + n for n, t in module._parameters.items() if t is not None]
            shared_keys += [pre + n for n, t in module._buffers.items()
                            if t is not None and n not in module._non_persistent_buffers_set]
        children = []
        for n, c in module._modules.items():
            if c is None:
                continue
            if not tuner or n in ("base_layer", "model"):
                children.append((pre + n, c))
                continue
            if not _is_container(c):  # a shared attribute: its keys are the tuner layer's shared keys
                for m in c.modules():
                    if m._state_dict_hooks or m._state_dict_pre_hooks or isinstance(m, BaseTunerLayer):
                        return None
                    hooked = hooked or _hooks_of(m)
                children.append(("", (None, list(c.state_dict(prefix=f"{pre}{n}.", keep_vars=True)))))
                continue
            hooked = hooked or _hooks_of(c)  # keyed: only the entries of the adapters loaded, in the container's order
            if c._state_dict_hooks or c._state_dict_pre_hooks:
                return None
            for a in names:  # (each adapter's keys are its own list: their order among adapters does not matter)
                sub = c._modules.get(a)
                if sub is not None:
                    for m in sub.modules():
                        if m._state_dict_hooks or m._state_dict_pre_hooks:
                            return None
                        hooked = hooked or _hooks_of(m)
                    keys = list(sub.state_dict(prefix=f"{pre}{n}.{a}.", keep_vars=True))
                elif c._parameters.get(a) is not None or (c._buffers.get(a) is not None
                                                          and a not in c._non_persistent_buffers_set):
                    keys = [f"{pre}{n}.{a}"]
                else:
                    keys = []
                children.append(("", (a, keys)))
        stack.extend(reversed(children))
    if first is None:
        first = next((n for n, _ in model.named_parameters()), "")
    return own, shared_keys, first.startswith("base_model.model."), hooked, layers


class _KnownKeys:
    """Membership in the model's state-dict keys, without the whole state dict: ``keys`` (found by
    :func:`_adapter_keys`), else a parameter or persistent buffer at the key's path."""

    def __init__(self, model, keys: set):
        self.model, self.keys = model, keys

    def __contains__(self, key) -> bool:
        if key in self.keys:
            return True
        path, _, leaf = key.rpartition(".")
        try:
            module = self.model.get_submodule(path)
        except AttributeError:
            return False
        if module._parameters.get(leaf) is not None:
            return True
        return module._buffers.get(leaf) is not None and leaf not in module._non_persistent_buffers_set


def _set_requires_grad(layers, names: list) -> None:
    """PEFT's ``set_requires_grad(names, True)`` on each tuner layer (``BaseTunerLayer.set_requires_grad``), reading
    the adapters ``names`` of its per-adapter containers only (PEFT's loops over every entry)."""
    from peft.utils.other import _set_layer_requires_grad

    want = set(names)
    for layer in layers:
        for attr in layer.adapter_layer_names:
            container = getattr(layer, attr, None)
            if container is None:
                continue
            for n in names:
                if n in container:
                    _set_layer_requires_grad(container[n], True)
        freeze = getattr(layer, "_freeze_non_trainable_peft_weights", None)
        if freeze is not None:
            freeze(want)


def _load_state(model, state, hooked=None) -> None:
    """``model.load_state_dict(state, strict=False)``, module by module: torch's recursion filters a container's
    entries once per child, which is quadratic in the adapters of a layer. Each tensor goes through its own module's
    ``load_state_dict`` (its ``_load_from_state_dict`` and hooks); where a module of the model has load hooks of its
    own (they may rename keys for their subtree), the whole model's ``load_state_dict`` instead. ``hooked``: whether
    one has, when known (:func:`_adapter_keys`' walk)."""
    if hooked is None:
        hooked = any(m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks for m in model.modules())
    if hooked:
        model.load_state_dict(state, strict=False)
        return
    groups = collections.defaultdict(dict)
    for key, value in state.items():
        path, _, leaf = key.rpartition(".")
        groups[path][leaf] = value
    for path, local in groups.items():
        try:
            module = model.get_submodule(path)
        except AttributeError:  # keys the model lacks: ignored, as strict=False ignores them
            continue
        module.load_state_dict(local, strict=False)


def _under(key, prefixes) -> bool:
    sub = key
    while True:
        if sub in prefixes:
            return True
        sub, dot, _ = sub.rpartition(".")
        if not dot:
            return False


def _convert_for_transformers(model, cfg, state, name):
    from peft.import_utils import is_transformers_ge_v5

    if is_transformers_ge_v5 and hasattr(getattr(model, "config", None), "model_type"):
        from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers

        state = convert_peft_adapter_state_dict_for_transformers(model=model, peft_config=cfg,
                                                                 adapter_state_dict=state, adapter_name=name)
    return dict(state)


def _aux_load_keys(model, aux, state, name):
    """set_peft_model_state_dict's key translation for auxiliary wrappers (ModulesToSaveWrapper, ...)."""
    if not aux:
        return state
    out = dict(state)
    for module_name in aux:
        module = model.get_submodule(module_name)
        for k, v in module.adapter_state_dict_load_map(name).items():
            out[f"{module_name}.{v}"] = state[f"{module_name}.{k}"]
            del out[f"{module_name}.{k}"]
    return out


def _warn_base_changing(cfg, others) -> None:
    every = [cfg] + others
    if len(every) < 2:
        return
    for init, what, link in (("pissa", "PiSSA", "pissa_finetuning#convert-pissa-to-lora"),
                             ("corda", "CorDA", "corda_finetuning#convert-corda-to-lora"),
                             ("olora", "OLoRA", "olora_finetuning#olora-and-lora")):
        if any(getattr(c, "init_lora_weights", None) == init for c in every):
            warnings.warn(f"{what} changes the base weights of the model and should thus not be used with other "
                          f"adapters. Consider converting the {what} adapter into a normal LoRA adapter: "
                          f"https://github.com/huggingface/peft/tree/main/examples/{link}", stacklevel=3)
            return
