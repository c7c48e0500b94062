"""DoRA adapters (``use_dora=True``) in a mixed batch: PEFT's ``DoraLinearLayer`` math, per row's adapter.

For a token ``t`` of a DoRA adapter ``a`` (scale ``s``, magnitude ``m_a``, base weight ``W[N, K]``, base bias ``b``)
PEFT computes, adapter alone::

    g_a   = m_a / ||W + s B_a A_a||_row         (the norm detached: no gradient flows through it)
    out   = base(x) + (g_a - 1) * (x~ W^T) + g_a * s * (x~ A_a^T B_a^T)

with ``x~ = x`` in eval or without dropout, else ``x~ = dropout(x)``, the mask the LoRA part drew (PEFT recomputes
the base term on the dropped input then). The layer op computes ``y = base(x) + s * x~ A^T B^T`` for every row, as
for plain LoRA; this module turns ``y`` into DoRA's output, which autograd differentiates (the magnitudes get
their gradients, the LoRA weights and the input theirs through ``y``)::

    out = y + (g - 1) * (y - b + (x~ - x) W^T)         (the last term only with dropout, in training)

``g - 1`` is taken per row from a ``[n_dora, N]`` table by a one-hot matmul (zero for ``__base__`` rows and plain
LoRA adapters' rows), so the magnitudes' gradient is a matmul too (deterministic, no atomics): one row of it per
sample, broadcast over the sample's tokens, when the batch names an adapter per sample (per token for packed rows),
in the output's dtype when that is 16-bit (as PEFT scales). On the Triton backend the dropped input ``x~ - x`` is one
kernel pass from the op's packed mask (its gradient another; nothing ``[tokens, K]`` kept for the backward), and
``out`` and its gradients (``dg`` summed over each row's tokens in a fixed order) are one kernel pass each
(``kernels/dora.py``); the torch backend and traced graphs use torch ops for the same expression. The weight norms are
computed once per layer call for each DoRA adapter the batch names (not per row): ``||W_i + s (B A)_i||^2 =
||W_i||^2 + 2 s (W A^T)_i . B_i + s^2 B_i (A A^T) B_i^T``, one GEMM ``W A_D^T`` for all of the layer's DoRA adapters
and no ``[N, K]`` temporary per adapter; on the Triton backend (eager) the rest of the norms and
``g - 1 = m / norm - 1`` are one kernel pass (``kernels.dora.dora_gates``: about ten torch launches fewer per layer
call). Layers without DoRA adapters never reach this module.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .kernels.dora import GATES_MAX_RANK, dora_combine, dora_combine_bwd, dora_gates
from .kernels.segments import to_device
from .reference import token_slots


@dataclass(eq=False)
class DoraLayer:
    """A patched layer's DoRA adapters (part of its ``LayerState``), in slot order."""

    names: tuple  # the DoRA adapters of the layer
    rows: torch.Tensor  # int64 [n_slots + 1]: slot -> row among ``names`` (``len(names)``: none; last entry: base)
    scales: tuple  # host floats, PEFT's ``scaling``
    dropout: bool  # some DoRA adapter has an active dropout rate in this mode


def is_dora(variant) -> bool:
    """Whether a PEFT ``lora_variant`` entry is DoRA on a Linear layer (the one variant mixed batches run)."""
    return type(variant).__name__ == "DoraLinearVariant"


def base_weight(layer) -> torch.Tensor:
    """The base layer's weight as ``[N, K]`` (a view for Conv1D's ``[K, N]``), dequantized where it is quantized
    (PEFT's ``dequantize_module_weight``, as its DoRA layer reads it)."""
    from peft.utils.integrations import dequantize_module_weight

    base = layer.get_base_layer()
    W = base._parameters.get("weight") if type(base) is torch.nn.Linear else dequantize_module_weight(base)
    return W.t() if getattr(layer, "fan_in_fan_out", False) else W


@torch.no_grad()
def weight_norms(W: torch.Tensor, As: list, Bs: list, scales: tuple, dtype=torch.float32) -> torch.Tensor:
    """``[n, N]`` in ``dtype`` (float32; float64 for a float64 layer): row ``a`` is ``||W + scales[a] B_a A_a||`` over
    each output row, for ``W[N, K]``, ``A_a[r_a, K]``, ``B_a[N, r_a]``; no gradient. A fixed number of ops whatever
    the adapter count:
    ``||W_i + s B_i A||^2 = ||W_i||^2 + sum_j B_ij (2 s (W A^T)_ij + s^2 (B_i A A^T)_j)``, with the adapters' ``A``
    rows and ``B`` columns concatenated, ``W A^T`` one GEMM, the Gram matrix ``A A^T`` masked to its diagonal blocks
    and scaled by ``s^2`` there, and the per-adapter sums over each block's columns one matmul with the columns'
    owner one-hot (added to ``||W_i||^2``, kept per frozen weight)."""
    A_all = torch.cat(As, 0) if len(As) > 1 else As[0]  # [R, K]
    B_all = (torch.cat(Bs, 1) if len(Bs) > 1 else Bs[0]).to(dtype)  # [N, R]
    owner, two_s, block_s2 = _owners(tuple(A.shape[0] for A in As), scales, W.device, dtype)
    A32 = A_all.to(dtype)
    gram = torch.mm(A32, A32.t()).mul_(block_s2)  # [R, R]: s_a^2 A_a A_a^T on the diagonal blocks, else 0
    P = torch.mm(W, A_all.to(W.dtype).t()).to(dtype)  # [N, R]: W A_a^T of every adapter in one GEMM
    E = torch.addmm(P.mul_(two_s), B_all, gram).mul_(B_all)  # [N, R]
    return torch.addmm(_row_sq_norms(W, dtype)[:, None], E, owner).t().clamp_min_(0).sqrt_()


@torch.no_grad()
def gates(W: torch.Tensor, As: list, Bs: list, scales: tuple, mags: list) -> tuple:
    """float32 ``([n, N] g - 1, [n, N] norms)`` of adapters with ``As``, ``Bs``, ``scales`` and magnitudes ``mags``
    on ``W`` (:func:`weight_norms`' norms, then ``m_a / norm - 1``), the Triton backend's way: the two GEMMs
    (``W A^T``, ``A A^T``) by torch, the rest in one kernel pass (``kernels.dora.dora_gates``); no gradient."""
    A_all = torch.cat(As, 0) if len(As) > 1 else As[0]  # [R, K]
    B_all = (torch.cat(Bs, 1) if len(Bs) > 1 else Bs[0]).contiguous()  # [N, R]
    ranks = tuple(A.shape[0] for A in As)

    def build():
        offsets = torch.tensor((0, *ranks), dtype=torch.int64).cumsum(0).to(torch.int32)
        return (to_device(offsets, W.device), to_device(torch.tensor([2 * s for s in scales], dtype=torch.float32),
                                                        W.device))

    offsets, two_s = _kept(("gates", ranks, scales, W.device), build)
    A32 = A_all.float()
    gram = torch.mm(A32, A32.t())  # [R, R]; the kernel reads each adapter's diagonal block
    P = torch.mm(W, A_all.to(W.dtype).t())  # [N, R]: W A_a^T of every adapter in one GEMM
    return dora_gates(P, B_all, gram, _row_sq_norms(W), torch.stack(mags), offsets, two_s, max(ranks))


def _row_sq_norms(W: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``[N]`` in ``dtype``: ``||W_i||^2``; kept for a frozen weight parameter while its data and version stay (a
    dequantized weight, a new tensor per call, is not kept; nor while tracing, where the graph computes it)."""
    if not isinstance(W, torch.nn.Parameter) or W.requires_grad or torch.compiler.is_compiling():
        return torch.linalg.vector_norm(W, dim=1, dtype=dtype).square_()
    key = ("w_sq", id(W), dtype)
    hit = _KEPT.get(key)
    stamp = (W.data_ptr(), W._version, W.shape, W.dtype, W.device)
    if hit is None or hit[0]() is not W or hit[1] != stamp:  # (a weak reference: the cache keeps no model alive)
        hit = _KEPT[key] = (weakref.ref(W), stamp, torch.linalg.vector_norm(W, dim=1, dtype=dtype).square_())
        _bound()
    return hit[2]


def _owners(ranks: tuple, scales: tuple, device, dtype=torch.float32) -> tuple:
    """For concatenated rank rows of adapters with ``ranks`` and ``scales``, on ``device``, kept per (ranks, scales,
    device): ``(one-hot [R, n] of each row's adapter, 2 s [R] per row, s^2 on the diagonal blocks of [R, R])``."""
    def build():
        # (the output size given: a traced call makes a static shape, not a data-dependent one that breaks the graph)
        idx = torch.repeat_interleave(torch.arange(len(ranks)), torch.tensor(ranks), output_size=sum(ranks))
        owner = (idx[:, None] == torch.arange(len(ranks))[None, :]).to(dtype)
        s = torch.tensor(scales, dtype=torch.float64)[idx].to(dtype)
        return (to_device(owner, device), to_device(2 * s, device),
                to_device((owner @ owner.t()) * (s[:, None] * s[None, :]), device))

    return _kept(("owners", ranks, scales, device, dtype), build)


_KEPT: dict = {}  # host-made constants of layer calls on their device, by what they are made from (bounded)


def _bound() -> None:
    if len(_KEPT) > 512:
        _KEPT.clear()


def _kept(key, build):
    if torch.compiler.is_compiling():  # (a graph makes its own: no traced tensor goes into the cache)
        return build()
    hit = _KEPT.get(key)
    if hit is None:
        _bound()
        hit = _KEPT[key] = build()
    return hit


def _per_call(cache: Optional[dict], key, build):
    """``build()[0]``, kept in ``cache`` (the layout's ``Segments.cache``: eager calls) under ``key`` -- constants
    that depend on the routing, the layout and the layer's tables only, shared by the layers of one forward and
    dropped with the layout; ``None`` (traced): built each call. ``build`` returns the value and the objects whose
    ids ``key`` holds (kept alive with it)."""
    if cache is None:
        return build()[0]
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = build()
    return hit[0]


def apply(layer, dora: DoraLayer, out: torch.Tensor, x: torch.Tensor, segs, table, names_in_batch,
          keep: Optional[torch.Tensor], absent_grads: bool = False, row_slots: Optional[torch.Tensor] = None,
          kernels: bool = False) -> torch.Tensor:
    """DoRA's output from the layer op's ``out = base(x) + LoRA delta`` (module docstring). ``x``: the input the LoRA
    part read; ``names_in_batch``: the adapters the batch names (``None``: all of the layer's, while tracing);
    ``keep``: the dropout mask the op's forward drew and returned (the Triton kernels' packed bits, or booleans),
    ``None`` without dropout in this call; ``absent_grads``: the magnitudes of adapters the batch does not name get
    zero gradients (as the LoRA weights get them: under a process group, where DDP needs one for every parameter it
    reduces) instead of none (as stock PEFT: an adapter without rows gets no gradient); ``row_slots``: the slot of
    each row of ``out`` (its first dimension) where the batch names one adapter per row -- then ``g - 1`` is a
    ``[rows, N]`` table broadcast over each row's tokens (no ``[tokens, N]`` one; its gradient a sum over each row's
    tokens), else gathered per token.
    With 16-bit outputs ``g - 1`` is applied in the output's dtype, as PEFT applies its scale. ``kernels`` (the
    Triton backend): the combine and its gradient are one kernel pass each (:class:`_Combine`) instead of torch ops.
    What depends on the routing and the layout only is kept in the layout's ``segs.cache`` (eager calls), so the
    layers of one forward share it."""
    N = out.shape[-1]
    cache = None if torch.compiler.is_compiling() else segs.cache
    live = tuple(n for n in dora.names if names_in_batch is None or n in names_in_batch)
    if not live and not absent_grads:  # no DoRA adapter in the batch: g - 1 is zero on every row
        return out
    a_mods, b_mods = layer.lora_A._modules, layer.lora_B._modules
    mags = layer.lora_magnitude_vector._modules
    W = base_weight(layer)
    wide = torch.float64 if out.dtype == torch.float64 else torch.float32  # (the norms' and gates' dtype)
    norms = gm1 = None
    if live:
        As, Bs = [a_mods[n].weight for n in live], [b_mods[n].weight for n in live]
        scales = tuple(s for n, s in zip(dora.names, dora.scales, strict=True) if n in live)
        if kernels and torch.float64 not in (W.dtype, out.dtype) and max(A.shape[0] for A in As) <= GATES_MAX_RANK \
                and not torch.compiler.is_compiling():
            gm1, norms = gates(W, As, Bs, scales, [mags[n].weight for n in live])
        else:
            norms = weight_norms(W, As, Bs, scales, wide)
    per_row = row_slots is not None and out.dim() >= 2 and out.shape[0] == row_slots.numel()
    ts = _per_call(cache, ("dora_ts",), lambda: (token_slots(segs),)) \
        if keep is not None or not per_row else None

    def selector():  # [rows or tokens, n_live]: the one-hot of each row's (token's) adapter among ``live``
        pos = {n: i for i, n in enumerate(live)}
        remap = _kept(("remap", dora.names, live, out.device), lambda: to_device(torch.tensor(
            [pos.get(n, len(live)) for n in dora.names] + [len(live)], dtype=torch.int64), out.device))
        row = remap[dora.rows[row_slots.long() if per_row else ts]]
        return (row[:, None] == torch.arange(len(live), device=row.device)).to(wide), dora.rows

    sel = _per_call(cache, ("dora_sel", dora.names, live, id(dora.rows), per_row, wide), selector)
    g = _Gates.apply(sel, norms, gm1, tuple(n in live for n in dora.names), absent_grads,
                     out.dtype if out.dtype in (torch.float16, torch.bfloat16) else wide,
                     *[mags[n].weight for n in dora.names])  # [rows, N] or [S, N]
    bias = layer.get_base_layer().bias
    delta = Wx = None
    if keep is not None:  # training under dropout: PEFT's base term reads the dropped input
        xr = x.reshape(-1, x.shape[-1])

        def factor():  # x~ - x = x * f: f is 1 / (1 - p) - 1 where the mask keeps an element, else -1
            p = torch.where(ts >= 0, table.dropout[ts.clamp(min=0)], 0.0)
            return (1 / (1 - p) - 1).to(xr.dtype), table

        kept = _per_call(cache, ("dora_kept", id(table), xr.dtype), factor)
        if keep.dtype == torch.uint8 and not torch.compiler.is_compiling():  # the kernels' bits: one pass over x
            delta = _DroppedInputDelta.apply(xr if xr.stride(-1) == 1 else xr.contiguous(), keep, kept)
        else:  # (traced: torch ops; -1.0 a Python scalar: a tensor made here would be a blocking host->device copy)
            delta = xr * torch.where(_keep_mask(keep, xr), kept[:, None], -1.0)
        Wx = W.to(xr.dtype)
    if kernels and (delta is None or delta.dtype == out.dtype) and (bias is None or not bias.requires_grad) \
            and not torch.compiler.is_compiling():
        # one kernel pass for res = y + g (y - b + t) and one for its gradient (kernels/dora.py): rows of tokens
        # sharing a g row (per sample), or one token per row (g per token); traced graphs keep the torch ops
        R = out.shape[0] if per_row else g.shape[0]
        y3 = out.reshape(R, -1, N)
        t = None if delta is None else torch.mm(delta, Wx.t()).view(y3.shape)
        return _Combine.apply(y3.contiguous(), t, g, bias).view(out.shape)
    y = out if per_row else out.reshape(-1, N)
    if per_row:
        g = g.view(out.shape[0], *([1] * (out.dim() - 2)), N)
    z = y if bias is None else y - bias
    if delta is not None:
        if z.dtype == delta.dtype:  # z + delta W^T in the GEMM's epilogue
            z = torch.addmm(z.reshape(-1, N), delta, Wx.t()).view(z.shape)
        else:
            z = z + torch.nn.functional.linear(delta, Wx).view(z.shape)
    res = torch.addcmul(y, g, z)
    return res.to(out.dtype).view(out.shape)


class _Gates(torch.autograd.Function):
    """``g - 1`` per row (or token): ``sel[R, n_live] @ (m_a / norms_a - 1)`` over the batch's DoRA adapters, in
    ``dtype``, from every DoRA magnitude of the layer (``live`` says which the batch names). One autograd node
    instead of the stack, division, matmul and cast of each layer call; the backward is the same math
    (``d m_a = (sel^T dg)_a / norms_a``, a matmul: no atomics). Magnitudes not named get no gradient, or exact zeros
    with ``absent_grads``."""

    @staticmethod
    def forward(ctx, sel, norms, gm1, live, absent_grads, dtype, *mags):
        ctx.live, ctx.absent_grads = live, absent_grads
        named = [m for m, on in zip(mags, live, strict=True) if on]
        if named:
            if gm1 is None:  # (else the Triton backend's dora_gates made it with the norms, from these magnitudes)
                gm1 = torch.stack(named).to(norms.dtype).div_(norms).sub_(1)  # (stack: a new tensor, not the parameter)
            g = torch.mm(sel, gm1)
        else:
            g = sel.new_zeros(sel.shape[0], mags[0].shape[0])
        ctx.save_for_backward(sel, norms)
        ctx.mag_dtypes = [m.dtype for m in mags]
        ctx.N = mags[0].shape[0]
        # (no ``.to`` of a tensor already in ``dtype``: that returns ``g`` itself, and torch 2.11's Dynamo then gives
        # the magnitudes zero gradients in a compiled graph -- tests/test_dora.py::test_compiled_equals_eager)
        return g if g.dtype == dtype else g.to(dtype)

    @staticmethod
    @once_differentiable  # (a second-order gradient through it raises rather than comes out wrong)
    def backward(ctx, dg):
        sel, norms = ctx.saved_tensors
        dm = torch.mm(sel.t(), dg.to(norms.dtype)).div_(norms) if norms is not None else None
        named = [d for d, on in zip(ctx.mag_dtypes, ctx.live, strict=True) if on]
        if named and all(d == named[0] for d in named):  # one cast for all (rows of one tensor), not one per adapter
            dm = dm.to(named[0])
        dm = iter(dm.unbind(0) if dm is not None else ())
        grads = []
        for on, dtype in zip(ctx.live, ctx.mag_dtypes, strict=True):
            if on:
                grads.append(next(dm).to(dtype))
            else:
                grads.append(dg.new_zeros(ctx.N, dtype=dtype) if ctx.absent_grads else None)
        return (None, None, None, None, None, None, *grads)


class _Combine(torch.autograd.Function):
    """``res = y + g (y - b + t)`` per row (``kernels.dora``): ``y[R, T, N]`` the op's output, ``t`` (or ``None``)
    the dropped-input term, ``g[R, N]``, ``b`` the frozen base bias (or ``None``). The backward needs ``z = y - b + t``
    for ``g``'s gradient: with ``t`` the forward writes it (``t`` and ``y`` are then not kept), else ``y`` is kept and
    ``z`` recomputed."""

    @staticmethod
    def forward(ctx, y, t, g, bias):
        res, z = dora_combine(y, t, bias, g, keep_z=t is not None and any(ctx.needs_input_grad))
        ctx.has_t = t is not None
        if z is not None:
            ctx.save_for_backward(z, g, None)
        else:
            ctx.save_for_backward(y, g, bias)
        return res

    @staticmethod
    def backward(ctx, G):
        z, g, bias = ctx.saved_tensors
        dy, dt, dg = dora_combine_bwd(G.contiguous(), z, None, bias, g, with_dt=ctx.has_t)
        return dy, dt, dg, None


class _DroppedInputDelta(torch.autograd.Function):
    """``x~ - x = x * f`` from the layer op's packed keep-mask in one kernel pass (``kernels.dropout.scale_by_keep``):
    ``x[S, K]``, ``bits`` uint8 ``[S, cdiv(K, 8)]``, ``kept[S]`` the factor of kept elements in ``x``'s dtype. ``f``
    is elementwise and depends on the mask only, so the gradient is the same map of the output's gradient (nothing
    ``[S, K]`` is kept for the backward but the packed mask)."""

    @staticmethod
    def forward(ctx, x, bits, kept):
        from .kernels.dropout import scale_by_keep

        ctx.save_for_backward(bits, kept)
        return scale_by_keep(x, bits, kept)

    @staticmethod
    def backward(ctx, grad):
        from .kernels.dropout import scale_by_keep

        bits, kept = ctx.saved_tensors
        return scale_by_keep(grad.contiguous(), bits, kept), None, None


def _keep_mask(keep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The boolean ``[S, K]`` keep-mask the layer op's LoRA part used: the torch backend's mask, or the Triton
    kernels' packed bits unpacked (byte arithmetic; :class:`_DroppedInputDelta` reads them without unpacking)."""
    from .kernels.dropout import unpack_keep_bits

    return keep if keep.dtype == torch.bool else unpack_keep_bits(keep, x.shape[1])
