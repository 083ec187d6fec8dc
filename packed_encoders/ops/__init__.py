"""Per-token ops of the packed forward. Each op has an fp32 ``*_ref`` specification and a plain PyTorch
implementation; fused kernels plug in as another :class:`OpSet` behind the same signatures.
Never imports transformers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .geglu import geglu_ref, geglu_torch
from .layer_norm import layer_norm_ref, layer_norm_torch, residual_layer_norm_ref, residual_layer_norm_torch
from .rope import rope_qkv_ref, rope_qkv_torch, rope_tables


@dataclass(frozen=True)
class OpSet:
    """One implementation of every per-token op.

    - ``layer_norm(x [T, H], weight [H] | None, bias [H] | None, eps) -> [T, H]``
    - ``residual_layer_norm(x, delta, weight, bias, eps) -> (x + delta, LN(x + delta))``
    - ``rope_qkv(qkv [T, 3*nh*hd], cos, sin, position_ids [T], nh, hd) -> (q, k, v)``, each ``[T, nh, hd]``
    - ``glu(x [T, 2I], activation) -> [T, I]``
    """

    name: str
    layer_norm: Callable
    residual_layer_norm: Callable
    rope_qkv: Callable
    glu: Callable


TORCH_OPS = OpSet("torch", layer_norm_torch, residual_layer_norm_torch, rope_qkv_torch, geglu_torch)

__all__ = [
    "OpSet", "TORCH_OPS", "geglu_ref", "geglu_torch", "layer_norm_ref", "layer_norm_torch",
    "residual_layer_norm_ref", "residual_layer_norm_torch", "rope_qkv_ref", "rope_qkv_torch", "rope_tables",
]
