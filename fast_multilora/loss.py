"""Per-adapter loss: the sum over adapters of each adapter's mean token loss.

Why: with a plain mean over all tokens of a mixed batch, an adapter's gradient is scaled by its share of the batch's
tokens, so its effective learning rate would change with the mix. Summing per-adapter means gives every adapter
exactly the gradient of training it alone on its own samples (mean over its tokens), whatever the mix. ``__base__``
rows are left out (they train nothing).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.function import once_differentiable

from .kernels.segments import to_device
from .plan import BASE

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read at import, as Triton decides
_KERNEL_OFF: list = []  # why the cross-entropy kernels failed to compile, once (then PyTorch's ops for good)


def _kernel_for(z: torch.Tensor) -> bool:
    """Whether the token cross-entropy of the logits ``z`` runs ``kernels/cross_entropy.py``'s kernels: on a GPU,
    and on the CPU under the Triton interpreter (the tests); PyTorch's ops otherwise, on fake tensors, while
    ``torch.compile`` traces (it traces PyTorch's ops, not a Triton launch), and for good once a kernel failed to
    compile (a warning says so)."""
    if _KERNEL_OFF or isinstance(z, FakeTensor) or torch.compiler.is_compiling():
        return False
    return z.device.type == "cuda" or (_INTERPRET and z.device.type == "cpu")


def _kernel_errors() -> tuple:
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    return CompilationError, OutOfResources


def _kernel_failed(e: Exception) -> None:
    _KERNEL_OFF.append(f"{type(e).__name__}: {e}")
    warnings.warn(f"fast_multilora: the cross-entropy kernels could not run on this GPU ({_KERNEL_OFF[0][:300]}); "
                  "PyTorch's ops compute the loss from now on (the same loss and gradients, more memory traffic)",
                  stacklevel=3)


def masked_token_ce(ce: torch.Tensor, labels: torch.Tensor, V: int, ignore_index: int) -> torch.Tensor:
    """Per-token ``ce`` computed against the labels clamped to ``[0, V)``: 0 at ``ignore_index``, NaN at a label
    outside ``[0, V)`` (no host read to raise on)."""
    return torch.where(labels == ignore_index, 0.0, torch.where((labels >= 0) & (labels < V), ce, float("nan")))


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy ``ce[N]`` of the logits ``z[N, V]`` (rows contiguous) through the kernels: the
    forward reads ``z`` once (``ce`` and ``lse``, fp32), the backward reads it once more and writes its gradient in
    its dtype, ``(softmax - onehot)`` times each token's upstream gradient (0 for ``ignore_index``). PyTorch's
    ``cross_entropy(z.float())`` takes an fp32 copy, ``log_softmax``'s fp32 output (saved), a zero-filled fp32
    gradient, its backward's and the cast back. ``ce`` is 0 at ``ignore_index`` and NaN at a label outside
    ``[0, V)`` (no host read to raise on)."""

    @staticmethod
    def forward(ctx, z, labels, ignore_index: int):
        from .kernels.cross_entropy import cross_entropy_fwd

        V = z.shape[1]
        target = labels.clamp(0, V - 1)
        ce, lse = cross_entropy_fwd(z, target)
        ce = masked_token_ce(ce, labels, V, ignore_index)
        ctx.save_for_backward(z, target, lse, labels)
        ctx.ignore_index = ignore_index
        return ce

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ce):
        from .kernels.cross_entropy import cross_entropy_bwd

        z, target, lse, labels = ctx.saved_tensors
        g = torch.where(labels == ctx.ignore_index, 0.0, grad_ce.to(lse.dtype))
        try:
            return cross_entropy_bwd(z, target, lse, g), None, None
        except _kernel_errors() as e:  # (raised before the launch) the same gradient from PyTorch's ops
            from .fused_loss import _dlogits

            _kernel_failed(e)
            z32 = z.to(lse.dtype, copy=True)  # (_dlogits overwrites it; z is the caller's logits)
            return _dlogits(z32, None, lse, labels, 0, z.shape[1], g, 1.0, None, z.dtype), None, None


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """``ce[N]`` of ``logits[N, V]`` against ``labels[N]`` (0 at ``ignore_index``), in fp32: the values and
    gradients of ``F.cross_entropy(logits.float(), labels, reduction="none")`` (HF's upcast), through
    :class:`_TokenCrossEntropy`'s kernels where :func:`_kernel_for` says so (which keep fp64 logits in fp64).
    A kernel that fails to compile (forward or backward) gives one warning and PyTorch's ops from then on."""
    if _kernel_for(logits):
        try:
            return _TokenCrossEntropy.apply(logits if logits.stride(1) == 1 else logits.contiguous(), labels,
                                            ignore_index)
        except _kernel_errors() as e:  # (raised before the launch)
            _kernel_failed(e)
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="none")


def per_adapter_mean(values: torch.Tensor, token_adapter: torch.Tensor, num_adapters: int,
                     valid: Optional[torch.Tensor] = None):
    """Mean of ``values`` per adapter over its valid tokens.

    ``token_adapter``: same shape as ``values``, ints in ``[0, num_adapters)`` or ``-1`` (ignored). Returns
    ``(means[num_adapters], counts[num_adapters])``; adapters without tokens get mean 0. Deterministic (a masked
    sum per adapter, not an atomic scatter); a NaN/Inf value stays in its own adapter's mean (no ``0 * NaN``).
    """
    v = values.reshape(-1).float()
    ids = token_adapter.reshape(-1).to(v.device)
    keep = ids >= 0
    if valid is not None:
        keep = keep & valid.reshape(-1).to(v.device)
    onehot = (ids[None, :] == torch.arange(num_adapters, device=v.device)[:, None]) & keep[None, :]
    counts = onehot.sum(1).to(v.dtype)
    sums = torch.where(onehot, v[None, :], torch.zeros((), dtype=v.dtype, device=v.device)).sum(1)
    return sums / counts.clamp(min=1), counts


def token_adapters(adapter_names: Sequence[str], vocab: Sequence[str], shape, device, *,
                   adapter_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Index into ``vocab`` of every token of a batch of ``shape`` ``[B, T]`` (-1 = ``__base__``): from one name per
    row, or with packed rows from ``adapter_ids[B, T]`` indexing ``adapter_names`` (-1 = base)."""
    names = list(adapter_names)
    index = {n: i for i, n in enumerate(vocab)}
    unknown = sorted({n for n in names if n != BASE and n not in index})
    if unknown:
        raise ValueError(f"adapter(s) {unknown} not in the loss vocabulary {list(vocab)}")
    # built on the host, copied through pinned memory: a copy that waited for the stream would make the host wait for
    # the whole forward pass before it could queue the backward
    table = to_device(torch.tensor([index.get(n, -1) for n in names] + [-1]), device)
    if adapter_ids is None:
        if len(names) != shape[0]:
            raise ValueError(f"got {len(names)} adapter names for a batch of {shape[0]} rows")
        return table[:-1][:, None].expand(shape)
    if tuple(adapter_ids.shape) != tuple(shape):
        raise ValueError(f"`adapter_ids` must be [batch, seq] = {tuple(shape)}, one adapter index per token of the "
                         f"labels, got shape {tuple(adapter_ids.shape)}")
    # -1 indexes the trailing "no adapter" entry
    return table[to_device(adapter_ids, device).long()]


def shifted_targets(labels: torch.Tensor, adapter_names: Sequence[str], vocab: Sequence[str], device, *,
                    adapter_ids: Optional[torch.Tensor] = None, ignore_index: int = -100, shift: bool = True):
    """``(labels, token_adapter)`` ``[B, T]`` on ``device``, aligned with the predictions of positions ``0..T-1``:
    with ``shift`` each position's label is the next token's (the last position gets ``ignore_index``) and its
    adapter the next token's (-1 at the end), as :func:`token_adapters` indexes ``vocab``."""
    tok = token_adapters(adapter_names, vocab, labels.shape, device, adapter_ids=adapter_ids)
    labels = to_device(labels, device)
    if shift:  # shift the labels, not the logits: a slice of the logits would be copied, and its gradient zero-filled
        labels = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
        tok = F.pad(tok[:, 1:], (0, 1), value=-1)
    return labels, tok


def adapter_token_means(logits: torch.Tensor, labels: torch.Tensor, adapter_names: Sequence[str],
                        vocab: Sequence[str], *, adapter_ids: Optional[torch.Tensor] = None,
                        ignore_index: int = -100, shift: bool = True):
    """Per-adapter mean token cross-entropy and token counts over an adapter ``vocab`` (``__base__`` tokens and
    ``ignore_index`` labels left out). Returns ``(means[len(vocab)], counts[len(vocab)])``; ``means`` carries the
    graph. ``adapter_names`` one per row, or with packed rows the names that ``adapter_ids[B, T]`` indexes."""
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, seq, vocab] (the model output's .logits), got shape "
                         f"{tuple(logits.shape)}")
    if tuple(labels.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"labels must be [batch, seq] = {tuple(logits.shape[:2])} to match logits of shape "
                         f"{tuple(logits.shape)}, got shape {tuple(labels.shape)}: one label per token, unshifted "
                         "(shift=True shifts them as HF models do)")
    labels, tok = shifted_targets(labels, adapter_names, vocab, logits.device, adapter_ids=adapter_ids,
                                  ignore_index=ignore_index, shift=shift)
    ce = token_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index)
    return per_adapter_mean(ce, tok, len(vocab), valid=labels.reshape(-1) != ignore_index)


def adapter_log_prob_means(log_probs: torch.Tensor, label_mask: torch.Tensor, adapter_names: Sequence[str],
                           vocab: Sequence[str], *, adapter_ids: Optional[torch.Tensor] = None):
    """:func:`adapter_token_means` from per-token next-token log-probabilities instead of logits (TRL's fused LM
    head returns them without building the logits): ``log_probs[B, T-1]`` of the labels ``1..T-1``,
    ``label_mask[B, T-1]`` where they are trained. Same means: the negative log-probability is the cross-entropy."""
    B, T1 = log_probs.shape
    tok = token_adapters(adapter_names, vocab, (B, T1 + 1), log_probs.device, adapter_ids=adapter_ids)[:, 1:]
    return per_adapter_mean(-log_probs, tok, len(vocab), valid=label_mask.to(log_probs.device))


def per_adapter_loss(logits: torch.Tensor, labels: torch.Tensor, adapter_names: Sequence[str], *,
                     adapter_ids: Optional[torch.Tensor] = None, ignore_index: int = -100, shift: bool = True,
                     return_dict: bool = False):
    """Causal-LM loss summed over adapters of each adapter's mean token cross-entropy.

    ``logits[B, T, V]``, ``labels[B, T]``; ``adapter_names`` one per row (or, with packed rows, the vocabulary that
    ``adapter_ids[B, T]`` indexes, -1 = base). ``shift=True`` predicts token ``t+1`` from ``t`` as HF models do.
    With ``return_dict=True`` returns ``(loss, {adapter: mean loss})`` (detached floats, adapters present only).
    """
    vocab = sorted({n for n in adapter_names if n != BASE})
    means, counts = adapter_token_means(logits, labels, adapter_names, vocab, adapter_ids=adapter_ids,
                                        ignore_index=ignore_index, shift=shift)
    loss = means.sum()
    if return_dict:
        return loss, AdapterLosses(vocab, means.detach(), counts)
    return loss


class AdapterLosses(Mapping):
    """``{adapter: mean token loss}`` (floats, adapters with tokens only) read from the device on first use: the
    step that computed it does not wait for the GPU (a host read right after the forward would keep the host from
    queuing the backward until the forward ran). ``dict(losses)`` for a plain dict."""

    def __init__(self, vocab: Sequence[str], means: torch.Tensor, counts: torch.Tensor):
        self._vocab, self._tensors, self._values = tuple(vocab), (means, counts), None

    def _read(self) -> dict:
        if self._values is None:
            means, counts = torch.stack(self._tensors).tolist()  # one host read
            self._values = {n: m for n, m, c in zip(self._vocab, means, counts, strict=True) if c > 0}
            self._tensors = None
        return self._values

    def __getitem__(self, name):
        return self._read()[name]

    def __iter__(self):
        return iter(self._read())

    def __len__(self):
        return len(self._read())

    def __repr__(self):
        return repr(self._read())
