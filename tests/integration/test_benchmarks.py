"""The benchmark harness on the CPU (``benchmarks/run.py --device cpu``: tiny shapes, torch backend): rows follow the
results schema, ratios come from the rows of the same run (fresh processes included), the fast path trains every
adapter and equals stock PEFT's outputs, ``--merge`` keeps other scenarios, declared scenarios say they are not
implemented, and the GPU path plans and builds its inputs (``--dry-run``). Timings themselves are never asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the harness end to end (subprocesses, model builds): ~100 s of a core

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402


def run(out, *args, rc=0, timeout=600):
    """``benchmarks/run.py --out out *args`` in a subprocess; asserts its exit status; returns (stdout, results)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--out", str(out), *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == rc, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout, (harness.load_results(str(out)) if Path(out).exists() else None)


def assert_ratios_from_rows(rows):
    """Every ok row's ratio over frozen is its wall time over the frozen row of the same record."""
    frozen = rows["frozen"]["wall_ms"]
    for key, r in rows.items():
        assert r["status"] == "ok" and r["wall_ms"] > 0, (key, r)
        if key != "frozen":
            assert r["ratios"]["frozen"] == pytest.approx(r["wall_ms"] / frozen, rel=1e-3), (key, r)


README_ROWS = {"frozen", "peft_single", "peft_mixed_loop", "fast_multilora", "fast_multilora[per_adapter_loss]"}


def test_cpu_readme_step_rows_schema_and_ratios(tmp_path):
    out = tmp_path / "cpu.json"
    stdout, res = run(out, "--device", "cpu", "--scenarios", "readme_step_cpu",
                      "--providers", "frozen,peft_single,peft_mixed_loop,fast_multilora")
    rec = res["scenarios"]["readme_step_cpu"]
    assert set(rec["rows"]) == README_ROWS
    assert_ratios_from_rows(rec["rows"])
    ps = rec["rows"]["peft_single"]["wall_ms"]
    fast = rec["rows"]["fast_multilora"]
    assert fast["ratios"]["peft_single"] == pytest.approx(fast["wall_ms"] / ps, rel=1e-3)
    for key in ("fast_multilora", "fast_multilora[per_adapter_loss]"):  # sql, chat, code all trained
        e = rec["rows"][key]["extra"]
        assert e["adapters_in_batch"] == e["adapters_with_grads"] == 3, e
        assert e["patch"]["fallback"] == 0 and e["patch"]["patched"] > 0, e
    run_meta = rec["run"]
    assert run_meta["device"] == "cpu" and run_meta["backend"] == "torch" and not run_meta["fresh_process"]
    assert len(run_meta["machine"]["load_avg_1_5_15"]) == 3 and "run.py" in run_meta["command"]
    assert "readme_step_cpu" in stdout


def test_fresh_process_rows_side_by_side(tmp_path):
    """``--fresh-process``: each provider in its own process, their rows in one record with ratios between them."""
    out = tmp_path / "r.json"
    _, res = run(out, "--device", "cpu", "--scenarios", "readme_step_cpu", "--providers", "frozen,fast_multilora",
                 "--variants", ",", "--fresh-process")
    rows = res["scenarios"]["readme_step_cpu"]["rows"]
    assert set(rows) == {"frozen", "fast_multilora"}
    assert all(r["fresh_process"] for r in rows.values())
    assert res["scenarios"]["readme_step_cpu"]["run"]["fresh_process"]
    assert_ratios_from_rows(rows)


def test_eval_and_layer_match_peft_and_merge_keeps_other_scenarios(tmp_path):
    out = tmp_path / "m.json"
    earlier = {"schema": 2, "scenarios": {"train_step_8": {"description": "an earlier run", "run": {"commit": "x"},
                                                            "rows": {"frozen": harness.make_row("frozen",
                                                                                                wall_ms=2.0)}}}}
    out.write_text(json.dumps(earlier))
    _, res = run(out, "--device", "cpu", "--scenarios", "eval_8,layer_4096", "--merge",
                 "--providers", "frozen,peft_single,peft_mixed_loop,fast_multilora")
    assert res["scenarios"]["train_step_8"]["rows"]["frozen"]["wall_ms"] == 2.0  # kept
    ev = res["scenarios"]["eval_8"]["rows"]
    assert set(ev) == {"frozen", "peft_single", "peft_mixed_loop", "fast_multilora"}
    assert_ratios_from_rows(ev)
    # the mixed batch (8 adapters + base rows) equals PEFT's own adapter_names path, B off zero
    assert ev["fast_multilora"]["extra"]["diff_rms_over_lora_effect_rms"] < 1e-4, ev["fast_multilora"]
    assert_ratios_from_rows(res["scenarios"]["layer_4096"]["rows"])


def test_declared_scenarios_record_not_implemented(tmp_path, monkeypatch):
    """A declared slot (no scenario is declared now: one added for the test) gets rows without numbers, and --list
    and the dry run say why."""
    import run
    import scenarios

    monkeypatch.setitem(scenarios.SCENARIOS, "declared_x", scenarios.Scenario(
        "declared_x", "declared", "llama", "a slot", ("fast_multilora",), not_implemented="no such feature yet"))
    out = tmp_path / "d.json"
    assert run.main(["--device", "cpu", "--scenarios", "declared_x", "--out", str(out)]) == 0
    rows = harness.load_results(str(out))["scenarios"]["declared_x"]["rows"]
    assert set(rows) == {"fast_multilora"}
    assert all(r["status"] == "not_implemented" and r["wall_ms"] is None and r["reason"] == "no such feature yet"
               for r in rows.values()), rows


def test_churn_and_paged_rows(tmp_path):
    """churn: per registry size, the fast row's add / delete / steps after each (wall_ms is the add), each added
    adapter trained by its step and the registry back to n after the deletes; PEFT's add_adapter row beside it with a
    ratio. train_step_paged (and its 8B-shaped case): the batch's adapters trained by each row, paging leaves the
    adapters outside the step (and outside the prefetched next set) paged out, ratios over the fully resident row."""
    out = tmp_path / "p.json"
    _, res = run(out, "--device", "cpu", "--scenarios", "churn,train_step_paged,train_step_paged_8b")
    rec = res["scenarios"]["churn"]
    rows = rec["rows"]
    assert set(rows) == {f"{p}[n={n}]" for p in ("fast_multilora_store_adamw", "peft_add_adapter") for n in (8, 32)}
    assert "churn rounds" in rec["run"]["timing"]
    for n in (8, 32):
        fast, peft = rows[f"fast_multilora_store_adamw[n={n}]"], rows[f"peft_add_adapter[n={n}]"]
        e = fast["extra"]
        assert fast["status"] == "ok" and fast["wall_ms"] == pytest.approx(e["add_ms"], abs=1e-3), fast
        assert all(e[k] > 0 for k in ("step_ms", "add_ms", "add_step_ms", "delete_ms", "delete_step_ms")), e
        assert e["added_adapters_trained"] == "3/3" and e["adapters_after"] == n and e["churned_left"] == [], e
        assert "fast_multilora.AdamW" in e["optimizer"] and e["patch"]["fallback"] == 0, e
        assert peft["status"] == "ok" and peft["extra"]["delete_ms"] > 0 and "step_ms" not in peft["extra"], peft
        assert peft["extra"]["adapters_after"] == n and peft["extra"]["churned_left"] == [], peft
        assert fast["ratios"]["peft_add_adapter"] == pytest.approx(fast["wall_ms"] / peft["wall_ms"], rel=1e-3)
    for sc, n, m in (("train_step_paged", 32, 4), ("train_step_paged_8b", 32, 8)):
        rows = res["scenarios"][sc]["rows"]
        v = f"[n={n}/batch={m}]"
        default = ("fast_multilora", "fast_multilora_paged_default_adamw")  # (torch.optim.AdamW's defaults)
        assert set(rows) == {p + v for p in ("fast_multilora_fused_adamw", "fast_multilora_paged",
                                             "fast_multilora_paged_no_prefetch", "fast_multilora_paged_params")
                             + default}, rows
        for key, r in rows.items():
            e = r["extra"]
            assert r["status"] == "ok" and e["adapters_with_grads"] == e["adapters_in_batch"] == m, (key, r)
            assert e["registered"] == n and e["patch"]["fallback"] == 0, e
            assert ("fused=True" in e["optimizer"]) == (key[: -len(v)] not in default), e
            # (steady state: one untimed cycle of the n / m sets first)
            assert e["first_cycle_ms"]["steps"] == n // m and e["first_cycle_ms"]["median"] > 0, e
        for ref, paged in (("fast_multilora_fused_adamw", ("fast_multilora_paged", "fast_multilora_paged_no_prefetch",
                                                           "fast_multilora_paged_params")),
                           ("fast_multilora", ("fast_multilora_paged_default_adamw",))):
            resident = rows[ref + v]
            assert resident["extra"]["paged_out_after_step"] == 0
            for p in paged:
                r = rows[p + v]
                # (the next set prefetched, or not)
                assert r["extra"]["paged_out_after_step"] == n - (m if p.endswith("no_prefetch") else 2 * m), r
                assert r["ratios"][ref] == pytest.approx(r["wall_ms"] / resident["wall_ms"], rel=1e-3)


def test_create_adapters_and_8b_fused_loss_rows(tmp_path):
    """create_adapters: add_adapters at every count, PEFT's loop only at the small one, a ratio between them, the
    saved and loaded adapters equal the created ones; step_8b_fused_loss: the three losses (HF labels=, logits,
    fused) train all 8 adapters, and the fused loss equals the logits path's on the same weights; head_loss_8b: its
    rows, and the fused loss and its hidden-state gradient equal the logits path's."""
    out = tmp_path / "c.json"
    _, res = run(out, "--device", "cpu", "--scenarios", "create_adapters,step_8b_fused_loss,head_loss_8b")
    rows = res["scenarios"]["create_adapters"]["rows"]
    assert set(rows) == {"fast_multilora[n=8]", "peft_add_adapter[n=8]", "fast_multilora[n=32]"}
    assert "fresh model" in res["scenarios"]["create_adapters"]["run"]["timing"]
    fast = rows["fast_multilora[n=8]"]
    assert fast["ratios"]["peft_add_adapter"] == pytest.approx(
        fast["wall_ms"] / rows["peft_add_adapter[n=8]"]["wall_ms"], rel=1e-3)
    for key, n in (("fast_multilora[n=8]", 8), ("peft_add_adapter[n=8]", 8), ("fast_multilora[n=32]", 32)):
        e = rows[key]["extra"]
        assert rows[key]["status"] == "ok" and rows[key]["iters"] == 3 and e["adapters_in_model"] == n + 1, e
    for key in ("fast_multilora[n=8]", "fast_multilora[n=32]"):
        e = rows[key]["extra"]
        assert e["fallback"] == 0 and e["loaded_equal_created"] and e["save_s"] > 0 and e["load_s"] > 0, e
    rows = res["scenarios"]["step_8b_fused_loss"]["rows"]
    assert set(rows) == {"fast_multilora[labels]", "fast_multilora[logits]", "fast_multilora[fused]"}
    assert "HF labels= loss" in rows["fast_multilora[labels]"]["extra"]["loss_call"]
    for r in rows.values():
        assert r["status"] == "ok" and r["extra"]["adapters_with_grads"] == 8, r
    e = rows["fast_multilora[fused]"]["extra"]
    assert "fused_causal_lm_loss" in e["loss_call"] and abs(e["eval_loss_fused_minus_logits"]) < 1e-4, e
    rows = res["scenarios"]["head_loss_8b"]["rows"]
    assert set(rows) == {"frozen", "fast_multilora[logits]", "fast_multilora[fused]", "fast_multilora[fused/chunk=256]",
                         "fast_multilora[fused/chunk=1024]"}
    for key in ("fast_multilora[logits]", "fast_multilora[fused]", "fast_multilora[fused/chunk=256]"):
        e = rows[key]["extra"]
        assert rows[key]["status"] == "ok" and "frozen" in rows[key]["ratios"], rows[key]
        # fp32 on CPU: the two losses sum the same per-token terms in other orders
        assert abs(e["loss_fused_minus_logits"]) < 1e-5 and e["dhidden_rel_err"] < 1e-5, e


def test_scale_variants_and_skipped_provider(tmp_path):
    """train_step_scale: frozen once, each fast provider per (resident, in-batch) count, every adapter of the batch
    trained; moe_step_8 records PEFT's missing mixed path for experts as skipped, with the reason."""
    out = tmp_path / "s.json"
    _, res = run(out, "--device", "cpu", "--scenarios", "train_step_scale,moe_step_8",
                 "--providers", "frozen,fast_multilora_store_adamw,peft_mixed_loop", "--variants", ",n=32/batch=32")
    rows = res["scenarios"]["train_step_scale"]["rows"]
    assert set(rows) == {"frozen", "fast_multilora_store_adamw[n=32/batch=32]"}
    e = rows["fast_multilora_store_adamw[n=32/batch=32]"]["extra"]
    assert e["adapters_in_batch"] == e["adapters_with_grads"] == 32, e
    moe = res["scenarios"]["moe_step_8"]["rows"]
    assert moe["peft_mixed_loop"]["status"] == "skipped" and "ParamWrapper" in moe["peft_mixed_loop"]["reason"]
    e = moe["fast_multilora_store_adamw"]["extra"]
    assert e["adapters_with_grads"] == 8, e


def test_dry_run_builds_every_gpu_scenario():
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--dry-run", "--device", "cuda",
                          "--scenarios", "all"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "inputs[]: {'ids': (16, 1024)}" in res.stdout  # full shapes
    assert "row fast_multilora_paged_adamw8bit[per_adapter_loss]" in res.stdout
    assert "row fast_multilora_store_adamw[n=1024/batch=64]" in res.stdout
    assert "row fast_multilora[n=1024]" in res.stdout and "row peft_add_adapter[n=128]" in res.stdout
    assert "row peft_add_adapter[n=256]" not in res.stdout  # PEFT's quadratic loop only at the small counts
    assert "inputs[fused]: {'ids': (4, 2048)" in res.stdout
    assert "inputs[fused]: {'hidden': (4, 2048, 4096)" in res.stdout  # head_loss_8b
    assert "model (meta): 8365.8 M parameters, 335.54 M of them LoRA" in res.stdout  # Llama-3-8B + 8 adapters
    assert "row fast_multilora_paged[n=1024/batch=64]" in res.stdout and "row peft_add_adapter[n=1024]" in res.stdout
    assert "row fast_multilora_paged_no_prefetch[n=128/batch=8]" in res.stdout
    assert "model (meta): 8139.3 M parameters, 109.05 M of them LoRA" in res.stdout  # Llama-3-8B + 8 on attention
    assert "not implemented" not in res.stdout
    listed = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--list"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300).stdout.splitlines()
    for name, declared in (("create_adapters", False), ("step_8b_fused_loss", False), ("train_step_paged", False),
                           ("churn", False)):
        line = next(ln for ln in listed if ln.startswith(name + " "))
        assert ("[not implemented" in line) == declared, line


def test_unknown_names_exit_2(tmp_path):
    for args in (["--scenarios", "train_step_9"], ["--providers", "peft_singel"]):
        res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--device", "cpu", *args],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and args[1] in res.stderr and "choose from" in res.stderr, res.stderr[-2000:]


def test_add_ratios_and_schema_checks():
    rows = {"frozen": harness.make_row("frozen", wall_ms=10.0),
            "peft_single": harness.make_row("peft_single", wall_ms=20.0),
            "fast": harness.make_row("fast", wall_ms=15.0),
            "fast[v]": harness.make_row("fast", "v", wall_ms=30.0),
            "bad": harness.make_row("bad", "", "error", "boom")}
    harness.add_ratios(rows)
    assert rows["fast"]["ratios"] == {"frozen": 1.5, "peft_single": 0.75}
    assert rows["fast[v]"]["ratios"] == {"frozen": 3.0, "peft_single": 1.5, "first_variant": 2.0}
    assert rows["bad"]["ratios"] == {} and rows["frozen"]["ratios"] == {"peft_single": 0.5}
    res = {"schema": 2, "scenarios": {"s": {"description": "", "run": {}, "rows": rows}}}
    harness.check_results(res)
    rows["fast"]["status"] = "ok?"
    with pytest.raises(ValueError, match="s/fast"):
        harness.check_results(res)
    with pytest.raises(ValueError, match="status"):
        harness.make_row("x", status="fine")


def test_top_kernels_sum_per_name_per_call():
    """A GPU row's ``extra.top_kernels``: per kernel name its summed time and launches per call, largest first."""
    timed = [("a", 10.0), ("b", 300.0), ("a", 30.0), ("c" * 100, 50.0), ("b", 100.0), ("d", 1.0)]
    assert harness.top_kernels(timed, 3, reps=2) == [["b", 0.2, 1.0], ["c" * 80, 0.025, 0.5], ["a", 0.02, 1.0]]
    assert harness.top_kernels(timed, 0) == []


def test_host_profile_ranks_functions_by_own_time_per_call():
    """A row's ``extra.top_host``: per function its own time and calls per call, largest own time first; a function
    that spends its time in a callee ranks below it."""
    def leaf():
        x = 0
        for i in range(200_000):  # own time: no call inside the loop
            x += i
        return x

    def caller():
        return leaf() + leaf()

    top = harness.host_profile(caller, 2, 3, "cpu")
    assert len(top) == 3 and [t[1] for t in top] == sorted((t[1] for t in top), reverse=True)
    where, ms, calls = top[0]
    assert where == f"tests/integration/test_benchmarks.py:{leaf.__code__.co_firstlineno}(leaf)" and calls == 2
    assert all(m < ms / 10 for w, m, _ in top[1:]), top


def test_sync_points_count_the_lines_that_synchronised(monkeypatch):
    """A GPU row's ``extra.sync_points``: per Python line the syncs PyTorch's detector reported in one call (here its
    warnings made by hand: the detector needs CUDA), most first; other warnings are not counted, and the detector
    is switched off again even when the call raises."""
    import warnings

    import torch

    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # line A, twice
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)  # line B
        warnings.warn("something else", stacklevel=1)

    line = step.__code__.co_firstlineno
    got = harness.sync_points(step, 8)
    here = "tests/integration/test_benchmarks.py"
    assert got == [[f"{here}:{line + 2}", 2], [f"{here}:{line + 3}", 1]], got
    assert harness.sync_points(step, 1) == [[f"{here}:{line + 2}", 2]]
    assert modes == ["warn", "default"] * 2

    def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        harness.sync_points(fails, 8)
    assert modes[-1] == "default"


@pytest.mark.parametrize("name", ["h200.json", "cpu.json"])
def test_committed_results_follow_the_schema(name):
    res = harness.load_results(str(ROOT / "benchmarks" / "results" / name))
    assert res["scenarios"], name
    key = "train_step_8" if name == "h200.json" else "readme_step_cpu"
    rows = res["scenarios"][key]["rows"]
    assert rows["frozen"]["status"] == "ok" and rows["fast_multilora"]["ratios"]["frozen"] > 0


def test_a_killed_fresh_process_child_keeps_the_rows_it_measured(monkeypatch):
    """A child killed at the time budget after measuring some of its variants: those rows are kept (the child writes
    its file after every row), the rest are errors naming the kill."""
    import argparse
    import types

    import run as run_py

    def child(argv, cwd, timeout):  # measured n=8, killed during n=32
        out = argv[argv.index("--out") + 1]
        harness.write_json(out, {"rows": {"fast[n=8]": harness.make_row("fast", "n=8", wall_ms=2.0)}})
        raise subprocess.TimeoutExpired(argv, timeout)

    monkeypatch.setattr(run_py.subprocess, "run", child)
    args = argparse.Namespace(fresh_process=True, threads=1, variants=None)
    st = {"device": "cpu", "size": "tiny", "backend": "torch", "compile_backend": "aot_eager"}
    rows = run_py.measure_rows(args, st, types.SimpleNamespace(name="s"), [("fast", "n=8"), ("fast", "n=32")],
                               harness.Budget(100))
    assert rows["fast[n=8]"]["status"] == "ok" and rows["fast[n=8]"]["wall_ms"] == 2.0
    assert rows["fast[n=32]"]["status"] == "error" and "killed" in rows["fast[n=32]"]["reason"]
    assert all(r["fresh_process"] for r in rows.values())


def test_tune_kernels_sass_part_reads_the_main_loops(tmp_path):
    """``tune_kernels.py --parts sass`` (no GPU: sm_90 compiles by Triton's bundled ptxas) records registers and the
    main loop's instructions and barriers of the shrink and its backward, with and without dropout; drawing or
    reading the mask adds instructions to the loop (a loop finder that missed the K step would not see them)."""
    from helpers import compile_for_sm90

    out = tmp_path / "sass.json"
    script = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); sys.argv = ['tune_kernels.py', "
              f"'--parts', 'sass', '--out', {str(out)!r}]; import tune_kernels; tune_kernels.main()")
    res = compile_for_sm90(script, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = {r["op"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {f"sass_shrink_{m}" for m in ("none", "dropout", "stored")} | {
        f"sass_shrink_bwd_{m}" for m in ("none", "redrawn", "stored")} | {"sass_draw_bytes", "sass_draw_mask",
                                                                         "sass_read_x"}
    for name, r in rows.items():
        assert r["regs"] > 0 and r["loop_instr"] > 0, r
        assert (r["loop_bar"] > 0) == ("shrink" in name or name == "sass_draw_mask"), r  # the dots' and mask's
    for kind, modes in (("shrink", ("dropout", "stored")), ("shrink_bwd", ("redrawn", "stored"))):
        for m in modes:
            assert rows[f"sass_{kind}_{m}"]["loop_instr"] > rows[f"sass_{kind}_none"]["loop_instr"], (kind, m)
