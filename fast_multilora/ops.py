"""The Triton launchers as ``torch.library`` custom ops, so ``torch.compile`` traces through them without a graph break.

Ops, namespace ``fast_multilora`` (``torch.ops.fast_multilora.<name>``):

* ``lora_shrink``      ``h = shrink(x, A_cat)``; the don't-care entries of ``h`` are zero (the launcher leaves them
  uninitialised), so the op's output is fully defined.
* ``lora_expand``      ``y += expand(h, B_cat)`` in place: mutates ``y``, returns nothing.
* ``lora_expand_bwd``  ``(dh, dB_cat)``; an optional ``dh`` input is the starting content of the returned ``dh``
  (the launcher's fill-in-place ``dh``, made functional).
* ``lora_shrink_bwd``  ``(dx, dA_cat)``; without ``need_dx``, ``dx`` is an empty ``[0, K]`` tensor (an op cannot return
  ``None``).
* ``lora_delta``       the differentiable one: ``(out, h)`` with ``out = y + delta(x)`` a new tensor (``y`` is not
  mutated: autograd of custom ops needs a functional op) and ``h`` the shrink output saved for backward (not
  differentiable). Its backward runs ``lora_expand_bwd`` then ``lora_shrink_bwd``, so the compiled backward graph
  holds ops too.

Op schemas take tensors and host scalars only: ``Segments`` and ``AdapterTable`` are passed as their fields
(``_layout``). ``Segments.cache`` does not cross the boundary: each op call rebuilds the ``Segments`` with an empty
cache, so the derived chunk tables (a few small device ops, no host sync) are recomputed inside every op call and
therefore belong to whatever graph is traced or captured -- a cache hit across calls would freeze a layout into a
CUDA graph. The eager path (``function.TritonBackend`` outside ``torch.compile``) calls the launchers directly and
keeps its per-``Segments`` cache.

The Python wrappers below (``lora_shrink`` ... ``lora_shrink_bwd``, ``lora_delta``) take ``Segments`` /
``AdapterTable`` like the launchers in ``fast_multilora.kernels`` and call the ops.
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
    return (segs.indptr, segs.slot, segs.perm, segs.max_len, segs.num_tokens, table.ranks, table.offsets, table.scales,
            table.dropout, table.max_rank, table.total_rank, table.has_dropout)


def _unpack(indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank, total_rank,
            has_dropout) -> tuple[Segments, AdapterTable]:
    """Inverse of ``_layout`` inside an op: a ``Segments`` with a fresh (per-call) cache and the ``AdapterTable``."""
    segs = Segments(indptr, slot, perm, max_len, num_tokens, {})
    return segs, AdapterTable(ranks, offsets, scales, dropout, max_rank, total_rank, has_dropout)


# ------------------------------------------------------------------------------------------------------------------
# The four launchers
# ------------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fast_multilora::lora_shrink", mutates_args=())
def _shrink_op(x: Tensor, A_cat: Tensor, indptr: Tensor, slot: Tensor, perm: Optional[Tensor], max_len: int,
               num_tokens: int, ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor, max_rank: int,
               total_rank: int, has_dropout: bool, stack_num: int, seed: Optional[int]) -> Tensor:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank,
                          total_rank, has_dropout)
    out = torch.zeros(x.shape[0], stack_num * max_rank, dtype=_acc(x.dtype), device=x.device)
    return K.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, seed=seed, out=out)


@_shrink_op.register_fake
def _(x, A_cat, indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank, total_rank,
      has_dropout, stack_num, seed):
    return x.new_empty(x.shape[0], stack_num * max_rank, dtype=_acc(x.dtype))


@torch.library.custom_op("fast_multilora::lora_expand", mutates_args=("y",))
def _expand_op(h: Tensor, B_cat: Tensor, y: Tensor, indptr: Tensor, slot: Tensor, perm: Optional[Tensor],
               max_len: int, num_tokens: int, ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor,
               max_rank: int, total_rank: int, has_dropout: bool, stack_num: int, slice_idx: int) -> None:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank,
                          total_rank, has_dropout)
    K.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx)


@_expand_op.register_fake
def _(h, B_cat, y, indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank, total_rank,
      has_dropout, stack_num, slice_idx):
    return None


@torch.library.custom_op("fast_multilora::lora_expand_bwd", mutates_args=())
def _expand_bwd_op(dy: Tensor, h: Tensor, B_cat: Tensor, indptr: Tensor, slot: Tensor, perm: Optional[Tensor],
                   max_len: int, num_tokens: int, ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor,
                   max_rank: int, total_rank: int, has_dropout: bool, stack_num: int, slice_idx: int,
                   dh: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank,
                          total_rank, has_dropout)
    dh = dh.clone() if dh is not None else None  # functional: the input is the starting content, never written
    return K.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx, dh=dh)


@_expand_bwd_op.register_fake
def _(dy, h, B_cat, indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank, total_rank,
      has_dropout, stack_num, slice_idx, dh):
    acc = _acc(dy.dtype)
    return (dy.new_empty(dy.shape[0], stack_num * max_rank, dtype=acc),
            dy.new_empty(dy.shape[1], total_rank, dtype=acc))


@torch.library.custom_op("fast_multilora::lora_shrink_bwd", mutates_args=())
def _shrink_bwd_op(dh: Tensor, x: Tensor, A_cat: Tensor, indptr: Tensor, slot: Tensor, perm: Optional[Tensor],
                   max_len: int, num_tokens: int, ranks: Tensor, offsets: Tensor, scales: Tensor, dropout: Tensor,
                   max_rank: int, total_rank: int, has_dropout: bool, stack_num: int, seed: Optional[int],
                   need_dx: bool) -> tuple[Tensor, Tensor]:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank,
                          total_rank, has_dropout)
    dx, dA = K.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, seed=seed, need_dx=need_dx)
    return (dx if need_dx else x.new_empty(0, x.shape[1])), dA


@_shrink_bwd_op.register_fake
def _(dh, x, A_cat, indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank, total_rank,
      has_dropout, stack_num, seed, need_dx):
    dx = x.new_empty(x.shape) if need_dx else x.new_empty(0, x.shape[1])
    return dx, x.new_empty(stack_num * total_rank, x.shape[1], dtype=_acc(x.dtype))


# ------------------------------------------------------------------------------------------------------------------
# The differentiable layer delta
# ------------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("fast_multilora::lora_delta", mutates_args=())
def _delta_op(x: Tensor, y: Tensor, A_cat: Tensor, B_cat: Tensor, indptr: Tensor, slot: Tensor,
              perm: Optional[Tensor], max_len: int, num_tokens: int, ranks: Tensor, offsets: Tensor, scales: Tensor,
              dropout: Tensor, max_rank: int, total_rank: int, has_dropout: bool,
              seed: Optional[int]) -> tuple[Tensor, Tensor]:
    segs, table = _unpack(indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank,
                          total_rank, has_dropout)
    h = torch.zeros(x.shape[0], max_rank, dtype=_acc(x.dtype), device=x.device)
    K.lora_shrink(x, A_cat, segs, table, seed=seed, out=h)
    out = y.clone(memory_format=torch.contiguous_format)
    K.lora_expand(h, B_cat, segs, table, out)
    return out, h


@_delta_op.register_fake
def _(x, y, A_cat, B_cat, indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank,
      total_rank, has_dropout, seed):
    return (torch.empty_like(y, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[0], max_rank, dtype=_acc(x.dtype)))


def _delta_setup(ctx, inputs, output):
    x, _, A_cat, B_cat, indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout = inputs[:13]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, output[1], A_cat, B_cat, indptr, slot, perm, ranks, offsets, scales, dropout)
    ctx.host = (max_len, num_tokens, *inputs[13:])  # max_len, num_tokens, max_rank, total_rank, has_dropout, seed


def _delta_backward(ctx, d_out, _d_h):
    x, h, A_cat, B_cat, indptr, slot, perm, ranks, offsets, scales, dropout = ctx.saved_tensors
    max_len, num_tokens, max_rank, total_rank, has_dropout, seed = ctx.host
    layout = (indptr, slot, perm, max_len, num_tokens, ranks, offsets, scales, dropout, max_rank, total_rank,
              has_dropout)
    need_x, _, need_a, need_b = ctx.needs_input_grad[:4]
    grads = [None] * len(ctx.needs_input_grad)
    grads[1] = d_out  # out = y + delta: the identity for y
    if need_x or need_a or need_b:
        dy = d_out.contiguous()
        dh, dB = torch.ops.fast_multilora.lora_expand_bwd(dy, h, B_cat, *layout, 1, 0, None)
        dx, dA = torch.ops.fast_multilora.lora_shrink_bwd(dh, x, A_cat, *layout, 1, seed, need_x)
        grads[0] = dx if need_x else None
        grads[2] = dA.to(A_cat.dtype) if need_a else None
        grads[3] = dB.to(B_cat.dtype) if need_b else None
    return tuple(grads)


_delta_op.register_autograd(_delta_backward, setup_context=_delta_setup)


# ------------------------------------------------------------------------------------------------------------------
# Wrappers with the launchers' signatures
# ------------------------------------------------------------------------------------------------------------------


def lora_shrink(x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1,
                seed: Optional[int] = None) -> Tensor:
    """``kernels.lora_shrink`` through ``fast_multilora::lora_shrink`` (``h``'s don't-care entries are zero)."""
    return torch.ops.fast_multilora.lora_shrink(x, A_cat, *_layout(segs, table), stack_num, seed)


def lora_expand(h, B_cat, segs: Segments, table: AdapterTable, y, *, stack_num: int = 1, slice_idx: int = 0):
    """``kernels.lora_expand`` through ``fast_multilora::lora_expand``: ``y`` updated in place and returned."""
    torch.ops.fast_multilora.lora_expand(h, B_cat, y, *_layout(segs, table), stack_num, slice_idx)
    return y


def lora_expand_bwd(dy, h, B_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, slice_idx: int = 0,
                    dh: Optional[Tensor] = None):
    """``kernels.lora_expand_bwd`` through ``fast_multilora::lora_expand_bwd``; a given ``dh`` is updated in place,
    as the launcher does."""
    new_dh, dB = torch.ops.fast_multilora.lora_expand_bwd(dy, h, B_cat, *_layout(segs, table), stack_num, slice_idx,
                                                          dh)
    if dh is None:
        return new_dh, dB
    dh.copy_(new_dh)
    return dh, dB


def lora_shrink_bwd(dh, x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1,
                    seed: Optional[int] = None, need_dx: bool = True):
    """``kernels.lora_shrink_bwd`` through ``fast_multilora::lora_shrink_bwd``: ``(dx or None, dA_cat)``."""
    dx, dA = torch.ops.fast_multilora.lora_shrink_bwd(dh, x, A_cat, *_layout(segs, table), stack_num, seed, need_dx)
    return (dx if need_dx else None), dA


def lora_delta(x, y, A_cat, B_cat, segs: Segments, table: AdapterTable, seed: Optional[int] = None) -> Tensor:
    """``y + delta(x)`` for 2-D ``x[S, K]``, ``y[S, N]`` as a new tensor, differentiable in ``x``, ``y``, ``A_cat``,
    ``B_cat`` (``fast_multilora::lora_delta``); dropout from the Philox ``seed`` when the table has any."""
    out, _ = torch.ops.fast_multilora.lora_delta(x, y, A_cat, B_cat, *_layout(segs, table), seed)
    return out
