"""The benchmark harness runs end to end (``bench_model.py --quick``: tiny sizes on the CPU, torch backend): every
scenario and provider produces a timing, the fast path's outputs match stock PEFT's, and the JSON has the layout
``docs/benchmarks.md`` reads. Timings themselves are benchmarks, never asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def bench(out, *args, rc=0, timeout=600):
    """``bench_model.py --quick --out out *args`` in a subprocess; asserts its exit status ``rc`` and returns
    ``(stdout, the JSON written)``."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "--quick", *args,
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == rc, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout, json.loads(out.read_text())


def assert_timed(d, scenario):
    """Every provider of ``scenario`` timed, none raised."""
    for name, r in d[scenario].items():
        assert r.get("error") is None and r["ms"] is not None and r["ms"] > 0, (scenario, name, r)


@pytest.mark.slow
def test_bench_model_quick_runs_every_provider(tmp_path):
    out = tmp_path / "h200.json"
    _, d = bench(out)
    assert {"layer_4096", "layer_2048", "train_step_8", "eval_8", "train_step_1", "train_step_32", "meta"} <= set(d)
    for scenario, providers in d.items():
        if scenario == "meta":
            continue
        assert "fast_multilora" in providers and "frozen" in providers, scenario
        assert_timed(d, scenario)
    assert {"fast_multilora_p0", "fast_multilora_p0_unshared", "peft_single_p0", "peft_single_fused_adamw",
            "fast_multilora_fused_adamw", "fast_multilora_share_dropout",
            "fast_multilora_adamw"} <= set(d["train_step_8"])
    assert d["train_step_8"]["fast_multilora"]["all_adapters_got_grads"]
    ev = d["eval_8"]["fast_multilora"]
    assert ev["diff_rms_over_lora_effect_rms"] < 1e-3, ev  # the mixed batch equals stock PEFT's adapter_names path
    assert (tmp_path / "h200.md").exists()


OPT_IN = ("train_step_8_compiled", "eval_8_compiled", "generate_static", "generate_dynamic")
PROVIDERS = {"train_step_8_compiled": {"fast_multilora", "fast_multilora_adamw", "peft_single", "frozen"},
             "eval_8_compiled": {"fast_multilora", "peft_single", "frozen"},
             "generate_static": {"fast_multilora", "fast_multilora_store", "peft_mixed", "frozen"},
             "generate_dynamic": {"fast_multilora", "fast_multilora_store", "peft_mixed", "frozen"}}


@pytest.fixture(scope="module")
def opt_in_run(tmp_path_factory):
    """The opt-in scenarios' quick run (compiled with aot_eager), merged into an earlier run's JSON."""
    out = tmp_path_factory.mktemp("bench_opt_in") / "h200.json"
    earlier = {"train_step_8": {p: {"ms": 2.0, "peak_mib": None} for p in ("fast_multilora", "peft_single", "frozen")},
               "meta": {"device": "cpu", "quick": True, "scenarios": {"train_step_8": "an earlier run"},
                        "skipped_scenarios": ["layer_4096"]}}
    out.write_text(json.dumps(earlier))
    return out, bench(out, "--merge", "--scenarios", ",".join(OPT_IN))[1]


def _check_row(scenario, name, r):
    assert r.get("error") is None and r["ms"] is not None and r["ms"] > 0, (scenario, name, r)
    assert {"ms", "peak_mib", "compile_s"} <= set(r), (scenario, name, r)
    if scenario == "generate_dynamic":
        assert r["compile_s"] is None, (scenario, name, r)  # eager
    else:
        assert r["compile_s"] > 0 and r["compile_backend"] == "aot_eager" and r["graphs"] >= 1, (scenario, name, r)
        assert r["compile_mode"] == "default", (scenario, name, r)
    if scenario == "eval_8_compiled":
        assert r["max_abs_diff_vs_eager"] < 1e-4, (scenario, name, r)
    if scenario == "generate_static" or (scenario == "generate_dynamic" and name.startswith("fast_multilora")):
        # fp32: compiled (or ours) greedy tokens equal the eager ones
        assert r["tokens_equal"] and r["tokens_common_prefix_frac"] == 1.0, (scenario, name, r)


@pytest.mark.slow
def test_bench_model_quick_opt_in_scenarios(opt_in_run):
    out, d = opt_in_run
    assert set(OPT_IN) | {"train_step_8", "meta"} <= set(d)
    assert d["train_step_8"]["frozen"]["ms"] == 2.0  # --merge kept the earlier run's scenario
    assert d["meta"]["merged_runs"][-1]["scenarios"] == list(OPT_IN)
    assert "layer_4096" in d["meta"]["skipped_scenarios"] and "generate_static" not in d["meta"]["skipped_scenarios"]
    for scenario in OPT_IN:
        assert set(d[scenario]) == PROVIDERS[scenario], scenario
        for name, r in d[scenario].items():
            _check_row(scenario, name, r)
    for scenario in ("train_step_8_compiled", "eval_8_compiled"):  # every provider, ours too: no graph break
        for name, r in d[scenario].items():
            assert r["graph_breaks"] == 0 and r["graphs"] == 1, (scenario, name, r)
    md = (out.parent / "h200.md").read_text()
    assert all(f"## {s}" in md for s in ("train_step_8", *OPT_IN)), md


@pytest.mark.slow
def test_bench_model_quick_qlora(tmp_path):
    """``qlora_step_8`` / ``qlora_eval_8`` on a tiny 4-bit model (bitsandbytes' CPU layers): every provider times,
    every adapter trains, the patched model equals stock PEFT (eval: the mixed batch; train: a0 and a base row)."""
    pytest.importorskip("bitsandbytes")
    out = tmp_path / "h200.json"
    _, d = bench(out, "--scenarios", "qlora_step_8,qlora_eval_8")
    for scenario in ("qlora_step_8", "qlora_eval_8"):
        assert set(d[scenario]) == {"fast_multilora", "peft_single", "peft_mixed_loop", "frozen"}, scenario
        assert_timed(d, scenario)
        fast = d[scenario]["fast_multilora"]
        assert fast["patch"] == {"patched": 14, "fallback": 0}, fast
        assert fast["diff_rms_over_lora_effect_rms"] < 1e-3, fast
    assert d["qlora_step_8"]["fast_multilora"]["all_adapters_got_grads"]
    assert "## qlora_step_8" in (tmp_path / "h200.md").read_text()


def test_bench_model_budget_skips_exit_3(tmp_path):
    """A scenario left out by ``--budget-s`` makes the run's exit status 3 (a partial run), naming it."""
    out = tmp_path / "h200.json"
    stdout, d = bench(out, "--scenarios", "eval_8", "--budget-s", "0", rc=3, timeout=300)
    assert "skipped for the time budget: eval_8" in stdout
    assert "eval_8" in d["meta"]["skipped_scenarios"] and not d.get("eval_8"), d.get("eval_8")


@pytest.mark.slow
def test_bench_model_quick_moe_and_scale(tmp_path):
    """``moe_step_8`` (every provider times; ours trains every adapter, expert weights included, and equals stock
    PEFT) and ``train_step_scale`` (one provider per adapter count, every resident adapter trained) on tiny models."""
    out = tmp_path / "h200.json"
    _, d = bench(out, "--scenarios", "moe_step_8,train_step_scale")
    assert set(d["moe_step_8"]) == {"fast_multilora", "peft_single", "peft_sequential", "frozen"}
    assert [p for p in d["train_step_scale"]] == ["fast_2", "fast_2_torch_adamw", "fast_8", "fast_32",
                                                  "fast_32_torch_adamw"]
    for scenario in ("moe_step_8", "train_step_scale"):
        assert_timed(d, scenario)
    fast = d["moe_step_8"]["fast_multilora"]
    assert fast["all_adapters_got_grads"] and fast["patch"]["experts"] > 0, fast
    assert fast["diff_rms_over_lora_effect_rms"] < 1e-3, fast
    for n in (2, 8, 32):
        r = d["train_step_scale"][f"fast_{n}"]
        assert r["adapters_with_grads"] == r["adapters"] == n and r["optimizer_ms"] > 0, r
        assert r["layer_host_us"] > 0 and r["layer_host_us_in_model"] > 0, r  # interleaved; in the grown model
        assert r["optimizer"] == "fast_multilora.AdamW", r
    assert "## train_step_scale" in (tmp_path / "h200.md").read_text()


@pytest.mark.slow
def test_bench_model_quick_scale_compiled(tmp_path):
    """``train_step_scale_compiled`` (aot_eager): every count compiles to one graph without a break, times, and
    trains every resident adapter."""
    out = tmp_path / "h200.json"
    _, d = bench(out, "--scenarios", "train_step_scale_compiled", "--scale-counts", "2,8")
    assert list(d["train_step_scale_compiled"]) == ["fast_2", "fast_8"]
    assert_timed(d, "train_step_scale_compiled")
    for n in (2, 8):
        r = d["train_step_scale_compiled"][f"fast_{n}"]
        assert r["adapters_with_grads"] == n and r["compile_s"] > 0 and r["compile_backend"] == "aot_eager", r
        assert r["graphs"] == 1 and r["graph_breaks"] == 0 and "layer_host_us" not in r, r
    assert "## train_step_scale_compiled" in (tmp_path / "h200.md").read_text()
