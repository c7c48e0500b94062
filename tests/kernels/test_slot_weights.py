"""Weights read in place (``kernels.segments.SlotWeights``) against the concatenated weights, every kernel.

The layer Functions hand the kernels each adapter's own ``lora_A`` / ``lora_B`` weight (a per-slot address table)
instead of ``torch.cat`` copies. Here the four launchers run on both forms of the same weights -- laid out in
reverse slot order with NaN-filled gaps between them, with absent slots (rank 0) -- and must give the same
results: bit for bit (the kernels do the same arithmetic on the same values; only the addresses differ), and within
the kernels' stated tolerances of the float64 reference (``test_kernels_forward.py``: fp32 1e-5 of max|ref|).
Outputs are NaN-poisoned where the contract leaves them unwritten. B weights may differ in rank per slot (each is
read with its own rank as row stride), read from separate tensors (``slot_weights``) or from one packed buffer (the
adapter store's block, a 1-D ``B_cat``: the layout of a blocked ``dB``, read without a table). Then the builders'
rules: what they refuse (the caller concatenates instead) and their caches.
"""

import math

import pytest
import torch
from fast_multilora.kernels.backward import lora_expand_bwd, lora_shrink_bwd
from fast_multilora.kernels.forward import lora_expand, lora_shrink
from fast_multilora.kernels.segments import SlotWeights, slot_weights
from helpers import DEVICE, make_segments, make_table, poisoned, random_token_slots

from fast_multilora import reference as ref

FAMILIES = [pytest.param(False, id="sgemm"), pytest.param(True, id="chunked")]


def _scattered(shapes, dtype, gen, device):
    """One tensor per shape: contiguous views of one buffer, laid out in reverse slot order with a 16-element gap
    after each (so the last slot has the lowest address and no two weights are adjacent), each at an offset that is
    a multiple of 16 elements. The views keep the buffer alive."""
    sizes = [math.prod(shape) for shape in shapes]
    padded = [-(-n // 16) * 16 + 16 for n in sizes]
    buf = torch.full((sum(padded),), float("nan"), dtype=dtype, device=device)  # the gaps stay NaN
    out, off = [None] * len(shapes), 0
    for i in reversed(range(len(shapes))):
        out[i] = buf[off : off + sizes[i]].view(shapes[i])
        out[i].copy_(torch.randn(*shapes[i], generator=gen) / 4)
        off += padded[i]
    return out


def _case(S, K, N, ranks, grouped, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ts = random_token_slots(S, len(ranks), g, layout="random")
    table = make_table(ranks, device=DEVICE)
    segs = make_segments(ts, grouped, device=DEVICE)
    slots = tuple(s for s, r in enumerate(ranks) if r > 0)
    As = _scattered([(ranks[s], K) for s in slots], dtype, g, DEVICE)
    Bs = _scattered([(N, ranks[s]) for s in slots], dtype, g, DEVICE)
    x = torch.randn(S, K, generator=g).to(DEVICE, dtype)
    A_slot = slot_weights(As, slots, len(ranks), 0)
    B_slot = slot_weights(Bs, slots, len(ranks), 1)
    assert A_slot is not None and B_slot is not None
    assert A_slot.base is As[-1] and B_slot.base is Bs[-1]  # the lowest address: the last slot's weight
    return table, segs, x, torch.cat(As), torch.cat(Bs, 1), A_slot, B_slot


# S, K, N, ranks (0 = adapter absent from the layer), seed
CASES = [
    pytest.param(45, 123, 77, [4, 0, 4, 4, 0, 4], 1, id="S45-K123-N77-R4-A6-absent"),
    pytest.param(33, 64, 130, [16, 16, 16], 2, id="S33-K64-N130-R16-A3"),
    pytest.param(20, 16, 17, [1] * 9 + [0], 3, id="S20-K16-N17-R1-A10"),
    # mixed ranks: each B weight read with its own rank as row stride (a shared stride reads the wrong elements)
    pytest.param(50, 40, 123, [1, 4, 0, 16, 3], 7, id="S50-K40-N123-R1.4.16.3-A5-absent"),
    pytest.param(37, 32, 64, [3, 16, 0, 1, 4], 8, id="S37-K32-N64-R3.16.1.4-A5-absent"),
]


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("S,K,N,ranks,seed", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []),
                         ids=["fp32", "fp16"] + (["bf16"] if DEVICE == "cuda" else []))  # bf16 dot: GPU only
def test_forward_in_place_equals_concatenated(S, K, N, ranks, seed, grouped, dtype):
    table, segs, x, A_cat, B_cat, A_slot, B_slot = _case(S, K, N, ranks, grouped, dtype, seed)
    width = max(ranks)
    h_cat = lora_shrink(x, A_cat, segs, table, out=poisoned(S, width, device=DEVICE))
    h_slot = lora_shrink(x, A_slot, segs, table, out=poisoned(S, width, device=DEVICE))
    torch.testing.assert_close(h_slot, h_cat, rtol=0, atol=0, equal_nan=True)  # NaN where unwritten, both
    h = torch.nan_to_num(h_cat, nan=0.0)
    y0 = torch.randn(S, N, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)
    for accumulate in (False, True):
        y_cat = lora_expand(h, B_cat, segs, table, y0.clone(), accumulate=accumulate)
        y_slot = lora_expand(h, B_slot, segs, table, y0.clone(), accumulate=accumulate)
        torch.testing.assert_close(y_slot, y_cat, rtol=0, atol=0)
    if dtype == torch.float32:  # and the reference (add mode), at the forward kernels' fp32 tolerance
        want = ref.lora_expand(ref.lora_shrink(x.double(), A_cat.double(), segs, table), B_cat.double(), segs, table,
                               y0.double().clone())
        torch.testing.assert_close(y_slot.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("S,K,N,ranks,seed", CASES)
def test_backward_in_place_equals_concatenated(S, K, N, ranks, seed, grouped):
    dtype = torch.float32
    table, segs, x, A_cat, B_cat, A_slot, B_slot = _case(S, K, N, ranks, grouped, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    h = torch.randn(S, max(ranks), generator=g).to(DEVICE)
    dy = torch.randn(S, N, generator=g).to(DEVICE, dtype)
    outs = []
    for B in (B_cat, B_slot):
        dh, dB = lora_expand_bwd(dy, h, B, segs, table, dh=torch.zeros(S, max(ranks), device=DEVICE))
        dx, dA = lora_shrink_bwd(dh, x, A_cat if B is B_cat else A_slot, segs, table)
        outs.append((dh, dB, dx, dA))
    for got, want, what in zip(outs[1], outs[0], ("dh", "dB", "dx", "dA"), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, w=what: f"{w}: {m}")
    dh_ref, dB_ref = ref.lora_expand_bwd(dy.double(), h.double(), B_cat.double(), segs, table)
    torch.testing.assert_close(outs[1][0].double(), dh_ref, rtol=1e-5, atol=1e-5 * dh_ref.abs().max().item())
    torch.testing.assert_close(outs[1][1].double(), dB_ref, rtol=1e-5, atol=1e-5 * dB_ref.abs().max().item())


def test_builder_refuses_what_the_kernels_cannot_read():
    n = 4
    a = [torch.randn(2, 32, device=DEVICE) for _ in range(3)]
    assert slot_weights(a, (0, 1, 3), n, 0) is not None
    assert slot_weights([a[0], a[1].half(), a[2]], (0, 1, 3), n, 0) is None  # mixed dtypes
    assert slot_weights([a[0], torch.randn(32, 2, device=DEVICE).t(), a[2]], (0, 1, 3), n, 0) is None  # strided
    big = torch.randn(2 * 32 + 1, device=DEVICE)
    assert slot_weights([a[0], big[1:].view(2, 32), a[2]], (0, 1, 3), n, 0) is None  # 1 element past alignment
    assert slot_weights([a[0], torch.randn(2, 31, device=DEVICE), a[2]], (0, 1, 3), n, 0) is None  # K differs
    b = [torch.randn(40, 2, device=DEVICE), torch.randn(40, 3, device=DEVICE)]
    w = slot_weights(b, (0, 1), n, 1)  # B weights of unequal ranks: each row stride is its slot's rank
    assert w is not None and w.shape == (40, 5) and w.stride() == (5, 1)
    assert slot_weights([b[0], torch.randn(41, 3, device=DEVICE)], (0, 1), n, 1) is None  # N differs
    assert slot_weights([b[0], torch.randn(3, 40, device=DEVICE).t()], (0, 1), n, 1) is None  # strided B
    assert slot_weights([], (), n, 0) is None


def test_builder_cache_follows_addresses():
    a = [torch.randn(2, 32, device=DEVICE) for _ in range(2)]
    w1 = slot_weights(a, (1, 2), 3, 0)
    assert slot_weights(a, (1, 2), 3, 0).offsets is w1.offsets  # in-place updates keep the addresses: cached
    with torch.no_grad():
        a[0].add_(1.0)
    assert slot_weights(a, (1, 2), 3, 0).offsets is w1.offsets
    ptrs = [t.data_ptr() for t in a]
    base = min(ptrs)
    size = a[0].element_size()
    assert w1.offsets.tolist() == [0, (ptrs[0] - base) // size, (ptrs[1] - base) // size]
    assert w1.shape == (4, 32) and w1.stride() == (32, 1) and w1.base.data_ptr() == base
    a[1] = torch.randn(2, 32, device=DEVICE)  # a new tensor: its own address, a new table
    w2 = slot_weights(a, (1, 2), 3, 0)
    assert w2.offsets.tolist()[2] * size == a[1].data_ptr() - w2.base.data_ptr()


def test_launchers_reject_stacked_slot_weights():
    ranks = [2, 2]
    table = make_table(ranks, device=DEVICE)
    segs = make_segments(torch.tensor([0, 1, 1, 0]), False, device=DEVICE)
    a = [torch.randn(2, 16, device=DEVICE) for _ in range(2)]
    w = slot_weights(a, (0, 1), 2, 0)
    w2 = SlotWeights(w.base, w.offsets, (8, 16))
    with pytest.raises(ValueError, match="stack_num=1"):
        lora_shrink(torch.randn(4, 16, device=DEVICE), w2, segs, table, stack_num=2)


@pytest.mark.parametrize("grouped", FAMILIES)
def test_dropout_paths_in_place_equal_concatenated(grouped):
    """Under dropout: the forward shrink storing its mask, the backward reading it, and the backward redrawing it
    from the seed -- the same with the weights read in place as concatenated."""
    from fast_multilora.kernels.dropout import keep_bits_buffer

    S, K, N, ranks = 40, 64, 48, [8, 8, 0, 8]
    table, segs, x, A_cat, B_cat, A_slot, B_slot = _case(S, K, N, ranks, grouped, torch.float32, 5)
    table = table._replace(dropout=torch.tensor([0.25, 0.5, 0.0, 0.1], device=DEVICE), has_dropout=True)
    seed = 1234
    dy = torch.randn(S, N, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    outs = []
    for A, B in ((A_cat, B_cat), (A_slot, B_slot)):
        keep = keep_bits_buffer(x)
        h = lora_shrink(x, A, segs, table, seed=seed, keep_out=keep, out=poisoned(S, max(ranks), device=DEVICE))
        dh, dB = lora_expand_bwd(dy, torch.nan_to_num(h), B, segs, table, dh=torch.zeros_like(h))
        stored = lora_shrink_bwd(dh, x, A, segs, table, seed=seed, keep=keep)
        redrawn = lora_shrink_bwd(dh, x, A, segs, table, seed=seed)
        outs.append((h, dB, *stored, *redrawn))
    for got, want, what in zip(outs[1], outs[0], ("h", "dB", "dx", "dA", "dx redrawn", "dA redrawn"), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=lambda m, w=what: f"{w}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# B weights packed in one flat buffer (the adapter store's block, kernels.segments.packed_b): slot a's [N, r_a] block
# at element N * offsets[a], read as it lies -- no table, no alignment asked of the blocks
# ---------------------------------------------------------------------------------------------------------------


def _packed(B_cat, ranks):
    """``B_cat``'s slots packed as the store lays them out: a 1-D view ``[N * total_rank]`` of a NaN-filled buffer,
    NaN after its end (a read past a block's end reads a neighbour's values or NaN, never this slot's)."""
    N, R = B_cat.shape
    buf = torch.full((N * R + 16,), float("nan"), dtype=B_cat.dtype, device=B_cat.device)
    flat, off = buf[: N * R], 0
    for r in ranks:
        flat[N * off : N * (off + r)] = B_cat[:, off : off + r].reshape(-1)  # row-major [N, r]: row stride r
        off += r
    return flat


PACKED = [  # the second and third: blocks at offsets that are no multiple of 16 elements (N = 123, odd ranks)
    pytest.param(37, 64, [3, 16, 0, 1, 4], 8, id="S37-N64-R3.16.1.4-A5-absent"),
    pytest.param(29, 123, [16, 0, 16, 5], 9, id="S29-N123-R16.16.5-A4-absent"),
    pytest.param(41, 123, [1, 3, 0, 7, 2], 10, id="S41-N123-R1.3.7.2-A5-absent"),
]


def _packed_case(S, N, ranks, grouped, dtype, seed):
    table, segs, _, _, B_cat, _, _ = _case(S, 16, N, ranks, grouped, dtype, seed)
    return table, segs, B_cat, _packed(B_cat, ranks)


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("S,N,ranks,seed", PACKED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_forward_packed_b_equals_concatenated(S, N, ranks, seed, grouped, dtype):
    table, segs, B_cat, B_packed = _packed_case(S, N, ranks, grouped, dtype, seed)
    g = torch.Generator().manual_seed(seed + 2)
    h = torch.randn(S, max(ranks), generator=g).to(DEVICE)
    y0 = torch.randn(S, N, generator=g).to(DEVICE, dtype)
    for accumulate in (False, True):
        y_cat = lora_expand(h, B_cat, segs, table, y0.clone(), accumulate=accumulate)
        y_packed = lora_expand(h, B_packed, segs, table, y0.clone(), accumulate=accumulate)
        torch.testing.assert_close(y_packed, y_cat, rtol=0, atol=0, msg=lambda m, a=accumulate: f"acc={a}: {m}")


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.parametrize("S,N,ranks,seed", PACKED)
def test_backward_packed_b_equals_concatenated(S, N, ranks, seed, grouped):
    """dh and dB with B read from the packed block equal the concatenated path, dB then in the packed layout (the
    gradient of the block); and that gradient, used as the B weights, expands as its concatenated form does."""
    table, segs, B_cat, B_packed = _packed_case(S, N, ranks, grouped, torch.float32, seed)
    g = torch.Generator().manual_seed(seed + 3)
    h = torch.randn(S, max(ranks), generator=g).to(DEVICE)
    dy = torch.randn(S, N, generator=g).to(DEVICE)
    dh_cat, dB_cat = lora_expand_bwd(dy, h, B_cat, segs, table, dh=torch.zeros(S, max(ranks), device=DEVICE))
    dh_packed, dB_flat = lora_expand_bwd(dy, h, B_packed, segs, table, dh=torch.zeros(S, max(ranks), device=DEVICE))
    torch.testing.assert_close(dh_packed, dh_cat, rtol=0, atol=0)
    assert dB_flat.shape == (N * sum(ranks),)
    assert torch.equal(dB_flat, _packed(dB_cat, ranks))  # slot a's [N, r_a] at N * offsets[a]
    _, dB_2d = lora_expand_bwd(dy, h, B_packed, segs, table, dB_blocked=False)
    torch.testing.assert_close(dB_2d, dB_cat, rtol=0, atol=0)
    y_cat = lora_expand(h, dB_cat, segs, table, torch.zeros(S, N, device=DEVICE))
    y_packed = lora_expand(h, dB_flat, segs, table, torch.zeros(S, N, device=DEVICE))
    torch.testing.assert_close(y_packed, y_cat, rtol=0, atol=0)


def test_packed_b_refuses_what_is_not_a_block():
    ranks = [1, 4, 0, 16, 3]
    table = make_table(ranks, device=DEVICE)
    R, S, N = sum(ranks), 5, 64
    segs = make_segments(torch.tensor([0, 1, 3, 4, 0]), False, device=DEVICE)
    h = torch.zeros(S, max(ranks), device=DEVICE)
    buf = torch.zeros(2 * N * R, device=DEVICE)
    for bad, match in ((buf[: N * R - 1], "N\\*total_rank"), (buf[::2], "contiguous"),
                       (buf[: N * R].to(torch.int32), "floating")):
        with pytest.raises(ValueError, match=match):
            lora_expand(h, bad, segs, table, torch.zeros(S, N, device=DEVICE))
        with pytest.raises(ValueError, match=match):
            lora_expand_bwd(torch.zeros(S, N, device=DEVICE), h, bad, segs, table)
