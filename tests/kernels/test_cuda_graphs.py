"""CUDA-graph capture of the four kernels (forward and backward, both segment families), replayed on new values.

Why it can work: no launcher reads a device value on the host. Grids come from host ints and tensor shapes only --
SGEMM forward ``(num_segments, cdiv(max_len, BLOCK_S), N-tiles)``, chunked forward ``cdiv(len(perm), BLOCK_M) +
num_segments`` chunks, backward ``S // chunk + n_slots + 1`` chunks -- each a capacity: programs past the real work
(past a segment's end, past the last chunk, rank 0, base tokens) return at once. So a captured graph stays correct
when new token -> slot values are copied into the static layout tensors, provided that

* the shapes stay (``len(indptr)``: the segment count, ``len(perm)``: the adapter-token count),
* ``Segments.max_len`` bounds every new segment (SGEMM): :func:`static_problem` sets it to ``S``, the capacity,
* the derived chunk tables are recomputed inside the graph: the captured call gets a ``Segments`` with an empty cache
  (a cache filled by the warm-up would freeze the warm-up's layout into the graph). ``fast_multilora.ops`` does this
  on every call, the launchers through :func:`run_ops`.

Allocations during capture come from the graph's private memory pool (``torch.cuda.graph``); the outputs of the
captured call are that pool's static tensors, rewritten by every replay.

The GPU test compares a replay with an eager run on the same new values: bitwise equal (the same kernels, no
atomics, fixed reduction order). On CPU the set-up and the eager runs are checked with the Triton interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from fast_multilora.kernels.api import lora_expand, lora_expand_bwd, lora_shrink, lora_shrink_bwd
from fast_multilora.kernels.segments import AdapterTable, Segments, segments_from_token_slots
from helpers import make_table

from fast_multilora import ops
from fast_multilora import reference as ref

FAMILIES = [pytest.param(False, id="sgemm"), pytest.param(True, id="chunked")]
IMPLS = ["kernels", "ops"]


@dataclass
class Static:
    """The static tensors a captured graph reads (inputs) and the layout they describe."""

    x: torch.Tensor
    A_cat: torch.Tensor
    B_cat: torch.Tensor
    y0: torch.Tensor  # base output; every run starts from a copy of it
    dy: torch.Tensor
    segs: Segments
    table: AdapterTable
    token_slots: torch.Tensor  # host values the layout tensors hold now (for the reference)


def layout(S: int, n_slots: int, grouped: bool, gen: torch.Generator, n_runs: int = 0) -> torch.Tensor:
    """Token -> slot values whose ``Segments`` have shapes fixed by ``(S, n_slots, grouped, n_runs)`` alone.

    Chunked (``grouped``): ``S // 8`` base tokens and every slot used, the rest interleaved at random, so
    ``len(perm)`` and the segment count do not depend on ``gen``. SGEMM: ``n_runs`` runs of random lengths, each slot
    (or base, -1) different from the previous run's, so the segment count is ``n_runs``.
    """
    if grouped:
        n_base = S // 8
        ts = torch.cat([torch.full((n_base,), -1), torch.arange(n_slots),
                        torch.randint(0, n_slots, (S - n_base - n_slots,), generator=gen)])
        return ts[torch.randperm(S, generator=gen)]
    cuts = torch.randperm(S - 1, generator=gen)[: n_runs - 1].sort().values + 1
    lengths = torch.diff(torch.cat([torch.tensor([0]), cuts, torch.tensor([S])]))
    slots = [int(torch.randint(-1, n_slots, (1,), generator=gen))]
    for _ in range(n_runs - 1):
        step = int(torch.randint(1, n_slots + 1, (1,), generator=gen))  # never 0: a new run changes slot
        slots.append((slots[-1] + 1 + step) % (n_slots + 1) - 1)
    return torch.repeat_interleave(torch.tensor(slots), lengths)


def static_problem(S, K, N, ranks, grouped, dtype, device, seed=0, n_runs=24) -> Static:
    """Static inputs of one layer: activations, weights, the layout (``max_len`` at its capacity ``S``)."""
    gen = torch.Generator().manual_seed(seed)
    R = sum(ranks)
    ts = layout(S, len(ranks), grouped, gen, n_runs)
    segs = segments_from_token_slots(ts, grouped=grouped, device=device)
    return Static(
        x=torch.randn(S, K, generator=gen).to(device, dtype),
        A_cat=(torch.randn(R, K, generator=gen) / K**0.5).to(device, dtype),
        B_cat=(torch.randn(N, R, generator=gen) / 4).to(device, dtype),
        y0=torch.randn(S, N, generator=gen).to(device, dtype),
        dy=torch.randn(S, N, generator=gen).to(device, dtype),
        segs=segs._replace(max_len=S),
        table=make_table(ranks, device=device),
        token_slots=ts,
    )


def load_new_values(st: Static, ranks, grouped, seed, n_runs=24) -> None:
    """Copy fresh values (activations, weights, a new layout of the same shapes) into the static tensors."""
    new = static_problem(st.x.shape[0], st.x.shape[1], st.y0.shape[1], ranks, grouped, st.x.dtype, st.x.device,
                         seed=seed, n_runs=n_runs)
    for name in ("x", "A_cat", "B_cat", "y0", "dy"):
        getattr(st, name).copy_(getattr(new, name))
    for mine, theirs in ((st.segs.indptr, new.segs.indptr), (st.segs.slot, new.segs.slot),
                         (st.segs.perm, new.segs.perm)):
        if mine is not None:
            mine.copy_(theirs)
    st.token_slots = new.token_slots


def run_ops(st: Static, impl: str) -> tuple:
    """Forward and backward of one layer: ``(h, y, dh, dB, dx, dA)``, new tensors (the graph pool's under capture).

    ``impl="kernels"`` calls the launchers with a ``Segments`` whose cache is empty, so the chunk tables are built from
    the static layout tensors in this call; ``"ops"``: the ``torch.library`` ops, which do that themselves.
    """
    segs = Segments(*st.segs[:5], cache={})
    y = st.y0.clone()
    if impl == "kernels":
        # zeros, not the launcher's uninitialised don't-care entries, so h compares bitwise (as the op's h does)
        h = lora_shrink(st.x, st.A_cat, segs, st.table,
                        out=torch.zeros(st.x.shape[0], st.table.max_rank, device=st.x.device))
        lora_expand(h, st.B_cat, segs, st.table, y)
        dh, dB = lora_expand_bwd(st.dy, h, st.B_cat, segs, st.table)
        dx, dA = lora_shrink_bwd(dh, st.x, st.A_cat, segs, st.table)
    else:
        h, _ = ops.lora_shrink(st.x, st.A_cat, segs, st.table)
        ops.lora_expand(h, st.B_cat, segs, st.table, y)
        dh, dB = ops.lora_expand_bwd(st.dy, h, st.B_cat, segs, st.table)
        dx, dA = ops.lora_shrink_bwd(dh, st.x, st.A_cat, segs, st.table)
    return h, y, dh, dB, dx, dA


def _reference(st: Static):
    """fp64 reference ``(y, dx, dA, dB)`` for the static tensors' current values."""
    segs = segments_from_token_slots(st.token_slots, grouped=False, device=st.x.device)
    x, A, B = st.x.double(), st.A_cat.double(), st.B_cat.double()
    h = ref.lora_shrink(x, A, segs, st.table)
    y = ref.lora_expand(h, B, segs, st.table, st.y0.double().clone())
    dh, dB = ref.lora_expand_bwd(st.dy.double(), h, B, segs, st.table)
    dx, dA = ref.lora_shrink_bwd(dh, x, A, segs, st.table)
    return y, dx, dA, dB


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grouped", FAMILIES)
def test_static_setup_on_new_values(grouped, impl, device):
    """The GPU test's set-up without capture: new values of the same shapes go into the static tensors, and the
    same calls on them match the reference (SGEMM: every new segment within the static ``max_len``)."""
    ranks = [4, 1, 8, 0, 3]
    st = static_problem(48, 24, 40, ranks, grouped, torch.float32, device, seed=1, n_runs=6)
    assert st.segs.max_len == 48
    before = run_ops(st, impl)
    old_slots = st.token_slots
    load_new_values(st, ranks, grouped, seed=2, n_runs=6)
    assert not torch.equal(old_slots, st.token_slots)
    got = run_ops(st, impl)
    assert not torch.equal(before[1], got[1])  # the run read the new values
    _, y, _, dB, dx, dA = got
    for name, g, want in zip(("y", "dx", "dA", "dB"), (y, dx, dA, dB), _reference(st), strict=True):
        torch.testing.assert_close(g.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item(),
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("grouped", FAMILIES)
def test_cuda_graph_replay_matches_eager(grouped, impl):
    ranks = [16, 8, 32, 4, 16, 64, 1, 12]  # 8 adapters
    st = static_problem(4096, 1024, 1536, ranks, grouped, torch.bfloat16, "cuda", seed=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: Triton compiles, the allocator settles
        for _ in range(2):
            run_ops(st, impl)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run_ops(st, impl)
    graph.replay()
    first = [o.clone() for o in outs]

    load_new_values(st, ranks, grouped, seed=2)
    graph.replay()
    got = [o.clone() for o in outs]
    want = run_ops(st, impl)
    torch.cuda.synchronize()
    for name, g, w, f in zip(("h", "y", "dh", "dB", "dx", "dA"), got, want, first, strict=True):
        assert torch.equal(g, w), f"{name}: replay differs from eager on the new values"
        assert not torch.equal(g, f), f"{name}: replay did not read the new values"


@pytest.mark.gpu
def test_patched_layer_graph_reads_weights_in_place():
    """A patched layer reads each adapter's weights in place through a cached per-slot address table
    (``kernels.slot_weights``): a CUDA graph of its forward replays on weights updated in place -- also after that
    cache was cleared and the memory reused, since tables a capture used are kept."""
    from fast_multilora.kernels import segments as seg
    from peft import LoraConfig, get_peft_model

    import fast_multilora

    g = torch.Generator().manual_seed(3)
    base = torch.nn.Sequential(torch.nn.Linear(64, 48)).cuda().requires_grad_(False)
    lc = LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False)
    model = get_peft_model(base, lc, adapter_name="a0")
    for i in range(1, 8):
        model.add_adapter(f"a{i}", lc)
    model.eval()
    fast_multilora.patch(model, backend="triton")
    x = torch.randn(8, 16, 64, generator=g).cuda()
    names = [f"a{(3 * i) % 8}" for i in range(8)]
    lora = [p for n, p in model.named_parameters() if "lora_" in n]

    def forward():
        with torch.no_grad():
            return model(x, adapter_names=names)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, caches the plan, the layer table and the weights' table
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    layer = model.base_model.model[0]
    A = [layer.lora_A[n].weight for n in sorted(layer.lora_A)]
    assert seg.slot_weights(A, tuple(range(8)), 8, 0) is not None  # the path under test: weights read in place
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward()
    graph.replay()
    first = out.clone()

    with torch.no_grad():
        for p in lora:
            p.add_(torch.randn(p.shape, generator=g).cuda() / 4)
    seg._SLOT_WEIGHTS.clear()  # the graph's tables must survive the cache being emptied ...
    junk = [torch.full((4096,), -1, dtype=torch.int64, device="cuda") for _ in range(64)]  # ... and memory reuse
    graph.replay()
    got = out.clone()
    want = forward()
    torch.cuda.synchronize()
    del junk
    assert not torch.equal(got, first), "replay did not read the updated weights"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
