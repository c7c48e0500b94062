"""Segmented LoRA ops: Triton kernels (both families) against the torch reference and a per-adapter torch loop.

For every case (tokens S, input dim K, output dim N, rank r, adapters, token mix, dropout p) and every op

* ``shrink``  ``h = dropout(x) @ A_a^T``                      (reads x once)
* ``expand``  ``y += scale_a * h @ B_a^T``                     (reads and writes y)
* ``bwd``     ``lora_expand_bwd`` then ``lora_shrink_bwd``    (dh, dB, then dx, dA)
* ``full``    the layer's LoRA delta forward + backward (the four ops in a row)

it records the median time (``triton.testing.do_bench``: L2 flushed before every call, 20/80 % quantiles), the
achieved GB/s from the bytes the op must move (``op_bytes``), that as a fraction of the copy bandwidth measured in the
same run (a 1 GiB device-to-device ``copy_``, bytes read + written), and speed-ups over ``torch_reference``
(``fast_multilora.reference``, the oracle) and ``torch_loop`` (what a user writes: per adapter, gather its rows,
matmul, ``index_copy_``/``index_add_`` back). As fla does, a speed-up is printed only for an op whose outputs matched
the reference in this case (checked once per case on the full tensors).

Kernel families: ``sgemm`` gets ``Segments`` of contiguous runs (tokens sorted by adapter, ``perm=None``);
``chunked`` gets the same tokens randomly interleaved and grouped through a permutation. Both are built with
``kernels.segments.segments_from_token_slots``. The reference and the loop run the contiguous layout.

    python benchmarks/bench_kernels.py                        # GPU, full case list, bf16
    python benchmarks/bench_kernels.py --quick                # CPU dry run: Triton interpreter, fp16, tiny cases
    python benchmarks/bench_kernels.py --cases S8192-K4096    # only cases whose id contains one of the substrings

Writes ``<out-dir>/kernels.json`` and ``<out-dir>/kernels.md`` after every case (a killed run keeps what it measured).
Launchers that do not exist yet are recorded as ``missing``; the other providers still run.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import traceback
from dataclasses import asdict, dataclass


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny cases on the CPU (Triton interpreter), a dry run")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--name", default="kernels", help="file stem of the JSON and markdown outputs")
    ap.add_argument("--cases", default="", help="comma-separated substrings; run only cases whose id contains one")
    ap.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"],
                    help="activation/weight dtype (default bf16; fp16 with --quick: the interpreter has no bf16 dot)")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new case after this many seconds")
    ap.add_argument("--warmup-ms", type=int, default=10)
    ap.add_argument("--rep-ms", type=int, default=40)
    ap.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and ARGS.quick:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on CPU tensors

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Budget, bench_op, fmt, run_meta, write_json, write_text  # noqa: E402

OPS = ("shrink", "expand", "bwd", "full")
KERNEL_FAMILIES = ("sgemm", "chunked")
PROVIDERS = KERNEL_FAMILIES + ("torch_reference", "torch_loop")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# fla's check: relative RMSE of the kernel's output against the reference's, per activation dtype
ERR_RATIO_TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
LAUNCHERS = {"lora_shrink": "forward", "lora_expand": "forward", "lora_expand_bwd": "backward",
             "lora_shrink_bwd": "backward"}
OP_NEEDS = {"shrink": ("lora_shrink",), "expand": ("lora_expand",), "bwd": ("lora_expand_bwd", "lora_shrink_bwd"),
            "full": tuple(LAUNCHERS)}


@dataclass(frozen=True)
class Case:
    S: int
    K: int
    N: int
    r: int
    adapters: int
    layout: str  # "uniform" (equal shares) or "skewed" (90 % of tokens on one adapter)
    p: float = 0.0  # LoRA dropout

    @property
    def id(self) -> str:
        s = f"S{self.S}-K{self.K}-N{self.N}-r{self.r}-A{self.adapters}-{self.layout}"
        return s + (f"-p{self.p:g}" if self.p else "")


def _c(S, K, N, r, A, layout="uniform", p=0.0):
    return Case(S, K, N, r, A, layout, p)


# Priority order: a time budget cuts the tail. Headline (issue 3's targets and SGLang comparison) first.
FULL_CASES = [
    _c(8192, 4096, 4096, 16, 8),
    _c(8192, 4096, 4096, 16, 8, "skewed"),
    _c(8192, 4096, 4096, 16, 32, "skewed"),
    _c(8192, 4096, 4096, 16, 32),
    _c(8192, 4096, 4096, 16, 1),
    _c(8192, 4096, 4096, 16, 8, p=0.05),
    _c(8192, 4096, 4096, 8, 8),
    _c(8192, 4096, 4096, 64, 8),
    _c(16384, 2048, 2048, 16, 8),
    _c(16384, 2048, 2048, 16, 8, "skewed"),
    _c(8192, 4096, 14336, 16, 8),  # gate/up-shaped
    _c(8192, 14336, 4096, 16, 8),  # down-shaped
    _c(512, 4096, 4096, 16, 8),
    _c(512, 4096, 4096, 16, 32),
    _c(16384, 4096, 4096, 16, 8),
    _c(16384, 4096, 4096, 64, 32, "skewed"),
]
QUICK_CASES = [
    _c(64, 48, 40, 8, 4),
    _c(64, 48, 40, 8, 4, "skewed"),
    _c(48, 32, 32, 4, 1),
    _c(64, 48, 40, 8, 4, p=0.1),
]
HEADLINE = ("S8192-K4096-N4096-r16-A8-uniform", "S8192-K4096-N4096-r16-A8-skewed",
            "S8192-K4096-N4096-r16-A32-skewed")


# ---------------------------------------------------------------------------------------------------------------------
# set-up


def token_slots(c: Case) -> torch.Tensor:
    """Host int64 ``[S]`` slots sorted by adapter: equal shares, or 90 % on adapter 0 and the rest evenly spread."""
    A, S = c.adapters, c.S
    if c.layout == "uniform" or A == 1:
        counts = [S // A + (1 if i < S % A else 0) for i in range(A)]
    elif c.layout == "skewed":
        big = round(0.9 * S)
        rest = S - big
        counts = [big] + [rest // (A - 1) + (1 if i < rest % (A - 1) else 0) for i in range(A - 1)]
    else:
        raise ValueError(c.layout)
    return torch.repeat_interleave(torch.arange(A), torch.tensor(counts))


def op_bytes(c: Case, act_bytes: int, w_bytes: int) -> dict:
    """Bytes each op must move (h, dh, dA, dB are float32). Split-reduction buffers a kernel adds are not counted."""
    S, K, N, R, U, e, w, f = c.S, c.K, c.N, c.r, c.adapters, act_bytes, w_bytes, 4
    shrink = S * K * e + U * R * K * w + S * R * f  # read x, A; write h
    expand = S * R * f + U * R * N * w + 2 * S * N * e  # read h, B; read + write y
    expand_bwd = S * N * e + S * R * f + U * R * N * w + S * R * f + U * R * N * f  # dy, h, B -> dh, dB
    shrink_bwd = S * R * f + 2 * S * K * e + U * R * K * w + U * R * K * f  # dh, x, A -> dx, dA
    return {"shrink": shrink, "expand": expand, "bwd": expand_bwd + shrink_bwd,
            "full": shrink + expand + expand_bwd + shrink_bwd}


def load_kernels():
    """The Triton launchers that exist now, and why the others do not (imported lazily, never fatal)."""
    found, why = {}, {}
    try:
        pkg = importlib.import_module("fast_multilora.kernels")
    except Exception as e:  # the package itself broken: every launcher missing
        return {n: None for n in LAUNCHERS}, {n: f"{type(e).__name__}: {e}" for n in LAUNCHERS}, None
    for name, module in LAUNCHERS.items():
        fn = getattr(pkg, name, None)
        if fn is None:
            try:
                fn = getattr(importlib.import_module(f"fast_multilora.kernels.{module}"), name, None)
                if fn is None:
                    why[name] = f"fast_multilora.kernels.{module} has no {name}"
            except Exception as e:
                why[name] = f"{type(e).__name__}: {e}"
        found[name] = fn
    try:
        keep_mask = importlib.import_module("fast_multilora.kernels.dropout").dropout_keep_mask
    except Exception:
        keep_mask = None
    return found, why, keep_mask


def make_table(c: Case, device):
    from fast_multilora.kernels.segments import AdapterTable

    ranks = torch.full((c.adapters,), c.r, dtype=torch.int32)
    return AdapterTable(
        ranks=ranks.to(device), offsets=(torch.cumsum(ranks, 0) - ranks).to(torch.int32).to(device),
        scales=torch.full((c.adapters,), 2.0, dtype=torch.float32, device=device),
        dropout=torch.full((c.adapters,), float(c.p), dtype=torch.float32, device=device),
        max_rank=c.r, total_rank=c.r * c.adapters, has_dropout=c.p > 0,
    )


class Inputs:
    def __init__(self, c: Case, dtype, device, keep_mask_fn):
        from fast_multilora.kernels.segments import segments_from_token_slots

        g = torch.Generator().manual_seed(0)  # host: layouts
        gd = torch.Generator(device=device).manual_seed(0)  # device: tensors (no host randn of GBs)

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=gd, device=device) * std).to(dtype)

        self.x = randn(c.S, c.K)
        self.A_cat = randn(c.adapters * c.r, c.K, std=1 / math.sqrt(c.K))
        self.B_cat = randn(c.N, c.adapters * c.r, std=1 / math.sqrt(c.r))
        self.y0 = randn(c.S, c.N)
        self.dy = randn(c.S, c.N)
        self.y = self.y0.clone()  # timing target of the in-place expand (values drift; bandwidth does not care)
        self.table = make_table(c, device)
        slots = token_slots(c)
        shuffled = slots[torch.randperm(c.S, generator=g)]
        self.segs = {"sgemm": segments_from_token_slots(slots, grouped=False, device=device),
                     "chunked": segments_from_token_slots(shuffled, grouped=True, device=device)}
        self.seed = 1234 if c.p > 0 else None
        self.keep, self.keep_exact = {}, {}
        for fam, segs in self.segs.items():
            if self.seed is None:
                self.keep[fam], self.keep_exact[fam] = None, True
            elif keep_mask_fn is not None:
                self.keep[fam], self.keep_exact[fam] = keep_mask_fn(self.seed, segs, self.table, c.K), True
            else:  # no way to draw the kernels' mask: the reference times an equivalent mask, checks are skipped
                self.keep[fam] = torch.rand(c.S, c.K, generator=gd, device=device) >= c.p
                self.keep_exact[fam] = False
        # per-adapter row indices and weights for the loop (contiguous layout, like the reference)
        slots_dev = slots.to(device)
        self.groups = [(torch.nonzero(slots_dev == a).reshape(-1), self.A_cat[a * c.r:(a + 1) * c.r].contiguous(),
                        self.B_cat[:, a * c.r:(a + 1) * c.r].contiguous()) for a in range(c.adapters)]


# ---------------------------------------------------------------------------------------------------------------------
# providers: one callable per op


def kernel_ops(kern, inp: Inputs, fam: str, h) -> dict:
    segs, t, seed = inp.segs[fam], inp.table, inp.seed
    shrink, expand, ebwd, sbwd = (kern[n] for n in LAUNCHERS)

    def bwd(hh):
        dh, _ = ebwd(inp.dy, hh, inp.B_cat, segs, t)
        return sbwd(dh, inp.x, inp.A_cat, segs, t, seed=seed, need_dx=True)

    def full():
        hh = shrink(inp.x, inp.A_cat, segs, t, seed=seed)
        expand(hh, inp.B_cat, segs, t, inp.y)
        return bwd(hh)

    ops = {"shrink": lambda: shrink(inp.x, inp.A_cat, segs, t, seed=seed),
           "expand": lambda: expand(h, inp.B_cat, segs, t, inp.y),
           "bwd": lambda: bwd(h), "full": full}
    return {op: fn for op, fn in ops.items() if all(kern[n] is not None for n in OP_NEEDS[op])}


def reference_ops(inp: Inputs, h) -> dict:
    from fast_multilora import reference as R

    segs, t, keep = inp.segs["sgemm"], inp.table, inp.keep["sgemm"]

    def bwd(hh):
        dh, _ = R.lora_expand_bwd(inp.dy, hh, inp.B_cat, segs, t)
        return R.lora_shrink_bwd(dh, inp.x, inp.A_cat, segs, t, keep=keep)

    def full():
        hh = R.lora_shrink(inp.x, inp.A_cat, segs, t, keep=keep)
        R.lora_expand(hh, inp.B_cat, segs, t, inp.y)
        return bwd(hh)

    return {"shrink": lambda: R.lora_shrink(inp.x, inp.A_cat, segs, t, keep=keep),
            "expand": lambda: R.lora_expand(h, inp.B_cat, segs, t, inp.y),
            "bwd": lambda: bwd(h), "full": full}


def loop_ops(inp: Inputs, c: Case) -> dict:
    """Per adapter: gather rows, matmul in the activations' dtype (as PEFT does), scatter back."""
    scale, keep, inv = 2.0, inp.keep["sgemm"], 1.0 / (1.0 - c.p)
    x, dy = inp.x, inp.dy

    def xa(idx):
        rows = x.index_select(0, idx)
        return rows * keep.index_select(0, idx) * inv if keep is not None else rows

    def shrink():
        h = x.new_empty(c.S, c.r)
        for idx, A, _ in inp.groups:
            h.index_copy_(0, idx, xa(idx) @ A.T)
        return h

    def expand(h):
        for idx, _, B in inp.groups:
            inp.y.index_add_(0, idx, h.index_select(0, idx) @ B.T, alpha=scale)

    def bwd(h):
        dx = torch.zeros_like(x)
        grads = []
        for idx, A, B in inp.groups:
            g = dy.index_select(0, idx)
            dh = (g @ B) * scale
            dB = (g.T @ h.index_select(0, idx)) * scale
            dA = dh.T @ xa(idx)
            d = dh @ A
            dx.index_copy_(0, idx, d * keep.index_select(0, idx) * inv if keep is not None else d)
            grads.append((dA, dB))
        return dx, grads

    h0 = shrink()

    def full():
        h = shrink()
        expand(h)
        return bwd(h)

    return {"shrink": shrink, "expand": lambda: expand(h0), "bwd": lambda: bwd(h0), "full": full}


# ---------------------------------------------------------------------------------------------------------------------
# correctness (once per case and family, against the reference on the same segments)


_PRINTED = set()


def _print_once(key: str, text: str) -> None:
    """A launcher's traceback, once per run (later cases fail the same way)."""
    if key not in _PRINTED:
        _PRINTED.add(key)
        print(f"--- {key}:\n{text[-2500:]}", file=sys.stderr, flush=True)


def err_ratio(got, want) -> float:
    got, want = got.float(), want.float()
    if not torch.isfinite(got).all():
        return math.inf
    den = want.pow(2).mean().sqrt().item()
    return (got - want).pow(2).mean().sqrt().item() / max(den, 1e-30)


def check_family(kern, inp: Inputs, fam: str, dtype) -> dict:
    """op -> {"check": "ok" | "FAIL ..." | "error ..." | "missing" | "unchecked ...", "err": worst ratio}."""
    from fast_multilora import reference as R

    segs, t, keep, seed = inp.segs[fam], inp.table, inp.keep[fam], inp.seed
    tol = ERR_RATIO_TOL[dtype]
    h_r = R.lora_shrink(inp.x, inp.A_cat, segs, t, keep=keep)
    per_fn = {}

    def run(name, fn):
        if kern[name] is None:
            per_fn[name] = ("missing", None)
            return
        if not inp.keep_exact[fam] and name in ("lora_shrink", "lora_shrink_bwd"):
            per_fn[name] = ("unchecked (no dropout_keep_mask to draw the kernels' mask)", None)
            return
        try:
            pairs = fn()
        except Exception as e:
            msg = str(e).splitlines()[0][:160] if str(e) else ""
            per_fn[name] = (f"error {type(e).__name__}: {msg}", None)
            _print_once(f"{name} raised", traceback.format_exc())
            return
        errs = {k: err_ratio(g, w) for k, (g, w) in pairs.items()}
        worst = max(errs.values())
        if worst <= tol:
            per_fn[name] = ("ok", worst)
        else:
            detail = ", ".join(f"{k} {v:.2e}" for k, v in errs.items())
            per_fn[name] = (f"FAIL rel-RMSE {detail} > {tol:.0e}", worst)

    def shrink():
        return {"h": (kern["lora_shrink"](inp.x, inp.A_cat, segs, t, seed=seed), h_r)}

    def expand():
        y_k, y_r = inp.y0.clone(), inp.y0.clone()
        kern["lora_expand"](h_r, inp.B_cat, segs, t, y_k)
        R.lora_expand(h_r, inp.B_cat, segs, t, y_r)
        base = inp.y0.float()
        return {"y-y0": (y_k.float() - base, y_r.float() - base)}

    dh_r, dB_r = R.lora_expand_bwd(inp.dy, h_r, inp.B_cat, segs, t)

    def expand_bwd():
        dh_k, dB_k = kern["lora_expand_bwd"](inp.dy, h_r, inp.B_cat, segs, t)
        return {"dh": (dh_k, dh_r), "dB": (dB_k, dB_r)}

    def shrink_bwd():
        dx_k, dA_k = kern["lora_shrink_bwd"](dh_r, inp.x, inp.A_cat, segs, t, seed=seed, need_dx=True)
        dx_r, dA_r = R.lora_shrink_bwd(dh_r, inp.x, inp.A_cat, segs, t, keep=keep)
        return {"dx": (dx_k, dx_r), "dA": (dA_k, dA_r)}

    run("lora_shrink", shrink)
    run("lora_expand", expand)
    run("lora_expand_bwd", expand_bwd)
    run("lora_shrink_bwd", shrink_bwd)
    out = {}
    for op, needs in OP_NEEDS.items():
        parts = [per_fn[n] for n in needs]
        errs = [e for _, e in parts if e is not None]
        if any(s == "missing" for s, _ in parts):
            status = "missing"
        elif all(s == "ok" for s, _ in parts):
            status = "ok"
        else:
            status = "; ".join(f"{n}: {s}" for n, (s, _) in zip(needs, parts, strict=True) if s != "ok")
        # an op whose launcher raised is not timed; one that ran but failed its check is timed, without speed-ups
        runnable = not any(s == "missing" or s.startswith("error") for s, _ in parts)
        out[op] = {"check": status, "err": max(errs) if errs else None, "runnable": runnable}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# one case


def run_case(c: Case, kern, keep_mask_fn, dtype, device, copy_gbps, args) -> list:
    inp = Inputs(c, dtype, device, keep_mask_fn)
    nbytes = op_bytes(c, torch.tensor([], dtype=dtype).element_size(), torch.tensor([], dtype=dtype).element_size())
    timing = dict(warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    from fast_multilora import reference as R

    results = {}  # (provider, op) -> row fields
    for fam in KERNEL_FAMILIES:
        checks = check_family(kern, inp, fam, dtype)
        h = R.lora_shrink(inp.x, inp.A_cat, inp.segs[fam], inp.table, keep=inp.keep[fam])
        ops = kernel_ops(kern, inp, fam, h)
        for op in OPS:
            row = {"check": checks[op]["check"], "err": checks[op]["err"]}
            if op in ops and checks[op]["runnable"]:
                try:
                    row.update(bench_op(ops[op], device, **timing))
                except Exception as e:
                    row["check"] = f"error while timing {type(e).__name__}: {str(e)[:160]}"
            results[(fam, op)] = row
        del h, ops
    h_ref = R.lora_shrink(inp.x, inp.A_cat, inp.segs["sgemm"], inp.table, keep=inp.keep["sgemm"])
    for name, ops in (("torch_reference", reference_ops(inp, h_ref)), ("torch_loop", loop_ops(inp, c))):
        for op in OPS:
            row = {"check": "oracle" if name == "torch_reference" else "not checked", "err": None}
            try:
                row.update(bench_op(ops[op], device, **timing))
            except Exception as e:
                row["check"] = f"error {type(e).__name__}: {str(e)[:160]}"
            results[(name, op)] = row
    rows = []
    for (prov, op), r in results.items():
        ms = r.get("ms")
        gbps = nbytes[op] / (ms * 1e-3) / 1e9 if ms else None
        row = {"case": c.id, **asdict(c), "op": op, "provider": prov, "ms": ms, "q20_ms": r.get("q20_ms"),
               "q80_ms": r.get("q80_ms"), "bytes": nbytes[op], "gbps": gbps,
               "frac_copy": gbps / copy_gbps if gbps and copy_gbps else None,
               "check": r["check"], "err": r["err"], "speedup_vs_reference": None, "speedup_vs_loop": None}
        if prov in KERNEL_FAMILIES and ms and r["check"] == "ok":  # fla: no speed-up for an op that fails its check
            for other, key in (("torch_reference", "speedup_vs_reference"), ("torch_loop", "speedup_vs_loop")):
                o = results.get((other, op), {}).get("ms")
                row[key] = o / ms if o else None
        rows.append(row)
    return rows


def copy_bandwidth(device: str, args) -> float:
    """GB/s of a large device copy, bytes read + written (the yardstick for the kernels' GB/s)."""
    n = (1 << 29) if device == "cuda" else (1 << 22)  # 1 GiB of bf16 on the GPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    t = bench_op(lambda: dst.copy_(src), device, warmup_ms=args.warmup_ms, rep_ms=max(args.rep_ms, 100))
    return 2 * n * 2 / (t["ms"] * 1e-3) / 1e9


# ---------------------------------------------------------------------------------------------------------------------
# report


def render_md(res: dict) -> str:
    m = res["meta"]
    lines = [
        "# Segmented LoRA kernels",
        "",
        f"{m.get('gpu') or m['device']} · torch {m['torch']} · triton {m.get('triton')} · {m['dtype']} · "
        f"commit `{m['commit']}` · {m['date_utc']} UTC" + (" · **--quick dry run (CPU, numbers meaningless)**"
                                                           if m.get("quick") else ""),
        "",
        f"Copy bandwidth measured in this run: **{fmt(res['copy_gbps'], 0)} GB/s** (read + write). "
        "Times are do_bench medians (L2 flushed), µs. GB/s from the bytes each op must move (`op_bytes`). "
        "`× ref` / `× loop`: speed-up over the torch reference / the per-adapter torch loop, printed only when the "
        "op matched the reference in this case.",
        "",
    ]
    if m.get("missing_launchers"):
        lines += ["Missing launchers: " + ", ".join(f"`{k}` ({v})" for k, v in m["missing_launchers"].items()), ""]
    by_case = {}
    for r in res["rows"]:
        by_case.setdefault(r["case"], []).append(r)
    targets = _targets(by_case)
    if targets:
        lines += ["## Targets (issue 3)", "", "| case | metric | target | measured | met |", "|---|---|---|---|---|"]
        lines += [f"| {c} | {metric} | {tgt} | {val} | {ok} |" for c, metric, tgt, val, ok in targets]
        lines.append("")
    lines += ["## All cases", ""]
    for case, rows in by_case.items():
        lines += [f"### {case}", "", "| op | provider | µs | p20–p80 µs | GB/s | % copy | × ref | × loop | check |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            q = f"{fmt(r['q20_ms'], 1, 1e3)}–{fmt(r['q80_ms'], 1, 1e3)}" if r["ms"] else "-"
            chk = r["check"] if r["err"] is None else f"{r['check']} ({r['err']:.1e})"
            chk = chk.replace("|", "\\|").replace("\n", " ")
            lines.append(f"| {r['op']} | {r['provider']} | {fmt(r['ms'], 1, 1e3)} | {q} | {fmt(r['gbps'], 0)} | "
                         f"{fmt(r['frac_copy'], 0, 100)} | {fmt(r['speedup_vs_reference'], 2)} | "
                         f"{fmt(r['speedup_vs_loop'], 2)} | {chk} |")
        lines.append("")
    if res.get("skipped"):
        lines += ["Not run (time budget or filter): " + ", ".join(res["skipped"]), ""]
    if res.get("errors"):
        lines += ["Cases that raised: " + "; ".join(f"{k}: {v}" for k, v in res["errors"].items()), ""]
    return "\n".join(lines)


def _best(rows, op):
    ok = [r for r in rows if r["op"] == op and r["provider"] in KERNEL_FAMILIES and r["ms"] and r["check"] == "ok"]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def _targets(by_case):
    out = []
    for case in HEADLINE:
        rows = by_case.get(case)
        if not rows:
            continue
        for op, us in (("shrink", 21), ("expand", 42)):
            b = _best(rows, op)
            val = f"{b['ms'] * 1e3:.1f} µs ({b['provider']})" if b else "no passing kernel"
            out.append((case, f"{op} time", f"≤ {us} µs", val, "yes" if b and b["ms"] * 1e3 <= us else "no"))
        for op, frac in (("shrink", 0.75), ("expand", 0.75), ("bwd", 0.60)):
            b = _best(rows, op)
            val = f"{b['frac_copy'] * 100:.0f} % ({b['provider']})" if b and b["frac_copy"] else "-"
            met = "yes" if b and b["frac_copy"] and b["frac_copy"] >= frac else "no"
            out.append((case, f"{op} bandwidth", f"≥ {frac * 100:.0f} % copy", val, met))
        b = _best(rows, "full")
        val = f"×{b['speedup_vs_loop']:.2f} ({b['provider']})" if b and b["speedup_vs_loop"] else "-"
        met = "yes" if b and b["speedup_vs_loop"] and b["speedup_vs_loop"] >= 3 else "no"
        out.append((case, "layer delta fwd+bwd vs loop", "≥ ×3", val, met))
    return out


# ---------------------------------------------------------------------------------------------------------------------


def main(args) -> int:
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        torch.set_num_threads(1)  # tiny ops: threads only add contention on a shared CPU
    if device == "cuda" and not torch.cuda.is_available():
        print("bench_kernels: no CUDA device; use --quick for a CPU dry run", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype or ("fp16" if args.quick else "bf16")]
    if device == "cpu" and dtype == torch.bfloat16:
        print("bench_kernels: warning: the Triton interpreter multiplies bf16 wrongly; expect failed checks")
    cases = QUICK_CASES if args.quick else FULL_CASES
    wanted = [s for s in args.cases.split(",") if s]
    kern, why, keep_mask_fn = load_kernels()
    budget = Budget(args.budget_s)
    res = {"meta": run_meta(device, args.commit, dtype=str(dtype).replace("torch.", ""), quick=args.quick,
                            missing_launchers=why, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms),
           "copy_gbps": None, "rows": [], "skipped": [], "errors": {}}
    json_path = os.path.join(args.out_dir, f"{args.name}.json")
    md_path = os.path.join(args.out_dir, f"{args.name}.md")
    print(f"bench_kernels: {res['meta'].get('gpu') or device}, {dtype}, launchers missing: {sorted(why) or 'none'}",
          flush=True)
    res["copy_gbps"] = copy_bandwidth(device, args)
    print(f"copy bandwidth {res['copy_gbps']:.0f} GB/s", flush=True)
    for c in cases:
        if wanted and not any(w in c.id for w in wanted):
            res["skipped"].append(c.id)
            continue
        if not budget.allows(3.0):
            res["skipped"].append(c.id)
            print(f"skip {c.id}: time budget ({budget.elapsed():.0f} s used)", flush=True)
            continue
        try:
            rows = run_case(c, kern, keep_mask_fn, dtype, device, res["copy_gbps"], args)
            res["rows"] += rows
            for r in rows:
                if r["provider"] in KERNEL_FAMILIES or r["op"] in ("shrink", "expand"):
                    print(f"{c.id:42s} {r['op']:6s} {r['provider']:15s} {fmt(r['ms'], 1, 1e3):>9s} µs "
                          f"{fmt(r['gbps'], 0):>6s} GB/s  xref {fmt(r['speedup_vs_reference'], 2):>6s}  "
                          f"xloop {fmt(r['speedup_vs_loop'], 2):>6s}  {r['check']}", flush=True)
        except Exception as e:
            traceback.print_exc()
            res["errors"][c.id] = f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        res["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
        write_json(json_path, res)
        write_text(md_path, render_md(res))
    res["meta"]["elapsed_s"] = round(budget.elapsed(), 1)
    write_json(json_path, res)
    write_text(md_path, render_md(res))
    print(f"wrote {json_path} and {md_path} in {budget.elapsed():.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
