#!/usr/bin/env bash
# The GPU run, from the repo root on the GPU machine: install, GPU tests, the harness (benchmarks/run.py), plot, and a
# tarball of everything in the output folder.
#
#   bash benchmarks/gpu_run.sh --out "$OUT"                                # tests + default scenarios, all providers
#   bash benchmarks/gpu_run.sh --out "$OUT" --no-tests --scenarios train_step_8 --fresh-process
#   bash benchmarks/gpu_run.sh --out "$OUT" --tests tests/test_compile_gpu.py --scenarios eval_8 --kernels
#
# Options: --out DIR (default $OUT, else benchmarks/results/gpu_run); --tests "PATHS" (default tests/) or --no-tests;
# --no-harness (the tests alone);
# --test-timeout S (default 420; the GPU tests under 6 xdist workers: 132 of them ran in 370 s on an H100 at
# 2442c66, none failed; serially, at 170 s only 5 had run, 2026-12-05); --scenarios LIST and
# --providers LIST (run.py's; default: its defaults);
# --variants LIST; --fresh-process; --budget-s S (the harness starts no row past it; default 360); --kernels (also
# bench_kernels.py, 120 s budget); --fresh (a new results file instead of merging into a copy of
# benchmarks/results/h200.json). Wheels in an ignored wheels/ folder (e.g. bitsandbytes, for the machine has no
# network) are installed with --no-deps first.
#
# $OUT then holds: gpu_run.log, pytest_gpu.log, h200.json (the repo's results with this run's scenarios replaced:
# copy it to benchmarks/results/h200.json), h200.md, h200_model.png (copy to docs/), kernels.* with --kernels, and
# results.tar.gz of them all. Exit status: the first failing stage's.
set -u
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels

OUT=${OUT:-benchmarks/results/gpu_run}
TESTS=tests/
TEST_TIMEOUT=420
BUDGET=360
HARNESS=()
KERNELS=0
MERGE=1
HARNESS_ON=1
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT=$2; shift ;;
        --tests) TESTS=$2; shift ;;
        --no-tests) TESTS="" ;;
        --no-harness) HARNESS_ON=0 ;;
        --test-timeout) TEST_TIMEOUT=$2; shift ;;
        --scenarios|--providers|--variants) HARNESS+=("$1" "$2"); shift ;;
        --fresh-process) HARNESS+=("$1") ;;
        --budget-s) BUDGET=$2; shift ;;
        --kernels) KERNELS=1 ;;
        --fresh) MERGE=0 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "gpu_run.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-$(command -v python3 || command -v python)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/gpu_run.log") 2>&1

RC=0
stage() {  # stage NAME CMD...: run, report rc and seconds, keep the first failure's rc
    local name=$1 t0=$SECONDS rc
    shift
    echo "== $name: start $(date -u +%H:%M:%S) UTC"
    "$@"
    rc=$?
    echo "== $name: rc=$rc after $((SECONDS - t0)) s"
    [ "$RC" -eq 0 ] && RC=$rc
    return 0
}

echo "== gpu_run: $(date -u) repo=$PWD out=$OUT commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
# the carried wheels first: a setuptools wheel among them is what the checkout's build (no isolation) then uses
for whl in wheels/*.whl; do
    [ -e "$whl" ] && stage "wheel $(basename "$whl")" "$PY" -m pip install -q --no-deps "$whl"
done
stage install "$PY" -m pip install -q --no-deps --no-build-isolation -e .
nvidia-smi -L
"$PY" -c "import sys, torch, triton, peft, transformers; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'triton', triton.__version__, 'peft', peft.__version__, 'transformers', transformers.__version__)"

if [ -n "$TESTS" ]; then
    # The GPU tests' time is mostly Triton compiling their kernels (CPU work): with pytest-xdist (a carried wheel),
    # one worker per two cores; -rA lists every test's outcome, so a run cut by the timeout shows which ones ran
    XDIST=()
    "$PY" -c "import xdist" 2>/dev/null && XDIST=(-n "$(( $(nproc) / 2 > 1 ? $(nproc) / 2 : 1 ))" -p no:benchmark)
    # shellcheck disable=SC2086
    stage tests bash -c 'set -o pipefail; FML_TEST_DEVICE=cuda timeout -k 10 "$1" "$0" -m pytest -q -rA \
        --durations=25 -m gpu -p no:cacheprovider "${@:4}" $2 2>&1 | tee "$3"' "$PY" "$TEST_TIMEOUT" "$TESTS" \
        "$OUT/pytest_gpu.log" "${XDIST[@]}"
fi
if [ "$HARNESS_ON" -eq 1 ]; then
    if [ "$MERGE" -eq 1 ] && [ -f benchmarks/results/h200.json ]; then
        cp benchmarks/results/h200.json "$OUT/h200.json"
        HARNESS+=(--merge)
    fi
    stage harness "$PY" benchmarks/run.py --device cuda --out "$OUT/h200.json" --budget-s "$BUDGET" "${HARNESS[@]}"
fi
if [ "$KERNELS" -eq 1 ]; then
    stage kernels "$PY" benchmarks/bench_kernels.py --out-dir "$OUT" --budget-s 120
fi
[ -f "$OUT/h200.json" ] && stage plot "$PY" benchmarks/plot.py "$OUT/h200.json" --png "$OUT/h200_model.png" \
    --md "$OUT/h200.md"
(cd "$OUT" && tar czf results.tar.gz --exclude results.tar.gz ./*)
echo "== gpu_run done in ${SECONDS} s, rc=$RC; $OUT/results.tar.gz"
exit "$RC"
