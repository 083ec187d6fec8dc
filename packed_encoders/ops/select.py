"""Choose the per-token op implementation (:class:`~packed_encoders.ops.OpSet`) for a device.

``kernels``:

- ``"torch"``: plain PyTorch ops.
- ``"triton"``: Triton kernels (:mod:`packed_encoders.ops.fused`); CUDA, or CPU while
  ``TRITON_INTERPRET=1`` (interpreted, for tests).
- ``"cute"``: quack's CuteDSL LayerNorm with Triton RoPE/GLU (:mod:`packed_encoders.ops.cute`); CUDA sm_90+.
- ``"auto"``: on CUDA the first family of :data:`AUTO_ORDER` that imports, else plain PyTorch.

With a fused family on an sm_90 GPU where quack imports, the projections of forwards without gradient go to
quack's CuteDSL GEMMs where they were measured faster than cuBLAS (the ``Wi`` GEMM with the GLU in its
epilogue; :mod:`packed_encoders.ops.quack_gemm`); the ``tuning`` read at ``pack()`` says whether
(``PACKED_ENCODERS_QUACK_GEMM``, ``_QUACK_ROPE``, ``_FUSED_GLU_GEMM``); nothing here reads the environment.

Returns the op set and a sentence saying why, for ``describe()``. Nothing is imported until asked for:
``import packed_encoders`` works with neither Triton nor cutlass installed.
"""

from __future__ import annotations

import torch

from ..errors import PackedEncodersError
from ..tuning import Tuning
from . import TORCH_OPS, OpSet

KERNEL_CHOICES = ("auto", "torch", "triton", "cute")

# Preference of "auto" on CUDA. Triton first until benchmarks/kernels.py measures the cute family
# faster on the H200 (the cute family also runs Triton for RoPE and the GLU).
AUTO_ORDER = ("triton", "cute")


def _triton_ops(device: torch.device) -> tuple[OpSet, str]:
    from .triton import interpret_enabled

    if device.type not in ("cuda", "cpu"):
        raise PackedEncodersError(f"kernels='triton' needs a CUDA device (got {device.type})")
    if device.type == "cpu" and not interpret_enabled():
        raise PackedEncodersError("kernels='triton' needs a CUDA device; on CPU only with TRITON_INTERPRET=1 "
                                  "(the interpreter, for tests)")
    try:
        from .fused import TRITON_OPS
    except Exception as exc:  # ImportError, or a Triton install that fails to initialise
        raise PackedEncodersError(f"kernels='triton': Triton is not importable ({exc.__class__.__name__}: {exc})") \
            from exc
    if device.type == "cpu":
        from .triton._runtime import interpreter_unavailable

        why = interpreter_unavailable()
        if why:
            raise PackedEncodersError(f"kernels='triton' cannot interpret on CPU: {why}")
        return TRITON_OPS, "Triton kernels, interpreted on CPU (TRITON_INTERPRET=1)"
    return TRITON_OPS, "Triton kernels"


def _cute_ops(device: torch.device) -> tuple[OpSet, str]:
    from .cute import unavailable

    why = unavailable(device)
    if why:
        raise PackedEncodersError(f"kernels='cute': {why}")
    from .cute.opset import CUTE_OPS

    return CUTE_OPS, "quack CuteDSL LayerNorm with Triton RoPE/GLU"


_FAMILIES = {"triton": _triton_ops, "cute": _cute_ops}


def _with_gemms(ops: OpSet, reason: str, device: torch.device, tuning: Tuning) -> tuple[OpSet, str]:
    """The fused op set with quack GEMMs where the route can run on ``device``; the reason says which."""
    from . import quack_gemm

    why = quack_gemm.unavailable(device, tuning.quack_gemm)
    if why:
        return ops, f"{reason}; GEMMs: F.linear ({why})"
    return quack_gemm.with_quack_gemms(ops, rope=tuning.quack_rope, small_glu=tuning.fused_glu_gemm), (
        f"{reason}; GEMMs: quack CuteDSL for Wi + GLU from {quack_gemm.GLU_MIN_TOKENS} tokens and the measured "
        "projection shapes (forwards without gradient), cuBLAS otherwise")


def select_ops(kernels: str, device: torch.device, tuning: Tuning | None = None) -> tuple[OpSet, str]:
    """``(op_set, reason)`` for ``kernels`` on ``device``, with the quack switches of ``tuning`` (default: a
    default ``Tuning()``, every switch on).

    Raises:
        PackedEncodersError: ``kernels`` is not one of :data:`KERNEL_CHOICES`, or an explicitly requested
            family cannot run on ``device`` (the message says why).
    """
    if kernels not in KERNEL_CHOICES:
        raise PackedEncodersError(f"kernels={kernels!r} is not one of {KERNEL_CHOICES}")
    device = torch.device(device)
    tuning = tuning if tuning is not None else Tuning()
    if kernels == "torch":
        return TORCH_OPS, "plain PyTorch ops (requested)"
    if kernels != "auto":
        ops, what = _FAMILIES[kernels](device)
        return _with_gemms(ops, f"{what} (requested)", device, tuning)
    if device.type != "cuda":
        return TORCH_OPS, f"plain PyTorch ops (auto: fused kernels run on CUDA; device is {device.type})"
    refused = []
    for family in AUTO_ORDER:
        try:
            ops, what = _FAMILIES[family](device)
        except PackedEncodersError as exc:
            refused.append(str(exc))
            continue
        return _with_gemms(ops, f"{what} (auto: first of {AUTO_ORDER} that runs here)", device, tuning)
    return TORCH_OPS, "plain PyTorch ops (auto: no fused family runs here: " + "; ".join(refused) + ")"
