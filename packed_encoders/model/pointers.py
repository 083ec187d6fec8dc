"""No-grad eager calls as raw-pointer launches over one workspace per call.

An eager ModernBERT-base forward of a batch of a few thousand tokens or fewer is host-bound: ~200 launches, and
per launch a ``torch.empty`` for the output, the wrapper's reads of shapes, strides and dtypes, and the launch.
For a plan whose ops this module can launch (see :func:`plan_runs_pointers`: the op set's Triton kernels that
take raw pointers, the LayerNorms, GLU and RoPE; the projections on the small Triton GEMM or cuBLAS; attention in
the RoPE-fused Triton kernel or FlashAttention-2 / -4), it runs the layers on integers instead: the activations live
in one workspace, allocated once per call from the caching allocator (in :mod:`.workspace`'s size classes), each
Triton op launches its already-compiled kernel through the signature a tensor launch bound
(``ops.triton._runtime.Bound``), cuBLAS projections without biases run through cuBLASLt on pointers
(:mod:`..ops.cublaslt`; ``torch.mm`` / ``torch.addmm`` on workspace views where a projection has a bias or an
operand is not 256-byte aligned), and FlashAttention-2 (``aten::_flash_attention_forward``) or FlashAttention-4
(its compiled kernels, :mod:`..attention.fa4_direct`) reads and writes tensor views of the workspace made once per
call. The maths, the kernels and their launch shapes are the tensor path's
(:func:`..model.forward.encoder_forward`): results are bit-identical, except that cuBLASLt's algorithm for a
projection may sum in another order than ``torch.mm``'s.

Weights are read from the live modules on every call, as the tensor path reads them. A call this module cannot
run (a signature not bound yet, the fast launcher off or launch hooks on, a weight of another dtype, non-contiguous
or misaligned, dropout in train mode, a layer 0 with a norm, ...) returns ``None`` and the caller runs the tensor
path, which binds what was missing; nothing it wrote is visible (only the workspace is written before the output).

Checked as CUDA graphs are: the first run of each launch class (geometry, dtype, device, routes, the GEMM and
attention configs its sizes select) is compared with the tensor path (bit for bit; with cuBLASLt projections,
every row's cosine >= 0.999: see :func:`_agrees`), and the tensor path's result returned; a mismatch turns
raw-pointer runs off for the process with a warning (:func:`off_reason` says why).
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import fa4_direct
from ..batch import PackedBatch
from ..ops import cublaslt
from . import workspace
from .dropout import rate
from .live import param, sub
from .params import ModernBertParams
from .workspace import pointer as _ptr

_ALIGN = workspace.ALIGN  # bytes between buffers: every pointer 16-byte aligned, as the bound signatures require
_VERIFIED: set = set()  # launch classes whose first run matched the tensor path
_STATE: dict = {"off": None}  # why raw-pointer runs are off for this process (a failed check), or None
_LOCAL = threading.local()  # .declined: the tensor path is running for a check (no raw-pointer run inside it)
_LINEAR_ROUTES = ("small_gemm", "F.linear")
_GLU_ROUTES = ("small_gemm", "split")
_FLASH = ("varlen", "fa4")  # attention on tensor views of the workspace, after the RoPE kernel


def off_reason(launch: bool = False) -> str | None:
    """Why raw-pointer runs are off for this process (a run disagreed with the tensor path), or ``None``;
    ``launch``: also why they cannot launch now (the fast Triton launcher they go through is off: see
    :func:`..ops.triton._runtime.fast_launch_off`; imports Triton)."""
    if _STATE["off"] is not None or not launch:
        return _STATE["off"]
    from ..ops.triton._runtime import fast_launch_off

    return fast_launch_off()


def plan_runs_pointers(plan) -> bool:
    """Whether a :class:`..model.plan.Plan` can run here: unchecked Triton ops (``ops.pointers``), the projections
    on the small Triton GEMM or ``F.linear`` (cuBLAS), ``Wi`` + GLU fused in the Triton GEMM or ``F.linear`` then the
    GLU kernel, and every layer's attention in the Triton kernel with RoPE fused or in FlashAttention-2 (torch
    ``varlen``) or -4 after the RoPE kernel."""
    return (plan.direct and getattr(plan.ops, "pointers", False) and plan.linear_route in _LINEAR_ROUTES
            and plan.glu in _GLU_ROUTES and (plan.glu != "split" or plan.linear_route == "F.linear")
            and all(not step.rope_linear and (step.rope_in_attention if step.backend == "triton"
                                              else step.backend in _FLASH and not step.rope_in_attention)
                    for step in plan.layers))


def _widths(hidden: int, inner: int, pre: bool) -> tuple[int, ...]:
    """Columns of the workspace's buffers, in order: the residual stream, the normed input, ``qkv``,
    the attention output, the projection output, the GLU output and (``pre``: ``Wi`` and the GLU as two launches)
    ``Wi``'s output."""
    return (hidden, hidden, 3 * hidden, hidden, hidden, inner) + ((2 * inner,) if pre else ())


def _layout(tokens: int, widths: tuple[int, ...], itemsize: int, lt: bool) -> tuple[int, tuple[int, ...], int | None]:
    """The workspace for ``tokens`` rows: ``(bytes, each buffer's offset, the cuBLASLt workspace's offset or None)``,
    offsets from an ``_ALIGN``-aligned base (:func:`.workspace.empty`), each ``_ALIGN``-aligned; the cuBLASLt
    workspace only when the projections go through cuBLASLt (``lt``)."""
    arena = workspace.Arena()
    offsets = tuple(arena.add(tokens * width * itemsize) for width in widths)
    lt_at = arena.add(cublaslt.WORKSPACE_BYTES) if lt else None
    return arena.size, offsets, lt_at


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
    key = _launch_class(params, batch, plan, out.dtype, out.device)
    if key in _VERIFIED:
        return out
    _LOCAL.declined = True
    try:
        ref = tensor_path()
    finally:
        _LOCAL.declined = False
    if _agrees(out, ref, exact=not _lt_projections(plan, model)):
        if len(_VERIFIED) > 4096:
            _VERIFIED.clear()
        _VERIFIED.add(key)
    else:
        diff = float((out.float() - ref.float()).abs().max())
        _STATE["off"] = (f"a raw-pointer run disagreed with the tensor path (max abs difference {diff:.3g}, "
                         f"{batch.total_tokens} tokens, {batch.num_seqs} sequences): off for this process")
        warnings.warn(f"packed_encoders: {_STATE['off']}; please report it", RuntimeWarning, stacklevel=2)
    return ref


def _agrees(out: torch.Tensor, ref: torch.Tensor, exact: bool) -> bool:
    """Whether a raw-pointer run's output matches the tensor path's: bit for bit where both make the same kernel
    calls; with cuBLASLt projections (whose algorithm may sum in another order than ``torch.mm``'s cuBLAS call),
    every row's cosine at least 0.999 and every finite entry where the tensor path's is (a wrong pointer or stride
    shows as whole rows of another token's or buffer's values, far below that)."""
    if torch.equal(out, ref):
        return True
    if exact:
        return False
    a, b = out.float(), ref.float()
    if not torch.equal(a.isfinite(), b.isfinite()):
        return False
    a, b = a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0)
    return bool(F.cosine_similarity(a, b, dim=-1, eps=1e-6).min() >= 0.999)


def _launch_class(params: ModernBertParams, batch: PackedBatch, plan, dtype: torch.dtype,
                  device: torch.device) -> tuple:
    """What selects the kernels and launch shapes of a run: geometry, dtype, device, the routes, and the size
    classes (the LayerNorm tile, the four GEMMs' configs, the attention tiles of the windows in reach,
    FlashAttention-4's ``max_seqlen`` span; cuBLAS and FlashAttention-2 are the tensor path's own calls)."""
    from ..attention import triton_short
    from ..ops.triton import layer_norm, small_gemm

    t, h, i = batch.total_tokens, params.hidden_size, params.intermediate_size
    config = small_gemm.default_config
    windows = tuple(params.layer_window(n) is not None and params.layer_window(n) < batch.max_seqlen - 1
                    for n in range(params.num_hidden_layers))
    # the Triton attention kernel's tiles exist only for its head dims; other geometries never launch it
    short = params.head_dim in triton_short.HEAD_DIMS
    tiles = triton_short.tile_config(batch.max_seqlen, params.head_dim, False) if short else None
    tiles_local = triton_short.tile_config(batch.max_seqlen, params.head_dim, True) if short else None
    return (params, dtype, device, plan.linear_route, plan.glu, tuple(step.backend for step in plan.layers),
            layer_norm._forward_shape(t, h, dtype.itemsize), config(t, 3 * h, h), config(t, h, h),
            config(t, 2 * i, h, glu=True), config(t, h, i), windows,
            tiles, tiles_local,
            fa4_direct.span_of(batch.max_seqlen) if any(step.backend == "fa4" for step in plan.layers) else None)


def _run(model: nn.Module, params: ModernBertParams, batch: PackedBatch, plan, rope_inputs) -> torch.Tensor | None:
    if batch.inputs_embeds is not None or batch.key_lens is not None or batch.cu_seqlens.dtype is not torch.int32:
        return None
    emb = sub(model, "embeddings")
    if rate(sub(emb, "drop")):
        return None
    table = param(sub(emb, "tok_embeddings"), "weight")
    device = batch.device
    if device.type != "cuda" or table.device != device:
        return None
    from ..ops.triton._runtime import bound_ok

    if not bound_ok():  # the fast launcher off (off_reason(launch=True) says why)
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index != torch._C._cuda_getDevice():
        return None
    # one allocation per call, from the caching allocator on the current stream: later calls reuse its block, and
    # nothing stays reserved for this path alone
    dtype = table.dtype
    widths = _widths(params.hidden_size, params.intermediate_size, plan.glu == "split")
    nbytes, offsets, lt_at = _layout(batch.total_tokens, widths, dtype.itemsize, _lt_projections(plan, model))
    ws, base = workspace.empty(nbytes, device)
    return _enqueue(model, params, batch, plan, rope_inputs, ws, tuple(base + at for at in offsets), widths, dtype,
                    index, torch._C._cuda_getCurrentRawStream(index), None if lt_at is None else base + lt_at)


def _lt_projections(plan, model: nn.Module) -> bool:
    """Whether the call's cuBLAS projections go through cuBLASLt on pointers (:mod:`..ops.cublaslt`: less host time
    per GEMM than ``torch.mm``): projections without biases (ModernBERT's), the library loadable."""
    if plan.linear_route != "F.linear" or cublaslt.status() is not None:
        return False
    return not any(_biases(model))


def _biases(model: nn.Module) -> tuple[bool, bool, bool, bool]:
    """Whether the first layer's ``Wqkv``, attention ``Wo``, ``Wi`` and MLP ``Wo`` have biases."""
    first = sub(model, "layers")[0]
    attn, mlp = sub(first, "attn"), sub(first, "mlp")
    return tuple(param(sub(m, name), "bias", None) is not None
                 for m, name in ((attn, "Wqkv"), (attn, "Wo"), (mlp, "Wi"), (mlp, "Wo")))


def _enqueue(model, params, batch, plan, rope_inputs, ws, offsets, widths, dtype, index, stream,
             lt_ws: int | None) -> torch.Tensor | None:
    """:func:`_run`'s launches on the workspace ``ws``: every launcher resolved once (one per kernel and launch
    shape), then the layers. ``offsets``: the addresses of its buffers (of ``widths`` columns, :func:`_layout`);
    ``lt_ws``: the cuBLASLt workspace's address when the projections go through cuBLASLt
    (:func:`_lt_projections`), else ``None``."""
    from ..attention import triton_short
    from ..ops.triton import glu as glu_kernel
    from ..ops.triton import layer_norm, small_gemm
    from ..ops.triton import rope as rope_kernel
    from ..ops.triton.glu import ACTIVATIONS

    emb = sub(model, "embeddings")
    tokens = sub(emb, "tok_embeddings")
    table = param(tokens, "weight")
    device = batch.device
    total = batch.total_tokens
    hidden, heads, head_dim = params.hidden_size, params.num_attention_heads, params.head_dim
    inner = params.intermediate_size
    act = ACTIVATIONS[params.activation]
    x, normed, qkv, att, delta, gated = offsets[:6]
    pre = offsets[6] if len(offsets) > 6 else None
    steps = plan.layers
    flash = any(step.backend in _FLASH for step in steps)
    cublas = plan.linear_route == "F.linear"

    # what every norm and projection must look like for the launchers below (checked again on each module)
    emb_norm = sub(emb, "norm")
    has_w, has_b = param(emb_norm, "weight") is not None, param(emb_norm, "bias", None) is not None
    biases = _biases(model)
    ln = layer_norm.forward_launcher(total, hidden, False, has_w, has_b, dtype, index, stream)
    ln_res = layer_norm.forward_launcher(total, hidden, True, has_w, has_b, dtype, index, stream)
    if ln is None or ln_res is None:
        return None
    rope = {}
    tables = rope_inputs(model, params, batch)  # held until the launches reading them are enqueued
    for is_global, (cos, sin, rows) in tables.items():
        ptrs = (_ptr(cos, torch.float32, cos.numel()), _ptr(sin, torch.float32, sin.numel()),
                _ptr(rows, rows.dtype, rows.numel()))
        if -1 in ptrs:
            return None
        rope[is_global] = (*ptrs, rows.dtype)
    attend = []
    launchers: dict = {}
    for i, step in enumerate(steps):
        rows_dtype = rope[params.layer_is_global[i]][3]
        key = (step.backend, step.window, rows_dtype)
        if key not in launchers:
            launchers[key] = (
                rope_kernel.forward_launcher(total, heads, head_dim, rows_dtype, dtype, index, stream)
                if step.backend in _FLASH else
                triton_short.launcher(batch.num_seqs, total, batch.max_seqlen, heads, head_dim, step.window,
                                      params.scaling, rows_dtype, dtype, index, stream))
        if launchers[key] is None:
            return None
        attend.append(launchers[key])
    glu = None if pre is None else glu_kernel.forward_launcher(total, inner, act, dtype, index, stream)
    wi_glu = None if pre is not None else small_gemm.launcher(total, hidden, inner, act, biases[2], dtype, index,
                                                              stream)
    if (glu or wi_glu) is None:
        return None

    if cublas or flash:
        typed = ws.view(dtype)
        base = ws.data_ptr()

        def view(at: int, *shape: int) -> torch.Tensor:
            # a tensor over one workspace buffer, for cuBLAS and FlashAttention-2 (one view per buffer and call)
            cols = shape[-1] if len(shape) == 2 else shape[1] * shape[2] * shape[3]
            strides = (cols, 1) if len(shape) == 2 else (cols, shape[2] * shape[3], shape[3], 1)
            return typed.as_strided(shape, strides, (at - base) // dtype.itemsize)

    if flash:  # the views FlashAttention reads, rotated in place by the RoPE kernel; FlashAttention-4's output
        q, k, v = view(qkv, total, 3, heads, head_dim).unbind(1)
        att_view = typed.as_strided((total, heads, head_dim), (hidden, head_dim, 1), (att - base) // dtype.itemsize)
    if cublas:
        tensors: dict = {}  # the buffers' views, made at the first torch.mm of the call

        def mm(src, weight: torch.Tensor, bias: torch.Tensor | None, dst: int) -> None:
            # F.linear's own cuBLAS call (addmm with a bias, mm without), written into the workspace
            if not tensors:
                tensors.update((at, view(at, total, width)) for at, width in zip(offsets, widths))
            src = src if type(src) is torch.Tensor else tensors[src]
            if bias is None:
                torch.mm(src, weight.t(), out=tensors[dst])
            else:
                torch.addmm(bias, src, weight.t(), out=tensors[dst])

        if lt_ws is not None:
            shapes = ((3 * hidden, hidden), (hidden, hidden), (2 * inner, hidden), (hidden, inner))
            lt = tuple(cublaslt.linear(total, n, k, dtype, index).call for n, k in shapes)

            def project(src, weight: torch.Tensor, bias: torch.Tensor | None, dst: int, which: int) -> None:
                a, w = (src if type(src) is int else src.data_ptr()), weight.data_ptr()
                if (a | w) & (_ALIGN - 1):  # cuBLASLt's algorithms assume 256-byte aligned operands
                    mm(src, weight, bias, dst)
                else:
                    lt[which](w, a, dst, lt_ws, stream)
        else:
            def project(src, weight: torch.Tensor, bias: torch.Tensor | None, dst: int, _: int) -> None:
                mm(src, weight, bias, dst)
    else:
        gemms = (small_gemm.launcher(total, hidden, 3 * hidden, None, biases[0], dtype, index, stream),
                 small_gemm.launcher(total, hidden, hidden, None, biases[1], dtype, index, stream),
                 None,
                 small_gemm.launcher(total, inner, hidden, None, biases[3], dtype, index, stream))
        if None in (gemms[0], gemms[1], gemms[3]):
            return None

        def project(src, weight: torch.Tensor, bias: torch.Tensor | None, dst: int, which: int) -> None:
            w = weight.data_ptr()
            gemms[which](src if type(src) is int else src.data_ptr(), w, w if bias is None else bias.data_ptr(), dst)

    def norm(m: nn.Module):
        # (weight, bias, eps) pointers of a norm shaped as the launchers expect (an absent one: any valid pointer)
        w, b = _ptr(param(m, "weight"), dtype, hidden), _ptr(param(m, "bias", None), dtype, hidden)
        if w == -1 or b == -1 or (w is not None) != has_w or (b is not None) != has_b:
            return None
        return (x if w is None else w), (x if b is None else b), m.eps

    e = F.embedding(batch.input_ids, table, tokens.padding_idx)
    args = norm(emb_norm)
    if args is None:
        return None
    ln(e.data_ptr(), x, args[0], args[1], x, x, args[2])
    cu = batch.cu_seqlens.data_ptr()
    if cu & 15:
        return None
    max_seqlen, scale = batch.max_seqlen, params.scaling
    pending = False
    for i, layer in enumerate(sub(model, "layers")):
        step = steps[i]
        attn, mlp = sub(layer, "attn"), sub(layer, "mlp")
        if attn.training and params.attention_dropout_of(attn) or rate(sub(attn, "out_drop")) \
                or rate(sub(mlp, "drop")):
            return None
        lqkv, lo, li, lo2 = sub(attn, "Wqkv"), sub(attn, "Wo"), sub(mlp, "Wi"), sub(mlp, "Wo")
        wqkv, wo, wi, wo2 = param(lqkv, "weight"), param(lo, "weight"), param(li, "weight"), param(lo2, "weight")
        bqkv, bo, bi, bo2 = (param(lqkv, "bias", None), param(lo, "bias", None), param(li, "bias", None),
                             param(lo2, "bias", None))
        checked = (_ptr(wqkv, dtype, 3 * hidden * hidden), _ptr(bqkv, dtype, 3 * hidden),
                   _ptr(wo, dtype, hidden * hidden), _ptr(bo, dtype, hidden), _ptr(wi, dtype, 2 * inner * hidden),
                   _ptr(bi, dtype, 2 * inner), _ptr(wo2, dtype, hidden * inner), _ptr(bo2, dtype, hidden))
        if -1 in checked or (bqkv is not None, bo is not None, bi is not None, bo2 is not None) != biases:
            return None
        attn_norm = sub(layer, "attn_norm")
        if isinstance(attn_norm, nn.Identity):
            if pending:  # (ModernBERT's first layer only: nothing to add yet)
                return None
            src = x
        else:
            args = norm(attn_norm)
            if args is None:
                return None
            if pending:
                ln_res(x, delta, args[0], args[1], x, normed, args[2])
            else:
                ln(x, x, args[0], args[1], x, normed, args[2])
            src = normed
        project(src, wqkv, bqkv, qkv, 0)
        cos, sin, rows, _ = rope[params.layer_is_global[i]]
        if step.backend in _FLASH:
            attend[i](qkv, cos, sin, rows)
            if step.backend == "fa4" and fa4_direct.forward(q, k, v, batch.cu_seqlens, max_seqlen, window=step.window,
                                                            scale=scale, out=att_view) is not None:
                a = att
            else:
                a = step.attention(q, k, v, batch.cu_seqlens, max_seqlen, window=step.window, scale=scale)
                a = a.view(total, hidden) if cublas else a
        else:
            attend[i](qkv, att, cu, cos, sin, rows)
            a = att
        project(a, wo, bo, delta, 1)
        a = None
        args = norm(sub(layer, "mlp_norm"))
        if args is None:
            return None
        ln_res(x, delta, args[0], args[1], x, normed, args[2])
        if pre is None:  # Wi and the GLU in one Triton launch
            w = wi.data_ptr()
            wi_glu(normed, w, w if bi is None else bi.data_ptr(), gated)
        else:
            project(normed, wi, bi, pre, 2)
            glu(pre, gated)
        project(gated, wo2, bo2, delta, 3)
        pending = True
    out = torch.empty((total, hidden), dtype=dtype, device=device)
    args = norm(sub(model, "final_norm"))
    if args is None:
        return None
    if pending:
        ln_res(x, delta, args[0], args[1], x, out.data_ptr(), args[2])
    else:
        ln(x, x, args[0], args[1], x, out.data_ptr(), args[2])
    return out


__all__ = ["off_reason", "plan_runs_pointers", "run"]
