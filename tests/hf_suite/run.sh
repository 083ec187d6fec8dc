#!/usr/bin/env bash
# Hugging Face's own ModernBERT model tests, run stock and with every ModernBertModel packed, then compared.
#
#   bash tests/hf_suite/run.sh HF_TESTS [pytest args...]
#
# HF_TESTS: the `tests/` folder of the installed transformers release's sources, holding the shared test files
# (test_modeling_common.py, test_configuration_common.py, test_pipeline_mixin.py, ...) and
# models/modernbert/test_modeling_modernbert.py: a clone of github.com/huggingface/transformers at the tag
# v$(python -c 'import transformers; print(transformers.__version__)'). The PyPI sdist
# (`pip download transformers==<installed> --no-binary :all: --no-deps`) ships the shared files but not
# tests/models/; copy the model's test file in from the tag. Nothing of HF's is committed here.
# Writes stock.xml / packed.xml under $OUT (default: a temporary folder) and exits non-zero when a test passing
# stock fails packed and is not listed with its reason in tests/hf_suite/compare.py.
set -euo pipefail
HF_TESTS=$(cd "$1" && pwd); shift
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PYTHON:-python}
OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
mkdir -p "$WORK/tests/models/modernbert"
cp "$HF_TESTS"/*.py "$WORK/tests/"
cp "$HF_TESTS/models/modernbert/test_modeling_modernbert.py" "$WORK/tests/models/modernbert/"
touch "$WORK/tests/__init__.py" "$WORK/tests/models/__init__.py" "$WORK/tests/models/modernbert/__init__.py"
cd "$WORK"
export PYTHONPATH="$REPO:$REPO/tests/hf_suite${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
for mode in stock packed; do
  PE_HF_SUITE_PACK=$([ $mode = packed ] && echo 1 || echo 0) "$PY" -m pytest -q -p pack_plugin -p no:cacheprovider \
    --junitxml="$OUT/$mode.xml" tests/models/modernbert/test_modeling_modernbert.py "$@" > "$OUT/$mode.log" 2>&1 || true
  tail -1 "$OUT/$mode.log"
done
"$PY" "$REPO/tests/hf_suite/compare.py" "$OUT/stock.xml" "$OUT/packed.xml"
