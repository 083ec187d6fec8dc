"""cuBLAS GEMMs called directly (``cublasGemmEx`` through ``ctypes``), for eager calls bound by host time.

``torch.mm`` of bf16 operands costs ~21 us of host time per call on the H200 machine's CPU (the dispatcher, the
autograd key, the output's allocation, the handle's set-up, then ``cublasGemmEx``); an eager ModernBERT-base
training step makes ~530 of them. :func:`mm` makes the same cuBLAS call with the same arguments on the same handle:
torch's bf16 / fp16 ``mm`` on its default BLAS backend is ``cublasGemmEx`` with fp32 compute and
``CUBLAS_GEMM_DEFAULT_TENSOR_OP``, on the handle ``torch.cuda.current_blas_handle()`` returns (which binds the
current stream, torch's workspace for it and the math mode), so the results are torch's, bit for bit.

Checked as the raw-pointer launches are: the first call of each class (operand dtypes, transposes, output dtype) on
a device is compared with ``torch.mm`` bit for bit and ``torch.mm``'s result returned; a mismatch turns the direct
call off for the process with a warning (:func:`off_reason`). It steps aside (returns ``None``: the caller runs
``torch.mm``) where torch would make another call: fp32 operands (TF32 modes), a preferred BLAS backend other than
cuBLAS, reduced-precision reductions disallowed, fp16 accumulation allowed, ROCm; and while a CUDA graph is being
captured before its class was checked (the check synchronises). Off for the process with
``PACKED_ENCODERS_DIRECT_CUBLAS=0`` (read at ``pack()``, :func:`set_enabled`).
"""

from __future__ import annotations

import ctypes
import threading
import warnings

import torch

_OP_N, _OP_T = 0, 1
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_COMPUTE_32F = 68
_GEMM_DEFAULT_TENSOR_OP = 99
_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F, torch.float32: _CUDA_R_32F}

_STATE: dict = {"enabled": True, "off": None, "fn": None}
_VERIFIED: set = set()
_LOCK = threading.Lock()
_ONE = ctypes.c_float(1.0)
_ZERO = ctypes.c_float(0.0)
_P_ONE, _P_ZERO = ctypes.addressof(_ONE), ctypes.addressof(_ZERO)


def set_enabled(enabled: bool) -> None:
    """Turn direct calls on or off for the process (``pack()`` sets it from ``PACKED_ENCODERS_DIRECT_CUBLAS``)."""
    _STATE["enabled"] = bool(enabled)


def off_reason() -> str | None:
    """Why direct calls are off for this process (the library was not found, or a call disagreed with
    ``torch.mm``), or ``None``."""
    return _STATE["off"]


def _library_path() -> str | None:
    """The ``libcublas`` torch loaded (not ``libcublasLt``), from the process's memory map."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


def _function():
    """``cublasGemmEx`` of the library torch uses, or ``None`` (off, with the reason kept)."""
    fn = _STATE["fn"]
    if fn is not None or _STATE["off"] is not None:
        return fn
    with _LOCK:
        if _STATE["fn"] is None and _STATE["off"] is None:
            if torch.version.hip:
                _STATE["off"] = "ROCm (hipBLAS)"
                return None
            torch._C._cuda_getCurrentBlasHandle()  # torch loads and initialises cuBLAS
            path = _library_path()
            try:
                if path is None:
                    raise OSError("libcublas is not mapped into this process")
                fn = ctypes.CDLL(path).cublasGemmEx
            except (OSError, AttributeError) as exc:
                _STATE["off"] = f"cublasGemmEx not found: {exc}"
                return None
            p, i = ctypes.c_void_p, ctypes.c_int
            fn.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
            fn.restype = i
            _STATE["fn"] = fn
    return _STATE["fn"]


def gemm_args(a_shape: tuple, trans_a: bool, b_shape: tuple, trans_b: bool) -> tuple[int, ...]:
    """``(transa, transb, m, n, k, lda, ldb, ldc)`` of the column-major ``cublasGemmEx`` call that writes the
    row-major ``C [M, N] = op(a) @ op(b)`` of row-major contiguous ``a`` and ``b`` (``op``: transposed when
    ``trans_*``): cuBLAS computes ``C^T = op(b)^T @ op(a)^T``, and a row-major matrix read column-major is its
    transpose, so ``b`` goes first."""
    m_rows = a_shape[1] if trans_a else a_shape[0]
    k = a_shape[0] if trans_a else a_shape[1]
    n = b_shape[0] if trans_b else b_shape[1]
    return (_OP_T if trans_b else _OP_N, _OP_T if trans_a else _OP_N, n, m_rows, k, b_shape[1], a_shape[1], n)


def _served(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's ``mm`` of these operands is the ``cublasGemmEx`` call :func:`mm` makes."""
    dtype = a.dtype
    if dtype is torch.bfloat16:
        return torch._C._get_cublas_allow_bf16_reduced_precision_reduction() == (True, True)
    if dtype is torch.float16:
        return (torch._C._get_cublas_allow_fp16_reduced_precision_reduction() == (True, True)
                and not torch._C._get_cublas_allow_fp16_accumulation())
    return False


def mm(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False, trans_b: bool = False,
       out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``op(a) @ op(b)`` (``op``: transposed when ``trans_*``) of contiguous 2-D CUDA tensors of one dtype (bf16 or
    fp16), written in ``out_dtype`` (that dtype or fp32; ``None``: the operands'), as a new contiguous tensor;
    ``None`` where the direct call does not serve (see the module's notes; the caller runs ``torch.mm``).

    ``mm(x, w, trans_b=True)`` is ``x @ w.T`` (a linear layer without bias), ``mm(dy, w)`` its input gradient,
    ``mm(dy, x, trans_a=True, out_dtype=torch.float32)`` its weight gradient from the fp32 accumulator."""
    if not _STATE["enabled"] or b.dtype is not a.dtype or not a.is_cuda or not _served(a, b):
        return None
    fn = _STATE["fn"] or _function()
    if fn is None or torch._C._get_blas_preferred_backend() is not torch._C._BlasBackend.Cublas:
        return None
    if a.dim() != 2 or b.dim() != 2 or not a.is_contiguous() or not b.is_contiguous():
        return None
    device = a.get_device()
    if b.get_device() != device or device != torch._C._cuda_getDevice():
        return None
    out_dtype = a.dtype if out_dtype is None else out_dtype
    if out_dtype is not a.dtype and out_dtype is not torch.float32:
        return None
    transa, transb, m, n, k, lda, ldb, ldc = gemm_args(a.shape, trans_a, b.shape, trans_b)
    if (b.shape[1] if trans_b else b.shape[0]) != k:
        raise RuntimeError(f"mm: shapes {tuple(a.shape)}{'^T' if trans_a else ''} and "
                           f"{tuple(b.shape)}{'^T' if trans_b else ''} cannot be multiplied")
    out = torch.empty((n, m), dtype=out_dtype, device=a.device)
    if not (m and n):
        return out
    if not k:
        return out.zero_()
    key = (device, a.dtype, out_dtype, trans_a, trans_b)
    checked = key in _VERIFIED
    if not checked and torch.cuda.is_current_stream_capturing():
        return None
    handle = torch._C._cuda_getCurrentBlasHandle()  # binds the current stream and torch's workspace
    ab = _DTYPES[a.dtype]
    status = fn(handle, transa, transb, m, n, k, _P_ONE, b.data_ptr(), ab, lda, a.data_ptr(), ab, ldb, _P_ZERO,
                out.data_ptr(), _DTYPES[out_dtype], ldc, _COMPUTE_32F, _GEMM_DEFAULT_TENSOR_OP)
    if status:
        _turn_off(f"cublasGemmEx returned status {status} for {tuple(a.shape)} x {tuple(b.shape)}")
        return None
    if not checked:
        return _check(key, out, a, b, trans_a, trans_b, out_dtype)
    return out


def _reference(a, b, trans_a, trans_b, out_dtype):
    x, y = (a.t() if trans_a else a), (b.t() if trans_b else b)
    return torch.mm(x, y) if out_dtype is a.dtype else torch.mm(x, y, out_dtype=out_dtype)


def _check(key, out, a, b, trans_a, trans_b, out_dtype) -> torch.Tensor:
    ref = _reference(a, b, trans_a, trans_b, out_dtype)
    if torch.equal(ref, out):
        _VERIFIED.add(key)
    else:
        _turn_off(f"a direct cublasGemmEx ({a.dtype} -> {out_dtype}, transposes {trans_a}, {trans_b}) differed from "
                  f"torch.mm (max abs difference {(ref.float() - out.float()).abs().max().item():.3g})")
    return ref


def _turn_off(reason: str) -> None:
    _STATE["off"] = reason
    _STATE["fn"] = None
    warnings.warn(f"packed_encoders: direct cuBLAS calls are off for this process: {reason}; torch.mm runs them",
                  RuntimeWarning, stacklevel=3)




def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; for a 2-D ``x`` without bias the same ``cublasGemmEx`` call made directly
    (:func:`mm`) where it serves (the eager no-grad projections past the small Triton GEMM's size rule)."""
    if bias is None and x.dim() == 2:
        y = mm(x, weight, trans_b=True)
        if y is not None:
            return y
    return torch.nn.functional.linear(x, weight, bias)


__all__ = ["gemm_args", "linear", "mm", "off_reason", "set_enabled"]
