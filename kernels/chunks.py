"""Chunk tables: groups of consecutive logical positions cut into pieces of at most ``chunk`` positions.

Both the chunked forward (``sgmv``: one group per segment) and the backward launchers (one group per slot, base
rows first) spread a long group over many programs by cutting it into chunks. The table is built by one small
Triton kernel from the groups' boundaries -- one launch and no host sync, where the equivalent torch ops (cumsum,
searchsorted, gathers, ``where``) were about fifteen launches: that matters wherever the table cannot be cached
across calls (every custom-op call under ``torch.compile``, every replay of a captured CUDA graph).
:func:`chunk_tables` builds the tables of every power-of-two chunk length at once, in that one launch: what a
model's entry builds once per forward call for the backward launchers of all its layers (``backward.with_tables``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, launch, next_power_of_2


@triton.jit
def _chunk_table_kernel(
    bounds, info, cptr, n_groups, chunk, first_id, stride_il, stride_cl,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """info[l, c] = (first_id + g, start, end) for chunk c of group g (positions bounds[g] .. bounds[g+1] cut into
    pieces of ``chunk << l``, ascending), (-1, 0, 0) past the last chunk; cptr[l, g] = first chunk of group g.
    Table ``l`` is program column ``l`` (one column: ``chunk`` itself)."""
    i_p = tl.program_id(0)
    i_l = tl.program_id(1)
    chunk = chunk << i_l
    info += i_l.to(tl.int64) * stride_il
    cptr += i_l * stride_cl
    o_g = tl.arange(0, BLOCK_G)
    m_g = o_g < n_groups
    lo = tl.load(bounds + o_g, mask=m_g, other=0).to(tl.int32)  # [BLOCK_G]
    hi = tl.load(bounds + o_g + 1, mask=m_g, other=0).to(tl.int32)
    n_c = tl.where(m_g, (hi - lo + chunk - 1) // chunk, 0)
    last = tl.cumsum(n_c, 0)  # chunks of groups 0..g, inclusive
    first = last - n_c
    if i_p == 0:
        tl.store(cptr + o_g, first, mask=m_g)
        tl.store(cptr + n_groups, tl.sum(n_c, 0))
    o_c = i_p * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] chunk indices
    g = tl.sum(((last[None, :] <= o_c[:, None]) & m_g[None, :]).to(tl.int32), 1)  # group of each chunk
    valid = g < n_groups
    sel = o_g[None, :] == g[:, None]  # [BLOCK_C, BLOCK_G] one-hot of the chunk's group
    g_lo = tl.sum(tl.where(sel, lo[None, :], 0), 1)
    g_hi = tl.sum(tl.where(sel, hi[None, :], 0), 1)
    g_first = tl.sum(tl.where(sel, first[None, :], 0), 1)
    start = g_lo + (o_c - g_first) * chunk
    end = tl.minimum(start + chunk, g_hi)
    p_info = info + o_c.to(tl.int64) * 3  # the table has a row for every program's chunk
    tl.store(p_info, tl.where(valid, g + first_id, -1))
    tl.store(p_info + 1, tl.where(valid, start, 0))
    tl.store(p_info + 2, tl.where(valid, end, 0))


def chunk_table(bounds: torch.Tensor, chunk: int, capacity: int, first_id: int = 0) -> tuple:
    """``(info, cptr)`` of the groups ``bounds[g] .. bounds[g+1]`` (int32 or int64 ``[n_groups + 1]``, ascending
    logical positions): int32 ``info[capacity, 3]``, chunk ``c`` = ``(first_id + g, start, end)`` in ascending order
    of group then position, ``(-1, 0, 0)`` past the last chunk; int32 ``cptr[n_groups + 1]``, group ``g``'s chunks are
    ``cptr[g] .. cptr[g+1]``. ``capacity`` must bound the chunk count (``sum ceil(len_g / chunk)``): chunks past it
    are dropped, so callers size it as ``positions // chunk + n_groups``."""
    n_groups = bounds.numel() - 1
    if chunk < 1 or n_groups < 0 or capacity < 0:
        raise ValueError(f"chunk_table: chunk={chunk}, n_groups={n_groups}, capacity={capacity}")
    BLOCK_G = next_power_of_2(n_groups)
    BLOCK_C = max(16, min(1024, 4096 // BLOCK_G))  # [BLOCK_C, BLOCK_G] tiles of a few thousand elements
    n_prog = max(1, cdiv(capacity, BLOCK_C))
    info = torch.empty(n_prog * BLOCK_C, 3, dtype=torch.int32, device=bounds.device)
    cptr = torch.empty(n_groups + 1, dtype=torch.int32, device=bounds.device)
    launch(_chunk_table_kernel, (n_prog,), (bounds, info, cptr, n_groups, chunk, first_id, 0, 0),
           dict(BLOCK_G=BLOCK_G, BLOCK_C=BLOCK_C, num_warps=4))
    return info[:capacity], cptr


CHUNK0 = 16  # the shortest chunk of :func:`chunk_tables` (tl.dot's smallest tile: every launcher's rows >= 16)


def table_levels(n_pos: int) -> int:
    """How many chunk lengths ``CHUNK0 << l`` :func:`chunk_tables` builds for ``n_pos`` positions: up to the first
    longer than ``n_pos``, whose table (one chunk per non-empty group, capacity ``n_groups``) is every longer
    chunk's too."""
    return max(1, (n_pos // CHUNK0).bit_length() + 1)


def table_level(chunk: int, levels: int):
    """The level of chunk length ``chunk`` in tables of ``levels`` levels (:func:`chunk_tables`), or ``None`` when
    ``chunk`` is not ``CHUNK0`` times a power of two."""
    q, r = divmod(chunk, CHUNK0)
    if r or q < 1 or q & (q - 1):
        return None
    return min(q.bit_length() - 1, levels - 1)


def chunk_tables(bounds: torch.Tensor, n_pos: int, first_id: int = 0) -> tuple:
    """``(info, cptr)``: :func:`chunk_table` of the groups ``bounds`` (``n_pos = bounds[-1]`` positions, a host int)
    for every chunk length ``CHUNK0 << l``, ``l < table_levels(n_pos)``, in one launch: int32 ``info[levels, rows,
    3]`` and ``cptr[levels, n_groups + 1]``; ``info[l, :capacity]`` and ``cptr[l]`` equal ``chunk_table(bounds,
    CHUNK0 << l, capacity, first_id)`` for ``capacity <= rows`` (the callers' ``n_pos // chunk + n_groups`` is)."""
    n_groups = bounds.numel() - 1
    if n_groups < 0 or n_pos < 0:
        raise ValueError(f"chunk_tables: n_groups={n_groups}, n_pos={n_pos}")
    levels = table_levels(n_pos)
    BLOCK_G = next_power_of_2(n_groups)
    capacity = n_pos // CHUNK0 + n_groups  # the shortest chunk's (every level's table is that many rows)
    # (no wider than the capacity: a small layout's tables stay small -- a cached training routing holds them)
    BLOCK_C = max(16, min(1024, 4096 // BLOCK_G, next_power_of_2(capacity)))
    n_prog = max(1, cdiv(capacity, BLOCK_C))
    info = torch.empty(levels, n_prog * BLOCK_C, 3, dtype=torch.int32, device=bounds.device)
    cptr = torch.empty(levels, n_groups + 1, dtype=torch.int32, device=bounds.device)
    launch(_chunk_table_kernel, (n_prog, levels), (bounds, info, cptr, n_groups, CHUNK0, first_id, info.stride(0),
                                                   cptr.stride(0)),
           dict(BLOCK_G=BLOCK_G, BLOCK_C=BLOCK_C, num_warps=4))
    return info, cptr


__all__ = ["CHUNK0", "chunk_table", "chunk_tables", "table_level", "table_levels"]
