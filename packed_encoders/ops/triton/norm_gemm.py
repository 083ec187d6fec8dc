"""(Residual +) LayerNorm fused into the prologue of a small-M GEMM: ``s = x + delta``, ``y = LN(s) @ W.T (+ b)``,
optionally with the GLU of :mod:`.small_gemm` on the way out, in one launch.

For query-sized batches (a few hundred tokens) every ModernBERT op is a latency-bound launch of a few
microseconds; a kernel profile of a batch-8 query replay on the H200 (tenth session) counted 45 LayerNorm
launches of 2.3 us each and 0.4 us gaps between kernels. Two of them per layer sit right before a projection
(``attn_norm`` before ``Wqkv``, ``mlp_norm`` before ``Wi``); this kernel takes each such pair as one launch.

Each program owns ``BLOCK_M`` rows and ``BLOCK_N`` output columns:

- It loads its rows whole (``[BLOCK_M, KP]``, ``KP`` the next power of two of ``K``, so ``K <= MAX_K``), forms
  ``s`` rounded to the residual dtype, and takes the row statistics in fp32 from those registers: mean, then the
  centred variance, as :mod:`.layer_norm` does. The programs with ``program_id(1) == 0`` write ``s``.
- Its K loop reloads ``[BLOCK_M, BLOCK_K]`` slices (L1/L2 hits), normalises them, applies the LayerNorm weight
  and bias, rounds to the activation dtype (the values the separate LayerNorm would have written) and feeds them
  to ``tl.dot`` against the weight read in place through its strides, fp32 accumulation.
- The epilogue is :mod:`.small_gemm`'s: bias, then for ``GLU`` ``act(a) * g`` from the rows ``n`` and ``n + I``.

Every program of a row block recomputes the statistics (``cdiv(N, BLOCK_N)`` times): the rows are few and in L2,
and a separate pass would be the launch this kernel removes. Rows past ``M`` wrap onto valid rows for the loads
and are dropped at the stores, as in :mod:`.small_gemm`.

Not measured on a GPU yet: the forward uses it only under ``PACKED_ENCODERS_NORM_GEMM`` (see
:mod:`packed_encoders.ops.fused`), off by default until an A/B on the H200 shows it pays.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._runtime import cdiv, device_guard, kernel, next_pow2
from .glu import ACTIVATIONS
from .small_gemm import DTYPES, Config

# kernels may only read globals declared as Triton constexprs
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_TANH_C = tl.constexpr(0.044715)

MAX_K = 1024  # a program holds BLOCK_M whole rows of s in registers for the statistics
MAX_TOKENS = 256  # the batches it is meant for (latency bound); larger ones keep the separate LayerNorm

# Untuned starting points (16-row tiles keep BLOCK_M x KP fp32 values at 64 per thread with 8 warps).
DEFAULT_LINEAR = Config(16, 64, 64, 8, 3)
DEFAULT_GLU = Config(16, 32, 64, 8, 3)


@kernel(do_not_specialize=("M",))
def _norm_gemm_kernel(
    X, D, LW, LB, S, W, B, Y, M, eps,
    sx_m, sd_m, sw_n, sw_k, s_b,
    N: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, GLU: tl.constexpr, ACT: tl.constexpr,
    HAS_RES: tl.constexpr, HAS_LW: tl.constexpr, HAS_LB: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    row_ok = offs_m < M

    # statistics from whole rows held in registers: mean, then the centred variance (layer_norm.py's order)
    kk = tl.arange(0, KP)
    k_in = kk < K
    s = tl.load(X + rows[:, None] * sx_m + kk[None, :], mask=k_in[None, :], other=0.0).to(tl.float32)
    if HAS_RES:
        d = tl.load(D + rows[:, None] * sd_m + kk[None, :], mask=k_in[None, :], other=0.0).to(tl.float32)
        s_round = (s + d).to(S.dtype.element_ty)  # the residual stream's rounding, as the separate op
        if pid_n == 0:
            tl.store(S + offs_m.to(tl.int64)[:, None] * K + kk[None, :], s_round,
                     mask=row_ok[:, None] & k_in[None, :])
        s = s_round.to(tl.float32)
    mean = tl.sum(s, axis=1) / K
    centred = tl.where(k_in[None, :], s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(centred * centred, axis=1) / K + eps)

    offs_k = tl.arange(0, BLOCK_K)
    w_at = W + cols[None, :] * sw_n + offs_k[:, None] * sw_k  # a [BLOCK_K, BLOCK_N] tile of W.T, in place
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GLU:
        g_at = w_at + N * sw_n
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kc = k0 + offs_k
        kc_ok = kc < K
        a = tl.load(X + rows[:, None] * sx_m + kc[None, :], mask=kc_ok[None, :], other=0.0).to(tl.float32)
        if HAS_RES:
            a = (a + tl.load(D + rows[:, None] * sd_m + kc[None, :], mask=kc_ok[None, :], other=0.0).to(
                tl.float32)).to(S.dtype.element_ty).to(tl.float32)
        a = (a - mean[:, None]) * rstd[:, None]
        if HAS_LW:
            a = a * tl.load(LW + kc, mask=kc_ok, other=0.0).to(tl.float32)[None, :]
        if HAS_LB:
            a = a + tl.load(LB + kc, mask=kc_ok, other=0.0).to(tl.float32)[None, :]
        a = tl.where(kc_ok[None, :], a, 0.0).to(Y.dtype.element_ty)  # what the separate LayerNorm would write
        w = tl.load(w_at, mask=kc_ok[:, None], other=0.0)
        if DOT_F32:  # the CPU interpreter multiplies bf16 bit patterns as integers; same maths in fp32
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        if GLU:
            g = tl.load(g_at, mask=kc_ok[:, None], other=0.0)
            if DOT_F32:
                acc_g = tl.dot(a.to(tl.float32), g.to(tl.float32), acc_g, input_precision="ieee")
            else:
                acc_g = tl.dot(a, g, acc_g, input_precision="ieee")
            g_at += BLOCK_K * sw_k
        w_at += BLOCK_K * sw_k
    if HAS_BIAS:
        acc += tl.load(B + cols * s_b).to(tl.float32)[None, :]
        if GLU:
            acc_g += tl.load(B + (cols + N) * s_b).to(tl.float32)[None, :]
    if GLU:  # glu.py's activations, in fp32 on the fp32 sums
        z = acc
        if ACT == 0:
            act = 0.5 * z * (1.0 + tl.math.erf(z * _SQRT1_2))
        elif ACT == 1:
            t = 2.0 * tl.sigmoid(2.0 * _SQRT_2_OVER_PI * (z + _TANH_C * z * z * z)) - 1.0  # tanh
            act = 0.5 * z * (1.0 + t)
        elif ACT == 2:
            act = z * tl.sigmoid(z)
        else:
            act = tl.maximum(z, 0.0)
        acc = act * acc_g
    ok = row_ok[:, None] & (offs_n < N)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=ok)


def unsupported(x: torch.Tensor, delta: torch.Tensor | None, norm_weight, norm_bias, weight: torch.Tensor,
                bias: torch.Tensor | None, activation: str | None) -> str | None:
    """Why :func:`norm_linear` cannot take these arguments (``None`` when it can)."""
    if x.dim() != 2 or x.dtype not in DTYPES:
        return f"x of shape {tuple(x.shape)} and dtype {x.dtype}"
    k = x.shape[1]
    if k > MAX_K:
        return f"hidden size {k} > {MAX_K} (whole rows are held in registers)"
    if x.stride(1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        return "x / delta need unit column stride and one shape"
    if weight.dim() != 2 or weight.shape[1] != k:
        return f"weight of shape {tuple(weight.shape)} for x {tuple(x.shape)}"
    for name, t, n in (("delta", delta, None), ("norm weight", norm_weight, k), ("norm bias", norm_bias, k),
                       ("bias", bias, weight.shape[0])):
        if t is None:
            continue
        if t.device != x.device or t.dtype != x.dtype:
            return f"{name} is {t.dtype} on {t.device}, x {x.dtype} on {x.device}"
        if n is not None and tuple(t.shape) != (n,):
            return f"{name} of shape {tuple(t.shape)}, expected ({n},)"
        if name.startswith("norm") and t.stride(0) != 1:
            return f"{name} needs unit stride (got {t.stride(0)})"
    if weight.device != x.device or weight.dtype != x.dtype:
        return f"weight is {weight.dtype} on {weight.device}, x {x.dtype} on {x.device}"
    if activation is not None:
        if activation not in ACTIVATIONS:
            return f"activation {activation!r}"
        if weight.shape[0] % 2:
            return f"{weight.shape[0]} Wi rows (not [2I, K])"
    return None


def norm_linear(x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor | None,
                norm_bias: torch.Tensor | None, eps: float, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str | None = None, config: Config | None = None):
    """``(s, y)``: ``s = x + delta`` (``x`` itself when ``delta`` is None) and ``y = LN(s) @ W.T + b`` ``[M, N]``,
    or with ``activation`` the GLU ``act(LN(s) @ W[:I].T + b[:I]) * (LN(s) @ W[I:].T + b[I:])`` ``[M, I]``.

    ``x``, ``delta`` ``[M, K]`` (unit column stride), LayerNorm ``norm_weight`` / ``norm_bias`` ``[K]`` or
    ``None``, ``eps``; ``weight`` ``[N, K]`` in HF's layout (read in place), ``bias`` ``[N]`` or ``None``; one dtype
    (bf16, fp16, fp32) and device (CUDA; CPU when interpreted); ``K <= MAX_K``. Rounding as the separate ops:
    ``s`` rounded to ``x``'s dtype, statistics in fp32 from it, the normalised values rounded to the dtype before
    the fp32-accumulated product, the output rounded once. Forward only (no autograd).

    Raises:
        ValueError: the reason from :func:`unsupported`, or an invalid ``config``.
    """
    why = unsupported(x, delta, norm_weight, norm_bias, weight, bias, activation)
    if why:
        raise ValueError(f"norm_linear: {why}")
    glu = activation is not None
    m, k = x.shape
    n_out = weight.shape[0] // 2 if glu else weight.shape[0]
    cfg = config or (DEFAULT_GLU if glu else DEFAULT_LINEAR)
    cfg.check()
    y = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    s = torch.empty_like(x, memory_format=torch.contiguous_format) if delta is not None else x
    if m == 0:
        return s, y
    if n_out == 0:  # nothing to project; the residual sum is still owed
        if delta is not None:
            s.copy_((x.float() + delta.float()).to(x.dtype))
        return s, y
    grid = (cdiv(m, cfg.block_m), cdiv(n_out, cfg.block_n))
    with device_guard(x):
        _norm_gemm_kernel.on(x)[grid](
            x, delta if delta is not None else x, norm_weight if norm_weight is not None else x,
            norm_bias if norm_bias is not None else x, s, weight, bias if bias is not None else weight, y, m,
            float(eps), x.stride(0), delta.stride(0) if delta is not None else 0, weight.stride(0),
            weight.stride(1), bias.stride(0) if bias is not None else 0,
            N=n_out, K=k, KP=max(16, next_pow2(k)), GLU=glu, ACT=ACTIVATIONS[activation] if glu else 0,
            HAS_RES=delta is not None, HAS_LW=norm_weight is not None, HAS_LB=norm_bias is not None,
            HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            DOT_F32=not x.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    return s, y
