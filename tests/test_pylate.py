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
    lines = [line for line in proc.stdout.splitlines() if line.startswith('{"')]
    assert lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(lines[-1])
    assert proc.returncode == 0, (result, proc.stderr[-4000:])
    assert result["packed"] and result["max_abs_diff"] < 1e-4


@pytest.mark.skipif(not os.environ.get("PE_PYLATE_PYTHON"),
                    reason="needs PE_PYLATE_PYTHON (bash tests/envs/pylate.sh DIR builds PyLate's environment)")
def test_pylate_training_matches_stock():
    """Contrastive and CachedContrastive, gradient checkpointing off and on, and on training graphs
    (``GraphConfig(training=True)``, the route forced as on CUDA): 3 trainer steps packed vs stock."""
    proc = subprocess.run([os.environ["PE_PYLATE_PYTHON"], str(ROOT / "tests" / "pylate_train_check.py"), str(ROOT)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"')]
    assert results, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode == 0 and "error" not in results[-1], (results[-1], proc.stderr[-4000:])
    assert [(r["loss"], r["checkpointing"], r["graphs"]) for r in results] == [
        ("contrastive", False, False), ("contrastive", True, False), ("contrastive", False, True),
        ("cached_contrastive", False, False), ("cached_contrastive", True, False), ("cached_contrastive", False, True)]
    for r in results:
        assert r["max_loss_diff"] < 1e-5 and r["max_weight_update"] > 1e-4
        assert "16 wide" in r["padded_outputs"]  # masked query expansion: the expansion tokens are trained too
        # CachedContrastive's forward with gradients over the chunk its no-grad forward unpadded: no second sync
        assert (r["unpad_syncs_skipped"] > 0) == (r["loss"] == "cached_contrastive"), r
    # training graphs (route forced as on CUDA): queries, positives and negatives embedded with gradients, three
    # slots pending until the one backward; every such call served by the node, nothing run eagerly
    graphs = results[2]
    assert graphs["calls"] == {"served": 3 * 3, "refused": 0, "without_grad": 0}, graphs
    training = graphs["training"]
    assert training["pending_slots"] == 0 and training["slots"] == [0, 1, 2], training
    assert training["fallbacks"] == {} and training["gradient_buffer_bytes"] > 0, training
    # CachedContrastive: each chunk's forward with gradients (2 per text kind, 3 kinds, 3 steps) served by the node
    cached = results[5]
    assert cached["calls"] == {"served": 2 * 3 * 3, "refused": 0, "without_grad": 0}, cached
    assert cached["training"]["pending_slots"] == 0, cached["training"]
