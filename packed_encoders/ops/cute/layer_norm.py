"""quack's CuteDSL LayerNorm (forward and backward) as ``torch.library`` custom ops.

Uses only quack's public ``quack.rmsnorm.layernorm_fwd`` / ``layernorm_bwd``. They take fp32 weight
and bias, so both are cast per call (an ``[H]`` copy; a no-op for fp32 parameters) and the fp32 weight
gradients are cast back to the parameters' dtypes. quack compiles one kernel per (dtype, H) with the
token count symbolic, so no recompiles across batch shapes.

Residual + LayerNorm is ``s = x + delta`` (a plain add, rounded to the stream dtype: the package's
rounding policy) followed by this LayerNorm on ``s``. quack's fused residual path normalises the fp32 sum
before rounding it, a different policy, and it is not public API, so it is not used.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


@torch.library.custom_op("packed_encoders::cute_layer_norm_fwd", mutates_args=(), device_types="cuda")
def _fwd(x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    from quack.rmsnorm import layernorm_fwd

    x = x.contiguous()
    if x.shape[0] == 0:
        empty = x.new_empty((0,), dtype=torch.float32)
        return torch.empty_like(x), empty, empty.clone()
    out, rstd, mean = layernorm_fwd(x, weight.float(), None if bias is None else bias.float(), eps,
                                    return_rstd=True, return_mean=True)
    return out, mean, rstd


@_fwd.register_fake
def _(x, weight, bias, eps):
    t = x.shape[0]
    return torch.empty_like(x), x.new_empty((t,), dtype=torch.float32), x.new_empty((t,), dtype=torch.float32)


@torch.library.custom_op("packed_encoders::cute_layer_norm_bwd", mutates_args=(), device_types="cuda")
def _bwd(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor,
         has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    from quack.rmsnorm import layernorm_bwd

    h = x.shape[-1]
    if x.shape[0] == 0:
        zeros = x.new_zeros((h,), dtype=torch.float32)
        return torch.empty_like(x), zeros, zeros.clone() if has_bias else x.new_empty((0,), dtype=torch.float32)
    dx, dw, db = layernorm_bwd(x.contiguous(), weight.float(), dy.contiguous(), rstd, mean, has_bias)
    db = db.float() if db is not None else x.new_empty((0,), dtype=torch.float32)
    return dx, dw.float(), db


@_bwd.register_fake
def _(dy, x, weight, mean, rstd, has_bias):
    h = x.shape[-1]
    return (torch.empty_like(x), x.new_empty((h,), dtype=torch.float32),
            x.new_empty((h,) if has_bias else (0,), dtype=torch.float32))


def _setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.b_dtype = None if bias is None else bias.dtype


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = _bwd(dy, x, weight, mean, rstd, ctx.b_dtype is not None)
    dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
    db = db.to(ctx.b_dtype) if ctx.b_dtype is not None and ctx.needs_input_grad[2] else None
    return dx, dw, db, None


_fwd.register_autograd(_backward, setup_context=_setup)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """quack LayerNorm of ``x`` ``[T, H]`` (CUDA, fp32/bf16/fp16, weight required); output in ``x.dtype``."""
    y, _, _ = _fwd(x, weight, bias, float(eps))
    return y
