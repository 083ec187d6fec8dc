"""Triton kernels for the per-token ops (LayerNorm, residual + LayerNorm, RoPE from fused qkv, GLU).

The kernel modules import Triton; this package file does not (it only answers whether interpret mode
is on). ``packed_encoders.ops.fused`` wraps the launchers as ``torch.library`` custom ops. Nothing here
is imported by ``import packed_encoders``.
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "on", "yes")


def interpret_enabled() -> bool:
    """True while ``TRITON_INTERPRET`` is set to a true value (read now, not at import; imports no Triton)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE
