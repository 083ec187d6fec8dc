"""The ``triton`` op set: Triton kernels as ``torch.library`` custom ops, routed per call.

Each kernel launch is a custom op in the ``packed_encoders`` namespace with a fake (meta)
implementation, so ``torch.compile`` and CUDA-graph capture see one opaque node per op (forward and
backward alike). LayerNorm, residual + LayerNorm and the GLU get their gradients through
``torch.library.register_autograd``. RoPE is the exception: its ``v`` output is a view of the ``qkv``
input (no copy), which a custom op may not return, so a small ``autograd.Function`` calls the forward
op, hands out the view, and its backward calls one op that writes the whole ``dqkv`` (with ``dv``
copied in) instead of letting autograd add a zero-padded ``dv`` scatter to it.

Routing: every public op checks, per call, that the kernels cover the inputs (CUDA tensors, or CPU
tensors when interpreted, see ``triton/_runtime.py``; fp32/bf16/fp16; a hidden size within the kernel's limit; a
known activation). Anything else runs the plain PyTorch op and is recorded in :func:`fallbacks`.

Importing this module imports Triton (``select_ops`` imports it only when asked for fused kernels).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..errors import SECOND_DERIVATIVE
from . import FusedOpSet, Kernels, OpSet, RouteLog
from .geglu import geglu_ref, geglu_torch
from .layer_norm import layer_norm_ref, layer_norm_torch, residual_layer_norm_torch
from .rope import rope_qkv_torch
from .triton import GLU_LINEAR_MAX_TOKENS
from .triton import glu as _glu
from .triton import layer_norm as _ln
from .triton import lora_merge as _lora_merge
from .triton import rope as _rope
from .triton import small_gemm as _small_gemm
from .triton._runtime import interpreter_unavailable

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_EMPTY = (0,)

# ---------------------------------------------------------------------------------------------------------
# custom ops: LayerNorm and residual + LayerNorm


@torch.library.custom_op("packed_encoders::triton_layer_norm_fwd", mutates_args=())
def _ln_fwd(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    _, y, mean, rstd = _ln.forward(x, None, weight, bias, eps, out_dtype)
    return y, mean, rstd


@_ln_fwd.register_fake
def _(x, weight, bias, eps, out_dtype):
    t = x.shape[0]
    return x.new_empty(x.shape, dtype=out_dtype), x.new_empty((t,), dtype=torch.float32), \
        x.new_empty((t,), dtype=torch.float32)


@torch.library.custom_op("packed_encoders::triton_residual_layer_norm_fwd", mutates_args=())
def _res_ln_fwd(x: Tensor, delta: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
                res_dtype: torch.dtype, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    s, y, mean, rstd = _ln.forward(x, delta, weight, bias, eps, out_dtype, res_dtype)
    return s, y, mean, rstd


@_res_ln_fwd.register_fake
def _(x, delta, weight, bias, eps, res_dtype, out_dtype):
    t = x.shape[0]
    return (x.new_empty(x.shape, dtype=res_dtype), x.new_empty(x.shape, dtype=out_dtype),
            x.new_empty((t,), dtype=torch.float32), x.new_empty((t,), dtype=torch.float32))


@torch.library.custom_op("packed_encoders::triton_layer_norm_bwd", mutates_args=())
def _ln_bwd(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor, dres: Optional[Tensor],
            has_bias: bool, dx_dtype: torch.dtype, dx2_dtype: torch.dtype,
            want_dx2: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(dx, dx2, dw, db)``; absent outputs (no second dtype, no weight, no bias) are empty
    ``[0]`` tensors, since a custom op cannot return ``None``."""
    dx, dx2, dw, db = _ln.backward(dy, x, weight, mean, rstd, dres, has_bias, dx_dtype,
                                   dx2_dtype if want_dx2 else None)
    empty = x.new_empty(_EMPTY, dtype=torch.float32)
    return dx, dx2 if dx2 is not None else x.new_empty(_EMPTY, dtype=dx2_dtype), \
        dw if dw is not None else empty, db if db is not None else empty.clone()


@_ln_bwd.register_fake
def _(dy, x, weight, mean, rstd, dres, has_bias, dx_dtype, dx2_dtype, want_dx2):
    h = x.shape[-1]
    return (x.new_empty(x.shape, dtype=dx_dtype),
            x.new_empty(x.shape if want_dx2 else _EMPTY, dtype=dx2_dtype),
            x.new_empty((h,) if weight is not None else _EMPTY, dtype=torch.float32),
            x.new_empty((h,) if has_bias else _EMPTY, dtype=torch.float32))


def _param_grads(ctx, dw, db, w_index, b_index):
    dw = dw.to(ctx.w_dtype) if ctx.w_dtype is not None and ctx.needs_input_grad[w_index] else None
    db = db.to(ctx.b_dtype) if ctx.b_dtype is not None and ctx.needs_input_grad[b_index] else None
    return dw, db


def _ln_setup(ctx, inputs, output):
    x, weight, bias, _, _ = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.w_dtype = None if weight is None else weight.dtype
    ctx.b_dtype = None if bias is None else bias.dtype


def _ln_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, _, dw, db = _ln_bwd(dy, x, weight, mean, rstd, None, ctx.b_dtype is not None, x.dtype, x.dtype, False)
    dw, db = _param_grads(ctx, dw, db, 1, 2)
    return dx, dw, db, None, None


_ln_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)


def _res_ln_setup(ctx, inputs, output):
    x, delta, weight, bias, _, _, _ = inputs
    s, _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(s, weight, mean, rstd)  # s is an output: saved, never written again
    ctx.x_dtype, ctx.d_dtype = x.dtype, delta.dtype
    ctx.w_dtype = None if weight is None else weight.dtype
    ctx.b_dtype = None if bias is None else bias.dtype


def _res_ln_backward(ctx, ds, dy, _dmean, _drstd):
    s, weight, mean, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    two = ctx.x_dtype != ctx.d_dtype
    dx, dx2, dw, db = _ln_bwd(dy, s, weight, mean, rstd, ds, ctx.b_dtype is not None, ctx.x_dtype, ctx.d_dtype, two)
    dw, db = _param_grads(ctx, dw, db, 2, 3)
    # s = x + delta: both inputs receive the same gradient (in their own dtypes)
    return dx, dx2 if two else dx, dw, db, None, None, None


_res_ln_fwd.register_autograd(_res_ln_backward, setup_context=_res_ln_setup)

# ---------------------------------------------------------------------------------------------------------
# custom ops: RoPE


@torch.library.custom_op("packed_encoders::triton_rope_qk_fwd", mutates_args=())
def _rope_fwd(qkv: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, num_heads: int,
              head_dim: int) -> tuple[Tensor, Tensor]:
    return _rope.forward(qkv, cos, sin, position_ids, num_heads, head_dim)


@_rope_fwd.register_fake
def _(qkv, cos, sin, position_ids, num_heads, head_dim):
    shape = (qkv.shape[0], num_heads, head_dim)
    return qkv.new_empty(shape), qkv.new_empty(shape)


@torch.library.custom_op("packed_encoders::triton_rope_qkv_bwd", mutates_args=())
def _rope_bwd(dq: Tensor, dk: Tensor, dv: Optional[Tensor], cos: Tensor, sin: Tensor, position_ids: Tensor,
              num_heads: int, head_dim: int, dtype: torch.dtype) -> Tensor:
    return _rope.backward(dq, dk, dv, cos, sin, position_ids, num_heads, head_dim, dtype)


@_rope_bwd.register_fake
def _(dq, dk, dv, cos, sin, position_ids, num_heads, head_dim, dtype):
    return dq.new_empty((dq.shape[0], 3 * num_heads * head_dim), dtype=dtype)


def _v_view(qkv: Tensor, num_heads: int, head_dim: int) -> Tensor:
    return qkv.view(qkv.shape[0], 3, num_heads, head_dim)[:, 2]


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, position_ids, num_heads, head_dim):
        q, k = _rope_fwd(qkv, cos, sin, position_ids, num_heads, head_dim)
        ctx.save_for_backward(cos, sin, position_ids)
        ctx.shape = (num_heads, head_dim, qkv.dtype)
        return q, k, _v_view(qkv, num_heads, head_dim)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin, position_ids = ctx.saved_tensors
        num_heads, head_dim, dtype = ctx.shape
        return _rope_bwd(dq, dk, dv, cos, sin, position_ids, num_heads, head_dim, dtype), None, None, None, None, None

# ---------------------------------------------------------------------------------------------------------
# custom ops: GLU


@torch.library.custom_op("packed_encoders::triton_glu_fwd", mutates_args=())
def _glu_fwd(x: Tensor, activation: str) -> Tensor:
    return _glu.forward(x, activation)


@_glu_fwd.register_fake
def _(x, activation):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@torch.library.custom_op("packed_encoders::triton_glu_bwd", mutates_args=())
def _glu_bwd(dy: Tensor, x: Tensor, activation: str) -> Tensor:
    return _glu.backward(dy, x, activation)


@_glu_bwd.register_fake
def _(dy, x, activation):
    return torch.empty_like(x)


def _glu_setup(ctx, inputs, output):
    x, activation = inputs
    ctx.save_for_backward(x)
    ctx.activation = activation


def _glu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _glu_bwd(dy, x, ctx.activation), None


_glu_fwd.register_autograd(_glu_backward, setup_context=_glu_setup)


def _no_second_derivative(ctx, *grads):
    raise RuntimeError(SECOND_DERIVATIVE)


def _nothing_to_keep(ctx, inputs, output) -> None:
    pass


# The backward ops run inside the forward ops' backward formulas; under create_graph=True autograd records them,
# and differentiating again must name the way out, not torch's "no autograd formula was registered"
for _bwd in (_ln_bwd, _rope_bwd, _glu_bwd):
    _bwd.register_autograd(_no_second_derivative, setup_context=_nothing_to_keep)
del _bwd

# ---------------------------------------------------------------------------------------------------------
# routing


_LOG = RouteLog()
_record = _LOG.record


def fallbacks() -> dict[str, dict[str, int]]:
    """``{op: {reason: calls}}`` of calls routed to plain PyTorch since import (or :func:`reset_fallbacks`)."""
    return _LOG.snapshot()


def reset_fallbacks() -> None:
    _LOG.clear()


def _unsupported(x: Tensor, *others: Tensor | None) -> str | None:
    """Why the kernels cannot take these tensors (``None`` when they can)."""
    if x.device.type == "cpu":
        why = interpreter_unavailable()
        if why:
            return f"CPU tensors (Triton kernels run on CUDA; not interpreting: {why})"
    elif x.device.type != "cuda":
        return f"{x.device.type} tensors"
    for t in (x, *others):
        if t is None:
            continue
        if t.dtype not in _FLOATS:
            return f"dtype {t.dtype} (kernels take float32, bfloat16, float16)"
        if t.device != x.device:
            return "inputs on different devices"
    if x.dtype == torch.float32 and x.device.type == "cuda" and not torch.is_autocast_enabled("cuda"):
        # fp32 models outside autocast keep plain-torch numerics (validate's 1e-4 relative-error bar);
        # the kernels serve half-precision models and autocast, where the fp32 residual stream meets them.
        return "fp32 activations outside autocast (plain torch keeps fp32 parity)"
    return None


def _ln_unsupported(x: Tensor, delta: Tensor | None, weight: Tensor | None, bias: Tensor | None) -> str | None:
    why = _unsupported(x, delta, weight, bias)
    if why:
        return why
    h = x.shape[-1]
    if h > _ln.MAX_HIDDEN or h == 0:
        return f"hidden size {h} (kernel covers 1..{_ln.MAX_HIDDEN})"
    if delta is not None and delta.shape != x.shape:
        return "residual and delta shapes differ"
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (h,):
            return f"{name} of shape {tuple(p.shape)}"
    return None


def _norm_out_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    # Under CUDA autocast F.layer_norm runs in fp32 and returns fp32 (it is on autocast's fp32 list);
    # CPU autocast leaves it in the input dtype. Mirror that so the two op sets agree on dtypes.
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled("cuda"):
        return torch.float32
    return dtype


def _direct(*tensors: Tensor | None) -> bool:
    """Launch the Triton kernel without the custom-op dispatcher: eager calls with nothing to differentiate.

    The dispatcher and autograd wrapper cost tens of microseconds per call, paid ~90 times per ModernBERT-base
    forward; a batch of short documents is host-bound. Under ``torch.compile`` the custom op stays opaque."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """LayerNorm over the last dim of ``x`` ``[..., H]``; output in ``out_dtype``, by default ``x.dtype`` (fp32
    under CUDA autocast)."""
    why = _ln_unsupported(x, None, weight, bias)
    if why:
        _record("layer_norm", why)
        return layer_norm_torch(x, weight, bias, eps, out_dtype)
    shape = x.shape
    out_dtype = out_dtype or _norm_out_dtype(x.dtype, x.device)
    if _direct(x, weight, bias):
        _, y, _, _ = _ln.forward(x.reshape(-1, shape[-1]), None, weight, bias, float(eps), out_dtype)
    else:
        y, _, _ = _ln_fwd(x.reshape(-1, shape[-1]), weight, bias, float(eps), out_dtype)
    return y.view(shape)


def residual_layer_norm(x: Tensor, delta: Tensor, weight: Tensor | None, bias: Tensor | None,
                        eps: float, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(s, LN(s))`` with ``s = x + delta`` rounded to ``promote_types(x, delta)`` first (the policy); ``LN(s)``
    in ``out_dtype`` (default: as :func:`layer_norm`'s)."""
    why = _ln_unsupported(x, delta, weight, bias)
    if why:
        _record("residual_layer_norm", why)
        return residual_layer_norm_torch(x, delta, weight, bias, eps, out_dtype)
    shape = x.shape
    res_dtype = torch.promote_types(x.dtype, delta.dtype)
    out_dtype = out_dtype or _norm_out_dtype(res_dtype, x.device)
    if _direct(x, delta, weight, bias):
        s, y, _, _ = _ln.forward(x.reshape(-1, shape[-1]), delta.reshape(-1, shape[-1]), weight, bias, float(eps),
                                 out_dtype, res_dtype)
    else:
        s, y, _, _ = _res_ln_fwd(x.reshape(-1, shape[-1]), delta.reshape(-1, shape[-1]), weight, bias, float(eps),
                                 res_dtype, out_dtype)
    return s.view(shape), y.view(shape)


def rope_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, num_heads: int, head_dim: int):
    """``q, k, v`` ``[T, nh, hd]`` from ``qkv`` ``[T, 3 * nh * hd]``: q, k rotated (contiguous, ``qkv.dtype``),
    v a strided view of ``qkv``. Same contract as :func:`packed_encoders.ops.rope.rope_qkv_torch`."""
    why = _unsupported(qkv, cos, sin)
    if not why:
        if head_dim % 2 or not 2 <= head_dim <= 512:
            why = f"head_dim {head_dim} (kernel covers even sizes 2..512)"
        elif qkv.dim() != 2 or qkv.shape[-1] != 3 * num_heads * head_dim:
            why = f"qkv of shape {tuple(qkv.shape)}"
        elif cos.shape[-1] != head_dim // 2 or cos.shape != sin.shape:
            why = "cos/sin tables of another head_dim"
        elif position_ids.dtype not in (torch.int64, torch.int32) or position_ids.device != qkv.device:
            why = "position_ids must be int32/int64 on the qkv device"
    if why:
        _record("rope_qkv", why)
        return rope_qkv_torch(qkv, cos, sin, position_ids, num_heads, head_dim)
    qkv = qkv.contiguous()
    if torch.is_grad_enabled() and qkv.requires_grad:
        return _Rope.apply(qkv, cos, sin, position_ids, num_heads, head_dim)
    rope_fwd = _rope.forward if _direct(qkv) else _rope_fwd
    q, k = rope_fwd(qkv, cos, sin, position_ids, num_heads, head_dim)
    return q, k, _v_view(qkv, num_heads, head_dim)


def glu(x: Tensor, activation: str = "gelu") -> Tensor:
    """``act(a) * g`` for ``x = [a | g]`` ``[..., 2I]`` -> ``[..., I]`` in ``x.dtype``."""
    why = _unsupported(x)
    if not why:
        if activation not in _glu.ACTIVATIONS:
            why = f"activation {activation!r}"
        elif x.shape[-1] % 2:
            why = f"odd last dim {x.shape[-1]}"
    if why:
        _record("glu", why)
        return geglu_torch(x, activation)
    shape = x.shape
    y = (_glu.forward if _direct(x) else _glu_fwd)(x.reshape(-1, shape[-1]), activation)
    return y.view(*shape[:-1], shape[-1] // 2)


@torch.library.custom_op("packed_encoders::triton_glu_linear", mutates_args=())
def _glu_linear_op(x: Tensor, weight: Tensor, bias: Optional[Tensor], activation: str) -> Tensor:
    return _small_gemm.glu_linear(x, weight, bias, activation)


@_glu_linear_op.register_fake
def _(x, weight, bias, activation):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


def glu_linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "gelu") -> Tensor:
    """``act(x @ W[:I].T + b[:I]) * (x @ W[I:].T + b[I:])`` ``[T, I]`` for ``x`` ``[T, K]`` and HF's ``Wi``
    weight ``[2I, K]`` (read in place), forward only: with gradient, above :data:`GLU_LINEAR_MAX_TOKENS`
    tokens (where cuBLAS + the GLU kernel is faster) or outside the kernel's cover it is ``F.linear`` then
    :func:`glu` (the last case recorded as a fallback)."""
    t = x.shape[0] if x.dim() == 2 else 0
    if not 0 < t <= GLU_LINEAR_MAX_TOKENS or (torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))):
        return glu(torch.nn.functional.linear(x, weight, bias), activation)
    why = _unsupported(x, weight, bias)
    if not why:
        if activation not in _glu.ACTIVATIONS:
            why = f"activation {activation!r}"
        elif weight.dim() != 2 or weight.shape[0] % 2 or weight.shape[1] != x.shape[1]:
            why = f"Wi weight of shape {tuple(weight.shape)} for x {tuple(x.shape)}"
        elif weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
            why = f"mixed dtypes (x {x.dtype}, weight {weight.dtype})"
    if why:
        _record("glu_linear", why)
        return glu(torch.nn.functional.linear(x, weight, bias), activation)
    return (_small_gemm.glu_linear if _direct(x) else _glu_linear_op)(x, weight, bias, activation)


# ---------------------------------------------------------------------------------------------------------
# toolchain check


def smoke(device) -> None:
    """Compile and run two tiny kernels (LayerNorm, GLU) on ``device`` and check them against the fp32
    references. Raises ``RuntimeError`` when the kernels cannot run there or disagree."""
    device = torch.device(device)
    # A half-precision probe: fp32 outside autocast routes to plain torch by policy, not for lack of kernels.
    probe = torch.empty(0, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    why = _unsupported(probe)
    if why:
        raise RuntimeError(f"Triton kernels cannot run on {device}: {why}")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(device)
    w = torch.randn(96, generator=g).to(device)
    y, _, _ = _ln_fwd(x, w, None, 1e-5, x.dtype)
    err = (y - layer_norm_ref(x, w, None, 1e-5)).abs().max().item()
    z = torch.randn(5, 2 * 40, generator=g).to(device)
    err = max(err, (_glu_fwd(z, "gelu") - geglu_ref(z, "gelu")).abs().max().item())
    if not err < 1e-4:
        raise RuntimeError(f"Triton smoke test on {device}: max error {err:.3g} against the fp32 reference")


# ---------------------------------------------------------------------------------------------------------
# unchecked launches: the forward checked the whole call once (``covers``), so no per-op routing


def covers(device: torch.device, dtype: torch.dtype, hidden: int, num_heads: int, head_dim: int,
           activation: str) -> str | None:
    """Why the kernels cannot run a whole no-grad forward of these facts (``None`` when every op can): the
    per-op checks of :func:`layer_norm` ... :func:`glu` asked once for the whole call. Activations are produced
    by the forward itself (contiguous ``[T, ...]`` on one device), so these facts decide every per-op check."""
    if device.type == "cpu":
        why = interpreter_unavailable()
        if why:
            return f"CPU tensors (Triton kernels run on CUDA; not interpreting: {why})"
    elif device.type != "cuda":
        return f"{device.type} tensors"
    if dtype not in _FLOATS:
        return f"dtype {dtype} (kernels take float32, bfloat16, float16)"
    if dtype == torch.float32 and device.type == "cuda" and not torch.is_autocast_enabled("cuda"):
        return "fp32 activations outside autocast (plain torch keeps fp32 parity)"
    if not 0 < hidden <= _ln.MAX_HIDDEN:
        return f"hidden size {hidden} (kernel covers 1..{_ln.MAX_HIDDEN})"
    if head_dim % 2 or not 2 <= head_dim <= 512:
        return f"head_dim {head_dim} (kernel covers even sizes 2..512)"
    if activation not in _glu.ACTIVATIONS:
        return f"activation {activation!r}"
    return None


def _into(out: Tensor | None, x: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``out`` when the kernel can write the normed ``x`` there (same shape, ``dtype``, contiguous), else ``None``."""
    if out is None or out.dtype != dtype or out.shape != x.shape or not out.is_contiguous():
        return None
    return out


def _layer_norm_direct(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                       out: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    dtype = out_dtype or _norm_out_dtype(x.dtype, x.device)
    return _ln.forward(x, None, weight, bias, eps, dtype, stats=False, out=_into(out, x, dtype))[1]


def _residual_layer_norm_direct(x: Tensor, delta: Tensor, weight: Tensor | None, bias: Tensor | None,
                                eps: float, out: Tensor | None = None,
                                out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    res_dtype = x.dtype if x.dtype is delta.dtype else torch.promote_types(x.dtype, delta.dtype)
    dtype = out_dtype or _norm_out_dtype(res_dtype, x.device)
    s, y, _, _ = _ln.forward(x, delta, weight, bias, eps, dtype, res_dtype, stats=False, out=_into(out, x, dtype))
    return s, y


def _residual_layer_norm_in_place(x: Tensor, delta: Tensor, weight: Tensor | None, bias: Tensor | None,
                                  eps: float, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    # the residual sum written over x (each program reads its rows before writing them): one allocation fewer per
    # norm, for the packed forward, which owns x (see OpSet.residual_in_place)
    if (x.dtype is not delta.dtype and torch.promote_types(x.dtype, delta.dtype) is not x.dtype
            or not x.is_contiguous()):
        return _residual_layer_norm_direct(x, delta, weight, bias, eps, out_dtype=out_dtype)
    dtype = out_dtype or _norm_out_dtype(x.dtype, x.device)
    _, y, _, _ = _ln.forward(x, delta, weight, bias, eps, dtype, x.dtype, stats=False, residual_out=x)
    return x, y


def _rope_qkv_direct(qkv: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, num_heads: int, head_dim: int):
    # forward only: the projection's output is the caller's temporary, so q and k rotate inside it (no allocation),
    # and its v's non-finite entries are zeroed there (DIRECT_OPS.rope_finite_v)
    qkv = qkv.contiguous()
    q, k = _rope.forward(qkv, cos, sin, position_ids, num_heads, head_dim, inplace=True)
    return q, k, _v_view(qkv, num_heads, head_dim)


def _rope_fwd_in_place(qkv: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, num_heads: int, head_dim: int):
    return _rope.forward(qkv, cos, sin, position_ids, num_heads, head_dim, inplace=True)


def _glu_linear_direct(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str = "gelu") -> Tensor:
    # the plan sizes the calls routed here (model/plan.py: Rules.glu_gemm_max_tokens, small_linear_max_tokens);
    # mixed dtypes (an fp32 weight outside autocast) go to cuBLAS
    if weight.dtype is x.dtype and (bias is None or bias.dtype is x.dtype):
        return _small_gemm.glu_linear_unchecked(x, weight, bias, activation)
    return _glu.forward(torch.nn.functional.linear(x, weight, bias), activation)


def _linear_direct(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    # the plan routes here only eager calls of at most Rules.small_linear_max_tokens tokens (host-bound: a Triton
    # launch costs less host time than F.linear's dispatch); mixed dtypes go to F.linear
    if weight.dtype is x.dtype and (bias is None or bias.dtype is x.dtype):
        return _small_gemm.linear_unchecked(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def lora_merge(weight: Tensor, a: Tensor, b: Tensor, scale: float, dtype: torch.dtype) -> Tensor | None:
    """:attr:`OpSet.lora_merge`: the Triton merge (:func:`.triton.lora_merge.merge`) for a half-precision result
    where the kernels take the operands, else ``None`` (fp32 results keep the torch ops, as the other ops do)."""
    if dtype is torch.float32 or _unsupported(weight, a, b) is not None or not _lora_merge.takes(weight, a, dtype):
        return None
    return _lora_merge.merge(weight, a, b, scale, dtype)


DIRECT_OPS = OpSet("triton", _layer_norm_direct, _residual_layer_norm_direct, _rope_qkv_direct, _glu.forward,
                   _glu_linear_direct, linear=_linear_direct, norm_out=True, rope_finite_v=True,
                   residual_in_place=_residual_layer_norm_in_place, pointers=True)

TRITON_KERNELS = Kernels("triton", _ln.forward, _ln.backward, _rope_fwd_in_place, _rope.backward, _glu.forward,
                         _glu.backward, rope_finite_v=True)

TRITON_OPS = FusedOpSet("triton", layer_norm, residual_layer_norm, rope_qkv, glu, glu_linear, smoke=smoke,
                        fallbacks=fallbacks, direct=DIRECT_OPS, covers=covers, kernels=TRITON_KERNELS,
                        lora_merge=lora_merge)

__all__ = ["TRITON_OPS", "fallbacks", "glu", "glu_linear", "layer_norm", "lora_merge", "reset_fallbacks",
           "residual_layer_norm", "rope_qkv", "smoke"]
