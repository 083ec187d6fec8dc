"""cuBLASLt GEMMs on raw device pointers, for the raw-pointer paths (``model/stack_pointers.py``: the training stack;
``model/pointers.py``: eager no-grad calls).

``torch.mm`` costs ~11-24 us of host time per call on the H200 machine (much of it cuBLAS's own: its
``cublasGemmEx`` path looks up an algorithm on every call), and an eager training step of ModernBERT-base makes
~530 of them. Here each GEMM shape class gets its descriptors and its algorithm once
(``cublasLtMatmulAlgoGetHeuristic``, ~0.35 ms on the H200 machine), and a call is one ``cublasLtMatmul`` through
``ctypes`` (``host_ops_20261204-174203``: 10.1 us against 11.3 for ``torch.mm`` into an output and 14.6 for
``F.linear``). The library is the ``libcublasLt`` torch itself loaded (found in the process's mapped files), so no
version can differ from torch's.

Row-major ``[rows, cols]`` tensors are column-major ``[cols, rows]`` matrices to cuBLAS, so the three products are
asked transposed: ``y = x @ w.T`` is ``y^T = w . x^T``.

Each product shape (its ``n``, ``k``, dtypes and the power-of-two class of the token count ``t``) has one set of
descriptors per thread, made with the first ``t`` of its class, and the heuristic's first algorithm for that ``t``.
Another ``t`` of the class sets the two layouts' column counts (two attribute writes, only when ``t`` changed since
the shape's last call) and runs the same algorithm: an eager training step or inference call meets a new ``t`` on
nearly every call, and new layouts and a ``cublasLtMatmulAlgoCheck`` per shape and call cost more host time than
they save (a ``t`` for which ``cublasLtMatmul`` refuses the class's algorithm gets its own descriptors and heuristic
choice, kept for the next call at that ``t``).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Callable

import torch

_VP, _U64, _I64, _I32, _SZ = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32, ctypes.c_size_t
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t
_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE = 1  # cublasLtMatmulPreferenceAttributes_t
_RESULT_BYTES = 96  # sizeof(cublasLtMatmulHeuristicResult_t): algo (64), workspaceSize, state, wavesCount, reserved[4]
WORKSPACE_BYTES = 4 << 20  # the caller allocates it per call (the heuristic's choices within it)
_LOCK = threading.Lock()
_STATE: dict = {}


def _library_path() -> str | None:
    """The ``libcublasLt`` this process mapped (torch loads it with its CUDA libraries), or ``None``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split()[-1]
    except OSError:
        return None
    return None


def status() -> str | None:
    """``None`` when cuBLASLt can be called here, else why not (no CUDA, the library not found or not loadable)."""
    with _LOCK:
        if "status" not in _STATE:
            try:
                _STATE["status"] = _load()
            except Exception as exc:  # noqa: BLE001 - a CUDA runtime that fails here: the tensor form, visibly
                _STATE["status"] = f"{exc.__class__.__name__}: {exc}"
        return _STATE["status"]


def _load() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    torch.cuda.init()
    a = torch.zeros(8, 8, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, a)  # makes torch load cuBLAS and cuBLASLt
    path = _library_path()
    if path is None:
        return "libcublasLt is not among the process's loaded libraries"
    try:
        lib = ctypes.CDLL(path)
        lib.cublasLtMatmulDescSetAttribute.argtypes = [_VP, _I32, _VP, _SZ]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(_VP), _I32, _U64, _U64, _I64]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [_VP, _I32, _VP, _SZ]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [_VP, _VP, _VP, _VP, _VP, _VP, _VP, _I32, _VP,
                                                       ctypes.POINTER(_I32)]
        lib.cublasLtMatrixLayoutSetAttribute.argtypes = [_VP, _I32, _VP, _SZ]
        lib.cublasLtMatrixLayoutDestroy.argtypes = [_VP]
        lib.cublasLtMatmul.argtypes = [_VP] * 14 + [_SZ, _VP]
        lib.cublasLtMatmul.restype = _I32
    except (OSError, AttributeError) as exc:
        return f"{path} does not load ({exc})"
    _STATE["lib"] = lib
    _STATE["handles"] = {}
    alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
    _STATE["scalars"] = (alpha, beta, ctypes.addressof(alpha), ctypes.addressof(beta))
    return None


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"cuBLASLt {what} failed (cublasStatus_t {code})")


def _handle(device: int) -> int:
    handles = _STATE["handles"]
    h = handles.get(device)
    if h is None:
        ref = _VP()
        with torch.cuda.device(device):
            _check(_STATE["lib"].cublasLtCreate(ctypes.byref(ref)), "cublasLtCreate")
        h = handles[device] = ref.value
    return h


def _layout(dtype: torch.dtype, rows: int, cols: int, ld: int) -> int:
    ref = _VP()
    _check(_STATE["lib"].cublasLtMatrixLayoutCreate(ctypes.byref(ref), _TYPES[dtype], rows, cols, ld),
           "cublasLtMatrixLayoutCreate")
    return ref.value


@functools.lru_cache(maxsize=None)
def _desc(trans_a: int, trans_b: int) -> int:
    lib = _STATE["lib"]
    ref = _VP()
    _check(lib.cublasLtMatmulDescCreate(ctypes.byref(ref), _COMPUTE_32F, _R_32F), "cublasLtMatmulDescCreate")
    for attr, value in ((_DESC_TRANSA, trans_a), (_DESC_TRANSB, trans_b)):
        v = _I32(value)
        _check(lib.cublasLtMatmulDescSetAttribute(ref, attr, ctypes.byref(v), 4), "cublasLtMatmulDescSetAttribute")
    return ref.value


@functools.lru_cache(maxsize=None)
def _preference() -> int:
    lib = _STATE["lib"]
    ref = _VP()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(ref)), "cublasLtMatmulPreferenceCreate")
    size = _U64(WORKSPACE_BYTES)
    _check(lib.cublasLtMatmulPreferenceSetAttribute(ref, _PREF_MAX_WORKSPACE, ctypes.byref(size), 8),
           "cublasLtMatmulPreferenceSetAttribute")
    return ref.value


_LAYOUT_COLS = 3  # cublasLtMatrixLayoutAttribute_t CUBLASLT_MATRIX_LAYOUT_COLS (uint64)


class _Shape:
    """One product shape's descriptors for every token count of its class (see the module docstring): ``t`` is the
    count its layouts hold now, ``t_layouts`` the two layouts whose column count is ``t``. Owned by every
    :class:`Matmul` made from it: the layouts are destroyed with the last one."""

    __slots__ = ("args", "t", "t_layouts", "layouts", "result", "own")

    def __init__(self, handle: int, desc: int, layouts: tuple[int, int, int], t_layouts: tuple[int, int],
                 result, t: int):
        self.layouts, self.t_layouts, self.result, self.t = layouts, t_layouts, result, t
        la, lb, ld = layouts
        self.args = (handle, desc, la, lb, ld, ctypes.addressof(result))
        self.own: dict = {}  # t -> a _Shape of that t alone (cuBLASLt refused the class's algorithm for it)

    def set_t(self, t: int) -> None:
        lib, cols = _STATE["lib"], _U64(t)
        for layout in self.t_layouts:
            _check(lib.cublasLtMatrixLayoutSetAttribute(_VP(layout), _LAYOUT_COLS, ctypes.byref(cols), 8),
                   "cublasLtMatrixLayoutSetAttribute")
        self.t = t

    def __del__(self):
        try:
            lib = _STATE.get("lib")
            for layout in self.layouts if lib is not None else ():
                lib.cublasLtMatrixLayoutDestroy(_VP(layout))
        except Exception:  # interpreter shutdown (module globals already gone)
            pass


_SHAPES: dict = {}  # (thread, device, class key) -> _Shape


def _shape(device: int, trans_a: int, trans_b: int, dims: tuple[int, int, int], t_at: int,
           lds: tuple[int, int, int], ab: torch.dtype, d: torch.dtype, exact: bool = False) -> _Shape:
    """The :class:`_Shape` of ``D = op(A) . op(B)``, ``dims`` its column-major ``(m, n, k)``, ``dims[t_at]`` the
    token count: the class's (``exact``: one made for this ``t`` alone, with its own heuristic choice)."""
    m, n, k = dims
    t = dims[t_at]
    klass = tuple(-max(1, x - 1).bit_length() if i == t_at else x for i, x in enumerate(dims))
    key = (threading.get_ident(), device, trans_a, trans_b, klass, lds, ab, d)
    shape = None if exact else _SHAPES.get(key)
    if shape is not None:
        return shape
    lib = _STATE["lib"]
    handle = _handle(device)
    desc = _desc(trans_a, trans_b)
    made: list = []
    try:
        for dtype, rows, cols, ld in ((ab, *((k, m) if trans_a else (m, k)), lds[0]),
                                      (ab, *((n, k) if trans_b else (k, n)), lds[1]), (d, m, n, lds[2])):
            made.append(_layout(dtype, rows, cols, ld))
        result = (ctypes.c_byte * _RESULT_BYTES)()
        count = _I32(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, *made, made[2], _preference(), 1, result,
                                                  ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for m={m} n={n} k={k} ({ab} -> {d})")
    except BaseException:
        for layout in made:
            lib.cublasLtMatrixLayoutDestroy(_VP(layout))
        raise
    # the layouts whose column count is t: B and D when t is n (forward, input gradient), A and B when t is k
    t_layouts = (made[1], made[2]) if t_at == 1 else (made[0], made[1])
    shape = _Shape(handle, desc, tuple(made), t_layouts, result, t)
    if not exact:
        if len(_SHAPES) > 1024:  # a bound on memory (threads come and go), not a working limit
            _SHAPES.clear()  # (a shape's layouts go with the last Matmul holding it)
        _SHAPES[key] = shape
    return shape


class Matmul:
    """One GEMM shape on raw pointers, ``call(a, b, d, workspace, stream)``: the operands as
    :func:`linear`, :func:`input_grad` and :func:`weight_grad` order them, each 256-byte aligned (the heuristic's
    default alignment); ``workspace``: a device buffer of :data:`WORKSPACE_BYTES` that no other stream uses
    meanwhile. Raises ``RuntimeError`` with the ``cublasStatus_t`` when cuBLASLt fails."""

    __slots__ = ("call",)

    def __init__(self, shape: _Shape, t: int, make_own: Callable[[], _Shape] | None):
        own = shape.own.get(t)
        if own is not None:  # this t's own descriptors: a refusal there is final
            shape, make_own = own, None
        mm = _STATE["lib"].cublasLtMatmul
        alpha, beta = (_VP(v) for v in _STATE["scalars"][2:])
        size = _SZ(WORKSPACE_BYTES)
        # the fixed arguments as ctypes objects: ctypes passes them as they are (an int is converted per call)
        handle, desc, la, lb, ld, algo = (_VP(v) for v in shape.args)
        set_t = shape.set_t

        def call(a: int, b: int, d: int, workspace: int, stream: int, _shape=shape) -> None:
            # (_shape: the layouts and the algorithm stay while this function exists)
            if _shape.t != t:
                set_t(t)
            code = mm(handle, desc, alpha, a, la, b, lb, beta, d, ld, d, ld, algo, workspace, size, stream)
            if code:
                refused(a, b, d, workspace, stream, code)

        def refused(a: int, b: int, d: int, workspace: int, stream: int, code: int) -> None:
            # cuBLASLt checks the algorithm against the layouts on every call: the class's does not take this t
            if make_own is None:
                raise RuntimeError(f"cuBLASLt cublasLtMatmul failed (cublasStatus_t {code})")
            own = shape.own.get(t)
            if own is None:
                if len(shape.own) >= 256:  # a long-running service meets many token counts: keep this bounded
                    shape.own.clear()
                own = shape.own[t] = make_own()
            h, dsc, oa, ob, od, oalgo = (_VP(v) for v in own.args)
            again = mm(h, dsc, alpha, a, oa, b, ob, beta, d, od, d, od, oalgo, workspace, size, stream)
            if again:
                raise RuntimeError(f"cuBLASLt cublasLtMatmul failed (cublasStatus_t {again}; {code} with the "
                                   "algorithm of its token-count class)")

        self.call = call


def _matmul(device: int, trans_a: int, trans_b: int, dims: tuple[int, int, int], t_at: int,
            lds: tuple[int, int, int], ab: torch.dtype, d: torch.dtype) -> Matmul:
    shape = _shape(device, trans_a, trans_b, dims, t_at, lds, ab, d)
    return Matmul(shape, dims[t_at], lambda: _shape(device, trans_a, trans_b, dims, t_at, lds, ab, d, exact=True))


def linear(t: int, n: int, k: int, dtype: torch.dtype, device: int) -> Matmul:
    """``y [t, n] = x [t, k] @ w [n, k].T``, all ``dtype``, contiguous: ``call(w, x, y, ...)``."""
    return _matmul(device, 1, 0, (n, t, k), 1, (k, k, n), dtype, dtype)


def input_grad(t: int, n: int, k: int, dtype: torch.dtype, device: int) -> Matmul:
    """``dx [t, k] = dy [t, n] @ w [n, k]``, all ``dtype``, contiguous: ``call(w, dy, dx, ...)``."""
    return _matmul(device, 0, 0, (k, t, n), 1, (k, n, k), dtype, dtype)


def weight_grad(t: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype, device: int) -> Matmul:
    """``dw [n, k] = dy [t, n].T @ x [t, k]`` (``dy``, ``x`` of ``dtype``; ``dw`` of ``out_dtype``, from the fp32
    accumulator), contiguous: ``call(x, dy, dw, ...)``."""
    return _matmul(device, 0, 1, (k, n, t), 2, (k, n, k), dtype, out_dtype)


__all__ = ["Matmul", "WORKSPACE_BYTES", "input_grad", "linear", "status", "weight_grad"]
