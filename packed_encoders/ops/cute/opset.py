"""``CUTE_OPS``: quack's CuteDSL LayerNorm, with the Triton ops for RoPE and the GLU.

Per call, LayerNorm inputs that quack's public API does not take route to the Triton op (which
may route further to plain PyTorch): a missing weight, an fp32 output requested for low-precision
input (CUDA autocast), a hidden size that is not a multiple of 8 (quack vectorises rows in 16-byte
chunks; other sizes are not exercised by its tests), or anything the Triton op itself would refuse.
Those routes are recorded and reported by :func:`fallbacks` together with the Triton op set's own.

The unchecked launches (``direct``) and the training blocks (``kernels``) are the Triton family's, LayerNorm
included (:data:`SUBSTITUTIONS`, shown by ``describe()``).

No CuteDSL RoPE or GLU kernel is written here: quack's rotary kernel takes positions from
``cu_seqlens`` rather than ``position_ids`` and rotates in place, and its gated activations live in
GEMM epilogues; a new CuteDSL kernel could not be tested on the machine this was written on.
"""

from __future__ import annotations


import torch
from torch import Tensor

from .. import FusedOpSet, RouteLog
from .. import fused as _triton
from . import layer_norm as _cute_ln

_LOG = RouteLog("triton: ")
_route = _LOG.record


def fallbacks() -> dict[str, dict[str, int]]:
    """Routes away from quack (``"triton: <why>"``) merged with the Triton ops' own routes to PyTorch
    (process-wide: the Triton op set's record is shared with ``TRITON_OPS``)."""
    out = _LOG.snapshot()
    for op, reasons in _triton.fallbacks().items():
        out.setdefault(op, {}).update(reasons)
    return out


def reset_fallbacks() -> None:
    """Clear this op set's routes and the Triton op set's record."""
    _LOG.clear()
    _triton.reset_fallbacks()


def _quack_refuses(s: Tensor, weight: Tensor | None, bias: Tensor | None,
                   out_dtype: torch.dtype | None = None) -> str | None:
    why = _triton._ln_unsupported(s, None, weight, bias)
    if why:
        return why
    if s.device.type != "cuda":
        return f"{s.device.type} tensors"
    if weight is None:
        return "no weight (quack's layernorm_fwd needs one)"
    if out_dtype is None and _triton._norm_out_dtype(s.dtype, s.device) != s.dtype:
        return "fp32 output under CUDA autocast"
    if out_dtype is not None and out_dtype != s.dtype:
        return f"{out_dtype} output for {s.dtype} input"
    if s.shape[-1] % 8:
        return f"hidden size {s.shape[-1]} not a multiple of 8"
    return None


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
               out_dtype: torch.dtype | None = None) -> Tensor:
    why = _quack_refuses(x, weight, bias, out_dtype)
    if why:
        _route("layer_norm", why)
        return _triton.layer_norm(x, weight, bias, eps, out_dtype)
    shape = x.shape
    return _cute_ln.layer_norm(x.reshape(-1, shape[-1]), weight, bias, eps).view(shape)


def residual_layer_norm(x: Tensor, delta: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                        out_dtype: torch.dtype | None = None):
    probe = x if x.dtype == torch.promote_types(x.dtype, delta.dtype) else delta  # carries the dtype of s
    why = _triton._ln_unsupported(x, delta, weight, bias) or _quack_refuses(probe, weight, bias, out_dtype)
    if why:
        _route("residual_layer_norm", why)
        return _triton.residual_layer_norm(x, delta, weight, bias, eps, out_dtype)
    s = x + delta  # rounded to the stream dtype: the package's rounding policy
    return s, layer_norm(s, weight, bias, eps, out_dtype)


def smoke(device) -> None:
    """Compile and run quack's LayerNorm and the Triton smoke kernels on ``device``; raises on failure."""
    from . import unavailable
    from ..layer_norm import layer_norm_ref

    device = torch.device(device)
    why = unavailable(device)
    if why:
        raise RuntimeError(f"cute kernels cannot run on {device}: {why}")
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 128, generator=g).to(device, torch.bfloat16)
    w = torch.randn(128, generator=g).to(device)
    err = (_cute_ln.layer_norm(x, w, None, 1e-5).float() - layer_norm_ref(x, w, None, 1e-5)).abs().max().item()
    if not err < 0.1:
        raise RuntimeError(f"quack LayerNorm smoke test on {device}: max error {err:.3g} against the fp32 reference")
    _triton.smoke(device)


# Training blocks and unchecked eager launches use the Triton LayerNorm: quack's costs ~15 us more host time
# per launch, which a host-bound eager forward pays in full. describe() says so (SUBSTITUTIONS).
SUBSTITUTIONS = ("LayerNorm: Triton's, not quack's, on the unchecked path (forwards without gradient that the op "
                 "set covers, eager and CUDA-graph captures) and in the per-block training autograd: quack's costs "
                 "~15 us more host time per launch; quack's LayerNorm runs on the checked path (torch.compile, "
                 "PACKED_ENCODERS_LEAN=0, inputs the unchecked path does not cover)",)
CUTE_OPS = FusedOpSet("cute", layer_norm, residual_layer_norm, _triton.rope_qkv, _triton.glu, _triton.glu_linear,
                      smoke=smoke, fallbacks=fallbacks, direct=_triton.DIRECT_OPS, covers=_triton.covers,
                      kernels=_triton.TRITON_KERNELS, substitutions=SUBSTITUTIONS, lora_merge=_triton.lora_merge)
