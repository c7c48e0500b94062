"""Mixed-batch LoRA on MoE experts: PEFT's ``target_parameters`` (``peft.tuners.lora.ParamWrapper``) on the fused
3-D expert weights of transformers' experts modules (``@use_experts_implementation``: Qwen3-MoE, Mixtral, GPT-OSS,
...), in training and eval.

**PEFT's layout** (peft 0.21 ``ParamWrapper``, one per targeted parameter, nested: ``experts`` is the wrapper of the
last targeted parameter, its ``base_layer`` the next one, down to the experts module). For a parameter of ``E``
experts and an adapter of rank ``r``: ``lora_A.weight`` is ``[E*r, in]`` (expert ``e``'s ``A_e`` = rows
``e*r .. (e+1)*r``), ``lora_B.weight`` is ``[out, r*E]`` with expert ``e``'s ``B_e`` in the *strided* columns
``e, E+e, 2E+e, ...`` (``weight.reshape(out, r, E)[..., e]``); the scale is ``alpha/r`` (``alpha/sqrt(r)`` with
rsLoRA); no dropout, bias or variant (PEFT refuses them). PEFT adds ``scale * B_e A_e`` to the parameter
(``[E, out, in]``; transposed to ``[E, in, out]`` when the module's ``is_transposed``) through a parametrization
while the experts run, so a pair (token ``t``, expert ``e``) whose input to that projection is ``u`` gets
``scale * (u A_eᵀ) B_eᵀ`` added to the projection's output -- linear in the weight, so exactly a LoRA delta per
routed pair. PEFT cannot mix adapters in one batch on these layers (it raises); here each pair takes its token's
adapter.

**Virtual experts.** A slot of the kernels' table is a (expert, adapter) pair: ``v = e * (n + 1) + (a + 1)`` for
the model-wide adapter slot ``a`` (``-1`` = base: ``v = e * (n + 1)``, rank 0) of ``n`` slots. Routed pairs are
sorted by ``v`` once per experts call -- grouped by expert, then adapter -- and that one order serves both the base
GEMMs (transformers' grouped GEMM over experts, ``grouped_mm`` where torch has it) and the LoRA delta: one
``function.LoraLinear`` call per projection over the virtual slots (chunked family,
``kernels.segments.grouped_segments``), the existing segmented shrink / expand and backward kernels, no Python loop
over experts, deterministic weight gradients (the kernels' fixed-order reductions). The concatenated weights are
PEFT's, adapter-major: ``A_cat = cat_a lora_A_a.weight`` as it is (virtual slot ``(e, a)`` at row
``off_a + e*r_a``), ``B_cat`` = each ``lora_B_a.weight`` with its columns reordered expert-major (one copy per call,
which autograd reverses for the gradient).

The experts' forward is replaced (when the batch names an adapter that the layer holds) by :func:`experts_forward`,
which follows transformers' ``grouped_mm_experts_forward`` (gate / activation, biases, the post-expert norm, the
routing weights, a deterministic sum over ``top_k``) with the deltas added; the base part equals the model's
``grouped_mm`` implementation and, up to summation order, the ``eager`` and ``batched_mm`` ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .function import LayerCall, LoraLinear, absent_positions, get_backend, run
from .kernels.segments import AdapterTable, grouped_segments, to_device

# the experts modules' attributes this path reads (set by transformers' ``use_experts_implementation``);
# ``has_post_expert_norm`` is read with a default of False: transformers releases before it (5.17) have no such norm
_EXPERTS_ATTRS = ("num_experts", "has_gate", "has_bias", "is_transposed")


def param_wrapper_class():
    """PEFT's ``ParamWrapper`` class (``None`` for a PEFT without it)."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # pragma: no cover - PEFT < 0.17
        return None
    return ParamWrapper


def is_param_wrapper(module) -> bool:
    cls = param_wrapper_class()
    return cls is not None and isinstance(module, cls)


def chain(wrapper) -> tuple:
    """``(wrappers, experts)``: the nested ``ParamWrapper`` s from ``wrapper`` down, and the module they wrap."""
    wrappers, m = [], wrapper
    while is_param_wrapper(m):
        wrappers.append(m)
        m = m.base_layer
    return tuple(wrappers), m


def _projections(experts) -> tuple:
    return ("gate_up_proj" if experts.has_gate else "up_proj", "down_proj")


def unsupported_reason(wrapper) -> Optional[str]:
    """``None`` when :func:`experts_forward` runs this wrapper chain, else what is missing (for the error)."""
    wrappers, experts = chain(wrapper)
    kind = f"{type(experts).__module__}.{type(experts).__qualname__}"
    missing = [a for a in _EXPERTS_ATTRS if not hasattr(experts, a)]
    if missing:
        return (f"the targeted parameters belong to {kind}, not a transformers experts module "
                f"(@use_experts_implementation; missing {missing}): only fused 3-D expert weights "
                "(gate_up_proj / up_proj, down_proj) are routed per token")
    names = [w.parameter_name for w in wrappers]
    allowed = _projections(experts)
    for w in wrappers:
        p = w.get_param()
        if w.parameter_name not in allowed:
            return (f"LoRA on {kind}.{w.parameter_name}: only the expert weights {list(allowed)} are routed per "
                    "token (not biases or other parameters)")
        if p.dim() != 3 or p.shape[0] != experts.num_experts or w.num_experts != experts.num_experts:
            return f"LoRA on {kind}.{w.parameter_name} of shape {tuple(p.shape)}: expected [num_experts, ., .]"
    if len(set(names)) != len(names):
        return f"{kind}: a parameter is wrapped twice ({names})"
    return None


@dataclass(eq=False)
class ProjState:
    """One targeted projection's adapters in the routing's slot order, over virtual (expert, adapter) slots. Also the
    projection's state for the adapter store (``fast_multilora.store``), which holds each adapter as one of rank
    ``E * r`` (its ``lora_A`` rows and ``lora_B`` columns as PEFT lays them out) and reads the fields a
    ``patching.LayerState`` has that it needs."""

    wrapper: torch.nn.Module
    table: AdapterTable
    present: tuple  # adapter names of the wrapper, slot order
    ranks: tuple  # E * r per present adapter: the rows of its lora_A weight
    slots: tuple  # the model-wide slot of each present adapter
    a_modules: tuple  # the present adapters' lora_A / lora_B modules
    b_modules: tuple
    a_dtypes: tuple
    experts: int  # E
    has_bias: bool = False  # (PEFT refuses lora_bias on a ParamWrapper)
    delta: Optional[tuple] = None  # (a change is read whole: the store compares its key)


@dataclass(eq=False)
class ExpertsState:
    experts: torch.nn.Module
    projs: dict  # parameter name -> ProjState (only the targeted projections with an adapter of the routing)
    n_slots: int
    device: torch.device


def _proj_state(wrapper, slot_names, E: int, absent=frozenset()) -> Optional[ProjState]:
    """``absent``: adapters paging keeps on the host (``fast_multilora.paging``), left out as if the layer lacked
    them."""
    n = len(slot_names)
    n_v = E * (n + 1)
    ranks, offsets, scales = [0] * n_v, [0] * n_v, [0.0] * n_v
    present, weight_ranks, slots, acc = [], [], [], 0
    for a, name in enumerate(slot_names):
        if name not in wrapper.lora_A or name in absent:
            continue
        r, c = wrapper.r[name], float(wrapper.scaling[name])
        for e in range(E):
            v = e * (n + 1) + a + 1
            ranks[v], offsets[v], scales[v] = r, acc + e * r, c
        present.append(name)
        weight_ranks.append(E * r)
        slots.append(a)
        acc += E * r
    if not present:
        return None
    a_mods = tuple(wrapper.lora_A[n] for n in present)
    b_mods = tuple(wrapper.lora_B[n] for n in present)
    device = a_mods[0].weight.device
    host = torch.tensor([ranks, offsets], dtype=torch.int32)
    table = AdapterTable(
        ranks=to_device(host[0], device), offsets=to_device(host[1], device),
        scales=to_device(torch.tensor(scales, dtype=torch.float32), device),
        dropout=torch.zeros(n_v, dtype=torch.float32, device=device), max_rank=max(ranks), total_rank=acc,
        has_dropout=False, slots=None, host=(tuple(ranks), tuple(offsets), tuple(scales), (0.0,) * n_v),
    )
    return ProjState(wrapper=wrapper, table=table, present=tuple(present), ranks=tuple(weight_ranks),
                     slots=tuple(slots), a_modules=a_mods, b_modules=b_mods,
                     a_dtypes=tuple(m.weight.dtype for m in a_mods), experts=E)


def _signature(wrapper, slot_names, absent) -> tuple:
    a_mods, b_mods = wrapper.lora_A._modules, wrapper.lora_B._modules
    return (slot_names, absent, tuple((n, a, b_mods[n], a.weight, b_mods[n].weight, wrapper.r[n], wrapper.scaling[n],
                               a.weight.device, a.weight.dtype) for n, a in a_mods.items()))


def refresh_proj(entry: dict, wrapper, slot_names, absent=frozenset()):
    """The :class:`ProjState` of one wrapper's own parameter in the routing's slot order (cached in ``entry``, the
    wrapper's patch entry: rebuilt when its signature moved), or ``None`` (no adapter, or a chain it cannot run);
    ``absent``: the adapters paged out (left out)."""
    if entry.get("error") is not None:
        return None
    sig = _signature(wrapper, slot_names, absent)
    if entry.get("sig") != sig:
        entry["proj"] = _proj_state(wrapper, slot_names, chain(wrapper)[1].num_experts, absent)
        entry["sig"] = sig
    return entry["proj"]


def refresh(entry: dict, wrapper, slot_names, entries) -> None:
    """The experts state of one wrapper chain (in ``entry``) from its wrappers' projection states (``entries(w)``:
    a wrapper's patch entry, after :func:`refresh_proj`); cheap when nothing changed (their identities)."""
    if entry.get("error") is not None:
        return
    wrappers, experts = chain(wrapper)
    projs = {w.parameter_name: entries(w).get("proj") for w in wrappers}
    projs = {k: v for k, v in projs.items() if v is not None}
    key = (len(slot_names), tuple(projs.values()))  # (by identity: ProjState compares as its object)
    if entry.get("chain") == key:
        return
    device = next(iter(projs.values())).table.ranks.device if projs else torch.device("cpu")
    entry["state"] = ExpertsState(experts=experts, projs=projs, n_slots=len(slot_names), device=device) if projs \
        else None
    entry["chain"] = key


def pair_token_slots(routing, x: torch.Tensor, name: str) -> torch.Tensor:
    """int64 ``[T]``: the slot of each of the experts' ``T`` input tokens, which the MoE block flattened row-major
    from ``[rows, seq]`` (-1 = base)."""
    T = x.shape[0]
    if routing.per_row:
        rows = routing.rows
        if rows == 0 or T % rows:
            raise ValueError(
                f"fast_multilora: {name} (MoE experts) got {T} tokens, not a multiple of the batch's {rows} rows "
                "(`adapter_names`); the experts' input must be the batch's tokens flattened row by row"
            )
        slots = routing.row_slots.to(x.device, torch.int64)
        return slots.repeat_interleave(T // rows, output_size=T) if T != rows else slots
    ids = routing.token_slots
    if ids.numel() != T:
        raise ValueError(
            f"fast_multilora: {name} (MoE experts) got {T} tokens but `adapter_ids` has {ids.numel()} "
            f"(shape {tuple(ids.shape)}); give one id per token"
        )
    return ids.reshape(-1).to(x.device, torch.int64)


def expert_major_b(weight: torch.Tensor, E: int) -> torch.Tensor:
    """PEFT's ``lora_B.weight`` ``[out, r*E]`` (expert ``e`` in columns ``j*E + e``) as ``[out, E*r]`` with expert
    ``e`` in columns ``e*r .. (e+1)*r``: the kernels' concatenated layout. A copy autograd reverses."""
    N, rE = weight.shape
    return weight.view(N, rE // E, E).transpose(1, 2).reshape(N, rE)


def lora_weights(ps: ProjState, store=None) -> tuple:
    """``(A weights, B weights, slots)`` of one projection's present adapters: the adapter store's two leaves and its
    ``store.LayerSlots`` when ``store`` holds the projection, else PEFT's weights (slot order) and ``None``."""
    slots = store.layer_slots(ps.wrapper) if store is not None else None
    if slots is not None and store.ddp.active:  # (under DDP: the leaves unless DDP reduces the parameters)
        slots = store.ddp.take(ps.wrapper, slots)
    if slots is not None:
        return (slots.a_leaf,), (slots.b_leaf,), slots
    return [m._parameters["weight"] for m in ps.a_modules], [m._parameters["weight"] for m in ps.b_modules], None


def expert_delta(backend, segs, ps: ProjState, u: torch.Tensor, y: torch.Tensor, a_w, b_w, E: int,
                 slots=None, routing=None) -> torch.Tensor:
    """``y + scale * (u A_eᵀ) B_eᵀ`` for every pair row of a virtual slot ``(e, a)`` (one ``LoraLinear`` call);
    ``u``, ``y``: ``[S, in]``, ``[S, out]`` in the sorted pair order of ``segs``; ``a_w``, ``b_w``, ``slots``: the
    weights (:func:`lora_weights`) -- PEFT's, each B copied to the expert-major layout (a copy autograd reverses), or
    the store's ``A_cat`` and packed B block, which every kernel reads in PEFT's layout (``AdapterTable.experts``)."""
    if slots is None:
        b_w = [expert_major_b(b, E) for b in b_w]
    call = LayerCall(backend=backend, segs=segs, table=ps.table if slots is None else slots.table, ranks=ps.ranks,
                     experts=E, stored=slots,
                     absent=absent_positions(ps.present, routing) if slots is None and routing is not None else ())
    cast = a_w[0].dtype
    if u.dtype == torch.float32 and cast in (torch.float16, torch.bfloat16) and all(t.dtype == cast for t in a_w):
        u = u.to(cast)  # as PEFT's 16-bit adapters see a 16-bit input
    return run(LoraLinear, u, y, None, None, call, *a_w, *b_w)


def pair_layout(expert_ids: torch.Tensor, pair_slots: torch.Tensor, E: int, n_slots: int) -> tuple:
    """``(order, segs, offs)`` of routed pairs (``expert_ids``, ``pair_slots``: int64 ``[S]``, slot -1 = base):
    ``order`` sorts them by virtual slot ``e * (n_slots + 1) + slot + 1`` (stable: by expert, then adapter, then
    pair), ``segs`` the chunked-family ``Segments`` of the sorted pairs over the ``E * (n_slots + 1)`` virtual slots,
    ``offs`` int32 ``[E]`` the cumulative pairs per expert (the grouped GEMM's offsets). Device ops only."""
    key = expert_ids * (n_slots + 1) + pair_slots + 1
    sorted_key, order = torch.sort(key, stable=True)
    segs = grouped_segments(sorted_key, E * (n_slots + 1))  # already sorted: its own stable order is the identity
    bounds = segs.grouping[1]  # int64 [E*(n+1) + 2]: first sorted row of each virtual slot (slot -1 first)
    ends = bounds[1 + (n_slots + 1) * torch.arange(1, E + 1, device=key.device)]
    return order, segs, ends.to(torch.int32)


def base_linear(experts, u, W, offs, bias):
    """The base projection of pairs sorted by expert (``offs``: int32 cumulative pairs per expert): transformers'
    grouped GEMM for a model configured with ``grouped_mm``, else one ``F.linear`` per expert, as its eager loop
    (``batched_mm``, ``eager``, ...: the same products up to summation order; float64 runs here)."""
    if getattr(experts.config, "_experts_implementation", None) == "grouped_mm":
        from transformers.integrations.moe import _grouped_linear

        return _grouped_linear(u, W, offs, bias=bias, is_transposed=experts.is_transposed)
    w = W.transpose(-2, -1) if experts.is_transposed else W  # [E, out, in]
    ends = offs.tolist()  # one host read per projection, as transformers' eager loop
    starts = [0, *ends[:-1]]
    pieces = zip(starts, ends, strict=True)
    out = torch.cat([torch.nn.functional.linear(u[a:b], w[e]) for e, (a, b) in enumerate(pieces)])
    return out if bias is None else out + bias


def experts_forward(state: ExpertsState, config, routing, x, top_k_index, top_k_weights, name: str, store=None):
    """The experts' forward with every routed pair's LoRA deltas (see the module docstring); returns ``[T, H]``.
    ``store``: the model's adapter store (the projections it holds take its leaves)."""
    experts = state.experts
    if getattr(experts, "_is_expert_parallel", False):
        raise ValueError(f"fast_multilora: {name}: expert-parallel experts are not supported in mixed batches")
    if x.device != state.device:
        raise ValueError(
            f"input is on {x.device} but the LoRA weights of {name} are on {state.device}; move the batch to the "
            "model's device"
        )
    backend = get_backend(config.backend, x.device)
    T, H = x.shape
    k = top_k_index.shape[-1]
    E, n = experts.num_experts, state.n_slots
    tok_slots = pair_token_slots(routing, x, name)
    expert_ids = top_k_index.reshape(-1).long()
    pair_slots = tok_slots.repeat_interleave(k, output_size=T * k) if k != 1 else tok_slots
    order, segs, offs = pair_layout(expert_ids, pair_slots, E, n)
    # pairs in sorted order; expand + index_select: a deterministic backward (no duplicate-index atomics)
    u = x.unsqueeze(1).expand(T, k, H).reshape(T * k, H).index_select(0, order)
    w_g = top_k_weights.reshape(-1).index_select(0, order)
    e_g = expert_ids.index_select(0, order) if experts.has_bias else None

    first, down = _projections(experts)
    y = base_linear(experts, u, getattr(experts, first), offs,
                    getattr(experts, f"{first}_bias")[e_g] if experts.has_bias else None)
    if first in state.projs:
        a_w, b_w, slots = lora_weights(state.projs[first], store)
        y = expert_delta(backend, segs, state.projs[first], u, y, a_w, b_w, E, slots, routing)
    h = experts._apply_gate(y) if experts.has_gate else experts.act_fn(y)
    y = base_linear(experts, h, experts.down_proj, offs, experts.down_proj_bias[e_g] if experts.has_bias else None)
    if down in state.projs:
        a_w, b_w, slots = lora_weights(state.projs[down], store)
        y = expert_delta(backend, segs, state.projs[down], h, y, a_w, b_w, E, slots, routing)
    if getattr(experts, "has_post_expert_norm", False):
        y = experts.post_expert_norm(y)
    weighted = y * w_g.unsqueeze(-1)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    out = weighted.index_select(0, inv).view(T, k, H).sum(dim=1)
    return out.to(x.dtype)


__all__ = ["chain", "experts_forward", "is_param_wrapper", "refresh", "refresh_proj", "unsupported_reason"]
