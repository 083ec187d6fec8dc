"""The CPU training-graph DDP checks (tests/test_train_graphs_loops.py) with NCCL, one rank per visible GPU (a single
GPU runs them as world size 1): the training graphs are captured for real, and DDP's averaged gradients through them
equal one process's stock gradients of the whole batch (five DDP setups) and the eager packed path's (GradCache).

Run: ``python -m pytest -q tests/gpu/test_train_graphs_loops.py`` (skipped without CUDA; at most 4 ranks, so
``CUDA_VISIBLE_DEVICES=0,1`` picks two).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

if not dist.is_nccl_available():
    pytest.skip("needs NCCL", allow_module_level=True)

# The CPU module's assertions, collected here against this module's NCCL ``ddp_results`` fixture.
from tests.test_train_graphs_loops import (  # noqa: E402,F401
    run_ddp_world, test_ddp_gradcache_through_training_graphs_equals_eager,
    test_ddp_gradients_through_training_graphs_equal_one_process)

WORLD = min(torch.cuda.device_count(), 4)  # the batch (16 rows, 8 query / document pairs) leaves every rank a share


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return run_ddp_world(tmp_path_factory.mktemp("dist_train_graphs_nccl"), WORLD, "nccl")
