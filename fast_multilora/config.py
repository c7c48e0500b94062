"""``PatchConfig``: every setting of a patched model, fixed when :func:`fast_multilora.patch` runs.

Settings that change which code runs live here, not in environment variables read at import: a compiled graph is
traced with one set of them, and two models in one process may use different ones.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

BACKENDS = ("auto", "torch", "triton")
FAMILIES = ("auto", "sgemm", "chunked")


@dataclass(frozen=True)
class PatchConfig:
    """Settings of :func:`fast_multilora.patch`.

    ``backend``: ``"triton"`` (the kernels; on CPU tensors they need ``TRITON_INTERPRET=1``), ``"torch"`` (the
    pure-PyTorch ops of ``fast_multilora.reference``) or ``"auto"`` (Triton for CUDA tensors, torch otherwise).

    ``family``: kernel family for per-row routing (``adapter_names``): ``"sgemm"`` (one segment per row, tokens in
    place), ``"chunked"`` (tokens grouped by adapter through a permutation, fixed-size chunks) or ``"auto"``
    (SGEMM for rows of at least ``plan.SGEMM_MIN_ROW_TOKENS`` tokens, chunked for shorter rows such as decode steps).
    Packed rows (``adapter_ids``) always take the chunked family. Either way the layout is built on the device from
    the routing tensor and its shapes only, so ``torch.compile`` sees no data-dependent shapes.

    ``fuse_base``: a layer whose base is a plain frozen ``nn.Linear`` runs the base GEMM inside the layer Function:
    the expand writes the delta (base rows: the bias or zero) and cuBLAS accumulates ``x Wᵀ`` into it; backward
    likewise for ``dx``. In training a bitsandbytes 4-bit base computing in the input's dtype too, its weight
    dequantized in the forward and the backward (as bitsandbytes' own autograd function does).

    ``weights_in_place``: eager Triton calls read each adapter's weights where they are (``kernels.SlotWeights``)
    instead of concatenating them per call (``torch.compile`` always concatenates: the ops take tensors).

    ``store_dropout_mask``: a training forward under dropout stores its keep-mask (one bit per element of x) for the
    backward, which then reads it instead of drawing it again; ``False`` redraws it (saves that memory), except in
    layers holding a DoRA adapter, whose base term reads the mask in the forward.

    ``adapter_store``: the adapters' weights live in slot-stacked storage (``fast_multilora.store``, built at
    ``patch``; PEFT's parameters are views of it and their ``.grad`` views of its gradient, so any optimizer steps
    them): each layer call takes two weight tensors whatever the adapter count. ``False`` keeps every parameter
    where PEFT made it (each layer call then takes every adapter's weights).

    ``fast_launch``: Triton kernels are launched through ``kernels.launch``'s cache of compiled kernels (less host
    time per launch, the same kernels) rather than Triton's own ``kernel[grid](...)``; ``False`` is a debugging
    switch. The cache is the process's, so the last ``patch`` sets it for every patched model.

    ``store_optimizer``: a ``torch.optim.AdamW`` holding the store's parameters (``model.parameters()``) steps them
    through the store -- one launch per arena instead of torch's per-tensor work -- with its own hyperparameters and
    states (``optimizer.state``, ``state_dict`` as usual; ``fast_multilora.optim`` says when it does not), and
    bitsandbytes' blockwise 8-bit Adam in a few calls per arena (``fast_multilora.optim_bnb``); ``False``: the
    optimizers step them per tensor.

    ``resident_adapters``: paging (``fast_multilora.paging``). ``None``: off, every adapter stays on its device.
    ``k``: the adapters of the batch (and those :func:`fast_multilora.prefetch` brought in) and at most ``k`` others,
    the most recently used, keep their weights and optimizer states on the device; every other adapter's live in
    (pinned) host memory and come back at the forward that names them. Results equal a fully resident run's exactly
    (with ``store_optimizer=False`` there: under paging torch's optimizers step every parameter themselves).
    """

    backend: str = "auto"
    family: str = "auto"
    fuse_base: bool = True
    weights_in_place: bool = True
    store_dropout_mask: bool = True
    adapter_store: bool = True
    fast_launch: bool = True
    store_optimizer: bool = True
    resident_adapters: Optional[int] = None

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected 'auto', 'torch' or 'triton'")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; expected 'auto', 'sgemm' or 'chunked'")
        k = self.resident_adapters
        if k is not None and (type(k) is not int or k < 0):
            raise ValueError(f"PatchConfig.resident_adapters must be None (no paging) or an int >= 0 (how many "
                             f"adapters outside the batch stay on the device), got {k!r}")
        for f in fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"PatchConfig.{f.name} must be a bool, got {getattr(self, f.name)!r}")

    def with_overrides(self, **overrides) -> PatchConfig:
        """A copy with ``overrides`` (field names of this class) applied; unknown names raise ``TypeError``."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown patch setting(s) {unknown}; PatchConfig has {sorted(known)}")
        return replace(self, **overrides)
