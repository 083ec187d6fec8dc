"""Choose the per-token op implementation (:class:`~packed_encoders.ops.OpSet`) for a device.

``kernels``: ``"auto"`` (fused kernels on CUDA when they import, else plain PyTorch), ``"torch"``,
or a concrete fused family. Returns the op set and a sentence saying why, for ``describe()``.
"""

from __future__ import annotations

import torch

from ..errors import PackedEncodersError
from . import TORCH_OPS, OpSet

KERNEL_CHOICES = ("auto", "torch")


def select_ops(kernels: str, device: torch.device) -> tuple[OpSet, str]:
    if kernels not in KERNEL_CHOICES:
        raise PackedEncodersError(f"kernels={kernels!r} is not one of {KERNEL_CHOICES}")
    if kernels == "torch":
        return TORCH_OPS, "plain PyTorch ops (requested)"
    return TORCH_OPS, "plain PyTorch ops (no fused kernel family is available in this build)"
