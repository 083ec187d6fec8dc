"""The ``cute`` op set: quack's CuteDSL LayerNorm kernels, Triton for RoPE and the GLU.

Nothing here imports ``cutlass`` or ``quack`` at import time; :func:`unavailable` and the op
implementations import them on first use. ``packed_encoders.ops.cute.opset.CUTE_OPS`` is the op set.
"""

from __future__ import annotations

import torch

MIN_CAPABILITY = (9, 0)


def unavailable(device: torch.device) -> str | None:
    """Why the ``cute`` op set cannot run on ``device`` (``None`` when it can).

    Needs a CUDA device of compute capability >= 9.0 (quack's kernels are built and tested for Hopper
    and Blackwell), importable ``cutlass`` (nvidia-cutlass-dsl) and ``quack`` (quack-kernels), and Triton
    for the ops quack does not cover here.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return f"CuteDSL kernels need a CUDA device (got {device.type})"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"compute capability sm_{cap[0]}{cap[1]} is below sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"
    try:
        import cutlass  # noqa: F401
        import quack.rmsnorm  # noqa: F401
    except Exception as exc:  # ImportError, or a DSL that fails to initialise
        return f"cutlass/quack not importable ({exc.__class__.__name__}: {exc})"
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return f"triton not importable ({exc.__class__.__name__}: {exc})"
    return None
