#!/usr/bin/env bash
# Builds a separate environment for the PyLate ColBERT test: pylate 1.6 pins sentence-transformers 5.3.0 and
# transformers <= 5.3.0, and its fast-plaid dependency pins an exact torch. `from pylate import models` needs
# neither fast-plaid nor fastkmeans, so pylate goes in with --no-deps beside its light dependencies.
# Usage: bash tests/envs/pylate.sh DIR   -> prints the interpreter path (export it as PE_PYLATE_PYTHON)
set -euo pipefail
dir=${1:?usage: pylate.sh DIR}
python3 -m venv "$dir" >&2
"$dir/bin/python" -m pip install -q --upgrade pip >&2
"$dir/bin/python" -m pip install -q torch==2.13.0 >&2
"$dir/bin/python" -m pip install -q "transformers==5.3.0" "sentence-transformers==5.3.0" datasets accelerate \
  pandas "ujson==5.12.0" pytest >&2
"$dir/bin/python" -m pip install -q --no-deps "pylate==1.6.0" >&2
"$dir/bin/python" -c "from pylate import models" >&2
echo "$dir/bin/python"
