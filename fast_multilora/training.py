"""Per-adapter loss for data-parallel loops and ``transformers.Trainer``.

The objective is :func:`fast_multilora.per_adapter_loss`'s: the sum over adapters of each adapter's mean token loss,
so every adapter gets the gradient of training alone on its own samples. Across data-parallel ranks the mean must be
over the *global* batch: each rank computes ``sum_a S_a / N_a`` with its own per-adapter token-loss sums ``S_a`` and
the all-reduced per-adapter token counts ``N_a``; DDP / FSDP then *average* gradients over ``world`` ranks, so the
rank's loss is multiplied by ``world`` (``scale_for_averaging``). The resulting update equals a one-process step on the
concatenated global batch (up to float summation order).

* :func:`distributed_per_adapter_loss` -- for hand-written (``accelerate``) loops.
* :class:`PerAdapterLoss` -- ``Trainer(compute_loss_func=loss, callbacks=[loss])``: the Trainer stays unmodified;
  the object reads ``adapter_names`` / ``adapter_ids`` from a forward pre-hook on the model, follows the Trainer's
  loss-scaling convention for ``compute_loss_func`` and logs ``loss/<adapter>`` entries; with ``fused=True`` the
  model's forward builds no full-vocabulary logits (the loss comes from its last hidden states).
* :class:`PerAdapterGradClip` -- clips each adapter's gradient on its own.
* :func:`trainer_kwargs` -- all of the above, the collator, the optimizer and the ``TrainingArguments`` settings they
  need, as keyword arguments: ``Trainer(**trainer_kwargs(model, tokenizer, args), train_dataset=...)``.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Dict, Optional, Sequence, Tuple

import torch
from transformers import TrainerCallback

from .loss import AdapterLosses, adapter_log_prob_means, adapter_token_means

__all__ = ["PerAdapterGradClip", "PerAdapterLoss", "adapter_token_sums", "distributed_per_adapter_loss",
           "trainer_kwargs"]


# the model's attribute naming its PerAdapterLoss (a weak reference)
_ATTACHED = "_fml_adapter_loss"


def _dist_world(group=None) -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group)
    return 1


def adapter_token_sums(logits: torch.Tensor, labels: torch.Tensor, adapter_names: Sequence[str],
                       vocab: Sequence[str], *, adapter_ids: Optional[torch.Tensor] = None,
                       ignore_index: int = -100, shift: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-adapter sums of token cross-entropy and token counts over a fixed adapter ``vocab``.

    Same token selection as :func:`fast_multilora.per_adapter_loss` (shifted labels, ``ignore_index`` and
    ``"__base__"`` tokens left out). Returns ``(sums[len(vocab)], counts[len(vocab)])``; ``sums`` carries the graph
    (also when no token belongs to an adapter, so ``backward()`` always works).
    """
    means, counts = adapter_token_means(logits, labels, adapter_names, vocab, adapter_ids=adapter_ids,
                                        ignore_index=ignore_index, shift=shift)
    return means * counts, counts


def distributed_per_adapter_loss(logits: torch.Tensor, labels: torch.Tensor, adapter_names: Sequence[str],
                                 vocab: Sequence[str], *, adapter_ids: Optional[torch.Tensor] = None,
                                 ignore_index: int = -100, shift: bool = True, group=None,
                                 scale_for_averaging: bool = True, return_dict: bool = False):
    """This rank's share of the global per-adapter loss (see the module docstring).

    ``vocab``: every adapter name, the same list on every rank (e.g. ``sorted(model.peft_config)``). Without
    ``torch.distributed`` (or with one rank) this equals :func:`fast_multilora.per_adapter_loss`. With
    ``return_dict=True`` also returns ``{adapter: global mean loss}`` (detached floats, adapters with tokens only;
    one extra all-reduce).
    """
    sums, counts = adapter_token_sums(logits, labels, adapter_names, vocab, adapter_ids=adapter_ids,
                                      ignore_index=ignore_index, shift=shift)
    world = _dist_world(group)
    if world > 1:
        counts = counts.detach().clone()
        torch.distributed.all_reduce(counts, group=group)
    loss = (sums / counts.clamp(min=1)).sum()
    if world > 1 and scale_for_averaging:
        loss = loss * world
    if not return_dict:
        return loss
    s = sums.detach().clone()
    if world > 1:
        torch.distributed.all_reduce(s, group=group)
    return loss, AdapterLosses(vocab, s / counts.clamp(min=1), counts)


class PerAdapterLoss(TrainerCallback):
    """Per-adapter loss for an unmodified ``transformers.Trainer``::

        loss = PerAdapterLoss(model)
        trainer = Trainer(model, args, data_collator=MultiAdapterCollator(tok), compute_loss_func=loss,
                          callbacks=[loss], ...)

    (:func:`trainer_kwargs` builds this wiring, and the rest, in one call.)

    It is both the ``compute_loss_func`` and a callback. A forward pre-hook (run before the routing hook of
    :func:`fast_multilora.patch`) records each call's ``adapter_names`` / ``adapter_ids``. The loss follows the
    Trainer's convention for ``compute_loss_func``: with ``average_tokens_across_devices`` (the default) the Trainer
    multiplies the loss by the number of processes, so per-adapter token counts are all-reduced and the rank's loss
    is ``sum_a S_a / N_a`` -- the exact global-batch objective under DDP/FSDP; the Trainer does not divide a
    ``compute_loss_func`` loss by the gradient-accumulation steps, so training losses are divided here (each
    micro-batch's per-adapter means weigh equally: exact for ``gradient_accumulation_steps=1``).
    The callback adds ``loss/<adapter>`` (mean over the logging window) to the Trainer's logs and
    ``eval_loss/<adapter>`` to evaluation logs. ``outputs`` carry ``logits``, or the per-token ``log_probs`` and
    ``label_mask`` of TRL's fused LM head (:class:`fast_multilora.trl.MultiAdapterSFTTrainer`).

    ``fused=True``: training forwards build no full-vocabulary logits. The pre-hook asks the model's own forward for
    the logits of the last position only (``logits_to_keep=1``, as ``generate`` does), a forward hook on the
    backbone (e.g. ``LlamaModel``) keeps its ``last_hidden_state``, and the loss is computed from it by the chunked
    LM head + cross-entropy of :mod:`fast_multilora.fused_loss` (same per-adapter means and gradients as the
    logits, to fp32 rounding). The first such call checks that the model's logits of the last position are its head
    (with the post-head transform) applied to that hidden state, and raises if not. Where the model cannot skip its
    logits (:func:`~fast_multilora.fused_loss.logits_free_head`: no ``logits_to_keep`` in its forward, LoRA or
    ``modules_to_save`` on ``lm_head``, a quantized or sharded head, a learned ``logit_scale``) it warns once, naming
    the reason, and takes the logits. Evaluation forwards always build the logits (the Trainer hands them to
    ``compute_metrics``). ``chunk_size``: tokens per chunk of the fused loss (default
    :func:`~fast_multilora.fused_loss.chunk_tokens`).
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, vocab: Optional[Sequence[str]] = None, *,
                 ignore_index: int = -100, shift: bool = True, fused: bool = False,
                 chunk_size: Optional[int] = None):
        if not isinstance(fused, bool):
            raise TypeError(f"PerAdapterLoss: `fused` must be True or False, got {fused!r}")
        self.vocab = list(vocab) if vocab is not None else None
        self.ignore_index = ignore_index
        self.shift = shift
        self.fused = fused
        self.chunk_size = chunk_size
        self.gradient_accumulation_steps = 1
        self.sync_counts = True
        self._model = None
        self._handle = None
        self._head = None  # LogitsFreeHead, or the reason the model has none (str); found at attach
        self._hidden_handle = None
        self._armed = False  # this forward call skips its logits: the backbone's hook keeps its hidden states
        self._hidden = None  # (last_hidden_state, autocast (device, enabled, dtype)) of the armed call
        self._checked = False
        self._warned = set()
        self._call: Tuple = (None, None)
        self._stats: Dict[bool, list] = {}
        if model is not None:
            self.attach(model)

    # -- wiring ---------------------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> "PerAdapterLoss":
        """Record ``adapter_names`` / ``adapter_ids`` of every forward call of ``model`` (the PeftModel). One
        ``PerAdapterLoss`` per model: attaching one detaches the one attached before (whose calls then raise)."""
        self.detach()
        prev = model.__dict__.get(_ATTACHED)
        prev = prev() if prev is not None else None
        if prev is not None and prev is not self:
            prev.detach()
        model.__dict__[_ATTACHED] = weakref.ref(self)
        self._model = model
        if self.vocab is None:
            from .data import _known_adapters

            self.vocab = _known_adapters(model)
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True, prepend=True)
        if self.fused:
            from .fused_loss import logits_free_head

            self._head = logits_free_head(model)
            if not isinstance(self._head, str):
                self._hidden_handle = self._head.backbone.register_forward_hook(self._keep_hidden)
        return self

    def detach(self) -> None:
        """Remove the hooks from the model (a call of the loss then raises)."""
        for h in (self._handle, self._hidden_handle):
            if h is not None:
                h.remove()
        self._handle = self._hidden_handle = None
        self._call, self._armed, self._hidden = (None, None), False, None

    def _fallback(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"PerAdapterLoss(fused=True): {reason}; the loss is computed from the full logits "
                          "(as with fused=False)", stacklevel=3)

    def _record(self, module, args, kwargs):
        self._call = (kwargs.get("adapter_names"), kwargs.get("adapter_ids"))
        self._armed, self._hidden = False, None
        if not (self.fused and module.training) or "fused_lm_head" in kwargs:  # TRL's own head: its log_probs
            return None
        if isinstance(self._head, str):
            self._fallback(self._head)
            return None
        from .fused_loss import head_weight_problem

        problem = head_weight_problem(self._head.lm_head)
        if problem is not None:
            self._fallback(problem)
            return None
        if kwargs.get(self._head.keep_arg) not in (None, 0):  # the caller chose the positions it wants
            return None
        if kwargs.get("labels") is not None:
            self._fallback("the call passes `labels` to the model, whose own loss needs every position's logits")
            return None
        self._armed = True
        return args, {**kwargs, self._head.keep_arg: 1}

    def _keep_hidden(self, module, args, output):
        if self._armed:
            hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
            dev = hidden.device.type
            self._hidden = (hidden, (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))

    def _fused_sums(self, outputs, labels, names, ids):
        """Per-adapter token-loss sums and counts from the hidden states the armed forward kept."""
        from .fused_loss import adapter_token_means_from_hidden

        if self._hidden is None:
            raise RuntimeError(
                "PerAdapterLoss(fused=True): the forward call skipped its logits but the model's backbone "
                f"({type(self._head.backbone).__name__}) did not run in it, so there are no hidden states to compute "
                "the loss from; use PerAdapterLoss(model, fused=False) for this model"
            )
        (hidden, (dev, enabled, dtype)), self._hidden = self._hidden, None
        head = self._head
        with torch.autocast(dev, dtype=dtype, enabled=enabled):  # the head's matmul as in the model's forward
            if not self._checked:
                self._check_last_position(outputs, hidden, head)
            means, counts = adapter_token_means_from_hidden(
                hidden, head.lm_head, labels, names, self.vocab, adapter_ids=ids, ignore_index=self.ignore_index,
                shift=self.shift, chunk_size=self.chunk_size, logit_scale=head.logit_scale, softcap=head.softcap)
        return means * counts, counts

    def _check_last_position(self, outputs, hidden, head):
        """Once: the model's own logits of the last position are ``lm_head(hidden)`` with the post-head transform
        (a causal LM whose forward does more to its logits would otherwise train on another loss)."""
        logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
        with torch.no_grad():
            z = head.lm_head(hidden[:, -1:]).float() * head.logit_scale
            if head.softcap is not None:
                z = torch.tanh(z / head.softcap) * head.softcap
            same = logits is not None and tuple(logits.shape) == tuple(z.shape) and torch.allclose(
                logits.float(), z, rtol=1e-3 if logits.dtype == torch.float32 else 3e-2, atol=1e-3)
        if not same:
            raise ValueError(
                f"PerAdapterLoss(fused=True): the logits of {type(_causal_of(self._model)).__name__} are not its "
                "LM head applied to its backbone's last hidden state (with the known post-head transforms), so the "
                "loss cannot be computed without them; use PerAdapterLoss(model, fused=False) for this model"
            )
        self._checked = True

    # -- compute_loss_func ----------------------------------------------------------------------------------------
    def __call__(self, outputs, labels, num_items_in_batch=None):
        names, ids = self._call
        if names is None:
            raise ValueError(
                "PerAdapterLoss: the forward call carried no `adapter_names`; the collator must emit them "
                "(fast_multilora.data.MultiAdapterCollator) and the loss must be attached to the model that is called"
            )
        log_probs = outputs.get("log_probs") if isinstance(outputs, dict) else getattr(outputs, "log_probs", None)
        if log_probs is not None:  # TRL's fused LM head: next-token log-probabilities, no logits
            mask = outputs["label_mask"] if isinstance(outputs, dict) else outputs.label_mask
            means, counts = adapter_log_prob_means(log_probs, mask, names, self.vocab, adapter_ids=ids)
            sums = means * counts
        elif self._armed:  # the forward built no logits: the loss from the hidden states
            self._armed = False
            sums, counts = self._fused_sums(outputs, labels, names, ids)
        else:
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs.logits
            sums, counts = adapter_token_sums(logits, labels, names, self.vocab, adapter_ids=ids,
                                              ignore_index=self.ignore_index, shift=self.shift)
        training = self._model.training if self._model is not None else torch.is_grad_enabled()
        # summed on the loss's device (a .cpu() here would make the host wait for the forward every step); read at
        # logging only. Local: on_log all-reduces both
        acc = self._stats.setdefault(training, [torch.zeros(len(self.vocab), device=sums.device),
                                                torch.zeros(len(self.vocab), device=sums.device)])
        acc[0] += sums.detach().float()
        acc[1] += counts.detach().float()
        if self.sync_counts and _dist_world() > 1:
            counts = counts.detach().clone()
            torch.distributed.all_reduce(counts)
        loss = (sums / counts.clamp(min=1)).sum()
        if training and self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        return loss

    # -- callback -------------------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self.gradient_accumulation_steps = int(args.gradient_accumulation_steps)
        self.sync_counts = bool(getattr(args, "average_tokens_across_devices", True))
        self._stats.clear()

    def _flush(self, training: bool) -> Dict[str, float]:
        acc = self._stats.pop(training, None)
        if acc is None:
            acc = [torch.zeros(len(self.vocab)), torch.zeros(len(self.vocab))]
        s, c = acc[0].cpu(), acc[1].cpu()
        if _dist_world() > 1:
            both = torch.stack([s, c]).to(_comm_device())
            torch.distributed.all_reduce(both)
            s, c = both[0].cpu(), both[1].cpu()
        return {n: float(s[i] / c[i]) for i, n in enumerate(self.vocab) if c[i] > 0}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None:
            return
        if "loss" in logs:
            prefix, training = "loss/", True
        elif any(k.startswith("eval_") for k in logs):
            prefix, training = "eval_loss/", False
        else:
            return
        extra = {f"{prefix}{n}": round(v, 4) for n, v in self._flush(training).items()}
        logs.update(extra)
        if state.log_history:  # Trainer.log appended a copy before calling callbacks
            state.log_history[-1].update(extra)


def _causal_of(model):
    from .fused_loss import _causal_lm

    return _causal_lm(model)


def _comm_device():
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PerAdapterGradClip(TrainerCallback):
    """Trainer callback: clip each adapter's gradient norm on its own, just before ``optimizer.step()``.

    Use with ``TrainingArguments(max_grad_norm=0)`` (the Trainer's own clip is global: one adapter's large gradient
    would shrink the steps of all others). Norms are per optimizer param group, so build the optimizer with
    :func:`fast_multilora.data.adapter_param_groups` (``Trainer(..., optimizers=(optimizer, None))``); a Trainer
    default optimizer groups by weight decay instead, and then the adapters are found by parameter name.
    """

    def __init__(self, max_norm: float = 1.0, model: Optional[torch.nn.Module] = None):
        self.max_norm = max_norm
        self._groups = None
        if model is not None:
            self._groups = _groups_by_name(model)
        self.last_norms: Dict = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        from .data import clip_grad_norm_per_adapter

        if self.max_norm <= 0:
            return
        groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
        if not groups or any("adapter" not in g for g in groups):
            if self._groups is None and model is not None:
                self._groups = _groups_by_name(model)
            groups = self._groups
        if groups:
            self.last_norms = clip_grad_norm_per_adapter(groups, self.max_norm)


def _groups_by_name(model):
    from .data import adapter_param_groups

    return adapter_param_groups(model)


# ---------------------------------------------------------------------------------------------------------------------
# the whole wiring in one call


def trainer_kwargs(model: torch.nn.Module, tokenizer=None, args=None, *, adapter_lr: Optional[Dict[str, float]] = None,
                   max_grad_norm: Optional[float] = None, group_by_adapter: Optional[bool] = None,
                   data_collator=None, optimizer=None, callbacks: Sequence = (), fused_loss: bool = True,
                   chunk_size: Optional[int] = None) -> dict:
    """Keyword arguments of an unmodified ``transformers.Trainer`` that trains every adapter of a patched PEFT model
    in mixed batches::

        fast_multilora.patch(model)                                  # a PeftModel with several trainable adapters
        trainer = Trainer(**fast_multilora.trainer_kwargs(model, tokenizer, TrainingArguments(...)),
                          train_dataset=samples)                     # samples: input_ids, labels, adapter_name
        trainer.train()                                              # logs loss/<adapter>

    Returns ``model``, ``args``, ``data_collator``, ``compute_loss_func``, ``callbacks`` and, where given,
    ``processing_class`` (``tokenizer``) and ``optimizers``:

    * ``data_collator``: :class:`~fast_multilora.data.MultiAdapterCollator` (``group_by_adapter`` rows, default
      True), or the one given (e.g. :class:`~fast_multilora.data.PackedCollator`; ``group_by_adapter`` then is
      refused).
    * ``compute_loss_func`` and the first callback: :class:`PerAdapterLoss` (``fused=fused_loss``: by default the
      loss is computed from the last hidden states without full-vocabulary logits where the model's forward allows,
      else from the logits with a warning; ``chunk_size`` as there). Logs ``loss/<adapter>``.
    * :class:`PerAdapterGradClip` clipping each adapter's gradient to ``max_grad_norm`` (default:
      ``args.max_grad_norm``, the Trainer's own setting, 1.0 unless changed; 0 = no clipping), then ``callbacks``.
    * ``optimizers=(optimizer, None)`` when ``adapter_lr`` (``{adapter: lr}``; the others ``args.learning_rate``)
      or ``optimizer`` is given: with ``adapter_lr``, the optimizer ``args.optim`` names (as the Trainer would
      build it, ``Trainer.get_optimizer_cls_and_kwargs``) over one param group per adapter
      (:func:`~fast_multilora.data.adapter_param_groups`, ``args.weight_decay``). Otherwise the Trainer builds its
      own. The LR schedule is the Trainer's in both cases.
    * ``args``: ``args`` (default ``TrainingArguments("tmp_trainer")``, as the Trainer's) with
      ``remove_unused_columns=False`` (the Trainer would drop the samples' ``adapter_name`` before the collator)
      and ``max_grad_norm=0`` (its global clip would couple the adapters: one adapter's large gradient would shrink
      every other's step). Where ``args`` says otherwise, a copy is returned (``dataclasses.replace``; the given
      object is left as it is) with a ``UserWarning`` naming each change; give them so to silence it.

    Raises where the wiring cannot work: a model that is not patched or has no adapters, TRL's ``SFTConfig`` (use
    :class:`fast_multilora.trl.MultiAdapterSFTTrainer`: TRL's ``SFTTrainer`` runs a second forward for a
    ``compute_loss_func``), ``adapter_lr`` together with ``optimizer``, ``group_by_adapter`` with
    ``data_collator``. Warns for one adapter only and for adapters with no trainable parameter (PEFT makes only
    the active adapter trainable).
    """
    import dataclasses

    from transformers import Trainer, TrainingArguments

    from .data import MultiAdapterCollator, _known_adapters, adapter_of_parameter, adapter_param_groups
    from .patching import _ROUTER_ATTR

    if not any(_ROUTER_ATTR in m.__dict__ for m in model.modules()):
        raise ValueError("trainer_kwargs: the model is not patched; call fast_multilora.patch(model) on the PeftModel "
                         "first")
    adapters = _known_adapters(model)
    if not adapters:
        raise ValueError("trainer_kwargs: the model has no LoRA adapters; add them (peft_model.add_adapter(name, "
                         "config), or fast_multilora.add_adapters) before building the Trainer")
    if len(adapters) == 1:
        warnings.warn(f"trainer_kwargs: the model has one adapter ({adapters[0]!r}): the per-adapter loss is its "
                      "mean token loss; fast_multilora is for training several adapters in one batch", stacklevel=2)
    trained = {a for a in (adapter_of_parameter(n, adapters) for n, p in model.named_parameters() if p.requires_grad)}
    frozen = [a for a in adapters if a not in trained]
    if frozen:
        warnings.warn(f"trainer_kwargs: adapter(s) {frozen} have no trainable parameter and will not train (PEFT "
                      "makes only the active adapter trainable); to train every adapter: for n, p in "
                      "model.named_parameters(): p.requires_grad_('lora_' in n)", stacklevel=2)
    if args is None:
        args = TrainingArguments(output_dir="tmp_trainer", remove_unused_columns=False, max_grad_norm=0.0)
    elif type(args).__module__.split(".")[0] == "trl":
        raise TypeError(f"trainer_kwargs: args is TRL's {type(args).__name__}; with TRL use "
                        "fast_multilora.trl.MultiAdapterSFTTrainer(model, args=..., train_dataset=...), which keeps "
                        "TRL's tokenization and fused LM head (SFTTrainer would run a second forward for a "
                        "compute_loss_func)")
    elif not isinstance(args, TrainingArguments):
        raise TypeError(f"trainer_kwargs: args must be a transformers.TrainingArguments, got {type(args).__name__}")
    if max_grad_norm is None:
        max_grad_norm = float(args.max_grad_norm or 0.0)
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm >= 0:
        raise ValueError(f"trainer_kwargs: max_grad_norm must be a number >= 0 (each adapter's gradient norm; 0 = "
                         f"no clipping), got {max_grad_norm!r}")
    changes = {}
    if args.remove_unused_columns:
        changes["remove_unused_columns"] = (False, "the Trainer would drop the samples' adapter_name before the "
                                                   "collator")
    if args.max_grad_norm:
        clip = f"each adapter is clipped on its own to {max_grad_norm}" if max_grad_norm else "no clipping"
        changes["max_grad_norm"] = (0.0, f"the Trainer's global clip is off; {clip}")
    if changes:
        said = "; ".join(f"{k}={getattr(args, k)!r} -> {v!r} ({why})" for k, (v, why) in changes.items())
        warnings.warn(f"trainer_kwargs: returned a copy of args with {said}. Set these in TrainingArguments to "
                      "silence this warning", stacklevel=2)
        args = dataclasses.replace(args, **{k: v for k, (v, _) in changes.items()})

    if data_collator is None:
        data_collator = MultiAdapterCollator(tokenizer, group_by_adapter=True if group_by_adapter is None
                                             else bool(group_by_adapter))
    elif group_by_adapter is not None:
        raise ValueError("trainer_kwargs: group_by_adapter is a setting of the default collator "
                         "(MultiAdapterCollator); with your own data_collator leave it out")
    if adapter_lr is not None and optimizer is not None:
        raise ValueError("trainer_kwargs: give adapter_lr (an optimizer is built from args with one param group "
                         "per adapter) or optimizer (yours), not both")
    if adapter_lr is not None:
        groups = adapter_param_groups(model, {a: {"lr": float(lr)} for a, lr in dict(adapter_lr).items()},
                                      default={"weight_decay": args.weight_decay})
        cls, opt_kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = cls(groups, **opt_kwargs)

    loss = PerAdapterLoss(model, fused=fused_loss, chunk_size=chunk_size)
    clip_cb = [PerAdapterGradClip(max_grad_norm)] if max_grad_norm > 0 else []
    out = dict(model=model, args=args, data_collator=data_collator, compute_loss_func=loss,
               callbacks=[loss, *clip_cb, *callbacks])
    if tokenizer is not None:
        out["processing_class"] = tokenizer
    if optimizer is not None:
        out["optimizers"] = (optimizer, None)
    return out

