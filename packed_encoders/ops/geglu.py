"""Gated linear unit of ModernBERT's MLP: ``act(a) * g`` with ``a, g = Wi(x).chunk(2, -1)``.

``activation`` is ``"gelu"`` (exact erf), ``"gelu_tanh"`` (tanh approximation), ``"silu"`` or ``"relu"``,
as mapped from HF's ``hidden_activation`` by :class:`~packed_encoders.model.params.ModernBertParams`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _act(a: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(a)
    if activation == "gelu_tanh":
        return F.gelu(a, approximate="tanh")
    if activation == "silu":
        return F.silu(a)
    if activation == "relu":
        return F.relu(a)
    raise ValueError(f"unknown GLU activation {activation!r}")


def geglu_ref(x: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    """fp32 specification. ``x``: ``[T, 2I]`` -> ``[T, I]`` fp32."""
    a, g = x.float().chunk(2, dim=-1)
    return _act(a, activation) * g


def geglu_torch(x: torch.Tensor, activation: str = "gelu") -> torch.Tensor:
    """Plain PyTorch GLU in the activation dtype, rounding like HF's ``act(input) * gate``."""
    a, g = x.chunk(2, dim=-1)
    return _act(a, activation) * g


def glu_bwd_torch(dy: torch.Tensor, x: torch.Tensor, activation: str = "gelu", forward_out: bool = False):
    """Gradient of :func:`geglu_torch` with respect to ``x = [a | g]`` ``[T, 2I]`` given ``dy`` ``[T, I]``, in fp32
    maths (as the Triton backward), returned in ``x.dtype``; ``forward_out``: ``(dx, geglu_torch(x))``."""
    if forward_out:
        return glu_bwd_torch(dy, x, activation), geglu_torch(x, activation)
    a, g = x.float().chunk(2, dim=-1)
    with torch.enable_grad():
        a = a.detach().requires_grad_()
        act = _act(a, activation)
        (dact,) = torch.autograd.grad(act, a, torch.ones_like(act))
    dyf = dy.float()
    return torch.cat((dyf * g * dact, dyf * act.detach()), dim=-1).to(x.dtype)
