import gc

import pytest
import torch

# Packed models of earlier tests keep their CUDA graphs' private memory pools until the models are collected, and a
# packed model is a reference cycle (its forward is bound to it), which only the cyclic collector frees: in one
# process on an 80 GB card, tests/gpu reached ~35 GiB in such pools before the ColBERT GradCache training test, which
# then ran out of memory (it passes alone).
_RELEASE_ABOVE_BYTES = 8 << 30


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """After each test, collect cycles and return cached blocks to the driver once the process holds more than
    ``_RELEASE_ABOVE_BYTES`` (below that, the ~0.1 s a collection costs is not worth it)."""
    yield
    if torch.cuda.is_available() and torch.cuda.memory_reserved() > _RELEASE_ABOVE_BYTES:
        gc.collect()
        torch.cuda.empty_cache()
