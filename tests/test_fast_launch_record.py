"""The fast launcher hands the driver what Triton's own launch does, through each Triton release's real C launcher.

Each run is a process of its own (tests/fast_launch_record_check.py over the recording libcuda of
tests/launch_record.py): this environment's Triton, then every release installed under the directories
``PE_TRITON_RELEASES`` names (colon-separated; ``.ci/run`` builds them with tests/envs/triton.sh). A run that does
not print ``ok`` fails with its output.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import launch_record

ROOT = Path(__file__).resolve().parents[1]
RELEASES = [d for d in os.environ.get("PE_TRITON_RELEASES", "").split(os.pathsep) if d]


def _check(triton_dir: str | None) -> str:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if triton_dir:
        env["PYTHONPATH"] = os.pathsep.join([triton_dir, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fast_launch_record_check.py"), str(ROOT)],
                          capture_output=True, text=True, env=env, timeout=900)
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and out and out[-1].startswith("ok "), proc.stdout[-3000:] + proc.stderr[-6000:]
    return out[-1]


@pytest.mark.skipif(launch_record.unavailable() is not None, reason=str(launch_record.unavailable()))
@pytest.mark.parametrize("triton_dir", [None, *RELEASES], ids=["this-env", *[Path(d).name for d in RELEASES]])
def test_fast_launch_matches_triton_launch(triton_dir):
    _, version, convention, launches = _check(triton_dir).split()
    assert int(launches) > 0
    if triton_dir:
        assert Path(triton_dir).name == version, f"{triton_dir} holds Triton {version}"


@pytest.mark.skipif(not RELEASES, reason="needs PE_TRITON_RELEASES (bash tests/envs/triton.sh DIR installs them)")
def test_every_release_the_fast_launcher_follows_is_checked():
    from packed_encoders.ops.triton._runtime import FAST_LAUNCH_TRITON

    import triton

    checked = {triton.__version__, *(Path(d).name for d in RELEASES)}
    for release in FAST_LAUNCH_TRITON:
        assert any(v.startswith(release) for v in checked), f"no Triton {release}* is checked"
