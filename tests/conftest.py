"""Test set-up: device choice, the Triton interpreter on CPU, the default selection, shared fixtures.

By default tests run on the CPU with ``TRITON_INTERPRET=1`` (set here, before triton is imported), so Triton
kernels run on CPU tensors. ``FML_TEST_DEVICE=cuda`` (the GPU script sets it) runs the same tests on the GPU with
compiled kernels and enables the tests marked ``gpu``.

The root folder kernels/ is no package of its own (``fast_multilora.kernels`` only), so from the checkout's root the
top-level name ``kernels`` stays PyPI's whatever is imported first (tests/test_layout.py).
"""

import os
import sys

import pytest

DEVICE = os.environ.get("FML_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # one thread per process, subprocesses the tests start included: the README's command runs one pytest-xdist
    # worker per core, and intra-op threads on top of them only oversubscribe the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# tests/helpers.py, models.py, trainloop.py, and test modules that reuse another's builders by module name
# (``from test_paths import ...``), whichever files a run collects
_HERE = os.path.dirname(os.path.abspath(__file__))
for _dir in (os.path.join(_HERE, "integration"), os.path.join(_HERE, "kernels"), _HERE):
    if _dir not in sys.path:
        sys.path.insert(0, _dir)

import torch  # noqa: E402

import fast_multilora  # noqa: E402, F401  (before the tests import peft: its import drops the dependencies' set-up noise)

if DEVICE == "cpu":
    # the tests' tensors are tiny: intra-op threads only add synchronisation (ms per op on a loaded 2-core machine)
    torch.set_num_threads(1)


def _memoize_interpreter_lang_walk() -> None:
    """The Triton interpreter patches ``triton.language``'s builtins around every launch, finding them each time by
    ``inspect.getmembers`` over the language modules and wrapping each in a new lambda (triton 3.x
    ``runtime/interpreter.py``: ``_patch_builtin``, ``_patch_attr``): ~2 ms of host work per launch, a fifth of an
    interpreted test's time. A module's builtins do not change, and each wrapper depends on its builtin only, so both
    are made once (at the first launch, before any patch) and set from that list, recorded in the launch's scope as
    ``_patch_attr`` records them; a Triton without these functions keeps its own."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    is_builtin = getattr(getattr(getattr(interpreter, "tl", None), "core", None), "is_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if getattr(interpreter, "_patch_builtin", None) is None or None in (is_builtin, patch_attr):
        return
    import inspect

    class _Scope:  # records the wrapper patch_attr sets, once per member
        def set_attr(self, obj, name, value):
            self.value = value

    found = {}

    def wrappers(pkg, builder) -> list:
        out = []
        for name, member in inspect.getmembers(pkg):
            if is_builtin(member):
                rec = _Scope()
                patch_attr(pkg, name, member, builder, rec)
                out.append((name, rec.value))
        return out

    def patch_builtin(pkg, builder, scope):
        made = found.get((pkg, builder))
        if made is None:
            made = found[(pkg, builder)] = wrappers(pkg, builder)
        for name, value in made:
            scope.set_attr(pkg, name, value)

    interpreter._patch_builtin = patch_builtin


if os.environ.get("TRITON_INTERPRET") == "1":
    _memoize_interpreter_lang_walk()


def pytest_configure(config):
    # CPU runs without -m leave out the tests marked slow (run them with -m slow, everything with -m "slow or not
    # slow"), unless tests are named by node id (file.py::test); GPU runs (FML_TEST_DEVICE=cuda) keep them
    if DEVICE == "cpu" and not config.option.markexpr and not any("::" in str(a) for a in config.args):
        config.option.markexpr = "not slow"


# single parametrized cases that take most of a CPU run (measured: `--durations`, 2-core VM), marked slow by node id
# (their siblings of the same test stay in the default run); `-m slow` runs them
SLOW_CASES = (
    "test_forward.py::test_forward_matches_reference[S63-K123-N2049-R1-A8-sgemm-",  # ~63 s each under the interpreter
    "test_store.py::test_many_adapters_match_peft_through_the_store[triton-128]",
    "test_memory.py::test_no_growth_over_many_steps[triton-20]",
    "test_compile.py::test_compiled_eval_of_few_rows_takes_the_decode_op[segmented]",  # [decode] stays
    "test_moe.py::test_compiled_experts_one_graph_equal_to_eager[triton]",  # [torch] stays
    # DoRA: compiled, one case per backend (the traced DoRA ops are the same on both but for the Triton mask's packed
    # bits, read under dropout: [dropout-triton] and [no-dropout-torch] stay, one graph each), and the Triton cases
    # that repeat an architecture the default run has on that path
    "test_dora.py::test_compiled_equals_eager[dropout-torch]",
    "test_dora.py::test_compiled_equals_eager[no-dropout-triton]",
    "test_dora.py::test_eval_matches_peft[gpt2-triton]",
    "test_dora.py::test_training_step_matches_peft[triton-sgemm-added-params-gpt2]",
    "test_dora.py::test_training_step_matches_peft[triton-sgemm-added-params-llama_bias]",
    "test_moe.py::test_mixed_batch_matches_peft[mixtral-eager-triton-eval]",  # qwen3_moe's stays
    # the model-level path matrices: the default run keeps a set holding every pair of two axes' values
    *(f"test_paths.py::test_path_matrix_matches_peft[{c}]" for c in (
        "sgemm-fused-in_place", "sgemm-fused-concatenated", "sgemm-added-store", "chunked-added-in_place",
        "chunked-added-concatenated", "chunked-fused-store")),
    *(f"test_paths.py::test_dropout_mask_stored_equals_redrawn[{c}]" for c in (
        "sgemm-fused-concatenated", "sgemm-added-store", "chunked-fused-store", "chunked-added-concatenated")),
    # CI time (each 20-45 s under the interpreter; 2026-12-05): the replay cases left cover both families, fused and
    # added, every weight source, decode and segmented; one dtype per family of the big-N blocked-gradient case
    *(f"test_paths.py::test_eval_replays_launch_plans[{c}]" for c in (
        "sgemm-added-store-decode", "chunked-fused-concatenated-segmented", "chunked-added-store-segmented")),
    *(f"test_backward.py::test_weight_grads_in_weight_dtype_and_blocked[S63-K123-N2049-R64-A8-x1-random-{c}]"
      for c in ("fp32-chunked", "fp16-sgemm", "fp16-chunked")),  # fp32-sgemm stays (smaller shapes: every case)
    "test_compile.py::test_compiled_graphs_take_the_entry_layout_and_copy_no_base_output[names]",  # [adapter_ids]
    "test_moe.py::test_compiled_experts_one_graph_equal_to_eager[torch]",  # MoE eager parity stays in the default
    "test_resume.py::test_resume_matches_uninterrupted_run[triton]",  # [torch] stays
    # 14-27 s each: the paged == resident cases on the torch backend stay; the churn count of pieces at 64 and 128
    # adapters (test_a_change_of_one_adapter_reads_that_adapter_only counts them, and what is read, at 24 and 48)
    "test_store.py::test_one_adapter_of_churn_costs_the_same_whatever_the_registry[",
    "test_paging.py::test_paged_training_equals_resident_training[triton-",
    # 15-25 s each (2026-12-06): the Triton store at 64 adapters (tests/kernels run 70 slots, the model-level Triton
    # store tests a few); the per-adapter AdamW parity on Triton (its optimizer alone against torch's stays, and
    # holes and spare rows on both backends); the experts' store training on Triton (test_moe's mixed batches train
    # the experts through the store on Triton)
    "test_store.py::test_many_adapters_match_peft_through_the_store[triton-64]",
    "test_store.py::test_adamw_equals_torch_adamw_per_adapter[triton]",
    "test_moe.py::test_experts_in_the_store_train_like_peft_per_adapter[triton-",
    # the Triton AdamW against torch's over three steps (tests/kernels/test_adamw.py checks the kernel against the
    # reference, test_holes_and_spare_rows_train_alike_on_both_backends the store's Triton step against the torch
    # backend's); test_compile.py marks its chunked-family opchecks itself
    "test_store.py::test_adamw_step_equals_torch_on_the_same_gradients[triton]",
    # CI time (2026-12-07, 5-22 s each on the 2-core VM): DoRA compiled on the torch backend ([dropout-triton] traces
    # the same DoRA ops, and the Triton mask's bits besides); three launch-plan replays (those left: both families,
    # fused and added, every weight source, decode and segmented); two stored-mask cases (one per family, fused and
    # added, stay); three of the fused loss's five frozen-head cases (one packed, one per-row stay, beside the float64
    # gradchecks of the frozen head)
    "test_dora.py::test_compiled_equals_eager[no-dropout-torch]",
    *(f"test_paths.py::test_eval_replays_launch_plans[{c}]" for c in (
        "chunked-added-in_place-decode", "sgemm-fused-in_place-decode", "sgemm-fused-store-segmented")),
    *(f"test_paths.py::test_dropout_mask_stored_equals_redrawn[{c}]" for c in (
        "sgemm-added-concatenated", "chunked-fused-concatenated")),
    *(f"test_fused_loss.py::test_equals_per_adapter_loss_fp32[{c}-frozen]" for c in (
        "packed-bias-one-chunk", "packed-nobias-c37", "per-row-bias-auto")),
    # the Triton backend's two-run determinism under the interpreter, whose programs run one at a time, so no
    # reduction order can vary there (the [torch] case checks the seeds' path; the GPU test, the compiled kernels);
    # the chunked family's 2049-wide forward (its N-tiles and ragged N: the 77- and 130-wide cases of both families,
    # and the 2049-wide backward, stay)
    "test_determinism.py::test_two_runs_same_seed_bit_identical_cpu[triton]",
    "test_forward.py::test_forward_matches_reference[S63-K123-N2049-R1-A8-chunked-",
)


def _kernel_fp16_repeat(item, first: set) -> bool:
    """A kernel test's fp16 case after the first of its test function and family (CI time, 2026-12-06: fp16 was 40 %
    of tests/kernels under the interpreter). The default run keeps fp32 at every shape and fp16 at one (not the
    widest) per kernel family and test; ``-m slow`` and the GPU run (every shape in fp16 and bf16) keep them all."""
    if "/kernels/" not in str(item.path).replace("\\", "/") or "fp16" not in item.name:
        return False
    family = "chunked" if "chunked" in item.name else "sgemm" if "sgemm" in item.name else ""
    key = (item.path, item.originalname, family)
    if key in first or "N2049" in item.name:  # (the kept one not the 2049-wide case: a third of a test's time)
        return True
    first.add(key)
    return False


def _stale_slow_cases(config, items) -> list:
    """The ``SLOW_CASES`` entries whose test file was collected whole (no node id on the command line) and that match
    none of its tests: a renamed test or a changed parameter id leaves its case in the default run unnoticed."""
    if any("::" in str(arg) for arg in config.args):
        return []
    files = {item.nodeid.split("::")[0].rsplit("/", 1)[-1] for item in items}
    return [case for case in SLOW_CASES
            if case.split("::")[0] in files and not any(case in item.nodeid for item in items)]


@pytest.hookimpl(tryfirst=True)  # before the -m selection
def pytest_collection_modifyitems(config, items):
    stale = _stale_slow_cases(config, items)
    if stale:
        raise pytest.UsageError(f"tests/conftest.py: SLOW_CASES entries that match no test of their file (a renamed "
                                f"test or parameter id?): {stale}; fix or remove them")
    first: set = set()
    for item in items:
        if any(case in item.nodeid for case in SLOW_CASES) or _kernel_fp16_repeat(item, first):
            item.add_marker(pytest.mark.slow)
    if DEVICE == "cuda" and torch.cuda.is_available():
        cpu_only = pytest.mark.skip(reason="Triton on CPU tensors under the interpreter: the CPU run's (on the GPU the "
                                           "kernels are tested on GPU tensors)")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(cpu_only)
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (FML_TEST_DEVICE=cuda)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters reset around a test, so graph and graph-break counts are the test's own."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
