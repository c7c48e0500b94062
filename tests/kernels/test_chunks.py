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
