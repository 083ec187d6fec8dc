"""Low-precision copies of fp32 weights under autocast, made once and reused until the weights change.

Under autocast every ``F.linear`` casts its fp32 weight to bf16 again, in every forward (GradCache runs each chunk
twice, so a step pays the casts many times; each is a launch plus a read and a write of the weight). :func:`cast`
keeps one copy per (parameter, dtype) and hands it out while the parameter is unchanged, judged by:

- its version counter (``param._version``: every in-place op through the tensor bumps it, e.g. a foreach
  optimizer step, ``param.copy_()``, ``param.mul_()``),
- its storage address (``param.data = other`` swaps it), dtype and device,
- a generation counter bumped after every ``torch.optim`` optimizer step (a global step hook, installed on first
  use): fused optimizers (``AdamW(fused=True)``) update parameters in place without bumping their version.

Not seen: an in-place edit through ``param.data`` (``param.data.copy_(...)``, e.g. a hand-written EMA update)
outside an optimizer step, since ``.data`` has a version counter of its own. Call :func:`clear` after such edits.

The copy is made without gradient tracking: callers that need the gradient to reach the fp32 parameter (the
block autograd functions of :mod:`packed_encoders.model.blocks`) compute the weight gradient themselves and return
it in the parameter's dtype. Inference tensors (no version counter), calls under CUDA-graph capture and calls
within :func:`off` (a training graph's warm-ups, whose allocations go to the graph's pool) are cast each time,
not cached. Entries go with their parameter (weak references).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

_CACHE: dict = {}
_LOCK = threading.Lock()
_STATE = {"generation": 0, "hooked": False}
_LOCAL = threading.local()


def _bump(*_args, **_kwargs) -> None:
    _STATE["generation"] += 1


def _install_hook() -> None:
    with _LOCK:
        if not _STATE["hooked"]:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(_bump)
            _STATE["hooked"] = True


def clear() -> None:
    """Drop every cached copy (after editing weights in a way :func:`cast` cannot see, e.g. ``p.data.copy_``)."""
    with _LOCK:
        _CACHE.clear()
    _bump()


@contextlib.contextmanager
def off():
    """Within the block, on this thread, :func:`cast` makes fresh copies and caches nothing (a cached copy made
    there would live in whatever memory pool the block allocates from)."""
    before = getattr(_LOCAL, "off", False)
    _LOCAL.off = True
    try:
        yield
    finally:
        _LOCAL.off = before


def cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in ``dtype`` (``t`` itself when it already is, or when either is ``None``), from the cache while ``t``
    is unchanged. The result carries no autograd history."""
    if t is None or dtype is None or t.dtype is dtype:
        return t
    if t.is_inference() or getattr(_LOCAL, "off", False) or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
        with torch.no_grad():
            return t.to(dtype)
    if not _STATE["hooked"]:
        _install_hook()
    key = (id(t), dtype)
    stamp = (_STATE["generation"], t._version, t.data_ptr(), t.device)
    hit = _CACHE.get(key)
    if hit is not None and hit[1] == stamp and hit[0]() is t:
        return hit[2]
    # a normal tensor even under inference_mode: a later training forward may save the cached copy for backward
    with torch.inference_mode(False), torch.no_grad():
        out = t.to(dtype)
    ref = weakref.ref(t, lambda _, k=key: _CACHE.pop(k, None))
    with _LOCK:
        _CACHE[key] = (ref, stamp, out)
    return out


def cached_count() -> int:
    """How many copies the cache holds (for tests and memory accounting)."""
    return len(_CACHE)
