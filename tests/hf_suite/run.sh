#!/usr/bin/env bash
# Hugging Face's own ModernBERT model tests, run stock and with every ModernBertModel packed, then compared.
#
#   bash tests/hf_suite/run.sh HF_TESTS [pytest args...]
#
# HF_TESTS: the `tests/` folder of the installed transformers release's sources (nothing of HF's is committed
# here). It needs the shared files (test_modeling_common.py, test_configuration_common.py, test_pipeline_mixin.py
# and what they import: exporters/test_export.py, generation/test_utils.py, utils/test_configuration_utils.py,
# utils/tiny_model_summary.json) and models/modernbert/test_modeling_modernbert.py, all of the same release:
#   V=$(python -c 'import transformers; print(transformers.__version__)')
#   git clone --depth 1 --branch v$V https://github.com/huggingface/transformers hf   # HF_TESTS=hf/tests
# The PyPI sdist (`pip download transformers==$V --no-binary :all: --no-deps`) ships the top-level tests/*.py only;
# the rest must come from the tag. HF's tests also need `parameterized` (in transformers' `testing` extra).
#
# PE_HF_SUITE_MASKS=contiguous: HF's random attention masks keep each row's real-token count but pad on the right
# (both runs). HF's masks have holes inside rows, which the patched forward hands to the stock forward, so most
# tests exercise the packed path only with this setting; run both (see pack_plugin.py).
# Writes stock.xml / packed.xml / *.log under $OUT (default: a temporary folder) and exits non-zero when a test
# passing stock fails packed and is not listed with its reason in tests/hf_suite/compare.py.
set -euo pipefail
HF_TESTS=$(cd "$1" && pwd); shift
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/tests/models/modernbert"
cp "$HF_TESTS"/*.py "$WORK/tests/"
# test_modeling_common / test_configuration_common import from these sub-packages
for sub in exporters generation utils; do
  mkdir -p "$WORK/tests/$sub"; touch "$WORK/tests/$sub/__init__.py"
  [ -d "$HF_TESTS/$sub" ] && cp "$HF_TESTS/$sub"/*.py "$WORK/tests/$sub/"
done
cp "$HF_TESTS/utils/tiny_model_summary.json" "$WORK/tests/utils/"   # test_pipeline_mixin reads it at import
# test_pipeline_mixin imports ../src/transformers: point it at the installed release
mkdir -p "$WORK/src"; ln -s "$("$PY" -c 'import os, transformers; print(os.path.dirname(transformers.__file__))')" "$WORK/src/transformers"
cp "$HF_TESTS/models/modernbert/test_modeling_modernbert.py" "$WORK/tests/models/modernbert/"
touch "$WORK/tests/__init__.py" "$WORK/tests/models/__init__.py" "$WORK/tests/models/modernbert/__init__.py"
cd "$WORK"
export PYTHONPATH="$REPO:$REPO/tests/hf_suite${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
# the two runs side by side, one torch thread each: the models are tiny, so each run is mostly single-threaded Python
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
for mode in stock packed; do
  (
    start=$SECONDS
    PE_HF_SUITE_PACK=$([ $mode = packed ] && echo 1 || echo 0) "$PY" -m pytest -q -p pack_plugin -p no:cacheprovider \
      -p no:randomly --junitxml="$OUT/$mode.xml" tests/models/modernbert/test_modeling_modernbert.py "$@" \
      > "$OUT/$mode.log" 2>&1 || true
    echo "$mode ($((SECONDS - start)) s): $(tail -1 "$OUT/$mode.log")"
  ) &
done
wait
"$PY" "$REPO/tests/hf_suite/compare.py" "$OUT/stock.xml" "$OUT/packed.xml"
