"""The training stack (:mod:`.stack`) on raw pointers: one autograd node for every layer, launched as integers.

An eager training step of the stack's tensor form spends most of its host time outside the kernels: each Triton op
through its tensor wrapper (allocations, the launch key, ``data_ptr`` reads: ~40 us on the H200 machine's slower
hosts against ~7 us for the bound launch itself) and each ``torch.mm`` (~14-24 us, most of it cuBLAS's per-call
algorithm lookup). Here a call resolves its launchers once (:func:`prepare`): the op family's Triton kernels bound by
earlier tensor launches (``ops.triton._runtime.Bound``) and one cuBLASLt plan per GEMM shape
(:mod:`..ops.cublaslt`); then every layer runs on pointers. The forward allocates one buffer per layer for what its
backward reads (the norms' inputs, statistics and outputs, the MLP's input, ``qkv``) beside the attention's
outputs; the backward reuses one buffer per call for its transients (sizes in :mod:`.workspace`'s classes).
Attention runs on tensor views of ``qkv``: FlashAttention-4's compiled kernels where the plan chose it and
:mod:`..attention.fa4_direct` serves the call, else FlashAttention-2, aten's own forward and backward pair (as
:mod:`.stack`). The maths, the Triton kernels and their launch shapes are the tensor form's; the GEMMs are cuBLAS
kernels that cuBLASLt's heuristic picks (not necessarily ``torch.mm``'s), so results agree with the tensor form to
GEMM rounding, not bit for bit.

:func:`prepare` returns why (the tensor form runs) for a call it cannot run: not CUDA, cuBLASLt or the bound launcher
unavailable (``PACKED_ENCODERS_TRITON_FAST_LAUNCH=0``, a profiler's launch hooks), a kernel signature no tensor launch
has bound yet (the first step of a new dtype combination runs the tensor form and binds it), another attention backend
than FlashAttention-2 / -4, query-only tails (``key_lens``), dropout, projection biases, fp32 GEMMs, a layer after the
first without an ``attn_norm``, a weight of another dtype, non-contiguous or misaligned. GEMM operands are 256-byte
aligned (what cuBLASLt's heuristic assumes by default): the buffers by construction, the weights checked, the incoming
gradients and the attention's output copied where they are not.
"""

from __future__ import annotations

import torch

from ..attention.flash import (fa4_backward, fa4_forward_saving, torch_varlen_backward, torch_varlen_forward_saving,
                               torch_varlen_status)
from ..ops import cublaslt
from ..ops.weight_cast import expire
from . import workspace
from .blocks import SLOTS_PER_LAYER as _PER_LAYER
from .blocks import as_dtype, check_versions, first_order, slot_needs, take_layers
from .workspace import Arena as _Arena
from .workspace import pointer as _ptr

_ALIGN = workspace.ALIGN  # what cuBLASLt's heuristic assumes of its operands (the Triton kernels: 16)
_LOW = (torch.bfloat16, torch.float16)
_F32 = torch.float32


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and ``_ALIGN``-byte aligned (a copy from the caching allocator where it is not)."""
    if t.is_contiguous() and not t.data_ptr() & (_ALIGN - 1):
        return t
    return t.clone(memory_format=torch.contiguous_format)


class _Launchers:
    """Every launcher one call needs, for its token count and dtypes (``None`` fields: not bound yet)."""

    def __init__(self, t, h, inner, act, heads, head_dim, x_dt, res_dt, cdt, w_dts, has_w, has_b, rows_dt, device,
                 stream):
        from ..ops.triton import glu, layer_norm, rope

        self.ok = True
        w_dt = w_dts or res_dt  # (an absent weight's pointer is x's: the signature carries x's dtype)

        def need(launcher):
            if launcher is None:
                self.ok = False
            return launcher

        def ln_dtypes(x, d, s, y):
            return (x, d if d is not None else x, w_dt if has_w else x, w_dt if has_b else x,
                    s if s is not None else y, y)

        # residual + LN (attn_norm with pending, mlp_norm), and plain LN (attn_norm of a first layer with a norm)
        self.ln_res = need(layer_norm.forward_launcher(t, h, True, has_w, has_b, cdt, device, stream, stats=True,
                                                       dtypes=ln_dtypes(res_dt, cdt, res_dt, cdt)))
        self.ln0 = layer_norm.forward_launcher(t, h, False, has_w, has_b, cdt, device, stream, stats=True,
                                               dtypes=ln_dtypes(x_dt, None, None, cdt))
        self.rope = need(rope.forward_launcher(t, heads, head_dim, rows_dt, cdt, device, stream))
        self.glu = need(glu.forward_launcher(t, inner, act, cdt, device, stream))
        self.glu_bwd = need(glu.backward_launcher(t, inner, act, cdt, device, stream))
        self.rope_bwd = need(rope.backward_launcher(t, heads, head_dim, cdt, rows_dt, cdt, device, stream))
        two = res_dt is not cdt  # the residual and the branch differ in dtype: the gradient is written in both
        self.two = two
        ln_bwd_dts = (cdt, res_dt, w_dt if has_w else res_dt, res_dt, res_dt, cdt if two else res_dt)
        self.ln_bwd = need(layer_norm.backward_launcher(t, h, ln_bwd_dts, has_w, has_b, True, two, device, stream))
        self.programs = layer_norm.backward_programs(t, h, max(res_dt.itemsize, cdt.itemsize), device)
        shapes = ((3 * h, h), (h, h), (2 * inner, h), (h, inner))  # Wqkv, attention Wo, Wi, mlp Wo: (n, k)
        self.fwd = tuple(cublaslt.linear(t, n, k, cdt, device).call for n, k in shapes)
        self.dx = tuple(cublaslt.input_grad(t, n, k, cdt, device).call for n, k in shapes)
        self.dw = {}  # (n, k, out dtype) -> call, made on first use (the parameters' dtypes)
        self.t, self.cdt, self.device, self.stream = t, cdt, device, stream

    def weight_grad(self, n: int, k: int, out_dtype: torch.dtype):
        call = self.dw.get((n, k, out_dtype))
        if call is None:
            call = self.dw[(n, k, out_dtype)] = cublaslt.weight_grad(self.t, n, k, self.cdt, out_dtype,
                                                                     self.device).call
        return call


class PointerCall:
    """What :class:`PointerStack`'s forward and backward share (see :func:`prepare`)."""

    __slots__ = ("args", "batch", "cdt", "compute", "has_b", "launch", "launch_args", "params", "plan", "present",
                 "res_dt", "tables", "tensor_tables")


def prepare(model, params, batch, plan, x: torch.Tensor, args, tables: dict, present: tuple, compute: list,
            cdt: torch.dtype | None) -> PointerCall | str:
    """A :class:`PointerCall` for the stack call of ``x`` ``[T, H]`` (the embedding output), or why this call takes
    the tensor form (see the module docstring). ``args``: each layer's :func:`.blocks.layer_args`;
    ``tables``: ``{is_global: (cos, sin, rows)}``; ``present``: the weight slots that hold a tensor; ``compute``:
    per slot, the projection weights in the compute dtype (``None`` elsewhere)."""
    if x.device.type != "cuda" or torch.compiler.is_compiling() or plan.kernels is None \
            or plan.kernels.name != "triton" or batch.cu_seqlens.dtype is not torch.int32:
        return "not a CUDA call with the Triton kernel family and int32 cu_seqlens (or under torch.compile)"
    if batch.key_lens is not None:
        return "a query-only batch (key_lens): its attention gathers the keys on the tensor form"
    t, h = x.shape
    if t == 0 or x.dtype not in (_F32, *_LOW) or _ptr(x, x.dtype, x.numel(), _ALIGN) == -1:
        return "an empty batch, or an embedding output that is not a contiguous, aligned fp32 / bf16 / fp16 tensor"
    from ..ops.triton._runtime import bound_ok, fast_launch_off

    if cublaslt.status() is not None:
        return f"cuBLASLt: {cublaslt.status()}"
    if not bound_ok():
        return f"the bound Triton launcher is off: {fast_launch_off() or 'not decided before a first launch'}"
    device = x.device.index
    if device != torch._C._cuda_getDevice():
        return "the input is not on the current CUDA device"
    if any(step.backend not in ("varlen", "fa4") for step in plan.layers):
        return "a layer's attention is not FlashAttention-2 (torch varlen) or FlashAttention-4"
    if any(step.backend == "fa4" for step in plan.layers) and torch_varlen_status() is not None:
        # (FlashAttention-2 runs a layer whose FlashAttention-4 call fa4_direct does not serve)
        return f"FlashAttention-4 layers without FlashAttention-2 beside them ({torch_varlen_status()})"
    wdt = cdt
    first_w = compute[2]
    if wdt is None:
        wdt = first_w.dtype if first_w is not None else None
    if wdt not in _LOW:
        return "the projections do not run in bf16 / fp16"
    inner = params.intermediate_size
    has_w = has_b = None
    for index, (in_params, in_meta, out_params, out_meta) in enumerate(args):
        if out_meta[4] or out_meta[5] or params.attention_dropout_of(model.layers[index].attn):
            return "dropout"
        if not in_meta[2] and index:
            return "a layer after the first without attn_norm"
        if any(b is not None for b in (in_params[3], out_params[1], out_params[5], out_params[7])):
            return "projection biases"
        for norm, (w, b) in enumerate(((in_params[0], in_params[1]), (out_params[2], out_params[3]))):
            if norm == 0 and not in_meta[2]:  # (no attn_norm)
                continue
            if (has_w, has_b) == (None, None):
                has_w, has_b = w is not None, b is not None
            if (w is not None, b is not None) != (has_w, has_b):
                return "norms with and without weight or bias"
    if has_w is None:
        has_w = has_b = False
    norms = [t_ for in_params, _, out_params, _ in args
             for t_ in (in_params[0], in_params[1], out_params[2], out_params[3]) if t_ is not None]
    w_dts = {t_.dtype for t_ in norms}
    if len(w_dts) > 1 or any(_ptr(t_, t_.dtype, h) == -1 for t_ in norms):
        return "norm weights of several dtypes, or not contiguous / 16-byte aligned"
    sizes = (3 * h * h, h * h, 2 * inner * h, h * inner)
    for index, (in_params, _, out_params, _) in enumerate(args):
        slot = index * _PER_LAYER
        if any(_ptr(compute[slot + at], wdt, size, _ALIGN) in (-1, None) for at, size in zip((2, 4, 8, 10), sizes)):
            return "a projection weight (in the compute dtype) not contiguous or 256-byte aligned"
        if any(w.dtype not in (_F32, wdt) for w in (in_params[2], out_params[0], out_params[4], out_params[6])):
            return "a projection weight of another low-precision dtype than the compute dtype"
    res_dt = torch.promote_types(x.dtype, wdt)
    if res_dt is not x.dtype:
        return "the residual stream's dtype differs from the embedding output's"
    tables_ptrs = {}
    rows_dt = None
    for g, (cos, sin, rows) in tables.items():
        ptrs = (_ptr(cos, _F32, cos.numel()), _ptr(sin, _F32, sin.numel()), _ptr(rows, rows.dtype, rows.numel()))
        if -1 in ptrs or (rows_dt is not None and rows.dtype is not rows_dt):
            return "RoPE tables not contiguous fp32, or position rows of several dtypes"
        rows_dt = rows.dtype
        tables_ptrs[g] = ptrs
    from ..ops.triton.glu import ACTIVATIONS

    act = ACTIVATIONS.get(params.activation)
    if act is None:
        return "an activation the GLU kernel does not have"
    launch_args = (t, h, inner, act, params.num_attention_heads, params.head_dim, x.dtype, res_dt, wdt,
                   next(iter(w_dts)) if w_dts else None, has_w, has_b, rows_dt, device)
    launch = _Launchers(*launch_args, torch._C._cuda_getCurrentRawStream(device))
    if not launch.ok or (args[0][1][2] and launch.ln0 is None):
        return "a kernel signature no tensor launch has bound yet (the tensor form binds it)"
    call = PointerCall()
    call.params, call.batch, call.plan, call.args, call.has_b = params, batch, plan, args, has_b
    call.tables, call.tensor_tables, call.present, call.compute, call.cdt = tables_ptrs, tables, present, compute, wdt
    call.res_dt, call.launch, call.launch_args = res_dt, launch, launch_args
    return call


def _launchers_here(call: PointerCall) -> "_Launchers":
    """The call's launchers on the current stream (autograd runs a backward on its forward's stream; another one
    gets launchers of its own)."""
    stream = torch._C._cuda_getCurrentRawStream(call.launch.device)
    if stream == call.launch.stream:
        return call.launch
    launch = _Launchers(*call.launch_args, stream)
    if not launch.ok:
        raise RuntimeError("packed_encoders: a kernel the training stack bound in forward is unbound in backward")
    return launch


class PointerStack(torch.autograd.Function):
    """:class:`.stack.EncoderStack` on raw pointers: ``(x, pending)`` after every layer from the embedding output
    ``x`` ``[T, H]``; ``weights``: the present weight slots (``call.present``), inputs so that autograd delivers
    their gradients."""

    @staticmethod
    def forward(ctx, x, call: PointerCall, *weights):
        params, batch, cdt, res_dt = call.params, call.batch, call.cdt, call.res_dt
        launch = _launchers_here(call)
        t, h = x.shape
        inner = params.intermediate_size
        heads, head_dim = params.num_attention_heads, params.head_dim
        device = x.device
        isz, rsz = cdt.itemsize, res_dt.itemsize
        compute = call.compute
        last = len(call.args) - 1
        # what one layer's backward reads, in one buffer per layer: s (a first layer's is x), y (a first layer
        # without attn_norm: a cast of x), the first norm's statistics, x (the last layer's is the node's output),
        # y2, the second norm's statistics, h, qkv and, in a FlashAttention-4 layer, the attention's output and
        # log-sum-exp (FlashAttention-2 allocates its own)
        arenas = {}

        def layout(first: bool, final: bool, fa4: bool) -> tuple[int, tuple[int, ...]]:
            arena = _Arena()
            own = not first or call.args[0][1][2]
            at = (0 if first else arena.add(t * h * rsz), arena.add(t * h * isz) if own else 0,
                  arena.add(4 * t), arena.add(4 * t), 0 if final else arena.add(t * h * rsz),
                  arena.add(t * h * isz), arena.add(4 * t), arena.add(4 * t), arena.add(t * 2 * inner * isz),
                  arena.add(t * 3 * h * isz), arena.add(t * h * isz) if fa4 else 0,
                  arena.add(4 * heads * t) if fa4 else 0)
            arenas[first, final, fa4] = found = (arena.size, at)
            return found
        # one call's transients: the attention projection and pending (one buffer: a layer reads pending in its first
        # norm, before it writes the projection, and writes pending after its second norm read the projection), the
        # GLU output, the cuBLASLt workspace
        scratch = _Arena()
        at_o, at_g = scratch.add(t * h * isz), scratch.add(t * inner * isz)
        at_p = at_o
        at_ws = scratch.add(cublaslt.WORKSPACE_BYTES)
        tmp, tbase = workspace.empty(scratch.size, device)
        o_p, g_p, pend_p, ws = tbase + at_o, tbase + at_g, tbase + at_p, tbase + at_ws
        stream = launch.stream
        fwd_qkv, fwd_o, fwd_i, fwd_2 = launch.fwd
        cu = batch.cu_seqlens
        max_seqlen, scale = batch.max_seqlen, params.scaling
        layers = []
        x_t = x  # the residual stream as a tensor where it is one (the input; the last layer's output)
        x_p = x.data_ptr()
        pending = False
        x_out = pend_out = None
        for index, (in_params, in_meta, out_params, out_meta) in enumerate(call.args):
            slot = index * _PER_LAYER
            wqkv, wo, wi, w2 = compute[slot + 2], compute[slot + 4], compute[slot + 8], compute[slot + 10]
            step = call.plan.layers[index]
            fa4 = step.backend == "fa4"
            size, at = arenas.get((index == 0, index == last, fa4)) or layout(index == 0, index == last, fa4)
            buf, base = workspace.empty(size, device)
            s_p, y_p, m1, r1, xo_p, y2_p, m2, r2, h_p, qkv_p, att_p, lse_p = (base + a for a in at)
            keep = None  # tensors of a layer without attn_norm (its input, the input in the compute dtype)
            ln_w, ln_b = in_params[0], in_params[1]
            if in_meta[2]:
                w_p = ln_w.data_ptr() if ln_w is not None else x_p
                b_p = ln_b.data_ptr() if ln_b is not None else x_p
                if pending:
                    launch.ln_res(x_p, pend_p, w_p, b_p, s_p, y_p, m1, r1, in_meta[1])
                else:  # a first layer with a norm: s is x itself
                    launch.ln0(x_p, x_p, w_p, b_p, y_p, y_p, m1, r1, in_meta[1])
                    s_p = x_p
                    keep = (x_t,)
            else:  # ModernBERT's first layer: no attn_norm, nothing pending
                y_c = as_dtype(x_t, cdt)
                keep = (x_t, y_c)
                s_p, y_p = x_p, y_c.data_ptr()
            fwd_qkv(wqkv.data_ptr(), y_p, qkv_p, ws, stream)
            cos, sin, rows = call.tables[params.layer_is_global[index]]
            launch.rope(qkv_p, cos, sin, rows)
            typed, at_buf = buf.view(cdt), buf.data_ptr()
            q, k, v = (typed.as_strided((t, heads, head_dim), (3 * h, head_dim, 1), (qkv_p - at_buf) // isz + j * h)
                       for j in range(3))  # (views of qkv in buf)
            got = None
            if fa4:
                out = typed.as_strided((t, heads, head_dim), (h, head_dim, 1), (att_p - at_buf) // isz)
                lse = buf.view(_F32).as_strided((heads, t), (t, 1), (lse_p - at_buf) // 4)
                got = fa4_forward_saving(q, k, v, cu, max_seqlen, window=step.window, scale=scale, out=out, lse=lse)
                out = lse = None
            if got is not None:
                a, att = got[0], (fa4_backward, got[1])
            else:
                a, saved = torch_varlen_forward_saving(q, k, v, cu, max_seqlen, window=step.window, scale=scale)
                att = (torch_varlen_backward, saved)
            a = _aligned(a)  # (both allocate it contiguous: a check)
            a_p = a.data_ptr()
            fwd_o(wo.data_ptr(), a_p, o_p, ws, stream)
            if index == last:  # outputs of the node: tensors of their own
                x_out = torch.empty((t, h), dtype=res_dt, device=device)
                pend_out = torch.empty((t, h), dtype=cdt, device=device)
                xo_p = x_out.data_ptr()
            m_w, m_b = out_params[2], out_params[3]
            launch.ln_res(s_p, o_p, m_w.data_ptr() if m_w is not None else s_p,
                          m_b.data_ptr() if m_b is not None else s_p, xo_p, y2_p, m2, r2, out_meta[1])
            fwd_i(wi.data_ptr(), y2_p, h_p, ws, stream)
            launch.glu(h_p, g_p)
            fwd_2(w2.data_ptr(), g_p, pend_p if index < last else pend_out.data_ptr(), ws, stream)
            read = tuple((w_, w_._version) for w_ in (ln_w, m_w, wqkv, wo, wi, w2) if w_ is not None)
            x_keep = x_out.detach() if index == last else None  # (an output held by ctx would be a cycle)
            layers.append((buf, keep, x_keep, (s_p, y_p, m1, r1, xo_p, y2_p, m2, r2, h_p), (*att, a), read))
            x_p, pending = xo_p, True
        ctx.call, ctx.layers = call, layers
        del tmp  # (stream-ordered: the caching allocator reuses it only for work queued after these launches)
        return x_out, pend_out

    @staticmethod
    @first_order  # raw kernels: a double backward raises rather than returning wrong second derivatives
    def backward(ctx, dx, dpending):
        expire()  # the next forward casts the weights again (a hand-written update may come first)
        call = ctx.call
        layers, keep_graph = take_layers(ctx)
        params, cdt, res_dt = call.params, call.cdt, call.res_dt
        launch = _launchers_here(call)
        t, h = dx.shape
        inner = params.intermediate_size
        heads, head_dim = params.num_attention_heads, params.head_dim
        device = dx.device
        isz, rsz = cdt.itemsize, res_dt.itemsize
        stream = launch.stream
        n_layers = len(call.args)
        needs = slot_needs(call.present, ctx.needs_input_grad[2:], n_layers)
        grads: list = [None] * len(needs)
        dx = _aligned(as_dtype(dx, res_dt))
        dpending = (torch.zeros((t, h), dtype=cdt, device=device) if dpending is None
                    else _aligned(as_dtype(dpending, cdt)))
        # one call's transients. Across layers: the residual's gradient ds (the norms' backward adds into it in
        # place: each program reads its rows' incoming gradient before it writes them) and, with two dtypes, the
        # branch's (do, then the next layer's dpending). Within a layer the MLP's (dg, dh, g; dy2 in dg once the GLU
        # backward read it) and then the attention's (da, dqkv; dy1 in da once the attention's backward read it).
        two = launch.two
        scratch = _Arena()
        at_ds = scratch.add(t * h * rsz)
        at_do = scratch.add(t * h * isz) if two else at_ds
        phase = scratch.size
        at_dg, at_dh = scratch.add(t * max(inner, h) * isz), scratch.add(t * 2 * inner * isz)
        at_g = scratch.add(t * inner * isz)
        mlp_end, scratch.size = scratch.size, phase
        at_da, at_dqkv = scratch.add(t * h * isz), scratch.add(t * 3 * h * isz)
        scratch.size = max(scratch.size, mlp_end)
        at_dy2, at_dy1, at_dxo, at_dpo = at_dg, at_da, at_ds, at_do
        programs = launch.programs
        # the norms' partial sums, fp32 [2 norms (and 2 biases), P, H] per layer, allocated as each layer's backward
        # runs (the activations of the layers above are freed by then) and reduced once after the layers
        norm_rows = 4 if call.has_b else 2
        partials = []
        # FlashAttention-4's input gradients and scratch buffers: one set for every layer (each layer's RoPE backward
        # reads dq, dk, dv before the next layer's attention backward, queued after it on this stream, writes them)
        fa4_grads = None
        fa4_scratch: dict = {}
        at_ws = scratch.add(cublaslt.WORKSPACE_BYTES)
        tmp, base = workspace.empty(scratch.size, device)
        dg_p, dh_p, g_p, dy2_p, dy1_p = base + at_dg, base + at_dh, base + at_g, base + at_dy2, base + at_dy1
        ds_p, do_p, da_p, dqkv_p = base + at_ds, base + at_do, base + at_da, base + at_dqkv
        dxo_p, dpo_p, ws = base + at_dxo, base + at_dpo, base + at_ws
        typed = tmp.view(cdt)
        da = typed.as_strided((t, heads, head_dim), (h, head_dim, 1), (da_p - tmp.data_ptr()) // isz)
        part_stride = programs * h * 4
        (dx_qkv, dx_o, dx_i, dx_2), dw_of = launch.dx, launch.weight_grad
        dx_p, dp_p = dx.data_ptr(), dpending.data_ptr()
        dx_in = None  # the gradient of the node's input, from the first layer
        for index in range(n_layers - 1, -1, -1):
            in_params, in_meta, out_params, out_meta = call.args[index]
            buf, keep, x_keep, (s_p, y_p, m1, r1, xo_p, y2_p, m2, r2, h_p), att, read = layers[index]
            check_versions(read, index)
            if not keep_graph:
                layers[index] = None
            slot = index * _PER_LAYER
            compute = call.compute
            wqkv, wo, wi, w2 = compute[slot + 2], compute[slot + 4], compute[slot + 8], compute[slot + 10]
            part = torch.empty((norm_rows, programs, h), dtype=_F32, device=device)
            partials.append(part)
            parts = part.data_ptr()
            dw2, dwi, dwo, dwqkv = _weight_grads(
                (out_params[6], out_params[4], out_params[0], in_params[2]),
                (needs[slot + 10], needs[slot + 8], needs[slot + 4], needs[slot + 2]),
                ((h, inner), (2 * inner, h), (h, h), (3 * h, h)), device)
            # MLP: pending = W2 glu(Wi y2)
            dx_2(w2.data_ptr(), dp_p, dg_p, ws, stream)
            launch.glu_bwd(dg_p, h_p, dh_p, g_p)
            if dw2 is not None:
                grads[slot + 10] = _weight_grad(dw_of, dw2, out_params[6], g_p, dp_p, ws, stream)
            dx_i(wi.data_ptr(), dh_p, dy2_p, ws, stream)
            if dwi is not None:
                grads[slot + 8] = _weight_grad(dw_of, dwi, out_params[4], y2_p, dh_p, ws, stream)
            # mlp_norm (residual): x = s + o
            m_w = out_params[2]
            launch.ln_bwd(dy2_p, xo_p, m_w.data_ptr() if m_w is not None else xo_p, m2, r2, dx_p, ds_p, do_p,
                          parts + part_stride, parts + 3 * part_stride if call.has_b else m2)
            # attention output: o = Wo a
            attention_bwd, saved, a = att
            dx_o(wo.data_ptr(), do_p, da_p, ws, stream)
            if dwo is not None:
                grads[slot + 4] = _weight_grad(dw_of, dwo, out_params[0], a.data_ptr(), do_p, ws, stream)
            if attention_bwd is fa4_backward:
                if fa4_grads is None:
                    fa4_grads = torch.empty((3, t, heads, head_dim), dtype=cdt, device=device).unbind(0)
                dq, dk, dv = attention_bwd(da, saved, fa4_grads, fa4_scratch)
            else:
                dq, dk, dv = attention_bwd(da, saved)
            att = saved = a = None
            cos, sin, rows = call.tables[params.layer_is_global[index]]
            if all(g.is_contiguous() and not g.data_ptr() & 15 for g in (dq, dk, dv)):
                launch.rope_bwd(dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), cos, sin, rows, dqkv_p)
                dqkv_at = dqkv_p
            else:  # (both attentions write contiguous gradients; should that change, the tensor launch)
                dqkv_t = call.plan.kernels.rope_bwd(dq, dk, dv, *call.tensor_tables[params.layer_is_global[index]],
                                                    heads, head_dim, cdt)
                dqkv_at = dqkv_t.data_ptr()
            dx_qkv(wqkv.data_ptr(), dqkv_at, dy1_p, ws, stream)
            if dwqkv is not None:
                grads[slot + 2] = _weight_grad(dw_of, dwqkv, in_params[2], y_p, dqkv_at, ws, stream)
            dq = dk = dv = None
            if in_meta[2]:  # attn_norm: s = x + pending (or x alone in a first layer); ds joins as the residual's
                ln_w = in_params[0]
                if index == 0:  # the node's input gradient: a tensor of its own
                    dx_in = torch.empty((t, h), dtype=res_dt, device=device)
                    dxo_p = dx_in.data_ptr()
                launch.ln_bwd(dy1_p, s_p, ln_w.data_ptr() if ln_w is not None else s_p, m1, r1, ds_p, dxo_p,
                              dpo_p if two else dxo_p, parts, parts + 2 * part_stride if call.has_b else m1)
                dx_p, dp_p = dxo_p, (dpo_p if two else dxo_p)
            else:  # no attn_norm: s is x; its gradient is ds plus the projection input's
                dy_t = typed.as_strided((t, h), (h, 1), (dy1_p - tmp.data_ptr()) // isz)
                ds_t = tmp.view(res_dt).as_strided((t, h), (h, 1), (ds_p - tmp.data_ptr()) // rsz)
                dx_in = as_dtype(dy_t, res_dt) + ds_t  # (as the tensor form: the input's dtype, then the sum)
            del buf, keep  # (this layer's activations go as soon as its gradients are made)
        del tmp, typed, da, fa4_grads, fa4_scratch
        partials.reverse()  # (made from the last layer down)
        _norm_grads(call, grads, needs, torch.cat(partials))
        return (dx_in, None, *(grads[slot] for slot in call.present))


def _weight_grads(params: tuple, needs: tuple, shapes: tuple, device) -> list:
    """The tensors one layer's projection weight gradients (``shapes``: ``(n, k)``) are written into, ``None`` where
    ``needs`` says none is wanted: in each parameter's dtype where it is fp32 or a low-precision one (the GEMM writes
    it from its fp32 accumulator), else fp32 (then cast). Views of one buffer (each ``_ALIGN``-aligned) where they
    share a dtype, as with fp32 master weights: one allocation per layer instead of four. Autograd hands them on as
    they are, so the ``.grad`` of a layer's four projections may share that buffer's storage."""
    dtypes = [(p.dtype if p.dtype in (_F32, *_LOW) else _F32) if need else None for p, need in zip(params, needs)]
    wanted = {d for d in dtypes if d is not None}
    if len(wanted) != 1:
        return [None if d is None else torch.empty(shape, dtype=d, device=device) for d, shape in zip(dtypes, shapes)]
    dtype = wanted.pop()
    per = _ALIGN // dtype.itemsize
    offsets, end = [], 0
    for (n, k), d in zip(shapes, dtypes):
        offsets.append(end)
        if d is not None:
            end += -(-n * k // per) * per
    flat = torch.empty(end, dtype=dtype, device=device)
    return [None if d is None else flat.as_strided((n, k), (k, 1), at)
            for (n, k), d, at in zip(shapes, dtypes, offsets)]


def _weight_grad(dw_of, dw: torch.Tensor, param: torch.Tensor, x_p: int, dy_p: int, ws: int, stream: int):
    """``dw [n, k] = dy.T @ x`` written into ``dw`` (from :func:`_weight_grads`), in ``param``'s dtype."""
    n, k = dw.shape
    dw_of(n, k, dw.dtype)(x_p, dy_p, dw.data_ptr(), ws, stream)
    return as_dtype(dw, param.dtype)


def _norm_grads(call: PointerCall, grads: list, needs: list, partials: torch.Tensor) -> None:
    """Every norm's weight (and bias) gradient from the partial sums the layers wrote (``[rows, P, H]``, per layer
    ``attn_norm``'s and ``mlp_norm``'s weights, then with biases their biases): one sum for all."""
    sums = partials.sum(1)
    per = 4 if call.has_b else 2
    for index, (in_params, in_meta, out_params, _) in enumerate(call.args):
        slot = index * _PER_LAYER
        for row, w_slot, norm in ((per * index, slot, in_params[:2]), (per * index + 1, slot + 6, out_params[2:4])):
            if w_slot == slot and not in_meta[2]:
                continue
            w, b = norm
            if w is not None and needs[w_slot]:
                grads[w_slot] = as_dtype(sums[row], w.dtype)
            if b is not None and needs[w_slot + 1]:
                grads[w_slot + 1] = as_dtype(sums[row + 2], b.dtype)


__all__ = ["PointerCall", "PointerStack", "prepare"]
