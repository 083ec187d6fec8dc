"""The CPU distributed checks with NCCL, one rank per visible GPU (a single GPU runs them as world size 1).

DDP in both orders (gradients equal one process on the global batch, find_unused_parameters / static_graph),
GradCache with one all-reduce per step (a plain loop and sentence-transformers' cached loss), FSDP2 (the encoder
as one unit keeps the packed path; per-layer units fall back to the stock forward with a warning, and pack()
refuses them); then sharded indexing across the ranks equals one process row for row after a killed rank resumes.

Run: ``python -m pytest -q tests/gpu/test_distributed.py`` (skipped without CUDA; one rank per visible GPU, at
most 4, so ``CUDA_VISIBLE_DEVICES=0,1`` picks two).
"""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

if not dist.is_nccl_available():
    pytest.skip("needs NCCL", allow_module_level=True)

from tests.dist_helpers import spawn  # noqa: E402
# The CPU module's assertions, collected here against this module's NCCL ``results`` fixture.
from tests.test_distributed import (  # noqa: E402,F401
    _train_worker, test_ddp_gradients_equal_one_process, test_fsdp2, test_gradcache_loop_syncs_once_with_same_gradients,
    test_st_cached_loss_under_ddp)
from tests.test_distributed_index import check_sharded_run, setup  # noqa: E402,F401

# up to 4 ranks: the tiny batches (16 rows) and corpus (~12 chunks) leave every rank a share
WORLD = min(torch.cuda.device_count(), 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.tiny_tokenizer import save_tiny_model

    tmp = tmp_path_factory.mktemp("dist_train_nccl")
    model_dir = save_tiny_model(tmp / "model")
    spawn(_train_worker, WORLD, tmp, str(tmp), model_dir, "nccl")
    with open(tmp / "results.json") as f:
        return json.load(f)


def test_sharded_indexing_after_a_kill(setup):  # noqa: F811  (the imported fixture)
    check_sharded_run(*setup, world=WORLD, backend="nccl")
