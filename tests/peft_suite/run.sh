#!/usr/bin/env bash
# PEFT's own LoRA tests against models patched by fast_multilora (needs network for the sdist and test extras).
#
#   bash tests/peft_suite/run.sh [pytest -k expression]      # default: the LoRA tests of test_custom_models.py
#
# Downloads the sdist of the installed PEFT version (it ships tests/), installs what its test helpers import, then
# runs the selection twice -- stock, and with tests/peft_suite/fml_patch_plugin.py patching every PeftModel and
# LoraModel the tests build -- and prints the tests that fail only when patched. Logs in $WORK (default /tmp).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/fml_peft_suite}
SELECT=${1:-"LoraConfig or lora or Lora"}
FILES=${FILES:-tests/test_custom_models.py}
version=$(python -c "import peft; print(peft.__version__)")
mkdir -p "$WORK"
cd "$WORK"
if [ ! -d "peft-$version/tests" ]; then
    python -m pip download -q --no-deps --no-binary :all: "peft==$version" -d .
    tar xzf "peft-$version.tar.gz"
fi
touch "peft-$version/tests/__init__.py"  # the sdist lacks it; the tests import their helpers relatively
python -m pip install -q diffusers datasets scipy parameterized
cd "peft-$version"
run() {  # run LOG [extra pytest args...]
    local log=$1
    shift
    python -m pytest -o addopts="" -q -rfE -p no:cacheprovider "$@" $FILES -k "$SELECT" >"$WORK/$log" 2>&1 || true
    tail -n 2 "$WORK/$log"
}
echo "== stock PEFT $version"
run stock.log
echo "== patched by fast_multilora"
PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" run patched.log -p fml_patch_plugin
grep -E "^(FAILED|ERROR) " "$WORK/stock.log" | sed 's/ - .*//' | sort >"$WORK/stock.failed" || true
grep -E "^(FAILED|ERROR) " "$WORK/patched.log" | sed 's/ - .*//' | sort >"$WORK/patched.failed" || true
echo "== failing only when patched:"
comm -13 "$WORK/stock.failed" "$WORK/patched.failed"
