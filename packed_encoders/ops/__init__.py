"""Per-token ops of the packed forward. Each op has an fp32 ``*_ref`` specification and a plain PyTorch
implementation; fused kernels plug in as another :class:`OpSet` behind the same signatures.
Never imports transformers."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from .geglu import geglu_ref, geglu_torch, glu_bwd_torch
from .layer_norm import (layer_norm_bwd_torch, layer_norm_fwd_torch, layer_norm_ref, layer_norm_torch,
                         residual_layer_norm_ref, residual_layer_norm_torch)
from .rope import (pair_freq_table, pair_order, rope_linear_ref, rope_linear_torch, rope_qkv_bwd_torch, rope_qkv_ref,
                   rope_qkv_torch, rope_tables, rotate_pairs, to_pair_order)


@dataclass(frozen=True)
class Kernels:
    """The raw forward / backward launches of one op family, for autograd functions that span several ops (the
    block functions of :mod:`packed_encoders.model.blocks`). No routing, no checks: the caller checked the call.

    - ``ln_fwd(x, delta, weight, bias, eps, out_dtype, res_dtype) -> (s, y, mean, rstd)``
    - ``ln_bwd(dy, s, weight, mean, rstd, dres, has_bias, dx_dtype, dx2_dtype, reduce=True) -> (dx, dx2, dw, db)``
      (``reduce=False``: ``dw``, ``db`` as fp32 ``[P, H]`` partial sums, for a caller that reduces many at once)
    - ``rope_fwd(qkv, cos, sin, rows, nh, hd) -> (q, k)``, the caller not reading ``qkv``'s q and k thirds afterwards:
      the Triton family rotates inside ``qkv`` (q and k its views, so q, k and the caller's v view share one
      buffer), the torch family returns new tensors (as stock HF, whose CPU attention then sums in the same order);
      ``rope_bwd(dq, dk, dv, cos, sin, rows, nh, hd, dtype) -> dqkv``
    - ``glu_fwd(x, activation) -> y``; ``glu_bwd(dy, x, activation, forward_out=False) -> dx``, or ``(dx, y)`` with
      ``forward_out`` (``y`` equal to ``glu_fwd``'s, for a backward that did not keep it)
    - ``rope_finite_v``: ``rope_fwd`` also zeroes the non-finite entries of ``qkv``'s v third (the attention then
      needs no cleaning pass, :attr:`packed_encoders.attention.backends.Backend.finite_v`)
    """

    name: str
    ln_fwd: Callable
    ln_bwd: Callable
    rope_fwd: Callable
    rope_bwd: Callable
    glu_fwd: Callable
    glu_bwd: Callable
    rope_finite_v: bool = False


def _rope_fwd_torch(qkv, cos, sin, position_ids, num_heads, head_dim):
    q, k, _ = rope_qkv_torch(qkv, cos, sin, position_ids, num_heads, head_dim)
    return q, k


TORCH_KERNELS = Kernels("torch", layer_norm_fwd_torch, layer_norm_bwd_torch, _rope_fwd_torch, rope_qkv_bwd_torch,
                        geglu_torch, glu_bwd_torch)


@dataclass(frozen=True)
class OpSet:
    """One implementation of every per-token op.

    - ``layer_norm(x [T, H], weight [H] | None, bias [H] | None, eps, out_dtype=None) -> [T, H]``
    - ``residual_layer_norm(x, delta, weight, bias, eps, out_dtype=None) -> (x + delta, LN(x + delta))``
      (``out_dtype``: the normed output's dtype, rounded once from the fp32 result, for a caller that feeds it
      to a projection in that dtype; ``None``: ``F.layer_norm``'s, i.e. fp32 under CUDA autocast)
    - ``rope_qkv(qkv [T, 3*nh*hd], cos, sin, position_ids [T], nh, hd) -> (q, k, v)``, each ``[T, nh, hd]`` (a
      forward-only op set may rotate q and k inside ``qkv``: the caller does not read ``qkv`` afterwards)
    - ``glu(x [T, 2I], activation) -> [T, I]``
    - ``glu_linear(x [T, K], weight [2I, K], bias [2I] | None, activation) -> [T, I]``, or ``None``: the ``Wi``
      projection and the GLU in one op, for forwards without gradient only (no backward)
    - ``linear(x [T, K], weight [N, K], bias [N] | None) -> [T, N]``, or ``None`` (``F.linear``): the
      projections of forwards without gradient (:mod:`.quack_gemm` routes measured shapes to quack)
    - ``rope_linear(x [T, K], weight [3*nh*hd, K], bias, positions [T] fp32, freq [2*nh*hd] fp32, nh, hd)``
      ``-> (q, k, v) | None``, or ``None``: the ``Wqkv`` projection with RoPE applied on the way out, for forwards
      without gradient only; q and k come back in *pair order* (:func:`.rope.pair_order`), v in HF order.
      The callable returns ``None`` for a call it does not take (the forward then projects and rotates apart)
    - ``kernels``: the family's raw launches (:class:`Kernels`) for the per-block autograd of training forwards,
      or ``None`` (the ops above run one autograd node each)
    - ``norm_out``: ``layer_norm`` and ``residual_layer_norm`` take ``out=`` (a ``[T, H]`` tensor the normed output
      is written into when its dtype is the one they produce, e.g. a CUDA graph's shared static output)
    - ``gemm``: which GEMMs the op set runs, for ``describe()``: ``"torch"`` (``F.linear``: cuBLAS on CUDA) or
      ``"quack"`` (quack where :mod:`.quack_gemm` routes a call, ``F.linear`` for the rest)
    - ``rope_finite_v``: the ``v`` that ``rope_qkv`` returns has its non-finite entries zeroed (as
      :attr:`Kernels.rope_finite_v`)
    - ``residual_in_place``: ``residual_layer_norm`` that writes the sum over ``x`` and returns it, for a caller
      that owns ``x`` and does not read it again (the packed forward's layers), or ``None``
    - ``lora_merge(weight [N, K], a [r, K], b [N, r], scale: float, dtype) -> [N, K] | None``: a peft LoRA slot's
      merged weight ``weight + scale * b @ a`` in ``dtype`` for a call without gradients, summed in fp32 and rounded
      once in one pass (:func:`packed_encoders.model.calls.merged_weights`); ``None`` for operands it does not take
      (the caller's torch ops serve them), or no such op
    - ``pointers``: the ops are the Triton kernels that :mod:`packed_encoders.model.pointers` launches on raw
      pointers (a plan of these ops may run a short call there instead)
    """

    name: str
    layer_norm: Callable
    residual_layer_norm: Callable
    rope_qkv: Callable
    glu: Callable
    glu_linear: Callable | None = field(default=None, compare=False)
    linear: Callable | None = field(default=None, compare=False)
    rope_linear: Callable | None = field(default=None, compare=False)
    gemm: str = field(default="torch", compare=False)
    kernels: Kernels | None = field(default=None, compare=False)
    norm_out: bool = field(default=False, compare=False)
    rope_finite_v: bool = field(default=False, compare=False)
    residual_in_place: Callable | None = field(default=None, compare=False)
    pointers: bool = field(default=False, compare=False)
    lora_merge: Callable | None = field(default=None, compare=False)


@dataclass(frozen=True)
class FusedOpSet(OpSet):
    """An :class:`OpSet` of fused kernels, with a toolchain check and a record of per-call fallbacks.

    - ``smoke(device)``: compile and run a tiny kernel on ``device``; raises (any exception) when the
      toolchain cannot. ``validation.py`` calls it when present.
    - ``fallbacks()``: ``{op_name: {reason: calls}}`` for calls that this op set routed to the plain
      PyTorch op because the kernels do not cover the inputs (CPU tensors outside interpret mode,
      an unsupported dtype or activation, a hidden size beyond the kernel's limit). Empty when every
      call ran fused. ``describe()`` can report it per encoder as
      ``entry["kernel_fallbacks"] = state.ops.fallbacks() if hasattr(state.ops, "fallbacks") else {}``.
      Counts are per eager call; under ``torch.compile`` a fallback is recorded when it is traced.
    - ``direct``: the same ops without per-call routing checks, forward only (no gradient): a forward that
      asked ``covers(device, dtype, hidden, num_heads, head_dim, activation)`` once and got ``None`` launches
      them directly (:mod:`packed_encoders.model.plan`). ``None``: every call goes through the checked ops.
    - ``substitutions``: sentences naming the kernels ``direct`` or ``kernels`` run in place of this family's own
      (``describe()["kernel_substitutions"]``), e.g. the cute family's Triton LayerNorm there.
    """

    smoke: Callable = field(default=None, compare=False)
    fallbacks: Callable = field(default=None, compare=False)
    direct: OpSet | None = field(default=None, compare=False)
    covers: Callable | None = field(default=None, compare=False)
    substitutions: tuple[str, ...] = field(default=(), compare=False)


class RouteLog:
    """Thread-safe counts ``{op: {prefix + reason: calls}}`` of calls an op set routed away from its kernels
    (what ``FusedOpSet.fallbacks()`` reports)."""

    def __init__(self, prefix: str = ""):
        self._prefix = prefix
        self._lock = threading.Lock()
        self._routes: dict[str, dict[str, int]] = {}

    def record(self, op: str, reason: str) -> None:
        key = self._prefix + reason
        with self._lock:
            per_op = self._routes.setdefault(op, {})
            per_op[key] = per_op.get(key, 0) + 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {op: dict(reasons) for op, reasons in self._routes.items()}

    def clear(self) -> None:
        with self._lock:
            self._routes.clear()


TORCH_OPS = OpSet("torch", layer_norm_torch, residual_layer_norm_torch, rope_qkv_torch, geglu_torch,
                  kernels=TORCH_KERNELS)

__all__ = [
    "FusedOpSet", "Kernels", "OpSet", "RouteLog", "TORCH_KERNELS", "TORCH_OPS", "geglu_ref", "geglu_torch",
    "glu_bwd_torch", "layer_norm_bwd_torch", "layer_norm_fwd_torch", "layer_norm_ref", "layer_norm_torch",
    "pair_freq_table", "pair_order", "residual_layer_norm_ref", "residual_layer_norm_torch", "rope_linear_ref",
    "rope_linear_torch", "rope_qkv_ref", "rotate_pairs", "to_pair_order", "rope_qkv_torch", "rope_tables",
]
