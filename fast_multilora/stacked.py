"""One shrink pass for sibling LoRA layers that read the same input (``q/k/v_proj``, ``gate/up_proj``, ...).

A Llama attention block calls ``q_proj``, ``k_proj`` and ``v_proj`` on the very same tensor, its MLP ``gate_proj``
and ``up_proj``. Their shrinks ``x -> h`` can then run as one pass over the siblings' A weights stacked per adapter
(the kernels' ``stack_num`` layout, see ``kernels/segments.py``): ``h[S, stack_num * max_rank]``, slice ``s`` of a
token of adapter ``a`` at columns ``s*r_a .. (s+1)*r_a``. Each sibling then expands its own slice.

**Groups are declared when patching** (:func:`declare_groups`), from the module tree as PEFT built it, the way vLLM's
``packed_modules_mapping`` names the projections it packs: patched LoRA Linear modules with one parent module, one
``in_features`` and one device whose names form one of ``SIBLING_SETS``. ``o_proj`` is in no set: it never reads
the q/k/v input.

**Stacks** (:func:`stacks_of`, whenever the layers' adapter tables change -- ``Router.begin`` refreshes them): the
members of a group that qualify -- adapters present with equal ranks and dropout rates, no active dropout (unless
``share_dropout``), no ``lora_bias``, no LoRA variant, one A-weight dtype and device -- and agree on all of that form
one stack; the others run alone. A stack's composition therefore depends on the model's state only, never on a call.

**Per call**: the first member of a stack called on an input tensor leads: one shrink over every member's A weights
(``function.LoraLinear`` with ``lead=True``), its ``h`` left in the group's :class:`Pending`; a member called later
on the very same tensor (identity) under the same routing takes its slice (``lead=False``). A member called on
another input leads a stack of its own. The path a call takes depends only on the order and inputs of the calls,
so the first forward call equals the second bit for bit, gradient-checkpointing recomputation repeats the
forward's path, and ``torch.compile`` traces it into one graph.

**Backward**: each member's expand backward gives its slice of ``dh``; autograd sums them into the lead's backward,
whose one shrink backward gives ``dx`` (summed over the slices) and every member's ``dA``. A member whose output
got no gradient in a backward pass (unused, or not asked for) gets no ``dA`` from that pass, as unstacked: each
member's backward records its slice in :attr:`Pending.reached`, which the lead's backward reads and resets.

**Dropout**: PEFT draws an independent mask per module. With ``share_dropout`` the stacked shrink reads ``x`` once
and gives each slice its own mask (key ``kernels.dropout.slice_seed(seed, s)``); its backward redraws them. Off by
default: on an H200 the per-slice masks made the stacked kernels slower than one shrink per sibling
(``docs/benchmarks.md``), so siblings under active dropout run alone; in eval, or at dropout 0, they share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

# Names of sibling projections that read one input, per architecture family (vLLM's packed_modules_mapping):
# Llama/Mistral/Qwen/Gemma (q/k/v, gate/up), BERT/ViT (query/key/value), T5 (q/k/v), Mixtral's experts (w1/w3).
SIBLING_SETS = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
    ("q", "k", "v"),
    ("w1", "w3"),
)


@dataclass(eq=False)
class Pending:
    """A stack's shrink in flight: its input and routing (so its layout: the same rows of the same routing), its
    ``h``, and the slices taken so far. Not the ``Segments`` object itself: while ``torch.compile`` traces, every
    layer builds its own (equal) layout."""

    x: torch.Tensor
    routing: object
    taken: set = field(default_factory=set)
    stack: Optional[Stack] = None
    h: Optional[torch.Tensor] = None
    reached: set = field(default_factory=set)  # slices whose output got a gradient in the running backward pass


@dataclass(eq=False)
class Stack:
    """Members sharing one shrink (declared order: member ``i`` owns slice ``i``)."""

    members: tuple
    group: SiblingGroup

    @property
    def size(self) -> int:
        return len(self.members)


class SiblingGroup:
    """Patched LoRA Linear siblings declared at patch time; ``pending`` is the stack in flight (per call)."""

    def __init__(self, members: list, names: list):
        self.members = tuple(members)
        self.names = tuple(names)
        self.pending: Optional[Pending] = None

    def __getstate__(self):  # copies (deepcopy, pickle) keep the grouping, not the per-call state
        return {"members": self.members, "names": self.names}

    def __setstate__(self, state):
        self.__init__(list(state["members"]), list(state["names"]))


def declare_groups(named_layers: list, sibling_sets=SIBLING_SETS) -> list:
    """The :class:`SiblingGroup` s of ``(name, layer)`` pairs (patched LoRA Linear modules): one parent module, one
    ``in_features``, one device, names forming one of ``sibling_sets`` (at least two of its names present)."""
    by_key: dict = {}
    for name, layer in named_layers:
        parent, _, leaf = name.rpartition(".")
        device = layer.get_base_layer().weight.device
        for i, names in enumerate(sibling_sets):
            if leaf in names:
                by_key.setdefault((parent, i, layer.in_features, device), []).append((name, layer))
    groups = []
    for members in by_key.values():
        if len(members) >= 2:
            groups.append(SiblingGroup([m for _, m in members], [n for n, _ in members]))
    return groups


def stacks_of(group: SiblingGroup, states: list, share_dropout: bool) -> list:
    """``[(member index, Stack or None, slice index)]`` for each member of ``group`` whose layer state (``states``,
    ``patching.LayerState`` or ``None``) is given: members that qualify and agree on their adapters form one stack."""
    classes: dict = {}
    for i, st in enumerate(states):
        if st is None or not st.present:
            continue
        layer = group.members[i]
        if (st.has_bias or st.variants or (st.table.has_dropout and not share_dropout)
                or len(set(st.a_dtypes)) != 1):
            continue
        key = (st.present, st.ranks, st.rates, st.a_dtypes, st.device)
        classes.setdefault(key, []).append((i, layer))
    out = []
    for members in classes.values():
        if len(members) < 2:
            continue
        stack = Stack(tuple(m for _, m in members), group)
        out += [(i, stack, s) for s, (i, _) in enumerate(members)]
    return out
