"""The one autograd Function of a patched LoRA layer call over a mixed batch, and the two backends it runs on.

``out = base(x) + sum over segments of scale_a * dropout_a(x_seg) @ A_a^T @ B_a^T`` -- one Function,
:class:`LoraLinear`, for every patched layer call, parameterised by its :class:`LayerCall`:

* ``fused``: the base is a frozen ``nn.Linear`` (or, in training, a bitsandbytes 4-bit layer: ``base_weight``
  dequantizes its weight) whose GEMM runs inside the Function (SGEMM family, eager: the expand
  writes the delta, the bias folded in, and cuBLAS accumulates ``x Wᵀ`` into it; chunked family: the GEMM first, the
  delta added into it -- :func:`base_first`; backward: the shrink backward's ``dx``, every row written, and cuBLAS
  accumulating ``dy W`` into it -- eager and compiled alike, the GEMM inside the expand's and the shrink backward's
  calls); otherwise the base layer ran outside (it may be quantized or hooked) and the delta is added to its output.
* ``stored``: the weights are the adapter store's two leaves of the layer (``fast_multilora.store``: every adapter's
  ``A`` rows as ``A_cat``, its ``B`` blocks packed), else PEFT's per-adapter parameters (layers the store does not
  hold, and layers whose parameters DDP reduces itself: ``fast_multilora.ddp``).
* ``decode``: few rows with autograd off: shrink and expand in one launch.

A call depends on its inputs and the model's batch context only (``plan.Routing``): no state passes from one layer
call to the next.

Eager calls run the Triton launchers directly (their host time matters at 56 layer calls per step); while
``torch.compile`` traces, the same calls go through the custom ops of ``fast_multilora.ops``, so the compiled forward
and backward graphs hold them, with shapes that never depend on the adapter mix (see ``plan.py``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Optional

import torch

from . import cpu_ops, reference
from .kernels.dropout import quantize_p
from .kernels.segments import AdapterTable, Segments, SlotWeights


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _no_autocast(fn):
    """Run a reference op with autocast off: its matmuls must keep the dtypes the op contract names (as the
    kernels do), not autocast's."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        device = args[0].device.type
        if not torch.is_autocast_enabled(device):  # (entering the context costs ~10 us of host time per call)
            return fn(self, *args, **kwargs)
        with torch.autocast(device, enabled=False):
            return fn(self, *args, **kwargs)

    return wrapper


class TorchBackend:
    """Pure-PyTorch segmented ops: on a CPU, eager, ``fast_multilora.cpu_ops`` (each slot's rows only); elsewhere
    ``fast_multilora.reference`` (static shapes: they compile too). Dropout: the shrink draws the keep-mask from
    torch's RNG on the device and the backward reads the mask it returned."""

    name = "torch"

    @staticmethod
    def draw_seed(x):
        return 0  # this backend draws its mask from torch's RNG; a non-None seed only says "dropout this call"

    @staticmethod
    def weights(ws, table, dim, in_place=False):
        """One layer's adapter weights (slot order) as the ops take them: concatenated along ``dim``."""
        return torch.cat(ws, dim)

    @_no_autocast
    def shrink(self, x, A_cat, segs, table, stack_num, seed, store_mask=False, record=None):
        """``(h, keep)``: ``keep`` is the mask the backward needs (``None`` without dropout). ``record``: Triton
        only (a launch plan replays kernel launches)."""
        keep = None
        if seed is not None and table.has_dropout:
            ts = reference.token_slots(segs)
            p = torch.where(ts >= 0, table.dropout[ts.clamp(min=0)], 0.0)
            shape = (stack_num, *x.shape) if stack_num > 1 else x.shape
            keep = torch.rand(shape, device=x.device) >= p[:, None]
        if cpu_ops.applies(x, stack_num):
            return cpu_ops.lora_shrink(x, A_cat, segs, table, keep=keep), keep
        return reference.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, keep=keep), keep

    @_no_autocast
    def expand(self, h, B_cat, segs, table, y, stack_num, slice_idx, accumulate=True, bias=None, gemm=None,
               record=None):
        if cpu_ops.applies(h, stack_num):
            y = cpu_ops.lora_expand(h, B_cat, segs, table, y, accumulate=accumulate, bias=bias)
        else:
            y = reference.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx,
                                      accumulate=accumulate, bias=bias)
        return _add_gemm(y, gemm)

    @_no_autocast
    def shrink_expand(self, x, A_cat, B_cat, segs, table, y, record=None):
        if cpu_ops.applies(x):
            return cpu_ops.lora_shrink_expand(x, A_cat, B_cat, segs, table, y)
        return reference.lora_shrink_expand(x, A_cat, B_cat, segs, table, y)

    @staticmethod
    def takes_packed(x, stored) -> bool:
        """Whether a stored call takes the store's packed expand block as it is (``_b_weight``) and its backward can
        add its weight gradients into the arena (``grad_out``): the CPU ops, but for an experts layer (whose block
        ``LayerSlots.b_cat`` reorders for the reference ops)."""
        return cpu_ops.applies(x) and stored.experts == 1

    adds_grads = takes_packed

    @_no_autocast
    def expand_bwd(self, dy, h, B_cat, segs, table, stack_num, slice_idx, dh=None, grad_dtype=None, grad_out=None):
        # grad_dtype: a hint the reference does not take (its weight gradients stay float32 [N, total_rank]);
        # grad_out: the CPU ops only (adds_grads)
        if cpu_ops.applies(dy, stack_num):
            return cpu_ops.lora_expand_bwd(dy, h, B_cat, segs, table, dh=dh, dB_add=grad_out)
        return reference.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx, dh=dh)

    @_no_autocast
    def shrink_bwd(self, dh, x, A_cat, segs, table, stack_num, seed, need_dx, keep=None, grad_dtype=None,
                   grad_out=None, gemm=None):
        if cpu_ops.applies(x, stack_num):
            dx, dA = cpu_ops.lora_shrink_bwd(dh, x, A_cat, segs, table, keep=keep, need_dx=need_dx, dA_add=grad_out)
        else:
            dx, dA = reference.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, keep=keep,
                                               need_dx=need_dx)
        return _add_gemm(dx, gemm), dA


class TritonBackend:
    """Triton kernels (``fast_multilora.kernels``); on CPU tensors they need ``TRITON_INTERPRET=1``.

    Eager calls go straight to the launchers; while ``torch.compile`` traces, the same calls go through the
    ``torch.library`` custom ops of ``fast_multilora.ops`` (same signatures), which the compiler can trace through.
    """

    name = "triton"

    def __init__(self):
        from . import ops
        from .kernels import api as K

        self.k = K
        self.ops = ops

    @staticmethod
    def draw_seed(x):
        """The dropout seed of one call: a host int from the CPU RNG in eager mode (no launch, no sync; checkpoint
        recomputation restores that RNG, so it redraws the same seed); while ``torch.compile`` traces, a one-element
        int32 tensor drawn on the device inside the graph (a captured CUDA graph draws a fresh one per replay)."""
        if _compiling():
            return torch.randint(0, 2**31 - 1, (1,), dtype=torch.int32, device=x.device)
        return int(torch.randint(0, 2**31 - 1, (1,)))

    def weights(self, ws, table, dim, in_place=True):
        """One layer's adapter weights (slot order; ``dim=0``: A weights, ``dim=1``: B weights) as the kernels take
        them: read in place (``kernels.SlotWeights``) in eager mode where ``kernels.slot_weights`` allows it, else
        their concatenation along ``dim`` (and always while ``torch.compile`` traces: the custom ops take tensors)."""
        if in_place and table.slots is not None and not _compiling():
            w = self.k.slot_weights(ws, table.slots, table.ranks.numel(), dim)
            if w is not None:
                return w
        return torch.cat(ws, dim)

    def shrink(self, x, A_cat, segs, table, stack_num, seed, store_mask=False, record=None):
        """``(h, keep_bits)``: with ``store_mask`` under dropout (one slice), the packed keep-mask the forward drew,
        for the backward to read; else ``None``. ``record`` (a dict, eager calls without dropout): the launch is kept
        under ``"shrink"`` (``kernels.forward.Replay``)."""
        if _compiling():
            return self.ops.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, seed=seed, store_mask=store_mask)
        keep = None
        if store_mask and seed is not None and table.has_dropout and stack_num == 1:
            keep = self.k.keep_bits_buffer(x)
        launches = None if record is None else []
        h = self.k.lora_shrink(x, A_cat, segs, table, stack_num=stack_num, seed=seed, keep_out=keep, record=launches)
        if record is not None:
            record["shrink"] = launches[0]
        return h, keep

    def expand(self, h, B_cat, segs, table, y, stack_num, slice_idx, accumulate=True, bias=None, gemm=None,
               record=None):
        """``gemm``: ``(a, b)``, then ``y += a @ b`` (cuBLAS, beta 1: a fused layer's base GEMM added into the delta
        written); while ``torch.compile`` traces, inside the op. ``record`` (a dict, eager calls):
        the launch is kept under ``"expand"``."""
        if _compiling():
            return self.ops.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx,
                                        accumulate=accumulate, bias=bias, gemm=gemm)
        launches = None if record is None else []
        out = self.k.lora_expand(h, B_cat, segs, table, y, stack_num=stack_num, slice_idx=slice_idx,
                                 accumulate=accumulate, bias=bias, record=launches)
        if record is not None:
            record["expand"] = launches[0]
        return _add_gemm(out, gemm)

    def shrink_expand(self, x, A_cat, B_cat, segs, table, y, record=None):
        """``y += delta`` in one launch (``kernels.lora_shrink_expand``: few rows, no grad); ``record`` (a dict):
        the launch is kept under ``"decode"``. While ``torch.compile`` traces: the custom op."""
        if _compiling():
            return self.ops.lora_shrink_expand(x, A_cat, B_cat, segs, table, y)
        launches = None if record is None else []
        self.k.lora_shrink_expand(x, A_cat, B_cat, segs, table, y, record=launches)
        if record is not None:
            record["decode"] = launches[0]
        return y

    @staticmethod
    def takes_packed(x, stored) -> bool:
        """Every expand kernel reads the store's packed block as it is, eager or compiled."""
        return True

    @staticmethod
    def adds_grads(x, stored) -> bool:
        """Whether the backward of a stored call can add its weight gradients into the arena (``grad_out``): eager."""
        return not _compiling()

    def expand_bwd(self, dy, h, B_cat, segs, table, stack_num, slice_idx, dh=None, grad_dtype=None, grad_out=None):
        """``(dh, dB)``; a given ``dh`` is the starting content (written in place in eager mode). With
        ``grad_dtype`` (eager only), ``dB`` comes in that dtype as one contiguous ``[N, r_a]`` block per adapter,
        flat (``_split_grads`` takes it apart without a copy), and a new ``dh`` is not zero-filled: only the cells
        the shrink backward reads (adapter rows, their rank's columns) are written, as the kernel tests check with
        NaN in the rest; otherwise float32 ``[N, total_rank]`` and a zero-filled ``dh``. ``grad_out`` (eager, in
        that blocked layout): the slots with tokens get their gradient added there, the others' left as they are
        (returned as ``dB``)."""
        if _compiling():
            return self.ops.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx,
                                            dh=dh)
        if grad_dtype is None and grad_out is None:
            return self.k.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx, dh=dh)
        dB = grad_out if grad_out is not None else \
            torch.empty(table.total_rank * dy.shape[1], dtype=grad_dtype, device=dy.device)
        if dh is None:  # for this backend's shrink backward, which reads only the cells the expand writes
            dh = torch.empty(dy.shape[0], stack_num * table.max_rank, dtype=h.dtype, device=dy.device)
        return self.k.lora_expand_bwd(dy, h, B_cat, segs, table, stack_num=stack_num, slice_idx=slice_idx,
                                      dh=dh, dB_out=dB, dB_blocked=True, accumulate_dB=grad_out is not None)

    def shrink_bwd(self, dh, x, A_cat, segs, table, stack_num, seed, need_dx, keep=None, grad_dtype=None,
                   grad_out=None, gemm=None):
        """``(dx, dA)``; with ``grad_dtype`` (eager only) ``dA`` comes in that dtype, else float32. ``grad_out``: as
        :meth:`expand_bwd`'s. ``gemm``: ``(a, b)``, then ``dx += a @ b`` (the fused base's ``dy W``), inside the op
        while ``torch.compile`` traces."""
        if _compiling():
            return self.ops.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, seed=seed,
                                            need_dx=need_dx, keep=keep, gemm=gemm)
        dA = grad_out if grad_out is not None else None if grad_dtype is None else \
            torch.empty(stack_num * table.total_rank, x.shape[1], dtype=grad_dtype, device=x.device)
        dx, dA = self.k.lora_shrink_bwd(dh, x, A_cat, segs, table, stack_num=stack_num, seed=seed, need_dx=need_dx,
                                        keep=keep, dA_out=dA, accumulate_dA=grad_out is not None)
        return _add_gemm(dx, gemm), dA


_BACKENDS: dict = {}


_RESOLVED: dict = {}  # (name, device type) -> backend, once resolved (every patched layer call asks)


def get_backend(name: str, device: torch.device):
    """Resolve ``"auto" | "torch" | "triton"`` for tensors on ``device``."""
    hit = _RESOLVED.get((name, device.type))
    if hit is not None:
        return hit
    backend = _resolve(name, device)
    if not (backend.name == "triton" and device.type == "cpu"):  # that one depends on TRITON_INTERPRET: asked each time
        _RESOLVED[(name, device.type)] = backend
    return backend


def _resolve(name: str, device: torch.device):
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


# not frozen: a frozen dataclass's __init__ sets each field through object.__setattr__ (~2 us more per layer call)
@dataclass(eq=False, slots=True)
class LayerCall:
    """Everything but the weights that one patched layer call needs (kept on ``ctx`` for backward).

    Weights passed to :class:`LoraLinear`, in order: the A weights, the B weights (slot order; the store's two
    leaves when ``stored``) and, with ``lora_bias``, the B biases.
    """

    backend: object
    segs: Segments
    table: AdapterTable  # this layer's
    ranks: tuple  # host ranks of this layer's present adapters, slot order
    fused: bool = False
    seed: object = None  # dropout this call: a host int or a device int32 tensor (TritonBackend.draw_seed)
    store_mask: bool = False
    in_place: bool = False  # eager Triton: weights read in place (kernels.SlotWeights)
    has_bias: bool = False  # lora_bias
    bias_rows: Optional[torch.Tensor] = None  # [S] row of each token's adapter among the present ones (n: none)
    # an MoE experts call (``fast_multilora.moe``): each weight holds this many slots of the table (its experts), so
    # dB comes as one concatenation [N, total_rank] (the expand backward's per-slot blocks are not the weights')
    experts: int = 1
    # the adapter store's slots of this layer (``fast_multilora.store.LayerSlots``): the weights are its two leaves,
    # ``A_cat[total_rank, K]`` and the packed B block, whose gradients come whole (no split per adapter)
    stored: object = None
    # a dict the forward fills with what a :class:`LaunchPlan` replays (eager no-grad Triton calls, ``plan_key``)
    record: Optional[dict] = None
    # few rows with autograd off (decode steps): shrink and expand in one launch, no ``h`` (``kernels.decode``); no
    # dropout, no ``lora_bias``
    decode: bool = False
    # fused over a quantized base: the GEMM's ``[N, K]`` weight from the passed one, ``base_weight(W, dtype)``, in the
    # forward and again in the backward (bitsandbytes 4-bit: dequantized; only the packed weight is kept)
    base_weight: object = None
    # DoRA under dropout: its base term reads the same dropped input, so the call returns ``(out, keep)``, ``keep``
    # the mask the shrink drew (the Triton kernels' packed bits, kept whatever ``store_mask`` says; the torch
    # backend's booleans): a second output of the Function, which ``torch.compile`` traces like the first
    want_keep: bool = False
    # the per-parameter path: positions (slot order) of present adapters without rows in this call, whose weights get
    # no gradient (``None``, as under stock PEFT, where such an adapter is not in the graph); empty: every adapter
    # gets its gradient, exact zeros where it has no rows (what DDP and FSDP2 need of every parameter they reduce)
    absent: tuple = ()

    @property
    def n_adapters(self) -> int:
        return len(self.ranks)

    @property
    def n_a(self) -> int:
        """How many A weight tensors the call takes."""
        return 1 if self.stored is not None else len(self.ranks)

    @property
    def n_b(self) -> int:
        """How many B weight tensors the call takes."""
        return 1 if self.stored is not None else len(self.ranks)


def as_rows(x_in: torch.Tensor) -> torch.Tensor:
    """``x[..., K]`` as contiguous rows ``[S, K]`` (a view when it already is)."""
    x = x_in.reshape(-1, x_in.shape[-1])
    return x if x.is_contiguous() else x.contiguous()


def lora_dropout_rate(drop: torch.nn.Module) -> float:
    """The rate a PEFT ``lora_dropout`` module applies in this call, as the kernels draw it (rounded to 2^-16 by
    ``quantize_p``); 0 for ``nn.Identity`` or a module in eval mode."""
    return quantize_p(float(drop.p)) if isinstance(drop, torch.nn.Dropout) and drop.training else 0.0


def _add_gemm(t: torch.Tensor, gemm: Optional[tuple]) -> torch.Tensor:
    """``t += a @ b`` in place for ``gemm = (a, b)`` (cuBLAS, beta 1: a fused layer's base GEMM added into the delta
    or ``dx`` a kernel wrote), ``t`` as it is for ``None``; returns ``t``."""
    return t if gemm is None else t.addmm_(*gemm)


def base_first(segs: Segments) -> bool:
    """Whether a fused call runs the base GEMM first and the expand adds the delta into its output, rather than the
    expand writing the delta (every row) and cuBLAS accumulating the GEMM into it (``addmm_``, beta 1): for the
    chunked family, whose write mode would zero-fill ``y`` first (one launch and one pass over ``y`` more than the
    GEMM's own write). The SGEMM family's write mode defines every row itself, and writing the delta then adding the
    GEMM in its epilogue is the cheaper pair on the GPU (``docs/kernels.md``). Reads the layout's kind only, eager
    and compiled alike."""
    return segs.perm is not None


def linear_with_delta(x, W, bias, expand, first: bool) -> torch.Tensor:
    """``x Wᵀ (+ bias) + delta``, ``expand(y, accumulate, bias, gemm)`` putting the delta into ``y``: the base GEMM
    ``first`` (:func:`base_first`) and the delta added, or the delta written (bias folded in) and the GEMM added by
    the expand's call (``gemm``: its operands; while ``torch.compile`` traces, inside the expand op, where a traced
    ``Tensor.addmm_`` would become an ``addmm`` that copies ``y`` first)."""
    if first:
        y = x @ W.t() if bias is None else torch.addmm(bias, x, W.t())
        expand(y, True, None, None)
        return y
    y = torch.empty(x.shape[0], W.shape[0], dtype=x.dtype, device=x.device)
    expand(y, False, bias, (x, W.t()))
    return y


def _delta_target(ctx, y_in: torch.Tensor) -> tuple:
    """``(returned tensor, its [S, N] rows)`` the delta is added into: in eager mode the base output itself when it
    owns contiguous storage (marked dirty: no copy), else a contiguous copy -- a view (GPT-2's Conv1D returns one)
    is never written through, and while ``torch.compile`` traces the op stays functional."""
    if not _compiling() and y_in.is_contiguous() and y_in._base is None:
        ctx.mark_dirty(y_in)
        return y_in, y_in.view(-1, y_in.shape[-1])
    out = y_in.clone(memory_format=torch.contiguous_format)
    return out, out.view(-1, out.shape[-1])


def _decode_target(ctx, fused: bool, x, y_in, W, b, out_shape) -> tuple:
    """``(returned tensor, its [S, N] rows)`` a decode call adds its delta into: fused, the base GEMM's output (one
    ``F.linear``), else :func:`_delta_target` of the base output -- the general path and its replay share it."""
    if fused:
        rows = torch.nn.functional.linear(x, W, b)
        return rows.view(out_shape), rows
    return _delta_target(ctx, y_in)


class LoraLinear(torch.autograd.Function):
    """``out = base + delta`` for one patched layer call (see the module docstring and :class:`LayerCall`).

    Inputs: ``x[..., K]``; ``y``, the base layer's output (``None`` when ``call.fused``); ``W``, ``b``, the frozen
    base weight and bias (``None`` unless fused); the call; then the weights. Output: ``out``.
    """

    @staticmethod
    def forward(ctx, x_in, y_in, W, b, call: LayerCall, *weights):
        ctx.set_materialize_grads(False)
        be, segs, table = call.backend, call.segs, call.table
        n, n_a = call.n_b, call.n_a
        x = as_rows(x_in)
        keep = None
        rec = call.record
        if call.decode:  # few rows, autograd off: one launch, no h
            A, B = _a_weight(call, weights[:n_a]), _b_weight(call, weights[n_a : n_a + n])
            out_shape = (*x_in.shape[:-1], W.shape[0]) if call.fused else None
            out, rows = _decode_target(ctx, call.fused, x, y_in, W, b, out_shape)  # the base GEMM first
            be.shrink_expand(x, A, B, segs, table, rows, record=rec)
            if rec is not None:
                rec.update(A=A, B=B, h=None, N=rows.shape[1], x_shape=x_in.shape)
            return out
        A = _a_weight(call, weights[:n_a])
        h, keep = be.shrink(x, A, segs, table, 1, call.seed, call.store_mask or call.want_keep, record=rec)
        B = _b_weight(call, weights[n_a : n_a + n])
        if call.fused:
            W_base = W if call.base_weight is None else call.base_weight(W, x.dtype)  # not kept for the backward
            rows = linear_with_delta(
                x, W_base, b, lambda y, acc, bias, gemm: be.expand(h, B, segs, table, y, 1, 0, accumulate=acc,
                                                                   bias=bias, gemm=gemm, record=rec), base_first(segs))
            del W_base
            out = rows.view(*x_in.shape[:-1], rows.shape[1])
        else:
            out, rows = _delta_target(ctx, y_in)
            be.expand(h, B, segs, table, rows, 1, 0, record=rec)
        if rec is not None:
            rec.update(A=A, B=B, h=h, N=rows.shape[1], x_shape=x_in.shape)
        if call.has_bias:
            _add_bias(rows, weights[n_a + n :], call)
        # the backward reads the weights as the forward did
        ctx.save_for_backward(x, h, W, keep, *weights[: n_a + n])
        ctx.call = call
        ctx.shapes = (x_in.shape, rows.shape[1])
        ctx.w_dtypes = tuple(w.dtype for w in weights)
        if call.want_keep:
            if keep is None:
                raise RuntimeError("fast_multilora: a layer call asked for its dropout mask (DoRA under dropout) but "
                                   "drew none; please report this")
            ctx.mark_non_differentiable(keep)
            return out, keep
        return out

    @staticmethod
    def backward(ctx, d_out, d_keep=None):  # (d_keep: the mask's, which has none)
        call: LayerCall = ctx.call
        x, h, W, keep, *weights = ctx.saved_tensors
        be, segs, table = call.backend, call.segs, call.table
        n, n_a = call.n_b, call.n_a
        x_shape, N = ctx.shapes
        w_dtypes = ctx.w_dtypes
        needs = ctx.needs_input_grad  # x, y, W, b, call, *weights
        need_dx, need_a = needs[0], any(needs[5 : 5 + n_a])
        need_b, need_bias = any(needs[5 + n_a : 5 + n_a + n]), any(needs[5 + n_a + n :])
        grads = [None] * len(w_dtypes)
        dx = d_y = dy = dh = None
        # the store's leaves: each slot's weight gradient added into the gradient arena where it lies, no leaf
        # gradient (whose size is the registry's: every adapter of the layer); the leaves' hooks run here instead
        add_a = add_b = False
        base_dx = call.fused and need_dx and d_out is not None
        if d_out is not None:
            add_a, add_b = _adds(call, x, need_a, 0), _adds(call, x, need_b, 1)
            dy = d_out.reshape(-1, N).contiguous()
            d_y = None if call.fused else d_out  # out = y + delta: the identity for y
            if need_dx or need_a or need_b:
                B = _b_weight(call, weights[n_a : n_a + n])
                dh, dB = be.expand_bwd(dy, h, B, segs, table, 1, 0,
                                       grad_dtype=_grad_dtype(w_dtypes[n_a : n_a + n])
                                       if call.experts == 1 or call.stored is not None else None,
                                       grad_out=call.stored.b_leaf.grad if add_b else None)
                if need_b and not add_b:  # (added: in the arena already)
                    if call.stored is not None:  # the packed block's gradient, whole
                        grads[n_a] = (dB if dB.dim() == 1 else call.stored.packed_grad(dB)).to(w_dtypes[n_a])
                    else:
                        grads[n_a : n_a + n] = _split_grads(dB, call.ranks, w_dtypes[n_a : n_a + n], dim=1,
                                                            n_rows=N)
            if call.has_bias and need_bias:
                for i, g in enumerate(_bias_grad(dy, call)):
                    grads[n_a + n + i] = g.to(w_dtypes[n_a + n + i])
        if base_dx and call.base_weight is not None:  # (dequantized here: not held through the expand backward)
            W = call.base_weight(W, dy.dtype)
        if dh is not None and (need_dx or need_a):
            A = _a_weight(call, weights[:n_a])
            dx, dA = be.shrink_bwd(dh, x, A, segs, table, 1, call.seed, need_dx, keep,
                                   grad_dtype=_grad_dtype(w_dtypes[:n_a]),
                                   grad_out=call.stored.a_leaf.grad if add_a else None,
                                   gemm=(dy, W) if base_dx else None)  # the kernel wrote every row, cuBLAS adds dy W
            if need_a and not add_a:  # (added: in the arena already)
                if call.stored is not None:
                    grads[0] = dA.to(w_dtypes[0])
                else:
                    grads[:n_a] = _split_grads(dA, call.ranks, w_dtypes[:n_a], dim=0)
        for i in call.absent:  # (per-parameter path: an adapter's own weights, and lora_bias its bias)
            grads[i] = grads[n_a + i] = None
            if call.has_bias:
                grads[n_a + n + i] = None
        if base_dx and dx is None:  # no LoRA dx terms (no dh)
            dx = dy @ W
        if dx is not None:
            dx = dx.view(x_shape)
        return (dx, d_y, None, None, None, *grads)


_ADDING = object()  # what a layer call that adds a leaf's gradient itself passes the leaf's hook (the engine: None)


def _adds(call: LayerCall, x, need: bool, part: int) -> bool:
    """Whether this backward adds the stored leaf ``part``'s (0: A, 1: B) gradient into the arena itself: eager, the
    backend able to (``adds_grads``), the leaf's gradient accumulator to run in this backward (not
    ``torch.autograd.grad``, whose caller takes the gradients; not ``create_graph``); the leaf's hook then runs
    first (``AdapterStore._hook``: the views of the pending adapters zeroed, DDP noted), as it would before a leaf
    gradient accumulated."""
    stored = call.stored
    if not need or stored is None or torch.is_grad_enabled():
        return False
    on = getattr(stored, "on_grad", None)
    if on is None or on[part] is None or not call.backend.adds_grads(x, stored):
        return False
    hook, node = on[part]
    leaf = stored.b_leaf if part else stored.a_leaf
    if leaf.grad is None:
        return False
    try:  # (a private torch function, as torch.utils.checkpoint uses it; without it: whole-block gradients)
        if not torch._C._will_engine_execute_node(node):
            return False
    except (RuntimeError, AttributeError):  # RuntimeError: torch.autograd.grad(), its caller takes the gradients
        return False
    hook(_ADDING)  # (the engine calls it again with None, which it skips)
    return True


class _NoGradCtx:
    """Stands in for an autograd ctx when a Function's forward runs with autograd off: it records nothing."""

    needs_input_grad = ()

    def save_for_backward(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def mark_non_differentiable(self, *tensors):
        pass

    def set_materialize_grads(self, value):
        pass


def run(fn_cls, *args):
    """``fn_cls.apply(*args)``; with autograd off (``no_grad``, ``inference_mode``) the Function's forward alone:
    nothing would be recorded, the Function machinery's host time per call (argument unwrapping, the ctx) is a
    visible part of an eval forward's per-layer host time, and ``torch.compile`` traces a plain function."""
    if torch.is_grad_enabled():
        return fn_cls.apply(*args)
    return fn_cls.forward(_NoGradCtx(), *args)


_NO_GRAD_CTX = _NoGradCtx()


def run_layer(plans: Optional[dict], kind: tuple, segs, stored, make_call, x, y, W, b, a_ws, b_ws, extra=()):
    """``run(LoraLinear, x, y, W, b, make_call(record), *a_ws, *b_ws, *extra)`` for one patched layer call, through
    its :class:`LaunchPlan` when it has one: ``plans`` is the layer state's dict of them when this call may replay
    one (an eager Triton call with autograd off, no dropout, no ``lora_bias``; else ``None``), ``kind`` what the
    call runs on (``("stored", decode)``, ``("params", decode)``). A plan is found by the layout, the input's shape,
    strides and dtype, fused or not and the kind, and holds for the same layout and store slots and weights at the
    same addresses (checked here). A call without a plan records one."""
    record = None
    if plans is not None:  # (no key while tracing: a graph would guard on the layout's identity)
        key = (id(segs), x.shape, x.stride(), x.dtype, W is not None, *kind)
        plan = plans.get(key)
        if plan is not None and plan.segs is segs and plan.stored is stored and plan.ptrs == _ptrs(a_ws, b_ws):
            return plan.replay(x, y, W, b, a_ws, b_ws)
        record = {}
    call = make_call(record)
    out = run(LoraLinear, x, y, W, b, call, *a_ws, *b_ws, *extra)
    if record is not None:
        if len(plans) >= 8:
            plans.clear()
        plans[key] = LaunchPlan(record, call, a_ws, b_ws)
    return out


def _ptrs(a_ws, b_ws) -> tuple:
    return (*map(torch.Tensor.data_ptr, a_ws), *map(torch.Tensor.data_ptr, b_ws))


class LaunchPlan:
    """One eager no-grad Triton layer call, recorded by the general path and replayed.

    A decode step calls each of its layers with the same layout, table and weights as the step before, so the
    general path's checks, block choices, weight tables and specialisation keys -- most of an eval call's host
    time -- need doing once per (layer state, layout, input kind). The call that records a plan runs the general
    path with ``LayerCall.record`` set: its launchers hand back their launches (``kernels.forward.Replay``), bound
    to every argument but the call's tensors. A replay makes the same allocations, fills and launches, with the
    same kernels, grids, constexprs and arguments, so its results equal the general path's bit for bit.
    Valid while the layout (``segs``, held), the store's slots and the layer's ``LayerState`` (which holds its
    plans and is rebuilt on every change ``plan.CHANGES`` reports) stay, and every weight is at the address it had
    (an optimizer steps weights in place; a replaced ``.data`` moves them): :func:`run_layer` checks these."""

    __slots__ = ("segs", "stored", "ptrs", "fused", "a_pick", "b_pick", "shrink", "expand", "decode",
                 "h_shape", "h_dtype", "N", "out_shape")

    def __init__(self, rec: dict, call: LayerCall, a_ws, b_ws):
        self.segs, self.stored, self.ptrs = call.segs, call.stored, _ptrs(a_ws, b_ws)
        self.fused = call.fused
        # (on the adapter store both operands are its leaves as they lie, _a_weight / _b_weight: found among the ws)
        self.a_pick = _picker(rec["A"], a_ws, lambda ws: torch.cat(ws, 0))
        self.b_pick = _picker(rec["B"], b_ws, lambda ws: torch.cat(ws, 1))
        self.shrink, self.expand, self.decode = rec.get("shrink"), rec.get("expand"), rec.get("decode")
        h = rec["h"]
        self.h_shape, self.h_dtype = (None, None) if h is None else (h.shape, h.dtype)
        self.N = rec["N"]
        self.out_shape = (*rec["x_shape"][:-1], self.N)

    def replay(self, x_in, y_in, W, b, a_ws, b_ws):
        """What ``LoraLinear.forward`` returns for this call (see :class:`LaunchPlan`)."""
        x = as_rows(x_in)
        if self.decode is not None:  # one launch (kernels.decode): x, the weights' pointer tensors, the output
            A, B = _pick(self.a_pick, a_ws), _pick(self.b_pick, b_ws)
            out, rows = _decode_target(_NO_GRAD_CTX, self.fused, x, y_in, W, b, self.out_shape)
            self.decode(x, A, B, rows)
            return out
        h = torch.empty(self.h_shape, dtype=self.h_dtype, device=x.device)
        self.shrink(x, _pick(self.a_pick, a_ws), h)
        B = _pick(self.b_pick, b_ws)
        if self.fused:
            expand = self.expand
            rows = linear_with_delta(x, W, b, lambda y, acc, bias, gemm: _add_gemm(expand(h, B, y, bias), gemm),
                                     base_first(self.segs))
            out = rows.view(self.out_shape)
        else:
            out, rows = _delta_target(_NO_GRAD_CTX, y_in)
            self.expand(h, B, rows)
        return out


def _picker(w, ws, derive):
    """How a replay finds the weight operand ``w`` the recording call used: the index of the tensor among the call's
    weights ``ws`` that ``w`` is (or, a ``SlotWeights``, whose address it starts at: its pointer tensor), else
    ``derive(ws)``, the concatenation the recording call built."""
    if isinstance(w, SlotWeights):
        w = w.base
    for i, t in enumerate(ws):
        if t is w:
            return i
    return derive


def _pick(pick, ws):
    return ws[pick] if type(pick) is int else pick(ws)


def _a_weight(call: LayerCall, ws):
    """The shrink weight: the store's leaf (already ``A_cat``) or the adapters' weights as the backend
    takes them."""
    if call.stored is not None:
        return ws[0]
    return call.backend.weights(ws, call.table, 0, call.in_place)


def _b_weight(call: LayerCall, ws):
    """The expand weight: the store's packed block as it is (Triton, eager or compiled: every expand kernel reads it
    without a table or a copy, ``kernels.segments.packed_b``; the torch backend's CPU ops likewise, but for an
    experts layer), its ``B_cat`` for the torch backend's reference ops; or the adapters' weights as the backend
    takes them."""
    if call.stored is None:
        return call.backend.weights(ws, call.table, 1, call.in_place)
    if call.backend.takes_packed(ws[0], call.stored):
        return ws[0]
    return call.stored.b_cat(ws[0])


def every_grad() -> bool:
    """Whether the per-parameter path gives every present adapter a gradient, exact zeros where it has no rows:
    under a process group (DDP and FSDP2 reduce every parameter they hold, on every rank alike) and while tracing
    (the graph does not know which adapters a later call's batch names). Else an adapter without rows gets none."""
    return torch.compiler.is_compiling() or (torch.distributed.is_available() and torch.distributed.is_initialized())


def absent_positions(present: tuple, routing) -> tuple:
    """:attr:`LayerCall.absent` of a per-parameter call: the positions of the ``present`` adapters (slot order)
    without rows in ``routing``; none with autograd off or where :func:`every_grad`."""
    if not torch.is_grad_enabled() or every_grad():
        return ()
    names = set(routing.names)
    return tuple(i for i, name in enumerate(present) if name not in names)


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


def _present_scales(call: LayerCall) -> torch.Tensor:
    """float32 ``[n_adapters]``: the present adapters' scales, slot order (static indices: ``table.slots``)."""
    return call.table.scales[list(call.table.slots)].to(torch.float32)


def _onehot(call: LayerCall, dtype) -> torch.Tensor:
    """[n_adapters, S] one-hot of each token's present-adapter row (zeros for base/absent): a deterministic
    segment-sum by matmul, used only for ``lora_bias``."""
    idx = call.bias_rows
    oh = torch.zeros(call.n_adapters + 1, idx.numel(), dtype=dtype, device=idx.device)
    oh[idx, torch.arange(idx.numel(), device=idx.device)] = 1
    return oh[:-1]


def _add_bias(y, biases, call: LayerCall) -> None:
    acc = reference._acc_dtype(y)
    bias = torch.stack([b.to(acc) for b in biases]) * _present_scales(call).to(acc)[:, None]  # [n, N]
    y += (_onehot(call, acc).T @ bias).to(y.dtype)


def _bias_grad(dy, call: LayerCall):
    acc = reference._acc_dtype(dy)
    g = _onehot(call, acc) @ dy.to(acc)  # [n, N]
    return list(g * _present_scales(call).to(acc)[:, None])
