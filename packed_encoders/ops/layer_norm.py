"""LayerNorm and residual + LayerNorm over packed activations ``[T, H]``.

Rounding policy (the same in inference and training, in every implementation): the residual sum
``x + delta`` is rounded to the activation dtype first, exactly like HF's eager ``hidden + out``;
statistics and normalisation then run in fp32 on that rounded sum, and the normalised output is
rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def layer_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp32 specification: ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (biased var)."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).square().mean(-1, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def residual_layer_norm_ref(x, delta, weight, bias, eps):
    """fp32 specification of residual + LayerNorm: returns ``(x + delta, LN(x + delta))`` in fp32."""
    s = x.float() + delta.float()
    return s, layer_norm_ref(s, weight, bias, eps)


def layer_norm_torch(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """Plain PyTorch LayerNorm in the activation dtype (fp32 statistics inside ATen), as HF's nn.LayerNorm."""
    w = None if weight is None else weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def residual_layer_norm_torch(x: torch.Tensor, delta: torch.Tensor, weight, bias, eps: float):
    """Plain PyTorch residual + LayerNorm: ``s = x + delta`` (rounded to dtype), returns ``(s, LN(s))``."""
    s = x + delta
    return s, layer_norm_torch(s, weight, bias, eps)
