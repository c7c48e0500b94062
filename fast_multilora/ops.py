"""The Triton launchers as ``torch.library`` operators, so ``torch.compile`` traces through them without a graph break.

Ops, namespace ``fast_multilora`` (``torch.ops.fast_multilora.<name>``):

* ``lora_shrink``      ``(h, keep_bits)``: ``h = shrink(x, A_cat)``, its don't-care entries zero (the launcher leaves
  them uninitialised), so the op's output is fully defined; with ``store_mask`` and dropout, ``keep_bits`` is the
  packed keep-mask the backward reads, else an empty ``[0, 0]`` uint8 tensor (an op cannot return ``None``).
* ``lora_expand``      ``y (+)= expand(h, B_cat)`` in place (``accumulate=False``: written, base rows the bias or
  zero), then with ``a``, ``b`` given ``y += a @ b`` (cuBLAS, beta 1: a fused layer's base GEMM added into the delta
  written): mutates ``y``, returns nothing; ``torch.compile`` functionalises it and Inductor re-inplaces it. The GEMM
  is inside the op because a traced ``Tensor.addmm_`` becomes an out-of-place ``addmm``, which copies ``y`` first,
  and an op of its own would cost a call's host time per layer.
* ``lora_shrink_expand``  ``y += expand(shrink(x, A_cat), B_cat)`` in place, one launch (few rows, no dropout: the
  decode calls of ``kernels.decode``); mutates ``y``, returns nothing.
* ``lora_expand_bwd``  ``(dh, dB_cat)``, ``dB_cat`` in ``B_cat``'s layout; an optional ``dh`` input is the starting
  content of the returned ``dh``
  (the launcher's fill-in-place ``dh``, made functional).
* ``lora_shrink_bwd``  ``(dx, dA_cat)``; without ``need_dx``, ``dx`` is an empty ``[0, K]`` tensor; with ``a``, ``b``
  given, ``dx += a @ b`` after the kernel wrote it (a fused layer's ``dy W``, as ``lora_expand``'s).

The ops are not differentiable: ``function.LoraLinear``, the one autograd Function of a patched layer call, calls
them in its forward and backward while ``torch.compile`` traces (and the launchers directly in eager mode), so the
compiled forward and backward graphs both hold them. A dropout ``seed`` is a one-element int32 device tensor, drawn
inside the traced graph: every replay of a captured CUDA graph draws a fresh one.

Op schemas take tensors and host scalars only: ``Segments`` and ``AdapterTable`` are passed as their fields
(``_layout``), in two list arguments -- the tensors, then the host ints with the op's own ints after them -- because an
op call's dispatch costs host time per schema argument (``torch.library.custom_op``'s version bump of a mutable op even
walked the schema once per argument: 0.12 ms per call at 23 arguments). ``Segments.cache`` does not cross the
boundary: each op call gets a cache of its own for the derived device tables, which are therefore built inside the op
call and belong to whatever graph is traced or captured -- a table kept across calls would freeze one layout into a
captured CUDA graph, and one allocated while CUDA graph trees warm up lives in the graph's memory pool, which they
refuse ("tensors in the cudagraph pool not tracked as outputs", measured on the H200). The backward's chunk tables
cross it as layout tensors instead: a training call's entry layout carries them (``Segments.chunk_tables``, built by
``Router.begin`` outside the graph, one launch for every chunk length: ``kernels.backward.with_tables``), so they
are graph inputs like the layout's own tensors and each backward op call slices its own out of them; a layout
without them (built inside a graph) has each backward op call build its two. Only the launchers' validation memos
(host values) are shared between the op
calls of one kind of layout (:func:`_shared_memos`), so a layout and a kind of layer table are checked once, as in
eager mode. The eager path (``function.TritonBackend`` outside ``torch.compile``) calls the launchers directly and
keeps its per-``Segments`` cache.

The Python wrappers below (``lora_shrink`` ... ``lora_shrink_bwd``) take ``Segments`` / ``AdapterTable`` like the
launchers in ``fast_multilora.kernels`` and call the ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .kernels import api as K
from .kernels.launch import memo_keys
from .kernels.segments import AdapterTable, Segments


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Dtype of ``h``, ``dh`` and the weight gradients: float32, float64 for float64 activations."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _layout(segs: Segments, table: AdapterTable, *extra: int) -> tuple[list, list]:
    """The op arguments of a layout as two lists (an op call's host cost grows with its schema's argument count):
    the tensors of ``Segments`` (less its cache; its chunk tables, if any, last) and of the ``AdapterTable`` the
    kernels read (not ``slots``: the ops take concatenated weights), then its host ints followed by the op's own
    ``extra`` ints."""
    order, bounds = segs.grouping if segs.grouping is not None else (None, None)
    info, cptr = segs.chunk_tables if segs.chunk_tables is not None else (None, None)
    tensors = [segs.indptr, segs.slot, segs.perm, order, bounds, table.ranks, table.offsets, table.scales,
               table.dropout, segs.token_slots, info, cptr]
    ints = [segs.max_len, segs.num_tokens, segs.base_max_len, table.max_rank, table.total_rank,
            int(table.has_dropout), table.experts, *(int(e) for e in extra)]
    return tensors, ints


_N_LAYOUT_INTS = 7
_MAX_RANK, _TOTAL_RANK, _HAS_DROPOUT = 3, 4, 5  # positions in ``ints`` (the fake kernels read them)


def _unpack(tensors: list, ints: list) -> tuple[Segments, AdapterTable, list]:
    """Inverse of ``_layout`` inside an op: a ``Segments`` with a per-call cache holding the layout's shared
    validation memos (:func:`_shared_memos`), the ``AdapterTable`` and the op's own ints."""
    indptr, slot, perm, order, bounds, ranks, offsets, scales, dropout, token_slots, info, cptr = tensors
    max_len, num_tokens, base_max_len, max_rank, total_rank, has_dropout, experts = ints[:_N_LAYOUT_INTS]
    grouping = (order, bounds) if order is not None else None
    cache = dict(_shared_memos(tensors[:5], (max_len, num_tokens, base_max_len)))
    segs = Segments(indptr, slot, perm, max_len, num_tokens, cache, base_max_len, token_slots, grouping,
                    (info, cptr) if info is not None else None)
    table = AdapterTable(ranks, offsets, scales, dropout, max_rank, total_rank, bool(has_dropout), experts=experts)
    return segs, table, ints[_N_LAYOUT_INTS:]


_SHARED: dict = {}  # what the launchers check of a layout -> its validation memos
_SHARED_MAX = 256


def _shared_memos(seg_tensors: list, seg_ints: tuple) -> dict:
    """The launchers' validation memos (``kernels.launch.memo_keys``: sets of tables' properties, filled in place by
    ``mark_checked``; the tables seen by identity stay in each call's own cache) of the layout ``(indptr, slot, perm,
    order, bounds)`` + its host ints, shared by every op call of a layout with the same dtypes, shapes, device and
    ints: what the checks read of a layout (and of a table: the memos' entries). Not by the tensors' identity: a
    compiled backward's op calls receive new tensor objects for the forward's layout and tables. Bounded: at most
    ``_SHARED_MAX`` kinds of layout."""
    key = (seg_tensors[0].device, seg_ints,
           *[None if t is None else (t.dtype, t.shape) for t in seg_tensors])
    memos = _SHARED.get(key)
    if memos is None:
        if len(_SHARED) >= _SHARED_MAX:
            _SHARED.clear()
        memos = _SHARED[key] = {k: set() for k in memo_keys(seg_tensors[0].device)}
    return memos


# ------------------------------------------------------------------------------------------------------------------
# The four launchers; ``layout`` / ``ints`` as ``_layout`` builds them, the op's own ints after the layout's
# ------------------------------------------------------------------------------------------------------------------


_LIB = torch.library.Library("fast_multilora", "DEF")


def _op(schema: str):
    """Define ``fast_multilora::<schema>`` and register the decorated function as its kernel on every device
    (``CompositeExplicitAutograd``), so the dispatcher calls it directly: ``torch.library.custom_op``'s Python layers
    around a kernel (autograd wrapper, version bump of mutated inputs, aliasing checks) cost ~40-50 us of host time
    per call on this repo's VM, around a launcher's own ~8 us. The ops are not differentiable (their callers are an
    autograd Function's forward and backward); ``register_fake`` gives them their fake-tensor kernels."""
    name = schema.split("(", 1)[0]
    _LIB.define(schema, tags=(torch.Tag.pt2_compliant_tag,))  # opcheck-tested, as custom_op would tag it

    def register(fn):
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return fn

    return register


def _fake(name: str):
    return torch.library.register_fake(f"fast_multilora::{name}", lib=_LIB)


@_op("lora_shrink(Tensor x, Tensor A_cat, Tensor?[] layout, SymInt[] ints, Tensor? seed) -> (Tensor, Tensor)")
def _shrink_op(x: Tensor, A_cat: Tensor, layout: list[Optional[Tensor]], ints: list[int],
               seed: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """ints: layout, stack_num, store_mask."""
    segs, table, (stack_num, store_mask) = _unpack(layout, ints)
    out = torch.zeros(x.shape[0], stack_num * table.max_rank, dtype=_acc(x.dtype), device=x.device)
    # zero-filled: the kernel writes adapter tokens' rows only, and an op's output must be fully defined
    keep = K.keep_bits_buffer(x).zero_() if _stores(seed, table.has_dropout, store_mask, stack_num) else None
    K.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, seed=seed, out=out, keep_out=keep)
    return out, keep if keep is not None else x.new_empty(0, 0, dtype=torch.uint8)


def _stores(seed, has_dropout: bool, store_mask: bool, stack_num: int) -> bool:
    return seed is not None and bool(has_dropout) and bool(store_mask) and stack_num == 1


@_fake("lora_shrink")
def _(x, A_cat, layout, ints, seed):
    stack_num, store_mask = ints[_N_LAYOUT_INTS:]
    h = x.new_empty(x.shape[0], stack_num * ints[_MAX_RANK], dtype=_acc(x.dtype))
    stores = _stores(seed, ints[_HAS_DROPOUT], store_mask, stack_num)
    shape = (x.shape[0], (x.shape[1] + 7) // 8) if stores else (0, 0)
    return h, x.new_empty(shape, dtype=torch.uint8)


@_op("lora_expand(Tensor h, Tensor B_cat, Tensor(a!) y, Tensor?[] layout, SymInt[] ints, Tensor? bias, Tensor? a, "
     "Tensor? b) -> ()")
def _expand_op(h: Tensor, B_cat: Tensor, y: Tensor, layout: list[Optional[Tensor]], ints: list[int],
               bias: Optional[Tensor], a: Optional[Tensor], b: Optional[Tensor]) -> None:
    """ints: layout, stack_num, slice_idx, accumulate."""
    segs, table, (stack_num, slice_idx, accumulate) = _unpack(layout, ints)
    K.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx, accumulate=bool(accumulate),
                  bias=bias)
    if a is not None:
        y.addmm_(a, b)


@_fake("lora_expand")
def _(h, B_cat, y, layout, ints, bias, a, b):
    return None


@_op("lora_shrink_expand(Tensor x, Tensor A_cat, Tensor B_cat, Tensor(a!) y, Tensor?[] layout, SymInt[] ints) -> ()")
def _shrink_expand_op(x: Tensor, A_cat: Tensor, B_cat: Tensor, y: Tensor, layout: list[Optional[Tensor]],
                      ints: list[int]) -> None:
    """ints: layout."""
    segs, table, _ = _unpack(layout, ints)
    K.lora_shrink_expand(x, A_cat, B_cat, segs, table, y)


@_fake("lora_shrink_expand")
def _(x, A_cat, B_cat, y, layout, ints):
    return None


@_op("lora_expand_bwd(Tensor dy, Tensor h, Tensor B_cat, Tensor?[] layout, SymInt[] ints, Tensor? dh) "
     "-> (Tensor, Tensor)")
def _expand_bwd_op(dy: Tensor, h: Tensor, B_cat: Tensor, layout: list[Optional[Tensor]], ints: list[int],
                   dh: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """ints: layout, stack_num, slice_idx."""
    segs, table, (stack_num, slice_idx) = _unpack(layout, ints)
    dh = dh.clone() if dh is not None else None  # functional: the input is the starting content, never written
    return K.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx, dh=dh)


@_fake("lora_expand_bwd")
def _(dy, h, B_cat, layout, ints, dh):
    acc = _acc(dy.dtype)
    stack_num = ints[_N_LAYOUT_INTS]
    db_shape = (ints[_TOTAL_RANK] * dy.shape[1],) if B_cat.dim() == 1 else (dy.shape[1], ints[_TOTAL_RANK])
    return dy.new_empty(dy.shape[0], stack_num * ints[_MAX_RANK], dtype=acc), dy.new_empty(db_shape, dtype=acc)


@_op("lora_shrink_bwd(Tensor dh, Tensor x, Tensor A_cat, Tensor?[] layout, SymInt[] ints, Tensor? seed, "
     "Tensor? keep, Tensor? a, Tensor? b) -> (Tensor, Tensor)")
def _shrink_bwd_op(dh: Tensor, x: Tensor, A_cat: Tensor, layout: list[Optional[Tensor]], ints: list[int],
                   seed: Optional[Tensor], keep: Optional[Tensor], a: Optional[Tensor],
                   b: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """ints: layout, stack_num, need_dx."""
    segs, table, (stack_num, need_dx) = _unpack(layout, ints)
    keep = keep if keep is not None and keep.numel() else None
    dx, dA = K.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, seed=seed, need_dx=bool(need_dx),
                               keep=keep)
    if not need_dx:
        return x.new_empty(0, x.shape[1]), dA
    return (dx if a is None else dx.addmm_(a, b)), dA


@_fake("lora_shrink_bwd")
def _(dh, x, A_cat, layout, ints, seed, keep, a, b):
    stack_num, need_dx = ints[_N_LAYOUT_INTS:]
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0, x.shape[1])
    return dx, x.new_empty(stack_num * ints[_TOTAL_RANK], x.shape[1], dtype=_acc(x.dtype))


# ------------------------------------------------------------------------------------------------------------------
# Wrappers with the launchers' signatures
# ------------------------------------------------------------------------------------------------------------------


def lora_shrink(x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, seed: Optional[Tensor] = None,
                store_mask: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """``(h, keep_bits or None)`` through ``fast_multilora::lora_shrink`` (``h``'s don't-care entries are zero)."""
    h, keep = torch.ops.fast_multilora.lora_shrink(x, A_cat, *_layout(segs, table, stack_num, store_mask), seed)
    return h, (keep if _stores(seed, table.has_dropout, store_mask, stack_num) else None)


def lora_expand(h, B_cat, segs: Segments, table: AdapterTable, y, *, stack_num: int = 1, slice_idx: int = 0,
                accumulate: bool = True, bias: Optional[Tensor] = None, gemm: Optional[tuple] = None):
    """``kernels.lora_expand`` through ``fast_multilora::lora_expand``: ``y`` updated in place and returned; with
    ``gemm`` ``(a, b)``, ``y += a @ b`` after it."""
    a, b = gemm if gemm is not None else (None, None)
    torch.ops.fast_multilora.lora_expand(h, B_cat, y, *_layout(segs, table, stack_num, slice_idx, accumulate), bias,
                                         a, b)
    return y


def lora_shrink_expand(x, A_cat, B_cat, segs: Segments, table: AdapterTable, y):
    """``kernels.lora_shrink_expand`` through ``fast_multilora::lora_shrink_expand``: ``y`` updated in place and
    returned (few rows, no dropout: decode steps)."""
    torch.ops.fast_multilora.lora_shrink_expand(x, A_cat, B_cat, y, *_layout(segs, table))
    return y


def lora_expand_bwd(dy, h, B_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, slice_idx: int = 0,
                    dh: Optional[Tensor] = None):
    """``kernels.lora_expand_bwd`` through ``fast_multilora::lora_expand_bwd``: ``(dh, dB_cat)``; a given ``dh`` is
    the starting content of the returned one (a new tensor: the op is functional). ``dB_cat`` in ``B_cat``'s layout:
    flat and blocked for the store's packed block."""
    return torch.ops.fast_multilora.lora_expand_bwd(dy, h, B_cat, *_layout(segs, table, stack_num, slice_idx), dh)


def lora_shrink_bwd(dh, x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1,
                    seed: Optional[Tensor] = None, need_dx: bool = True, keep: Optional[Tensor] = None,
                    gemm: Optional[tuple] = None):
    """``kernels.lora_shrink_bwd`` through ``fast_multilora::lora_shrink_bwd``: ``(dx or None, dA_cat)``; with
    ``gemm`` ``(a, b)`` (and ``need_dx``), ``dx += a @ b`` after the kernel wrote it."""
    a, b = gemm if gemm is not None else (None, None)
    dx, dA = torch.ops.fast_multilora.lora_shrink_bwd(dh, x, A_cat, *_layout(segs, table, stack_num, need_dx), seed,
                                                      keep, a, b)
    return (dx if need_dx else None), dA
