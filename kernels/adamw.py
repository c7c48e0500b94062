"""AdamW, gradient norms and gradient scaling over slot-stacked adapter storage, one launch whatever the adapter count.

Many adapters' weights live in one flat 1-D buffer per (dtype, device), an *arena*: blocks of contiguous elements,
each owned by one adapter; the gradient, ``exp_avg`` and ``exp_avg_sq`` are buffers of the same layout. A
:class:`ChunkTable` cuts the blocks into chunks of at most ``CHUNK`` elements, sorted by adapter; each kernel runs one
program per chunk and reads the per-adapter values (hyperparameters, step, active flag, factor) from device tensors,
so the host cost of an optimizer step does not grow with the number of adapters or blocks, and the launches can be
captured in a CUDA graph. Elements outside every block, and (AdamW) those of inactive adapters, are never accessed.
The AdamW step can instead run over a list of chunks (:func:`adapter_chunks`: those of the adapters an optimizer
steps), so a step of a few adapters of a large registry launches what those few hold, not a program per chunk of all.

The AdamW update is ``torch.optim.AdamW``'s (``amsgrad=False, maximize=False``), in torch's operation order: the
per-adapter scalars (``1 - lr*wd``, ``1 - beta``, ``lr / (1 - beta1^t)``, ``sqrt(1 - beta2^t)``) in float64 and
rounded to float32, as torch computes them in Python floats, once per step for all adapters (``adamw_scalars_``, which
also counts the step); elementwise float32 math with FMAs exactly where torch's
kernels have one (``lerp``, ``addcmul``) and none elsewhere (``enable_fp_fusion=False``), so a float32 arena gets
torch's result to the last bit or so. 16-bit arenas keep every intermediate in float32 and round once as they store
(as torch's ``fused=True`` does; the ``foreach`` and single-tensor paths round after each op).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import launch, next_power_of_2
from .segments import to_device

# One chunk is one program's tile: 1024 elements at 4 warps, 8 per thread (one 16-byte vector of bfloat16). Measured
# on an H200 (benchmarks/tune_kernels.py --parts adamw: the scale step's arena at 64 adapters, 294M bf16 elements,
# aligned): 1024 / 4 warps at 94% of the copy bandwidth; 1024 / 8, 2048 / 4 and 2048 / 8 at 78-87%; without the
# alignment hint 1024 / 4 ran at 72%. The table costs 16 bytes per chunk (0.4% of an fp32 arena); a block smaller
# than a chunk wastes lanes of one program, not bandwidth.
CHUNK = 1024
# The widest alignment the kernels are told of (elements): every chunk's start and length a multiple of it lets Triton
# issue 16-byte vector loads and stores (8 bfloat16 elements); without the hint, chunk starts and lengths read from
# the table are of unknown alignment and every access is a 2- or 4-byte one.
MAX_ALIGN = 16

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACTIVE_DTYPES = (torch.bool, torch.int8, torch.uint8, torch.int32, torch.int64)


class ChunkTable(NamedTuple):
    """The arena's blocks cut into chunks, sorted by adapter then position (all tensors on the arena's device).

    ``start`` int64 ``[C]`` first element of each chunk; ``length`` int32 ``[C]`` its element count (1..``chunk``);
    ``adapter`` int32 ``[C]`` its owner; ``adapter_ptr`` int32 ``[n_adapters + 1]``: adapter ``a``'s chunks are
    ``adapter_ptr[a] .. adapter_ptr[a+1]``. Host ints: ``n_adapters``, ``numel`` (the arena's size), ``chunk`` (the
    longest chunk allowed; the kernels' tile), ``max_chunks`` (most chunks of one adapter), ``covered`` (elements in
    all blocks), ``align`` (the largest power of two up to ``MAX_ALIGN`` dividing every chunk's start and length: the
    kernels' alignment hint)."""

    start: torch.Tensor
    length: torch.Tensor
    adapter: torch.Tensor
    adapter_ptr: torch.Tensor
    n_adapters: int
    numel: int
    chunk: int
    max_chunks: int
    covered: int
    align: int


# A host list of at most this many blocks is cut in plain Python (:func:`_chunk_table_small`): the vectorised cut's
# twenty-odd host tensor ops cost more than the loop for the few blocks of an adapter that came or changed (the
# optimizer's table edits), while the result is the same.
SMALL_BLOCKS = 64


def _chunk_table_small(blocks, n_adapters: int, numel: int, device, chunk: int) -> "ChunkTable":
    """:func:`chunk_table` of a short host list of blocks, cut in Python (the same table, the same errors)."""
    rows = [tuple(map(int, x)) for x in blocks]
    rows = [x for x in rows if x[1] != 0]
    for x in rows:
        start, size, adapter = x
        if start < 0 or size < 0 or start + size > numel or adapter < 0 or adapter >= n_adapters:
            raise ValueError(f"chunk_table: block {x} is outside the arena [0, {numel}) or its adapter outside "
                             f"[0, {n_adapters})")
    by_pos = sorted(rows, key=lambda x: x[0])
    for x, y in zip(by_pos, by_pos[1:], strict=False):
        if y[0] < x[0] + x[1]:
            raise ValueError(f"chunk_table: blocks {x} and {y} overlap")
    starts, lengths, owners, counts, covered = [], [], [], [0] * n_adapters, 0
    for start, size, adapter in sorted(rows, key=lambda x: (x[2], x[0])):  # by adapter, then position
        for off in range(0, size, chunk):
            starts.append(start + off)
            lengths.append(min(chunk, size - off))
            owners.append(adapter)
        counts[adapter] += -(-size // chunk)
        covered += size
    if len(starts) >= 2**31:  # pragma: no cover - (a short list of blocks)
        raise ValueError(f"chunk_table: {len(starts)} chunks do not fit int32 indices; use a larger chunk")
    g = math.gcd(*starts, *lengths)
    align = MAX_ALIGN
    while align > 1 and g % align != 0:
        align //= 2
    ptr = list(itertools.accumulate(counts, initial=0))
    return ChunkTable(
        start=to_device(torch.tensor(starts, dtype=torch.int64), device),
        length=to_device(torch.tensor(lengths, dtype=torch.int32), device),
        adapter=to_device(torch.tensor(owners, dtype=torch.int32), device),
        adapter_ptr=to_device(torch.tensor(ptr, dtype=torch.int32), device),
        n_adapters=n_adapters, numel=numel, chunk=chunk, max_chunks=max(counts, default=0), covered=covered,
        align=align)


def chunk_table(blocks, n_adapters: int, numel: int, device, chunk: int = CHUNK) -> ChunkTable:
    """The :class:`ChunkTable` of ``blocks``, a host list of ``(start, numel, adapter)`` (or an int tensor
    ``[n, 3]`` of them): any sizes (empty blocks are
    skipped), any order, no overlaps, not necessarily covering the arena ``[0, numel)``. Built on the host (vectorised)
    and copied to ``device`` once."""
    if not (isinstance(chunk, int) and chunk >= 1 and isinstance(n_adapters, int) and n_adapters >= 0
            and isinstance(numel, int) and numel >= 0):
        raise ValueError(f"chunk_table: chunk={chunk!r}, n_adapters={n_adapters!r}, numel={numel!r} must be ints "
                         "(chunk >= 1, the others >= 0)")
    if not torch.is_tensor(blocks) and len(blocks) <= SMALL_BLOCKS:
        return _chunk_table_small(blocks, n_adapters, numel, device, chunk)
    b = blocks.to(torch.int64).cpu() if torch.is_tensor(blocks) else \
        torch.tensor([tuple(x) for x in blocks], dtype=torch.int64)
    b = b.reshape(-1, 3)
    b = b[b[:, 1] != 0]
    start, size, adapter = b.unbind(1)
    bad = (start < 0) | (size < 0) | (start + size > numel) | (adapter < 0) | (adapter >= n_adapters)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"chunk_table: block {tuple(b[i].tolist())} is outside the arena [0, {numel}) or its adapter "
                         f"outside [0, {n_adapters})")
    by_pos = torch.argsort(start)
    overlap = start[by_pos][1:] < (start + size)[by_pos][:-1]
    if bool(overlap.any()):
        i = int(overlap.nonzero()[0, 0])
        raise ValueError(f"chunk_table: blocks {tuple(b[by_pos[i]].tolist())} and {tuple(b[by_pos[i + 1]].tolist())} "
                         "overlap")
    order = by_pos[torch.argsort(adapter[by_pos], stable=True)]  # by adapter, then position
    start, size, adapter = start[order], size[order], adapter[order]
    n_c = (size + chunk - 1) // chunk
    C = int(n_c.sum())
    blk = torch.repeat_interleave(torch.arange(n_c.numel()), n_c, output_size=C)
    offset = (torch.arange(C) - (torch.cumsum(n_c, 0) - n_c)[blk]) * chunk  # the chunk's offset in its block
    per_adapter = torch.bincount(adapter[blk], minlength=n_adapters)
    ptr = torch.zeros(n_adapters + 1, dtype=torch.int64)
    ptr[1:] = torch.cumsum(per_adapter, 0)
    if C >= 2**31:
        raise ValueError(f"chunk_table: {C} chunks do not fit int32 indices; use a larger chunk")
    c_start, c_length = start[blk] + offset, (size[blk] - offset).clamp(max=chunk)
    align = MAX_ALIGN
    while align > 1 and bool(((c_start % align != 0) | (c_length % align != 0)).any()):
        align //= 2
    return ChunkTable(
        start=to_device(c_start, device),
        length=to_device(c_length.to(torch.int32), device),
        adapter=to_device(adapter[blk].to(torch.int32), device),
        adapter_ptr=to_device(ptr.to(torch.int32), device),
        n_adapters=n_adapters, numel=numel, chunk=chunk,
        max_chunks=int(per_adapter.max()) if n_adapters else 0, covered=int(size.sum()), align=align)


# ----------------------------------------------------------------------------------------------------------------
# Kernels: one program per chunk (the finish kernel: one per adapter)
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _f32(x):
    """``x`` in float32; bfloat16 through its bits (Triton 3.9's interpreter converts bfloat16 subnormals wrongly)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest even in ``dtype``; bfloat16 through its bits (Triton 3.9's interpreter
    truncates float32 -> bfloat16 casts; the GPU's cvt.rn gives these bits), NaN kept NaN."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x == x, bits, 0x7FC0).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _pow(b, t):
    """``b ** t`` in float64 for ``0 <= b < 1``, ``t >= 1`` (``b = 0``: 0, without taking log2(0))."""
    return tl.where(b == 0.0, 0.0, tl.exp2(t * tl.log2(tl.where(b == 0.0, 1.0, b))))


@triton.jit
def _adamw_scalars_kernel(hyper, step, active, scalars, n_adapters, BLOCK_A: tl.constexpr):
    """step[a] += 1 for each active adapter a (in place), then scalars[a] = its float32 scalars of this step
    (:func:`adamw_scalars_`) from (lr, b1, b2, eps, wd) = hyper[a] and t = step[a]."""
    o_a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    m_a = o_a < n_adapters
    on = tl.load(active + o_a, mask=m_a, other=0) != 0
    t = tl.load(step + o_a, mask=m_a, other=0.0) + tl.where(on, 1.0, 0.0)
    tl.store(step + o_a, t, mask=m_a & on)
    t = tl.maximum(t.to(tl.float64), 1.0)  # (a never-active adapter's count is 0: its scalars are not read)
    lr = tl.load(hyper + o_a * 5, mask=m_a, other=0.0).to(tl.float64)
    beta1 = tl.load(hyper + o_a * 5 + 1, mask=m_a, other=0.0).to(tl.float64)
    beta2 = tl.load(hyper + o_a * 5 + 2, mask=m_a, other=0.0).to(tl.float64)
    wd = tl.load(hyper + o_a * 5 + 4, mask=m_a, other=0.0).to(tl.float64)
    p_s = scalars + o_a * 8
    tl.store(p_s, (1.0 - lr * wd).to(tl.float32), mask=m_a)
    tl.store(p_s + 1, (1.0 - beta1).to(tl.float32), mask=m_a)
    tl.store(p_s + 2, (1.0 - beta2).to(tl.float32), mask=m_a)
    tl.store(p_s + 3, beta2.to(tl.float32), mask=m_a)
    tl.store(p_s + 4, (-lr / (1.0 - _pow(beta1, t))).to(tl.float32), mask=m_a)
    tl.store(p_s + 5, tl.sqrt(1.0 - _pow(beta2, t)).to(tl.float32), mask=m_a)
    tl.store(p_s + 6, tl.load(hyper + o_a * 5 + 3, mask=m_a, other=0.0), mask=m_a)
    tl.store(p_s + 7, 0.0, mask=m_a)


@triton.jit
def _adamw_kernel(
    param, grad, exp_avg, exp_avg_sq, c_start, c_length, c_adapter, scalars, active, c_index,
    BLOCK: tl.constexpr, ALIGN: tl.constexpr, INDEXED: tl.constexpr,
):
    """p = p*(1 - lr*wd) - lr/(1 - b1^t) * m / (sqrt(v)/sqrt(1 - b2^t) + eps), m = lerp(m, g, 1 - b1),
    v = b2*v + (1 - b2)*g*g on chunk c of adapter a = c_adapter[c] when active[a], with adapter a's scalars[a];
    c = c_index[program] (``INDEXED``: the chunks of some adapters) or the program's own index."""
    if INDEXED:
        i_c = tl.load(c_index + tl.program_id(0)).to(tl.int64)
    else:
        i_c = tl.program_id(0).to(tl.int64)
    a = tl.load(c_adapter + i_c).to(tl.int64)
    o_e = tl.arange(0, BLOCK)
    # an inactive adapter's chunk masks every access off (its elements are neither read nor written)
    m_e = o_e < tl.where(tl.load(active + a) != 0, tl.multiple_of(tl.load(c_length + i_c), ALIGN), 0)
    o_x = tl.multiple_of(tl.load(c_start + i_c), ALIGN) + o_e  # [BLOCK] int64 arena offsets
    b_p = _f32(tl.load(param + o_x, mask=m_e))
    b_g = _f32(tl.load(grad + o_x, mask=m_e))
    b_m = _f32(tl.load(exp_avg + o_x, mask=m_e))
    b_v = _f32(tl.load(exp_avg_sq + o_x, mask=m_e))
    p_s = scalars + a * 8
    decay, w1, w2, b2 = tl.load(p_s), tl.load(p_s + 1), tl.load(p_s + 2), tl.load(p_s + 3)
    neg_step, bc2_sqrt, eps = tl.load(p_s + 4), tl.load(p_s + 5), tl.load(p_s + 6)
    # torch's lerp: fma(w, end - self, self) for |w| < 0.5, else fma(w - 1, end - self, end)
    small = w1 < 0.5
    b_p = b_p * decay
    b_m = tl.fma(tl.where(small, w1, w1 - 1.0), b_g - b_m, tl.where(small, b_m, b_g))  # exp_avg.lerp_(grad, w1)
    b_v = tl.fma(w2 * b_g, b_g, b_v * b2)  # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = tl.div_rn(tl.sqrt_rn(b_v), bc2_sqrt) + eps
    b_p = b_p + tl.div_rn(neg_step * b_m, denom)  # param.addcdiv_(exp_avg, denom, value=-step_size)
    tl.store(param + o_x, _rounded(b_p, param.dtype.element_ty), mask=m_e)
    tl.store(exp_avg + o_x, _rounded(b_m, exp_avg.dtype.element_ty), mask=m_e)
    tl.store(exp_avg_sq + o_x, _rounded(b_v, exp_avg_sq.dtype.element_ty), mask=m_e)


@triton.jit
def _sq_norm_partial_kernel(grad, c_start, c_length, partial, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """partial[c] = sum of g^2 over chunk c (float32)."""
    i_c = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BLOCK)
    m_e = o_e < tl.multiple_of(tl.load(c_length + i_c), ALIGN)
    b_g = _f32(tl.load(grad + tl.multiple_of(tl.load(c_start + i_c), ALIGN) + o_e, mask=m_e, other=0.0))
    tl.store(partial + i_c, tl.sum(b_g * b_g, 0))


@triton.jit
def _sq_norm_finish_kernel(partial, adapter_ptr, out, BLOCK_P: tl.constexpr):
    """out[a] = sum of partial[c] over adapter a's chunks, in a fixed order (BLOCK_P-wide columns, then a tree)."""
    i_a = tl.program_id(0)
    c0 = tl.load(adapter_ptr + i_a)
    c1 = tl.load(adapter_ptr + i_a + 1)
    b_acc = tl.zeros([BLOCK_P], dtype=tl.float32)
    for i in range(c0, c1, BLOCK_P):
        o_c = i + tl.arange(0, BLOCK_P)
        b_acc += tl.load(partial + o_c, mask=o_c < c1, other=0.0)
    tl.store(out + i_a, tl.sum(b_acc, 0))


@triton.jit
def _scale_kernel(grad, c_start, c_length, c_adapter, factors, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """g *= factors[a] on chunk c of adapter a = c_adapter[c] (float32 product, rounded once); a factor of 1 exits."""
    i_c = tl.program_id(0).to(tl.int64)
    f = tl.load(factors + tl.load(c_adapter + i_c))
    if f == 1.0:
        return
    o_e = tl.arange(0, BLOCK)
    m_e = o_e < tl.multiple_of(tl.load(c_length + i_c), ALIGN)
    p_g = grad + tl.multiple_of(tl.load(c_start + i_c), ALIGN) + o_e
    b_g = _f32(tl.load(p_g, mask=m_e))
    tl.store(p_g, _rounded(b_g * f, grad.dtype.element_ty), mask=m_e)


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _meta(table: ChunkTable) -> dict:
    BLOCK = next_power_of_2(table.chunk)
    # no FP contraction: the explicit tl.fma calls are where torch's kernels fuse, every other op rounds on its own
    return dict(BLOCK=BLOCK, ALIGN=table.align, num_warps=max(1, min(4, BLOCK // 256)), enable_fp_fusion=False)


def _check_arena(name: str, table: ChunkTable, tensors: dict):
    """Every arena buffer 1-D, contiguous, ``table.numel`` elements, one float dtype, on one device with the table."""
    if not isinstance(table, ChunkTable):
        raise ValueError(f"{name}: table must be a ChunkTable (kernels.adamw.chunk_table), got {type(table).__name__}")
    first = next(iter(tensors.values()))
    dev, dtype = getattr(first, "device", None), getattr(first, "dtype", None)
    for what, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"{name}: {what} must be 1-D and contiguous, got shape {tuple(t.shape)}, "
                             f"strides {t.stride()}")
        if t.numel() != table.numel:
            raise ValueError(f"{name}: {what} has {t.numel()} elements, the table's arena {table.numel}")
        if t.dtype != dtype or t.dtype not in _DTYPES:
            raise ValueError(f"{name}: {what} is {t.dtype}; the arena buffers must share one dtype of {_DTYPES}, "
                             f"the first is {dtype}")
        if t.device != dev:
            raise ValueError(f"{name}: {what} is on {t.device}, the first buffer on {dev}")
    if table.start.device != dev:
        raise ValueError(f"{name}: the table is on {table.start.device}, the arena on {dev}")
    return dev


def _check_vec(name: str, what: str, t, shape: tuple, dtypes: tuple, dev) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != shape or t.dtype not in dtypes or t.device != dev or not t.is_contiguous():
        raise ValueError(f"{name}: {what} must be a contiguous {'/'.join(str(d) for d in dtypes)} tensor of shape "
                         f"{shape} on {dev}, got {t.dtype} {tuple(t.shape)} on {t.device}"
                         f"{'' if t.is_contiguous() else ' (not contiguous)'}")


def adamw_scalars_(hyper, step, active) -> torch.Tensor:
    """One optimizer step's per-adapter scalars, one launch: ``step[a] += 1`` in place for each adapter with
    ``active[a] != 0`` (torch counts before it updates), then float32 ``[n_adapters, 8]`` = (1 - lr*wd, 1 - beta1,
    1 - beta2, beta2, -lr / (1 - beta1^t), sqrt(1 - beta2^t), eps, 0) with t the new count, computed in float64 and
    rounded to float32 (torch computes them in Python floats). ``hyper`` float32 ``[n_adapters, 5]`` = (lr, beta1,
    beta2, eps, weight_decay), ``step`` float32 ``[n_adapters]``, ``active`` ``[n_adapters]`` bool or integer, on one
    device. An inactive adapter's row is not meant to be read."""
    name = "adamw_scalars_"
    if not isinstance(step, torch.Tensor) or step.dim() != 1:
        raise ValueError(f"{name}: step must be a 1-D float32 tensor (one count per adapter), got "
                         f"{getattr(step, 'shape', type(step).__name__)}")
    n, dev = step.shape[0], step.device
    _check_vec(name, "hyper", hyper, (n, 5), (torch.float32,), dev)
    _check_vec(name, "step", step, (n,), (torch.float32,), dev)
    _check_vec(name, "active", active, (n,), _ACTIVE_DTYPES, dev)
    scalars = torch.empty((n, 8), dtype=torch.float32, device=dev)
    if n:
        BLOCK_A = max(16, min(1024, next_power_of_2(n)))
        launch(_adamw_scalars_kernel, (triton.cdiv(n, BLOCK_A),), (hyper, step, active, scalars, n),
               dict(BLOCK_A=BLOCK_A, num_warps=4))
    return scalars


def adamw_step_(param, grad, exp_avg, exp_avg_sq, table: ChunkTable, scalars, active, chunks=None) -> None:
    """In place, ``torch.optim.AdamW``'s step (``amsgrad=False, maximize=False``) on every chunk of an adapter ``a``
    with ``active[a] != 0``, one launch: ``scalars`` float32 ``[n_adapters, 8]`` this step's per-adapter scalars
    (:func:`adamw_scalars_`, once per optimizer step for all arenas), ``active`` ``[n_adapters]`` bool or integer; both
    on the arena's device. The four arena buffers share one dtype (float32, bfloat16 or float16). Elements of inactive
    adapters and outside every block are not accessed.

    ``chunks`` (optional, :func:`adapter_chunks`): int32 indices of the table's chunks to run, which must include
    every chunk of every active adapter -- one program each instead of one per chunk of the table, so a step of a
    few adapters of a large registry launches what those few hold (a program of an inactive adapter's chunk still
    exits without access)."""
    name = "adamw_step_"
    dev = _check_arena(name, table, dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq))
    n = table.n_adapters
    _check_vec(name, "scalars", scalars, (n, 8), (torch.float32,), dev)
    _check_vec(name, "active", active, (n,), _ACTIVE_DTYPES, dev)
    n_chunks = table.start.shape[0]
    if chunks is not None:
        if not isinstance(chunks, torch.Tensor) or chunks.dim() != 1:
            raise ValueError(f"{name}: chunks must be a 1-D torch.Tensor of chunk indices (adapter_chunks), got "
                             f"{type(chunks).__name__} {tuple(getattr(chunks, 'shape', ()))}")
        _check_vec(name, "chunks", chunks, (chunks.shape[0],), (torch.int32,), dev)
        n_chunks = chunks.shape[0]
    if n_chunks == 0:
        return
    launch(_adamw_kernel, (n_chunks,), (param, grad, exp_avg, exp_avg_sq, table.start, table.length, table.adapter,
                                        scalars, active, table.start if chunks is None else chunks),
           dict(_meta(table), INDEXED=chunks is not None))


def adapter_chunks(per_adapter, adapters) -> torch.Tensor:
    """Host int32 indices of the chunks of ``adapters`` (host indices, ascending) in a :class:`ChunkTable` whose
    adapter ``a`` has ``per_adapter[a]`` chunks (a host int tensor: the table's counts), for ``adamw_step_``'s
    ``chunks``; the table's chunks are sorted by adapter, so adapter ``a``'s run from the sum of the counts before
    it."""
    per_adapter = torch.as_tensor(per_adapter, dtype=torch.int64)
    pick = torch.as_tensor(adapters, dtype=torch.int64)
    counts = per_adapter[pick]
    first = (torch.cumsum(per_adapter, 0) - per_adapter)[pick]
    total = int(counts.sum())
    owner_first = torch.repeat_interleave(first - (torch.cumsum(counts, 0) - counts), counts, output_size=total)
    return (owner_first + torch.arange(total)).to(torch.int32)


def grad_sq_norms(grad, table: ChunkTable) -> torch.Tensor:
    """float32 ``[n_adapters]``: the sum of squares of each adapter's gradient elements (float32 accumulation; zero
    for an adapter without elements). Deterministic: per-chunk partial sums, then a fixed-order sum per adapter (two
    launches, no atomics)."""
    dev = _check_arena("grad_sq_norms", table, dict(grad=grad))
    out = torch.empty(table.n_adapters, dtype=torch.float32, device=dev)
    if table.n_adapters == 0:
        return out
    n_chunks = table.start.shape[0]
    partial = torch.empty(max(n_chunks, 1), dtype=torch.float32, device=dev)
    if n_chunks:
        launch(_sq_norm_partial_kernel, (n_chunks,), (grad, table.start, table.length, partial), _meta(table))
    BLOCK_P = max(16, min(1024, next_power_of_2(table.max_chunks)))
    launch(_sq_norm_finish_kernel, (table.n_adapters,), (partial, table.adapter_ptr, out),
           dict(BLOCK_P=BLOCK_P, num_warps=4 if BLOCK_P >= 512 else 1))
    return out


def scale_grads_(grad, table: ChunkTable, factors) -> None:
    """In place ``g *= factors[a]`` on every element of adapter ``a`` (float32 ``factors [n_adapters]`` on the
    arena's device; the product in float32, rounded once); chunks whose factor is exactly 1 are not accessed."""
    dev = _check_arena("scale_grads_", table, dict(grad=grad))
    _check_vec("scale_grads_", "factors", factors, (table.n_adapters,), (torch.float32,), dev)
    n_chunks = table.start.shape[0]
    if n_chunks == 0:
        return
    launch(_scale_kernel, (n_chunks,), (grad, table.start, table.length, table.adapter, factors), _meta(table))


__all__ = ["CHUNK", "MAX_ALIGN", "ChunkTable", "adamw_scalars_", "adamw_step_", "adapter_chunks", "chunk_table",
           "grad_sq_norms", "scale_grads_"]
