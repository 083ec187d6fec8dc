"""Triton GEMMs for the few-hundred-token batches of a latency-bound forward: ``linear`` and a GLU-fused ``glu_linear``.

At M = 256..512 tokens a ModernBERT-base projection is bound by launch latency and weight traffic, not by
FLOPs. These kernels tile the output ``[M, N]`` with M blocks of 16..128 and N blocks of 32..256, so that a
small M still yields a grid of ~132 programs, each streaming ``BLOCK_N`` weight rows through the K loop with
fp32 accumulation. Measured on the H200 (``benchmarks/gemm_small.py``, :data:`TUNED`): the fused
``glu_linear`` beats cuBLAS + the Triton GLU by 1.02-1.24x at M = 128..512 (0.84-0.89x beyond); the plain
``linear`` is 0.78-1.03x cuBLAS.

- The weight is HF's own ``[N, K]`` layout read in place through its strides (a row slice or any other view
  works; nothing is copied or re-laid). ``x`` is read through its strides too.
- ``N``, ``K`` and the tile sizes are compile-time constants; the token count ``M`` is a runtime argument in
  ``do_not_specialize``, so one compiled artifact per (N, K, dtype, config) serves every M.
- Programs along M vary fastest (``program_id(0)``), so the programs sharing a weight tile run together and
  all but the first read it from L2.
- ``glu_linear`` keeps two accumulators per program, for the rows ``n`` and ``n + I`` of the same
  ``[2I, K]`` weight, and writes ``act(a) * g`` from them in fp32, rounded once: the ``[M, 2I]``
  intermediate and the separate GLU launch are gone.
- No split-K: at K = 768..1152 the K loop is 6..18 steps, small M blocks already give enough programs, and
  split-K needs a workspace (an allocation besides the output) plus a second ~2 us reduction launch.
- A launch is one kernel on the current stream, with no host sync and no allocation but the output: CUDA
  graph capturable. No ``triton.autotune``: configs are chosen on the host (:func:`default_config`,
  :data:`TUNED`); ``benchmarks/gemm_small.py`` measures every entry of :data:`CONFIGS`.

Dtypes: bf16 and fp16 (tensor cores), fp32 (IEEE-exact products, no TF32, like ``F.linear`` by default).
Interpreted on CPU (``TRITON_INTERPRET=1``), dot inputs are cast to fp32 first: the interpreter multiplies
bf16 bit patterns as integers.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton.language as tl

from ._runtime import I32_END, cdiv, kernel, launch_cached
# the GLU kernel's activation constants (Triton constexprs, taken after a tensor in a product: glu.py says why)
from .glu import _SQRT1_2, _SQRT_2_OVER_PI, _TANH_C, ACTIVATIONS

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# launch signature -> _runtime.Bound (launches that skip Triton's per-argument key; see _runtime.launch_cached)
_BOUND: dict = {}


class Config(NamedTuple):
    """A launch configuration: output tile ``BLOCK_M x BLOCK_N``, K step ``BLOCK_K`` (powers of two >= 16),
    ``num_warps`` and software-pipeline depth ``num_stages``."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def check(self) -> None:
        """Raise ``ValueError`` (naming ``config``) unless the tile sizes are powers of two >= 16 and the warp
        count a power of two in 1..16."""
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"config.{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"config.num_warps must be a power of two in 1..16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"config.num_stages must be >= 1, got {self.num_stages}")


# The sweep of benchmarks/gemm_small.py: 16/32-row tiles with wide K steps (more weight bytes in flight per stage;
# mma.sync on Hopper, which lost everywhere but M = 128), 64-row tiles (wgmma: the H200's winners at M >= 256), and
# 128 x 128/256 tiles for M in the thousands (glu_linear's two accumulators make 128 x 256 exceed shared memory).
CONFIGS: tuple[Config, ...] = (
    Config(16, 32, 128, 2, 4),
    Config(16, 64, 128, 4, 4),
    Config(16, 128, 64, 4, 4),
    Config(32, 32, 128, 4, 4),
    Config(32, 64, 64, 4, 4),
    Config(32, 64, 128, 4, 3),
    Config(32, 128, 64, 4, 4),
    Config(64, 32, 64, 4, 4),
    Config(64, 64, 64, 4, 4),
    Config(64, 64, 128, 4, 3),
    Config(64, 128, 64, 4, 4),
    Config(64, 128, 64, 8, 3),
    Config(128, 64, 64, 4, 4),
    Config(128, 128, 64, 8, 3),
    Config(128, 256, 64, 8, 3),
)

# Measured winners, pasted from ``benchmarks/gemm_small.py``'s output: ``{(op, N, K, M): Config}`` with ``op``
# "linear" or "glu" and ``N`` the weight's rows (2I for "glu"). H200, bf16, weights cycled out of L2, one run
# (2026-11-29, triton 3.6, torch 2.11); the comment is the speed-up over cuBLAS (over cuBLAS + Triton GLU for "glu").
TUNED: dict[tuple[str, int, int, int], Config] = {
    ('glu', 2304, 768, 128): Config(64, 32, 64, 4, 4),  # 1.24x vs baseline
    ('glu', 2304, 768, 256): Config(64, 32, 64, 4, 4),  # 1.08x vs baseline
    ('glu', 2304, 768, 512): Config(64, 32, 64, 4, 4),  # 1.02x vs baseline
    ('glu', 2304, 768, 1024): Config(128, 128, 64, 8, 3),  # 0.89x vs baseline
    ('glu', 2304, 768, 2048): Config(64, 64, 64, 4, 4),  # 0.84x vs baseline
    ('glu', 2304, 768, 4096): Config(64, 64, 64, 4, 4),  # 0.87x vs baseline
    ('glu', 2304, 768, 8192): Config(128, 128, 64, 8, 3),  # 1.03x vs baseline (gemm_small_20261203-141000)
    ('linear', 2304, 768, 128): Config(64, 64, 128, 4, 3),  # 0.85x vs baseline
    ('linear', 2304, 768, 256): Config(64, 64, 64, 4, 4),  # 0.81x vs baseline
    ('linear', 2304, 768, 512): Config(64, 64, 64, 4, 4),  # 0.79x vs baseline
    ('linear', 2304, 768, 1024): Config(64, 128, 64, 8, 3),  # 0.78x vs baseline
    ('linear', 2304, 768, 2048): Config(64, 128, 64, 8, 3),  # 0.78x vs baseline
    ('linear', 2304, 768, 4096): Config(128, 128, 64, 8, 3),  # 0.80x vs baseline
    ('linear', 768, 768, 128): Config(16, 32, 128, 2, 4),  # 1.03x vs baseline
    ('linear', 768, 768, 256): Config(64, 32, 64, 4, 4),  # 0.95x vs baseline
    ('linear', 768, 768, 512): Config(64, 64, 128, 4, 3),  # 0.93x vs baseline
    ('linear', 768, 768, 1024): Config(64, 128, 64, 4, 4),  # 0.85x vs baseline
    ('linear', 768, 768, 2048): Config(64, 128, 64, 4, 4),  # 0.82x vs baseline
    ('linear', 768, 768, 4096): Config(64, 128, 64, 8, 3),  # 0.91x vs baseline
    ('linear', 768, 1152, 128): Config(16, 32, 128, 2, 4),  # 0.96x vs baseline
    ('linear', 768, 1152, 256): Config(64, 32, 64, 4, 4),  # 0.83x vs baseline
    ('linear', 768, 1152, 512): Config(64, 64, 64, 4, 4),  # 0.81x vs baseline
    ('linear', 768, 1152, 1024): Config(64, 128, 64, 4, 4),  # 0.78x vs baseline
    ('linear', 768, 1152, 2048): Config(64, 128, 64, 4, 4),  # 0.81x vs baseline
    ('linear', 768, 1152, 4096): Config(64, 128, 64, 8, 3),  # 0.87x vs baseline
}

# Programs the heuristic aims for: the H200's multiprocessor count (one wave of at least one program each).
TARGET_PROGRAMS = 132

# Candidates of the heuristic, widest first: the widest that still fills the GPU wins. 64-row tiles only: on the
# H200 they (wgmma) beat the 16/32-row tiles (mma.sync) at every measured M >= 256. glu_linear holds two
# accumulators: at 64 x 128 it needs 8 warps not to spill registers.
_HEURISTIC = (
    Config(64, 128, 64, 4, 4),
    Config(64, 64, 64, 4, 4),
    Config(64, 32, 64, 4, 4),
)
_HEURISTIC_GLU = (Config(64, 128, 64, 8, 3),) + _HEURISTIC[1:]


@functools.lru_cache(maxsize=4096)
def default_config(M: int, N: int, K: int, *, glu: bool = False) -> Config:
    """The config for ``x [M, K] @ W[N, K].T`` (``glu``: ``W`` is ``[N = 2I, K]``, output ``[M, N // 2]``).

    From :data:`TUNED` when it holds ``(op, N, K)``: the entry of the smallest measured M >= ``M`` (the largest
    measured M beyond them). Otherwise the widest 64-row tile giving >= :data:`TARGET_PROGRAMS` programs, or the
    narrowest when none does. Memoised: an eager call of a few hundred tokens asks on every layer.
    """
    op = "glu" if glu else "linear"
    measured = sorted((m, cfg) for (o, n, k, m), cfg in TUNED.items() if (o, n, k) == (op, N, K))
    if measured:
        return next((cfg for m, cfg in measured if m >= M), measured[-1][1])
    cols, candidates = (N // 2, _HEURISTIC_GLU) if glu else (N, _HEURISTIC)
    for cfg in candidates:
        if cdiv(M, cfg.block_m) * cdiv(cols, cfg.block_n) >= TARGET_PROGRAMS:
            return cfg
    return candidates[-1]


@kernel(do_not_specialize=("M",))
def _gemm_kernel(
    X, W, B, Y, M,
    sx_m, sx_k, sw_n, sw_k, s_b,
    N: tl.constexpr, K: tl.constexpr, GLU: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):
    # N is the output width: the weight's rows for a linear, I (the half) for GLU, whose gate rows follow at +N.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Out-of-range rows and columns wrap onto valid ones: the K loop's loads need no M/N masks, the store drops them.
    rows = (offs_m % M).to(tl.int64)
    cols = (offs_n % N).to(tl.int64)
    x_at = X + rows[:, None] * sx_m + offs_k[None, :] * sx_k
    w_at = W + cols[None, :] * sw_n + offs_k[:, None] * sw_k  # a [BLOCK_K, BLOCK_N] tile of W.T, in place
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GLU:
        g_at = w_at + N * sw_n
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            x = tl.load(x_at)
            w = tl.load(w_at)
        else:
            k_ok = offs_k + k0 < K
            x = tl.load(x_at, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_at, mask=k_ok[:, None], other=0.0)
        if DOT_F32:  # the CPU interpreter multiplies bf16 bit patterns as integers; same maths in fp32
            x = x.to(tl.float32)
            acc = tl.dot(x, w.to(tl.float32), acc, input_precision="ieee")
        else:  # "ieee" only matters for fp32 inputs: exact products, as F.linear without TF32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        if GLU:
            if K % BLOCK_K == 0:
                g = tl.load(g_at)
            else:
                g = tl.load(g_at, mask=k_ok[:, None], other=0.0)
            if DOT_F32:
                acc_g = tl.dot(x, g.to(tl.float32), acc_g, input_precision="ieee")
            else:
                acc_g = tl.dot(x, g, acc_g, input_precision="ieee")
            g_at += BLOCK_K * sw_k
        x_at += BLOCK_K * sx_k
        w_at += BLOCK_K * sw_k
    if HAS_BIAS:
        acc += tl.load(B + cols * s_b).to(tl.float32)[None, :]
        if GLU:
            acc_g += tl.load(B + (cols + N) * s_b).to(tl.float32)[None, :]
    if GLU:  # glu.py's activations, in fp32 on the fp32 sums
        a = acc
        if ACT == 0:
            act = 0.5 * a * (1.0 + tl.math.erf(a * _SQRT1_2))
        elif ACT == 1:
            t = 2.0 * tl.sigmoid((a + a * _TANH_C * a * a) * (2.0 * _SQRT_2_OVER_PI)) - 1.0  # tanh
            act = 0.5 * a * (1.0 + t)
        elif ACT == 2:
            act = a * tl.sigmoid(a)
        else:
            act = tl.maximum(a, 0.0)
        acc = act * acc_g
    ok = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(Y + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> None:
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"weight must be [N, K] with K = {x.shape[1]} (x's last dim), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if bias is not None:
        if bias.shape != (rows,):
            raise ValueError(f"bias must be [{rows}] (the weight's rows), got {tuple(bias.shape)}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise ValueError(f"bias must be {x.dtype} on {x.device}, got {bias.dtype} on {bias.device}")


def _signature(x_dtype, w_dtype, b_dtype, strides: tuple, out_cols: int, k: int, glu: bool, act: int, has_bias: bool,
               config: Config, m: int, pointers: int) -> tuple:
    # what the compiled specialisation depends on: the strides are specialised ints (their values belong here), M
    # is not (only its 32-bit range); ``pointers``: every pointer or-ed together (16-byte aligned when its low bits
    # are clear)
    return (x_dtype, w_dtype, b_dtype, strides, out_cols, k, glu, act, has_bias, config, m < I32_END,
            not pointers & 15)


def launcher(m: int, k: int, out_cols: int, act: int | None, bias: bool, dtype: torch.dtype, device: int,
             stream: int):
    """``y = x @ weight.T (+ bias)`` (``act`` ``None``) or the GLU form (``act``: an :data:`ACTIVATIONS` code) for
    raw device pointers, 16-byte aligned: ``launch(x, weight, bias, y)`` with contiguous ``x`` ``[m, k]``,
    ``weight`` ``[N, k]``, ``bias`` ``[N]`` (``bias`` False: ignored, pass ``weight``'s), ``y`` ``[m, out_cols]``, all
    of one ``dtype``; the default config, on ``stream`` of CUDA device ``device``. ``None`` when no tensor launch
    bound that signature yet (see ``_runtime.launch_cached``)."""
    glu = act is not None
    config = default_config(m, 2 * out_cols if glu else out_cols, k, glu=glu)
    strides = (k, 1, k, 1, 1 if bias else 0)
    bound = _BOUND.get((device, _signature(dtype, dtype, dtype, strides, out_cols, k, glu, act or 0, bias, config, m,
                                           0)))
    if not bound:  # not bound yet (or unbindable: False)
        return None
    run = bound.at(cdiv(m, config.block_m), cdiv(out_cols, config.block_n), 1, stream)

    def launch(x: int, weight: int, b: int, y: int) -> None:
        run(x, weight, b, y, m, *strides)

    return launch


def _launch(x, weight, bias, out_cols: int, glu: bool, act: int, config: Config) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty((m, out_cols), dtype=x.dtype, device=x.device)
    if m == 0 or out_cols == 0:
        return y
    b = bias if bias is not None else weight
    strides = (*x.stride(), *weight.stride(), bias.stride(0) if bias is not None else 0)
    fast = sig = None
    if x.is_cuda:
        fast = (x.data_ptr(), weight.data_ptr(), b.data_ptr(), y.data_ptr(), m, *strides)
        sig = _signature(x.dtype, weight.dtype, b.dtype, strides, out_cols, k, glu, act, bias is not None, config, m,
                         fast[0] | fast[1] | fast[2] | fast[3])
    launch_cached(_BOUND, sig, _gemm_kernel, x, (cdiv(m, config.block_m), cdiv(out_cols, config.block_n)),
                  (x, weight, b, y, m, *strides),
                  dict(N=out_cols, K=k, GLU=glu, ACT=act, HAS_BIAS=bias is not None, BLOCK_M=config.block_m,
                       BLOCK_N=config.block_n, BLOCK_K=config.block_k, DOT_F32=not x.is_cuda,
                       num_warps=config.num_warps, num_stages=config.num_stages), fast)
    return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: Config | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` ``[M, N]`` in ``x.dtype``, as ``F.linear``: fp32 accumulation, one rounding.

    ``x`` ``[M, K]``, ``weight`` ``[N, K]`` (any strides: read in place), ``bias`` ``[N]`` or ``None``, all of one
    dtype (bf16, fp16, fp32) and device (CUDA; CPU when interpreted). ``config`` defaults to
    :func:`default_config`. Raises ``ValueError`` naming the offending argument for other dtypes, shapes or
    devices, or an invalid config.
    """
    _check(x, weight, bias, weight.shape[0] if weight.dim() == 2 else -1)
    if config is not None:
        config.check()
    n = weight.shape[0]
    return _launch(x, weight, bias, n, False, 0, config or default_config(x.shape[0], n, x.shape[1]))


def linear_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`linear` without its argument checks and with the default config, for callers whose operands meet its
    contract by construction (the packed forward's no-grad path: one dtype and device, checked once per call)."""
    n = weight.shape[0]
    return _launch(x, weight, bias, n, False, 0, default_config(x.shape[0], n, x.shape[1]))


def glu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str,
               config: Config | None = None) -> torch.Tensor:
    """``act(x @ W[:I].T + b[:I]) * (x @ W[I:].T + b[I:])`` ``[M, I]`` in ``x.dtype``, ``W = weight`` ``[2I, K]``.

    ModernBERT's ``Wi`` followed by its GLU in one launch: both products accumulate in fp32, the activation
    (``"gelu"`` exact erf, ``"gelu_tanh"``, ``"silu"``, ``"relu"``; :data:`glu.ACTIVATIONS`) and the product
    are fp32, the output is rounded once. Arguments as :func:`linear`; ``config.block_n`` tiles I. Raises
    ``ValueError`` for an unknown activation or an odd number of weight rows, besides :func:`linear`'s errors.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    _check(x, weight, bias, weight.shape[0] if weight.dim() == 2 else -1)
    rows = weight.shape[0]
    if rows % 2:
        raise ValueError(f"weight must have an even number of rows [2I, K], got {rows}")
    if config is not None:
        config.check()
    cfg = config or default_config(x.shape[0], rows, x.shape[1], glu=True)
    return _launch(x, weight, bias, rows // 2, True, ACTIVATIONS[activation], cfg)


def glu_linear_unchecked(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str) -> torch.Tensor:
    """:func:`glu_linear` without its argument checks and with the default config (see :func:`linear_unchecked`)."""
    rows = weight.shape[0]
    return _launch(x, weight, bias, rows // 2, True, ACTIVATIONS[activation],
                   default_config(x.shape[0], rows, x.shape[1], glu=True))
