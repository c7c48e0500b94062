"""Where a train step's time goes (issue-4 step: 8 adapters mixed, 16 x 1024, Llama shape, bf16, r=16, dropout
0.05; ``--shape 32,32,512``: ``train_step_32``'s): host time per step, kernel launches per step by kernel, the top
Python functions by own time (cProfile) and the top torch ops by self CPU time. Usage (GPU):
``python benchmarks/profile_step.py [--out FILE]``.

``--decode``: one dynamic-cache decode step of ``generate_dynamic``'s batch (16 rows of 128 prompt tokens, 8 adapters
mixed with ``__base__`` rows, eval, bf16) for ours and for the plain base model: host time per step, launches by
kernel, torch ops and cProfile -- where a mixed decode step's per-layer host time goes. With ``--compile MODE``:
``generate_static``'s call (16 new tokens, the decode step compiled by transformers in that mode), CUDA kernels by
name -- where a static-cache generate's device time goes.

``--scale 8,64``: the issue-18 step (``train_step_scale``: packed rows, every resident adapter trained, the adapter
store with ``fast_multilora.AdamW``) at each adapter count on one model grown by ``add_adapter``: per phase (forward,
backward, optimizer step + ``zero_grad``) host and GPU time, kernel time by kernel against the first count, the
optimizer step alone, and at the last count the torch ops and cProfile -- what grows with the adapter count.

``--eval`` (with ``--compile MODE`` or eager): ``eval_8``'s forward (16 x 1024 tokens, 8 adapters over 14 rows and 2
``__base__`` rows, no grad) for ours and for the plain base model, side by side: where a forward's host and kernel
time go, compiled or not.

``--layer``: the same for one call of the harness's ``layer_4096`` scenario (a 4096x4096 ``nn.Linear`` in a
``PeftModel``, 8 x 1024 tokens, forward + backward), ours with 8 adapters mixed against stock PEFT's single adapter:
where a lone layer call's host time goes."""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from harness import host_ms  # benchmarks/ is on sys.path when this runs as a script

import fast_multilora

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from multi_adapter_tasks import BENCH_LLAMA  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(n_adapters=8, rows=16, T=1024, compile_mode=None, store=False):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(LlamaConfig(**BENCH_LLAMA)).to(torch.bfloat16)
    lc = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS)
    pm = get_peft_model(base, lc, adapter_name="a0")
    for i in range(1, n_adapters):
        pm.add_adapter(f"a{i}", lc)
    for n, p in pm.named_parameters():
        p.requires_grad_("lora_" in n)
    fast_multilora.patch(pm, backend="triton")
    pm.train()
    ids = torch.randint(0, BENCH_LLAMA["vocab_size"], (rows, T), device="cuda")
    names = [f"a{i % n_adapters}" for i in range(rows)]
    params = [p for p in pm.parameters() if p.requires_grad]
    if store:  # the adapter store's one-launch AdamW (the layers then take the store's leaves)
        opts = {"store": fast_multilora.AdamW(pm, lr=1e-4)}
    else:
        opts = {"foreach": torch.optim.AdamW(params, lr=1e-4, foreach=True),
                "fused": torch.optim.AdamW(params, lr=1e-4, fused=True)}
    use = {"opt": next(iter(opts.values()))}
    split = []  # host seconds per step: (forward + loss, backward, optimizer step + zero_grad)
    fwd = pm if compile_mode is None else torch.compile(pm, mode=None if compile_mode == "default" else compile_mode)

    def step():
        t0 = time.perf_counter()
        out = fwd(input_ids=ids, adapter_names=names)
        loss = fast_multilora.per_adapter_loss(out.logits, ids, names)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        use["opt"].step()
        use["opt"].zero_grad(set_to_none=True)
        split.append((t1 - t0, t2 - t1, time.perf_counter() - t2))

    def set_optimizer(kind: str):  # "foreach" (the anchors' default on CUDA) or "fused"
        use["opt"] = opts[kind]

    step.set_optimizer = set_optimizer
    step.split = split
    step.ids = ids
    return pm, step


def tee():
    """``(say, buf)``: ``say(...)`` prints and also appends to ``buf`` (a ``StringIO`` written to ``--out``)."""
    buf = io.StringIO()

    def say(*x):
        print(*x, flush=True)
        print(*x, file=buf)

    return say, buf


def cuda_kernels(prof, width: int = 70):
    """``(launches, us)``: Counters of a profile's CUDA kernel launches and device time (us), keyed by the kernel
    name cut to ``width`` characters."""
    launches, us = Counter(), Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            launches[e.name[:width]] += 1
            us[e.name[:width]] += e.device_time_total
    return launches, us


def report(say, fn, unit: str, *, n_prof: int, n_cprof: int, top_kernels: int, op_rows: int, cprof_rows: int,
           cumulative_rows: int = 0):
    """Profile ``n_prof`` calls of ``fn`` (kernel launches and CUDA time per ``unit``, the top kernels, torch ops by
    self CPU time), then ``n_cprof`` calls under cProfile (by own time; with ``cumulative_rows`` also cumulative)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n_prof):
            fn()
        torch.cuda.synchronize()
    kernels, cuda_us = cuda_kernels(prof)
    say(f"kernel launches per {unit}: {sum(kernels.values()) / n_prof:.1f}; "
        f"CUDA time {sum(cuda_us.values()) / n_prof / 1e3:.3f} ms")
    for k, n in kernels.most_common(top_kernels):
        say(f"  {n / n_prof:7.1f} x {cuda_us[k] / n:8.1f} us  {k}")
    say(f"--- torch ops by self CPU time ({n_prof} x {unit})")
    say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=op_rows, max_name_column_width=55))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n_cprof):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    for order, rows in (("tottime", cprof_rows), ("cumulative", cumulative_rows)):
        if rows:
            out = io.StringIO()
            pstats.Stats(pr, stream=out).sort_stats(order).print_stats(rows)
            say(f"--- cProfile, {n_cprof} x {unit}, by {'own time' if order == 'tottime' else 'cumulative time'}")
            say(out.getvalue())


def build_layer(ours: bool, K=4096, rows=8, T=1024):
    """The harness's layer scenario: ``call()`` runs one forward + backward of a LoRA'd ``nn.Linear``,
    ``call.forward_only()`` the forward alone."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(K, K, bias=False)).to("cuda", torch.bfloat16).requires_grad_(False)
    lc = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=["0"])
    pm = get_peft_model(base, lc, adapter_name="a0")
    for i in range(1, 8):
        pm.add_adapter(f"a{i}", lc)
    pm.to("cuda", torch.bfloat16)
    x = torch.randn(rows, T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(rows, T, K, device="cuda", dtype=torch.bfloat16)
    names = sorted(f"a{i % 8}" for i in range(rows))
    if ours:
        for n, p in pm.named_parameters():
            p.requires_grad_("lora_" in n)
        fast_multilora.patch(pm, backend="triton")
    else:
        pm.set_adapter("a0")
    params = [p for p in pm.parameters() if p.requires_grad]

    def call():
        x.grad = None
        for p in params:
            p.grad = None
        out = pm(x, adapter_names=names) if ours else pm(x)
        out.backward(gy)

    call.forward_only = lambda: pm(x, adapter_names=names) if ours else pm(x)
    return call


def _host_ms(fn) -> float:
    return round(host_ms(fn, 21), 3)


def host_split(call, ours: bool) -> dict:
    """Host ms of one layer call (median of 21, each after a sync) with parts of it left out: forward only (under
    ``no_grad``), and for ours the same with every Triton launch skipped (the Python and torch work around them)."""
    out = {"fwd_bwd": _host_ms(call)}
    with torch.no_grad():
        out["fwd_no_grad"] = _host_ms(call.forward_only)
    if ours:
        from fast_multilora.kernels import backward as kb
        from fast_multilora.kernels import forward as kf

        saved = kf.launch, kb.launch
        kf.launch = kb.launch = lambda *a, **k: None
        try:
            out["fwd_bwd_launches_skipped"] = _host_ms(call)
            with torch.no_grad():
                out["fwd_no_grad_launches_skipped"] = _host_ms(call.forward_only)
        finally:
            kf.launch, kb.launch = saved
    return out


def profile_both(say, what: str, build, labels: tuple, unit: str, details=None, **report_kw):
    """Ours (``build(True)``) then the other provider (``build(False)``): warm-up, host time, ``details(fn, ours)``
    (lines of its own), then :func:`report`."""
    for ours in (True, False):
        fn = build(ours)
        for _ in range(5):
            fn()
        say(f"=== {what}, {labels[ours]}: host {host_ms(fn, 21):.3f} ms (median of 21, each after a sync)")
        if details is not None:
            details(fn, ours)
        report(say, fn, unit, **report_kw)
        del fn
        torch.cuda.empty_cache()


def profile_layer(say):
    from fast_multilora.kernels import launch

    def details(call, ours):
        say(f"host split: {host_split(call, ours)}")
        if ours:
            say(f"launch paths since import: {launch.stats()}")

    profile_both(say, "layer_4096 call", build_layer, ("peft_single", "fast_multilora, 8 adapters"), "call",
                 details, n_prof=10, n_cprof=20, top_kernels=20, op_rows=30, cprof_rows=35)


def eval_model(ours: bool, n_adapters: int, cfg=None, device="cuda", lora_dropout=0.0):
    """The benchmark Llama (random init, bf16, eval): plain, or (``ours``) a PEFT model of ``n_adapters`` patched."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**(cfg or BENCH_LLAMA))).to(torch.bfloat16).eval()
    if ours:
        lc = LoraConfig(r=16, lora_alpha=32, lora_dropout=lora_dropout, target_modules=TARGETS)
        model = get_peft_model(model, lc, adapter_name="a0")
        for i in range(1, n_adapters):
            model.add_adapter(f"a{i}", lc)
        fast_multilora.patch(model, backend="triton" if device == "cuda" else "torch")
        model.eval()
    return model


def build_decode(ours: bool, n_adapters=8, rows=16, prompt=128, cfg=None, device="cuda"):
    """One decode step (1 token per row) after a prefill, dynamic cache, no grad: ours with ``n_adapters`` mixed
    with ``__base__`` rows (every fourth), or the plain base model. Each call appends one position to the cache."""
    from transformers import DynamicCache

    model = eval_model(ours, n_adapters, cfg, device)
    kw = {}
    if ours:
        kw["adapter_names"] = ["__base__" if i % 4 == 3 else f"a{i % n_adapters}" for i in range(rows)]
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt), device=device)
    cache = DynamicCache()
    with torch.no_grad():
        tok = model(input_ids=ids, past_key_values=cache, use_cache=True, **kw).logits[:, -1:].argmax(-1)

    def step():
        with torch.no_grad():
            return model(input_ids=tok, past_key_values=cache, use_cache=True, **kw).logits

    return step


def build_eval(ours: bool, compile_mode=None, n_adapters=8, rows=16, T=1024, cfg=None, device="cuda"):
    """``eval_8``'s forward (no grad): ours with ``n_adapters`` over ``rows - 2`` rows and 2 ``__base__`` rows, or the
    plain base model; with ``compile_mode`` under ``torch.compile`` (the first call compiles)."""
    model = eval_model(ours, n_adapters, cfg, device, lora_dropout=0.05)
    kw = {}
    if ours:
        kw["adapter_names"] = [f"a{i % n_adapters}" for i in range(rows - 2)] + ["__base__"] * 2
    ids = torch.randint(0, model.config.vocab_size, (rows, T), device=device)
    fwd = model if compile_mode is None else torch.compile(
        model, mode=None if compile_mode == "default" else compile_mode)

    def forward():
        with torch.no_grad():
            return fwd(input_ids=ids, **kw).logits

    return forward


def profile_eval(say, compile_mode=None):
    how = "eager" if compile_mode is None else f"torch.compile, mode {compile_mode}"
    profile_both(say, f"eval_8 forward ({how})", lambda ours: build_eval(ours, compile_mode),
                 ("base model", "fast_multilora, 8 adapters + 2 __base__ rows"), "forward", n_prof=5, n_cprof=10,
                 top_kernels=30, op_rows=30, cprof_rows=35)


def build_scale(pm, n: int, rows=16, T=1024):
    """``step`` of ``train_step_scale`` at ``n`` adapters on ``pm`` (grown to ``n`` by ``add_adapter``): packed rows,
    ``max(4, n // rows)`` samples per row, the store with ``fast_multilora.AdamW``; ``step.parts`` the three phases."""
    import copy

    for i in range(n):
        if f"a{i}" not in pm.peft_config:
            pm.add_adapter(f"a{i}", copy.deepcopy(pm.peft_config["a0"]))
    pm.to("cuda", torch.bfloat16)
    for k, q in pm.named_parameters():
        q.requires_grad_("lora_" in k)
    pm.train()
    opt = fast_multilora.AdamW(pm, lr=1e-4)
    ids = torch.randint(0, BENCH_LLAMA["vocab_size"], (rows, T), device="cuda")
    per_row = max(4, -(-n // rows))
    seg = T // per_row
    j = (torch.arange(T, device="cuda") // seg).clamp(max=per_row - 1)
    adapter_ids = ((torch.arange(rows, device="cuda")[:, None] * per_row + j) % n).contiguous()
    pos = (torch.arange(T, device="cuda") - j * seg).expand(rows, T)
    names = [f"a{i}" for i in range(n)]
    box = {}

    def fwd():
        box["loss"] = pm(input_ids=ids, labels=ids, adapter_names=names, adapter_ids=adapter_ids,
                         position_ids=pos).loss

    def bwd():
        box.pop("loss").backward()

    def opt_step():
        opt.step()
        opt.zero_grad()

    def step():
        fwd()
        bwd()
        opt_step()

    step.parts = (("forward", fwd), ("backward", bwd), ("optimizer", opt_step))
    step.opt = opt
    return step


def phase_times(step, iters=7) -> dict:
    """Per phase of ``step.parts``: median ``(host ms, GPU ms)`` -- host until its last launch returns, GPU between
    CUDA events around it (a phase whose host time reaches its GPU time is host-bound)."""
    rows = []
    for _ in range(iters):
        torch.cuda.synchronize()
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(step.parts) + 1)]
        host = []
        marks[0].record()
        for (_, fn), mark in zip(step.parts, marks[1:], strict=True):
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            mark.record()
        torch.cuda.synchronize()
        rows.append((host, [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]))
    return {k: (round(statistics.median(r[0][i] for r in rows), 2), round(statistics.median(r[1][i] for r in rows), 2))
            for i, (k, _) in enumerate(step.parts)}


def host_syncs(fn) -> dict:
    """``{file:line: count}`` of the Python lines whose CUDA calls synchronized with the host during ``fn()``
    (``tests/helpers.sync_warnings``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import sync_warnings

    return dict(Counter(f"{Path(w.filename).name}:{w.lineno}" for w in sync_warnings(fn)))


def profile_scale(say, counts):
    from harness import time_steps
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = LlamaForCausalLM(LlamaConfig(**BENCH_LLAMA)).to(torch.bfloat16)
    lc = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS)
    pm = get_peft_model(base, lc, adapter_name="a0")
    fast_multilora.patch(pm, backend="triton")
    first = None
    for n in counts:
        step = build_scale(pm, n)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        wall = time_steps(step, "cuda", warm=1, iters=7)["ms"]
        say(f"=== {n} adapters: step {wall:.2f} ms (CUDA events, median of 7)")
        say(f"phases: {phase_times(step)}")
        for _, fn in step.parts[:2]:  # gradients of every adapter, then the optimizer step alone on them
            fn()
        say(f"optimizer step alone: {time_steps(step.opt.step, 'cuda', warm=2, iters=10)['ms']:.3f} ms; "
            f"host {host_ms(step.opt.step, 11):.3f} ms")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step.opt.step()
            torch.cuda.synchronize()
        launches, us = cuda_kernels(prof)
        say("  its kernels: " + "; ".join(f"{launches[k]} x {us[k]:.1f} us {k}" for k in launches))
        step.opt.zero_grad()
        say(f"host syncs in one step: {host_syncs(step)}")
        if n not in (counts[0], counts[-1]):
            continue
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        launches, us = cuda_kernels(prof)
        say(f"kernel launches per step {sum(launches.values()) / 2:.0f}; CUDA time {sum(us.values()) / 2e3:.2f} ms")
        if first is None:
            first = (n, launches, us)
            for k, c in launches.most_common(25):
                say(f"  {c / 2:7.1f} x {us[k] / c:8.1f} us  {k}")
        else:
            n0, l0, u0 = first
            say(f"kernels by CUDA-time growth over {n0} adapters (per step: launches, ms here, ms at {n0}):")
            keys = sorted(set(us) | set(u0), key=lambda k: -(us[k] - u0[k]))
            for k in keys[:20]:
                say(f"  {launches[k] / 2:7.1f} {us[k] / 2e3:8.3f} {u0[k] / 2e3:8.3f}  {k}")
    say(f"--- torch ops by self CPU time ({counts[-1]} adapters, 2 steps)")
    say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=55))
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    pr.disable()
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats(order).print_stats(40)
        say(f"--- cProfile, 3 steps at {counts[-1]} adapters, by {order}")
        say(out.getvalue())


def build_generate_static(ours: bool, compile_mode: str, new=16, rows=16, prompt=128):
    """``generate_static``'s call (16 prompts x 128, 8 adapters + ``__base__`` rows, greedy, static cache, the decode
    step compiled by transformers' ``CompileConfig`` in ``compile_mode``) with ``new`` new tokens."""
    from transformers import CompileConfig

    model = eval_model(ours, 8)
    prompts = torch.randint(0, model.config.vocab_size, (rows, prompt), device="cuda")
    kw = dict(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
              do_sample=False, pad_token_id=0, cache_implementation="static",
              compile_config=CompileConfig(mode=compile_mode))
    if ours:
        kw["adapter_names"] = [f"a{i % 8}" for i in range(rows - rows // 4)] + ["__base__"] * (rows // 4)

    def generate():
        with torch.no_grad():
            return model.generate(**kw)

    return generate


def profile_generate_static(say, compile_mode):
    """Where a static-cache generate's device time goes, ours against the base model: CUDA kernels by name over one
    call of 16 new tokens (the prefill runs eagerly in both)."""
    profile_both(say, f"static-cache generate, 16 new tokens, decode step compiled ({compile_mode})",
                 lambda ours: build_generate_static(ours, compile_mode),
                 ("base model", "fast_multilora, 8 adapters + __base__ rows"), "generate", n_prof=2, n_cprof=1,
                 top_kernels=30, op_rows=15, cprof_rows=10)


def profile_decode(say):
    # SDPA's cuDNN backend builds an execution plan per new key length (~4.7 ms of host time per call on an H200) and
    # keeps it for the process: whichever provider ran first paid for both. Each provider's cache therefore first
    # walks the lengths the measured pass will see (41 steps, from the same prompt length).
    for ours in (True, False):
        step = build_decode(ours)
        for _ in range(41):
            step()
        del step
        torch.cuda.empty_cache()
    profile_both(say, "decode step", build_decode, ("base model", "fast_multilora, 8 adapters + __base__ rows"),
                 "step", n_prof=5, n_cprof=10, top_kernels=20, op_rows=30, cprof_rows=35, cumulative_rows=40)


def profile_train(say, n_adapters: int, rows: int, T: int, compile_mode=None, store=False):
    """The train step (``build``): wall and host time per step, then :func:`report`."""
    _, step = build(n_adapters, rows, T, compile_mode=compile_mode, store=store)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        host.append((t1 - t0) * 1e3)
        total.append((time.perf_counter() - t0) * 1e3)
    say(f"step: wall {statistics.median(total):.1f} ms, host (until the last launch returns) "
        f"{statistics.median(host):.1f} ms (medians of 7)")
    report(say, step, "step", n_prof=1, n_cprof=3, top_kernels=30, op_rows=35, cprof_rows=45, cumulative_rows=60)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--layer", action="store_true", help="profile the layer_4096 call instead of the train step")
    ap.add_argument("--decode", action="store_true", help="profile a mixed dynamic-cache decode step instead")
    ap.add_argument("--scale", default=None, help="adapter counts, e.g. 8,64: the issue-18 step's growth")
    ap.add_argument("--compile", default=None, help="torch.compile the model: default | reduce-overhead | ...")
    ap.add_argument("--eval", action="store_true", help="profile eval_8's forward (eager, or --compile) instead")
    ap.add_argument("--shape", default="8,16,1024",
                    help="the train step's adapters,rows,tokens per row (train_step_32: 32,32,512)")
    ap.add_argument("--store", action="store_true",
                    help="train step with fast_multilora.AdamW (the adapter store) instead of torch's AdamW")
    a = ap.parse_args(argv)
    say, buf = tee()
    if a.eval:
        profile_eval(say, a.compile)
    elif a.scale:
        profile_scale(say, [int(c) for c in a.scale.split(",")])
    elif a.decode and a.compile:
        profile_generate_static(say, a.compile)
    elif a.decode or a.layer:
        (profile_decode if a.decode else profile_layer)(say)
    else:
        profile_train(say, *(int(v) for v in a.shape.split(",")), compile_mode=a.compile,
                      store=a.store)
    if a.out:
        Path(a.out).write_text(buf.getvalue())

if __name__ == "__main__":
    main()
