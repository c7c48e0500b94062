"""Compare the adapters two training runs saved (``train_multi_adapter.py --save-init``): per adapter, the relative
difference of the trained updates ``||(W_b - W0) - (W_a - W0)|| / ||W_a - W0||`` over all its LoRA tensors, and the
largest absolute difference. Writes JSON; exit status 1 when any adapter exceeds ``--tol``.

    python benchmarks/compare_adapters.py RUN_A RUN_B --tol 0.05 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import load_file


def load(run: Path, sub: str) -> dict:
    out = {}
    for f in sorted((run / sub).glob("*/adapter_model.safetensors")):
        out[f.parent.name] = {k: v.double() for k, v in load_file(f).items()}
    if not out:
        raise SystemExit(f"no adapters under {run / sub}")
    return out


def compare(a: Path, b: Path) -> dict:
    init, wa, wb = load(a, "adapters_init"), load(a, "adapters"), load(b, "adapters")
    if set(wa) != set(wb):
        raise SystemExit(f"different adapters: {sorted(wa)} vs {sorted(wb)}")
    res = {}
    for name in sorted(wa):
        num = den = 0.0
        max_abs = 0.0
        for k, w in wa[name].items():
            d = wb[name][k] - w
            num += float(d.square().sum())
            den += float((w - init[name][k]).square().sum())
            max_abs = max(max_abs, float(d.abs().max()))
        res[name] = {"rel_update_diff": (num / den) ** 0.5 if den else float("nan"), "max_abs_diff": max_abs,
                     "update_norm": den ** 0.5}
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_a", type=Path, help="reference run (its adapters_init/ is the common start)")
    p.add_argument("run_b", type=Path)
    p.add_argument("--tol", type=float, default=None, help="largest allowed rel_update_diff")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    res = compare(a.run_a, a.run_b)
    worst = max(r["rel_update_diff"] for r in res.values())
    out = {"run_a": str(a.run_a), "run_b": str(a.run_b), "tol": a.tol, "worst_rel_update_diff": worst,
           "adapters": res}
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0 if a.tol is None or worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
