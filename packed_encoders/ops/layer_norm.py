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


def layer_norm_torch(x: torch.Tensor, weight, bias, eps: float,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain PyTorch LayerNorm in the activation dtype (fp32 statistics inside ATen), as HF's nn.LayerNorm;
    ``out_dtype``: the result cast to it (``None``: as ``F.layer_norm`` returns it)."""
    w = None if weight is None else weight.to(x.dtype)
    b = None if bias is None else bias.to(x.dtype)
    y = F.layer_norm(x, (x.shape[-1],), w, b, eps)
    return y if out_dtype is None else y.to(out_dtype)


def residual_layer_norm_torch(x: torch.Tensor, delta: torch.Tensor, weight, bias, eps: float,
                              out_dtype: torch.dtype | None = None):
    """Plain PyTorch residual + LayerNorm: ``s = x + delta`` (rounded to dtype), returns ``(s, LN(s))``."""
    s = x + delta
    return s, layer_norm_torch(s, weight, bias, eps, out_dtype)


def layer_norm_fwd_torch(x: torch.Tensor, delta: torch.Tensor | None, weight, bias, eps: float,
                         out_dtype: torch.dtype, res_dtype: torch.dtype | None = None):
    """Plain PyTorch twin of the Triton forward (``ops.triton.layer_norm.forward``): ``(s, y, mean, rstd)`` with
    ``s = x + delta`` rounded to ``res_dtype`` (``None`` without ``delta``), statistics in fp32 on it, ``y`` rounded
    once to ``out_dtype``; ``mean, rstd`` fp32 ``[T]`` for :func:`layer_norm_bwd_torch`."""
    s = None
    if delta is not None:
        s = (x.float() + delta.float()).to(res_dtype)
        x = s
    xf = x.float()
    mean = xf.mean(-1)
    xc = xf - mean[:, None]
    rstd = torch.rsqrt(xc.square().mean(-1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return s, y.to(out_dtype), mean, rstd


def layer_norm_bwd_torch(dy: torch.Tensor, x: torch.Tensor, weight, mean: torch.Tensor, rstd: torch.Tensor,
                         dres: torch.Tensor | None, has_bias: bool, dx_dtype: torch.dtype,
                         dx2_dtype: torch.dtype | None, reduce: bool = True):
    """Plain PyTorch twin of the Triton backward: ``(dx, dx2, dw, db)`` given the normalised input ``x``, with the
    residual's gradient ``dres`` added into ``dx`` (and ``dx`` written again in ``dx2_dtype``); fp32 maths,
    ``dw``/``db`` fp32 ``[H]`` or ``None`` (``reduce=False``: ``[1, H]``, partial sums that add up to them)."""
    xhat = (x.float() - mean[:, None]) * rstd[:, None]
    dyf = dy.float()
    wdy = dyf * weight.float() if weight is not None else dyf
    n = x.shape[-1]
    c1 = (xhat * wdy).sum(-1, keepdim=True) / n
    c2 = wdy.sum(-1, keepdim=True) / n
    dx = (wdy - (xhat * c1 + c2)) * rstd[:, None]
    if dres is not None:
        dx = dx + dres.float()
    dw = (dyf * xhat).sum(0, keepdim=not reduce) if weight is not None else None
    db = dyf.sum(0, keepdim=not reduce) if has_bias else None
    return dx.to(dx_dtype), None if dx2_dtype is None else dx.to(dx2_dtype), dw, db
