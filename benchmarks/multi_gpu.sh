#!/usr/bin/env bash
# Multi-GPU run of examples/train_multi_adapter.py (accelerate DDP and FSDP2 on 2 GPUs) against one GPU on the same
# global batch: the benchmark's Llama shape (random, ~0.5 B), 8 adapters mixed in every rank's slice, Triton path.
# From the repo root on a machine with >= 2 GPUs:
#
#   OUT=/some/folder bash benchmarks/multi_gpu.sh
#
# Per precision (bfloat16 base with float32 adapters, 64 x 1024 tokens per step; float32 throughout, 16 x 512): a
# one-GPU run, DDP on 2 GPUs, FSDP2 on 2 GPUs, each from the same seed and saved initial adapters;
# benchmarks/compare_adapters.py then compares each multi-GPU run's trained adapters with the one-GPU run's.
# LoRA dropout is 0 here: the dropout mask of a token is drawn from its row in the local batch, which differs
# between one GPU and a rank's slice.
# Files in $OUT: multi_gpu.log, <run>.log, compare_<run>.json, multi_gpu.json (summary: tokens/s and differences);
# bundle them (tar) when the transport limits the number of files.
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET
OUT=${OUT:-benchmarks/results/multi_gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=${WORK:-/tmp/fml_multi_gpu}
T_RUN=${T_RUN:-150}
PRECISIONS=${PRECISIONS:-"bfloat16 float32"}
ADAPTERS=upper,reverse,digits,sort,count,upper_2,reverse_2,digits_2
CFG=examples/accelerate
exec > >(tee -a "$OUT/multi_gpu.log") 2>&1

run() {  # run NAME LAUNCH_ARGS... -- SCRIPT_ARGS...
    local name=$1 t0=$SECONDS rc
    shift
    echo "== $name: start $(date -u +%H:%M:%S) UTC"
    timeout -k 10 "$T_RUN" "$@" --output-dir "$WORK/$name" >"$OUT/$name.log" 2>&1
    rc=$?
    tail -n 4 "$OUT/$name.log"
    echo "== $name: rc=$rc after $((SECONDS - t0))s"
}

for dt in $PRECISIONS; do
    if [ "$dt" = bfloat16 ]; then steps=12 block=1024 batch=64; else steps=8 block=512 batch=16; fi
    args=(examples/train_multi_adapter.py --model bench --dtype "$dt" --adapters $ADAPTERS --rank 16 --alpha 32
          --block-size "$block" --global-batch-size "$batch" --train-per-adapter 8 --max-steps "$steps" --no-eval
          --save-init --backend triton)
    CUDA_VISIBLE_DEVICES=0 run "one_$dt" accelerate launch --config_file $CFG/single_gpu.yaml "${args[@]}"
    run "ddp_$dt" accelerate launch --config_file $CFG/multi_gpu.yaml --num_processes 2 "${args[@]}"
    run "fsdp2_$dt" accelerate launch --config_file $CFG/fsdp2.yaml --num_processes 2 "${args[@]}"
    for m in ddp fsdp2; do
        if [ "$dt" = bfloat16 ]; then tol=0.05; else tol=0.001; fi
        python benchmarks/compare_adapters.py "$WORK/one_$dt" "$WORK/${m}_$dt" --tol $tol \
            --json "$OUT/compare_${m}_$dt.json" >/dev/null
        echo "== compare ${m}_$dt vs one_$dt (tol $tol): rc=$?"
    done
done

python - "$WORK" "$OUT" <<'PY'
import json, pathlib, sys
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
res = {}
for m in sorted(work.glob("*/metrics.json")):
    d = json.loads(m.read_text())
    res[m.parent.name] = {"tokens_per_s": d.get("tokens_per_s"), "processes": d.get("processes"),
                          "final_loss": d["history"][-1]["loss"] if d.get("history") else None}
for c in sorted(out.glob("compare_*.json")):
    d = json.loads(c.read_text())
    res.setdefault(c.stem[len("compare_"):], {}).update(worst_rel_update_diff=d["worst_rel_update_diff"], tol=d["tol"])
for dt in ("bfloat16", "float32"):
    one = res.get(f"one_{dt}", {}).get("tokens_per_s")
    for m in ("ddp", "fsdp2"):
        r = res.get(f"{m}_{dt}", {})
        if one and r.get("tokens_per_s"):
            r["speedup_vs_one_gpu"] = r["tokens_per_s"] / one
(out / "multi_gpu.json").write_text(json.dumps(res, indent=1))
print(json.dumps(res, indent=1))
PY
