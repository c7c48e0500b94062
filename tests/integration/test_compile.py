"""``torch.compile`` of the layer path: the ``torch.library`` custom ops (opcheck) and whole patched models.

Runs on CPU (Triton through the interpreter, tests/conftest.py) with ``backend="aot_eager"``: AOTAutograd traces the
forward and backward graphs through the ops' fake implementations and runs them eagerly (Inductor and CUDA graphs
are checked on the GPU, ``test_compile_gpu.py``). Graph breaks and recompilations are counted through
``torch._dynamo.utils.counters``: a patched model compiles to one graph, with no break, that serves every adapter
mix of the same shapes (names, ``adapter_ids``, counts, order), in training and eval, on both backends. The models
have one decoder layer where a test allows: its seven LoRA layers (four shapes, four adapter tables) are every kind of
layer call.
"""

import pytest
import torch
from functorch.compile import make_boxed_func
from helpers import make_segments, make_table
from models import peft_model, twin
from peft.tuners.lora import LoraLayer
from torch._dynamo.utils import counters

import fast_multilora
from fast_multilora import ops

S, K, N = 37, 23, 29
RANKS = [1, 4, 0, 3]
DROPOUT = [0.0, 0.3, 0.0, 0.1]
FAMILIES = [pytest.param(False, id="sgemm"), pytest.param(True, id="chunked")]
pytestmark = pytest.mark.usefixtures("fresh_dynamo")
MIXES = [  # per-row names for 4 rows: different sets, counts, orders, all-base, one adapter everywhere
    ["a1", "__base__", "a0", "a2"], ["a1", "a1", "a0", "a2"], ["__base__"] * 4, ["a2", "a0", "a1", "a1"],
    ["a0"] * 4, ["a2", "__base__", "a2", "a0"],
]


_TOKEN_SLOTS = torch.randint(-1, len(RANKS), (S,), generator=torch.Generator().manual_seed(5))


def _problem(grouped, device, dropout=False):
    g = torch.Generator().manual_seed(7)
    ts = _TOKEN_SLOTS
    R = sum(RANKS)
    t = {
        "x": torch.randn(S, K, generator=g), "y": torch.randn(S, N, generator=g),
        "A": torch.randn(R, K, generator=g) / K**0.5, "B": torch.randn(N, R, generator=g),
        "h": torch.randn(S, max(RANKS), generator=g), "dy": torch.randn(S, N, generator=g),
        "bias": torch.randn(N, generator=g), "W": torch.randn(N, K, generator=g),
    }
    t = {k: v.to(device) for k, v in t.items()}
    table = make_table(RANKS, dropout=DROPOUT if dropout else None, device=device)
    return t, make_segments(ts, grouped, device=device), table


# the chunked family's segments with -m slow (CI time): each op's SGEMM case checks the same registration, fake
# kernel and autograd formula, without the permutation argument
@pytest.mark.parametrize("grouped", [FAMILIES[0], pytest.param(True, id="chunked", marks=pytest.mark.slow)])
@pytest.mark.parametrize("op", ["lora_shrink", "lora_shrink_store", "lora_expand", "lora_expand_write",
                                "lora_expand_bwd", "lora_expand_bwd_dh", "lora_shrink_bwd", "lora_shrink_bwd_keep",
                                "lora_shrink_bwd_no_dx", "lora_shrink_bwd_gemm", "lora_shrink_expand",
                                "lora_expand_write_gemm"])
def test_opcheck(op, grouped, device):
    """The ops' schema, fake tensors and AOT dispatch (dynamic shapes), with a device seed; the expand in add and
    write mode (with a bias), the backward ops with their optional inputs, the one-launch decode op (its layout with
    the rows' slots), and the fused base's GEMM inside the write-mode expand (a transposed weight, as the forward
    passes it) and inside the shrink backward."""
    t, segs, table = _problem(grouped, device, dropout=True)
    seed = torch.tensor([1234], dtype=torch.int32, device=device)

    def L(*extra):  # the layout's two list arguments, the op's own ints after the layout's
        return ops._layout(segs, table, *extra)

    keep = torch.ops.fast_multilora.lora_shrink(t["x"], t["A"], *L(1, True), seed)[1]
    f = torch.ops.fast_multilora
    cases = {
        "lora_shrink": (f.lora_shrink, (t["x"], t["A"], *L(1, False), seed)),
        "lora_shrink_store": (f.lora_shrink, (t["x"], t["A"], *L(1, True), seed)),
        "lora_expand": (f.lora_expand, (t["h"], t["B"], t["y"], *L(1, 0, True), None, None, None)),
        "lora_expand_write": (f.lora_expand, (t["h"], t["B"], t["y"], *L(1, 0, False), t["bias"], None, None)),
        "lora_expand_write_gemm": (f.lora_expand, (t["h"], t["B"], t["y"], *L(1, 0, False), t["bias"], t["x"],
                                                   t["W"].t())),
        "lora_expand_bwd": (f.lora_expand_bwd, (t["dy"], t["h"], t["B"], *L(1, 0), None)),
        "lora_expand_bwd_dh": (f.lora_expand_bwd, (t["dy"], t["h"], t["B"], *L(1, 0), t["h"])),
        "lora_shrink_bwd": (f.lora_shrink_bwd, (t["h"], t["x"], t["A"], *L(1, True), seed, None, None, None)),
        "lora_shrink_bwd_keep": (f.lora_shrink_bwd, (t["h"], t["x"], t["A"], *L(1, True), seed, keep, None, None)),
        "lora_shrink_bwd_no_dx": (f.lora_shrink_bwd, (t["h"], t["x"], t["A"], *L(1, False), None, None, None,
                                                      None)),
        "lora_shrink_bwd_gemm": (f.lora_shrink_bwd, (t["h"], t["x"], t["A"], *L(1, True), seed, keep, t["dy"],
                                                     t["W"])),
        "lora_shrink_expand": (f.lora_shrink_expand, (t["x"], t["A"], t["B"], t["y"], *ops._layout(
            segs._replace(token_slots=_TOKEN_SLOTS.to(device, torch.int32)), table))),
    }
    fn, args = cases[op]
    result = torch.library.opcheck(fn, args)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("grouped", FAMILIES)
def test_backward_ops_read_the_layouts_chunk_tables(grouped, device):
    """The backward ops given the layout's chunk tables (``backward.with_tables``, as ``Router.begin`` builds them
    for a training call) return what they return building their own, with no chunk table built; and they read them:
    slot 1's chunks marked unused in the tables leave its tokens' ``dh`` and ``dx`` rows zero (the other rows
    unchanged), so a table that misses one slot's rows fails here."""
    from fast_multilora.kernels import backward as kb

    g = torch.Generator().manual_seed(8)
    S, R = 150, sum(RANKS)  # slots of 30-40 rows: several chunks each at the interpreter's 16- and 32-row chunks
    ts = torch.randint(-1, len(RANKS), (S,), generator=g)
    t = {"x": torch.randn(S, K, generator=g), "A": torch.randn(R, K, generator=g) / K**0.5,
         "B": torch.randn(N, R, generator=g), "h": torch.randn(S, max(RANKS), generator=g),
         "dy": torch.randn(S, N, generator=g)}
    t = {k: v.to(device) for k, v in t.items()}
    table = make_table(RANKS, dropout=DROPOUT, device=device)
    segs = make_segments(ts, grouped, device=device)
    segs = segs._replace(grouping=kb._grouping(segs, len(RANKS)), cache={})  # as the device builders carry it
    seed = torch.tensor([99], dtype=torch.int32, device=device)

    def run(s):
        dh, dB = ops.lora_expand_bwd(t["dy"], t["h"], t["B"], s, table)
        dx, dA = ops.lora_shrink_bwd(dh, t["x"], t["A"], s, table, seed=seed)
        return dh, dB, dx, dA

    want = run(segs)
    with_tables = kb.with_tables(segs)
    info, cptr = with_tables.chunk_tables
    assert info.shape[0] > 1, info.shape  # several chunk lengths: the launchers' picks are among them
    built = []
    real = kb.chunk_table
    kb.chunk_table = lambda *a, **k: built.append(a[1]) or real(*a, **k)
    try:
        got = run(with_tables)
        assert not built, built
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        bad = info.clone()
        bad[..., 0][bad[..., 0] == 1] = -1  # slot 1's chunks: unused
        s_bad = with_tables._replace(chunk_tables=(bad, cptr), cache={})
        dh, _ = ops.lora_expand_bwd(t["dy"], t["h"], t["B"], s_bad, table)
        # dx through the launcher the op calls, into a NaN-filled buffer: every row written, slot 1's as base rows
        dx = torch.full_like(t["x"], float("nan"))
        kb.lora_shrink_bwd(dh, t["x"], t["A"], s_bad, table, seed=seed, dx_out=dx)
    finally:
        kb.chunk_table = real
    rows = (ts == 1).to(device)
    assert rows.any() and (want[0][rows] != 0).any() and (want[2][rows] != 0).any()
    assert (dh[rows] == 0).all() and (dx[rows] == 0).all()
    assert torch.equal(dh[~rows], want[0][~rows])
    assert torch.equal(dx[~rows], want[2][~rows])


def _breaks_and_graphs():
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def _run_mixes(model, compiled, train, packed=False, T=9):
    """Every mix through ``compiled`` (and its LoRA grads when training); returns [(logits, grads)]."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (4, T), generator=g)
    w = torch.randn(4, T, 97, generator=g)
    results = []
    for i, names in enumerate(MIXES):
        model.zero_grad(set_to_none=True)
        kw = dict(adapter_names=names)
        if packed:  # per-token ids into the names, -1 = base: a different cut per mix
            cut = 1 + i % (T - 1)
            kw["adapter_ids"] = torch.tensor([[r] * cut + [(r + 1) % 4 - (r == 2)] * (T - cut) for r in range(4)])
        with torch.set_grad_enabled(train):
            out = compiled(input_ids=ids, **kw).logits
        if train:
            (out * w).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.detach(), grads))
    return results


# one corner of the grid by default (training, packed rows, the store: the default stack), the rest marked slow (the
# Triton corners cost 25-40 s of a core each under the interpreter; Triton ops under compile stay in the default run
# through test_compiled_graphs_hold_the_ops, the gradcheck and the store cases below)
_DEFAULT_GRID = {("torch", True, True, True)}
_GRID = [pytest.param(b, t, p, s, id=f"{b}-{'train' if t else 'eval'}-{'adapter_ids' if p else 'names'}-"
                                      f"{'store' if s else 'params'}",
                      marks=() if (b, t, p, s) in _DEFAULT_GRID else pytest.mark.slow)
         for b in ("torch", "triton") for t in (True, False) for p in (False, True) for s in (False, True)]


@pytest.mark.parametrize("backend, train, packed, store", _GRID)
def test_compiled_model_one_graph_for_every_mix(backend, train, packed, store, device):
    """A patched tiny Llama under ``torch.compile(model, backend="aot_eager")``: one graph, no graph break, no
    recompilation over six adapter mixes; logits and LoRA grads equal eager's (fp32-tight). ``store``: both models'
    adapters in the adapter store (``fast_multilora.store``, the default), whose leaves the layers take; else
    ``adapter_store=False``, every layer call taking PEFT's parameters. Two decoder layers: this fp32-tight bound
    holds for them (with one, a cancelling entry of a LoRA grad differs by 7e-6 absolute, summation order). On the
    per-parameter path the traced graph gives the adapters without rows exact zero gradients (it does not know which
    adapters a call's batch names), eager none."""
    model = peft_model("llama").to(device)
    eager = twin(model)
    fast_multilora.patch(model, backend=backend, adapter_store=store)
    fast_multilora.patch(eager, backend=backend, adapter_store=store)
    if store:
        from fast_multilora.store import AdapterStore

        assert AdapterStore.of(model).slots and AdapterStore.of(eager).slots
    model.train(train)
    eager.train(train)
    got = _run_mixes(model, torch.compile(model, backend="aot_eager"), train, packed)
    assert _breaks_and_graphs() == (0, 1), (dict(counters["graph_break"]), dict(counters["stats"]))
    want = _run_mixes(eager, eager, train, packed)
    for (out, grads), (w_out, w_grads) in zip(got, want, strict=True):
        _same(out, w_out, backend)
        if store:
            assert set(grads) == set(w_grads)
        else:  # (traced, the per-parameter path gives the adapters without rows exact zeros; eager, none)
            assert set(w_grads) <= set(grads)
            assert all(not grads[n].any() for n in set(grads) - set(w_grads))
        for n, gw in w_grads.items():
            _same(grads[n], gw, backend, n)


@pytest.mark.parametrize("T", [9, 20], ids=["decode", "segmented"])
def test_compiled_eval_of_few_rows_takes_the_decode_op(T, device, monkeypatch):
    """Compiled eval of at most ``kernels.DECODE_MAX_ROWS`` rows (4 x 9) runs the one-launch decode op in the graph
    (``fast_multilora::lora_shrink_expand``: no shrink, no expand, no chunk table), more rows (4 x 20) the shrink and
    the expand; one graph over the mixes, logits equal eager's (which takes the same kernels)."""
    from fast_multilora.kernels import api as K

    model = peft_model("llama", layers=1).to(device)
    eager = twin(model)
    for m in (model, eager):
        fast_multilora.patch(m, backend="triton")
        m.eval()
    ran = []
    for n in ("lora_shrink", "lora_expand", "lora_shrink_expand"):
        fn = getattr(K, n)
        monkeypatch.setattr(K, n, lambda *a, _n=n, _fn=fn, **k: (ran.append(_n), _fn(*a, **k))[1])
    got = _run_mixes(model, torch.compile(model, backend="aot_eager"), False, T=T)
    assert _breaks_and_graphs() == (0, 1), (dict(counters["graph_break"]), dict(counters["stats"]))
    assert set(ran) == ({"lora_shrink_expand"} if T == 9 else {"lora_shrink", "lora_expand"}), set(ran)
    for (out, _), (w_out, _) in zip(got, _run_mixes(eager, eager, False, T=T), strict=True):
        _same(out, w_out, "triton")


def _same(got, want, backend, what=""):
    """fp32-tight: the compiled graph sums the members' input gradients in its own order, and reads concatenated
    weights where eager Triton reads them in place (the torch backend: AOTAutograd's decompositions of its ops)."""
    # absolute floor 1e-6: the logits and most grads here are O(1); a grad that cancels to ~1e-8 is noise
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * max(1.0, want.abs().max().item()),
                               msg=lambda m: f"{backend} {what}: {m}")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_compiled_training_with_dropout(backend, device):
    """LoRA dropout under ``torch.compile``: still one graph for every mix (the seed is drawn on the device inside
    the graph, the torch backend's mask from torch's RNG); each step draws a new mask, and with the same RNG state
    two compiled steps agree."""
    model = peft_model("llama", dropout=0.3, layers=1).to(device)
    fast_multilora.patch(model, backend=backend)
    model.train()
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, 97, (4, 9), generator=torch.Generator().manual_seed(1))
    outs = []
    for names in MIXES[:3] + [MIXES[0], MIXES[0]]:
        torch.manual_seed(0 if len(outs) >= 3 else len(outs))
        out = compiled(input_ids=ids, adapter_names=names).logits
        out.sum().backward()
        outs.append(out.detach())
        assert all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())
    assert _breaks_and_graphs() == (0, 1)
    assert torch.equal(outs[3], outs[4])  # the same RNG state: the same masks
    torch.manual_seed(5)
    other = compiled(input_ids=ids, adapter_names=MIXES[0]).logits.detach()
    assert not torch.equal(other, outs[3])  # another RNG state: other masks


def _called(node) -> tuple:
    """The callables a traced graph node calls: its target, and a mutating op under ``auto_functionalized_v2`` (its
    first argument)."""
    return tuple(t for t in (node.target, *node.args[:1]) if callable(t)) if node.op == "call_function" else ()


def test_compiled_graphs_hold_the_ops(device):
    """The compiled forward and backward graphs hold the Triton ops (the delta is traced, not run between graphs),
    the expand in both modes (fused base: write mode; a hooked base: add mode), one shrink per layer call, and the
    fused base's GEMM inside the expand op (forward) and the shrink backward op (dx) -- no ``aten.mm`` / ``addmm``
    of its own in the graphs (SGEMM family)."""
    from torch._dynamo.backends.common import aot_autograd

    model = peft_model("llama", layers=1).to(device)
    model.base_model.model.model.layers[0].mlp.down_proj.base_layer.register_forward_hook(lambda m, a, o: o)
    fast_multilora.patch(model, backend="triton", family="sgemm")  # (9-token rows would take the chunked family)
    seen, shrinks, gemms = set(), [], []

    def record(gm, _example_inputs):
        n_gemm = 0
        for node in gm.graph.nodes:
            for target in _called(node):
                if isinstance(target, torch._ops.OpOverload) and target.namespace == "fast_multilora":
                    seen.add(target.name())
                    if target.name() == "fast_multilora::lora_shrink":
                        shrinks.append(node)
                    if target.name() == "fast_multilora::lora_expand":  # (mutating: auto_functionalized's kwargs)
                        n_gemm += node.kwargs["a"] is not None
                    if target.name() == "fast_multilora::lora_shrink_bwd":
                        n_gemm += node.args[7] is not None
        gemms.append(n_gemm)
        return make_boxed_func(gm)

    ids = torch.randint(0, 97, (4, 9)).to(device)
    out = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record))(
        input_ids=ids, adapter_names=MIXES[0]).logits
    out.sum().backward()
    assert seen == {f"fast_multilora::{op}" for op in ("lora_shrink", "lora_expand", "lora_expand_bwd",
                                                       "lora_shrink_bwd")}
    assert _breaks_and_graphs() == (0, 1)
    # forward: the 6 fused layers (the hooked down_proj is not); backward: those whose input needs a gradient (the
    # frozen embeddings' q/k/v do not)
    assert gemms == [6, 3], gemms
    # every LoRA layer call shrinks its own input (no state passes between layer calls): 7 in the decoder layer
    assert len(shrinks) == 7, len(shrinks)


def test_compiled_training_on_the_adapter_store_reads_b_as_it_lies(device):
    """On the adapter store, a compiled train step hands each layer's packed B block to the expand ops as it is and
    gets its gradient back in that layout: in the forward graph every ``lora_expand`` takes a ``b_leaf`` input
    itself, in the backward graph every ``lora_expand_bwd`` takes a graph input (the saved leaf) and its ``dB`` is
    returned without a cat, permute or copy in between (the per-call ``B_cat`` rearrangement and ``packed_grad`` are
    gone); the gradients equal eager's."""
    from torch._dynamo.backends.common import aot_autograd

    model = peft_model("llama", layers=1).to(device)
    eager = twin(model)
    for m in (model, eager):
        fast_multilora.patch(m, backend="triton", adapter_store=True)
        m.train()
    fw, bw = [], []

    def recorder(into):
        def record(gm, _example_inputs):
            into.append(gm)
            return make_boxed_func(gm)
        return record

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=recorder(fw), bw_compiler=recorder(bw)))
    ids = torch.randint(0, 97, (4, 9), generator=torch.Generator().manual_seed(3)).to(device)
    compiled(input_ids=ids, adapter_names=MIXES[0]).logits.sum().backward()
    eager(input_ids=ids, adapter_names=MIXES[0]).logits.sum().backward()
    assert _breaks_and_graphs() == (0, 1) and len(fw) == len(bw) == 1
    expand = torch.ops.fast_multilora.lora_expand.default
    expand_bwd = torch.ops.fast_multilora.lora_expand_bwd.default
    n_layers = sum(1 for m in model.modules() if isinstance(m, LoraLayer))
    f_calls = [n for n in fw[0].graph.nodes if expand in _called(n)]  # auto_functionalized: y is mutated
    assert len(f_calls) == n_layers, (len(f_calls), n_layers)
    for n in f_calls:
        b = n.kwargs["B_cat"] if "B_cat" in n.kwargs else n.args[1]
        assert b.op == "placeholder" and b.meta["val"].dim() == 1, (n, b)  # a graph input, the packed 1-D block
    b_calls = [n for n in bw[0].graph.nodes if n.target is expand_bwd]
    assert len(b_calls) == n_layers, (len(b_calls), n_layers)
    out = next(n for n in bw[0].graph.nodes if n.op == "output")
    for n in b_calls:
        b = n.args[2]
        assert b.op == "placeholder" and b.meta["val"].dim() == 1, (n, b)  # the saved leaf, as it is
        (db,) = [u for u in n.users if u.args[1] == 1]  # getitem(call, 1): dB
        assert list(db.users) == [out], (n, list(db.users))
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    want = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert set(grads) == set(want) and any("lora_B" in n for n in grads)
    for n, g in want.items():
        _same(grads[n], g, "triton", n)


@pytest.mark.parametrize("packed", [False, True], ids=["names", "adapter_ids"])
def test_compiled_graphs_take_the_entry_layout_and_copy_no_base_output(packed, device, monkeypatch):
    """The layout is built once per call at the model's entry and enters the graph as inputs: no sort or
    searchsorted (the layout builders' ops) in the traced graphs -- built per layer, the 8-layer benchmark model's
    eval graph ran 56 sorts. And no ``aten.addmm``: a fused layer's base GEMM is added in place inside the expand op
    (SGEMM) or runs first and the LoRA ops add into it (chunked), where a traced ``Tensor.addmm_`` would become an
    ``addmm`` that copies its input. The op calls of one layout share its
    validation memos (``ops._shared_memos``): each kind of (layout, layer table) is checked once, as in eager mode.
    The backward's chunk tables come with the entry layout (``backward.with_tables``, graph inputs like the
    layout's own tensors): no op call builds one, and another mix (other tables) runs the same graph. The shared
    memos hold no table."""
    from fast_multilora.kernels import backward as kb
    from fast_multilora.kernels import forward as kf
    from fast_multilora.kernels import launch
    from torch._dynamo.backends.common import aot_autograd

    model = peft_model("llama", layers=1).to(device)
    fast_multilora.patch(model, backend="triton")
    model.train()
    marks, built = [], []
    monkeypatch.setattr(ops, "_SHARED", {})  # memos of earlier tests' layouts of the same kind would hit
    for mod in (kf, kb):
        real_mark = mod.mark_checked
        monkeypatch.setattr(mod, "mark_checked",
                            lambda s, t, k, real=real_mark: marks.append((k, launch._table_key(t))) or real(s, t, k))
    real_chunk_table, real_tables = kb.chunk_table, kb.chunk_tables
    monkeypatch.setattr(kb, "chunk_table", lambda *a, **k: built.append(a[1]) or real_chunk_table(*a, **k))
    entry = []  # the entry's tables: called eagerly by Router.begin, once per forward call with a new routing
    monkeypatch.setattr(kb, "chunk_tables", lambda *a, **k: entry.append(torch.compiler.is_compiling())
                        or real_tables(*a, **k))
    ops_seen = []

    def record(gm, _example_inputs):
        ops_seen.extend(str(t) for n in gm.graph.nodes for t in _called(n))
        return make_boxed_func(gm)

    compiled = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    ids = torch.randint(0, 97, (4, 9)).to(device)
    kw = dict(adapter_names=MIXES[0])
    if packed:
        kw = dict(adapter_names=["a0", "a1", "a2"], adapter_ids=torch.tensor([[0] * 4 + [1] * 5, [2] * 9,
                                                                             [-1] * 3 + [0] * 6, [1] * 9]))
    compiled(input_ids=ids, **kw).logits.sum().backward()
    assert _breaks_and_graphs() == (0, 1)
    assert any("lora_shrink_bwd" in o for o in ops_seen), "no backward graph recorded"
    bad = sorted({o for o in ops_seen if any(k in o for k in ("aten.sort", "searchsorted", "aten.addmm"))})
    assert not bad, bad
    assert not built, built  # every backward op call sliced the entry layout's tables
    assert entry == [False], entry
    # each kind of layer table checked once per layout and direction (unshared: by every op call of its layer)
    assert marks and len(marks) == len(set(marks)), sorted(marks)
    if not packed:  # the same names again: the same routing and layout, nothing checked twice
        marks.clear()
        compiled(input_ids=ids, **kw).logits.sum().backward()
        assert not marks, marks
        kw = dict(adapter_names=MIXES[3])
    else:
        kw["adapter_ids"] = kw["adapter_ids"].flip(1)
    compiled(input_ids=ids, **kw).logits.sum().backward()  # another mix: its own tables, the same graph
    assert _breaks_and_graphs() == (0, 1) and not built and entry == [False, False], (entry, built)
    held = [e for memos in ops._SHARED.values() for memo in memos.values() for e in memo]
    assert held and all(type(e) is tuple and not any(torch.is_tensor(v) for v in e) for e in held), \
        "a shared memo holds a table"


@pytest.mark.parametrize("grouped", FAMILIES)
@pytest.mark.interpreter
def test_compiled_layer_gradchecks_in_float64(grouped):
    """float64 gradcheck of a compiled layer call (``aot_eager``, one graph) with dropout, through the ops: fused,
    the delta written (SGEMM) or added into the base GEMM's output (chunked) and the base added inside the expand
    op, the backward's dx written and ``dy W`` added inside the shrink-backward op; unfused, the delta added into a
    copy of the base output (what
    only a compiled call does). The seed is a device tensor, as the compiled path draws it. Also equal to the eager
    call."""
    from helpers import random_token_slots
    from test_function import _call, _gradcheck, _weights, delta, fused

    g = torch.Generator().manual_seed(0)
    S, K, N, ranks = 13, 5, 6, [2, 0, 1, 3]
    ts = random_token_slots(S, len(ranks), g)
    As, Bs = _weights(ranks, K, N, torch.float64, g)
    x = torch.randn(S, K, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(S, N, generator=g, dtype=torch.float64, requires_grad=True)
    W, b = torch.randn(N, K, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    kw = dict(dropout=[0.5, 0, 0.25, 0.1], seed=torch.tensor([1234], dtype=torch.int32))
    fcall = _call(ts, ranks, grouped, "triton", fused=True, **kw)
    dcall = _call(ts, ranks, grouped, "triton", **kw)
    f_fused = torch.compile(lambda x, *w: fused(x, W, b, fcall, *w), backend="aot_eager", fullgraph=True)
    f_delta = torch.compile(lambda x, y, *w: delta(x, y, dcall, *w), backend="aot_eager", fullgraph=True)
    assert _gradcheck(f_fused, (x, *As, *Bs), "triton")
    assert _gradcheck(f_delta, (x, y, *As, *Bs), "triton")
    assert _breaks_and_graphs() == (0, 2)
    torch.testing.assert_close(f_fused(x, *As, *Bs), fused(x, W, b, fcall, *As, *Bs))
    torch.testing.assert_close(f_delta(x, y, *As, *Bs), delta(x, y.clone(), dcall, *As, *Bs))


def test_inductor_adds_the_base_gemm_in_place():
    """Under Inductor (CPU here; the same passes run for CUDA), a fused layer call (SGEMM family) adds its base GEMM
    inside the expand op (forward) and the shrink backward op (``dx``), on the buffers they write: the generated code
    holds no GEMM of its own (``extern_kernels.mm`` / ``addmm``: a traced ``Tensor.addmm_`` is lowered to an
    out-of-place ``addmm``, which copies its input first) and no copy or clone; the expand op mutates the buffer it
    is given in place. Equal to eager."""
    from helpers import random_token_slots
    from test_function import _call, _need_interpreter, _weights, fused
    from torch._inductor.utils import run_and_get_code

    _need_interpreter("triton")
    g = torch.Generator().manual_seed(0)
    S, K, N, ranks = 40, 16, 24, [2, 0, 1, 3]
    ts = random_token_slots(S, len(ranks), g)
    As, Bs = _weights(ranks, K, N, torch.float32, g)
    x = torch.randn(S, K, generator=g, requires_grad=True)
    W, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    call = _call(ts, ranks, False, "triton", fused=True)

    def step(x, *w):
        out = fused(x, W, b, call, *w)
        out.square().sum().backward()
        return out.detach()

    ws = [*As, *Bs]
    got, code = run_and_get_code(torch.compile(step, backend="inductor"), x, *ws)
    got_grads = [t.grad.clone() for t in (x, *ws)]
    for t in (x, *ws):
        t.grad = None
    want = step(x, *ws)
    assert len(code) == 2, len(code)  # forward and backward
    for src in code:
        body = src[src.index("def call("):]
        assert not any(k in body for k in ("clone", "copy_", "extern_kernels")), body
    fwd = code[0][code[0].index("def call("):]
    assert fwd.count("torch.ops.fast_multilora.lora_expand.default(") == 1, fwd  # (in place: no result taken)
    assert "= torch.ops.fast_multilora.lora_expand" not in fwd, fwd
    assert code[1].count("torch.ops.fast_multilora.lora_shrink_bwd.default(") == 1, code[1]
    torch.testing.assert_close(got, want)
    for a, t in zip(got_grads, (x, *ws), strict=True):
        torch.testing.assert_close(a, t.grad)


@pytest.mark.parametrize("kind", ["rows", "grouped"])
def test_device_layouts_match_the_host_builder(kind, device):
    """The layouts the layers build on the device from a slot tensor (``row_segments``: one segment per row;
    ``grouped_segments``: rows sorted by slot, a segment per slot) give the kernels' results of the host-built layout
    of the same tokens, forward and backward; the backward grouping they carry equals the one the backward launchers
    derive themselves."""
    from fast_multilora.kernels import backward as KB
    from fast_multilora.kernels.segments import grouped_segments, row_segments

    g = torch.Generator().manual_seed(11)
    rows, T, n = 6, 7, len(RANKS)
    row_slots = torch.tensor([2, -1, 0, 3, 0, 2], dtype=torch.int32)
    ts = row_slots.repeat_interleave(T) if kind == "rows" else torch.randint(-1, n, (rows * T,), generator=g)
    dev_segs = (row_segments(row_slots.to(device), T, n) if kind == "rows"
                else grouped_segments(ts.to(torch.int32).to(device), n))
    host_segs = make_segments(ts, grouped=kind != "rows", device=device)
    assert torch.equal(dev_segs.token_slots.long().cpu(), ts.long())
    order, bounds = KB._grouping(dev_segs._replace(grouping=None, cache={}), n)
    assert torch.equal(dev_segs.grouping[0], order) and torch.equal(dev_segs.grouping[1], bounds)
    table = make_table(RANKS, device=device)
    S, R = rows * T, sum(RANKS)
    x, dy = torch.randn(S, K, generator=g).to(device), torch.randn(S, N, generator=g).to(device)
    A, B = torch.randn(R, K, generator=g).to(device), torch.randn(N, R, generator=g).to(device)
    from fast_multilora.kernels import api as KK

    results = []
    for segs in (dev_segs, host_segs):
        h = KK.lora_shrink(x, A, segs, table, out=torch.zeros(S, max(RANKS), device=device))
        y = KK.lora_expand(h, B, segs, table, torch.zeros(S, N, device=device))
        dh, dB = KK.lora_expand_bwd(dy, h, B, segs, table)
        dx, dA = KK.lora_shrink_bwd(dh, x, A, segs, table)
        results.append((h, y, dB, dx, dA))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, b.abs().max().item()))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_static_cache_generation_compiles_once_for_every_mix(backend, device):
    """``generate(..., cache_implementation="static")``: transformers compiles the decode step (here with
    ``aot_eager``, its compile forced on CPU); three mixes give eager's tokens, with no graph break and no graph
    beyond the first mix's (prefill and decode)."""
    from transformers import CompileConfig

    model = peft_model("llama", layers=1).to(device).eval()
    fast_multilora.patch(model, backend=backend)
    ids = torch.randint(0, 97, (4, 6), generator=torch.Generator().manual_seed(4)).to(device)
    cc = CompileConfig(backend="aot_eager", fullgraph=False)
    cc._compile_all_devices = True  # transformers compiles on CUDA only by default
    graphs = []
    for names in (MIXES[0], MIXES[1], MIXES[4]):
        kw = dict(input_ids=ids, adapter_names=names, max_new_tokens=5, do_sample=False, pad_token_id=0)
        want = model.generate(**kw)
        got = model.generate(**kw, cache_implementation="static", compile_config=cc)
        assert torch.equal(got, want), names
        graphs.append(counters["stats"]["unique_graphs"])
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert graphs[0] >= 1 and graphs[-1] == graphs[0], graphs


def test_static_cache_generation_on_the_adapter_store_reads_the_leaves_as_they_are(device):
    """``PatchConfig(adapter_store=True)``: the compiled decode step's graph takes each layer's two store leaves and
    no adapter parameter, hands them to the decode op as they are (no concatenation, permutation or copy of a
    weight) and one adapter table per distinct kind of layer (equal tables are shared); eager's tokens over three
    mixes, no graph break, no graph after the first mix's."""
    from test_paths import _fast_states
    from transformers import CompileConfig

    graphs = []

    def record(gm, _example_inputs, **_kw):
        graphs.append(gm)
        return gm.forward

    model = peft_model("llama", layers=1).to(device).eval()
    report = fast_multilora.patch(model, backend="triton", adapter_store=True)
    assert report.config.adapter_store
    ids = torch.randint(0, 97, (4, 6), generator=torch.Generator().manual_seed(4)).to(device)
    cc = CompileConfig(backend=record, fullgraph=False)
    cc._compile_all_devices = True
    for names in (MIXES[0], MIXES[1], MIXES[4]):
        kw = dict(input_ids=ids, adapter_names=names, max_new_tokens=5, do_sample=False, pad_token_id=0)
        want = model.generate(**kw)
        assert torch.equal(model.generate(**kw, cache_implementation="static", compile_config=cc), want), names
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert len(graphs) == 1, len(graphs)  # the decode step (transformers runs the prefill eagerly)
    inputs = [n for n in graphs[0].graph.nodes if n.op == "placeholder"]
    assert not [n.name for n in inputs if "lora_A" in n.name or "lora_B" in n.name]
    leaves = [n for n in inputs if n.name.endswith(("a_leaf", "b_leaf"))]
    n_layers = sum(1 for m in model.modules() if isinstance(m, LoraLayer))
    assert len(leaves) == 2 * n_layers, (len(leaves), n_layers)
    for leaf in leaves:  # read by the decode op itself: no cat, permute, reshape or clone of a weight in between
        assert [u.target for u in leaf.users] == [torch.ops.fast_multilora.lora_shrink_expand], leaf.users
    tables = {id(state.table) for state in _fast_states(model)}
    assert len([n for n in inputs if n.name.endswith("table_ranks")]) == len(tables)
    # a0 on q/v, a1 on all seven, a2 on q/gate/up/down: q, v, {k, o} and {gate, up, down} -- 4 tables for 7 layers
    assert len(tables) == 4, len(tables)
