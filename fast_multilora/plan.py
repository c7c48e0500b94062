"""Routing: which adapter each sample (or token) uses, and the batch plan every patched layer shares.

A :class:`Router` belongs to one patched model. ``begin()`` is called once per forward call (by the model's forward
pre-hook, or the :func:`fast_multilora.route` context) with the per-sample ``adapter_names`` (or, for packed rows,
a name vocabulary plus per-token ``adapter_ids``). The first layer that sees an activation of a given shape builds a
:class:`BatchPlan` for it (segments on the device, one small host->device copy, no device->host sync for per-sample
names); every later layer with the same token layout, and every backward, reuses it.

The routing stays active after the forward returns so that gradient-checkpointing recomputation, which re-runs layer
forwards during ``backward()``, finds the same plan; the next forward call replaces it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .kernels.segments import Segments, segments_from_token_slots

BASE = "__base__"

# Family heuristic (benchmarks/ measure it): contiguous runs (SGEMM, no gather) when runs are long; the chunked SGMV
# family (tokens grouped by adapter through a permutation, fixed-size chunks) when runs are short -- packed rows,
# per-token routing, many one-sample runs -- since SGEMM then launches one mostly idle program column per run.
SGEMM_MIN_MEAN_RUN = 64


def choose_family(token_slots: torch.Tensor) -> str:
    """``"sgemm"`` or ``"chunked"`` for a host tensor of per-token slots (``-1`` = base); env ``FML_FAMILY`` forces."""
    forced = os.environ.get("FML_FAMILY", "auto")
    if forced in ("sgemm", "chunked"):
        return forced
    n = token_slots.numel()
    if n == 0:
        return "sgemm"
    runs = 1 + int((token_slots[1:] != token_slots[:-1]).sum())
    return "sgemm" if n / runs >= SGEMM_MIN_MEAN_RUN else "chunked"


@dataclass
class BatchPlan:
    """One token layout, shared by every layer that sees it (forward and backward)."""

    slot_names: tuple  # model-wide adapter slot order
    token_slots: torch.Tensor  # host int64 [S], -1 = base
    segments: Segments  # on the activations' device
    family: str
    used_slots: frozenset  # slots with at least one token

    @property
    def num_tokens(self) -> int:
        return self.segments.num_tokens


@dataclass
class Routing:
    """What one forward call asked for: per-row names, or a vocabulary plus per-token ids (packed rows)."""

    names: tuple
    slot_names: tuple  # the model's adapters when the routing began: the slot order of its plans
    ids: Optional[torch.Tensor] = None  # [rows, T] indices into names, -1 = base
    plans: dict = field(default_factory=dict)

    @property
    def per_row(self) -> bool:
        return self.ids is None

    def row_names(self, x: torch.Tensor) -> list:
        """Names per row of ``x``, for layers that run PEFT's own per-adapter loop."""
        if not self.per_row:
            raise ValueError(
                "packed rows (per-token `adapter_ids`) cannot run on a layer that falls back to PEFT's per-sample "
                "mixed-batch loop; see the patch report for the modules that fall back"
            )
        if x.shape[0] != len(self.names):
            raise ValueError(
                f"Length of `adapter_names` should be the same as the number of inputs, but got {len(self.names)} "
                f"and {x.shape[0]} respectively."
            )
        return list(self.names)


class Router:
    """Per-model routing state: the active :class:`Routing` and the model-wide slot order."""

    def __init__(self, root: torch.nn.Module):
        self.root = root
        self.current: Optional[Routing] = None
        self._by_names: dict = {}  # per-row routings by (names, adapters), reused across forward calls
        self.family = "auto"
        self.backend = "auto"
        self.share_shrink = True  # sibling layers on one input share a shrink pass (patch setting)
        self.share_dropout = False  # ... also under active dropout, a mask per slice (patch setting)
        self.fuse_base = True  # a frozen nn.Linear base runs inside FusedLinearDelta (patch setting)
        self.generation = 0  # counts begin() calls: per-forward-call state (fast_multilora.stacked) keys on it
        self.pending_ids: Optional[torch.Tensor] = None  # adapter_ids popped by a PeftModel's pre-hook
        self.layers: list = []  # every LoRA layer of the model (ours and the fallback ones), set by patch()
        self.tuner = None  # the PEFT tuner whose peft_config keys we watch
        self.config_key: tuple = ()
        self.repatch = None  # callable re-running patch() with the same settings

    # -- adapters known to the model ------------------------------------------------------------------------------
    def known_adapters(self) -> list:
        """Sorted names of the adapters held by the model's LoRA layers (the model-wide slot order)."""
        self._refresh()
        known = set()
        for m in self.layers:
            known.update(m.lora_A.keys())
            e = getattr(m, "lora_embedding_A", None)
            if e is not None:
                known.update(e.keys())
        return sorted(known)

    def _refresh(self) -> None:
        """Re-patch when the PEFT config changed (``add_adapter`` may have created new LoRA layers)."""
        tuner = self.tuner
        if tuner is None or self.repatch is None:
            return
        key = tuple(sorted(getattr(tuner, "peft_config", {}).keys()))
        if key != self.config_key:
            self.repatch()

    def _check_names(self, names: Sequence[str], known: list) -> None:
        unknown = sorted({n for n in names if n != BASE and n not in known})
        if unknown:
            raise ValueError(  # PEFT's own sentence first, so code matching PEFT's message still matches
                f"Trying to infer with non-existing adapter(s): {', '.join(unknown)} -- unknown adapter name(s) "
                f"{unknown} in `adapter_names`; this model has adapters {known} (use {BASE!r} for rows without an "
                "adapter)"
            )

    def _make_routing(self, adapter_names, adapter_ids=None) -> Routing:
        if isinstance(adapter_names, str):
            raise TypeError("`adapter_names` must be a list of adapter names, one per sample, not a single string")
        names = tuple(adapter_names)
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"`adapter_names` must hold strings, got {type(n).__name__}: {n!r}")
        known = self.known_adapters()
        self._check_names(names, known)
        if adapter_ids is not None:
            if not torch.is_tensor(adapter_ids) or adapter_ids.dtype.is_floating_point:
                raise TypeError("`adapter_ids` must be an integer tensor [batch, seq] indexing `adapter_names`")
            if adapter_ids.numel() and (int(adapter_ids.max()) >= len(names) or int(adapter_ids.min()) < -1):
                raise ValueError(
                    f"`adapter_ids` values must lie in [-1, {len(names) - 1}] (indices into `adapter_names`, "
                    f"-1 = base), got [{int(adapter_ids.min())}, {int(adapter_ids.max())}]"
                )
        return Routing(names=names, slot_names=tuple(known), ids=adapter_ids)

    def begin(self, adapter_names=None, adapter_ids=None) -> None:
        """Start routing a forward call; ``adapter_names=None`` turns routing off (stock PEFT behaviour)."""
        self.generation += 1
        if adapter_names is None:
            if adapter_ids is not None:
                raise ValueError("`adapter_ids` needs `adapter_names` (the names its values index)")
            self.current = None
            return
        if adapter_ids is None:  # per-row names: reuse the routing (and its plans) of an identical earlier call
            self.current = self.routing_for_names(adapter_names)
            return
        self.current = self._make_routing(adapter_names, adapter_ids)

    def routing_for_names(self, names) -> Routing:
        """Routing for per-row names, cached by (names, the model's adapters): a training loop whose batches repeat
        a layout builds its plans once. Also used for names PEFT's own hooks hand to a layer."""
        if isinstance(names, str):
            raise TypeError("`adapter_names` must be a list of adapter names, one per sample, not a single string")
        key = (tuple(names), tuple(self.known_adapters()))
        r = self._by_names.get(key)
        if r is None:
            if len(self._by_names) > 8:
                self._by_names.clear()
            r = self._by_names[key] = self._make_routing(key[0])
        return r

    # -- plans ----------------------------------------------------------------------------------------------------
    def plan_for(self, routing: Routing, x: torch.Tensor) -> BatchPlan:
        lead = tuple(x.shape[:-1])
        key = (lead, x.device)
        plan = routing.plans.get(key)
        if plan is None:
            if len(routing.plans) > 16:  # e.g. a long generate(): keep the cache bounded
                routing.plans.clear()
            plan = routing.plans[key] = self._build_plan(routing, lead, x.device)
        return plan

    def _build_plan(self, routing: Routing, lead: tuple, device) -> BatchPlan:
        slot_names = routing.slot_names
        index = {n: i for i, n in enumerate(slot_names)}
        vocab = torch.tensor([index.get(n, -1) for n in routing.names] + [-1], dtype=torch.int64)  # [-1] for id -1
        if routing.per_row:
            rows = lead[0] if lead else 1
            if rows != len(routing.names):
                raise ValueError(
                    f"Length of `adapter_names` should be the same as the number of inputs, but got "
                    f"{len(routing.names)} and {rows} respectively."
                )
            per_row = vocab[:-1]
            tokens_per_row = 1
            for d in lead[1:]:
                tokens_per_row *= d
            token_slots = per_row.repeat_interleave(tokens_per_row)
        else:
            ids = routing.ids
            if tuple(ids.shape) != lead:
                raise ValueError(
                    f"`adapter_ids` has shape {tuple(ids.shape)} but the layer input has leading shape {lead}; "
                    "give one id per token"
                )
            token_slots = vocab[ids.to("cpu", torch.int64).reshape(-1)]  # -1 indexes the trailing base entry
        family = self.family if self.family in ("sgemm", "chunked") else choose_family(token_slots)
        segs = segments_from_token_slots(token_slots, grouped=(family == "chunked"), device=device)
        used = frozenset(int(s) for s in token_slots.unique().tolist() if s >= 0)
        return BatchPlan(slot_names, token_slots, segs, family, used)
