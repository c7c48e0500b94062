"""The benchmark harness runs end to end (``bench_model.py --quick``: tiny sizes on the CPU, torch backend): every
scenario and provider produces a timing, the fast path's outputs match stock PEFT's, and the JSON has the layout
``docs/benchmarks.md`` reads. Timings themselves are benchmarks, never asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_model_quick_runs_every_provider(tmp_path):
    out = tmp_path / "h200.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_model.py"), "--quick", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    d = json.loads(out.read_text())
    assert {"layer_4096", "layer_2048", "train_step_8", "eval_8", "train_step_1", "train_step_32", "meta"} <= set(d)
    for scenario, providers in d.items():
        if scenario == "meta":
            continue
        assert "fast_multilora" in providers and "frozen" in providers, scenario
        for name, r in providers.items():
            assert r.get("error") is None and r["ms"] is not None and r["ms"] > 0, (scenario, name, r)
    assert {"fast_multilora_p0", "fast_multilora_p0_unshared", "peft_single_p0", "peft_single_fused_adamw",
            "fast_multilora_fused_adamw", "fast_multilora_share_dropout"} <= set(d["train_step_8"])
    assert d["train_step_8"]["fast_multilora"]["all_adapters_got_grads"]
    ev = d["eval_8"]["fast_multilora"]
    assert ev["diff_rms_over_lora_effect_rms"] < 1e-3, ev  # the mixed batch equals stock PEFT's adapter_names path
    assert (tmp_path / "h200.md").exists()
