"""``kernels.chunks.chunk_table`` against a plain-Python cut of the groups (fresh random boundaries, empty groups,
no group, one-position chunks, several hundred groups, int32 and int64 boundaries, spare capacity)."""

import pytest
import torch
from fast_multilora.kernels.chunks import chunk_table


def _reference(bounds: list, chunk: int, capacity: int, first_id: int):
    info, cptr = [], []
    for g in range(len(bounds) - 1):
        cptr.append(len(info))
        for start in range(bounds[g], bounds[g + 1], chunk):
            info.append((first_id + g, start, min(start + chunk, bounds[g + 1])))
    cptr.append(len(info))
    assert len(info) <= capacity
    return info + [(-1, 0, 0)] * (capacity - len(info)), cptr


@pytest.mark.parametrize("n_groups,chunk,empty", [(1, 16, 0.0), (5, 1, 0.3), (9, 7, 0.5), (0, 4, 0.0),
                                                  (300, 3, 0.4), (2, 1024, 0.0)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_chunk_table_matches_reference(n_groups, chunk, empty, dtype, device):
    g = torch.Generator().manual_seed(n_groups * 31 + chunk)
    lens = torch.randint(1, 40, (n_groups,), generator=g)
    lens[torch.rand(n_groups, generator=g) < empty] = 0
    bounds = [0] + torch.cumsum(lens, 0).tolist()
    capacity = bounds[-1] // chunk + n_groups + 3  # the callers' bound, plus spare
    first_id = -1 if n_groups % 2 else 0
    info, cptr = chunk_table(torch.tensor(bounds, dtype=dtype, device=device), chunk, capacity, first_id)
    want_info, want_cptr = _reference(bounds, chunk, capacity, first_id)
    assert info.dtype == cptr.dtype == torch.int32 and info.shape == (capacity, 3)
    assert info.cpu().tolist() == [list(r) for r in want_info]
    assert cptr.cpu().tolist() == want_cptr


@pytest.mark.parametrize("n_groups,n_pos", [(1, 0), (3, 15), (4, 16), (9, 200), (130, 517)])
def test_chunk_tables_hold_every_power_of_two_chunk(n_groups, n_pos, device):
    """``chunk_tables``: level ``l`` of the one launch equals ``chunk_table`` of chunk ``CHUNK0 << l`` for the
    callers' capacity; the last level is longer than ``n_pos`` (one chunk per non-empty group), so every longer chunk
    maps to it (``table_level``), and a chunk that is not ``CHUNK0`` times a power of two to none."""
    from fast_multilora.kernels.chunks import CHUNK0, chunk_tables, table_level

    g = torch.Generator().manual_seed(n_groups + n_pos)
    cuts = torch.sort(torch.randint(0, n_pos + 1, (n_groups - 1,), generator=g)).values.tolist()
    bounds = [0, *cuts, n_pos]
    info, cptr = chunk_tables(torch.tensor(bounds, device=device), n_pos, first_id=-1)
    levels = info.shape[0]
    assert cptr.shape == (levels, n_groups + 1) and CHUNK0 << (levels - 1) > n_pos  # the last level: longer
    assert levels == 1 or n_pos >= CHUNK0 << (levels - 2)  # the one before: not
    for chunk in [CHUNK0 << i for i in range(levels + 2)]:
        level = table_level(chunk, levels)
        capacity = n_pos // chunk + n_groups
        want_info, want_cptr = _reference(bounds, chunk, capacity, -1)
        assert info[level, :capacity].cpu().tolist() == [list(r) for r in want_info], chunk
        assert cptr[level].cpu().tolist() == want_cptr, chunk
    assert table_level(24, levels) is None and table_level(8, levels) is None and table_level(0, levels) is None
