"""Triton gated linear unit ``act(a) * g`` over ``x = [a | g]`` ``[T, 2I]``, forward and backward.

All math in fp32 from the stored inputs; each output is rounded once (the plain PyTorch op rounds
``act(a)`` to the activation dtype before the product). Activations (compile-time): exact erf GELU,
tanh GELU, SiLU, ReLU. ``I`` is a compile-time constant; the token count is a runtime argument.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ._runtime import I32_END, cdiv, kernel, launch_cached, next_pow2

ACTIVATIONS = {"gelu": 0, "gelu_tanh": 1, "silu": 2, "relu": 3}
# launch signature -> _runtime.Bound (launches that skip Triton's per-argument key; see _runtime.launch_cached)
_FWD_BOUND: dict = {}
_BWD_BOUND: dict = {}

# kernels may only read globals declared as Triton constexprs, and a product takes them after a tensor: interpreted,
# ``C * a`` is plain Python, whose ``constexpr.__mul__`` wraps the tensor product in a constexpr that Triton 3.9's
# builtins refuse ("cannot convert ... to tensor"); compiled, either order is the same multiply
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_TANH_C = tl.constexpr(0.044715)


@functools.lru_cache(maxsize=None)
def config(inner: int) -> tuple[int, int, int]:
    """``(BLOCK_T, BLOCK_I, num_warps)``: tiles of about 4096 outputs; ``BLOCK_I`` is the widest power of two
    whose column blocks waste at most 1/16 of their lanes on ``I`` (ModernBERT-base's 1152 -> 128)."""
    block_i = 64
    for cand in (1024, 512, 256, 128):
        if cand <= 2 * next_pow2(inner) and cdiv(inner, cand) * cand * 16 <= inner * 17:
            block_i = cand
            break
    block_i = min(block_i, next_pow2(inner))
    block_t = max(1, 4096 // block_i)
    return block_t, block_i, 8 if block_t * block_i >= 4096 else 4


@kernel(do_not_specialize=("n_rows",))
def _glu_fwd_kernel(X, Y, n_rows, I: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, ACT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    src = X + r64 * (2 * I) + cols[None, :]
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = 0.5 * a * (1.0 + tl.math.erf(a * _SQRT1_2))
    elif ACT == 1:
        t = 2.0 * tl.sigmoid((a + a * _TANH_C * a * a) * (2.0 * _SQRT_2_OVER_PI)) - 1.0  # tanh
        act = 0.5 * a * (1.0 + t)
    elif ACT == 2:
        act = a * tl.sigmoid(a)
    else:
        act = tl.maximum(a, 0.0)
    tl.store(Y + r64 * I + cols[None, :], (act * g).to(Y.dtype.element_ty), mask=mask)


@kernel(do_not_specialize=("n_rows",))
def _glu_bwd_kernel(DY, X, DX, Y, n_rows, I: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr,
                    ACT: tl.constexpr, HAS_Y: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < n_rows)[:, None] & (cols < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    src = X + r64 * (2 * I) + cols[None, :]
    a = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(src + I, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + r64 * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        cdf = 0.5 * (1.0 + tl.math.erf(a * _SQRT1_2))
        act = a * cdf
        dact = cdf + a * _INV_SQRT_2PI * tl.exp(-0.5 * a * a)
    elif ACT == 1:
        t = 2.0 * tl.sigmoid((a + a * _TANH_C * a * a) * (2.0 * _SQRT_2_OVER_PI)) - 1.0
        act = 0.5 * a * (1.0 + t)
        dact = 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + a * (3.0 * _TANH_C) * a)
    elif ACT == 2:
        sig = tl.sigmoid(a)
        act = a * sig
        dact = sig * (1.0 + a * (1.0 - sig))
    else:
        act = tl.maximum(a, 0.0)
        dact = tl.where(a > 0.0, 1.0, 0.0)
    tl.store(DX + r64 * (2 * I) + cols[None, :], (dy * g * dact).to(DX.dtype.element_ty), mask=mask)
    tl.store(DX + r64 * (2 * I) + I + cols[None, :], (dy * act).to(DX.dtype.element_ty), mask=mask)
    if HAS_Y:  # the forward's output again: act is computed as the forward computes it, so the bits are the same
        tl.store(Y + r64 * I + cols[None, :], (act * g).to(Y.dtype.element_ty), mask=mask)


def _forward_signature(dtype, inner: int, act: int, t: int, pointers: int) -> tuple:
    # what the forward kernel's compiled specialisation depends on: dtype, the constexprs, then t's 32-bit range (it
    # is not specialised) and whether every pointer (or-ed together) is 16-byte aligned
    bt, bi, warps = config(inner)
    return (dtype, inner, bt, bi, warps, act, t < I32_END, not pointers & 15)


def forward(x: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(x[:, :I]) * x[:, I:]`` ``[T, I]`` in ``x.dtype`` for ``x`` ``[T, 2I]``."""
    t, two_i = x.shape
    inner = two_i // 2
    x = x.contiguous()
    y = torch.empty((t, inner), dtype=x.dtype, device=x.device)
    if t == 0 or inner == 0:
        return y
    bt, bi, warps = config(inner)
    act = ACTIVATIONS[activation]
    fast = sig = None
    if x.is_cuda:
        fast = (x.data_ptr(), y.data_ptr(), t)
        sig = _forward_signature(x.dtype, inner, act, t, fast[0] | fast[1])
    launch_cached(_FWD_BOUND, sig, _glu_fwd_kernel, x, (cdiv(t, bt), cdiv(inner, bi)), (x, y, t),
                  dict(I=inner, BLOCK_T=bt, BLOCK_I=bi, ACT=act, num_warps=warps), fast)
    return y


def forward_launcher(t: int, inner: int, act: int, dtype: torch.dtype, device: int, stream: int):
    """:func:`forward` for raw device pointers, 16-byte aligned: ``launch(x, y)`` with ``x`` contiguous
    ``[t, 2 * inner]`` and ``y`` contiguous ``[t, inner]``, both ``dtype``; ``act`` an :data:`ACTIVATIONS` code; on
    ``stream`` of CUDA device ``device``. ``None`` when no tensor launch bound that signature yet (see
    ``_runtime.launch_cached``)."""
    bt, bi, _ = config(inner)
    bound = _FWD_BOUND.get((device, _forward_signature(dtype, inner, act, t, 0)))
    if not bound:  # not bound yet (or unbindable: False)
        return None
    run = bound.at(cdiv(t, bt), cdiv(inner, bi), 1, stream)

    def launch(x: int, y: int) -> None:
        run(x, y, t)

    return launch


def backward_launcher(t: int, inner: int, act: int, dtype: torch.dtype, device: int, stream: int):
    """:func:`backward` with ``forward_out`` for raw device pointers, 16-byte aligned: ``launch(dy, x, dx, y)`` with
    ``dy`` / ``y`` contiguous ``[t, inner]`` and ``x`` / ``dx`` contiguous ``[t, 2 * inner]``, all ``dtype``; ``act``
    an :data:`ACTIVATIONS` code. ``None`` when no tensor launch bound that signature yet."""
    bt, bi, warps = config(inner)
    bound = _BWD_BOUND.get((device, (dtype, dtype, dtype, inner, bt, bi, warps, act, True, t < I32_END, True)))
    if not bound:
        return None
    run = bound.at(cdiv(t, bt), cdiv(inner, bi), 1, stream)

    def launch(dy: int, x: int, dx: int, y: int) -> None:
        run(dy, x, dx, y, t)

    return launch


def backward(dy: torch.Tensor, x: torch.Tensor, activation: str, forward_out: bool = False):
    """``dx`` ``[T, 2I]`` in ``x.dtype`` given ``dy`` ``[T, I]`` and the forward input ``x``.

    ``forward_out``: return ``(dx, y)``, ``y`` ``[T, I]`` the forward's output recomputed in the same pass (equal
    to :func:`forward`'s bit for bit), for a backward that needs it but did not keep it."""
    t, two_i = x.shape
    inner = two_i // 2
    x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty_like(x)
    y = torch.empty((t, inner), dtype=x.dtype, device=x.device) if forward_out else None
    if t and inner:
        bt, bi, warps = config(inner)
        act = ACTIVATIONS[activation]
        yy = dx if y is None else y
        fast = sig = None
        if x.is_cuda:
            fast = (dy.data_ptr(), x.data_ptr(), dx.data_ptr(), yy.data_ptr(), t)
            sig = (dy.dtype, x.dtype, yy.dtype, inner, bt, bi, warps, act, forward_out, t < I32_END,
                   not (fast[0] | fast[1] | fast[2] | fast[3]) & 15)
        launch_cached(_BWD_BOUND, sig, _glu_bwd_kernel, x, (cdiv(t, bt), cdiv(inner, bi)), (dy, x, dx, yy, t),
                      dict(I=inner, BLOCK_T=bt, BLOCK_I=bi, ACT=act, HAS_Y=forward_out, num_warps=warps), fast)
    return (dx, y) if forward_out else dx
