"""Batching for mixed-adapter training: padding collator, packed rows, per-adapter optimizer groups.

* :class:`MultiAdapterCollator` -- for ``torch.utils.data.DataLoader`` and ``transformers.Trainer``: pads samples of
  different adapters into one batch and emits ``adapter_names`` (one name per row, ``"__base__"`` = no adapter).
  ``group_by_adapter=True`` orders rows by adapter, so each adapter's rows are adjacent (the SGEMM family then
  reads runs of rows of one adapter; the family itself is chosen from shapes, see ``fast_multilora.plan``).
* :func:`pack_samples` / :class:`PackedCollator` -- several samples (of any adapters) per row: ``adapter_ids``
  ``[rows, seq]`` index into ``adapter_names`` (-1 = base / padding), ``position_ids`` restart at every packed
  sample, labels are -100 at every sample's first token (nothing is predicted across a boundary). Attention across
  samples is prevented by transformers itself: with ``attention_mask=None`` and no KV cache, transformers >= 4.56
  derives a block-diagonal causal mask from restarting ``position_ids`` (``masking_utils.find_packed_sequence_indices``,
  sdpa and eager alike). ``attention="4d"`` instead emits an explicit additive 4-D mask (any attention that accepts
  a 4-D float mask).
* :class:`AdapterInterleaveSampler` -- a sampler over samples of several adapters (e.g. one dataset per adapter,
  concatenated) that takes them round-robin, so every batch holds every adapter in equal parts.
* :func:`adapter_param_groups` -- one optimizer param group per adapter (own ``lr``, ``weight_decay``, ...);
  :func:`clip_grad_norm_per_adapter` clips each adapter's gradient on its own (a global clip would couple adapters:
  one adapter's large gradient would shrink every other adapter's step).

Samples are dicts with ``input_ids`` (list or 1-D tensor), optionally ``labels`` (same length, -100 = not trained;
default: a copy of ``input_ids``) and the adapter name under ``adapter_key`` (default ``"adapter_name"``; missing =
``"__base__"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

import torch

from .plan import BASE

__all__ = [
    "AdapterInterleaveSampler",
    "MultiAdapterCollator",
    "PackedCollator",
    "adapter_of_parameter",
    "adapter_param_groups",
    "clip_grad_norm_per_adapter",
    "pack_samples",
    "packed_attention_mask",
]


def _as_list(x) -> List[int]:
    if torch.is_tensor(x):
        return [int(v) for v in x.reshape(-1).tolist()]
    return [int(v) for v in x]


def _pad_id(pad_token_id, tokenizer) -> int:
    if pad_token_id is not None:
        return int(pad_token_id)
    if tokenizer is not None:
        pid = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pid is not None:
            return int(pid)
    return 0


def _sample_name(sample: Mapping, adapter_key: str) -> str:
    name = sample.get(adapter_key, BASE)
    if name is None:
        return BASE
    if not isinstance(name, str):
        raise TypeError(f"sample[{adapter_key!r}] must be an adapter name (str), got {type(name).__name__}")
    return name


def _missing_key_error(adapter_key: str) -> KeyError:
    return KeyError(
        f"samples carry no {adapter_key!r} key. With transformers.Trainer set "
        "TrainingArguments(remove_unused_columns=False): otherwise the Trainer drops columns that the model's "
        "forward() does not name before they reach the collator. Pass require_adapter=False to treat such samples "
        f"as {BASE!r} rows."
    )


@dataclass
class MultiAdapterCollator:
    """Pad a list of samples into one mixed batch: ``input_ids``, ``attention_mask``, ``labels``, ``adapter_names``.

    ``tokenizer`` (or ``pad_token_id``) gives the pad id. ``padding_side``: ``"right"`` for training, ``"left"`` for
    generation prompts. ``group_by_adapter=True`` sorts rows by adapter (stable, base rows last): the batch is the
    same multiset of samples, but each adapter's rows are contiguous, which lets the kernels use long segments.
    ``max_length`` truncates, ``pad_to_multiple_of`` rounds the padded length up.
    """

    tokenizer: Any = None
    pad_token_id: Optional[int] = None
    adapter_key: str = "adapter_name"
    label_pad_token_id: int = -100
    padding_side: str = "right"
    pad_to_multiple_of: Optional[int] = None
    max_length: Optional[int] = None
    group_by_adapter: bool = False
    require_adapter: bool = True

    def __call__(self, features: Sequence[Mapping]) -> Dict[str, Any]:
        if not features:
            raise ValueError("empty batch")
        if self.padding_side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {self.padding_side!r}")
        if self.require_adapter and any(self.adapter_key not in f for f in features):
            raise _missing_key_error(self.adapter_key)
        names = [_sample_name(f, self.adapter_key) for f in features]
        order = list(range(len(features)))
        if self.group_by_adapter:
            first = {}
            for n in names:
                first.setdefault(n, len(first))
            order.sort(key=lambda i: (names[i] == BASE, first[names[i]]))
        pad = _pad_id(self.pad_token_id, self.tokenizer)
        ids, labs, masks = [], [], []
        for i in order:
            f = features[i]
            x = _as_list(f["input_ids"])
            y = _as_list(f["labels"]) if f.get("labels") is not None else list(x)
            m = _as_list(f["attention_mask"]) if f.get("attention_mask") is not None else [1] * len(x)
            if len(y) != len(x) or len(m) != len(x):
                raise ValueError(f"sample {i}: input_ids, labels and attention_mask differ in length")
            if self.max_length is not None:
                x, y, m = x[: self.max_length], y[: self.max_length], m[: self.max_length]
            if f.get("labels") is None:
                y = [t if k else self.label_pad_token_id for t, k in zip(y, m, strict=True)]
            ids.append(x)
            labs.append(y)
            masks.append(m)
        T = max(len(x) for x in ids)
        if self.pad_to_multiple_of:
            T = int(math.ceil(T / self.pad_to_multiple_of) * self.pad_to_multiple_of)

        def padded(rows, value):
            out = torch.full((len(rows), T), value, dtype=torch.long)
            for r, row in enumerate(rows):
                if not row:
                    continue
                if self.padding_side == "right":
                    out[r, : len(row)] = torch.tensor(row)
                else:
                    out[r, T - len(row) :] = torch.tensor(row)
            return out

        return {
            "input_ids": padded(ids, pad),
            "attention_mask": padded(masks, 0),
            "labels": padded(labs, self.label_pad_token_id),
            "adapter_names": [names[i] for i in order],
        }


class AdapterInterleaveSampler(torch.utils.data.Sampler):
    """Indices of a dataset whose samples belong to several adapters, taken round-robin over the adapters.

    ``adapter_of_index[i]`` is sample ``i``'s adapter (e.g. ``dataset["adapter"]`` of datasets concatenated one per
    adapter). Each pass shuffles every adapter's samples (``shuffle=True``; a new order per pass, from ``seed``) and
    yields one sample of each adapter in turn, in the order the adapters first occur, so any ``k * n_adapters``
    consecutive indices hold ``k`` samples of every adapter; an adapter that runs out drops out of the rotation.
    """

    def __init__(self, adapter_of_index: Sequence[str], *, shuffle: bool = True, seed: int = 0):
        self.adapters: Dict[str, List[int]] = {}
        for i, name in enumerate(adapter_of_index):
            self.adapters.setdefault(name, []).append(i)
        self.n = len(adapter_of_index)
        self.shuffle = shuffle
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        queues = []
        for rows in self.adapters.values():
            order = torch.randperm(len(rows), generator=self.generator).tolist() if self.shuffle else range(len(rows))
            queues.append([rows[k] for k in order])
        for k in range(max((len(q) for q in queues), default=0)):
            for q in queues:
                if k < len(q):
                    yield q[k]


# ---------------------------------------------------------------------------------------------------------------------
# packed rows


def _first_fit(lengths: Sequence[int], max_length: int) -> List[List[int]]:
    """Bins of sample indices (first fit, longest first); each bin's total length <= max_length."""
    bins: List[List[int]] = []
    room: List[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_length - lengths[i])
    for b in bins:  # keep dataset order inside a row
        b.sort()
    return bins


def _in_order(lengths: Sequence[int], max_length: int) -> List[List[int]]:
    bins: List[List[int]] = [[]]
    used = 0
    for i, n in enumerate(lengths):
        if used + n > max_length and bins[-1]:
            bins.append([])
            used = 0
        bins[-1].append(i)
        used += n
    return bins


def packed_attention_mask(position_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive 4-D attention mask ``[rows, 1, seq, seq]`` for packed rows: causal within each packed sample, no
    attention across samples (a sample starts wherever ``position_ids`` does not increase by one)."""
    pos = position_ids
    start = torch.ones_like(pos, dtype=torch.bool)
    start[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    seq = start.long().cumsum(-1)  # [R, T] packed-sample index of each token
    T = pos.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=pos.device).tril()
    allowed = (seq[:, :, None] == seq[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def pack_samples(samples: Sequence[Mapping], max_length: int, *, pad_token_id: int = 0,
                 adapter_key: str = "adapter_name", label_pad_token_id: int = -100,
                 adapter_names: Optional[Sequence[str]] = None, strategy: str = "first_fit",
                 attention: str = "position_ids", mask_dtype: torch.dtype = torch.float32,
                 pad_to_max_length: bool = False) -> Dict[str, Any]:
    """Pack samples of (possibly) different adapters into rows of at most ``max_length`` tokens.

    Returns ``input_ids``, ``labels``, ``position_ids``, ``adapter_ids`` (all ``[rows, seq]``) and ``adapter_names``
    (the vocabulary ``adapter_ids`` index; -1 marks base samples and padding). ``position_ids`` restart at 0 for every
    sample (padding counts as one more sample); labels are ``label_pad_token_id`` at every sample's first token and
    on padding. ``attention="position_ids"`` (default) emits no attention mask: transformers derives the
    block-diagonal mask from ``position_ids`` (call the model with ``use_cache=False``: transformers 5 builds a KV cache
    in training forwards too, and a cache turns that mask off; :class:`PackedCollator`'s batch says so itself);
    ``attention="4d"`` adds ``attention_mask`` = :func:`packed_attention_mask`. Samples longer than ``max_length``
    are truncated. ``strategy``: ``"first_fit"`` (fewest rows) or ``"in_order"`` (keeps sample order). The result
    also holds ``sample_spans``: per sample ``(row, start, length)``.
    """
    if attention not in ("position_ids", "4d"):
        raise ValueError(f"attention must be 'position_ids' or '4d', got {attention!r}")
    if not samples:
        raise ValueError("no samples to pack")
    seqs, labs, names = [], [], []
    for s in samples:
        x = _as_list(s["input_ids"])[:max_length]
        y = _as_list(s["labels"])[:max_length] if s.get("labels") is not None else list(x)
        if len(y) != len(x):
            raise ValueError("input_ids and labels differ in length")
        if not x:
            raise ValueError("empty sample")
        seqs.append(x)
        labs.append(y)
        names.append(_sample_name(s, adapter_key))
    vocab = list(adapter_names) if adapter_names is not None else []
    if adapter_names is None:
        for n in names:
            if n != BASE and n not in vocab:
                vocab.append(n)
    index = {n: i for i, n in enumerate(vocab) if n != BASE}
    missing = sorted({n for n in names if n != BASE and n not in index})
    if missing:
        raise ValueError(f"adapter(s) {missing} are not in adapter_names={vocab}")
    lengths = [len(x) for x in seqs]
    if strategy == "first_fit":
        bins = _first_fit(lengths, max_length)
    elif strategy == "in_order":
        bins = _in_order(lengths, max_length)
    else:
        raise ValueError(f"strategy must be 'first_fit' or 'in_order', got {strategy!r}")
    T = max_length if pad_to_max_length else max(sum(lengths[i] for i in b) for b in bins)
    R = len(bins)
    input_ids = torch.full((R, T), pad_token_id, dtype=torch.long)
    labels = torch.full((R, T), label_pad_token_id, dtype=torch.long)
    adapter_ids = torch.full((R, T), -1, dtype=torch.long)
    position_ids = torch.zeros((R, T), dtype=torch.long)
    spans = [None] * len(seqs)
    for r, b in enumerate(bins):
        t = 0
        for i in b:
            n = lengths[i]
            input_ids[r, t : t + n] = torch.tensor(seqs[i])
            lab = torch.tensor(labs[i])
            lab[0] = label_pad_token_id  # nothing predicts a sample's first token from the previous sample
            labels[r, t : t + n] = lab
            adapter_ids[r, t : t + n] = index.get(names[i], -1)
            position_ids[r, t : t + n] = torch.arange(n)
            spans[i] = (r, t, n)
            t += n
        position_ids[r, t:] = torch.arange(T - t)  # padding: one more "sample", never trained
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "adapter_ids": adapter_ids,
        "adapter_names": vocab,
        "sample_spans": spans,
    }
    if attention == "4d":
        out["attention_mask"] = packed_attention_mask(position_ids, mask_dtype)
    return out


@dataclass
class PackedCollator:
    """Collator that packs each incoming list of samples into rows of at most ``max_length`` tokens.

    Emits ``input_ids``, ``labels``, ``position_ids``, ``adapter_ids``, ``adapter_names`` (and ``attention_mask`` with
    ``attention="4d"``) and ``use_cache=False``, ready for ``model(**batch)``. ``adapter_names`` fixes the id
    vocabulary (default: the names of the batch, in order of appearance). ``use_cache=False``: transformers 5 builds
    a KV cache in a training forward unless told not to (HF ``Trainer`` turns it off in the model's config), and
    with a cache it derives no block-diagonal mask from ``position_ids``: packed samples would attend to each other.
    """

    max_length: int
    tokenizer: Any = None
    pad_token_id: Optional[int] = None
    adapter_key: str = "adapter_name"
    label_pad_token_id: int = -100
    adapter_names: Optional[Sequence[str]] = None
    strategy: str = "first_fit"
    attention: str = "position_ids"
    mask_dtype: torch.dtype = torch.float32
    require_adapter: bool = True

    def __call__(self, features: Sequence[Mapping]) -> Dict[str, Any]:
        if self.require_adapter and any(self.adapter_key not in f for f in features):
            raise _missing_key_error(self.adapter_key)
        out = pack_samples(
            features, self.max_length, pad_token_id=_pad_id(self.pad_token_id, self.tokenizer),
            adapter_key=self.adapter_key, label_pad_token_id=self.label_pad_token_id,
            adapter_names=self.adapter_names, strategy=self.strategy, attention=self.attention,
            mask_dtype=self.mask_dtype,
        )
        out.pop("sample_spans")
        out["use_cache"] = False
        return out


# ---------------------------------------------------------------------------------------------------------------------
# per-adapter optimizer settings

# PEFT keeps every adapter's tensors in containers keyed by adapter name: ``...lora_A.<adapter>.weight``,
# ``...lora_embedding_A.<adapter>``, ``...modules_to_save.<adapter>.weight``, ``...trainable_tokens_delta.<adapter>``
_CONTAINERS = ("modules_to_save", "trainable_tokens_delta")


def _known_adapters(model) -> List[str]:
    cfg = getattr(model, "peft_config", None)
    known = set(cfg) if isinstance(cfg, dict) else set()
    for m in model.modules():
        a = getattr(m, "lora_A", None)
        if isinstance(a, torch.nn.ModuleDict):
            known.update(a.keys())
    return sorted(known)


def adapter_of_parameter(param_name: str, adapters: Iterable[str]) -> Optional[str]:
    """The adapter a PEFT parameter name belongs to (``None`` for base / shared parameters)."""
    adapters = set(adapters)
    parts = param_name.split(".")
    for i in range(1, len(parts)):
        if parts[i] in adapters and (parts[i - 1].startswith("lora_") or parts[i - 1] in _CONTAINERS):
            return parts[i]
    return None


def adapter_param_groups(model: torch.nn.Module, settings: Optional[Mapping[str, Mapping]] = None, *,
                         default: Optional[Mapping] = None, trainable_only: bool = True) -> List[dict]:
    """Optimizer param groups, one per adapter, for ``torch.optim.*(groups, lr=...)``.

    ``settings``: ``{adapter: {"lr": ..., "weight_decay": ..., ...}}`` (any optimizer group option); adapters not
    listed get ``default`` (or the optimizer's defaults). Each group carries an ``"adapter"`` key (the name) that
    torch keeps in ``optimizer.param_groups`` -- handy for logging and :func:`clip_grad_norm_per_adapter`.
    Trainable parameters that belong to no adapter form a last group with ``"adapter": None``.
    """
    settings = dict(settings or {})
    known = _known_adapters(model)
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"settings for unknown adapter(s) {unknown}; the model has {known}")
    by_adapter: Dict[Optional[str], list] = {n: [] for n in known}
    by_adapter[None] = []
    for name, p in model.named_parameters():
        if trainable_only and not p.requires_grad:
            continue
        by_adapter[adapter_of_parameter(name, known)].append(p)
    groups = []
    for n in known + [None]:
        if not by_adapter[n]:
            continue
        opts = dict(default or {})
        opts.update(settings.get(n, {}) if n is not None else {})
        groups.append({"params": by_adapter[n], "adapter": n, **opts})
    return groups


def clip_grad_norm_per_adapter(groups_or_optimizer, max_norm: float, norm_type: float = 2.0) -> Dict[Any, float]:
    """Clip each adapter's gradients to ``max_norm`` independently; returns ``{adapter: pre-clip norm}``.

    Takes an optimizer built from :func:`adapter_param_groups` (or the groups themselves). Call it after gradients
    are complete (after DDP's all-reduce, i.e. after ``backward``), before ``optimizer.step()``.
    """
    groups = getattr(groups_or_optimizer, "param_groups", groups_or_optimizer)
    names, norms = [], []
    for g in groups:
        params = [p for p in g["params"] if p.grad is not None]
        if not params:
            continue
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
        if hasattr(norm, "full_tensor"):  # FSDP2: DTensor gradients give a DTensor norm (partial over ranks)
            norm = norm.full_tensor()
        names.append(g.get("adapter"))
        norms.append(norm.detach().reshape(()).to(torch.float64))  # (exact for every float dtype)
    # the norms read back together: one device sync per call, not one per adapter (each would stall the next
    # adapter's clip until the GPU drained)
    values = torch.stack([n.to(norms[0].device) for n in norms]).tolist() if norms else []
    return dict(zip(names, values, strict=True))
