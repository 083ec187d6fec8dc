"""Short no-grad eager calls as raw-pointer launches over one reused workspace.

An eager ModernBERT-base forward of a short batch launches ~155 Triton kernels and spends its time on the host:
per launch, a ``torch.empty`` for the output, the wrapper's reads of shapes, strides and dtypes, and the launch.
For a plan whose every op is one of the Triton kernels that take raw pointers (:attr:`..ops.OpSet.pointers`: the
LayerNorms, the small GEMMs, the RoPE-fused Triton attention; see :func:`plan_runs_pointers`), this module runs
the layers on integers instead: the activations live in one workspace, allocated once per (device, stream,
geometry) and reused by later calls on that stream (stream order serialises them; threads sharing a stream take
turns enqueueing), and each op launches
its already-compiled kernel through the signature a tensor launch bound (``ops.triton._runtime.Bound``). The maths
and the kernels are the tensor path's (:func:`..model.forward.encoder_forward`): results are bit-identical.

Weights are read from the live modules on every call, as the tensor path reads them. A call this module cannot
run (a signature not bound yet, the fast launcher off or launch hooks on, a weight of another dtype, non-contiguous
or misaligned, dropout in train mode, a layer 0 with a norm, ...) returns ``None`` and the caller runs the tensor
path, which binds what was missing; nothing it wrote is visible (only the workspace is written before the output).

Checked as CUDA graphs are: the first run of each launch class (geometry, dtype, device, the GEMM and attention
configs its sizes select) is compared with the tensor path, bit for bit, and the tensor path's result returned;
a mismatch turns raw-pointer runs off for the process with a warning (:func:`off_reason` says why).
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..batch import PackedBatch
from .params import ModernBertParams

_WORKSPACES: dict = {}
_MAX_WORKSPACES = 16
_ALIGN = 256  # bytes between buffers: every pointer 16-byte aligned, as the bound signatures require
_VERIFIED: set = set()  # launch classes whose first run matched the tensor path
_STATE: dict = {"off": None}  # why raw-pointer runs are off for this process (a failed check), or None
_LOCAL = threading.local()  # .declined: the tensor path is running for a check (no raw-pointer run inside it)


def off_reason() -> str | None:
    """Why raw-pointer runs are off for this process (a run disagreed with the tensor path), or ``None``."""
    return _STATE["off"]


def plan_runs_pointers(plan) -> bool:
    """Whether a :class:`..model.plan.Plan` can run here: unchecked Triton ops (``ops.pointers``), the projections
    and ``Wi`` + GLU on the small Triton GEMM, and every layer's attention in the Triton kernel with RoPE fused."""
    return (plan.direct and getattr(plan.ops, "pointers", False) and plan.linear_route == "small_gemm"
            and plan.glu == "small_gemm"
            and all(step.backend == "triton" and step.rope_in_attention and not step.rope_linear
                    for step in plan.layers))


def _workspace(device: torch.device, tokens: int, hidden: int, inner: int, dtype: torch.dtype,
               stream: int) -> tuple[torch.Tensor, int, threading.Lock]:
    """``(buffer, capacity in tokens, lock)`` of this (device, stream, geometry)'s workspace, grown to hold
    ``tokens`` (a power of two, at least 64). Buffers per token: the residual stream, the normed input, ``qkv``,
    the attention output, the projection output and the GLU output (ModernBERT-base, bf16: 13 KB per token,
    3.3 MB at 256 tokens, 53 MB at 4,096). The caller holds the lock while it enqueues (two threads interleaving
    launches on one stream would interleave their writes) and the buffer until it has: a workspace replaced or
    dropped meanwhile is freed only after, in its stream's order."""
    key = (device, stream, hidden, inner, dtype)
    hit = _WORKSPACES.get(key)
    if hit is not None and hit[1] >= tokens:
        return hit
    capacity = max(64, 1 << (tokens - 1).bit_length())
    per_token = (7 * hidden + inner) * dtype.itemsize
    hit = (torch.empty(capacity * per_token + 6 * _ALIGN, dtype=torch.uint8, device=device), capacity,
           threading.Lock())
    if len(_WORKSPACES) >= _MAX_WORKSPACES:
        _WORKSPACES.pop(next(iter(_WORKSPACES), None), None)
    _WORKSPACES[key] = hit
    return hit


def _offsets(base: int, capacity: int, hidden: int, inner: int, itemsize: int) -> tuple[int, ...]:
    out = []
    at = -(-base // _ALIGN) * _ALIGN
    for width in (hidden, hidden, 3 * hidden, hidden, hidden, inner):
        out.append(at)
        at += -(-capacity * width * itemsize // _ALIGN) * _ALIGN
    return tuple(out)


def _ptr(t: torch.Tensor | None, dtype: torch.dtype, numel: int) -> int | None:
    """``t``'s data pointer when it is a contiguous ``dtype`` tensor of ``numel`` elements (``None``: no tensor);
    ``-1`` otherwise (the call then takes the tensor path)."""
    if t is None:
        return None
    if t.dtype is not dtype or t.numel() != numel or not t.is_contiguous():
        return -1
    return t.data_ptr()


def _dropout_active(m: nn.Module) -> bool:
    return isinstance(m, nn.Dropout) and m.training and m.p > 0


def run(model: nn.Module, params: ModernBertParams, batch: PackedBatch, plan, rope_inputs,
        tensor_path: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """The encoder's ``[T, hidden]`` output (after ``final_norm``) for ``batch``, or ``None`` when the call must take
    the tensor path (see the module docstring). ``plan``: a plan for which :func:`plan_runs_pointers` holds;
    ``rope_inputs(model, params, batch)``: the forward's ``{is_global: (cos, sin, rows)}`` tables;
    ``tensor_path()``: the same call on the tensor path (run once per launch class, to check the first run)."""
    if _STATE["off"] is not None or getattr(_LOCAL, "declined", False):
        return None
    out = _run(model, params, batch, plan, rope_inputs)
    if out is None:
        return None
    key = _launch_class(params, batch, out.dtype, out.device)
    if key in _VERIFIED:
        return out
    _LOCAL.declined = True
    try:
        ref = tensor_path()
    finally:
        _LOCAL.declined = False
    if torch.equal(out, ref):
        if len(_VERIFIED) > 4096:
            _VERIFIED.clear()
        _VERIFIED.add(key)
    else:
        diff = float((out.float() - ref.float()).abs().max())
        _STATE["off"] = (f"a raw-pointer run disagreed with the tensor path (max abs difference {diff:.3g}, "
                         f"{batch.total_tokens} tokens, {batch.num_seqs} sequences): off for this process")
        warnings.warn(f"packed_encoders: {_STATE['off']}; please report it", RuntimeWarning, stacklevel=2)
    return ref


def _launch_class(params: ModernBertParams, batch: PackedBatch, dtype: torch.dtype, device: torch.device) -> tuple:
    """What selects the kernels and launch shapes of a run: geometry, dtype, device and the size classes (the
    LayerNorm tile, the four GEMMs' configs, the attention tiles of the windows in reach)."""
    from ..attention import triton_short
    from ..ops.triton import layer_norm, small_gemm

    t, h, i = batch.total_tokens, params.hidden_size, params.intermediate_size
    config = small_gemm.default_config
    windows = tuple(params.layer_window(n) is not None and params.layer_window(n) < batch.max_seqlen - 1
                    for n in range(params.num_hidden_layers))
    return (params, dtype, device, layer_norm._forward_shape(t, h, dtype.itemsize), config(t, 3 * h, h),
            config(t, h, h), config(t, 2 * i, h, glu=True), config(t, h, i), windows,
            triton_short.tile_config(batch.max_seqlen, params.head_dim, False),
            triton_short.tile_config(batch.max_seqlen, params.head_dim, True))


def _run(model: nn.Module, params: ModernBertParams, batch: PackedBatch, plan, rope_inputs) -> torch.Tensor | None:
    if batch.inputs_embeds is not None or batch.key_lens is not None or batch.cu_seqlens.dtype is not torch.int32:
        return None
    emb = model.embeddings
    if _dropout_active(emb.drop):
        return None
    table = emb.tok_embeddings.weight
    dtype = table.dtype
    device = batch.device
    if device.type != "cuda" or table.device != device:
        return None
    from ..ops.triton._runtime import bound_ok

    if not bound_ok():  # the fast launcher off (PACKED_ENCODERS_TRITON_FAST_LAUNCH=0) or launch hooks on
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != torch._C._cuda_getDevice():
        return None
    stream = torch._C._cuda_getCurrentRawStream(index)
    buf, capacity, lock = _workspace(device, batch.total_tokens, params.hidden_size, params.intermediate_size, dtype,
                                     stream)
    with lock:
        return _enqueue(model, params, batch, plan, rope_inputs, buf, capacity, dtype, index, stream)


def _enqueue(model, params, batch, plan, rope_inputs, buf, capacity, dtype, index, stream) -> torch.Tensor | None:
    """:func:`_run`'s launches on the workspace ``buf`` (its lock held)."""
    from ..attention import triton_short
    from ..ops.triton import layer_norm, small_gemm
    from ..ops.triton.glu import ACTIVATIONS

    emb = model.embeddings
    table = emb.tok_embeddings.weight
    device = batch.device
    total = batch.total_tokens
    hidden, heads, head_dim = params.hidden_size, params.num_attention_heads, params.head_dim
    inner = params.intermediate_size
    act = ACTIVATIONS[params.activation]
    x, normed, qkv, att, delta, gated = _offsets(buf.data_ptr(), capacity, hidden, inner, dtype.itemsize)
    ln = layer_norm.forward_pointers
    gemm = small_gemm.launch_pointers
    attend = triton_short.launch_pointers

    def norm_args(m: nn.Module):
        return _ptr(m.weight, dtype, hidden), _ptr(getattr(m, "bias", None), dtype, hidden), m.eps

    e = F.embedding(batch.input_ids, table, emb.tok_embeddings.padding_idx)
    w, b, eps = norm_args(emb.norm)
    if w == -1 or b == -1 or not ln(e.data_ptr(), None, w, b, None, x, total, hidden, eps, dtype, index, stream):
        return None
    rope = {}
    tables = rope_inputs(model, params, batch)  # held until the launches reading them are enqueued
    for is_global, (cos, sin, rows) in tables.items():
        if (cos.dtype is not torch.float32 or not cos.is_contiguous() or not sin.is_contiguous()
                or not rows.is_contiguous()):
            return None
        rope[is_global] = (cos.data_ptr(), sin.data_ptr(), rows.data_ptr(), rows.dtype)
    cu = batch.cu_seqlens.data_ptr()
    num_seqs, max_seqlen, scale = batch.num_seqs, batch.max_seqlen, params.scaling
    pending = False
    for i, layer in enumerate(model.layers):
        step = plan.layers[i]
        attn, mlp = layer.attn, layer.mlp
        if attn.training and params.attention_dropout_of(attn) or _dropout_active(attn.out_drop) \
                or _dropout_active(mlp.drop):
            return None
        wqkv, wo, wi, wo2 = attn.Wqkv, attn.Wo, mlp.Wi, mlp.Wo
        pq = _ptr(wqkv.weight, dtype, 3 * hidden * hidden)
        bq = _ptr(wqkv.bias, dtype, 3 * hidden)
        po = _ptr(wo.weight, dtype, hidden * hidden)
        bo = _ptr(wo.bias, dtype, hidden)
        pi = _ptr(wi.weight, dtype, 2 * inner * hidden)
        bi = _ptr(wi.bias, dtype, 2 * inner)
        po2 = _ptr(wo2.weight, dtype, hidden * inner)
        bo2 = _ptr(wo2.bias, dtype, hidden)
        if -1 in (pq, bq, po, bo, pi, bi, po2, bo2):
            return None
        if isinstance(layer.attn_norm, nn.Identity):
            if pending:  # (ModernBERT's first layer only: nothing to add yet)
                return None
            src = x
        else:
            w, b, eps = norm_args(layer.attn_norm)
            if w == -1 or b == -1 or not ln(x, delta if pending else None, w, b, x if pending else None, normed, total,
                                            hidden, eps, dtype, index, stream):
                return None
            src = normed
        if not (gemm(src, pq, bq, qkv, total, hidden, 3 * hidden, None, dtype, index, stream)
                and attend(qkv, att, cu, num_seqs, total, max_seqlen, heads, head_dim, step.window, scale,
                           rope[params.layer_is_global[i]], dtype, index, stream)
                and gemm(att, po, bo, delta, total, hidden, hidden, None, dtype, index, stream)):
            return None
        w, b, eps = norm_args(layer.mlp_norm)
        if w == -1 or b == -1 or not (
                ln(x, delta, w, b, x, normed, total, hidden, eps, dtype, index, stream)
                and gemm(normed, pi, bi, gated, total, hidden, inner, act, dtype, index, stream)
                and gemm(gated, po2, bo2, delta, total, inner, hidden, None, dtype, index, stream)):
            return None
        pending = True
    out = torch.empty((total, hidden), dtype=dtype, device=device)
    w, b, eps = norm_args(model.final_norm)
    if w == -1 or b == -1 or not ln(x, delta if pending else None, w, b, x if pending else None, out.data_ptr(), total,
                                    hidden, eps, dtype, index, stream):
        return None
    return out


__all__ = ["off_reason", "plan_runs_pointers", "run"]
