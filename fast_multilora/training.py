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
  loss-scaling convention for ``compute_loss_func`` and logs ``loss/<adapter>`` entries.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch
from transformers import TrainerCallback

from .loss import AdapterLosses, adapter_log_prob_means, adapter_token_means

__all__ = ["PerAdapterLoss", "adapter_token_sums", "distributed_per_adapter_loss"]


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
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, vocab: Optional[Sequence[str]] = None, *,
                 ignore_index: int = -100, shift: bool = True):
        self.vocab = list(vocab) if vocab is not None else None
        self.ignore_index = ignore_index
        self.shift = shift
        self.gradient_accumulation_steps = 1
        self.sync_counts = True
        self._model = None
        self._handle = None
        self._call: Tuple = (None, None)
        self._stats: Dict[bool, list] = {}
        if model is not None:
            self.attach(model)

    # -- wiring ---------------------------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> "PerAdapterLoss":
        """Record ``adapter_names`` / ``adapter_ids`` of every forward call of ``model`` (the PeftModel)."""
        if self._handle is not None:
            self._handle.remove()
        self._model = model
        if self.vocab is None:
            from .data import _known_adapters

            self.vocab = _known_adapters(model)
        self._handle = model.register_forward_pre_hook(self._record, with_kwargs=True, prepend=True)
        return self

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _record(self, module, args, kwargs):
        self._call = (kwargs.get("adapter_names"), kwargs.get("adapter_ids"))

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
