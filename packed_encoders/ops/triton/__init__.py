"""Triton kernels for the per-token ops (LayerNorm, residual + LayerNorm, RoPE from fused qkv, GLU).

The kernel modules import Triton; this package file does not (it only answers whether interpret mode
is on and holds the fast launcher's switch, which ``pack()`` sets). ``packed_encoders.ops.fused`` wraps the
launchers as ``torch.library`` custom ops. ``import packed_encoders`` loads this file only, never a kernel
module or Triton.
"""

from __future__ import annotations

import os
import sys

from ...tuning import Tuning

_TRUE = ("1", "true", "on", "yes")


def interpret_enabled() -> bool:
    """True while ``TRITON_INTERPRET`` is set to a true value (read now, not at import; imports no Triton)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


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
