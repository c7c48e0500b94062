"""Create, save and load many LoRA adapters: fast_multilora.add_adapters / save_adapters / load_adapters against PEFT's
own loops (add_adapter, save_pretrained, load_adapter), timed on the CPU.

    python examples/many_adapters.py                                  # tiny Llama (2 layers, hidden 32)
    python examples/many_adapters.py --layers 8 --hidden 2048 --counts 64,256 --loop-count 64

PEFT's loops are quadratic in the number of adapters, so they run at --loop-count only; ours at every count.
"""

import argparse
import os
import platform
import tempfile
import time
import warnings

import fast_multilora  # first: with a checkout's root on sys.path it keeps the top-level name ``kernels`` PyPI's

# isort: split
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build(args):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 3 // 2, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=61, max_position_embeddings=32)
    return get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=args.rank, target_modules=TARGETS), adapter_name="t0")


def configs(n, rank):
    return {f"t{i}": LoraConfig(r=rank, target_modules=TARGETS) for i in range(1, n)}


def timed(fn, *args):
    """(CPU seconds of this process, wall seconds) of ``fn(*args)``: on shared cores the CPU time is the steadier."""
    c, w = time.process_time(), time.perf_counter()
    fn(*args)
    return time.process_time() - c, time.perf_counter() - w


def peft_add(model, cfgs):
    for name, cfg in cfgs.items():
        model.add_adapter(name, cfg)


def peft_load(model, sources):
    for name, path in sources.items():
        model.load_adapter(path, adapter_name=name)


def measure(n, args, loop, tmp) -> dict:
    """{what: (fast_multilora times, PEFT loop times or None)} for ``n`` adapters."""
    model = build(args)
    add = timed(fast_multilora.add_adapters, model, configs(n, args.rank))
    save = timed(fast_multilora.save_adapters, model, os.path.join(tmp, "ours"))
    sources = {f"l{i}": os.path.join(tmp, "ours", f"t{i}") for i in range(n)}
    load = timed(fast_multilora.load_adapters, build(args), sources)
    if not loop:
        return {"create": (add, None), "save": (save, None), "load": (load, None)}
    ref = build(args)
    loop_add = timed(peft_add, ref, configs(n, args.rank))
    loop_save = timed(ref.save_pretrained, os.path.join(tmp, "peft"))
    loop_load = timed(peft_load, build(args), sources)
    return {"create": (add, loop_add), "save": (save, loop_save), "load": (load, loop_load)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--counts", default="128,256,512,1024", help="adapter counts for fast_multilora")
    p.add_argument("--loop-count", default="128", help="adapter count(s) for PEFT's loops, e.g. 128,256 (0: none)")
    args = p.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at start; torch {torch.__version__}, peft {__import__('peft').__version__}; "
          f"Llama {args.layers} layers, hidden {args.hidden}, r={args.rank} on all 7 projections")
    print("| adapters | what | fast_multilora: CPU s (wall s) | PEFT loop: CPU s (wall s) | ratio (CPU) |")
    print("|---:|---|---:|---:|---:|")
    loops = {int(c) for c in args.loop_count.split(",")} - {0}
    counts = sorted({int(c) for c in args.counts.split(",")} | loops)
    for n in counts:
        with tempfile.TemporaryDirectory() as tmp:
            rows = measure(n, args, n in loops, tmp)
        for what, (ours, theirs) in rows.items():
            tail = f"{theirs[0]:.2f} ({theirs[1]:.1f}) | {theirs[0] / ours[0]:.0f}x" if theirs else "| "
            print(f"| {n} | {what} | {ours[0]:.2f} ({ours[1]:.1f}) | {tail} |", flush=True)
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
