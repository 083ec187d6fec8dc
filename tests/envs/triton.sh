#!/usr/bin/env bash
# Installs the Triton releases the fast launcher follows beyond the lock's (see FAST_LAUNCH_TRITON in
# packed_encoders/ops/triton/_runtime.py), each on its own under DIR/<version>, for tests/test_fast_launch_record.py
# (it puts one at a time first on PYTHONPATH; Triton needs nothing else installed beside it).
# Usage: bash tests/envs/triton.sh DIR   -> prints the directories, colon-separated (export as PE_TRITON_RELEASES)
set -euo pipefail
dir=${1:?usage: triton.sh DIR}
out=()
for version in 3.7.1 3.8.0 3.9.0; do
  python3 -m pip install -q --no-deps --target "$dir/$version" "triton==$version" >&2
  out+=("$dir/$version")
done
(IFS=:; echo "${out[*]}")
