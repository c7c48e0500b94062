"""``kernels.adamw`` (chunk tables, the one-launch AdamW step, per-adapter squared gradient norms and gradient
scaling) and their references in ``fast_multilora.reference``, against ``torch.optim.AdamW`` run per adapter and
``torch.linalg.vector_norm``: odd block sizes (1, 7, 123, 4097, 2*CHUNK+3), a layout of multiples of 8 (the
kernels' alignment hint: 16-byte vector accesses on the GPU), shuffled blocks with gaps, an empty block,
an adapter without blocks, 1 / 4 / 130 adapters, per-adapter lr / betas / eps / weight decay / step counts, adapters
switched off per step, several consecutive steps, float32 / bfloat16 / float16. Gaps and never-active adapters hold
signalling NaNs: any arithmetic on them would quiet them, so bit-equality proves they were not touched."""

import functools
import os
import textwrap
from dataclasses import dataclass

import pytest
import torch
from fast_multilora.kernels import adamw
from fast_multilora.kernels.adamw import CHUNK, chunk_table
from helpers import compile_for_sm90

from fast_multilora import cpu_ops
from fast_multilora import reference as ref

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_ON_GPU = os.environ.get("FML_TEST_DEVICE", "cpu") == "cuda"  # conftest's switch
IMPLS = {
    "triton": (adamw.adamw_scalars_, adamw.adamw_step_, adamw.grad_sq_norms, adamw.scale_grads_),
    "torch": (ref.adamw_scalars_reference, ref.adamw_step_reference, ref.grad_sq_norms_reference,
              ref.scale_grads_reference),
    # the torch backend's step on CPU arenas (fast_multilora.cpu_ops): the reference's math on whole buffers, on the
    # active adapters' elements gathered (what it does when they are under half of the arena), ...
    "cpu": (ref.adamw_scalars_reference, functools.partial(cpu_ops.adamw_step, way="whole"),
            ref.grad_sq_norms_reference, ref.scale_grads_reference),
    "cpu_gather": (ref.adamw_scalars_reference, functools.partial(cpu_ops.adamw_step, way="gather"),
                   ref.grad_sq_norms_reference, ref.scale_grads_reference),
    # ... and on runs of adjacent elements of adapters with equal scalars, in slices (what it does when the runs
    # are long: adapters that share their settings and step count and lie side by side)
    "cpu_runs": (ref.adamw_scalars_reference, functools.partial(cpu_ops.adamw_step, way="runs"),
                 ref.grad_sq_norms_reference, ref.scale_grads_reference),
}
# signalling NaNs (quiet bit clear): loads and stores keep the bits, arithmetic sets the quiet bit
_SNAN = {torch.float32: (torch.int32, 0x7FA5A5A5), torch.bfloat16: (torch.int16, 0x7FA5),
         torch.float16: (torch.int16, 0x7D55)}
_ACTIVE_DTYPE = {torch.float32: torch.bool, torch.bfloat16: torch.int32, torch.float16: torch.int8}


@dataclass(frozen=True)
class Case:
    n_adapters: int
    big: tuple  # blocks of these sizes are dealt to adapters 0, 1, ... besides 1-2 small blocks each
    chunk: int = CHUNK
    steps: int = 3
    small: int = 2  # each adapter has 1..small blocks of 1-39 elements
    align: int = 1  # every block start, size and gap a multiple of this (the kernels' alignment hint)

    @property
    def id(self):
        return f"A{self.n_adapters}-C{self.chunk}" + (f"-L{self.align}" if self.align > 1 else "")


# the interpreter runs one program per chunk: 130 adapters use short chunks (a 4096-wide tile per tiny block is slow)
CASES = [Case(1, (1, 7, 123, 4097, 2 * CHUNK + 3)), Case(4, (1, 7, 123, 4097, 2 * CHUNK + 3), steps=2),
         Case(130, (1, 7, 123, 300), chunk=64, steps=2, small=1),
         Case(4, (8, 120, 4096, 2 * CHUNK + 16), steps=2, small=1, align=8)]
_NO_BLOCKS = 7  # in the 130-adapter case, an adapter without elements
_NEVER = 3  # ... and one never active


def _layout(case: Case, gen):
    """``(blocks, numel)``: blocks ``(start, size, adapter)`` in shuffled order with gaps of 0-4 elements (times
    ``case.align``, as the small blocks' sizes)."""
    q = case.align
    sizes = [(q * int(torch.randint(1, 40, (1,), generator=gen)), a) for a in range(case.n_adapters)
             for _ in range(int(torch.randint(1, case.small + 1, (1,), generator=gen)))]
    sizes += [(s, i % case.n_adapters) for i, s in enumerate(case.big)] + [(0, 0)]
    if case.n_adapters > _NO_BLOCKS:
        sizes = [(s, a) for s, a in sizes if a != _NO_BLOCKS]
    blocks, pos = [], q * int(torch.randint(0, 5, (1,), generator=gen))
    for i in torch.randperm(len(sizes), generator=gen).tolist():
        blocks.append((pos, *sizes[i]))
        pos += sizes[i][0] + q * int(torch.randint(0, 5, (1,), generator=gen))
    return blocks, pos + 3


def _covered(blocks, numel, adapters=None):
    m = torch.zeros(numel, dtype=torch.bool)
    for s, n, a in blocks:
        if adapters is None or a in adapters:
            m[s:s + n] = True
    return m


def _poison(t, mask):
    int_dtype, bits = _SNAN[t.dtype]
    t.view(int_dtype)[mask.to(t.device)] = bits


def _assert_untouched(t, mask, what):
    int_dtype, bits = _SNAN[t.dtype]
    got = t.view(int_dtype)[mask.to(t.device)]
    assert bool((got == bits).all()), f"{what}: {int((got != bits).sum())} poisoned elements were touched"


def _f32(x) -> float:
    return float(torch.tensor(x, dtype=torch.float32))  # torch gets the float32 values the kernels read


def _hyper(n, gen):
    """Per-adapter (lr, beta1, beta2, eps, wd) and step counts before the first step (0 = a fresh adapter);
    beta1 = 0.3 and 0 take lerp's weight >= 0.5 branch, beta1 = 0 also has 1 - beta1^t = 1."""
    def pick(choices):
        return [choices[i] for i in torch.randint(0, len(choices), (n,), generator=gen).tolist()]
    lr = (10 ** (-4 + 2.5 * torch.rand(n, generator=gen))).tolist()
    rows = [[_f32(x) for x in r] for r in zip(lr, pick([0.9, 0.8, 0.3, 0.0]), pick([0.999, 0.99, 0.95, 0.9999]),
                                              pick([1e-8, 1e-6, 1e-3]), pick([0.0, 0.01, 0.1]), strict=True)]
    steps0 = torch.randint(0, 2000, (n,), generator=gen)
    steps0[torch.rand(n, generator=gen) < 0.3] = 0
    return rows, steps0.tolist()


def _active_masks(case: Case, gen):
    masks = torch.rand(case.steps, case.n_adapters, generator=gen) < 0.7
    if case.n_adapters == 1:
        masks[:, 0] = torch.tensor([True, False, True])[:case.steps]
    else:
        masks[0] = True
        masks[:, _NEVER] = False
    return masks


class _Arena:
    """Random arena buffers: parameters, float32-exact first and second moments, NaN-poisoned gaps."""

    def __init__(self, case: Case, dtype, device, gen):
        self.blocks, self.numel = _layout(case, gen)
        self.gaps = ~_covered(self.blocks, self.numel)
        n = self.numel
        self.p = (0.05 * torch.randn(n, generator=gen)).to(dtype)
        m = 0.1 * torch.randn(n, generator=gen)
        self.m = m.to(dtype)
        self.v = ((m**2 + 1e-4 * torch.rand(n, generator=gen)) * (1 + torch.rand(n, generator=gen))).to(dtype)
        self.p, self.m, self.v = (x.to(device) for x in (self.p, self.m, self.v))
        for t in (self.p, self.m, self.v):
            _poison(t, self.gaps)
        self.table = chunk_table(self.blocks, case.n_adapters, n, device, chunk=case.chunk)

    def grad(self, dtype, device, gen, inactive):
        g = torch.randn(self.numel, generator=gen).to(dtype).to(device)
        _poison(g, self.gaps | _covered(self.blocks, self.numel, inactive))  # an inactive adapter's grad is arbitrary
        return g

    def slices(self, a):
        return [slice(s, s + n) for s, n, b in self.blocks if b == a and n > 0]


class _TorchAdamW:
    """One ``torch.optim.AdamW`` (single-tensor path) per adapter over its blocks as separate tensors, started from
    the arena's moments and the adapter's step count; ``dtype`` is the oracle's own (float32 for the error rule)."""

    def __init__(self, arena: _Arena, rows, steps0, dtype):
        self.arena, self.opts, self.tensors = arena, [], []
        self.moved = [0.0] * len(rows)  # per adapter, the sum over steps of the largest |update|
        for a, (row, s0) in enumerate(zip(rows, steps0, strict=True)):
            ts = [arena.p[sl].to(dtype).clone().requires_grad_() for sl in arena.slices(a)]
            opt = torch.optim.AdamW(ts or [torch.zeros(1, requires_grad=True)], lr=row[0], betas=(row[1], row[2]),
                                    eps=row[3], weight_decay=row[4], foreach=False)
            for t, sl in zip(ts, arena.slices(a), strict=True):
                opt.state[t] = {"step": torch.tensor(float(s0)), "exp_avg": arena.m[sl].to(dtype).clone(),
                                "exp_avg_sq": arena.v[sl].to(dtype).clone()}
            self.opts.append(opt)
            self.tensors.append(ts)

    def step(self, g, active):
        for a in active:
            for t, sl in zip(self.tensors[a], self.arena.slices(a), strict=True):
                t.grad = g[sl].to(t.dtype).clone()
            if self.tensors[a]:
                before = [t.detach().clone() for t in self.tensors[a]]
                self.opts[a].step()
                self.moved[a] += max((t.detach() - b).abs().max().item() for t, b in zip(self.tensors[a], before,
                                                                                        strict=True))

    def cat(self, a, what):
        ts = self.tensors[a]
        if what == "p":
            return torch.cat([t.detach() for t in ts])
        return torch.cat([self.opts[a].state[t][what] for t in ts])


@dataclass
class _Problem:
    """An arena, per-adapter hyperparameters and step counts, and each step's active mask and gradient."""

    arena: _Arena
    rows: list
    steps0: list
    masks: torch.Tensor
    grads: list


@functools.lru_cache(maxsize=None)  # the interpreter is slow: each run is computed once and checked by several tests
def _problem(case: Case, dtype, device) -> _Problem:
    gen = torch.Generator().manual_seed(case.n_adapters * 7 + case.chunk + DTYPES.index(dtype))
    arena = _Arena(case, dtype, device, gen)
    rows, steps0 = _hyper(case.n_adapters, gen)
    masks = _active_masks(case, gen)
    grads = [arena.grad(dtype, device, gen, [a for a in range(case.n_adapters) if not m[a]]) for m in masks]
    return _Problem(arena, rows, steps0, masks, grads)


@functools.lru_cache(maxsize=None)
def _stepped(case: Case, dtype, device, impl) -> list:
    """``[param, grad, exp_avg, exp_avg_sq]`` after ``case.steps`` steps of ``impl`` (none modifies them)."""
    pb = _problem(case, dtype, device)
    hyper = torch.tensor(pb.rows, dtype=torch.float32, device=device)
    count = torch.tensor(pb.steps0, dtype=torch.float32, device=device)
    buffers = [pb.arena.p.clone(), None, pb.arena.m.clone(), pb.arena.v.clone()]
    scalars_, step_ = IMPLS[impl][:2]
    for mask, g in zip(pb.masks, pb.grads, strict=True):
        buffers[1] = g
        active = mask.to(_ACTIVE_DTYPE[dtype]).to(device)
        step_(*buffers, pb.arena.table, scalars_(hyper, count, active), active)
    # each adapter's count went up once per step it was active in (torch counts per stepped tensor)
    assert count.cpu().tolist() == (torch.tensor(pb.steps0) + pb.masks.sum(0)).float().tolist()
    return buffers


@functools.lru_cache(maxsize=None)
def _oracle(case: Case, dtype, device, oracle_dtype) -> _TorchAdamW:
    pb = _problem(case, dtype, device)
    o = _TorchAdamW(pb.arena, pb.rows, pb.steps0, oracle_dtype)
    for mask, g in zip(pb.masks, pb.grads, strict=True):
        o.step(g, [a for a in range(case.n_adapters) if mask[a]])
    return o


def _params(dtypes, impls=("triton", "torch"), many=(torch.float32,)):
    """``(case, dtype, impl)``; on CPU the 130-adapter case (the interpreter's slowest) for the dtypes in ``many``
    only (what it adds, per-adapter indexing, does not depend on the dtype)."""
    return [pytest.param(c, d, i, id=f"{c.id}-{str(d)[6:]}-{i}") for c in CASES for d in dtypes for i in impls
            if c.n_adapters < 100 or d in many or _ON_GPU]


def _check_untouched(case, arena, buffers):
    never = [_NEVER] if case.n_adapters > _NEVER else []
    for what, t in zip(("param", "exp_avg", "exp_avg_sq"), (buffers[0], buffers[2], buffers[3]), strict=True):
        _assert_untouched(t, arena.gaps, f"{what} gaps")
        if never:  # a never-active adapter keeps its start values bit for bit
            m = _covered(arena.blocks, arena.numel, never).to(t.device)
            start = {"param": arena.p, "exp_avg": arena.m, "exp_avg_sq": arena.v}[what]
            assert torch.equal(t.view(_SNAN[t.dtype][0])[m], start.view(_SNAN[t.dtype][0])[m]), what


@pytest.mark.parametrize("case,dtype,impl", _params([torch.float32]))
def test_adamw_float32_matches_torch(case, dtype, impl, device):
    """float32 against torch.optim.AdamW within 4 ulps of the value and of the adapter's updates (rtol 2^-21, atol
    2^-21 * the sum over steps of its largest |update|): the kernels repeat torch's operations and roundings; what
    differs is torch's CPU float32 sqrt (1 ulp off on ~16% of inputs; the kernels' is exact), so an update may differ
    in its last bit (on CUDA torch also divides by a scalar through its reciprocal). exp_avg and exp_avg_sq do not
    depend on it: measured bit-identical on CPU."""
    arena, buffers, o = _problem(case, dtype, device).arena, _stepped(case, dtype, device, impl), _oracle(
        case, dtype, device, dtype)
    for a in range(case.n_adapters):
        if not arena.slices(a):
            continue
        for what, buf in (("p", buffers[0]), ("exp_avg", buffers[2]), ("exp_avg_sq", buffers[3])):
            got = torch.cat([buf[sl] for sl in arena.slices(a)])
            atol = 2**-21 * o.moved[a] if what == "p" else 0.0
            torch.testing.assert_close(got, o.cat(a, what), rtol=2**-21, atol=atol,
                                       msg=lambda m, a=a, what=what: f"adapter {a} {what}: {m}")
    _check_untouched(case, arena, buffers)


@pytest.mark.parametrize("case,dtype,impl", _params([torch.bfloat16, torch.float16]))
def test_adamw_low_precision_matches_torch(case, dtype, impl, device):
    """16-bit buffers: against torch.optim.AdamW on the same 16-bit tensors (foreach=False) within 2 ulps of the
    dtype (of the value, or of the largest magnitude: near zero, p*(1-lr*wd) and the update cancel, and torch rounds
    both first); and (flash-attention's rule) the error against a float32 AdamW run from the same start values and
    grads at most twice torch's own 16-bit error: the kernels round once per value and step, torch after each op."""
    arena, buffers = _problem(case, dtype, device).arena, _stepped(case, dtype, device, impl)
    oracles = {d: _oracle(case, dtype, device, d) for d in (dtype, torch.float32)}
    ulp = torch.finfo(dtype).eps
    for what, buf in (("p", buffers[0]), ("exp_avg", buffers[2]), ("exp_avg_sq", buffers[3])):
        got = torch.cat([buf[sl] for a in range(case.n_adapters) for sl in arena.slices(a)]).float()
        lowp = torch.cat([oracles[dtype].cat(a, what) for a in range(case.n_adapters) if arena.slices(a)]).float()
        fp32 = torch.cat([oracles[torch.float32].cat(a, what) for a in range(case.n_adapters) if arena.slices(a)])
        atol = 2 * ulp * fp32.abs().max().item()
        torch.testing.assert_close(got, lowp, rtol=2 * ulp, atol=atol, msg=lambda m, what=what: f"{what}: {m}")
        err, err_torch = (got - fp32).abs().max().item(), (lowp - fp32).abs().max().item()
        print(f"{case.id} {dtype} {impl} {what}: max error vs float32 {err:.3g}, torch's {err_torch:.3g}, "
              f"max |kernel - torch| {(got - lowp).abs().max().item():.3g}")
        assert err <= 2 * err_torch + 1e-7, f"{what}: error vs float32 {err:.3g}, torch {dtype}'s {err_torch:.3g}"
    _check_untouched(case, arena, buffers)


@pytest.mark.parametrize("case,dtype,impl", _params(DTYPES, ["triton", "cpu", "cpu_gather", "cpu_runs"]))
def test_adamw_kernel_matches_reference(case, dtype, impl, device):
    """The Triton step, and the CPU arenas' step, against the reference: bit-identical on CPU (same scalars,
    operations and roundings); on the GPU within 1 ulp of the dtype. Gaps and never-active adapters untouched."""
    if impl.startswith("cpu") and device != "cpu":
        pytest.skip("the CPU arenas' step")
    _check_untouched(case, _problem(case, dtype, device).arena, _stepped(case, dtype, device, impl))
    got, want = _stepped(case, dtype, device, impl), _stepped(case, dtype, device, "torch")
    for what, i in (("param", 0), ("exp_avg", 2), ("exp_avg_sq", 3)):
        if got[i].is_cpu:
            assert torch.equal(got[i].view(_SNAN[dtype][0]), want[i].view(_SNAN[dtype][0])), what
        else:
            torch.testing.assert_close(got[i], want[i], rtol=torch.finfo(dtype).eps, atol=1e-9, equal_nan=True)


@pytest.mark.parametrize("case,dtype,impl", _params(DTYPES))
def test_grad_sq_norms(case, dtype, impl, device):
    """Per adapter against torch.linalg.vector_norm(...)**2 of its blocks (float32; rtol 1e-5 for the summation
    order), zero without elements, NaN gaps not read, bit-identical on a second call."""
    gen = torch.Generator().manual_seed(case.n_adapters + DTYPES.index(dtype))
    arena = _Arena(case, dtype, device, gen)
    g = arena.grad(dtype, device, gen, [])
    fn = IMPLS[impl][2]
    got = fn(g, arena.table)
    assert got.dtype == torch.float32 and got.shape == (case.n_adapters,)
    want = torch.stack([torch.linalg.vector_norm(torch.cat([g[sl] for sl in arena.slices(a)]).float()) ** 2
                        if arena.slices(a) else torch.zeros((), device=device) for a in range(case.n_adapters)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    if case.n_adapters > _NO_BLOCKS:
        assert got[_NO_BLOCKS].item() == 0.0
    assert torch.equal(fn(g, arena.table), got)


@pytest.mark.parametrize("case,dtype,impl", _params(DTYPES, many=(torch.bfloat16,)))
def test_scale_grads(case, dtype, impl, device):
    """g *= factors[a] (float32 product, rounded once) bit for bit against a per-block product; adapters whose
    factor is 1 hold signalling NaNs and stay untouched, as do the gaps."""
    gen = torch.Generator().manual_seed(case.n_adapters + 11 * DTYPES.index(dtype))
    arena = _Arena(case, dtype, device, gen)
    factors = torch.rand(case.n_adapters, generator=gen) * 2
    factors[torch.rand(case.n_adapters, generator=gen) < 0.3] = 1.0
    factors[0] = 0.5
    ones = [a for a in range(case.n_adapters) if factors[a] == 1.0]
    g = arena.grad(dtype, device, gen, ones)
    want = g.clone()
    for a in range(case.n_adapters):
        for sl in arena.slices(a):
            if factors[a] != 1.0:
                want[sl] = (g[sl].float() * factors[a].item()).to(dtype)
    IMPLS[impl][3](g, arena.table, factors.to(device))
    assert torch.equal(g.view(_SNAN[dtype][0]), want.view(_SNAN[dtype][0]))
    _assert_untouched(g, arena.gaps | _covered(arena.blocks, arena.numel, ones), "grad")


@pytest.mark.parametrize("chunk", [CHUNK, 5, 1])
def test_chunk_table(chunk, device):
    """Chunks of 1..chunk elements tile every non-empty block exactly, sorted by adapter then position;
    ``adapter_ptr`` bounds each adapter's chunks; host counts."""
    gen = torch.Generator().manual_seed(chunk)
    case = Case(9, (0, 1, 7, 123, 4097, 2 * CHUNK + 3) if chunk == CHUNK else (0, 1, 7, 12, 23), chunk=chunk)
    blocks, numel = _layout(case, gen)
    t = chunk_table(blocks, case.n_adapters, numel, device, chunk=chunk)
    start, length, adapter, ptr = (x.cpu().tolist() for x in (t.start, t.length, t.adapter, t.adapter_ptr))
    assert t.start.dtype == torch.int64 and t.length.dtype == t.adapter.dtype == t.adapter_ptr.dtype == torch.int32
    assert all(1 <= n <= chunk for n in length)
    assert list(zip(adapter, start, strict=True)) == sorted(zip(adapter, start, strict=True))
    want = sorted((a, s + i) for s, n, a in blocks for i in range(n))
    assert sorted((a, s + i) for s, n, a in zip(start, length, adapter, strict=True) for i in range(n)) == want
    counts = [adapter.count(a) for a in range(case.n_adapters)]
    assert ptr == [sum(counts[:a]) for a in range(case.n_adapters + 1)]
    assert (t.n_adapters, t.numel, t.chunk, t.max_chunks, t.covered) == (case.n_adapters, numel, chunk, max(counts),
                                                                          len(want))
    empty = chunk_table([], 3, 10, device)
    assert empty.start.numel() == 0 and empty.adapter_ptr.tolist() == [0, 0, 0, 0] and empty.covered == 0


@pytest.mark.parametrize("blocks, chunk, want", [
    ([(0, 32, 0), (48, 16, 1), (64, 4096, 0)], CHUNK, 16),  # every start and length a multiple of 16
    ([(0, 24, 0), (32, 16, 1)], 16, 8),  # the block of 24 ends in a chunk of 8
    ([(0, 32, 0), (32, 32, 1)], 12, 4),  # chunks of 12 start at 12, 24: multiples of 4
    ([(0, 32, 0), (40, 6, 1)], CHUNK, 2),
    ([(0, 32, 0), (33, 16, 1)], CHUNK, 1),  # one odd start
    ([(0, 32, 0), (32, 7, 1)], CHUNK, 1),  # one odd length
    ([], CHUNK, 16),
])
def test_chunk_table_alignment(blocks, chunk, want, device):
    """``align``: the largest power of two up to ``MAX_ALIGN`` dividing every chunk's start and length -- what the
    kernels tell Triton (a wrong one would make the GPU issue misaligned vector accesses); checked against the
    chunks themselves."""
    t = chunk_table(blocks, 2, 5000, device, chunk=chunk)
    assert t.align == want
    assert all(x % t.align == 0 for x in t.start.tolist() + t.length.tolist())
    assert want == adamw.MAX_ALIGN or any(x % (2 * t.align) for x in t.start.tolist() + t.length.tolist())


_PTX_ACCESSES = textwrap.dedent("""
    import collections, re, sys
    from fast_multilora.kernels import adamw as A
    from tune_kernels import sm90_kernel
    dt = sys.argv[1]
    adamw_sig = dict(param=dt, grad=dt, exp_avg=dt, exp_avg_sq=dt, c_start="*i64", c_length="*i32",
                     c_adapter="*i32", scalars="*fp32", active="*i1", c_index="*i32")
    kernels = {
        "adamw": (A._adamw_kernel, adamw_sig, dict(INDEXED=False)),
        "adamw_listed": (A._adamw_kernel, adamw_sig, dict(INDEXED=True)),
        "norm": (A._sq_norm_partial_kernel, dict(grad=dt, c_start="*i64", c_length="*i32", partial="*fp32"), {}),
        "scale": (A._scale_kernel, dict(grad=dt, c_start="*i64", c_length="*i32", c_adapter="*i32",
                  factors="*fp32"), {}),
    }
    for name, (fn, sig, const) in kernels.items():
        for align in (1, 16):
            # (every parameter a pointer: each 16-byte aligned, the arena's alignment is ALIGN's to state)
            ptx = sm90_kernel(fn, sig, dict(const, BLOCK=1024, ALIGN=align), 4, enable_fp_fusion=False).asm["ptx"]
            n = collections.Counter(m.group(1) for m in re.finditer(r"\\b(ld|st)\\.global\\.v4", ptx))
            print(name, align, n["ld"], n["st"])
""")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_alignment_hint_gives_vector_accesses(dtype):
    """Compiled for an H100-class GPU (PTX, no GPU needed; a subprocess without the interpreter): with a table's
    ``align`` of 16 every arena access of the AdamW, norm and scale kernels is a 16-byte vector one (4 loads and 3
    stores of bfloat16 per AdamW thread; twice that in float32); without it (align 1) none is: chunk starts and
    lengths read from the table would otherwise leave Triton 2- or 4-byte accesses (the step at 64 adapters then ran
    at ~60 % of the copy bandwidth). The AdamW kernel over a chunk list (``INDEXED``) the same."""
    out = compile_for_sm90(_PTX_ACCESSES, dtype, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = {(k, int(a)): (int(ld), int(st)) for k, a, ld, st in (line.split() for line in out.stdout.split("\n")
                                                                   if line.strip())}
    per = 1 if dtype == "*bf16" else 2  # 8 elements per thread: one 16-byte vector of bfloat16, two of float32
    assert got == {("adamw", 1): (0, 0), ("adamw", 16): (4 * per, 3 * per), ("adamw_listed", 1): (0, 0),
                   ("adamw_listed", 16): (4 * per, 3 * per), ("norm", 1): (0, 0),
                   ("norm", 16): (per, 0), ("scale", 1): (0, 0), ("scale", 16): (per, per)}


def test_adamw_scalars(device):
    """``adamw_scalars_`` (both implementations; 1100 adapters: two programs): active adapters' counts go up by one
    in place, inactive ones' stay; each active row equals torch's Python-float scalars rounded to float32 bit for
    bit, the triton kernel equal to the reference."""
    gen = torch.Generator().manual_seed(5)
    n = 1100
    rows, steps0 = _hyper(n, gen)
    active = torch.rand(n, generator=gen) < 0.6
    hyper = torch.tensor(rows, dtype=torch.float32, device=device)
    got = {}
    for impl in ("triton", "torch"):
        count = torch.tensor(steps0, dtype=torch.float32, device=device)
        got[impl] = IMPLS[impl][0](hyper, count, active.to(device)).cpu()
        assert count.cpu().tolist() == [float(s + int(a)) for s, a in zip(steps0, active.tolist(), strict=True)]
    assert torch.equal(got["triton"][active], got["torch"][active])
    for a in torch.nonzero(active).flatten().tolist()[:200]:
        lr, b1, b2, eps, wd = (float(x) for x in hyper[a].cpu())
        t = steps0[a] + 1
        want = [1 - lr * wd, 1 - b1, 1 - b2, b2, -lr / (1 - b1**t), (1 - b2**t) ** 0.5, eps, 0.0]
        assert got["triton"][a].tolist() == [_f32(x) for x in want], a


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[3]], ids=lambda c: c.id)
def test_adamw_step_over_a_chunk_list(case, device):
    """``adamw_step_(..., chunks=adapter_chunks(counts, adapters))``: one program per chunk of the listed adapters
    (the optimizer's step of a few adapters of a large registry). ``adapter_chunks`` lists exactly those adapters'
    chunks of the table (an adapter without blocks: none); listing every active adapter and a few inactive ones (whose
    programs exit) gives the whole-table launch's result bit for bit; an active adapter left off is not touched."""
    pb = _problem(case, torch.float32, device)
    table, n = pb.arena.table, case.n_adapters
    ptr = table.adapter_ptr.cpu().long()
    counts = ptr[1:] - ptr[:-1]
    for pick in ([0], [1, 2], list(range(n))) + (([_NO_BLOCKS, _NO_BLOCKS + 1, n - 1],) if n > _NO_BLOCKS else ()):
        want = torch.cat([torch.arange(int(ptr[a]), int(ptr[a + 1])) for a in pick])
        assert torch.equal(adamw.adapter_chunks(counts, pick), want.int()), pick
    assert adamw.adapter_chunks(counts, []).numel() == 0
    mask = pb.masks[1]
    on = torch.nonzero(mask).flatten().tolist()
    off = [a for a in range(n) if not mask[a]]
    hyper = torch.tensor(pb.rows, dtype=torch.float32, device=device)
    scalars = adamw.adamw_scalars_(hyper, torch.tensor(pb.steps0, dtype=torch.float32, device=device),
                                   mask.to(device))

    def run(listed):
        bufs = [pb.arena.p.clone(), pb.grads[1], pb.arena.m.clone(), pb.arena.v.clone()]
        chunks = None if listed is None else adamw.adapter_chunks(counts, sorted(listed)).to(device)
        adamw.adamw_step_(*bufs, table, scalars, mask.to(device), chunks=chunks)
        return bufs

    whole = run(None)
    listed = run(on + off[:2])
    for w, g in zip(whole, listed, strict=True):
        assert torch.equal(w.view(torch.int32), g.view(torch.int32))
    left = next(a for a in on if counts[a] > 0)
    partial = run([a for a in on if a != left])
    m = _covered(pb.arena.blocks, pb.arena.numel, [left]).to(device)
    others = ~m & ~pb.arena.gaps.to(device)
    for got, start, w in zip((partial[0], partial[2], partial[3]), (pb.arena.p, pb.arena.m, pb.arena.v),
                             (whole[0], whole[2], whole[3]), strict=True):
        assert torch.equal(got[m], start[m]) and torch.equal(got[others], w[others])
    with pytest.raises(ValueError, match="chunks"):
        adamw.adamw_step_(*run(None), table, scalars, mask.to(device), chunks=torch.zeros(2, 2, dtype=torch.int32,
                                                                                            device=device))
    with pytest.raises(ValueError, match="chunks"):
        adamw.adamw_step_(*run(None), table, scalars, mask.to(device), chunks=torch.zeros(2, device=device).long())


def test_empty_table(device):
    """No chunks: the step and the scaling launch nothing, the norms are zero."""
    t = chunk_table([(2, 0, 1)], 2, 8, device)
    bufs = [torch.full((8,), 3.0, device=device) for _ in range(4)]
    active = torch.ones(2, dtype=torch.bool, device=device)
    adamw.adamw_step_(*bufs, t, torch.full((2, 8), 0.5, device=device), active)
    adamw.scale_grads_(bufs[1], t, torch.full((2,), 2.0, device=device))
    assert all(bool((b == 3.0).all()) for b in bufs)
    assert adamw.grad_sq_norms(bufs[1], t).tolist() == [0.0, 0.0]


def test_chunk_table_errors(device):
    for blocks, match in [([(0, 4, 0), (3, 2, 1)], "overlap"), ([(8, 4, 0)], "outside"), ([(0, 2, 2)], "outside"),
                          ([(-1, 2, 0)], "outside"), ([(0, -2, 0)], "outside")]:
        with pytest.raises(ValueError, match=match):
            chunk_table(blocks, 2, 10, device)
    with pytest.raises(ValueError, match="chunk"):
        chunk_table([], 2, 10, device, chunk=0)


def test_validation_errors(device):
    t = chunk_table([(0, 5, 0), (6, 3, 1)], 2, 10, device)
    p, g, m, v = (torch.zeros(10, device=device) for _ in range(4))
    sc = torch.zeros(2, 8, device=device)
    active = torch.ones(2, dtype=torch.bool, device=device)
    bad = [
        ((p.view(2, 5), g, m, v, t, sc, active), "1-D"),
        ((torch.zeros(20, device=device)[::2], g, m, v, t, sc, active), "contiguous"),
        ((p, torch.zeros(11, device=device), m, v, t, sc, active), "elements"),
        ((p, g.bfloat16(), m, v, t, sc, active), "dtype"),
        ((p.double(), g.double(), m.double(), v.double(), t, sc, active), "dtype"),
        ((p.int(), g, m, v, t, sc, active), "dtype"),
        ((p, g, m, v, t._replace(start=t.start.to("meta")), sc, active), "table is on"),
        ((p, g, m, v, t, torch.zeros(2, 5, device=device), active), "scalars"),
        ((p, g, m, v, t, sc.double(), active), "scalars"),
        ((p, g, m, v, t, sc, active.float()), "active"),
        ((p, g, m, v, t, sc, active[:1]), "active"),
        ((p, g, m, v, (t.start, t.length), sc, active), "ChunkTable"),
        ((p.tolist(), g, m, v, t, sc, active), "torch.Tensor"),
    ]
    if device != "cpu":
        bad.append(((p.cpu(), g, m, v, t, sc, active), "is on"))
        bad.append(((p, g, m, v, t, sc.cpu(), active), "scalars"))
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            adamw.adamw_step_(*args)
    hyper, step = torch.zeros(2, 5, device=device), torch.ones(2, device=device)
    for args, match in [((torch.zeros(2, 4, device=device), step, active), "hyper"),
                        ((hyper.double(), step, active), "hyper"),
                        ((torch.zeros(3, 5, device=device), step, active), "hyper"),
                        ((hyper, step.long(), active), "step"),
                        ((hyper, step.view(2, 1), active), "step"),
                        ((hyper, step, active.float()), "active"),
                        ((hyper, step, active[:1]), "active")]:
        with pytest.raises(ValueError, match=match):
            adamw.adamw_scalars_(*args)
    with pytest.raises(ValueError, match="factors"):
        adamw.scale_grads_(g, t, torch.ones(3, device=device))
    with pytest.raises(ValueError, match="elements"):
        adamw.grad_sq_norms(torch.zeros(9, device=device), t)
