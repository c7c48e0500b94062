"""``kernels/launch.py``: the cached launch path takes the compiled kernel of an already seen specialisation and
passes every parameter in signature order; anything that changes Triton's specialisation goes through Triton.

The logic runs on CPU with a stand-in for a JIT function (the interpreter has no compiled kernels); on a GPU the
real kernels are launched twice on fresh values and compared with the reference.
"""

from types import SimpleNamespace

import pytest
import torch
from fast_multilora.kernels import launch as L


class _FakeCompiled:
    def __init__(self):
        self.calls = []
        self.function, self.packed_metadata = "fn-handle", "packed"

    def run(self, *a):
        self.calls.append(a)


class _FakeJit:
    """Parameters (x, n, seed, BLOCK: constexpr, FLAG: constexpr); ``seed`` is not specialised."""

    __name__ = "fake_kernel"

    def __init__(self):
        P = SimpleNamespace
        self.params = [P(name="x", num=0, is_constexpr=False, do_not_specialize=False),
                       P(name="n", num=1, is_constexpr=False, do_not_specialize=False),
                       P(name="seed", num=2, is_constexpr=False, do_not_specialize=True),
                       P(name="BLOCK", num=3, is_constexpr=True, do_not_specialize=False),
                       P(name="FLAG", num=4, is_constexpr=True, do_not_specialize=False)]
        self.triton_calls = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.triton_calls.append((grid, args, meta))
            c = _FakeCompiled()
            self.last = c
            return c

        return run


class _T(torch.Tensor):
    pass


@pytest.fixture
def fast(monkeypatch):
    """The cached path switched on, with CPU tensors (``_T``) standing in for device tensors: only
    ``.device.index``, ``.dtype`` and ``.data_ptr()`` are read."""
    monkeypatch.setattr(L, "_ENABLED", True)
    monkeypatch.setattr(L, "_hooks_set", lambda: False)
    monkeypatch.setattr(L, "_stream", lambda dev: 1234)
    monkeypatch.setattr(L, "_KERNELS", {})
    monkeypatch.setattr(_T, "device", property(lambda self: SimpleNamespace(index=0)), raising=False)


def test_cached_launch_passes_all_parameters_in_order(fast):
    fn = _FakeJit()
    x = torch.zeros(64).as_subclass(_T)
    L.launch(fn, (3, 2), (x, 32, 7), dict(BLOCK=16, FLAG=True, num_warps=4))
    assert len(fn.triton_calls) == 1  # first: Triton compiles and launches
    compiled = fn.last
    L.launch(fn, (5,), (x, 48, 99), dict(BLOCK=16, FLAG=True, num_warps=4))  # same specialisation
    assert len(fn.triton_calls) == 1 and len(compiled.calls) == 1
    assert compiled.calls[0] == (5, 1, 1, 1234, "fn-handle", "packed", None, None, None, x, 48, 99, 16, True)
    # each change of specialisation goes through Triton: int == 1, int not a multiple of 16, new constexpr,
    # another dtype, a misaligned pointer
    for args, meta in [((x, 1, 0), dict(BLOCK=16, FLAG=True, num_warps=4)),
                       ((x, 33, 0), dict(BLOCK=16, FLAG=True, num_warps=4)),
                       ((x, 32, 0), dict(BLOCK=32, FLAG=True, num_warps=4)),
                       ((x, 32, 0), dict(BLOCK=16, FLAG=True, num_warps=8)),
                       ((x.double().as_subclass(_T), 32, 0), dict(BLOCK=16, FLAG=True, num_warps=4)),
                       ((x[1:].as_subclass(_T), 32, 0), dict(BLOCK=16, FLAG=True, num_warps=4))]:
        n = len(fn.triton_calls)
        L.launch(fn, (1,), args, meta)
        assert len(fn.triton_calls) == n + 1, (args[1:], meta)
    # the seed is not specialised: a new value reuses the kernel (as long as it fits in int32)
    n = len(fn.triton_calls)
    L.launch(fn, (1,), (x, 32, 123456), dict(BLOCK=16, FLAG=True, num_warps=4))
    assert len(fn.triton_calls) == n
    L.launch(fn, (1,), (x, 32, 2**40), dict(BLOCK=16, FLAG=True, num_warps=4))
    assert len(fn.triton_calls) == n + 1


def test_bound_replays_with_new_tensors_in_its_holes(fast):
    """``launch.Bound``: the recorded launch's compiled kernel with the given tensors at the hole positions and
    every other argument as recorded; a tensor of another specialisation (alignment, dtype) goes through Triton."""
    fn = _FakeJit()
    x, x2 = (torch.zeros(64).as_subclass(_T) for _ in range(2))
    meta = dict(BLOCK=16, FLAG=True, num_warps=4)
    b = L.Bound(fn, (3, 2), (x, 48, 7), meta, 1)
    b(x)
    assert len(fn.triton_calls) == 1  # first: Triton compiles (and launches) it
    compiled = fn.last
    b(x2)
    assert len(fn.triton_calls) == 1 and compiled.calls == [
        (3, 2, 1, 1234, "fn-handle", "packed", None, None, None, x2, 48, 7, 16, True)]
    assert b.args == [None, 48, 7]  # the record keeps no tensor of its holes (a call's activations)
    for other in (x[1:].as_subclass(_T), x.double().as_subclass(_T)):
        n = len(fn.triton_calls)
        b(other)
        assert len(fn.triton_calls) == n + 1 and fn.triton_calls[-1][1] == (other, 48, 7)
    with pytest.raises(ValueError):  # one tensor per hole
        b(x, x2)


def test_launcher_type_error_falls_back_to_triton(fast, monkeypatch):
    fn = _FakeJit()
    x = torch.zeros(16).as_subclass(_T)
    L.launch(fn, (1,), (x, 32, 0), dict(BLOCK=16, FLAG=False, num_warps=4))

    def bad_run(*a):
        raise TypeError("function takes exactly 20 arguments")

    fn.last.run = bad_run
    with pytest.warns(UserWarning, match="cached kernel launches disabled"):
        L.launch(fn, (1,), (x, 32, 0), dict(BLOCK=16, FLAG=False, num_warps=4))
    assert len(fn.triton_calls) == 2 and not L._ENABLED


def test_patch_passes_fast_launch_down(fast, monkeypatch):
    """``PatchConfig.fast_launch`` reaches the launch path through ``patch``: ``False`` sends every launch through
    Triton's own ``kernel[grid](...)``, ``True`` (the default) takes the cached path where it can run -- never
    where it cannot (the interpreter, an old Triton, a launcher it failed to call)."""
    from models import peft_model

    import fast_multilora

    monkeypatch.setattr(L, "_SUPPORTED", True)
    fn = _FakeJit()
    x = torch.zeros(64).as_subclass(_T)
    meta = dict(BLOCK=16, FLAG=True, num_warps=4)
    model = peft_model()
    fast_multilora.patch(model, fast_launch=False)
    for _ in range(2):
        L.launch(fn, (1,), (x, 32, 0), meta)
    assert len(fn.triton_calls) == 2 and not L._ENABLED
    fast_multilora.patch(model)
    for _ in range(2):
        L.launch(fn, (1,), (x, 32, 0), meta)
    assert len(fn.triton_calls) == 3 and len(fn.last.calls) == 1  # compiled once, then replayed
    monkeypatch.setattr(L, "_SUPPORTED", False)
    fast_multilora.patch(model, fast_launch=True)
    assert not L._ENABLED


def test_hook_chains_count_only_when_not_empty(monkeypatch):
    chain = SimpleNamespace(calls=[])
    assert not L._active(chain) and not L._active(None)
    chain.calls.append(print)
    assert L._active(chain) and L._active(print)


def test_constexprs_must_come_last(fast):
    fn = _FakeJit()
    fn.params[1], fn.params[3] = fn.params[3], fn.params[1]
    with pytest.raises(TypeError, match="constexpr parameters last"):
        L._Kernel(fn)


@pytest.mark.gpu
def test_repeat_launches_match_reference(device):
    """Second and later calls of one shape take the cached path and still equal the reference (fresh values)."""
    if not L._ENABLED:
        pytest.skip("cached launches are off (fast_launch=False or interpreter)")
    from fast_multilora.kernels.api import lora_expand, lora_expand_bwd, lora_shrink, lora_shrink_bwd
    from fast_multilora.kernels.segments import segments_from_token_slots
    from helpers import make_table

    from fast_multilora import reference

    g = torch.Generator().manual_seed(0)
    S, K, N, ranks = 1000, 384, 320, [16, 8, 0, 16]
    ts = torch.randint(-1, 4, (S,), generator=g)
    table = make_table(ranks, scales=torch.rand(4, generator=g).tolist(), device=device)
    for grouped in (False, True):
        segs = segments_from_token_slots(ts, grouped, device)
        before = L.stats()["fast"]
        for _ in range(3):
            x = torch.randn(S, K, generator=g).to(device, torch.bfloat16)
            A = (torch.randn(sum(ranks), K, generator=g) / 20).to(device)
            B = (torch.randn(N, sum(ranks), generator=g) / 20).to(device)
            y = torch.randn(S, N, generator=g).to(device, torch.bfloat16)
            dy = torch.randn(S, N, generator=g).to(device, torch.bfloat16)
            h = lora_shrink(x, A, segs, table)
            y_k = lora_expand(h, B, segs, table, y.clone())
            dh, dB = lora_expand_bwd(dy, h, B, segs, table)
            dx, dA = lora_shrink_bwd(dh, x, A, segs, table)
            h_r = reference.lora_shrink(x.float(), A, segs, table)
            y_r = reference.lora_expand(h_r, B, segs, table, y.float())
            dh_r, dB_r = reference.lora_expand_bwd(dy.float(), h_r, B, segs, table)
            dx_r, dA_r = reference.lora_shrink_bwd(dh_r, x.float(), A, segs, table)
            for got, want, what in [(y_k.float(), y_r, "y"),
                                    (dB, dB_r, "dB"), (dx.float(), dx_r, "dx"), (dA, dA_r, "dA")]:
                err = (got - want).abs().max() / want.abs().max().clamp(min=1e-6)
                assert err < 3e-2, f"{what} grouped={grouped}: max error {err:.3g} of the largest value"
        assert L.stats()["fast"] > before, L.stats()


def test_arg_key_separates_what_triton_specialises():
    """Keys differ where Triton compiles another variant (int == 1, divisibility by 16, int64, dtype, alignment) and
    agree where it does not (two multiples of 16; any int32 value of a do_not_specialize parameter)."""
    x = torch.zeros(64)
    k = L._arg_key
    assert k((x, 32), set()) == k((x, 48), set())
    for a, b in [(1, 2), (16, 17), (0, 1), (-1, 0), (16, 2**31 + 16), (2**31 - 1, 2**31)]:
        assert k((x, a), set()) != k((x, b), set()), (a, b)
    assert k((x, 7), {1}) == k((x, 16), {1}) == k((x, 1), {1}) != k((x, 2**40), {1})
    assert k((x,), set()) != k((x.double(),), set()) and k((x,), set()) != k((x[1:],), set())
    assert k((None, True), set()) != k((None, False), set()) and k((0.5,), set()) == k((0.25,), set())


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sgemm", "chunked"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "added"])
@pytest.mark.parametrize("T", [3, 16], ids=["decode", "segmented"])  # 15 rows: kernels.decode; 80: shrink + expand
def test_eval_replays_take_the_compiled_kernels(device, family, fuse, T):
    """A replayed eval call (``function.LaunchPlan``) launches the recorded kernels through the cached path, fresh
    inputs each call: logits equal the general path's (plans forgotten) bit for bit."""
    if not L._ENABLED:
        pytest.skip("cached launches are off (fast_launch=False or interpreter)")
    from models import peft_model

    import fast_multilora
    from fast_multilora.patching import _STATE_ATTR

    model = peft_model("llama").to(device).eval()
    fast_multilora.patch(model, family=family, fuse_base=fuse)
    names = ["a1", "__base__", "a0", "a2", "a0"]
    g = torch.Generator().manual_seed(0)
    states = [m.__dict__[_STATE_ATTR] for m in model.modules() if m.__dict__.get(_STATE_ATTR) is not None]
    with torch.no_grad():
        model(input_ids=torch.randint(0, 97, (5, T), generator=g).to(device), adapter_names=names)  # records
        for _ in range(3):
            ids = torch.randint(0, 97, (5, T), generator=g).to(device)
            before = L.stats()
            got = model(input_ids=ids, adapter_names=names).logits
            after = L.stats()
            assert after["fast"] > before["fast"] and after["slow"] == before["slow"], (before, after)
            for s in states:
                s.plans.clear()
            assert torch.equal(got, model(input_ids=ids, adapter_names=names).logits)
