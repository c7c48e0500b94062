"""Plain data the kernels take: how tokens map to adapter slots, and one layer's per-slot adapter tables.

Only torch is imported here, so both the Triton launchers and the pure-PyTorch reference can share these types.

Conventions (every op follows them):

* ``S`` tokens, rows of a 2-D activation ``x[S, K]``. A *slot* is a model-wide adapter index ``0 .. n_slots-1``.
  Tokens that use no adapter (``"__base__"``) have slot ``-1``: kernels skip them (``dx`` rows are zero).
* ``Segments`` lists runs of tokens that share a slot. ``indptr[i] .. indptr[i+1]`` are *logical* positions of
  segment ``i``; the physical row of logical position ``j`` is ``perm[j]`` (``perm is None`` means identity, i.e.
  the segments are contiguous runs of rows: the SGEMM family; with a permutation the segments are one per slot and
  rows are gathered: the chunked SGMV family).
* ``AdapterTable`` holds per-slot ``ranks`` (0 when the slot's adapter is absent from this layer: a no-op), the
  first rank-row ``offsets`` of the slot in the concatenated weights, fp32 ``scales`` and dropout ``p``.
* Concatenated weights of one layer: ``A_cat[stack_num * R_total, K]`` where slot ``a`` owns rows
  ``stack_num*offsets[a] .. stack_num*(offsets[a]+ranks[a])`` (slice ``s`` of a stacked q/k/v group at
  ``stack_num*offsets[a] + s*ranks[a]``); ``B_cat[N, R_total]`` (one per slice) where slot ``a`` owns columns
  ``offsets[a] .. offsets[a]+ranks[a]``. Every launcher also takes, for ``stack_num == 1``, a :class:`SlotWeights`
  instead: each slot's own ``[r_a, K]`` / ``[N, r_a]`` weight read where it is (no copy).
* The shrink output ``h[S, stack_num * max_rank]`` is float32; a token of slot ``a`` uses columns
  ``0 .. stack_num*ranks[a]`` (slice ``s`` at ``s*ranks[a]``). Columns beyond are don't-care.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch


class Segments(NamedTuple):
    indptr: torch.Tensor  # int32 [n_seg + 1], logical token boundaries
    slot: torch.Tensor  # int32 [n_seg], adapter slot of each segment
    perm: Optional[torch.Tensor]  # int32 [S] logical -> physical row, or None for identity
    max_len: int  # longest segment (host int, sizes grids)
    num_tokens: int  # S, rows of the activations
    cache: dict  # launcher-side derived tables (chunk lists per block size), filled lazily
    base_max_len: int = -1  # longest segment of base tokens (slot -1) among the segments; -1: not known
    token_slots: Optional[torch.Tensor] = None  # int32 [S]: slot of each physical row (-1 = base), if known
    # (order int32 [S], bounds int64 [n_slots + 2]): rows stable-sorted by slot and where each slot's rows start
    # (slot -1 first), for the backward launchers; built with the layout, so per-call ops need not sort again
    grouping: Optional[tuple] = None
    # (info int32 [levels, rows, 3], cptr int32 [levels, n_slots + 2]): the backward's chunk tables of ``grouping``
    # for every chunk length ``chunks.CHUNK0 << l`` (``chunks.chunk_tables``, slot ids first), built with the layout
    # once per forward call (``backward.with_tables``) so the backward launchers need not build their own
    chunk_tables: Optional[tuple] = None

    @property
    def covers_all_rows(self) -> bool:
        """Every row lies in a segment and the longest segment of any slot is known (host ints): the SGEMM family's
        write-mode expand can then define every row of its output in one pass."""
        return self.perm is None and self.base_max_len >= 0

    @property
    def num_segments(self) -> int:
        return self.slot.numel()


class AdapterTable(NamedTuple):
    ranks: torch.Tensor  # int32 [n_slots]
    offsets: torch.Tensor  # int32 [n_slots], first rank-row of each slot in A_cat / column in B_cat
    scales: torch.Tensor  # float32 [n_slots]
    dropout: torch.Tensor  # float32 [n_slots]
    max_rank: int  # max over ranks (host int)
    total_rank: int  # sum of ranks (host int)
    has_dropout: bool  # any dropout p > 0 (host bool)
    slots: Optional[tuple] = None  # host: the slots of rank > 0, ascending (the order of a layer's weights), if known
    host: Optional[tuple] = None  # host copies (ranks, offsets, scales, dropout), tuples per slot, if known
    # E > 1: the slots are MoE *virtual* slots ``v = e * spe + s`` of E experts (``spe = n_slots // E`` slots per
    # expert). It changes only how a packed B block is addressed (``packed_b``; and ``lora_expand_bwd``'s blocked dB,
    # the same layout): an adapter's B is PEFT's ``[N, r*E]`` experts weight as it is, expert e of slot v in its
    # strided columns ``j*E + e``. A 2-D ``B_cat`` or ``SlotWeights`` keeps its meaning (slot v at column
    # ``offsets[v]``, expert-major), as does everything about A.
    experts: int = 1


class SlotWeights(NamedTuple):
    """One layer's adapter weights read where they are, standing in for ``A_cat`` / ``B_cat`` (no concatenated copy).

    Slot ``a``'s weight starts ``offsets[a]`` elements after ``base``'s first element; ``base`` is the weight at the
    lowest address, the kernels' pointer argument. Build it with :func:`slot_weights`, which checks what the kernels
    assume: every weight contiguous, of one dtype and device, and at an offset that is a multiple of 16 elements (the
    alignment the concatenation's rows have; the CUDA caching allocator hands out 512-byte aligned blocks).
    A weights ``[r_a, K]`` (``stack_num == 1``), row stride ``K``; B weights ``[N, r_a]``, row stride ``r_a``: the
    kernels take it from the table's ``ranks[a]``, so B ranks may differ per slot.
    """

    base: torch.Tensor
    offsets: torch.Tensor  # int64 [n_slots] on the weights' device; 0 for slots without a weight (rank 0)
    shape: tuple  # the concatenation it stands for: (total_rank, K) for A, (N, total_rank) for B

    def stride(self) -> tuple:
        """The strides of the concatenation it stands for, which launchers pass as the weight's strides: ``(K, 1)``
        for A, each weight's own too; ``(total_rank, 1)`` for B, unread under ``W_OFFS`` (each slot's row stride is
        its rank)."""
        return self.shape[1], 1


def weight_args(name: str, w, device, stack_num: int) -> tuple:
    """``(the tensor the kernels take as the weight pointer, per-slot element offsets or None)`` for a launcher's
    weight argument: a concatenated weight as it is (the table's offsets locate its slots), or a :class:`SlotWeights`,
    whose own invariants are checked here (one slice: ``stack_num == 1``; int64 offsets on ``device``). The launcher
    checks the returned tensor itself."""
    if not isinstance(w, SlotWeights):
        return w, None
    if stack_num != 1:
        raise ValueError(f"{name}: SlotWeights take stack_num=1, got {stack_num} (stacked weights are concatenated)")
    if w.offsets.device != device or w.offsets.dtype != torch.int64:
        raise ValueError(f"{name}.offsets must be int64 on {device}, got {w.offsets.dtype} on {w.offsets.device}")
    return w.base, w.offsets


_ALIGN = 16  # elements
_SLOT_WEIGHTS: dict = {}  # key of slot_weights -> (base index, device offsets, shape) or None
_CAPTURED: dict = {}  # the entries a CUDA graph capture used: kept when _SLOT_WEIGHTS is cleared


def slot_weights(weights: Sequence[torch.Tensor], slots: tuple, n_slots: int, dim: int) -> Optional[SlotWeights]:
    """``weights`` (slot ``slots[i]`` owns ``weights[i]``) as a :class:`SlotWeights`, or ``None`` when the kernels
    cannot read them in place (mixed dtypes or devices, a non-contiguous weight, a misaligned address, A weights of
    unequal ``K`` or B weights of unequal ``N``): the caller then concatenates. ``dim=0``: A weights ``[r_a, K]``;
    ``dim=1``: B weights ``[N, r_a]``, ranks free.

    Cached by what the result depends on -- per weight its address, shape, dtype and contiguity -- which in-place
    optimizer updates keep: a training loop builds each layer's device table of offsets once. Per call: the key.
    Tables looked up while a CUDA graph is being captured are kept for good (the graph reads them on every replay);
    a capture needs them built beforehand (a warm-up call), as it needs the batch plan.
    """
    if not weights:
        return None
    key = (weights[0].device, n_slots, slots, dim,
           *[(w.data_ptr(), w.shape, w.dtype, w.is_contiguous()) for w in weights])
    hit = _cached(key, lambda: _slot_offsets(weights, slots, n_slots, dim), weights[0].is_cuda)
    if hit is None:
        return None
    index, offsets, shape = hit
    return SlotWeights(weights[index], offsets, shape)


def _cached(key, build, is_cuda: bool):
    """The entry of ``key`` in the builders' cache, ``build()`` on a miss; kept for good while a CUDA graph is being
    captured (the graph reads its device table on every replay)."""
    hit = _SLOT_WEIGHTS.get(key, False)
    if hit is False:
        hit = _CAPTURED.get(key, False)
        if hit is False:
            hit = build()
        if len(_SLOT_WEIGHTS) >= 4096:  # bounded: entries are a few bytes of device memory each
            _SLOT_WEIGHTS.clear()
        _SLOT_WEIGHTS[key] = hit
    if hit is not None and is_cuda and torch.cuda.is_current_stream_capturing():
        _CAPTURED[key] = hit  # a CUDA graph now reads this table: never freed
    return hit


def _slot_offsets(weights, slots, n_slots, dim):
    """``(index of the base weight, int64 offsets [n_slots] on the device, shape)``, or ``None`` (see
    :func:`slot_weights`)."""
    w0 = weights[0]
    if len(slots) != len(weights) or any(w.dim() != 2 or w.dtype != w0.dtype or w.device != w0.device
                                         or not w.is_contiguous() for w in weights):
        return None
    if any(w.shape[1 - dim] != w0.shape[1 - dim] for w in weights):  # one K (A) or one N (B)
        return None
    ptrs = [w.data_ptr() for w in weights]
    index = min(range(len(ptrs)), key=ptrs.__getitem__)
    size = w0.element_size()
    host = [0] * n_slots
    for s, p in zip(slots, ptrs, strict=True):
        delta = p - ptrs[index]
        if delta % (_ALIGN * size) or not 0 <= s < n_slots:
            return None
        host[s] = delta // size
    total = sum(w.shape[dim] for w in weights)
    shape = (total, w0.shape[1]) if dim == 0 else (w0.shape[0], total)
    return index, _device_offsets(host, w0.device), shape


def _device_offsets(host: list, device) -> torch.Tensor:
    return to_device(torch.tensor(host, dtype=torch.int64), device)


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` without making the host wait for the device: to a CUDA device through
    pinned memory (torch's caching host allocator keeps the block until the copy ran), since a copy from pageable
    memory may synchronize with the stream, i.e. wait for every kernel queued before it (a whole forward pass, when
    a loss builds its tables). Other devices: a plain copy (the tensor itself when it is there already)."""
    device = torch.device(device)
    if host.device == device:
        return host
    if device.type == "cuda" and host.device.type == "cpu":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def packed_b(name: str, w, N: int, total_rank: int, device) -> bool:
    """Whether a launcher's ``B_cat`` argument is the adapter store's packed block (``store.LayerSlots.b_leaf``):
    1-D ``[N * total_rank]``, slot ``a``'s ``[N, ranks[a]]`` weight contiguous at element ``N * offsets[a]`` -- the
    layout ``lora_expand_bwd`` writes a packed ``B``'s gradient in. Every expand kernel reads it as it lies
    (``sgemm.slot_b``'s ``B_PACKED``: no table, no copy), so a compiled graph passes the block itself. A 1-D
    ``w`` that is not such a block raises ``ValueError``.

    With a table of ``experts = E > 1`` (MoE virtual slots ``v = e * spe + s``, see :func:`expert_args`) the block
    holds each adapter's B in PEFT's experts layout ``[N, r*E]`` (expert ``e`` in the strided columns ``j*E + e``):
    virtual slot ``v`` of expert ``e = v // spe`` reads element ``N * (offsets[v] - e*ranks[v]) + e + n*(ranks[v]*E)
    + j*E`` for its ``B_v[n, j]`` -- with ``offsets[v] = off_a + e*r_a``, adapter ``a``'s weight as it is at element
    ``N * off_a``: the packed layout of one slot of rank ``E*r_a``. Only the packed form changes meaning: a 2-D
    ``B_cat`` stays the expert-major concatenation (slot ``v`` at columns ``offsets[v] ..``)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return False
    if not w.is_contiguous() or w.device != device or not w.dtype.is_floating_point:
        raise ValueError(f"{name}: a packed B must be a contiguous floating tensor on {device}, got {w.dtype} "
                         f"{'contiguous' if w.is_contiguous() else 'strided'} on {w.device}")
    if w.numel() != N * total_rank:
        raise ValueError(f"{name}: a packed B must have N*total_rank = {N}*{total_rank} elements, got {w.numel()}")
    return True


def expert_args(name: str, table: AdapterTable) -> tuple:
    """``(E, spe)`` of a table for the kernels: its ``experts`` (a constexpr, ``EXPERTS``) and the slots per expert
    ``n_slots // E`` (a runtime int, ``spe``: virtual slot ``v`` is expert ``v // spe``'s); ``(1, 1)`` for an
    ordinary table (``spe`` unread). ``ValueError`` when ``E`` is not a positive int or does not divide the slots."""
    E = table.experts
    if E == 1:
        return 1, 1
    if not isinstance(E, int) or isinstance(E, bool) or E < 1:
        raise ValueError(f"{name}: table.experts must be a positive int (1 = an ordinary table), got {E!r}")
    n_slots = table.ranks.numel()
    if n_slots % E:
        raise ValueError(f"{name}: table.experts={E} does not divide the table's {n_slots} slots; an experts table "
                         f"has spe slots per expert (virtual slot v = e * spe + s), n_slots = E * spe")
    return E, n_slots // E


def segments_from_token_slots(token_slots: torch.Tensor, grouped: bool, device=None) -> Segments:
    """Build ``Segments`` from host (CPU) per-token slots (``-1`` = no adapter); one small host->device copy.

    ``grouped=False`` (SGEMM family): tokens stay in place, one segment per run of equal slots, covering all ``S``
    tokens; runs of base tokens are segments with slot ``-1``, which every kernel skips (or, for ``dx``, zeroes).
    ``grouped=True`` (chunked SGMV family): adapter tokens stable-sorted by slot, one segment per used slot; ``perm``
    lists only adapter tokens, so base tokens are in no segment.
    """
    token_slots = token_slots.to("cpu", torch.int64).reshape(-1)
    S = token_slots.numel()
    device = torch.device(device) if device is not None else token_slots.device
    perm = None
    keys = token_slots
    if grouped:
        order = torch.sort(token_slots, stable=True).indices
        order = order[token_slots[order] >= 0]
        keys = token_slots[order]
        perm = order.to(torch.int32)
    n = keys.numel()
    if n == 0:
        starts = torch.zeros(0, dtype=torch.int64)
    else:
        change = torch.ones(n, dtype=torch.bool)
        change[1:] = keys[1:] != keys[:-1]
        starts = torch.nonzero(change).reshape(-1)
    indptr = torch.cat([starts, torch.tensor([n], dtype=torch.int64)])
    slots = keys[starts]
    lens = indptr[1:] - indptr[:-1]
    live = slots >= 0
    host = torch.cat([indptr, slots] + ([perm.to(torch.int64)] if perm is not None else [])).to(torch.int32)
    dev = to_device(host, device)
    n_seg = slots.numel()
    return Segments(
        indptr=dev[: n_seg + 1],
        slot=dev[n_seg + 1 : 2 * n_seg + 1],
        perm=dev[2 * n_seg + 1 :] if perm is not None else None,
        max_len=int(lens[live].max()) if bool(live.any()) else 0,
        num_tokens=S,
        cache={},
        base_max_len=(int(lens[~live].max()) if bool((~live).any()) else 0) if perm is None else -1,
    )


def slot_grouping(token_slots: torch.Tensor, n_slots: int) -> tuple:
    """``(order, bounds)`` of per-row slots (``-1`` = base): rows stable-sorted by slot (int32 ``[S]``) and where each
    slot's rows start, int64 ``[n_slots + 2]`` (rows of slot ``a`` are ``order[bounds[a+1]:bounds[a+2]]``, slot -1
    first). Device ops only; the backward launchers' row grouping (``Segments.grouping``)."""
    sorted_ts, order = torch.sort(token_slots, stable=True)
    bounds = torch.searchsorted(sorted_ts, torch.arange(-1, n_slots + 1, device=token_slots.device,
                                                        dtype=sorted_ts.dtype))
    return order.to(torch.int32), bounds.to(torch.int64)


def row_segments(row_slots: torch.Tensor, tokens_per_row: int, n_slots: int) -> Segments:
    """SGEMM-family ``Segments`` of per-row routing, built on ``row_slots``' device without a host sync: one segment
    per row of ``tokens_per_row`` tokens (slot ``row_slots[i]``, ``-1`` = base), with the backward's row grouping for
    a table of ``n_slots`` slots. Every host int comes from the shapes, so a compiled graph or a captured CUDA graph
    serves any adapter mix of the same shape."""
    n_rows, T = row_slots.numel(), tokens_per_row
    dev = row_slots.device
    slot = row_slots.reshape(-1).to(torch.int32)
    ts = slot.repeat_interleave(T) if T != 1 else slot
    return Segments(
        indptr=torch.arange(n_rows + 1, device=dev, dtype=torch.int32) * T, slot=slot, perm=None,
        max_len=T if n_rows else 0, num_tokens=n_rows * T, cache={}, base_max_len=T if n_rows else 0,
        token_slots=ts, grouping=slot_grouping(ts, n_slots),
    )


def grouped_segments(token_slots: torch.Tensor, n_slots: int) -> Segments:
    """Chunked-family ``Segments`` built on ``token_slots``' device without a host sync: rows stable-sorted by slot
    (``perm`` covers every row), one segment per slot ``-1 .. n_slots-1`` (slot ``-1``, base rows, first; empty
    segments included), so shapes depend on ``S`` and ``n_slots`` only, never on the mix. The sort is the backward's
    row grouping too."""
    ts = token_slots.reshape(-1).to(torch.int32)
    order, bounds = slot_grouping(ts, n_slots)
    return Segments(
        indptr=bounds.to(torch.int32), slot=torch.arange(-1, n_slots, device=ts.device, dtype=torch.int32),
        perm=order, max_len=ts.numel(), num_tokens=ts.numel(), cache={}, base_max_len=-1, token_slots=ts,
        grouping=(order, bounds),
    )
