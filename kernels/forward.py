"""Forward launchers: ``lora_shrink`` (x -> h) and ``lora_expand`` (y += scale * h @ B^T), both segment families.

Same signatures and semantics as ``fast_multilora.reference`` except dropout: the reference takes a ``keep=`` mask,
these take a Philox ``seed`` (``None`` = no dropout; the mask is ``kernels.dropout.keep_block`` on physical rows, so
backward kernels can regenerate it, or read the packed copy ``keep_out=`` stores). ``segs.perm is None`` picks the
SGEMM family (``sgemm.py``), otherwise the chunked SGMV family (``sgmv.py``).

Block sizes are data, not autotuned: rows of ``kernels/configs/<target>.json`` picked by ``configs.block_config``
(one row per size bucket, the first whose ``max_width`` covers the op's ``N`` wins), then two fixed rules (4-byte
activations halve ``BLOCK_K``; stages, then ``BLOCK_K``, shrink until the pipelined tiles fit ``SMEM_BUDGET``).
GPU rows target Hopper (H100/H200: 228 KB shared memory, 132 SMs):

* shrink, memory-bound: ``BLOCK_N`` covers the whole ``stack*rank`` up to 128 so x is read once; ``BLOCK_S=64`` rows
  x ``BLOCK_K=256`` (32 KB bf16 per stage) with 3 stages keeps ~96 KB of x in flight per SM; at S=8192, 8 segments
  of 1024 rows this is 128 programs, one wave on 132 SMs. Wider ranks take ``BLOCK_K=128`` so the weight tile fits.
* expand: K is the rank (one ``BLOCK_R`` step up to 64), ``BLOCK_N=128``: y tiles of 64x128 (16 KB bf16) read,
  added to in fp32 and written; many small programs, several resident per SM hide the latency.
* interpreter (``TRITON_INTERPRET=1``, CPU tests): small blocks so ragged edges, several K steps, N-tiles and rank
  steps are all exercised while the Python-level interpreter stays fast.
* rows per program shrink below ``BLOCK_S`` (to >= 16, tl.dot's minimum) when segments are short: SGEMM by the
  longest segment, chunked SGMV by the mean segment length (host ints only, no sync).

h is float32 ``[S, stack_num*max_rank]`` (float64 for float64 x). Only the entries the contract defines are
written (rows of adapter tokens, columns ``< stack*rank``); when ``out`` is not given, the rest is uninitialised.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from .configs import INTERPRETER, block_config, target_for
from .dropout import check_keep_bits, check_seed
from .launch import CHECK_KEYS, Bound, cdiv, checked, launch, mark_checked, next_power_of_2
from .segments import AdapterTable, Segments, expert_args, packed_b, weight_args
from .sgemm import sgemm_expand_kernel, sgemm_shrink_kernel
from .sgmv import chunk_table, sgmv_expand_kernel, sgmv_shrink_kernel

# a mix of at least this many segments (no dropout, stack*rank <= 32) takes the "shrink_many" rows
SHRINK_MANY_SEGMENTS = 32
SMEM_BUDGET = 144 * 1024  # bytes of pipelined shrink tiles; leaves headroom under Hopper's 228 KB (A100: 164 KB)
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_TARGET = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "gpu"  # as Triton decides, at import


def _target() -> str:
    return _TARGET


def _config_target(device) -> str:
    """The block-size file (``kernels/configs/<target>.json``) for a launch on ``device``."""
    return INTERPRETER if _target() == "interpreter" else target_for(device, interpret=False)


def _pow2_clamp(n: int, lo: int, hi: int) -> int:
    """``next_power_of_2(n)`` clamped to ``[lo, hi]`` (tl.dot needs every dim >= 16)."""
    return max(lo, min(hi, next_power_of_2(max(n, 1))))


def _rows_block(segs: Segments, cap: int) -> int:
    """Rows per program: the table's ``cap``, smaller when segments are short (decode-like batches)."""
    if segs.perm is None:
        typical = segs.max_len
    else:
        typical = cdiv(segs.perm.numel(), max(segs.num_segments, 1))
    return _pow2_clamp(typical, 16, cap)


def _shrink_blocks(segs: Segments, width: int, x: torch.Tensor, A_cat: torch.Tensor, dropout: bool = False,
                   stack_num: int = 1, store_mask: bool = False):
    """``(BLOCK_S, BLOCK_N, BLOCK_K, num_warps, num_stages)`` for the shrink: the row of op ``shrink`` (or
    ``shrink_dropout``, ``shrink_dropout_store``; ``shrink_many`` for many-adapter mixes) in the target's block-size
    file (``configs.block_config``), then the rules."""
    target = _target()
    cfg_target = _config_target(x.device)
    op = "shrink_dropout_store" if store_mask else "shrink_dropout" if dropout else "shrink"
    if not dropout and width <= 32 and segs.num_segments >= SHRINK_MANY_SEGMENTS:
        op = "shrink_many"
    cfg = block_config(op, width=width, family="sgemm" if segs.perm is None else "chunked", target=cfg_target)
    S_BLK, N_CAP, BLOCK_K = cfg["BLOCK_S"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    num_warps, num_stages = cfg["num_warps"], cfg["num_stages"]
    BLOCK_N = _pow2_clamp(width, 16, N_CAP)
    BLOCK_S = _rows_block(segs, S_BLK)
    if target == "gpu":
        if dropout and stack_num > 1:
            BLOCK_K = min(BLOCK_K, 64)  # a mask per slice: 128-wide K tiles spill registers (sm_90, 8 warps, q/k/v)
        BLOCK_K = max(16, BLOCK_K * 2 // x.element_size())  # same bytes of x per stage
        w_size = A_cat.element_size()  # weight tiles are staged in their own dtype, cast after the load
        while num_stages * BLOCK_K * (BLOCK_S * x.element_size() + BLOCK_N * w_size) > SMEM_BUDGET:
            if num_stages > 2:
                num_stages -= 1
            elif BLOCK_K > 16:
                BLOCK_K //= 2
            else:
                break
    return BLOCK_S, BLOCK_N, BLOCK_K, num_warps, num_stages


def _dot_precision(dtype: torch.dtype):
    # fp32/fp64: ieee, so results match the reference (tf32 would not); 16-bit: the default (tensor cores)
    return "ieee" if dtype in (torch.float32, torch.float64) else None


def _check_2d(name: str, t, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the activations' device)")
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got {t.dtype}")


def _weights(name: str, w, device, stack_num: int) -> tuple:
    """``segments.weight_args`` of a launcher's weight, its pointer tensor checked as any 2-D operand (a
    ``SlotWeights``' base: one weight)."""
    t, w_offs = weight_args(name, w, device, stack_num)
    _check_2d(name if w_offs is None else f"{name}.base", t, device)
    return t, w_offs


def _check_layout(segs: Segments, table: AdapterTable, S: int, device, stack_num: int) -> None:
    if not isinstance(stack_num, int) or stack_num < 1:
        raise ValueError(f"stack_num must be a positive int, got {stack_num!r}")
    if segs.num_tokens != S:
        raise ValueError(f"segs covers {segs.num_tokens} tokens but the activations have {S} rows")
    if checked(segs, table, (CHECK_KEYS[0], device)):  # the checks below run once per (segments, kind of table)
        return
    tensors = {"segs.indptr": segs.indptr, "segs.slot": segs.slot, "table.ranks": table.ranks,
               "table.offsets": table.offsets}
    if segs.perm is not None:
        tensors["segs.perm"] = segs.perm
    for name, t in tensors.items():
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device} (the activations' device)")
    for name, t in (("table.scales", table.scales), ("table.dropout", table.dropout)):
        if t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"{name} must be float32 on {device}, got {t.dtype} on {t.device}")
    mark_checked(segs, table, (CHECK_KEYS[0], device))


class Replay:
    """A launcher call recorded for replay (``record=`` of :func:`lora_shrink` / :func:`lora_expand`): the rows it
    filled and its launch (``launch.Bound``), every argument fixed but the call's tensors. ``replay(a, w, out,
    bias)``: ``a`` is ``x`` (shrink) or ``h`` (expand), ``w`` the weight's pointer tensor (what ``weight_args``
    gave: the ``A_cat`` / ``B_cat`` itself, or a ``SlotWeights``' base, whose offsets the record holds), ``out``
    the output, ``bias`` the expand's. Valid for tensors of the recorded shapes, strides, dtypes and device, the
    same layout and table (held), and weights at the recorded addresses: the caller's plan key checks that."""

    __slots__ = ("bound", "fill", "bias_arg")

    def __init__(self, bound: Optional[Bound], fill: bool = False, bias_arg: bool = False):
        self.bound, self.fill, self.bias_arg = bound, fill, bias_arg

    def __call__(self, a, w, out, bias=None):
        if self.fill:
            _fill_rows(out, bias)
        if self.bound is not None:
            self.bound(a, w, out, bias if self.bias_arg else out)
        return out


def _run(kernel, grid, args, meta, record: Optional[list], **replay) -> None:
    """Launch; with ``record``, through a ``Bound`` whose holes are the leading four arguments (activations,
    weight, output, mask or bias), appended as a :class:`Replay`."""
    if record is None:
        launch(kernel, grid, args, meta)
        return
    bound = Bound(kernel, grid, args, meta, 4)
    bound(*args[:4])
    record.append(Replay(bound, **replay))


def lora_shrink(x, A_cat, segs: Segments, table: AdapterTable, *, stack_num: int = 1, seed=None,
                out: Optional[torch.Tensor] = None, keep_out: Optional[torch.Tensor] = None,
                record: Optional[list] = None) -> torch.Tensor:
    """``h[S, stack_num*max_rank]`` (float32; float64 for float64 ``x``): ``h[t] = dropout(x[t]) @ A_a^T``.

    Dropout runs when ``seed`` is given (a host int, or a one-element int32 tensor on x's device that the kernels
    read: ``dropout.check_seed``) and ``table.has_dropout``; ``out`` (same shape and dtype) is filled in place.
    Only rows of adapter tokens and their columns ``< stack_num*rank`` are written.
    ``keep_out`` (``dropout.keep_bits_buffer(x)``, ``stack_num == 1``): under dropout, the drawn mask is stored
    there packed, for ``lora_shrink_bwd(..., keep=keep_out)``; rows of adapter tokens only.
    ``record`` (a list; calls without dropout): the call is appended as a :class:`Replay`.
    """
    _check_2d("x", x, getattr(x, "device", None))
    device = x.device
    A, w_offs = _weights("A_cat", A_cat, device, stack_num)
    slotted = w_offs is not None
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"x must be one of {_ACTIVATION_DTYPES}, got {x.dtype}")
    S, K = x.shape
    _check_layout(segs, table, S, device, stack_num)
    if tuple(A_cat.shape) != (stack_num * table.total_rank, K):
        raise ValueError(f"A_cat must be [stack_num*total_rank, K] = [{stack_num * table.total_rank}, {K}], "
                         f"got {list(A_cat.shape)}")
    check_seed("lora_shrink", seed, device, stack_num)
    if keep_out is not None:
        check_keep_bits("lora_shrink", keep_out, x, stack_num)
    if x.dtype == torch.float64 and segs.perm is not None and device.type == "cuda":
        # Triton 3.6 fails in ConvertTritonGPUToLLVM on the gathered fp64 dot (measured on H200); float64 exists
        # for gradcheck, which runs on CPU (interpreter) or with the SGEMM family
        raise NotImplementedError("float64 activations with the chunked (gathered) family do not compile for the GPU; "
                                  "use float32, or family='sgemm' (patch(..., family='sgemm'))")
    h_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    width = stack_num * table.max_rank
    if out is None:
        out = torch.empty(S, width, dtype=h_dtype, device=device)
    else:
        _check_2d("out", out, device)
        if out.shape != (S, width) or out.dtype != h_dtype:
            raise ValueError(f"out must be {h_dtype} [{S}, {width}], got {out.dtype} {list(out.shape)}")
    has_dropout = seed is not None and table.has_dropout
    if record is not None and (has_dropout or keep_out is not None):
        raise ValueError("lora_shrink: a call under dropout cannot be recorded (a replay would redraw its mask)")
    if S == 0 or width == 0 or segs.num_segments == 0 or segs.max_len == 0:
        if record is not None:
            record.append(Replay(None))
        return out

    store_mask = has_dropout and keep_out is not None
    BLOCK_S, BLOCK_N, BLOCK_K, num_warps, num_stages = _shrink_blocks(segs, width, x, A, has_dropout, stack_num,
                                                                      store_mask)
    common = (*A_cat.stride(), *out.stride(), keep_out.stride(0) if store_mask else 0)
    keep_arg = keep_out if store_mask else out
    meta = dict(STACK=stack_num, HAS_DROPOUT=has_dropout, STORE_MASK=store_mask, EVEN_K=K % BLOCK_K == 0,
                DOT_PRECISION=_dot_precision(x.dtype), W_OFFS=slotted, BLOCK_N=BLOCK_N,
                BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages)
    seed = seed if has_dropout else 0
    w_offs = w_offs if slotted else table.offsets  # unread without W_OFFS
    if segs.perm is None:
        grid = (segs.num_segments, cdiv(segs.max_len, BLOCK_S), cdiv(width, BLOCK_N))
        _run(sgemm_shrink_kernel, grid, (
            x, A, out, keep_arg, segs.indptr, segs.slot, table.ranks, table.offsets, w_offs, table.dropout, seed,
            K, *x.stride(), *common), dict(meta, BLOCK_S=BLOCK_S), record)
    else:
        chunks = chunk_table(segs, BLOCK_S)
        grid = (chunks.shape[0], cdiv(width, BLOCK_N))
        _run(sgmv_shrink_kernel, grid, (
            x, A, out, keep_arg, chunks, segs.slot, segs.perm, table.ranks, table.offsets, w_offs,
            table.dropout,
            seed, *x.stride(), *common), dict(K=K, N=width, BLOCK_M=BLOCK_S, **meta), record)
    return out


def lora_expand(h, B_cat, segs: Segments, table: AdapterTable, y, *, stack_num: int = 1, slice_idx: int = 0,
                accumulate: bool = True, bias: Optional[torch.Tensor] = None, record: Optional[list] = None):
    """In place ``y[t] += scale_a * h[t, slice] @ B_a^T``; returns ``y``. Rows of base tokens are untouched.

    ``accumulate=False`` writes instead of adding: ``y[t] = scale_a * h[t, slice] @ B_a^T + bias`` for adapter
    tokens and ``y[t] = bias`` (zero without ``bias``, a ``[N]`` vector) for the others, so ``y``'s prior content is
    never read -- the buffer a base GEMM then accumulates into (``y.addmm_(x, W.t())``).
    The scale is applied and the sum taken in fp32 (fp64 when ``y`` or ``h`` is float64); y keeps its dtype.
    ``record`` (a list): the call is appended as a :class:`Replay`.
    """
    _check_2d("y", y, getattr(y, "device", None))
    device = y.device
    _check_2d("h", h, device)
    if y.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"y must be one of {_ACTIVATION_DTYPES}, got {y.dtype}")
    S, N = y.shape
    packed = packed_b("B_cat", B_cat, N, table.total_rank, device)
    B, w_offs = (B_cat, None) if packed else _weights("B_cat", B_cat, device, 1)
    _check_layout(segs, table, S, device, stack_num)
    if not isinstance(slice_idx, int) or not 0 <= slice_idx < stack_num:
        raise ValueError(f"slice_idx must be an int in [0, stack_num={stack_num}), got {slice_idx!r}")
    if h.shape != (S, stack_num * table.max_rank):
        raise ValueError(f"h must be [S, stack_num*max_rank] = [{S}, {stack_num * table.max_rank}], "
                         f"got {list(h.shape)}")
    if not packed and tuple(B_cat.shape) != (N, table.total_rank):
        raise ValueError(f"B_cat must be [N, total_rank] = [{N}, {table.total_rank}], got {list(B_cat.shape)}")
    if bias is not None:
        if accumulate:
            raise ValueError("bias is only taken with accumulate=False")
        if not isinstance(bias, torch.Tensor) or bias.shape != (N,) or bias.device != device:
            raise ValueError(f"bias must be a [{N}] tensor on {device}, got {getattr(bias, 'shape', type(bias))}")
    _expand_launch(h, B_cat, B, w_offs, packed, segs, table, y, slice_idx=slice_idx, accumulate=accumulate,
                   bias=bias, record=record)
    return y


def _fill_rows(y: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
    if bias is None:
        y.zero_()
    else:
        y.copy_(bias.to(y.dtype).expand_as(y))


def _expand_launch(h, B_cat, B, w_offs, packed: bool, segs: Segments, table: AdapterTable, y, *, slice_idx: int,
                   accumulate: bool, bias, record: Optional[list] = None) -> None:
    """The expand's launch; ``B``, ``w_offs``: ``B_cat``'s pointer tensor and per-slot offsets (``_weights``);
    ``packed``: ``B_cat`` is the store's packed block (``segments.packed_b``; an experts table's in PEFT's layout)."""
    S, N = y.shape
    experts, spe = expert_args("lora_expand", table)
    if not packed:  # the experts' addressing is the packed block's only
        experts, spe = 1, 1
    live = not (S == 0 or N == 0 or table.max_rank == 0 or segs.num_segments == 0 or segs.max_len == 0)
    write_all = not accumulate and segs.covers_all_rows  # the SGEMM kernel defines base rows itself
    if not accumulate and not write_all:
        _fill_rows(y, bias)  # rows no segment reaches; then the kernel writes (or adds to the bias of) adapter rows
    if not live:
        if write_all:
            _fill_rows(y, bias)
        if record is not None:
            record.append(Replay(None, fill=not accumulate))
        return
    fill = not accumulate and not write_all
    fp64 = torch.float64 in (y.dtype, h.dtype)
    cfg_target = _config_target(y.device)
    cfg = block_config("expand_add" if accumulate else "expand_write", width=N, target=cfg_target)
    S_BLK, N_CAP, R_CAP, n_tiles = cfg["BLOCK_S"], cfg["BLOCK_N"], cfg["BLOCK_R"], cfg["N_TILES"]
    num_warps, num_stages = cfg["num_warps"], cfg["num_stages"]
    BLOCK_N = _pow2_clamp(N, 16, N_CAP)
    BLOCK_R = _pow2_clamp(table.max_rank, 16, R_CAP)
    BLOCK_S = _rows_block(segs, S_BLK)
    common = (*h.stride(), *((0, 1) if packed else B_cat.stride()), *y.stride())  # a packed B's: unread
    slotted = w_offs is not None
    w_offs = w_offs if slotted else table.offsets  # unread without W_OFFS
    meta = dict(FP64=fp64, DOT_PRECISION=_dot_precision(torch.float64 if fp64 else y.dtype), W_OFFS=slotted,
                B_PACKED=packed, EXPERTS=experts,
                # after a bias fill the kernel adds to it; after a zero fill (or defining every row) it writes
                ACCUMULATE=accumulate or (not write_all and bias is not None), HAS_BIAS=write_all and bias is not None,
                BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, num_warps=num_warps, num_stages=num_stages)
    bias_arg = bias if meta["HAS_BIAS"] else y
    if segs.perm is None:
        rows = max(segs.max_len, segs.base_max_len) if write_all else segs.max_len
        tiles_n = cdiv(N, BLOCK_N)
        # several N-tiles per program only when the grid has tiles to spare (small batches keep every tile apart)
        tiles = segs.num_segments * cdiv(rows, BLOCK_S) * tiles_n
        n_tiles = min(n_tiles, tiles_n) if tiles >= block_config(
            "expand_loop", target=cfg_target)["min_tiles"] else 1
        grid = (segs.num_segments, cdiv(rows, BLOCK_S), cdiv(N, BLOCK_N * n_tiles))
        _run(sgemm_expand_kernel, grid, (
            h, B, y, bias_arg, segs.indptr, segs.slot, table.ranks, table.offsets, w_offs, table.scales, slice_idx,
            spe, N, *common), dict(meta, BLOCK_S=BLOCK_S, N_TILES=n_tiles), record, fill=fill,
            bias_arg=meta["HAS_BIAS"])
    else:
        chunks = chunk_table(segs, BLOCK_S)
        grid = (chunks.shape[0], cdiv(N, BLOCK_N))
        _run(sgmv_expand_kernel, grid, (
            h, B, y, bias_arg, chunks, segs.slot, segs.perm, table.ranks, table.offsets, w_offs,
            table.scales, slice_idx, spe, *common),
            dict(N=N, MAX_RANK=table.max_rank, BLOCK_M=BLOCK_S, **meta), record, fill=fill, bias_arg=meta["HAS_BIAS"])
