"""Token x hidden offsets beyond 2^31: the kernels must index with int64.

GPU (``FML_TEST_DEVICE=cuda``, ``gpu`` marker): S=140,000 tokens, K=N=16,384 in bf16 -- each activation is 4.6 GB and
rows >= 131,072 start past element 2^31. Shrink, expand, expand backward and shrink backward run on four adapters
(one run crossing row 131,072, one entirely above it, one with dropout, base tokens in between), both segment
families; a sample of rows (every segment boundary, both sides of row 131,072, random rows) is compared to the
float64 reference, and ``dA`` / ``dB`` (reductions over all of an adapter's tokens) are compared in full against a
chunked float32 reference. Peak GPU memory is about 15 GiB (x, y/dy, dx; asserted < 40 GiB); the test takes a
few seconds plus kernel compilation.

CPU: the same check at a small size under the interpreter, so the test's own logic is exercised in CI.
"""

import time

import pytest
import torch
from fast_multilora.kernels import api as kernels
from fast_multilora.kernels.dropout import dropout_keep_mask
from fast_multilora.kernels.segments import AdapterTable, segments_from_token_slots
from helpers import TOL, assert_close_bound

from fast_multilora import reference as ref

RANKS = [16, 8, 32, 4]
DROPOUT = [0.0, 0.0, 0.25, 0.0]
SEED = 20240229


def _layout(S, boundary):
    """Runs (slot, start, end): adapter 0, base, adapter 1, adapter 2 across ``boundary``, adapter 3 above it."""
    cuts = [0, S * 3 // 14, S * 5 // 14, S * 12 // 14, (boundary + S) // 2, S]
    assert cuts[3] < boundary < cuts[4] < S
    slots = [0, -1, 1, 2, 3]
    return [(slots[i], cuts[i], cuts[i + 1]) for i in range(5)]


def _sample_rows(runs, S, boundary, gen, n_random):
    rows = {boundary - 2, boundary - 1, boundary, boundary + 1, S - 1}
    for _, a, b in runs:
        rows.update({a, a + 1, b - 2, b - 1})
    rows.update(torch.randint(0, S, (n_random,), generator=gen).tolist())
    return torch.tensor(sorted(r for r in rows if 0 <= r < S))


def _table(device):
    r = torch.tensor(RANKS, dtype=torch.int32)
    p = torch.tensor(DROPOUT)
    return AdapterTable(ranks=r.to(device), offsets=(torch.cumsum(r, 0) - r).to(torch.int32).to(device),
                        scales=torch.tensor([2.0, 0.5, 1.0, 1.5]).to(device), dropout=p.to(device),
                        max_rank=max(RANKS), total_rank=sum(RANKS), has_dropout=True)


def _check(got, want, bound, dtype, what):
    assert_close_bound(got, want, bound, TOL[dtype], what, resolution=1e-30)


def run_large(S, K, N, dtype, device, grouped, n_random=512, chunk=8192):
    gen = torch.Generator().manual_seed(0)
    boundary = -(-(2**31) // K)  # first row whose offset row*K reaches 2^31 (at the GPU size)
    if S * K < 2**31:  # the CPU-sized run keeps the same layout around a scaled-down boundary
        boundary = S * 13 // 14 - 3
    runs = _layout(S, boundary)
    ts = torch.cat([torch.full((b - a,), s) for s, a, b in runs])
    segs = segments_from_token_slots(ts, grouped=grouped, device=device)
    table = _table(device)
    rows = _sample_rows(runs, S, boundary, gen, n_random)
    rows_d = rows.to(device)
    slot_of = ts[rows]
    R, R_tot = max(RANKS), sum(RANKS)
    offs = [0] + torch.tensor(RANKS).cumsum(0).tolist()
    dev_gen = torch.Generator(device=device).manual_seed(1)
    A = (torch.randn(R_tot, K, generator=gen) / K**0.5).to(device)  # fp32 weights (PEFT's default)
    B = (torch.randn(N, R_tot, generator=gen) / 4).to(device)
    hi = torch.float64

    # the kernels' keep-mask for the sampled rows and the dropout adapter's run (the full mask, [S, K] bytes, is
    # built once and freed)
    drop_run = next(r for r in runs if r[0] >= 0 and DROPOUT[r[0]] > 0)
    full_keep = dropout_keep_mask(SEED, segs, table, K)
    keep_rows = full_keep[rows_d].cpu()
    keep_run = full_keep[drop_run[1] : drop_run[2]].clone()
    del full_keep

    def small(rows_ts):
        """Segments and table for the sampled rows alone (the reference needs only their slots)."""
        return segments_from_token_slots(rows_ts, grouped=False, device="cpu"), _table("cpu")

    s_segs, s_table = small(slot_of)
    live = (slot_of >= 0).to(device)

    # ---- forward: shrink then expand ------------------------------------------------------------------------------
    x = torch.randn(S, K, generator=dev_gen, device=device, dtype=dtype)
    h = kernels.lora_shrink(x, A, segs, table, seed=SEED)
    x_s = x[rows_d].cpu().to(hi)
    want = ref.lora_shrink(x_s, A.cpu().to(hi), s_segs, s_table, keep=keep_rows)
    bound = ref.lora_shrink(x_s.abs(), A.cpu().to(hi).abs(), s_segs, s_table, keep=keep_rows)
    cols = torch.arange(R)[None, :] < torch.tensor([RANKS[a] if a >= 0 else 0 for a in slot_of.tolist()])[:, None]
    _check(h[rows_d].cpu()[cols], want[cols], bound[cols], dtype, "shrink h")

    y = torch.randn(S, N, generator=dev_gen, device=device, dtype=dtype)
    y_s0 = y[rows_d].cpu()
    kernels.lora_expand(h, B, segs, table, y)
    h_s = torch.where(cols, h[rows_d].cpu().to(hi), 0.0)  # don't-care columns (uninitialised) as 0
    want = ref.lora_expand(h_s, B.cpu().to(hi), s_segs, s_table, y_s0.to(hi))
    bound = ref.lora_expand(h_s.abs(), B.cpu().to(hi).abs(), s_segs, s_table, y_s0.to(hi).abs())
    _check(y[rows_d].cpu(), want, bound, dtype, "expand y")

    # ---- backward: dy reuses y's memory ---------------------------------------------------------------------------
    dy = y
    dy.normal_(generator=dev_gen)
    dh, dB = kernels.lora_expand_bwd(dy, h, B, segs, table)
    dy_s = dy[rows_d].cpu().to(hi)
    want_dh, _ = ref.lora_expand_bwd(dy_s, h_s, B.cpu().to(hi), s_segs, s_table)
    bound_dh, _ = ref.lora_expand_bwd(dy_s.abs(), h_s.abs(), B.cpu().to(hi).abs(), s_segs, s_table)
    _check(dh[rows_d].cpu()[cols], want_dh[cols], bound_dh[cols], dtype, "expand_bwd dh")

    dx, dA = kernels.lora_shrink_bwd(dh, x, A, segs, table, seed=SEED)
    dh_s = torch.where(cols, dh[rows_d].cpu().to(hi), 0.0)
    want_dx, _ = ref.lora_shrink_bwd(dh_s, x_s, A.cpu().to(hi), s_segs, s_table, keep=keep_rows)
    bound_dx, _ = ref.lora_shrink_bwd(dh_s.abs(), x_s.abs(), A.cpu().to(hi).abs(), s_segs, s_table, keep=keep_rows)
    _check(dx[rows_d].cpu()[live.cpu()], want_dx[live.cpu()], bound_dx[live.cpu()], dtype, "shrink_bwd dx")
    assert torch.count_nonzero(dx[rows_d][~live]) == 0, "dx of base rows not zero"
    del dx

    # ---- dA / dB in full: float32 references over each adapter's tokens, in row chunks ---------------------------
    for a, (slot, start, end) in ((i, r) for i, r in enumerate(runs) if r[0] >= 0):
        c, r = float(table.scales[slot]), RANKS[slot]
        p = DROPOUT[slot]
        want_dB = torch.zeros(N, r, dtype=torch.float32, device=device)
        bnd_dB = torch.zeros_like(want_dB)
        want_dA = torch.zeros(r, K, dtype=torch.float32, device=device)
        bnd_dA = torch.zeros_like(want_dA)
        for t0 in range(start, end, chunk):
            t1 = min(end, t0 + chunk)
            g, hh, dhh = dy[t0:t1].float(), h[t0:t1, :r], dh[t0:t1, :r]
            want_dB += c * g.T @ hh
            bnd_dB += c * g.abs().T @ hh.abs()
            xt = x[t0:t1].float()
            if p > 0:
                xt = xt * keep_run[t0 - start : t1 - start] / (1 - p)
            want_dA += dhh.T @ xt
            bnd_dA += dhh.abs().T @ xt.abs()
        _check(dB[:, offs[slot] : offs[slot + 1]], want_dB, bnd_dB, dtype, f"dB of adapter {slot} (run {a})")
        _check(dA[offs[slot] : offs[slot + 1]], want_dA, bnd_dA, dtype, f"dA of adapter {slot} (run {a})")


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_large_index_logic_small(grouped):
    """The large-index check at a CPU size (interpreter): same layout, boundary scaled down."""
    run_large(S=140, K=24, N=20, dtype=torch.float16, device="cpu", grouped=grouped, n_random=16, chunk=32)


@pytest.mark.gpu
@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_offsets_beyond_2_31(grouped):
    S, K, N = 140_000, 16_384, 16_384
    assert (S - 1) * K > 2**31 and (S - 1) * N > 2**31
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    run_large(S, K, N, torch.bfloat16, "cuda", grouped)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"large-index {['sgemm', 'chunked'][grouped]}: {time.time() - t0:.1f} s, peak {peak:.1f} GiB")
    assert peak < 40, f"peak GPU memory {peak:.1f} GiB"
