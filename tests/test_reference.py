"""The pure-PyTorch segmented ops against a per-token dense oracle, both segment families."""

import pytest
import torch
from helpers import dense_lora, make_segments, make_table, random_token_slots

from fast_multilora import reference as ref


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
@pytest.mark.parametrize("layout", ["random", "runs", "skewed"])
def test_forward_matches_dense(grouped, layout):
    g = torch.Generator().manual_seed(0)
    S, K, N, ranks = 37, 23, 19, [3, 0, 1, 5]
    ts = random_token_slots(S, len(ranks), g, layout=layout)
    table = make_table(ranks)
    As = [torch.randn(r, K, generator=g) for r in ranks]
    Bs = [torch.randn(N, r, generator=g) for r in ranks]
    x = torch.randn(S, K, generator=g)
    y0 = torch.randn(S, N, generator=g)
    segs = make_segments(ts, grouped)
    h = ref.lora_shrink(x, torch.cat(As), segs, table)
    y = ref.lora_expand(h, torch.cat(Bs, 1), segs, table, y0.clone())
    want = dense_lora(x, ts, As, Bs, table.scales.tolist())
    torch.testing.assert_close((y - y0).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grouped", [False, True], ids=["sgemm", "chunked"])
def test_backward_matches_autograd(grouped):
    g = torch.Generator().manual_seed(1)
    S, K, N, ranks, ps = 29, 11, 13, [2, 4, 1], [0.0, 0.3, 0.5]
    ts = random_token_slots(S, len(ranks), g)
    table = make_table(ranks, dropout=ps)
    keep = torch.rand(S, K, generator=g) > 0.3
    As = [torch.randn(r, K, generator=g, dtype=torch.float64, requires_grad=True) for r in ranks]
    Bs = [torch.randn(N, r, generator=g, dtype=torch.float64, requires_grad=True) for r in ranks]
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(S, N, generator=g, dtype=torch.float64)
    dense_lora_autograd = torch.zeros(S, N, dtype=torch.float64)
    rows = []
    for t in range(S):
        a = int(ts[t])
        if a < 0:
            rows.append(torch.zeros(N, dtype=torch.float64))
            continue
        xt = x[t] * keep[t] / (1 - ps[a]) if ps[a] > 0 else x[t]
        rows.append(table.scales[a].item() * (xt @ As[a].T) @ Bs[a].T)
    dense_lora_autograd = torch.stack(rows)
    dense_lora_autograd.backward(dy)
    segs = make_segments(ts, grouped)
    A_cat, B_cat = torch.cat([a.detach() for a in As]), torch.cat([b.detach() for b in Bs], 1)
    h = ref.lora_shrink(x.detach(), A_cat, segs, table, keep=keep)
    dh, dB = ref.lora_expand_bwd(dy, h, B_cat, segs, table)
    dx, dA = ref.lora_shrink_bwd(dh, x.detach(), A_cat, segs, table, keep=keep)
    torch.testing.assert_close(dx, x.grad)
    torch.testing.assert_close(dA.double(), torch.cat([a.grad for a in As]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dB.double(), torch.cat([b.grad for b in Bs], 1), rtol=1e-5, atol=1e-5)


def test_stacked_slices_match_separate():
    g = torch.Generator().manual_seed(2)
    S, K, ranks, stack = 17, 9, [2, 3], 3
    ts = random_token_slots(S, len(ranks), g)
    table = make_table(ranks)
    segs = make_segments(ts, True)
    As = [[torch.randn(r, K, generator=g) for r in ranks] for _ in range(stack)]  # [slice][slot]
    x = torch.randn(S, K, generator=g)
    A_stacked = torch.cat([torch.cat([As[s][a] for s in range(stack)]) for a in range(len(ranks))])
    h = ref.lora_shrink(x, A_stacked, segs, table, stack_num=stack)
    for s in range(stack):
        hs = ref.lora_shrink(x, torch.cat(As[s]), segs, table)
        for a, r in enumerate(ranks):
            rows = ts == a
            torch.testing.assert_close(h[rows, s * r : (s + 1) * r], hs[rows, :r])
