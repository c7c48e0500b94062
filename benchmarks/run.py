"""Run benchmark scenarios x providers and write one results file (schema: ``harness.py``).

    python benchmarks/run.py --out benchmarks/results/h200.json --merge                # GPU, default scenarios
    python benchmarks/run.py --scenarios train_step_8 --providers frozen,peft_single,fast_multilora --fresh-process
    python benchmarks/run.py --device cpu --out /tmp/cpu.json                         # tiny shapes, torch backend
    python benchmarks/run.py --device cpu --size full --scenarios readme_step_cpu --out benchmarks/results/cpu.json
    python benchmarks/run.py --dry-run --scenarios all                               # plan + inputs, no timing
    python benchmarks/run.py --list                                                  # scenarios and providers

``--fresh-process`` runs every provider of a scenario in its own process (host-bound steps then do not inherit
the allocator, caches and Python state of the providers before them); the parent collects their rows, so medians and
ratios still stand side by side in one record. ``--budget-s S`` starts no row after S seconds; under
``--fresh-process`` it also bounds a running provider: its process is killed 60 s past the budget (so a budget far
below one row's time kills that row, recorded as an error). Exit status: 0, 1 when a row raised, 2 on bad
arguments, 3 when the time budget left rows out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
if ROOT not in sys.path:  # this checkout's fast_multilora, imported before peft/transformers (its kernels guard)
    sys.path.insert(1, ROOT)

import harness  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    ap.add_argument("--size", choices=("full", "tiny"), default=None, help="default: full on cuda, tiny on cpu")
    ap.add_argument("--scenarios", default="default", help="comma-separated names, 'default' or 'all'")
    ap.add_argument("--providers", default="all", help="comma-separated names or 'all'")
    ap.add_argument("--variants", default=None, help="comma-separated variants to run (e.g. n=8/batch=8); default all")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "h200.json"))
    ap.add_argument("--merge", action="store_true", help="replace only this run's scenarios in an existing --out")
    ap.add_argument("--fresh-process", action="store_true", help="each provider of a scenario in its own process")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no row past this many seconds (exit 3); with --fresh-process a provider's process "
                         "still running 60 s past the budget is killed, its unfinished rows recorded as errors")
    ap.add_argument("--backend", default=None, help="fast_multilora backend (default: triton on cuda, torch on cpu)")
    ap.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor on cuda, "
                                                            "aot_eager on cpu)")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads (default 1: small ops on a shared "
                                                           "CPU only contend; 0 keeps torch's default)")
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and build every scenario's inputs and "
                                                           "model (on the meta device), time nothing")
    ap.add_argument("--list", action="store_true", help="list scenarios and providers")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one provider, rows only (fresh process)
    return ap.parse_args(argv)


def resolve(args):
    """``(scenarios, providers)`` named by the arguments; ``SystemExit(2)`` naming what is unknown."""
    from providers import PROVIDERS
    from scenarios import SCENARIOS

    if args.scenarios in ("default", "all"):
        scs = [s for s in SCENARIOS.values() if args.scenarios == "all" or s.default]
    else:
        unknown = [n for n in args.scenarios.split(",") if n not in SCENARIOS]
        if unknown:
            _usage(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
        scs = [SCENARIOS[n] for n in args.scenarios.split(",") if n]
    provs = list(PROVIDERS) if args.providers == "all" else [p for p in args.providers.split(",") if p]
    unknown = [p for p in provs if p not in PROVIDERS]
    if unknown:
        _usage(f"unknown provider(s) {unknown}; choose from {sorted(PROVIDERS)}")
    return scs, provs


def _usage(msg):
    print(f"run.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


def settings(args) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        _usage("no CUDA device; use --device cpu (tiny shapes) or --dry-run")
    return {"device": device, "size": args.size or ("full" if device == "cuda" else "tiny"),
            "backend": args.backend or ("triton" if device == "cuda" else "torch"),
            "compile_backend": args.compile_backend or ("inductor" if device == "cuda" else "aot_eager")}


def child_argv(args, st, scenario, provider) -> list:
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--scenarios", scenario, "--providers", provider,
            "--device", st["device"], "--size", st["size"], "--backend", st["backend"],
            "--compile-backend", st["compile_backend"], "--threads", str(args.threads)]
    return argv + (["--variants", args.variants] if args.variants else [])


def measure_rows(args, st, sc, pairs, budget, on_row=None) -> dict:
    """Rows of ``pairs`` (provider, variant) of scenario ``sc``, in this process or one process per provider;
    ``on_row(rows)`` after each row (a child writes its file then: a killed child keeps the rows it measured)."""
    from scenarios import Context, measure

    rows = {}
    if not args.fresh_process:
        ctx = Context(sc, st["device"], st["size"], st["backend"], st["compile_backend"])
        for name, variant in pairs:
            key = harness.row_key(name, variant)
            rows[key] = (measure(ctx, name, variant) if budget.allows()
                         else harness.make_row(name, variant, "skipped", "time budget"))
            report(sc.name, rows[key])
            if on_row is not None:
                on_row(rows)
        return rows
    for name in dict.fromkeys(n for n, _ in pairs):
        mine = [(n, v) for n, v in pairs if n == name]
        if not budget.allows():
            got = {harness.row_key(n, v): harness.make_row(n, v, "skipped", "time budget") for n, v in mine}
        else:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "rows.json")
                left = budget.left()
                try:
                    res = subprocess.run(child_argv(args, st, sc.name, name) + ["--out", out], cwd=ROOT,
                                         timeout=None if left is None else max(left, 1) + 60)
                    why = f"exit status {res.returncode}"
                except subprocess.TimeoutExpired:
                    why = "time budget (the child was killed)"
                got = {}
                if os.path.exists(out):  # complete, or the rows measured before a kill or a crash
                    with open(out) as f:
                        got = json.load(f)["rows"]
                for n, v in mine:  # killed (time budget), a crash (segfault, OOM kill) before the row was written
                    if harness.row_key(n, v) not in got:
                        got[harness.row_key(n, v)] = harness.make_row(n, v, "error", f"child process died: {why}")
        for key, row in got.items():
            row["fresh_process"] = True
            rows[key] = row  # the child printed it
    return rows


def report(scenario, row):
    t = row["wall_ms"]
    what = f"{t:10.2f} ms" if t is not None else f"{row['status']}: {row['reason']}"
    split = f"  gpu {row['gpu_ms']:.2f} host {row['host_ms']:.2f}" if row["gpu_ms"] is not None else ""
    print(f"  {scenario:18s} {harness.row_key(row['provider'], row['variant']):48s} {what}{split}", flush=True)


def dry_run(scs, provs, st) -> int:
    """The plan of every scenario, and its inputs and model built for real shapes (model on the meta device: no
    memory, no device needed)."""
    import workloads as M
    from scenarios import Context, rows_of

    for sc in scs:
        sizes = M.Sizes(st["size"])
        pairs = rows_of(sc, provs, sizes)
        print(f"== {sc.name} ({sc.kind}): {sc.description}")
        if sc.not_implemented:
            print(f"   not implemented: {sc.not_implemented}")
            continue
        ctx = Context(sc, "cpu", st["size"], st["backend"], st["compile_backend"])
        for v in dict.fromkeys(v for _, v in pairs):
            b = ctx.batch(v)
            shapes = {k: tuple(t.shape) for k, t in b.items() if hasattr(t, "shape")}
            if sc.kind in ("create", "churn"):
                print(f"   inputs[{v}]: {b['adapters']} " + ("LoraConfigs to add" if sc.kind == "create" else
                                                           "adapters registered, one added and deleted per round"))
                continue
            print(f"   inputs[{v}]: {shapes}, {len(set(b.get('names', [])) - {'__base__'})} adapters in the batch, "
                  f"{b.get('adapters', 3 if sc.model == 'readme' else 8)} "
                  + ("registered, a different set per step" if sc.kind == "paged" else "resident"))
        if sc.model in ("llama", "llama8b", "moe", "layer", "readme") and not dict(sc.lora).get("use_dora"):
            # (DoRA's init reads the base weight: no meta build)
            ctx.device = "meta"  # structure and parameter counts without allocating
            # 8 adapters (the scale scenario's counts grow the same model at run time); create_adapters' one
            pm = ctx.peft(1 if sc.kind == "create" else None)
            total = sum(p.numel() for p in pm.parameters())
            lora = sum(p.numel() for p in M.lora_params(pm))
            print(f"   model (meta): {total / 1e6:.1f} M parameters, {lora / 1e6:.2f} M of them LoRA")
            if sc.kind == "create":
                n = max(M.Sizes(st["size"]).create)
                print(f"   {n} more adapters: {n * lora / 1e6:.0f} M LoRA parameters, {n * lora * 4 / 2**30:.1f} GiB "
                      "in fp32 (PEFT's autocast_adapter_dtype)")
        for name, v in pairs:
            print(f"   row {harness.row_key(name, v)}")
    return 0


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    args = parse_args(argv)
    import fast_multilora  # noqa: F401, I001 - before peft/transformers: the checkout's kernels guard
    from providers import PROVIDERS
    from scenarios import SCENARIOS, rows_of

    if args.list:
        for s in SCENARIOS.values():
            print(f"{s.name:20s} {s.description}" + (f" [not implemented: {s.not_implemented}]"
                                                      if s.not_implemented else ""))
        for p in PROVIDERS.values():
            print(f"{p.name:32s} {p.doc}")
        return 0
    scs, provs = resolve(args)
    st = settings(args)
    if args.dry_run:
        return dry_run(scs, provs, st)
    import torch
    import workloads as M

    if st["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    elif args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",") if args.variants else None
    budget = harness.Budget(args.budget_s)
    if args.child:
        sc = scs[0]
        def write(rows):
            harness.write_json(args.out, {"rows": rows})

        write(measure_rows(argparse.Namespace(fresh_process=False), st, sc,
                           rows_of(sc, provs, M.Sizes(st["size"]), variants), budget, on_row=write))
        return 0
    res = harness.load_results(args.out) if args.merge else {"schema": harness.SCHEMA, "scenarios": {}}
    rc = 0
    for sc in scs:
        print(f"== {sc.name} ({budget.elapsed():.0f} s)", flush=True)
        meta = harness.run_meta(st["device"], args.commit, **{k: v for k, v in st.items() if k != "device"},
                                fresh_process=args.fresh_process, torch_threads=torch.get_num_threads(),
                                dtype="bfloat16" if st["device"] == "cuda" else "float32",
                                timing=f"median of CUDA-event timings (CPU: wall clock); warm-up/iterations "
                                       f"{M.Sizes(st['size']).warm}/{M.Sizes(st['size']).iters}, PEFT's loops and "
                                       f"generation {M.Sizes(st['size']).slow_warm}/{M.Sizes(st['size']).slow_iters}"
                                       + (f"; {sc.name}: {sc.timing}" if sc.timing else ""))
        pairs = rows_of(sc, provs, M.Sizes(st["size"]), variants)
        if sc.not_implemented:
            rows = {harness.row_key(n, v): harness.make_row(n, v, "not_implemented", sc.not_implemented)
                    for n, v in pairs if PROVIDERS[n].family == "fast"}
        elif sc.needs and not _importable(sc.needs):
            rows = {harness.row_key(n, v): harness.make_row(n, v, "skipped", f"{sc.needs} unavailable")
                    for n, v in pairs}
        elif sc.liger and st["device"] != "cuda":  # its Triton kernels need a GPU; its patches are global to classes
            rows = {harness.row_key(n, v): harness.make_row(n, v, "skipped", "Liger Kernel's kernels need a CUDA GPU")
                    for n, v in pairs}
        else:
            rows = measure_rows(args, st, sc, pairs, budget)
        harness.add_ratios(rows, harness.RATIO_REFS + sc.refs)
        res["scenarios"][sc.name] = {"description": sc.description, "run": meta, "rows": rows}
        harness.write_json(args.out, res)
        statuses = {r["status"] for r in rows.values()}
        if "error" in statuses:
            rc = max(rc, 1)
        if any(r["reason"] == "time budget" for r in rows.values()):
            rc = 3
    print(f"run.py: wrote {args.out} in {budget.elapsed():.0f} s (exit {rc})", flush=True)
    return rc


def _importable(name) -> bool:
    try:
        __import__(name)
        return True
    except Exception:  # noqa: BLE001
        return False


if __name__ == "__main__":
    sys.exit(main())
