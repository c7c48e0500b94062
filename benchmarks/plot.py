"""Plot and tabulate a results file (schema: ``harness.py``).

    python benchmarks/plot.py benchmarks/results/h200.json --png docs/h200_model.png
    python benchmarks/plot.py benchmarks/results/cpu.json --md -              # markdown tables on stdout
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402


def _f(v, d=1):
    return "-" if v is None else f"{v:.{d}f}"


def tables(res: dict, scenarios=None) -> str:
    """One markdown table per scenario: wall / GPU / host ms, × frozen, × peft_single, peak MiB, status or note. A
    row merged from another run than its scenario's (``extra["run"]``) names that run; ratios are always within a
    row's own run."""
    out = []
    for sc, rec in res["scenarios"].items():
        if scenarios and sc not in scenarios:
            continue
        run = rec["run"]
        where = run.get("gpu") or f"{run.get('machine', {}).get('cpu')} ({run.get('device')})"
        out += [f"### {sc}", "", rec["description"], "",
                f"{where}, commit `{run.get('commit')}`, {run.get('date_utc')} UTC, torch {run.get('torch')}"
                + (", one process per provider" if run.get("fresh_process") else "")
                + (f"; {run['converted_from']}" if run.get("converted_from") else ""), "",
                "| row | wall ms | GPU ms | host ms | × frozen | × frozen compiled | × peft_single | peak MiB | note |",
                "|---|---|---|---|---|---|---|---|---|"]
        for key, r in rec["rows"].items():
            ratios = r["ratios"]
            note = r["reason"] or ""
            if r["status"] == "ok":
                note = _note(r["extra"], ratios)
            other = r.get("extra", {}).get("run")
            if other:  # merged from another run (its own process and machine): its ratios are that run's
                note = f"run `{other.get('commit')}` {other.get('date_utc')}" + (f"; {note}" if note else "")
            elif r["status"] != "ok":
                note = f"**{r['status']}**: {note}"
            out.append(f"| {key} | {_f(r['wall_ms'])} | {_f(r['gpu_ms'])} | {_f(r['host_ms'])} | "
                       f"{_f(ratios.get('frozen'), 2)} | {_f(ratios.get('frozen_compiled'), 2)} | "
                       f"{_f(ratios.get('peft_single'), 2)} | "
                       f"{_f(r['peak_mib'], 0)} | {note.replace('|', '/')} |")
        out.append("")
    return "\n".join(out)


def _note(e: dict, ratios=None) -> str:
    parts = []
    if (ratios or {}).get("peft_add_adapter"):
        parts.append(f"{ratios['peft_add_adapter']:.3f} x PEFT's add_adapter loop")
    if "save_s" in e:
        parts.append(f"save_adapters {e['save_s']:.2f} s, load_adapters {e['load_s']:.2f} s")
    if "eval_loss_fused_minus_logits" in e:
        parts.append(f"fused - logits loss (eval) {e['eval_loss_fused_minus_logits']:.1e}")
    if "adapters_with_grads" in e:
        parts.append(f"{e['adapters_with_grads']}/{e.get('adapters_in_batch', e.get('adapters'))} adapters got "
                     "gradients")
    if "all_adapters_got_grads" in e:  # schema-1 rows
        parts.append(f"every adapter got gradients: {'yes' if e['all_adapters_got_grads'] else 'no'}")
    if "optimizer" in e and not str(e["optimizer"]).startswith("torch.optim.AdamW(model"):
        parts.append(str(e["optimizer"]).split(" (")[0])
    if "diff_rms_over_lora_effect_rms" in e:
        parts.append(f"vs PEFT: diff RMS / LoRA effect {e['diff_rms_over_lora_effect_rms']:.1e}")
    if "tokens_equal" in e:  # schema-1 rows
        parts.append(f"tokens = {e.get('tokens_vs')}'s: {'yes' if e['tokens_equal'] else 'no'}")
    if "tokens_equal_peft" in e:
        parts.append(f"tokens = PEFT's: {'yes' if e['tokens_equal_peft'] else 'no'} "
                     f"({100 * e['tokens_common_prefix_frac']:.0f} % common prefix)")
    if e.get("compile_s") is not None:
        parts.append(f"compile + first call {e['compile_s']:.1f} s")
    if e.get("graph_breaks"):
        parts.append(f"{e['graph_breaks']} graph breaks")
    return "; ".join(parts)


def plot(res: dict, path: str, title: str | None = None) -> None:
    """Bars of wall ms per row, one panel per scenario with timings; ``× frozen`` beside each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = [(sc, rec) for sc, rec in res["scenarios"].items()
            if any(r["status"] == "ok" for r in rec["rows"].values())]
    if not scen:
        raise ValueError("plot: no scenario has a timed row")
    cols = min(3, len(scen))
    nrows = -(-len(scen) // cols)
    tall = max(len(rec["rows"]) for _, rec in scen)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.6 * cols, (0.9 + 0.2 * tall) * nrows + 0.6), squeeze=False)
    for ax in axes.flat[len(scen):]:
        ax.axis("off")
    for ax, (sc, rec) in zip(axes.flat, scen, strict=False):
        rows = [(k, r) for k, r in rec["rows"].items() if r["status"] == "ok"]
        ms = [r["wall_ms"] for _, r in rows]
        colors = ["tab:gray" if r["provider"] == "frozen" else "tab:green" if r["provider"].startswith("fast")
                  else "tab:blue" for _, r in rows]
        ax.barh(range(len(rows)), ms, color=colors)
        ax.set_yticks(range(len(rows)), [k for k, _ in rows], fontsize=7)
        ax.invert_yaxis()
        for i, (_, r) in enumerate(rows):
            x = r["ratios"].get("frozen")
            ax.text(r["wall_ms"], i, f" {r['wall_ms']:.1f}" + (f" (×{x:.2f})" if x else ""), va="center",
                    fontsize=6)
        ax.set_xlim(0, max(ms) * 1.5)
        run = rec["run"]
        ax.set_title(f"{sc} · {str(run.get('commit'))[:9]}", fontsize=9)
        ax.set_xlabel("ms per call (median)", fontsize=7)
        ax.tick_params(axis="x", labelsize=6)
    runs = [rec["run"] for _, rec in scen]
    where = runs[0].get("gpu") or runs[0].get("machine", {}).get("cpu")
    fig.suptitle(title or f"fast_multilora vs PEFT · {where} · green: fast_multilora, blue: PEFT, gray: no LoRA",
                 fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_figheight()))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results")
    ap.add_argument("--png", default=None, help="write the plot here")
    ap.add_argument("--md", default=None, help="write markdown tables here ('-': stdout)")
    ap.add_argument("--scenarios", default=None, help="comma-separated subset (default: all in the file)")
    args = ap.parse_args(argv)
    res = harness.load_results(args.results)
    if args.scenarios:
        keep = args.scenarios.split(",")
        res = {**res, "scenarios": {k: v for k, v in res["scenarios"].items() if k in keep}}
    if args.png:
        plot(res, args.png)
        print(f"plot.py: wrote {args.png}")
    if args.md == "-":
        print(tables(res))
    elif args.md:
        harness.write_text(args.md, tables(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
