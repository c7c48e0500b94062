"""The Triton launchers as ``torch.library`` custom ops, so ``torch.compile`` traces through them without a graph break.

Ops, namespace ``fast_multilora`` (``torch.ops.fast_multilora.<name>``):

* ``lora_shrink``      ``(h, keep_bits)``: ``h = shrink(x, A_cat)``, its don't-care entries zero (the launcher leaves
  them uninitialised), so the op's output is fully defined; with ``store_mask`` and dropout, ``keep_bits`` is the
  packed keep-mask the backward reads, else an empty ``[0, 0]`` uint8 tensor (an op cannot return ``None``).
* ``lora_expand``      ``y (+)= expand(h, B_cat)`` in place (``accumulate=False``: written, base rows the bias or
  zero): mutates ``y``, returns nothing; ``torch.compile`` functionalises it.
* ``lora_expand_bwd``  ``(dh, dB_cat)``; an optional ``dh`` input is the starting content of the returned ``dh``
  (the launcher's fill-in-place ``dh``, made functional).
* ``lora_shrink_bwd``  ``(dx, dA_cat)``; without ``need_dx``, ``dx`` is an empty ``[0, K]`` tensor.

The ops are not differentiable: ``function.LoraLinear``, the one autograd Function of a patched layer call, calls
them in its forward and backward while ``torch.compile`` traces (and the launchers directly in eager mode), so the
compiled forward and backward graphs both hold them. A dropout ``seed`` is a one-element int32 device tensor, drawn
inside the traced graph: every replay of a captured CUDA graph draws a fresh one.

Op schemas take tensors and host scalars only: ``Segments`` and ``AdapterTable`` are passed as their fields
(``_layout``). ``Segments.cache`` does not cross the boundary: each op call rebuilds the ``Segments`` with an empty
cache, so the derived chunk tables (a few small device ops, no host sync) are recomputed inside every op call and
therefore belong to whatever graph is traced or captured -- a cache hit across calls would freeze a layout into a
CUDA graph. The eager path (``function.TritonBackend`` outside ``torch.compile``) calls the launchers directly and
keeps its per-``Segments`` cache.

The Python wrappers below (``lora_shrink`` ... ``lora_shrink_bwd``) take ``Segments`` / ``AdapterTable`` like the
launchers in ``fast_multilora.kernels`` and call the ops.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import kernels as K
from .kernels.segments import AdapterTable, Segments


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Dtype of ``h``, ``dh`` and the weight gradients: float32, float64 for float64 activations."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _layout(segs: Segments, table: AdapterTable) -> tuple:
    """The op arguments of a layout: ``Segments`` less its cache, then the ``AdapterTable`` fields the kernels read
    (not ``slots``: the ops take concatenated weights)."""
    order, bounds = segs.grouping if segs.grouping is not None else (None, None)
    return (segs.indptr, segs.slot, segs.perm, segs.max_len, segs.num_tokens, segs.base_max_len, order, bounds,
            table.ranks, table.offsets, table.scales, table.dropout, table.max_rank, table.total_rank,
            table.has_dropout)


def _unpack(indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets, scales, dropout,
            max_rank, total_rank, has_dropout) -> tuple[Segments, AdapterTable]:
    """Inverse of ``_layout`` inside an op: a ``Segments`` with a fresh (per-call) cache and the ``AdapterTable``."""
    grouping = (order, bounds) if order is not None else None
    segs = Segments(indptr, slot, perm, max_len, num_tokens, {}, base_max_len, grouping=grouping)
    return segs, AdapterTable(ranks, offsets, scales, dropout, max_rank, total_rank, has_dropout)


# ------------------------------------------------------------------------------------------------------------------
# The four launchers
# ------------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fast_multilora::lora_shrink", mutates_args=())
def _shrink_op(
    x: Tensor, A_cat: Tensor,
    indptr: Tensor, slot: Tensor, perm: Optional[Tensor], max_len: int, num_tokens: int, base_max_len: int,
    order: Optional[Tensor], bounds: Optional[Tensor],
    ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor, max_rank: int, total_rank: int, has_dropout: bool,
    stack_num: int, seed: Optional[Tensor], store_mask: bool,
) -> tuple[Tensor, Tensor]:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets,
                          scales, dropout, max_rank, total_rank, has_dropout)
    out = torch.zeros(x.shape[0], stack_num * max_rank, dtype=_acc(x.dtype), device=x.device)
    # zero-filled: the kernel writes adapter tokens' rows only, and an op's output must be fully defined
    keep = K.keep_bits_buffer(x).zero_() if _stores(seed, has_dropout, store_mask, stack_num) else None
    K.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, seed=seed, out=out, keep_out=keep)
    return out, keep if keep is not None else x.new_empty(0, 0, dtype=torch.uint8)


def _stores(seed, has_dropout: bool, store_mask: bool, stack_num: int) -> bool:
    return seed is not None and has_dropout and store_mask and stack_num == 1


@_shrink_op.register_fake
def _(x, A_cat,
      indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets, scales, dropout, max_rank,
      total_rank, has_dropout, stack_num, seed, store_mask):
    h = x.new_empty(x.shape[0], stack_num * max_rank, dtype=_acc(x.dtype))
    shape = (x.shape[0], (x.shape[1] + 7) // 8) if _stores(seed, has_dropout, store_mask, stack_num) else (0, 0)
    return h, x.new_empty(shape, dtype=torch.uint8)


@torch.library.custom_op("fast_multilora::lora_expand", mutates_args=("y",))
def _expand_op(
    h: Tensor, B_cat: Tensor, y: Tensor,
    indptr: Tensor, slot: Tensor, perm: Optional[Tensor], max_len: int, num_tokens: int, base_max_len: int,
    order: Optional[Tensor], bounds: Optional[Tensor],
    ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor, max_rank: int, total_rank: int, has_dropout: bool,
    stack_num: int, slice_idx: int, accumulate: bool, bias: Optional[Tensor],
) -> None:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets,
                          scales, dropout, max_rank, total_rank, has_dropout)
    K.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx, accumulate=accumulate,
                  bias=bias)


@_expand_op.register_fake
def _(h, B_cat, y,
      indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets, scales, dropout, max_rank,
      total_rank, has_dropout, stack_num, slice_idx, accumulate, bias):
    return None


@torch.library.custom_op("fast_multilora::lora_expand_bwd", mutates_args=())
def _expand_bwd_op(
    dy: Tensor, h: Tensor, B_cat: Tensor,
    indptr: Tensor, slot: Tensor, perm: Optional[Tensor], max_len: int, num_tokens: int, base_max_len: int,
    order: Optional[Tensor], bounds: Optional[Tensor],
    ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor, max_rank: int, total_rank: int, has_dropout: bool,
    stack_num: int, slice_idx: int, dh: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets,
                          scales, dropout, max_rank, total_rank, has_dropout)
    dh = dh.clone() if dh is not None else None  # functional: the input is the starting content, never written
    return K.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx, dh=dh)


@_expand_bwd_op.register_fake
def _(dy, h, B_cat,
      indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets, scales, dropout, max_rank,
      total_rank, has_dropout, stack_num, slice_idx, dh):
    acc = _acc(dy.dtype)
    return (dy.new_empty(dy.shape[0], stack_num * max_rank, dtype=acc),
            dy.new_empty(dy.shape[1], total_rank, dtype=acc))


@torch.library.custom_op("fast_multilora::lora_shrink_bwd", mutates_args=())
def _shrink_bwd_op(
    dh: Tensor, x: Tensor, A_cat: Tensor,
    indptr: Tensor, slot: Tensor, perm: Optional[Tensor], max_len: int, num_tokens: int, base_max_len: int,
    order: Optional[Tensor], bounds: Optional[Tensor],
    ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor, max_rank: int, total_rank: int, has_dropout: bool,
    stack_num: int, seed: Optional[Tensor], need_dx: bool, keep: Optional[Tensor],
) -> tuple[Tensor, Tensor]:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets,
                          scales, dropout, max_rank, total_rank, has_dropout)
    keep = keep if keep is not None and keep.numel() else None
    dx, dA = K.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, seed=seed, need_dx=need_dx, keep=keep)
    return (dx if need_dx else x.new_empty(0, x.shape[1])), dA


@_shrink_bwd_op.register_fake
def _(dh, x, A_cat,
      indptr, slot, perm, max_len, num_tokens, base_max_len, order, bounds, ranks, offsets, scales, dropout, max_rank,
      total_rank, has_dropout, stack_num, seed, need_dx, keep):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0, x.shape[1])
    return dx, x.new_empty(stack_num * total_rank, x.shape[1], dtype=_acc(x.dtype))


# ------------------------------------------------------------------------------------------------------------------
# Wrappers with the launchers' signatures
# ------------------------------------------------------------------------------------------------------------------


def lora_shrink(x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, seed: Optional[Tensor] = None,
                store_mask: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """``(h, keep_bits or None)`` through ``fast_multilora::lora_shrink`` (``h``'s don't-care entries are zero)."""
    h, keep = torch.ops.fast_multilora.lora_shrink(x, A_cat, *_layout(segs, table), stack_num, seed, store_mask)
    return h, (keep if _stores(seed, table.has_dropout, store_mask, stack_num) else None)


def lora_expand(h, B_cat, segs: Segments, table: AdapterTable, y, *, stack_num: int = 1, slice_idx: int = 0,
                accumulate: bool = True, bias: Optional[Tensor] = None):
    """``kernels.lora_expand`` through ``fast_multilora::lora_expand``: ``y`` updated in place and returned."""
    torch.ops.fast_multilora.lora_expand(h, B_cat, y, *_layout(segs, table), stack_num, slice_idx, accumulate, bias)
    return y


def lora_expand_bwd(dy, h, B_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, slice_idx: int = 0,
                    dh: Optional[Tensor] = None):
    """``kernels.lora_expand_bwd`` through ``fast_multilora::lora_expand_bwd``: ``(dh, dB_cat)``; a given ``dh`` is
    the starting content of the returned one (a new tensor: the op is functional)."""
    return torch.ops.fast_multilora.lora_expand_bwd(dy, h, B_cat, *_layout(segs, table), stack_num, slice_idx, dh)


def lora_shrink_bwd(dh, x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1,
                    seed: Optional[Tensor] = None, need_dx: bool = True, keep: Optional[Tensor] = None):
    """``kernels.lora_shrink_bwd`` through ``fast_multilora::lora_shrink_bwd``: ``(dx or None, dA_cat)``."""
    dx, dA = torch.ops.fast_multilora.lora_shrink_bwd(dh, x, A_cat, *_layout(segs, table), stack_num, seed, need_dx,
                                                      keep)
    return (dx if need_dx else None), dA
