"""Fixtures shared by the CPU tests. Model and batch builders live in :mod:`tests.helpers`."""

from __future__ import annotations

import os

import pytest
import torch

# Re-exported for test modules that import them from here; new code imports tests.helpers.
from tests.helpers import (CONFIGS, PARITY_CONFIGS, SPECIAL, VOCAB, assert_close_real, make_config,  # noqa: F401
                           make_model, padded_batch, stock, stock_positions)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(params=PARITY_CONFIGS)
def config_name(request):
    return request.param


@pytest.fixture
def interpreter_fixes():
    """For modules that launch a ``@triton.jit`` kernel directly (``pytestmark =
    pytest.mark.usefixtures("interpreter_fixes")``): on CPU each test runs with ``TRITON_INTERPRET=1`` inside
    ``ops.triton._runtime._interpreter_fixes()``, so Triton's standard library is in its interpreted form whatever
    mode Triton was imported in, fp32 -> bf16 casts round as on the GPU, and every interpreter patch is undone
    afterwards (the module passes in any order with the other interpreter modules). On CUDA it does nothing."""
    if torch.cuda.is_available():
        yield
        return
    from packed_encoders.ops.triton._runtime import _interpreter_fixes

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # read per call by the wrapper; another module may have reset it
        with _interpreter_fixes():
            yield


@pytest.fixture(scope="module")
def triton_interpret():
    """``TRITON_INTERPRET=1`` for one test module (``pytestmark = pytest.mark.usefixtures("triton_interpret")``):
    its Triton kernels run interpreted on CPU; compiled kernels elsewhere in the process are unaffected, since
    interpretation is chosen per launch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
