"""Fixtures shared by the CPU tests. Model and batch builders live in :mod:`tests.helpers`."""

from __future__ import annotations

import inspect
import os
import re

import pytest
import torch

# Re-exported for test modules that import them from here; new code imports tests.helpers.
from tests.helpers import (CONFIGS, PARITY_CONFIGS, SPECIAL, VOCAB, assert_close_real, make_config,  # noqa: F401
                           make_model, padded_batch, stock, stock_positions)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Triton gives its standard library (tl.sum, tl.sigmoid, ...) its compiled or interpreted form once, when it is
# first imported, from TRITON_INTERPRET. Import it now with TRITON_INTERPRET unset, whoever runs the suite, so the
# ahead-of-time compile tests always see the compiled form: the interpreter tests turn TRITON_INTERPRET on for
# their own module or test only (the fixtures below), and an interpreted launch swaps the interpreted forms in and
# out itself (packed_encoders/ops/triton/_runtime.py). Were Triton first imported while a test had it on, the
# interpreted forms would stay for the whole process, and the compile tests would fail whenever Triton's disk
# cache is cold (a warm cache skips the frontend that calls them).
os.environ.pop("TRITON_INTERPRET", None)
try:
    import triton.language  # noqa: F401
except ImportError:  # no Triton: its tests skip
    pass


# The interpreter pass: ``PE_INTERPRETER_TRITON=3.9.0`` (CI runs it after the suite, with that release first on
# PYTHONPATH: ``.ci/run``) keeps only the tests that interpret kernels on CPU, those that ask for the fixtures
# below (in their signature, a ``usefixtures`` mark or ``request.getfixturevalue``), and refuses to run unless the
# Triton imported is that release and its interpreter is supported: a pass whose tests all skipped would check
# nothing.
INTERPRETER_PASS = os.environ.get("PE_INTERPRETER_TRITON")
INTERPRETER_FIXTURES = ("triton_interpret", "supported_interpreter", "interpret_on_cpu")


def pytest_configure(config):
    if not INTERPRETER_PASS:
        return
    try:
        import triton
    except ImportError as e:
        raise pytest.UsageError(f"PE_INTERPRETER_TRITON={INTERPRETER_PASS}: no Triton ({e})")
    from packed_encoders.ops.triton._runtime import unsupported_interpreter

    if triton.__version__ != INTERPRETER_PASS:
        raise pytest.UsageError(f"PE_INTERPRETER_TRITON={INTERPRETER_PASS}, but this is Triton {triton.__version__} "
                                f"({triton.__file__})")
    why = unsupported_interpreter()
    if why:
        raise pytest.UsageError(f"PE_INTERPRETER_TRITON={INTERPRETER_PASS}: {why}")


def interprets(item) -> bool:
    """Whether a test asks for an interpreter fixture (for the interpreter pass)."""
    if set(INTERPRETER_FIXTURES) & set(getattr(item, "fixturenames", ())):
        return True
    fn = getattr(item, "function", None)
    try:
        source = inspect.getsource(fn) if fn is not None else ""
    except (OSError, TypeError):
        source = ""
    return any(re.search(rf"\b{name}\b", source) for name in INTERPRETER_FIXTURES)


def pytest_collection_modifyitems(config, items):
    if not INTERPRETER_PASS:
        return
    keep = [interprets(item) for item in items]
    config.hook.pytest_deselected(items=[item for item, k in zip(items, keep) if not k])
    items[:] = [item for item, k in zip(items, keep) if k]


@pytest.fixture(params=PARITY_CONFIGS)
def config_name(request):
    return request.param


def _skip_unsupported_interpreter():
    pytest.importorskip("triton")
    from packed_encoders.ops.triton._runtime import unsupported_interpreter

    why = unsupported_interpreter()
    if why and INTERPRETER_PASS:
        pytest.fail(f"PE_INTERPRETER_TRITON={INTERPRETER_PASS}: {why}")
    if why:
        pytest.skip(f"{why}; CI installs the lock's Triton and runs these")


@pytest.fixture
def supported_interpreter():
    """On a machine without CUDA, skips the test, with the reason, under a Triton whose interpreter is not supported
    (for tests that interpret a kernel inside modules that also hold tests that do not)."""
    if not torch.cuda.is_available():
        _skip_unsupported_interpreter()


@pytest.fixture(scope="module")
def interpret_on_cpu():
    """``TRITON_INTERPRET=1`` for one test module on a machine without CUDA (``pytestmark =
    pytest.mark.usefixtures("interpret_on_cpu")``), for modules whose tensors live on the GPU when there is one:
    there the module runs compiled kernels and the variable stays unset (a kernel module first imported while it
    is set would take its interpreted form for the whole process)."""
    if torch.cuda.is_available():
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(scope="module")
def triton_interpret():
    """``TRITON_INTERPRET=1`` for one test module (``pytestmark = pytest.mark.usefixtures("triton_interpret")``):
    its Triton kernels run interpreted on CPU; compiled kernels elsewhere in the process are unaffected, since
    interpretation is chosen per launch. Skipped, with the reason, under a Triton whose interpreter is not
    supported."""
    _skip_unsupported_interpreter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a test module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny matmuls,
    where extra threads only contend on a shared CI machine (3x slower there with the default)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
