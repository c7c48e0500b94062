"""TRL's ``SFTTrainer`` training many adapters of one patched PEFT model in one mixed batch.

    from fast_multilora.trl import MultiAdapterSFTTrainer

    fast_multilora.patch(model)                                   # a PeftModel with adapters "sql", "chat", ...
    trainer = MultiAdapterSFTTrainer(model, args=SFTConfig(...), train_dataset=ds, processing_class=tok)
    trainer.train()                                               # ds: prompt/completion (or text) + "adapter_name"

``MultiAdapterSFTTrainer`` is ``trl.SFTTrainer`` with three additions, everything else (tokenization, chat
templates, completion-only and assistant-only labels, packing, the fused LM head, its metrics) is TRL's own:

* **Routing**: the samples' adapter column (``adapter_key``, default ``"adapter_name"``; ``"__base__"`` = no
  adapter) survives dataset preparation, and the collator TRL builds is wrapped so that each batch carries
  ``adapter_names`` (one per padded row), or ``adapter_ids`` per token (packed and padding-free rows) with
  ``adapter_names`` = the adapter vocabulary. ``train_dataset`` may also be ``{adapter: dataset}``: the datasets are
  concatenated with the adapter column added, and an :class:`~fast_multilora.data.AdapterInterleaveSampler` takes
  them round-robin, so every batch holds every adapter in equal parts.
* **Packing** (``SFTConfig(packing=True)``): TRL packs only ``input_ids`` and ``labels``; here every token also
  carries its sample's adapter index (a per-token column packed with them by TRL's ``pack_dataset``), so a packed
  row mixes adapters and routes per token (``bfd``: padding-free rows whose ``position_ids`` restart at each sample;
  ``wrapped``: as TRL wraps them).
* **Loss**: :class:`~fast_multilora.training.PerAdapterLoss`, the sum over adapters of each adapter's mean token
  loss, read from the per-token log-probabilities of TRL's fused LM head (no logits are built, no extra forward);
  the logs gain ``loss/<adapter>`` (and ``eval_loss/<adapter>``) beside TRL's metrics. Scaled as the Trainer
  expects: divided by the gradient-accumulation steps here, per-adapter token counts all-reduced and the loss
  multiplied by the number of processes with ``average_tokens_across_devices`` (DDP's gradient mean cancels it).

Save the adapters with PEFT: ``model.save_pretrained(dir, selected_adapters=[...])``.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Mapping, Optional, Sequence

import torch
from trl import SFTTrainer, pack_dataset

from .data import AdapterInterleaveSampler, _known_adapters
from .plan import BASE
from .training import PerAdapterLoss

__all__ = ["ADAPTER_IDS", "AdapterRoutingCollator", "MultiAdapterSFTTrainer"]

# the per-token adapter column of packed datasets (indices into the adapter vocabulary, -1 = base)
ADAPTER_IDS = "adapter_ids"


def _adapter_of(example: Mapping, adapter_key: str, index: Mapping[str, int]) -> str:
    if adapter_key not in example:
        raise KeyError(
            f"an example carries no {adapter_key!r} column (the adapter of each sample); columns: {sorted(example)}. "
            "Add it to the dataset, or name the column with adapter_key=..."
        )
    name = example[adapter_key]
    if name is None:
        return BASE
    if name != BASE and name not in index:
        raise ValueError(f"example adapter {name!r} is not one of the model's adapters {list(index)} (or {BASE!r})")
    return name


class AdapterRoutingCollator:
    """Wrap a collator of token rows (TRL's ``DataCollatorForLanguageModeling``, padded or ``padding_free``) so that
    its batches carry the routing of :func:`fast_multilora.patch`.

    Examples carry their adapter's name under ``adapter_key``, or (packed examples) a per-token list of indices into
    ``vocab`` under ``"adapter_ids"`` (-1 = base). Padded rows of one sample each get ``adapter_names`` (one per
    row); otherwise (packed or ``padding_free`` rows) the batch gets ``adapter_ids`` laid out as the collator lays
    out ``input_ids`` (right padding, -1; all examples in one row when ``padding_free``) and ``adapter_names`` =
    ``vocab``.
    """

    def __init__(self, collator, vocab: Sequence[str], *, adapter_key: str = "adapter_name",
                 padding_free: bool = False):
        self.collator = collator
        self.vocab = list(vocab)
        self.adapter_key = adapter_key
        self.padding_free = padding_free
        self._index = {n: i for i, n in enumerate(self.vocab)}

    def _name(self, example: Mapping) -> str:
        return _adapter_of(example, self.adapter_key, self._index)

    def __call__(self, examples: Sequence[Mapping]) -> Dict[str, Any]:
        batch = self.collator(examples)
        packed = ADAPTER_IDS in examples[0]
        if not packed and not self.padding_free:
            batch["adapter_names"] = [self._name(e) for e in examples]
            return batch
        rows = [list(e[ADAPTER_IDS]) if packed else [self._index.get(self._name(e), -1)] * len(e["input_ids"])
                for e in examples]
        if self.padding_free:
            rows = [[i for r in rows for i in r]]
        shape = tuple(batch["input_ids"].shape)
        if len(rows) != shape[0] or max(len(r) for r in rows) > shape[1]:
            raise ValueError(f"the collator's input_ids {list(shape)} do not lay out the examples' tokens as rows "
                             f"of {[len(r) for r in rows]} (padding_free={self.padding_free})")
        ids = torch.full(shape, -1, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        batch["adapter_ids"] = ids
        batch["adapter_names"] = list(self.vocab)
        return batch


class MultiAdapterSFTTrainer(SFTTrainer):
    """``trl.SFTTrainer`` for a patched PEFT model with several adapters (see the module docstring).

    ``model``: a ``PeftModel`` passed through :func:`fast_multilora.patch`, its adapters trainable.
    ``train_dataset``: a dataset with an ``adapter_key`` column, or ``{adapter: dataset}``. ``adapters``: the
    adapter vocabulary (default: the model's adapters). Other arguments are ``SFTTrainer``'s.
    """

    # the loss is divided by the gradient-accumulation steps in PerAdapterLoss (transformers' Trainer reads this)
    loss_is_scaled_for_ga = True

    def __init__(self, model, args=None, train_dataset=None, eval_dataset=None, *, adapter_key: str = "adapter_name",
                 adapters: Optional[Sequence[str]] = None, **kwargs):
        if kwargs.get("compute_loss_func") is not None:
            raise ValueError("MultiAdapterSFTTrainer computes the per-adapter loss itself; pass no compute_loss_func")
        self.adapter_key = adapter_key
        self.adapter_vocab = list(adapters) if adapters is not None else _known_adapters(model)
        self._interleave = isinstance(train_dataset, Mapping)
        if self._interleave:
            train_dataset = _concatenate(train_dataset, adapter_key)
        self.adapter_loss = PerAdapterLoss(model, self.adapter_vocab)
        super().__init__(model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset, **kwargs)
        self.data_collator = AdapterRoutingCollator(self.data_collator, self.adapter_vocab, adapter_key=adapter_key,
                                                    padding_free=self.padding_free)
        self.add_callback(self.adapter_loss)

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        for c in (self.adapter_key, ADAPTER_IDS):
            if c not in self._signature_columns:
                self._signature_columns = [*self._signature_columns, c]

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        if not packing:
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)
        # TRL packs only input_ids and labels: prepare the samples unpacked (untruncated, as TRL's packing leaves
        # cutting to pack_dataset), give every token its sample's adapter index, and pack the three columns
        unpacked = copy.copy(args)
        unpacked.max_length = None
        dataset = super()._prepare_dataset(dataset, processing_class, unpacked, False, formatting_func, dataset_name)
        index = {n: i for i, n in enumerate(self.adapter_vocab)}
        map_kwargs = {"num_proc": args.dataset_num_proc} if hasattr(dataset, "num_rows") else {}

        def token_adapters(example):
            slot = index.get(_adapter_of(example, self.adapter_key, index), -1)
            return {ADAPTER_IDS: [slot] * len(example["input_ids"])}

        dataset = dataset.map(token_adapters, **map_kwargs).select_columns(["input_ids", "labels", ADAPTER_IDS])
        dataset = pack_dataset(dataset, args.max_length, args.packing_strategy, map_kwargs)
        return dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset

    def _get_train_sampler(self, train_dataset=None):
        ds = self.train_dataset if train_dataset is None else train_dataset
        if self._interleave and self.adapter_key in getattr(ds, "column_names", ()):
            return AdapterInterleaveSampler(ds[self.adapter_key], seed=self.args.seed)
        return super()._get_train_sampler(train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        seen = []  # the outputs of TRL's forward call (its first: the fused LM head's log-probabilities)
        handle = self.model.register_forward_hook(lambda m, a, out: seen.append(out) if not seen else None)
        try:
            result = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                          num_items_in_batch=num_items_in_batch)  # TRL's forward and metrics
        finally:
            handle.remove()
        loss = self.adapter_loss(seen[0], inputs["labels"])
        if self.adapter_loss.sync_counts and self.accelerator.num_processes > 1:
            loss = loss * self.accelerator.num_processes  # DDP averages gradients over the processes
        return (loss, result[1]) if return_outputs else loss


def _concatenate(datasets: Mapping[str, Any], adapter_key: str):
    from datasets import concatenate_datasets

    parts = []
    for name, ds in datasets.items():
        if adapter_key in ds.column_names:
            raise ValueError(f"dataset of adapter {name!r} already has a column {adapter_key!r}")
        parts.append(ds.add_column(adapter_key, [name] * len(ds)))
    return concatenate_datasets(parts)
