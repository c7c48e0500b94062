"""Per-adapter loss from the last hidden states, without building the full-vocabulary logits.

``per_adapter_loss(model(...).logits, ...)`` needs the logits of every token: on a Llama-3-8B-shaped step (8192
tokens x 128,256 vocabulary) that is 4.2 GB in fp32, plus a gradient of the same size. Here the LM head's matmul and
the cross-entropy run together, a block at a time:

* forward, in chunks of tokens: the chunk's logits ``[chunk, V]`` (the head's dtype, then fp32), their logsumexp and
  the target logit; per token it keeps ``ce`` (the output) and ``lse`` (for the backward), nothing of size ``V``.
* with a frozen head (LoRA training: only the hidden states need a gradient), the forward also makes each chunk's
  ``d ce / d hidden = (softmax - onehot) @ W`` from the logits at hand (one more matmul per chunk, a ``[N, H]``
  result kept), and the backward multiplies it by the per-token upstream gradient: the head's matmul runs twice per
  step, as on the unfused path (logits, then ``d hidden``), not three times. Without a post-head transform (scale 1,
  no softcap: Llama, Qwen, Mistral) a chunk is :func:`_plain_chunk`: on a GPU the head's matmul writes the logits
  block and one Triton kernel (``kernels/cross_entropy.py``) reads it twice and writes ``softmax - onehot`` over it;
  on a CPU PyTorch's ``log_softmax`` and ``exp``; the general path adds an fp32 copy, logsumexp's temporaries and
  two in-place passes.
* backward, with a trained head (or bias), in blocks of the vocabulary: the block's logits ``[N, V_blk]`` again,
  ``d logits = (softmax - onehot) * g`` from the saved ``lse`` (``g``: the per-token upstream gradient), then
  ``dW[blk] = d logits^T @ hidden`` and ``db[blk]`` written once each, and ``d hidden += d logits @ W[blk]`` summed
  in fp32 over the blocks in order. No atomics and no accumulation into ``dW``: each row block of ``dW`` is one
  matmul over all tokens, as in the unfused path, so the result does not depend on the chunking.

In ``transformers.Trainer``, :class:`fast_multilora.training.PerAdapterLoss` with ``fused=True`` (the default of
:func:`fast_multilora.trainer_kwargs`) takes this path through the model's own forward: :func:`logits_free_head`
says how (``logits_to_keep=1``, the backbone's last hidden state, the head and its post-head transform) or why not.

The per-adapter weighting (``1 / N_a`` per token of adapter ``a``, 0 for ``__base__`` and ignored tokens) is not part
of the fused op: it returns per-token losses and :func:`~fast_multilora.loss.per_adapter_mean` reduces them, so
autograd hands the op exactly those weights as its upstream gradient. Everything stays on the device: no host read.

PyTorch ops, but for the plain chunk's cross-entropy kernel on a GPU (as Liger Kernel's cross-entropy kernel writes
the gradient over the logits; Liger's returns 16-bit per-token losses and reads the host per call, so it is not
used here). The transformed (scale, softcap) and trained-head paths could take such a kernel too.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import once_differentiable

from . import loss as _loss
from .loss import AdapterLosses, per_adapter_mean, shifted_targets
from .plan import BASE

__all__ = ["LinearCrossEntropy", "LogitsFreeHead", "adapter_token_means_from_hidden", "chunk_tokens",
           "fused_causal_lm_loss", "head_weight_problem", "linear_cross_entropy", "logits_free_head",
           "per_adapter_loss_from_hidden"]

# a chunk of at least this many tokens: below it the Python loop's per-chunk overhead dominates on small models
MIN_CHUNK = 64
# on a GPU, at least this many (where there are): the chunk's two head matmuls, ``[chunk, H] @ [H, V]`` and
# ``[chunk, V] @ [V, H]``, leave SMs idle at fewer rows. Measured on one H100 at `f0d44cf` (``linear_cross_entropy``
# forward and backward on random bf16 hidden states [8192, 4096] and head [128256, 4096], medians of 7 CUDA-event
# timings; docs/benchmarks.md; the harness's ``head_loss_8b`` rows ``[fused/chunk=256]`` and ``[fused/chunk=1024]``
# measure it in the step's setting): 256 / 512 / 1024 / 2048 tokens per chunk took 29.6 / 28.2 / 26.7 / 28.5 ms
# with peaks of +320 / 320 / 323 / 581 MiB (the full-logits path 38.8 ms, +14 GiB); the ``[chunk, V] @ [V, H]`` matmul
# 0.41 ms at 256 rows (x 32 chunks: 13.1 ms) against 1.48 at 1024 (x 8: 11.8).
GPU_MIN_CHUNK = 1024


def chunk_tokens(n_tokens: int, hidden_size: int, vocab_size: int, *, gpu: bool = False) -> int:
    """Default tokens per chunk: the chunk's logits hold about as many elements as the hidden states (``N x H``), so
    the transient memory is of the order of the inputs whatever the vocabulary (Liger Kernel sizes its chunks so);
    a power of two, at least :data:`MIN_CHUNK` -- on a GPU (``gpu``) at least :data:`GPU_MIN_CHUNK` -- and at most
    ``N``."""
    ratio = -(-vocab_size // max(hidden_size, 1))
    per = -(-max(n_tokens, 1) // ratio)
    least = GPU_MIN_CHUNK if gpu else MIN_CHUNK
    return min(max(1 << (per - 1).bit_length(), least), max(n_tokens, 1))


def _logits(h, weight, bias, scale: float, softcap: Optional[float]):
    """fp32 logits of ``h`` against ``weight`` rows: the head's own ``F.linear`` (in its dtype, autocast's if on), then
    the model's post-head transform ``softcap * tanh(scale * z / softcap)``. Returns ``(logits, tanh or None, the
    matmul's dtype)``; the tanh is for the backward's chain rule."""
    raw = F.linear(h, weight, bias)
    z = raw.to(torch.promote_types(raw.dtype, torch.float32))  # fp32 (fp64 stays): a fresh tensor, scaled in place
    if scale != 1.0:
        z.mul_(scale)
    if softcap is None:
        return z, None, raw.dtype
    t = torch.tanh(z / softcap)
    return t * softcap, t, raw.dtype


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of ``F.linear(hidden, weight, bias)`` against ``labels`` without the full logits.

    ``hidden[N, H]``, ``weight[V, H]``, ``bias[V] | None``, ``labels[N]`` (int64); returns ``ce[N]`` in fp32 (fp64
    for fp64 inputs, as every logits block): 0 where ``labels == ignore_index``, NaN where a label lies outside
    ``[0, V)`` (no host read to raise on)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index: int, chunk: int, scale: float,
                softcap: Optional[float]):
        N, V = hidden.shape[0], weight.shape[0]
        # only the hidden states need a gradient (a frozen head: LoRA training): each chunk's d ce / d hidden is made
        # here from the logits at hand, and the backward scales it by the upstream gradient -- no second pass of the
        # head's matmul (a trained head's dW needs every token's upstream gradient first: the backward recomputes)
        early = ctx.needs_input_grad[0] and not any(ctx.needs_input_grad[1:3])
        plain = early and scale == 1.0 and softcap is None
        ce = torch.empty(N, dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        lse = None if plain else torch.empty_like(ce)
        target = labels.clamp(0, V - 1)
        dh_unit = None
        for s in range(0, N, chunk):
            if plain:  # the common case (a frozen head, no post-head transform): no logsumexp, no fp32 z kept
                dz, ce[s:s + chunk], mm_dtype = _plain_chunk(hidden[s:s + chunk], weight, bias, target[s:s + chunk])
            else:
                z, t, mm_dtype = _logits(hidden[s:s + chunk], weight, bias, scale, softcap)  # [chunk, V] fp32
                lse[s:s + chunk] = torch.logsumexp(z, 1)
                ce[s:s + chunk] = lse[s:s + chunk] - z.gather(1, target[s:s + chunk, None])[:, 0]
            if early:
                if not plain:
                    dz = _dlogits(z, t, lse[s:s + chunk], labels[s:s + chunk], 0, V, None, scale, softcap, mm_dtype)
                    del z, t
                part = dz @ weight  # [chunk, H], the head matmul's dtype (as the unfused path's d hidden)
                if dh_unit is None:
                    dh_unit = torch.empty(N, part.shape[1], dtype=part.dtype, device=part.device)
                dh_unit[s:s + chunk] = part
                del dz, part
            else:
                del z, t
        ce = _loss.masked_token_ce(ce, labels, V, ignore_index)
        if early:  # lse is not needed (nor made on the plain path)
            ctx.save_for_backward(dh_unit, labels)
        else:
            ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.early = early
        ctx.settings = (ignore_index, chunk, scale, softcap)
        dev = hidden.device.type  # the backward recomputes the logits under the forward's autocast, on any device
        ctx.amp = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        ctx.hidden_dtype, ctx.acc_dtype = hidden.dtype, ce.dtype
        return ce

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ce):
        if ctx.early:  # d hidden = upstream gradient x the forward's d ce / d hidden, per token
            dh_unit, labels = ctx.saved_tensors
            g = torch.where(labels == ctx.settings[0], 0.0, grad_ce.to(ctx.acc_dtype))  # [N]
            dh = (dh_unit.to(ctx.acc_dtype) * g[:, None]).to(ctx.hidden_dtype)
            return dh, None, None, None, None, None, None, None
        dev, enabled, dtype = ctx.amp
        with torch.autocast(dev, dtype=dtype, enabled=enabled):
            return LinearCrossEntropy._backward(ctx, grad_ce)

    @staticmethod
    def _backward(ctx, grad_ce):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        ignore_index, chunk, scale, softcap = ctx.settings
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        N, H = hidden.shape
        V = weight.shape[0]
        g = torch.where(labels == ignore_index, 0.0, grad_ce.to(lse.dtype))  # [N]
        dh = torch.zeros(N, H, dtype=lse.dtype, device=hidden.device) if need_h else None
        dw = torch.empty_like(weight) if need_w else None
        db = torch.empty_like(bias) if need_b else None
        # vocabulary blocks of as many logits as a forward chunk: [N, block] = [chunk, V]
        block = max(1, min(V, -(-chunk * V // max(N, 1))))
        for v0 in range(0, V, block):
            v1 = min(v0 + block, V)
            w_blk, b_blk = weight[v0:v1], (None if bias is None else bias[v0:v1])
            z, t, mm_dtype = _logits(hidden, w_blk, b_blk, scale, softcap)  # [N, blk] fp32
            if need_b:
                p = _dlogits(z, t, lse, labels, v0, v1, g, scale, softcap, None)  # fp32
                db[v0:v1] = p.sum(0)
                dz = p.to(mm_dtype)  # d logits in the head matmul's dtype, as the unfused path's gradient
                del p
            else:
                dz = _dlogits(z, t, lse, labels, v0, v1, g, scale, softcap, mm_dtype)
            del z, t
            if need_w:
                if dw.dtype == dz.dtype == hidden.dtype:
                    torch.mm(dz.t(), hidden, out=dw[v0:v1])
                else:  # autocast: the matmul in its dtype, then into the weight's
                    dw[v0:v1] = dz.t() @ hidden
            if need_h:
                dh += dz @ w_blk
            del dz  # before the next block's logits
        return (None if dh is None else dh.to(hidden.dtype)), dw, db, None, None, None, None, None


def _plain_chunk(h, weight, bias, target):
    """A chunk's ``(d ce / d logits, ce, the matmul's dtype)`` for a frozen head without a post-head transform: the
    head's ``F.linear`` writes the ``[chunk, V]`` logits in its dtype (autocast's under autocast), then
    (``loss._kernel_for``) ``kernels.cross_entropy_`` reads them twice and overwrites them with ``softmax - onehot``
    (fp32 arithmetic, ``ce`` in fp32); or PyTorch's ops: ``log_softmax`` with ``dtype=fp32`` (16-bit logits copied to
    fp32 first, except fp16 on CUDA), one ``exp`` writing ``softmax`` in the matmul's dtype (the unfused path's
    gradient dtype), and the ``- onehot`` of each row's target from its fp32 log-probability, written once."""
    raw = F.linear(h, weight, bias)  # in autocast's dtype under autocast
    mm_dtype = raw.dtype
    if _loss._kernel_for(raw):
        from .kernels.cross_entropy import cross_entropy_

        try:
            ce = cross_entropy_(raw, target)  # raw is d ce / d logits now
            return raw, ce, mm_dtype
        except _loss._kernel_errors() as e:  # (raised before the launch: raw is as the matmul wrote it)
            _loss._kernel_failed(e)
    logp = torch.log_softmax(raw, 1, dtype=torch.promote_types(mm_dtype, torch.float32))
    del raw
    at = target[:, None]
    lp_t = logp.gather(1, at)
    dz = torch.exp(logp, out=torch.empty(logp.shape, dtype=mm_dtype, device=logp.device))
    del logp
    # every row's clamped target: ignored rows' upstream gradient is 0, and a label outside [0, V) makes ce NaN
    dz.scatter_(1, at, (lp_t.exp() - 1.0).to(dz.dtype))
    return dz, -lp_t[:, 0], dz.dtype


def _dlogits(z, t, lse, labels, v0: int, v1: int, g, scale: float, softcap: Optional[float], dtype):
    """``d ce / d raw logits`` of the vocabulary block ``[v0, v1)``, from its fp32 logits ``z`` (overwritten),
    the post-head transform's ``t`` and the rows' ``lse``: ``softmax - onehot`` (times the per-row upstream gradient
    ``g`` when given), through the softcap's and the scale's chain rule; in ``dtype`` (the head matmul's, for the
    next matmul) or, ``None``, fp32."""
    p = z.sub_(lse[:, None]).exp_()  # softmax
    # - onehot: one write per row (deterministic), 0 for labels outside this block
    at = (labels - v0).clamp_(0, v1 - v0 - 1)[:, None]
    here = ((labels >= v0) & (labels < v1)).to(p.dtype)[:, None]
    p.scatter_(1, at, p.gather(1, at) - here)
    if g is not None:
        p.mul_(g[:, None])
    if softcap is not None:
        p.mul_(t.mul_(t).neg_().add_(1.0))  # d tanh = 1 - tanh^2
    if scale != 1.0:
        p.mul_(scale)
    return p if dtype is None else p.to(dtype)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         labels: torch.Tensor, *, ignore_index: int = -100, chunk_size: Optional[int] = None,
                         logit_scale: float = 1.0, softcap: Optional[float] = None) -> torch.Tensor:
    """Per-token cross-entropy ``ce[N]`` (fp32) of ``F.linear(hidden, weight, bias)`` (``hidden[N, H]``) against
    ``labels[N]`` (int64), without the full logits (:class:`LinearCrossEntropy`); ``chunk_size`` tokens per chunk
    (default :func:`chunk_tokens`)."""
    chunk = chunk_tokens(hidden.shape[0], hidden.shape[1], weight.shape[0], gpu=hidden.device.type == "cuda") \
        if chunk_size is None else chunk_size
    return LinearCrossEntropy.apply(hidden, weight, bias, labels, ignore_index, int(chunk), float(logit_scale),
                                    None if softcap is None else float(softcap))


def _qualname(obj) -> str:
    cls = getattr(type(obj), "_fml_base", type(obj))  # a patched PEFT layer: its PEFT class
    return cls.__qualname__ if cls.__module__.startswith("torch") else f"{cls.__module__}.{cls.__qualname__}"


def _head(lm_head, bias):
    """``(weight, bias)`` of the LM head, checked: an ``nn.Linear`` or a weight tensor ``[V, H]`` (plus ``bias``)."""
    if isinstance(lm_head, torch.nn.Linear):
        if bias is not None:
            raise ValueError("per_adapter_loss_from_hidden: `bias` is for a weight tensor; an nn.Linear head brings "
                             "its own bias")
        weight, bias = lm_head.weight, lm_head.bias
    elif isinstance(lm_head, torch.Tensor):
        weight = lm_head
    else:
        raise TypeError(
            f"per_adapter_loss_from_hidden: `lm_head` must be the LM head as an nn.Linear or its weight tensor "
            f"[vocab, hidden], got {_qualname(lm_head)}. A head with LoRA adapters or another wrapper (PEFT's "
            "lora.Linear, ModulesToSaveWrapper) is not a plain linear map: use per_adapter_loss(model(...).logits, ...)"
        )
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        plain = type(t) in (torch.Tensor, torch.nn.Parameter) or isinstance(t, FakeTensor)  # fake: shape analyses
        if not plain or not t.is_floating_point():
            raise TypeError(
                f"per_adapter_loss_from_hidden: the LM head's {name} is a {type(t).__name__} of dtype {t.dtype}; the "
                "fused loss needs a plain floating-point tensor (a quantized or sharded head, e.g. bitsandbytes, "
                "torchao or a DTensor, is not supported): use per_adapter_loss(model(...).logits, ...)"
            )
    if weight.dim() != 2 or (bias is not None and tuple(bias.shape) != (weight.shape[0],)):
        raise ValueError(f"per_adapter_loss_from_hidden: the LM head's weight must be [vocab, hidden] and its bias "
                         f"[vocab], got {tuple(weight.shape)} and {None if bias is None else tuple(bias.shape)}")
    return weight, bias


def _checked_head(hidden, lm_head, labels, bias, chunk_size, softcap):
    """The head's ``(weight, bias)``, with every input of :func:`per_adapter_loss_from_hidden` checked."""
    weight, bias = _head(lm_head, bias)
    if hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"per_adapter_loss_from_hidden: `hidden` must be the floating-point hidden states "
                         f"[batch, seq, hidden], got shape {tuple(hidden.shape)} ({hidden.dtype})")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"per_adapter_loss_from_hidden: hidden size {hidden.shape[-1]} does not match the LM head's "
                         f"weight {tuple(weight.shape)} ([vocab, hidden])")
    if tuple(labels.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"per_adapter_loss_from_hidden: `labels` has shape {tuple(labels.shape)}, the hidden states "
                         f"{tuple(hidden.shape)}: give one label per token [batch, seq]")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"per_adapter_loss_from_hidden: `chunk_size` must be a positive int (tokens per chunk) or "
                         f"None, got {chunk_size!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"per_adapter_loss_from_hidden: `softcap` must be positive or None, got {softcap!r}")
    if weight.device != hidden.device:
        raise ValueError(f"per_adapter_loss_from_hidden: `hidden` is on {hidden.device} but the LM head's weight on "
                         f"{weight.device}; move them to one device")
    if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
        raise TypeError(f"per_adapter_loss_from_hidden: `hidden` is {hidden.dtype} but the LM head's weight "
                        f"{weight.dtype}; cast one to the other (as the model's own head call would need) or run "
                        "under torch.autocast")
    return weight, bias


def adapter_token_means_from_hidden(hidden: torch.Tensor, lm_head: Union[torch.nn.Linear, torch.Tensor],
                                    labels: torch.Tensor, adapter_names: Sequence[str], vocab: Sequence[str], *,
                                    bias: Optional[torch.Tensor] = None, adapter_ids: Optional[torch.Tensor] = None,
                                    ignore_index: int = -100, shift: bool = True, chunk_size: Optional[int] = None,
                                    logit_scale: float = 1.0, softcap: Optional[float] = None):
    """:func:`~fast_multilora.loss.adapter_token_means` of the logits ``lm_head(hidden)``, computed without them:
    ``(means[len(vocab)], counts[len(vocab)])`` over a fixed adapter ``vocab`` (``means`` carries the graph).
    Arguments as in :func:`per_adapter_loss_from_hidden`."""
    weight, bias = _checked_head(hidden, lm_head, labels, bias, chunk_size, softcap)
    targets, tok = shifted_targets(labels, adapter_names, vocab, hidden.device, adapter_ids=adapter_ids,
                                   ignore_index=ignore_index, shift=shift)
    ce = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(),
                              ignore_index=ignore_index, chunk_size=chunk_size, logit_scale=logit_scale,
                              softcap=softcap)
    return per_adapter_mean(ce, tok, len(vocab), valid=targets.reshape(-1) != ignore_index)


def per_adapter_loss_from_hidden(hidden: torch.Tensor, lm_head: Union[torch.nn.Linear, torch.Tensor],
                                 labels: torch.Tensor, adapter_names: Sequence[str], *,
                                 bias: Optional[torch.Tensor] = None, adapter_ids: Optional[torch.Tensor] = None,
                                 ignore_index: int = -100, shift: bool = True, return_dict: bool = False,
                                 chunk_size: Optional[int] = None, logit_scale: float = 1.0,
                                 softcap: Optional[float] = None):
    """:func:`~fast_multilora.per_adapter_loss` of the logits ``lm_head(hidden)``, computed without them.

    ``hidden[B, T, H]``: the model's last hidden states (after its final norm); ``lm_head``: an ``nn.Linear`` or its
    weight ``[V, H]`` (with ``bias=`` its bias). ``labels``, ``adapter_names``, ``adapter_ids``, ``ignore_index``,
    ``shift`` and ``return_dict`` as in ``per_adapter_loss``: the sum over adapters of each adapter's mean token
    cross-entropy, ``__base__`` rows and ``ignore_index`` labels left out. ``chunk_size``: tokens per chunk (memory
    ``~ chunk_size x V`` fp32 elements at a time; default :func:`chunk_tokens`). ``logit_scale`` / ``softcap``: the
    model's post-head transform, ``logits = softcap * tanh(logit_scale * z / softcap)`` (Cohere's ``logit_scale``,
    Granite's ``1 / logits_scaling``, Gemma's ``final_logit_softcapping``). A label outside ``[0, V)`` other than
    ``ignore_index`` makes its adapter's loss NaN (``per_adapter_loss`` raises instead: that needs a host read).
    """
    vocab = sorted({n for n in adapter_names if n != BASE})
    means, counts = adapter_token_means_from_hidden(
        hidden, lm_head, labels, adapter_names, vocab, bias=bias, adapter_ids=adapter_ids, ignore_index=ignore_index,
        shift=shift, chunk_size=chunk_size, logit_scale=logit_scale, softcap=softcap)
    loss = means.sum()
    if return_dict:
        return loss, AdapterLosses(vocab, means.detach(), counts)
    return loss


# ---- the model helper --------------------------------------------------------------------------------------------

_HEAD_NAMES = ("ForCausalLM", "LMHeadModel")


def _causal_lm(model):
    """The transformers ``*ForCausalLM`` inside a ``PeftModel`` / ``LoraModel`` (or ``model`` itself)."""
    from peft.tuners.tuners_utils import BaseTuner

    if hasattr(model, "get_base_model"):  # PeftModel
        model = model.get_base_model()
    elif isinstance(model, BaseTuner):
        model = model.model
    return model


def _post_head_transform(causal) -> tuple:
    """``(logit_scale, softcap)`` of the transforms transformers' causal LMs apply to ``lm_head``'s output."""
    cfg = getattr(causal, "config", None)
    scale = 1.0
    own = getattr(causal, "logit_scale", None)  # Cohere: logits * self.logit_scale
    if own is not None:
        if isinstance(own, torch.Tensor):
            raise ValueError(f"fused_causal_lm_loss: {type(causal).__name__}.logit_scale is a tensor (a learned scale);"
                             " the fused loss takes a fixed scale: use per_adapter_loss(model(**batch).logits, ...)")
        scale *= float(own)
    if getattr(cfg, "logits_scaling", None):  # Granite: logits / config.logits_scaling
        scale /= float(cfg.logits_scaling)
    softcap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3: cap * tanh(logits / cap)
    return scale, (float(softcap) if softcap else None)


def fused_causal_lm_loss(model, batch, *, adapter_names: Optional[Sequence[str]] = None,
                         adapter_ids: Optional[torch.Tensor] = None, ignore_index: int = -100, shift: bool = True,
                         return_dict: bool = False, chunk_size: Optional[int] = None):
    """``per_adapter_loss(model(**batch).logits, ...)`` of a patched PEFT causal LM, without building the logits.

    ``model``: the patched ``PeftModel`` (or its ``LoraModel``) of a transformers ``*ForCausalLM`` /
    ``*LMHeadModel`` (a backbone ``model.base_model`` returning ``last_hidden_state``, and a plain ``nn.Linear``
    ``lm_head``). ``batch``: what ``model(**batch)`` would take, with ``labels`` and the routing (``adapter_names``,
    optional ``adapter_ids``; or pass them as arguments). Runs the backbone with the batch routed (the routing stays
    active after the call, as after ``model(...)``, so gradient-checkpointing recomputation sees it), then
    :func:`per_adapter_loss_from_hidden` on ``model.get_output_embeddings()`` with the model's post-head transform
    (``logit_scale``, ``logits_scaling``, ``final_logit_softcapping``). Returns the loss, or ``(loss,
    AdapterLosses)`` with ``return_dict=True``.
    """
    from .patching import _ROUTER_ATTR, _begin

    inputs = dict(batch)
    labels = inputs.pop("labels", None)
    names = inputs.pop("adapter_names", None) if adapter_names is None else adapter_names
    ids = inputs.pop("adapter_ids", None) if adapter_ids is None else adapter_ids
    inputs.pop("adapter_names", None), inputs.pop("adapter_ids", None)
    if labels is None:
        raise ValueError("fused_causal_lm_loss: the batch has no `labels`; give the token labels [batch, seq] "
                         "(the input ids, with ignore_index where no loss is wanted)")
    if names is None:
        raise ValueError("fused_causal_lm_loss: no `adapter_names` in the batch or the arguments; give one adapter "
                         "name per row ('__base__' for none), or the vocabulary that `adapter_ids` indexes")
    router = model.__dict__.get(_ROUTER_ATTR) or next(
        (m.__dict__[_ROUTER_ATTR] for m in model.modules() if _ROUTER_ATTR in m.__dict__), None)
    if router is None:
        raise ValueError("fused_causal_lm_loss: the model is not patched; call fast_multilora.patch(model) first")
    causal = _causal_lm(model)
    kind = type(causal).__name__
    backbone = getattr(causal, "base_model", causal)
    lm_head = causal.get_output_embeddings() if hasattr(causal, "get_output_embeddings") else None
    if not kind.endswith(_HEAD_NAMES) or backbone is causal or lm_head is None:
        raise ValueError(
            f"fused_causal_lm_loss: {kind} is not a standard transformers causal LM (a *ForCausalLM / *LMHeadModel "
            "with a backbone `base_model` and an `lm_head`); run its backbone yourself and call "
            "fast_multilora.per_adapter_loss_from_hidden(hidden, lm_head, labels, names), or use "
            "per_adapter_loss(model(**batch).logits, ...)"
        )
    if not isinstance(lm_head, torch.nn.Linear):
        raise ValueError(
            f"fused_causal_lm_loss: the LM head of {kind} is a {_qualname(lm_head)}, not a plain nn.Linear (LoRA "
            "on lm_head, modules_to_save=['lm_head'], or a quantized head): its logits are not hidden @ W.T; use "
            "per_adapter_loss(model(**batch).logits, ...)"
        )
    scale, softcap = _post_head_transform(causal)
    inputs.setdefault("use_cache", False)
    _begin(router, names, ids, (), inputs)
    out = backbone(**inputs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return per_adapter_loss_from_hidden(hidden, lm_head, labels, names, adapter_ids=ids, ignore_index=ignore_index,
                                        shift=shift, return_dict=return_dict, chunk_size=chunk_size,
                                        logit_scale=scale, softcap=softcap)


# ---- the model's own forward without its logits (PerAdapterLoss(fused=True), fast_multilora.trainer_kwargs) --------

_KEEP_ARGS = ("logits_to_keep", "num_logits_to_keep")  # transformers >= 4.50 / 4.45-4.49


class LogitsFreeHead(NamedTuple):
    """How a PEFT causal LM's own forward runs without its full logits: call it with ``{keep_arg: 1}`` (the logits
    of the last position only, as ``generate`` asks), read ``backbone``'s ``last_hidden_state`` (a forward hook) and
    compute the loss from it on ``lm_head`` with the post-head transform ``logit_scale`` / ``softcap``."""

    backbone: torch.nn.Module
    lm_head: torch.nn.Linear
    keep_arg: str
    logit_scale: float
    softcap: Optional[float]


def logits_free_head(model) -> Union[LogitsFreeHead, str]:
    """The :class:`LogitsFreeHead` of a (patched) PEFT model of a transformers causal LM, or why there is none (a
    sentence): not a ``*ForCausalLM`` / ``*LMHeadModel`` with a backbone, a head that is no plain ``nn.Linear`` (LoRA
    on ``lm_head``, ``modules_to_save``, quantized), a forward without ``logits_to_keep``, a learned (tensor)
    ``logit_scale``. The head's weight itself (quantized, or a DTensor under FSDP2) is checked per call by
    :func:`head_weight_problem`."""
    import inspect

    causal = _causal_lm(model)
    kind = type(causal).__name__
    backbone = getattr(causal, "base_model", causal)
    lm_head = causal.get_output_embeddings() if hasattr(causal, "get_output_embeddings") else None
    if not kind.endswith(_HEAD_NAMES) or backbone is causal or lm_head is None:
        return (f"{kind} is not a standard transformers causal LM (a *ForCausalLM / *LMHeadModel with a backbone "
                "`base_model` and an `lm_head`)")
    if not isinstance(lm_head, torch.nn.Linear):
        return (f"the LM head of {kind} is a {_qualname(lm_head)}, not a plain nn.Linear (LoRA on lm_head, "
                "modules_to_save=['lm_head'], or a quantized head)")
    params = inspect.signature(causal.forward).parameters
    keep = next((k for k in _KEEP_ARGS if k in params), None)
    if keep is None:
        return f"{kind}.forward takes no `logits_to_keep`: it builds the logits of every position"
    try:
        scale, softcap = _post_head_transform(causal)
    except ValueError:
        return f"{kind}.logit_scale is a tensor (a learned scale); the fused loss takes a fixed scale"
    return LogitsFreeHead(backbone, lm_head, keep, scale, softcap)


def head_weight_problem(lm_head: torch.nn.Linear) -> Optional[str]:
    """Why the fused loss cannot take ``lm_head``'s weight as it is now (None if it can): quantized, or sharded (a
    DTensor: FSDP2 outside the forward)."""
    for name in ("weight", "bias"):
        t = getattr(lm_head, name, None)
        if t is None:
            continue
        plain = type(t) in (torch.Tensor, torch.nn.Parameter) or isinstance(t, FakeTensor)
        if not plain or not t.is_floating_point():
            return (f"the LM head's {name} is a {type(t).__name__} of dtype {t.dtype} (a quantized or sharded head, "
                    "e.g. bitsandbytes, torchao or a DTensor under FSDP2)")
    return None
