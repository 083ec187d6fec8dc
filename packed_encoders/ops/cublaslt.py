"""cuBLASLt GEMMs on raw device pointers, for the training stack's raw-pointer path (``model/stack_pointers.py``).

``torch.mm`` costs ~14-24 us of host time per call on the H200 machine (more than half of it cuBLAS's own: its
``cublasGemmEx`` path looks up an algorithm on every call), and an eager training step of ModernBERT-base makes
~530 of them. Here each GEMM shape class gets its descriptors and its algorithm once
(``cublasLtMatmulAlgoGetHeuristic``, ~0.35 ms on the H200 machine), and a call is one ``cublasLtMatmul`` through
``ctypes`` (~15 us there against ~24 for ``torch.mm`` in the same process). The library is the ``libcublasLt``
torch itself loaded (found in the process's mapped files), so no version can differ from torch's.

Row-major ``[rows, cols]`` tensors are column-major ``[cols, rows]`` matrices to cuBLAS, so the three products are
asked transposed: ``y = x @ w.T`` is ``y^T = w . x^T``.

An algorithm is chosen per (product, ``n``, ``k``, dtypes, power-of-two class of the token count ``t``): the
heuristic's first choice for the first ``t`` of its class, which cuBLASLt then checks (``cublasLtMatmulAlgoCheck``)
for every other ``t`` once; a ``t`` it refuses gets its own heuristic choice.
"""

from __future__ import annotations

import ctypes
import functools
import threading

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
        lib.cublasLtMatmulAlgoCheck.argtypes = [_VP, _VP, _VP, _VP, _VP, _VP, _VP, _VP]
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


class _Owned:
    """A plan's matrix layouts (destroyed with it) and its heuristic result (its algorithm at offset 0): held by
    every :class:`Matmul` of the plan, so that neither goes while one may still be called."""

    __slots__ = ("layouts", "result")

    def __init__(self, layouts: tuple, result):
        self.layouts, self.result = layouts, result

    def __del__(self):
        try:
            lib = _STATE.get("lib")
            for layout in self.layouts if lib is not None else ():
                lib.cublasLtMatrixLayoutDestroy(_VP(layout))
        except Exception:  # interpreter shutdown (module globals already gone)
            pass


_ALGOS: dict = {}  # (device, class key) -> heuristic result buffer (its algo at offset 0)
_PLANS: dict = {}  # (device, exact key) -> (handle, desc, layout a, layout b, layout d, algo address, _Owned)


def _plan(device: int, trans_a: int, trans_b: int, dims: tuple[int, int, int], t_at: int, lds: tuple[int, int, int],
          ab: torch.dtype, d: torch.dtype):
    """``(handle, desc, layout a, layout b, layout d, algo address, owner)`` of ``D = op(A) . op(B)``, ``dims`` its
    column-major ``(m, n, k)``, ``dims[t_at]`` the token count; ``owner`` (:class:`_Owned`) keeps the layouts and the
    algorithm alive."""
    key = (device, trans_a, trans_b, dims, lds, ab, d)
    plan = _PLANS.get(key)
    if plan is not None:
        return plan
    lib = _STATE["lib"]
    handle = _handle(device)
    desc = _desc(trans_a, trans_b)
    m, n, k = dims
    owner = _Owned((), None)
    la = _layout(ab, *((k, m) if trans_a else (m, k)), lds[0])
    owner.layouts = (la,)
    lb = _layout(ab, *((n, k) if trans_b else (k, n)), lds[1])
    owner.layouts = (la, lb)
    ld = _layout(d, m, n, lds[2])
    owner.layouts = (la, lb, ld)
    # the algorithm of this shape's class (the token count rounded up to a power of two), checked for this count
    klass = (device, trans_a, trans_b, tuple(-max(1, x - 1).bit_length() if i == t_at else x
                                             for i, x in enumerate(dims)), lds, ab, d)
    result = _ALGOS.get(klass)
    if result is not None:
        checked = (ctypes.c_byte * _RESULT_BYTES)()
        refused = lib.cublasLtMatmulAlgoCheck(handle, desc, la, lb, ld, ld, ctypes.addressof(result), checked)
        if refused or ctypes.c_size_t.from_buffer(checked, 64).value > WORKSPACE_BYTES:
            result = None
    if result is None:
        result = (ctypes.c_byte * _RESULT_BYTES)()
        count = _I32(0)
        _check(lib.cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, ld, ld, _preference(), 1, result,
                                                  ctypes.byref(count)), "cublasLtMatmulAlgoGetHeuristic")
        if count.value < 1:
            raise RuntimeError(f"cuBLASLt has no algorithm for m={m} n={n} k={k} ({ab} -> {d})")
        _ALGOS.setdefault(klass, result)
    owner.result = result
    if len(_PLANS) > 4096:  # token counts vary per batch: a bound on memory, not a working limit
        _PLANS.clear()  # (a plan's layouts go with the last Matmul holding it)
    plan = _PLANS[key] = (handle, desc, la, lb, ld, ctypes.addressof(result), owner)
    return plan


class Matmul:
    """One GEMM shape on raw pointers, ``call(a, b, d, workspace, stream)``: the operands as
    :func:`linear`, :func:`input_grad` and :func:`weight_grad` order them, each 256-byte aligned (the heuristic's
    default alignment); ``workspace``: a device buffer of :data:`WORKSPACE_BYTES` that no other stream uses
    meanwhile."""

    __slots__ = ("call",)

    def __init__(self, plan):
        # the fixed arguments as ctypes objects: ctypes passes them as they are (an int is converted per call)
        handle, desc, la, lb, ld, algo = (_VP(v) for v in plan[:6])
        mm = _STATE["lib"].cublasLtMatmul
        alpha, beta = (_VP(v) for v in _STATE["scalars"][2:])
        size = _SZ(WORKSPACE_BYTES)

        def call(a: int, b: int, d: int, workspace: int, stream: int, _owner=plan[6]) -> None:
            # (_owner: the layouts and the algorithm stay while this function exists)
            code = mm(handle, desc, alpha, a, la, b, lb, beta, d, ld, d, ld, algo, workspace, size, stream)
            if code:
                raise RuntimeError(f"cuBLASLt cublasLtMatmul failed (cublasStatus_t {code})")

        self.call = call


def linear(t: int, n: int, k: int, dtype: torch.dtype, device: int) -> Matmul:
    """``y [t, n] = x [t, k] @ w [n, k].T``, all ``dtype``, contiguous: ``call(w, x, y, ...)``."""
    return Matmul(_plan(device, 1, 0, (n, t, k), 1, (k, k, n), dtype, dtype))


def input_grad(t: int, n: int, k: int, dtype: torch.dtype, device: int) -> Matmul:
    """``dx [t, k] = dy [t, n] @ w [n, k]``, all ``dtype``, contiguous: ``call(w, dy, dx, ...)``."""
    return Matmul(_plan(device, 0, 0, (k, t, n), 1, (k, n, k), dtype, dtype))


def weight_grad(t: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype, device: int) -> Matmul:
    """``dw [n, k] = dy [t, n].T @ x [t, k]`` (``dy``, ``x`` of ``dtype``; ``dw`` of ``out_dtype``, from the fp32
    accumulator), contiguous: ``call(x, dy, dw, ...)``."""
    return Matmul(_plan(device, 0, 1, (k, n, t), 2, (k, n, k), dtype, out_dtype))


__all__ = ["Matmul", "WORKSPACE_BYTES", "input_grad", "linear", "status", "weight_grad"]
