"""The autograd Function of one layer's LoRA delta over a mixed batch, and the two backends it runs on.

``y = base(x) + sum over segments of scale_a * dropout_a(x_seg) @ A_a^T @ B_a^T`` -- the base layer stays opaque
(it may be quantized); only the delta is ours. The delta is added in place into the base output ``y`` (the expand's
fused add), so ``y`` is marked dirty and its gradient passes through unchanged.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from . import reference
from .kernels.dropout import quantize_p
from .kernels.segments import AdapterTable, Segments


def _no_autocast(fn):
    """Run a reference op with autocast off: its matmuls must keep the dtypes the op contract names (as the
    kernels do), not autocast's."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with torch.autocast(args[0].device.type, enabled=False):
            return fn(self, *args, **kwargs)

    return wrapper


# The Triton backend reads each adapter's weights where they are (``kernels.SlotWeights``, a per-slot address table
# cached per layer) instead of concatenating them on every call; FML_WEIGHTS_IN_PLACE=0 concatenates (for A/B runs).
WEIGHTS_IN_PLACE = os.environ.get("FML_WEIGHTS_IN_PLACE", "1") != "0"

# A training forward under dropout stores its keep-mask (one bit per element of x) for the backward, which then
# reads it instead of drawing it again; FML_STORE_DROPOUT_MASK=0 redraws it in the backward (saves that memory).
STORE_DROPOUT_MASK = os.environ.get("FML_STORE_DROPOUT_MASK", "1") != "0"


class TorchBackend:
    """Pure-PyTorch segmented ops (``fast_multilora.reference``); dropout masks drawn from the seed on the device."""

    name = "torch"

    @staticmethod
    def _keep(x, segs, table, seed, stack_num=1):
        """The keep-mask for ``seed``: ``[S, K]``, or one per slice of a stack (``[stack_num, S, K]``)."""
        if seed is None or not table.has_dropout:
            return None
        g = torch.Generator(device=x.device)
        g.manual_seed(seed)
        p = reference.token_slots(segs)
        p = torch.where(p >= 0, table.dropout[p.clamp(min=0)], torch.zeros((), device=x.device))
        shape = (stack_num, *x.shape) if stack_num > 1 else x.shape
        return torch.rand(shape, generator=g, device=x.device) >= p[:, None]

    @staticmethod
    def keep_buffer(x, seed, table):
        """No stored mask: the backward redraws it from the seed."""
        return None

    @staticmethod
    def weights(ws, table, dim):
        """One layer's adapter weights (slot order) as the ops take them: concatenated along ``dim``."""
        return torch.cat(ws, dim)

    @_no_autocast
    def shrink(self, x, A_cat, segs, table, stack_num, seed, keep_out=None):
        keep = self._keep(x, segs, table, seed, stack_num)
        return reference.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, keep=keep)

    @_no_autocast
    def expand(self, h, B_cat, segs, table, y, stack_num, slice_idx, accumulate=True, bias=None):
        return reference.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx,
                                     accumulate=accumulate, bias=bias)

    @_no_autocast
    def expand_bwd(self, dy, h, B_cat, segs, table, stack_num, slice_idx, dh=None, grad_dtype=None):
        # grad_dtype: a hint the reference does not take (its weight gradients stay float32 [N, total_rank])
        return reference.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx, dh=dh)

    @_no_autocast
    def shrink_bwd(self, dh, x, A_cat, segs, table, stack_num, seed, need_dx, keep=None, grad_dtype=None):
        keep = self._keep(x, segs, table, seed, stack_num)
        return reference.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, keep=keep, need_dx=need_dx)


class TritonBackend:
    """Triton kernels (``fast_multilora.kernels``); on CPU tensors they need ``TRITON_INTERPRET=1``.

    Eager calls go straight to the launchers; while ``torch.compile`` traces, the same calls go through the
    ``torch.library`` custom ops of ``fast_multilora.ops`` (same signatures), which the compiler can trace through.
    """

    name = "triton"

    def __init__(self):
        from . import kernels as K
        from . import ops

        self.k = K
        self.ops = ops

    def _impl(self):
        return self.ops if torch.compiler.is_compiling() else self.k

    def weights(self, ws, table, dim):
        """One layer's adapter weights (slot order; ``dim=0``: A weights, ``dim=1``: B weights) as the kernels take
        them: read in place (``kernels.SlotWeights``) in eager mode where ``kernels.slot_weights`` allows it, else
        their concatenation along ``dim`` (and always while ``torch.compile`` traces: the custom ops take tensors)."""
        if WEIGHTS_IN_PLACE and table.slots is not None and not torch.compiler.is_compiling():
            w = self.k.slot_weights(ws, table.slots, table.ranks.numel(), dim)
            if w is not None:
                return w
        return torch.cat(ws, dim)

    def keep_buffer(self, x, seed, table):
        """A buffer for the packed dropout mask the forward shrink stores and the backward reads (eager only: the
        custom ops redraw it), or ``None`` without dropout."""
        if seed is None or not table.has_dropout or not STORE_DROPOUT_MASK or torch.compiler.is_compiling():
            return None
        return self.k.keep_bits_buffer(x)

    def shrink(self, x, A_cat, segs, table, stack_num, seed, keep_out=None):
        if keep_out is not None:
            return self.k.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, seed=seed, keep_out=keep_out)
        return self._impl().lora_shrink(x, A_cat, segs, table, stack_num=stack_num, seed=seed)

    def expand(self, h, B_cat, segs, table, y, stack_num, slice_idx, accumulate=True, bias=None):
        if accumulate:
            return self._impl().lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx)
        # write mode: eager only (FusedLinearDelta, which is not used while torch.compile traces)
        return self.k.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx,
                                  accumulate=False, bias=bias)

    def expand_bwd(self, dy, h, B_cat, segs, table, stack_num, slice_idx, dh=None, grad_dtype=None):
        """``(dh, dB)``. With ``grad_dtype`` (eager only), ``dB`` comes in that dtype as one contiguous ``[N, r_a]``
        block per adapter, flat (``_split_grads`` takes it apart without a copy), and a new ``dh`` is not
        zero-filled: only the cells the shrink backward reads (adapter rows, their rank's columns) are written, as
        the kernel tests check with NaN in the rest; otherwise float32 ``[N, total_rank]`` and a zero-filled ``dh``."""
        if grad_dtype is not None and not torch.compiler.is_compiling():
            dB = torch.empty(table.total_rank * B_cat.shape[0], dtype=grad_dtype, device=dy.device)
            if dh is None:  # for this backend's shrink backward, which reads only the cells the expand writes
                dh = torch.empty(dy.shape[0], stack_num * table.max_rank, dtype=h.dtype, device=dy.device)
            return self.k.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx,
                                          dh=dh, dB_out=dB, dB_blocked=True)
        return self._impl().lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx,
                                            dh=dh)

    def shrink_bwd(self, dh, x, A_cat, segs, table, stack_num, seed, need_dx, keep=None, grad_dtype=None):
        """``(dx, dA)``; with ``grad_dtype`` (eager only) ``dA`` comes in that dtype, else float32."""
        eager = keep is not None or (grad_dtype is not None and not torch.compiler.is_compiling())
        if eager:
            dA = None if grad_dtype is None else torch.empty(stack_num * table.total_rank, x.shape[1],
                                                             dtype=grad_dtype, device=x.device)
            return self.k.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, seed=seed,
                                          need_dx=need_dx, keep=keep, dA_out=dA)
        return self._impl().lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, seed=seed,
                                            need_dx=need_dx)


_BACKENDS: dict = {}


def get_backend(name: str, device: torch.device):
    """Resolve ``"auto" | "torch" | "triton"`` for tensors on ``device``."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before triton is "
            "imported, or use backend='torch' (or 'auto') on CPU"
        )
    if name not in ("torch", "triton"):
        raise ValueError(f"unknown backend {name!r}; expected 'auto', 'torch' or 'triton'")
    if name not in _BACKENDS:
        _BACKENDS[name] = TorchBackend() if name == "torch" else TritonBackend()
    return _BACKENDS[name]


@dataclass
class DeltaSpec:
    """Everything but tensors that one layer call needs (kept on ``ctx`` for backward)."""

    segs: Segments
    table: AdapterTable
    backend: object
    seed: Optional[int]  # dropout seed, None when no dropout this call
    num_adapters: int  # adapters present in the layer (their A and B weights follow x, y in apply())
    ranks: tuple  # host ranks of those adapters, in slot order
    has_bias: bool  # lora_bias: one bias per adapter follows the B weights
    bias_slots: Optional[torch.Tensor] = None  # [S] slot-table row per token for the bias gather
    grad: bool = True  # autograd records the call (grad mode at the call; inside a Function's forward it is off)


def as_rows(x_in: torch.Tensor) -> torch.Tensor:
    """``x[..., K]`` as contiguous rows ``[S, K]`` (a view when it already is)."""
    x = x_in.reshape(-1, x_in.shape[-1])
    return x if x.is_contiguous() else x.contiguous()


def own_storage(result: torch.Tensor) -> torch.Tensor:
    """``result`` as a tensor the delta may be added to in place: itself when it owns contiguous storage, else a
    contiguous copy (a view -- GPT-2's Conv1D returns one -- must not be written through)."""
    if not result.is_contiguous() or result._base is not None:
        return result.contiguous() if not result.is_contiguous() else result.clone()
    return result


def lora_dropout_rate(drop: torch.nn.Module) -> float:
    """The rate a PEFT ``lora_dropout`` module applies in this call, as the kernels draw it (rounded to 2^-16 by
    ``quantize_p``); 0 for ``nn.Identity`` or a module in eval mode."""
    return quantize_p(float(drop.p)) if isinstance(drop, torch.nn.Dropout) and drop.training else 0.0


def linear_with_delta(backend, x, W, bias, h, B_cat, segs, table, stack_num, slice_idx) -> torch.Tensor:
    """``x Wᵀ (+ bias) + delta``: the expand writes the delta into a fresh ``y`` (write mode, bias folded in, every
    row defined) and cuBLAS accumulates the base GEMM into it (``addmm_``, beta 1)."""
    y = torch.empty(x.shape[0], W.shape[0], dtype=x.dtype, device=x.device)
    backend.expand(h, B_cat, segs, table, y, stack_num, slice_idx, accumulate=False, bias=bias)
    return y.addmm_(x, W.t())


class LoraDelta(torch.autograd.Function):
    """``y += delta(x)`` for a mixed batch; inputs ``x[S, K]``, ``y[S, N]`` then every present adapter's ``A``
    (``[r, K]``), ``B`` (``[N, r]``) and, with ``lora_bias``, bias (``[N]``)."""

    @staticmethod
    def forward(ctx, x_in, y_in, spec: DeltaSpec, *weights):
        n = spec.num_adapters
        x = as_rows(x_in)
        y = y_in.view(-1, y_in.shape[-1])  # the caller passes a contiguous base output
        be = spec.backend
        A = be.weights(weights[:n], spec.table, 0) if n else x.new_zeros(0, x.shape[1])
        B = be.weights(weights[n : 2 * n], spec.table, 1) if n else y.new_zeros(y.shape[1], 0)
        keep = _keep_buffer(ctx, be, x, spec)
        h = be.shrink(x, A, spec.segs, spec.table, 1, spec.seed, keep)
        be.expand(h, B, spec.segs, spec.table, y, 1, 0)
        if spec.has_bias:
            _add_bias(y, weights[2 * n :], spec)
        ctx.mark_dirty(y_in)
        ctx.save_for_backward(x, h, keep, *weights[: 2 * n])  # the backward reads the weights as the forward did
        ctx.w_dtypes = [w.dtype for w in weights]
        ctx.spec = spec
        ctx.x_shape = x_in.shape
        return y_in

    @staticmethod
    def backward(ctx, dy_in):
        spec: DeltaSpec = ctx.spec
        x, h, keep, *weights = ctx.saved_tensors
        w_dtypes = ctx.w_dtypes
        n = spec.num_adapters
        needs = ctx.needs_input_grad
        need_dx = needs[0]
        need_w = any(needs[3:])
        dx, grads = None, [None] * len(w_dtypes)
        dy = dy_in.reshape(-1, dy_in.shape[-1])
        if (need_dx or need_w) and n:
            dy = dy.contiguous()
            be = spec.backend
            gd = _grad_dtype(w_dtypes[: 2 * n])
            A, B = be.weights(weights[:n], spec.table, 0), be.weights(weights[n:], spec.table, 1)
            dh, dB = be.expand_bwd(dy, h, B, spec.segs, spec.table, 1, 0, grad_dtype=gd)
            dx, dA = be.shrink_bwd(dh, x, A, spec.segs, spec.table, 1, spec.seed, need_dx, keep, grad_dtype=gd)
            grads[:n] = _split_grads(dA, spec.ranks, w_dtypes[:n], dim=0)
            grads[n : 2 * n] = _split_grads(dB, spec.ranks, w_dtypes[n : 2 * n], dim=1, n_rows=dy.shape[1])
            if spec.has_bias:
                for i, gbias in enumerate(_bias_grad(dy, spec)):
                    grads[2 * n + i] = gbias.to(w_dtypes[2 * n + i])
        elif need_dx:
            dx = torch.zeros_like(x)
        if dx is not None:
            dx = dx.view(ctx.x_shape)
        return (dx, dy_in, None, *grads)


class FusedLinearDelta(torch.autograd.Function):
    """``y = x Wᵀ (+ b) + delta(x)`` for a frozen ``nn.Linear`` base (``W``, ``b`` need no gradient): inputs
    ``x[..., K]``, ``W[N, K]``, ``b`` (or ``None``), the spec, then the adapters' weights as for :class:`LoraDelta`.

    The delta is written first (the expand in write mode, the bias folded in, base rows set to the bias or zero) and
    cuBLAS accumulates the base GEMM into it (``y.addmm_(x, Wᵀ)``, beta 1, read in the GEMM's epilogue), so the base
    output is not written, read back and rewritten by a separate add. Backward likewise: the shrink backward writes
    the LoRA part of ``dx`` (with ``dA``, one pass over ``x``) and cuBLAS accumulates ``dy W`` into it, instead of
    two ``dx`` tensors summed by autograd.
    """

    @staticmethod
    def forward(ctx, x_in, W, bias, spec: DeltaSpec, *weights):
        n = spec.num_adapters
        x = as_rows(x_in)
        be = spec.backend
        A = be.weights(weights[:n], spec.table, 0)
        B = be.weights(weights[n : 2 * n], spec.table, 1)
        keep = _keep_buffer(ctx, be, x, spec)
        h = be.shrink(x, A, spec.segs, spec.table, 1, spec.seed, keep)
        y = linear_with_delta(be, x, W, bias, h, B, spec.segs, spec.table, 1, 0)
        ctx.save_for_backward(x, h, W, keep, *weights)  # the backward reads the weights as the forward did
        ctx.w_dtypes = [w.dtype for w in weights]
        ctx.spec = spec
        ctx.x_shape = x_in.shape
        return y.view(*x_in.shape[:-1], W.shape[0])

    @staticmethod
    def backward(ctx, dy_in):
        spec: DeltaSpec = ctx.spec
        x, h, W, keep, *weights = ctx.saved_tensors
        n = spec.num_adapters
        needs = ctx.needs_input_grad
        need_dx, need_w = needs[0], any(needs[4:])
        dx, grads = None, [None] * len(ctx.w_dtypes)
        if need_dx or need_w:
            dy = dy_in.reshape(-1, dy_in.shape[-1]).contiguous()
            be = spec.backend
            gd = _grad_dtype(ctx.w_dtypes[: 2 * n])
            A, B = be.weights(weights[:n], spec.table, 0), be.weights(weights[n:], spec.table, 1)
            dh, dB = be.expand_bwd(dy, h, B, spec.segs, spec.table, 1, 0, grad_dtype=gd)
            # one pass over x for dA and the LoRA part of dx (written, base rows zero; the dropout mask drawn once)
            dx, dA = be.shrink_bwd(dh, x, A, spec.segs, spec.table, 1, spec.seed, need_dx, keep, grad_dtype=gd)
            if need_w:
                grads[:n] = _split_grads(dA, spec.ranks, ctx.w_dtypes[:n], dim=0)
                grads[n : 2 * n] = _split_grads(dB, spec.ranks, ctx.w_dtypes[n : 2 * n], dim=1, n_rows=W.shape[0])
            if need_dx:
                dx.addmm_(dy, W)
                dx = dx.view(ctx.x_shape)
        return (dx, None, None, None, *grads)


class _NoGradCtx:
    """Stands in for an autograd ctx when a Function's forward runs with autograd off: it records nothing."""

    needs_input_grad = ()

    def save_for_backward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def run(fn_cls, *args):
    """``fn_cls.apply(*args)``; with autograd off (``no_grad``, ``inference_mode``; not while ``torch.compile``
    traces) the Function's forward alone: nothing would be recorded, and the Function machinery's host time per call
    (argument unwrapping, the ctx) is a visible part of an eval forward's per-layer host time."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return fn_cls.apply(*args)
    return fn_cls.forward(_NoGradCtx(), *args)


def _keep_buffer(ctx, backend, x, spec: DeltaSpec):
    """Where the forward shrink stores its dropout mask for the backward: only when a gradient will be taken
    (``needs_input_grad`` alone does not tell: it ignores an enclosing ``torch.no_grad``)."""
    return backend.keep_buffer(x, spec.seed, spec.table) if spec.grad and any(ctx.needs_input_grad) else None


def _grad_dtype(dtypes: list):
    """The one dtype every adapter weight of the call has (the kernels then write the weight gradients in it, in
    the parameters' layout), else ``None``."""
    return dtypes[0] if dtypes and all(d == dtypes[0] for d in dtypes) else None


def _split_grads(g_cat: torch.Tensor, ranks: tuple, dtypes: list, dim: int, n_rows: int = 0) -> list:
    """Per-adapter gradients from a concatenated buffer, in each parameter's dtype.

    A 1-D ``g_cat`` (``dim=1``) is already blocked: adapter ``a``'s ``[n_rows, r_a]`` gradient is one contiguous
    piece, in its dtype (``TritonBackend.expand_bwd(grad_dtype=...)``): the pieces are views. Otherwise one cast kernel
    for the whole buffer instead of one per adapter (the per-call cost that dominated a layer's CPU time); the
    pieces are views, contiguous where the parameters are (``dim=0``, or equal ranks along ``dim=1`` through a
    blocked copy), so autograd keeps them as ``.grad`` without another copy.
    """
    if g_cat.dim() == 1:
        if len(set(ranks)) == 1 and all(dt == g_cat.dtype for dt in dtypes):  # one view, unbound: 2 torch calls
            return list(g_cat.view(len(ranks), n_rows, ranks[0]).unbind(0))
        pieces = g_cat.split([n_rows * r for r in ranks])
        return [g.view(n_rows, r).to(dt) for g, r, dt in zip(pieces, ranks, dtypes, strict=True)]
    if len(set(dtypes)) != 1:
        return [g.to(dt) for g, dt in zip(g_cat.split(ranks, dim=dim), dtypes, strict=True)]
    dtype = dtypes[0]
    if dim == 0:
        return list(g_cat.to(dtype).split(ranks, dim=0))
    if len(set(ranks)) == 1:  # [N, n*r] -> [n, N, r] contiguous: adapter a's [N, r] block is one contiguous view
        N, r = g_cat.shape[0], ranks[0]
        blocked = g_cat.view(N, len(ranks), r).permute(1, 0, 2).to(dtype, memory_format=torch.contiguous_format)
        return list(blocked.unbind(0))
    return list(g_cat.to(dtype).split(ranks, dim=1))


def _onehot(spec: DeltaSpec, dtype) -> torch.Tensor:
    """[num_adapters, S] one-hot of each token's present-adapter row (zeros for base/absent): a deterministic
    segment-sum by matmul, used only for ``lora_bias``."""
    idx = spec.bias_slots
    oh = torch.zeros(spec.num_adapters + 1, idx.numel(), dtype=dtype, device=idx.device)
    oh[idx, torch.arange(idx.numel(), device=idx.device)] = 1
    return oh[:-1]


def _add_bias(y, biases, spec: DeltaSpec) -> None:
    scales = spec.table.scales[spec.table.ranks > 0].to(torch.float32)  # present adapters, slot order
    bias = torch.stack([b.float() for b in biases]) * scales[:, None]  # [n, N]
    y += (_onehot(spec, torch.float32).T @ bias).to(y.dtype)


def _bias_grad(dy, spec: DeltaSpec):
    scales = spec.table.scales[spec.table.ranks > 0].to(torch.float32)
    g = _onehot(spec, torch.float32) @ dy.float()  # [n, N]
    return list(g * scales[:, None])
