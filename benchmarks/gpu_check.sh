#!/usr/bin/env bash
# The one GPU run: install, GPU tests (+ the fuzz sweep), kernel benchmark, model benchmark, step profile, multi-GPU
# run. From the repo root, on the GPU machine:
#
#   OUT=/some/folder COMMIT=<sha> bash benchmarks/gpu_check.sh
#   STAGES="kernels model" bash benchmarks/gpu_check.sh          # a subset (install + env always run first)
#
# Stages: tests (tests marked gpu; the hypothesis fuzz sweep runs meanwhile -- on the second GPU where there is one
# -- in FUZZ_PROCS processes of different seeds, FML_FUZZ_EXAMPLES examples per test in all), kernels, model,
# profile (benchmarks/profile_step.py, per PROFILE_MODES entry: eager, a compile mode, decode,
# decode-<compile mode>, scale, eval, eval-<compile mode>, store, store-<compile mode> or train32), multi
# (benchmarks/multi_gpu.sh, needs 2 GPUs), ktests (the kernel and fused-path test files whole -- KTEST_FILES --,
# every dtype, on the GPU, in parallel processes), tune (benchmarks/tune_kernels.py --parts $TUNE_PARTS, default model: block sweep at
# the training step's shapes), ab (benchmarks/ab_step.py: patch settings A/B on the train step), gaps
# (benchmarks/kernel_gaps.py: an eval forward's kernel gaps, and its wall-time A/B), compiled (bench_model.py's
# opt-in scenarios: train step and eval under torch.compile, static- and dynamic-cache generate, merged into the
# model stage's h200.json; COMPILE_MODE, default "default", lists torch.compile's modes, each but "default" written
# to h200_<mode>.json; T_COMPILED per mode). qlora (opt-in): bench_model.py's qlora_step_8 / qlora_eval_8 (issue 19)
# merged into the model stage's h200.json (T_QLORA); with GPU_TESTS=tests/test_quantized_gpu.py the tests stage runs
# the QLoRA GPU tests. bitsandbytes is not in the GPU image and the machine has no network: a wheel
# wheels/bitsandbytes-*.whl in the tree is pip-installed (--no-deps) before any stage.
# Default: "tests kernels model".
#
# A benchmark stage's rc=3: bench_model.py left scenarios or providers out for its time budget (it names them).
# Every stage runs under its own `timeout`; a stage that fails or times out does not stop the later ones, and the
# benchmarks write their JSON/markdown after every case, so a killed stage still leaves what it measured. Worst case
# (every limit hit, default stages) about 8.7 minutes; limits (seconds): T_INSTALL, T_TESTS, T_KERNELS, T_MODEL,
# T_PROFILE (per profiled mode), T_MULTI, T_COMPILED; pytest's stop rule with PYTEST_STOP (default -x).
#
# Files in $OUT (flat): gpu_check.log (this script's whole output), pytest_gpu.log, fuzz_gpu.log, kernels.json,
# kernels.md, h200.json, h200.md, h200.png, profile_step_<mode>.txt, multi_gpu/ (see multi_gpu.sh).
set -u

export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels
OUT=${OUT:-benchmarks/results/gpu_run}
STAGES=${STAGES:-"tests kernels model"}
T_INSTALL=${T_INSTALL:-45}
T_TESTS=${T_TESTS:-120}
T_KERNELS=${T_KERNELS:-130}
T_MODEL=${T_MODEL:-200}
T_PROFILE=${T_PROFILE:-120}
T_MULTI=${T_MULTI:-420}
T_KTESTS=${T_KTESTS:-150}
T_TUNE=${T_TUNE:-240}
T_AB=${T_AB:-150}
T_GAPS=${T_GAPS:-150}
MODEL_SCENARIOS=${MODEL_SCENARIOS:-}  # the model stage's scenarios (default: bench_model.py's own list)
MODEL_ARGS=${MODEL_ARGS:-}  # more bench_model.py flags for the model and compiled stages (e.g. --scale-counts 8,64,256)
COMPILED_ARGS=${COMPILED_ARGS:-$MODEL_ARGS}  # the compiled stage's own flags where they differ from the model stage's
GPU_TESTS=${GPU_TESTS:-tests/}  # the tests stage's paths (e.g. GPU_TESTS=tests/test_compile_gpu.py)
KTEST_FILES=${KTEST_FILES:-"tests/test_kernels_forward.py tests/test_kernels_backward.py tests/test_kernels_decode.py tests/test_fused.py tests/test_slot_weights.py"}  # the ktests stage's files
COMPILED_SCENARIOS=${COMPILED_SCENARIOS:-train_step_8_compiled,eval_8_compiled,generate_static,generate_dynamic}
T_COMPILED=${T_COMPILED:-540}  # 12 providers, 9 of them compiled (40-90 s each on an H200)
COMPILE_MODE=${COMPILE_MODE:-default}
T_QLORA=${T_QLORA:-300}  # qlora_step_8 + qlora_eval_8: model save + 4-bit load, 4 + 4 providers
PROFILE_MODES=${PROFILE_MODES:-eager}  # the profile stage: train steps eager and/or per torch.compile mode; decode;
# decode-<compile mode> (generate_static's call, its decode step compiled in that mode);
# scale (the issue-18 step at each of SCALE_COUNTS adapters); eval (eval_8's forward, eager) or eval-<compile mode>;
# store or store-<compile mode> (the train step with fast_multilora.AdamW); train32 (train_step_32's shape, eager)
SCALE_COUNTS=${SCALE_COUNTS:-8,64,256}
FML_FUZZ_EXAMPLES=${FML_FUZZ_EXAMPLES:-30}  # per fuzz test, over all shards
FUZZ_PROCS=${FUZZ_PROCS:-1}
TEST_PROCS=${TEST_PROCS:-1}  # the tests stage in that many processes (benchmarks/run_tests_parallel.py)
PYTEST_STOP=${PYTEST_STOP:--x}  # e.g. PYTEST_STOP=--maxfail=20 to see more than the first failure
PY=${PYTHON:-$(command -v python3 || command -v python)}
COMMIT=${COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

want() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

SUMMARY=""
stage() {  # stage NAME LIMIT_S CMD...: run CMD under timeout, record rc and seconds
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    echo "== $name: start $(date -u +%H:%M:%S) UTC, limit ${limit}s"
    timeout -k 10 "$limit" "$@"
    rc=$?
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "== $name: TIMED OUT after ${limit}s"; fi
    echo "== $name: rc=$rc after $((SECONDS - t0))s"
    SUMMARY="$SUMMARY $name:rc=$rc:$((SECONDS - t0))s"
    return 0
}

# exits 0 where fast_multilora and its kernels import from this tree (the kernels folder is a namespace: no __file__)
IMPORTS_THIS_TREE="import sys, fast_multilora.kernels.api as k; sys.exit(not k.__file__.startswith('$PWD/'))"

ensure_importable() {
    # fast_multilora.kernels is this tree's root folder kernels/ (pyproject's package-dir; fast_multilora/__init__.py
    # maps a source tree's own folder); if the editable install did not take, put the tree's root on PYTHONPATH
    # (checked from / : from the repo root the package imports through the cwd, the benchmarks' scripts do not)
    if (cd / && "$PY" -c "$IMPORTS_THIS_TREE") 2>/dev/null; then return 0; fi
    echo "install: fast_multilora not importable from this tree; putting $PWD on PYTHONPATH"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    "$PY" -c "import fast_multilora.kernels.api; print('install: fallback ok')"
}

main() {
    echo "== gpu_check: $(date -u) repo=$PWD out=$OUT stages='$STAGES' commit=${COMMIT:-unknown}"
    # (re)install unless this tree is the one imported: an editable install of another checkout would run its code
    if ! (cd / && "$PY" -c "$IMPORTS_THIS_TREE") 2>/dev/null; then
        stage install "$T_INSTALL" "$PY" -m pip install --no-deps --no-build-isolation -e . -q
    fi
    ensure_importable
    local whl
    for whl in wheels/bitsandbytes-*.whl; do  # a carried wheel (QLoRA tests and scenarios; no network here)
        [ -e "$whl" ] && stage bnb_wheel "$T_INSTALL" "$PY" -m pip install --no-deps -q "$whl"
    done
    stage env 20 bash -c 'nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm,clocks.max.mem,power.limit,temperature.gpu,utilization.gpu --format=csv; "$0" -c "import sys, torch, triton, peft, transformers; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"triton\", triton.__version__, \"peft\", peft.__version__, \"transformers\", transformers.__version__, \"gpu\", torch.cuda.get_device_name())"' "$PY"

    if want tests; then
        # the fuzz sweep runs meanwhile (on the second GPU where there is one), in FUZZ_PROCS processes with
        # different hypothesis seeds sharing FML_FUZZ_EXAMPLES examples per test (Triton compiles use a core each)
        local n_gpu fuzz_gpu=0 i fuzz_pids=""
        n_gpu=$("$PY" -c "import torch; print(torch.cuda.device_count())")
        [ "$n_gpu" -ge 2 ] && fuzz_gpu=1
        for i in $(seq 1 "$FUZZ_PROCS"); do
            (CUDA_VISIBLE_DEVICES=$fuzz_gpu FML_TEST_DEVICE=cuda FML_FUZZ_DERANDOMIZE=0 \
                FML_FUZZ_EXAMPLES=$(( (FML_FUZZ_EXAMPLES + FUZZ_PROCS - 1) / FUZZ_PROCS )) timeout -k 10 "$T_TESTS" \
                "$PY" -m pytest -q -rfE -m gpu -k fuzz tests/test_fuzz.py -p no:cacheprovider --hypothesis-seed="$i" \
                >"$OUT/fuzz_gpu_$i.tmp" 2>&1
             echo "fuzz shard $i (seed $i) rc=$?" >>"$OUT/fuzz_gpu_$i.tmp") &
            fuzz_pids="$fuzz_pids $!"
        done
        if [ "$TEST_PROCS" -gt 1 ]; then  # tests dealt to TEST_PROCS processes (their compiles in parallel)
            stage tests "$T_TESTS" bash -c 'set -o pipefail; CUDA_VISIBLE_DEVICES=0 FML_TEST_DEVICE=cuda "$0" benchmarks/run_tests_parallel.py --procs "$2" --timeout $(($3 - 15)) --log-dir "$1.d" $4 -- -m gpu -k "not fuzz" 2>&1 | tee "$1"; rc=$?; cat "$1".d/*.log >> "$1"; rm -rf "$1.d"; exit $rc' "$PY" "$OUT/pytest_gpu.log" "$TEST_PROCS" "$T_TESTS" "$GPU_TESTS"
        else
            stage tests "$T_TESTS" bash -c 'set -o pipefail; CUDA_VISIBLE_DEVICES=0 FML_TEST_DEVICE=cuda "$0" -m pytest -q -rfE -m gpu -k "not fuzz" $3 $2 -p no:cacheprovider 2>&1 | tee "$1"' "$PY" "$OUT/pytest_gpu.log" "$PYTEST_STOP" "$GPU_TESTS"
        fi
        # shellcheck disable=SC2086
        wait $fuzz_pids
        cat "$OUT"/fuzz_gpu_*.tmp >"$OUT/fuzz_gpu.log"
        grep -E "passed|failed|rc=" "$OUT/fuzz_gpu.log"
    fi
    if want ktests; then
        stage ktests "$T_KTESTS" bash -c 'set -o pipefail; FML_TEST_DEVICE=cuda "$0" benchmarks/run_tests_parallel.py --procs 12 --timeout $(($2 - 15)) --log-dir "$1.d" $3 2>&1 | tee "$1"; rc=$?; cat "$1".d/*.log > "$1.all"; rm -rf "$1.d"; exit $rc' "$PY" "$OUT/pytest_kernels_gpu.log" "$T_KTESTS" "$KTEST_FILES"
    fi
    if want tune; then
        stage tune "$T_TUNE" "$PY" benchmarks/tune_kernels.py --parts "${TUNE_PARTS:-model}" --out "$OUT/tune_model.json"
    fi
    if want ab; then
        stage ab "$T_AB" "$PY" benchmarks/ab_step.py --out "$OUT/ab_step.txt"
    fi
    if want gaps; then
        stage gaps "$T_GAPS" "$PY" benchmarks/kernel_gaps.py --out "$OUT/kernel_gaps.txt"
    fi
    if want kernels; then
        stage kernels "$T_KERNELS" "$PY" benchmarks/bench_kernels.py --out-dir "$OUT" \
            --budget-s $((T_KERNELS - 25)) ${COMMIT:+--commit "$COMMIT"}
    fi
    if want model; then
        stage model "$T_MODEL" "$PY" benchmarks/bench_model.py --out "$OUT/h200.json" \
            ${MODEL_SCENARIOS:+--scenarios "$MODEL_SCENARIOS"} --budget-s $((T_MODEL - 35)) ${COMMIT:+--commit "$COMMIT"} \
            $MODEL_ARGS
    fi
    if want compiled; then  # default mode: --merge adds its scenarios to the model stage's h200.json; others: own file
        local cm cj
        for cm in $COMPILE_MODE; do
            cj="$OUT/h200.json"
            [ "$cm" = default ] || cj="$OUT/h200_$cm.json"
            stage "compiled_$cm" "$T_COMPILED" "$PY" benchmarks/bench_model.py --out "$cj" --merge \
                --scenarios "$COMPILED_SCENARIOS" \
                --compile-mode "$cm" --budget-s $((T_COMPILED - 35)) ${COMMIT:+--commit "$COMMIT"} $COMPILED_ARGS
        done
    fi
    if want qlora; then  # --merge: adds its scenarios to the model stage's h200.json (or starts one)
        stage qlora "$T_QLORA" "$PY" benchmarks/bench_model.py --out "$OUT/h200.json" --merge \
            --scenarios qlora_step_8,qlora_eval_8 --budget-s $((T_QLORA - 35)) ${COMMIT:+--commit "$COMMIT"}
    fi
    if want profile; then  # one profile per PROFILE_MODES entry: eager, a torch.compile mode, or decode
        local m
        for m in $PROFILE_MODES; do
            stage "profile_$m" "$T_PROFILE" env CUDA_VISIBLE_DEVICES=0 "$PY" benchmarks/profile_step.py \
                $(case "$m" in eager) ;; decode) echo --decode ;; decode-*) echo --decode --compile "${m#decode-}" ;; scale) echo --scale "$SCALE_COUNTS" ;;
                  eval) echo --eval ;; eval-*) echo --eval --compile "${m#eval-}" ;; store) echo --store ;;
                  store-*) echo --store --compile "${m#store-}" ;; train32) echo --shape 32,32,512 ;;
                  *) echo --compile "$m" ;; esac) \
                --out "$OUT/profile_step_$m.txt"
        done
    fi
    if want multi; then
        stage multi "$T_MULTI" env OUT="$OUT/multi_gpu" bash benchmarks/multi_gpu.sh
    fi
    rm -f "$OUT"/*.tmp
    echo "== gpu_check done in ${SECONDS}s:$SUMMARY"
    case "$SUMMARY" in *rc=[1-9]*) return 1 ;; esac
    return 0
}

main 2>&1 | tee "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
