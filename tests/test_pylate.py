"""PyLate ColBERT parity, run in PyLate's own environment (its pins clash with ours).

`.ci/run` builds that environment with tests/envs/pylate.sh and exports PE_PYLATE_PYTHON; without it the
test cannot run and is skipped with that reason.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not os.environ.get("PE_PYLATE_PYTHON"),
                    reason="needs PE_PYLATE_PYTHON (bash tests/envs/pylate.sh DIR builds PyLate's environment)")
def test_pylate_colbert_parity():
    proc = subprocess.run([os.environ["PE_PYLATE_PYTHON"], str(ROOT / "tests" / "pylate_check.py"), str(ROOT)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1])
    assert proc.returncode == 0, (result, proc.stderr[-4000:])
    assert result["packed"] and result["max_abs_diff"] < 1e-4
