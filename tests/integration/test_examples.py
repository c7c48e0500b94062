"""The demo (``examples/train_multi_adapter.py``) and ``examples/eval_mixed_batch.py`` on its saved run: the
evaluation reloads the adapters with stock PEFT and scores the same held-out prompts as the demo's own evaluation
(``run.json`` records how many per task), and ``--check`` finds the mixed batch's answers equal to stock PEFT
generating one adapter at a time."""

import json
import os
import sys

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)

pytestmark = pytest.mark.slow  # demo runs


def test_eval_mixed_batch_scores_the_demos_prompts(tmp_path, capsys):
    import eval_mixed_batch
    import train_multi_adapter

    train_multi_adapter.main(["--model", "tiny", "--max-steps", "2", "--output-dir", str(tmp_path), "--device", "cpu",
                              "--backend", "torch", "--eval-per-task", "3", "--no-eval-before",
                              "--train-per-adapter", "24"])
    demo = json.loads((tmp_path / "metrics.json").read_text())
    assert json.loads((tmp_path / "run.json").read_text())["eval_per_task"] == 3
    got = eval_mixed_batch.main(["--run-dir", str(tmp_path), "--device", "cpu", "--backend", "torch", "--check"])
    assert got["rows"] == 3 * 3 * 2  # 3 adapters on their tasks + the base on each task, 3 prompts each
    assert "answers differing from the mixed batch: 0 of 18" in capsys.readouterr().out
    # the same prompts and weights as the demo's evaluation after training: the same accuracies
    assert {f"{a}/{t}": v for (a, t), v in got["accuracy"].items()} == demo["after"]["accuracy"]


def test_readme_quick_start_runs(tmp_path, monkeypatch):
    """The README's quick-start block runs as it is and saves every adapter in PEFT format."""
    readme = open(os.path.join(os.path.dirname(EXAMPLES), "README.md")).read()
    block = readme.split("<!-- quick-start", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(block, "README.md quick-start", "exec"), scope)
    assert set(scope["per"]) == {"sql", "chat", "code"}
    assert all(p.grad is not None for n, p in scope["model"].named_parameters() if "lora_" in n)
    saved = {p.parent.name for p in (tmp_path / "out" / "adapters").glob("*/adapter_config.json")}
    assert saved == {"sql", "chat", "code"}


def test_readme_demo_table_is_what_the_demo_prints():
    """The README's demo table is the demo's own printout: the demo's ``print_table`` fed the README's numbers prints
    the README's lines (header and rows), character for character."""
    import multi_adapter_tasks as T
    import train_multi_adapter

    readme = open(os.path.join(os.path.dirname(EXAMPLES), "README.md")).read()
    lines = readme.split("<!-- timings -->", 1)[1].split("```\n", 2)[1].splitlines()
    header, rows = lines[0], [ln.split() for ln in lines[1:]]
    before = {"accuracy": {}, "loss": {}}
    after = {"accuracy": {}, "loss": {}, "examples": {}}
    for a, t, b0, a0, a1, b1, l0, _, l1 in rows:
        before["accuracy"].update({f"{T.BASE}/{t}": float(b0), f"{a}/{t}": float(a0)})
        after["accuracy"].update({f"{T.BASE}/{t}": float(b1), f"{a}/{t}": float(a1)})
        before["loss"][a], after["loss"][a] = float(l0), float(l1)
        after["examples"].update({f"{a}/{t}": ("x", "y", "y"), f"{T.BASE}/{t}": ("x", "y", "z")})
    args = train_multi_adapter.parse_args([])
    assert [T.task_of(a) for a in args.adapters] == [r[1] for r in rows], "the README lists the demo's adapters"
    printed = []
    train_multi_adapter.print_table(args, before, after, printed.append)
    table = "\n".join(printed).splitlines()
    start = table.index(header)  # the header as the demo prints it
    assert table[start + 1 : start + 1 + len(rows)] == lines[1 : 1 + len(rows)]


def test_trainer_example_trains_logs_and_saves_every_adapter(tmp_path, capsys):
    """``examples/trainer_multi_adapter.py`` (an unmodified Trainer built by ``fast_multilora.trainer_kwargs``) on the
    tiny model: per-adapter losses in the logs, every adapter saved in PEFT format, and neither a warning of the
    helper (its TrainingArguments already say what the helper needs) nor a fallback of the fused loss."""
    import warnings

    import multi_adapter_tasks as T
    import trainer_multi_adapter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_multi_adapter.main(["--model", "tiny", "--max-steps", "5", "--batch-size", "6", "--device", "cpu",
                                    "--output-dir", str(tmp_path), "--adapter-lr", f"{T.DEFAULT_ADAPTERS[0]}=4e-3"])
    ours = [str(w.message) for w in caught if str(w.message).startswith(("trainer_kwargs", "PerAdapterLoss"))]
    assert not ours, ours
    out = capsys.readouterr().out
    logged = out.split("per-adapter losses logged:", 1)[1].split("accuracy after training", 1)[0]
    assert "step    5" in logged and all(f"{a}=" in logged for a in T.DEFAULT_ADAPTERS), logged
    saved = {p.parent.name for p in (tmp_path / "adapters").glob("*/adapter_config.json")}
    assert saved == set(T.DEFAULT_ADAPTERS)


def test_multi_tenant_example_paged_equals_resident(tmp_path):
    """``examples/multi_tenant.py --resident 1``: the registry paged (the step's tenants, the prefetched next ones and
    one other on the device) with ``torch.optim.AdamW``, tenants leaving and joining (the loop edits the optimizer's
    groups): the same requests and every weight as the same run fully resident, most adapters in host memory at the
    end, and a leaver saved while paged out loads with stock PEFT to its weights. (Equal to within 1e-4, a hundredth
    of one update of lr 1e-2, where a slot mix-up moves weights by whole updates: the resident run's
    torch.optim.AdamW steps through the store's AdamW kernel, the paged one is torch's own math, and where a gradient
    is near AdamW's eps their roundings move an update by up to ~1e-5; ``tests/test_paging.py`` compares both with
    torch's math, bitwise.)"""
    import multi_tenant
    import torch
    from peft import PeftModel

    import fast_multilora

    argv = ["--tenants", "24", "--per-step", "3", "--steps", "14", "--churn-every", "4"]
    paged = multi_tenant.main(argv + ["--resident", "1", "--out", str(tmp_path / "paged")])
    resident = multi_tenant.main(argv + ["--optimizer", "torch", "--out", str(tmp_path / "resident")])
    assert paged["names"] == resident["names"] and paged["counts"] == resident["counts"]
    pager = fast_multilora.paging._router(paged["model"]).pager
    assert len(pager.paged) >= len(paged["names"]) // 2, sorted(pager.resident())
    fast_multilora.paging.synchronize(paged["model"])
    got, want = dict(paged["model"].named_parameters()), dict(resident["model"].named_parameters())
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k].detach().cpu(), want[k].detach().cpu(), rtol=1e-4, atol=1e-4, msg=k)
    left = sorted({p.parent.name for p in (tmp_path / "paged").glob("*/adapter_config.json")} - set(paged["names"]))
    assert len(left) == 3, left
    name = left[0]
    torch.manual_seed(0)
    loaded = PeftModel.from_pretrained(multi_tenant.base_model(16), str(tmp_path / "paged" / name), adapter_name=name)
    twin = PeftModel.from_pretrained(multi_tenant.base_model(16), str(tmp_path / "resident" / name), adapter_name=name)
    a = {k: v for k, v in loaded.state_dict().items() if f".{name}." in k}
    b = {k: v for k, v in twin.state_dict().items() if f".{name}." in k}
    assert a and a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=k)


def test_multi_tenant_example_trains_busy_tenants_and_saves_leavers(tmp_path):
    """``examples/multi_tenant.py``: a registry created by ``add_adapters``, Zipf-like requests, tenants leaving
    (saved, then deleted) and joining while ``fast_multilora.AdamW`` trains; the busiest tenants' losses fall, and a
    saved adapter loads with stock PEFT to the weights it was trained to."""
    import multi_tenant
    import torch
    from peft import PeftModel

    res = multi_tenant.main(["--tenants", "24", "--steps", "16", "--churn-every", "5", "--out", str(tmp_path)])
    busy = sorted(res["counts"], key=lambda n: -res["counts"][n])[:3]
    assert all(res["counts"][n] >= 5 and res["last"][n] < res["first"][n] - 0.2 for n in busy), \
        {n: (res["counts"][n], res["first"][n], res["last"][n]) for n in busy}
    saved = {p.parent.name for p in tmp_path.glob("*/adapter_config.json")}
    left = set(res["trained"]) | saved
    assert set(res["trained"]) <= saved and len(saved - set(res["names"])) == 3, (saved, left)  # 3 tenants left
    name = busy[0]
    torch.manual_seed(0)  # the example's seed: the same base
    loaded = PeftModel.from_pretrained(multi_tenant.base_model(16), str(tmp_path / name), adapter_name=name)
    want = {k: v for k, v in res["model"].state_dict().items() if f".{name}." in k}
    got = {k: v for k, v in loaded.state_dict().items() if f".{name}." in k}
    assert want and set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
