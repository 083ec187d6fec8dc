"""CI runs the interpreter tests under every Triton release whose interpreter the runtime supports
(``INTERPRETER_TRITON`` in packed_encoders/ops/triton/_runtime.py): the lock's, which the whole suite runs under, and
each release ``.ci/run`` runs them again under (``PE_INTERPRETER_TRITON=<release>``, see tests/conftest.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_interprets_under_every_supported_release():
    pytest.importorskip("triton")
    from packed_encoders.ops.triton._runtime import INTERPRETER_TRITON

    lock = re.search(r'\nname = "triton"\nversion = "([^"]+)"', (ROOT / "uv.lock").read_text()).group(1)
    passes = re.findall(r"PE_INTERPRETER_TRITON=([0-9][0-9.]*)", (ROOT / ".ci" / "run").read_text())
    assert passes, ".ci/run runs no interpreter pass"
    for release in INTERPRETER_TRITON:
        assert any(v.startswith(release) for v in [lock, *passes]), (
            f"CI runs the interpreter tests under no Triton {release}* (the lock's is {lock}, .ci/run's passes {passes})")
    for version in passes:
        assert version.startswith(INTERPRETER_TRITON), f".ci/run interprets under Triton {version}, not supported"
