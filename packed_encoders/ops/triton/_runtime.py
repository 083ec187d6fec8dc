"""How a Triton kernel is launched: compiled for CUDA tensors, interpreted for CPU tensors.

Triton decides between compiling and interpreting when ``@triton.jit`` runs (it reads
``TRITON_INTERPRET`` at decoration time). The kernels here are plain Python functions wrapped on
first use in both forms: a ``JITFunction`` for CUDA tensors and an ``InterpretedFunction`` for CPU
tensors, so the kernel modules can be imported in either mode. CPU tensors are only accepted while
``TRITON_INTERPRET=1`` is set (read per call) *and* Triton itself was imported with it set: the
kernels call Triton's standard library (``tl.sum``, ``tl.sigmoid``), which Triton decorates once, at
its own import, in one mode or the other. A process that imported Triton compiled (a GPU test run)
therefore runs the kernels compiled on CUDA and refuses to interpret them on CPU; a CPU-only process
that imported Triton with ``TRITON_INTERPRET=1`` interprets them. Kernels call no jitted helpers of
their own.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from . import interpret_enabled

def interpreter_unavailable() -> str | None:
    """Why CPU tensors cannot be interpreted now (``None`` when they can)."""
    if not interpret_enabled():
        return "TRITON_INTERPRET is not set"
    if not isinstance(tl.standard.sum, InterpretedFunction):
        return ("Triton was imported without TRITON_INTERPRET=1, so its standard library is compiled-only; "
                "set it before importing triton to interpret the kernels on CPU")
    return None


class Kernel:
    """A kernel source with a compiled and an interpreted form, each built once on first use.

    ``do_not_specialize`` names the runtime integer arguments (token counts) that Triton must not
    specialise on (value 1, divisibility by 16), so one compiled artifact serves every batch.
    """

    def __init__(self, fn, do_not_specialize=()):
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self._compiled = None
        self._interpreted = None

    def on(self, t: torch.Tensor):
        """The launchable form for the device of ``t``."""
        if t.device.type == "cuda":
            if self._compiled is None:
                self._compiled = JITFunction(self.fn, do_not_specialize=self.do_not_specialize)
            return self._compiled
        if t.device.type == "cpu" and interpreter_unavailable() is None:
            if self._interpreted is None:
                self._interpreted = _Interpreted(InterpretedFunction(self.fn, do_not_specialize=self.do_not_specialize))
            return self._interpreted
        why = interpreter_unavailable() if t.device.type == "cpu" else f"{t.device.type} tensors"
        raise RuntimeError(f"Triton kernels run on CUDA tensors, or on CPU tensors when interpreted; here: {why}")


class _Interpreted:
    """``fn[grid](...)`` for an ``InterpretedFunction``, with two fidelity fixes held during the launch.

    - Triton 3.6's interpreter holds scalars as 1-element arrays and converts loop bounds with
      ``int(array)``, which NumPy >= 2.3 refuses; the index conversion takes the single element instead.
    - The interpreter casts fp32 -> bf16 by truncating the mantissa, while compiled Triton rounds to
      nearest even (``cvt.rn.bf16.f32``); the cast is done with torch's round-to-nearest-even so that
      interpreted results carry the rounding the GPU will. Compiled kernels are untouched.
    """

    _lock = threading.Lock()

    def __init__(self, fn: InterpretedFunction):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with self._lock, _interpreter_fixes():
                return self.fn[grid](*args, **kwargs)
        return launch


@contextlib.contextmanager
def _interpreter_fixes():
    original_patch = _interp._patch_lang_tensor
    builder = _interp.InterpreterBuilder
    original_cast = builder.cast_impl

    def patched(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return _interp.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original_cast(self, src, dst_type)

    _interp._patch_lang_tensor = patched
    builder.cast_impl = cast_impl
    try:
        yield
    finally:
        _interp._patch_lang_tensor = original_patch
        builder.cast_impl = original_cast


def kernel(*, do_not_specialize=()):
    """Decorator: ``@kernel(do_not_specialize=("n_rows",))`` on a Triton kernel body."""
    return lambda fn: Kernel(fn, do_not_specialize)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(t: torch.Tensor, work_items: int, per_sm: int = 4) -> int:
    """How many programs a persistent kernel launches: ``per_sm`` per multiprocessor on CUDA,
    a handful when interpreted, never more than the work items (and at least 1)."""
    if t.device.type == "cuda":
        cap = per_sm * _sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    else:
        cap = 3
    return max(1, min(cap, work_items))


def device_guard(t: torch.Tensor):
    """Triton launches on the current device's current stream: make ``t``'s device current."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return _NULL


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
