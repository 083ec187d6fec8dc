"""Triton kernels for the per-token ops (LayerNorm, residual + LayerNorm, RoPE from fused qkv, GLU).

The kernel modules import Triton; this package file does not (it only answers whether interpret mode
is on, holds the fast launcher's switch, which ``pack()`` sets, and the GLU GEMM's token limit, which the
plan reads). ``packed_encoders.ops.fused`` wraps the launchers as ``torch.library`` custom ops. ``import
packed_encoders`` loads this file only, never a kernel module or Triton.
"""

from __future__ import annotations

import os
import sys

from ...tuning import Tuning

_TRUE = ("1", "true", "on", "yes")


def interpret_enabled() -> bool:
    """True while ``TRITON_INTERPRET`` is set to a true value (read now, not at import; imports no Triton)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


# Largest token count served by the GLU-fused Wi GEMM. Measured on the H200 (bf16, ModernBERT-base 768 -> 2 x
# 1152) against cuBLAS + the GLU kernel: alone (benchmarks/gemm_small.py, cold weights) 1.24x at 128 tokens,
# 1.08x at 256, 1.02x at 512, 0.89x at 1024; inside a graph replay of the whole forward (profiled per kernel)
# 6.6 vs 6.95 us per layer at 256 tokens but 8.4 vs 8.2 us at 512. PACKED_ENCODERS_FUSED_GLU_GEMM=0 (read at
# pack() into the plan's Rules, which then never routes Wi here) turns it off for a packed model, for A/B runs.
GLU_LINEAR_MAX_TOKENS = 256


# The Triton fast launcher (``_runtime.FastLauncher``) is on: ``PACKED_ENCODERS_TRITON_FAST_LAUNCH`` as read at
# ``pack()`` into its ``Tuning``. Process-wide, like the launchers: the last ``pack()`` sets it.
FAST_LAUNCH = Tuning().triton_fast_launch


def set_fast_launch(enabled: bool) -> None:
    """Turn the fast launcher on or off for every kernel (decided again at each kernel's next launch)."""
    global FAST_LAUNCH
    FAST_LAUNCH = bool(enabled)
    runtime = sys.modules.get(__name__ + "._runtime")
    if runtime is not None:
        runtime.FastLauncher.enabled = None
