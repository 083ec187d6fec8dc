"""Training forwards with few autograd nodes: one per layer block, or one for the whole encoder stack.

A ModernBERT layer under autograd as separate ops makes ~15 autograd nodes (casts, projections, norms, views,
dropout), each paying dispatcher and autograd bookkeeping on the host, in forward and again in backward. Here a layer
is two blocks around its attention:

- attention in: residual add + ``attn_norm`` + ``Wqkv`` + RoPE -> ``(s, q, k, v)``;
- the attention backend;
- attention out + MLP: ``Wo`` (+ dropout) + residual + ``mlp_norm`` + ``Wi`` + GLU (+ dropout) + ``mlp.Wo``
  -> ``(x, pending)``; ``pending`` is added into the next layer's norm.

Each block is a forward function and a backward function (:func:`attn_in_fwd` / :func:`attn_in_bwd`,
:func:`out_mlp_fwd` / :func:`out_mlp_bwd`) that launch the op family's raw kernels (:class:`..ops.Kernels`) and
cuBLAS directly and keep only what the backward reads. Two granularities run them:

- :class:`AttentionIn` and :class:`AttentionOutMlp`: one ``autograd.Function`` per block, with the attention
  backend's own autograd between them (:func:`run_layer_blocks`); what gradient checkpointing, per-layer hooks and
  DDP's per-bucket gradient overlap need;
- :mod:`.stack`: one ``autograd.Function`` for every layer of the encoder, the attention's forward and backward
  called inside it (each ``Function`` costs ~50 us of host time per forward and backward on the H200 machine).

Numerics are autocast's: with autocast on, each projection runs in the autocast dtype (weights cast once and
reused, :mod:`..ops.weight_cast`), norms and residual sums as the op set's kernels do; weight gradients of fp32
parameters are written in fp32 from the GEMM's accumulator on CUDA (autocast's cast node rounds them to the autocast
dtype first), else computed in the autocast dtype and cast. Every projection gets its operands already in the
compute dtype, so an ambient autocast has nothing left to cast (no autocast context is entered: that costs host time
per block). Dropout masks are drawn in forward (``native_dropout``, so gradient checkpointing's RNG replay draws the
same ones) and kept for the backward. The ``torch.library`` custom ops stay for ``torch.compile`` (which takes the
per-op path).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ..errors import SECOND_DERIVATIVE
from ..ops.weight_cast import cast, expire
from .dropout import rate
from .live import param, sub
from .params import ModernBertParams


def first_order(backward):
    """``once_differentiable`` for the packed encoder's autograd functions, its error naming the library: the
    backward runs without grad, and a backward through its result (``create_graph=True``, then differentiating
    again) raises :data:`SECOND_DERIVATIVE` rather than returning wrong second derivatives."""
    delayed = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
    if delayed is None:  # torch without the node once_differentiable builds on: its own message
        return once_differentiable(backward)

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled() or not any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
            return outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)

        def aliased(t):
            if t is None or not isinstance(t, torch.Tensor):
                return t
            t = t.detach()
            t.requires_grad = t.is_floating_point() or t.is_complex()
            return t

        return delayed(SECOND_DERIVATIVE.encode(), len(outs))(*[aliased(t) for t in outs])

    return wrapper


def _norm_params(m: nn.Module):
    """``(weight, bias, eps, present)`` of a LayerNorm slot (``nn.Identity``: nothing to normalise)."""
    if isinstance(m, nn.Identity):
        return None, None, 0.0, False
    return param(m, "weight"), param(m, "bias", None), m.eps, True


def _dropout(x: torch.Tensor, p: float):
    if not p:
        return x, None
    return torch.native_dropout(x, p, True)


def _undrop(g: torch.Tensor, mask: torch.Tensor | None, p: float) -> torch.Tensor:
    # p = 1 drops everything: scale 0, as torch's own dropout backward (1 / (1 - p) would divide by zero)
    return g if mask is None else torch.ops.aten.native_dropout_backward(g, mask, 1.0 / (1.0 - p) if p < 1 else 0.0)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` for a 2-D ``x`` (the same cuBLAS call: ``mm`` / ``addmm``), without ``linear``'s dispatch layers."""
    return torch.mm(x, w.t()) if b is None else torch.addmm(b, x, w.t())


def as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, skipping the call when ``t`` has that dtype (a no-op ``to`` still costs a dispatch: ~10 of
    them per layer and step)."""
    return t if t.dtype is dtype else t.to(dtype)


def _grad_w(need: bool, g: torch.Tensor | None, like: torch.Tensor | None):
    """A parameter's gradient in its own dtype, or ``None`` when it takes none."""
    if g is None or like is None or not need:
        return None
    return as_dtype(g, like.dtype)


def _norm_grads(partial: bool, need_w: bool, need_b: bool, dw, db, w, b):
    """A norm's ``(d weight, d bias)`` from its backward kernel: the kernel's fp32 partial sums as they are
    (``partial``: the caller reduces them), else in the parameters' dtypes; ``None`` where not wanted."""
    if partial:
        return (dw if need_w else None), (db if need_b else None)
    return _grad_w(need_w, dw, w), _grad_w(need_b, db, b)


def _mm_out_dtype():
    """``mm(a, b, dtype)``: a bf16 / fp16 GEMM that writes its fp32 accumulator as fp32 (``aten::mm.dtype``, CUDA
    only), through ``torch.mm``'s own binding where it takes ``out_dtype`` (cheaper on the host than the operator
    overload's Python call); ``None`` where torch has neither."""
    a = torch.empty(1, 1, device="meta", dtype=torch.bfloat16)
    try:
        torch.mm(a, a, out_dtype=torch.float32)
        return lambda x, y, dtype: torch.mm(x, y, out_dtype=dtype)
    except (TypeError, RuntimeError, NotImplementedError):
        return getattr(torch.ops.aten.mm, "dtype", None)


_MM_OUT_DTYPE = _mm_out_dtype()


def _linear_weight_grads(dy: torch.Tensor, x: torch.Tensor, need_w: bool, need_b: bool, w, b):
    """``(dw, db)`` of ``y = x @ w_c.T + b``, in the parameters' dtypes (``None`` where not wanted).

    fp32 master weights under autocast (``dy`` bf16 / fp16 on CUDA): the GEMM writes its fp32 accumulator
    directly and the bias sum accumulates in fp32, rather than rounding to the compute dtype and casting back as
    autocast's cast node does (one kernel and one allocation fewer per gradient; the result differs from stock
    by that bf16 rounding only, towards the exact value)."""
    widen = (w is not None and w.dtype == torch.float32 and dy.dtype in (torch.bfloat16, torch.float16)
             and dy.is_cuda and _MM_OUT_DTYPE is not None)
    dw = db = None
    if need_w:
        dw = _MM_OUT_DTYPE(dy.t(), x, torch.float32) if widen else _grad_w(True, torch.mm(dy.t(), x), w)
    if b is not None and need_b:
        db = dy.sum(0, dtype=torch.float32) if widen and b.dtype == torch.float32 else _grad_w(True, dy.sum(0), b)
    return dw, db


def _linear_bwd(dy: torch.Tensor, x: torch.Tensor, w_c: torch.Tensor, need_w: bool, need_b: bool, w, b):
    """``(dx, dw, db)`` of ``y = x @ w_c.T + b`` (all in the compute dtype), weight gradients in the parameters'."""
    return (torch.mm(dy, w_c), *_linear_weight_grads(dy, x, need_w, need_b, w, b))


# ------------------------------------------------------------------------------------------------ attention in
# meta: (kernels, eps, has_norm, compute dtype or None, heads, head_dim)
# saved: (s or None, ln_w, mean, rstd, y_c, w_c, cos, sin, rows) — tensors, what save_for_backward may hold
# facts: (has_pending, (x dtype, pending dtype, qkv dtype, y dtype), has_ln_b)


def attn_in_fwd(x, pending, ln_w, ln_b, w_c, b_c, cos, sin, rows, meta):
    """``s = x + pending``; ``q, k, v = rope(Wqkv(norm(s)))`` with ``Wqkv``'s weight and bias in the compute dtype
    (``w_c, b_c``). Returns ``(s, q, k, v, saved, facts)``; ``s`` is ``None`` when ``pending`` is ``None`` (the
    caller's ``x`` is the residual)."""
    kern, eps, has_norm, cdt, nh, hd = meta
    res_dtype = x.dtype if pending is None else torch.promote_types(x.dtype, pending.dtype)
    mean = rstd = None
    if has_norm:
        # the normed output feeds only the projection: written once in its dtype (the same rounding as a cast)
        s, y, mean, rstd = kern.ln_fwd(x, pending, ln_w, ln_b, eps, cdt or res_dtype, res_dtype)
        if s is None:
            s = x
    else:
        s = x if pending is None else (x + pending)
        y = s
    y_c = y if cdt is None else as_dtype(y, cdt)
    qkv = _linear(y_c, w_c, b_c)
    q, k = kern.rope_fwd(qkv, cos, sin, rows, nh, hd)
    v = qkv.view(qkv.shape[0], 3, nh, hd)[:, 2]
    saved = (s if has_norm else None, ln_w, mean, rstd, y_c, w_c, cos, sin, rows)
    facts = (pending is not None, (x.dtype, None if pending is None else pending.dtype, qkv.dtype, y.dtype),
             ln_b is not None)
    return (s if pending is not None else None), q, k, v, saved, facts


def attn_in_bwd(saved, facts, meta, params, needs, ds, dq, dk, dv, partial: bool = False):
    """Gradients ``(dx, dpending, d ln_w, d ln_b, dw, db)`` of :func:`attn_in_fwd`; ``params``: its
    ``(ln_w, ln_b, w, b)``, ``needs``: which of them want a gradient; ``ds``: the gradient of ``s`` (``None``
    without ``pending``). ``partial``: the norm's gradients as the kernel's fp32 partial sums (``[P, H]``, for the
    caller to reduce, see ``Kernels.ln_bwd``)."""
    kern, _eps, has_norm, _cdt, nh, hd = meta
    s, ln_w_saved, mean, rstd, y_c, w_c, cos, sin, rows = saved
    has_pending, (x_dtype, p_dtype, qkv_dtype, y_dtype), has_ln_b = facts
    ln_w, ln_b, w, b = params
    dqkv = kern.rope_bwd(dq, dk, dv, cos, sin, rows, nh, hd, qkv_dtype)
    dy, dw, db = _linear_bwd(dqkv, y_c, w_c, needs[2], needs[3], w, b)
    dres = ds if has_pending else None
    dlnw = dlnb = None
    if has_norm:
        two = has_pending and p_dtype != x_dtype
        dx, dx2, dlnw, dlnb = kern.ln_bwd(dy, s, ln_w_saved, mean, rstd, dres, has_ln_b, x_dtype,
                                          p_dtype if two else None, reduce=not partial)
        dlnw, dlnb = _norm_grads(partial, needs[0], needs[1], dlnw, dlnb, ln_w, ln_b)
        dp = (dx2 if two else dx) if has_pending else None
    else:
        g = as_dtype(dy, y_dtype) if dres is None else dy.float() + dres.float()
        dx = as_dtype(g, x_dtype)
        dp = as_dtype(g, p_dtype) if has_pending else None
    return dx, dp, dlnw, dlnb, dw, db


# ------------------------------------------------------------------------------------- attention out + MLP
# meta: (kernels, eps, compute dtype or None, activation, attention-output dropout, MLP dropout)
# saved: (a_c, x, ln_w, mean, rstd, y_c, h, mask_o, mask_g, wo_c, wi_c, w2_c)
# facts: (a dtype, a shape, s dtype, o dtype, pending dtype)


def out_mlp_fwd(a, s, wo_c, bo_c, ln_w, ln_b, wi_c, bi_c, w2_c, b2_c, meta):
    """``x = s + drop(Wo(a))``; ``pending = Wo2(drop(glu(Wi(norm(x)))))``, the projections' weights and biases in
    the compute dtype (``*_c``). Returns ``(x, pending, saved, facts)``."""
    kern, eps, cdt, activation, p_out, p_mlp = meta
    t = a.shape[0]
    a2 = a.reshape(t, -1)
    a_c = a2 if cdt is None else as_dtype(a2, cdt)
    o, mask_o = _dropout(_linear(a_c, wo_c, bo_c), p_out)
    res_dtype = torch.promote_types(s.dtype, o.dtype)
    x, y, mean, rstd = kern.ln_fwd(s, o, ln_w, ln_b, eps, cdt or res_dtype, res_dtype)
    y_c = y if cdt is None else as_dtype(y, cdt)
    h = _linear(y_c, wi_c, bi_c)
    g, mask_g = _dropout(kern.glu_fwd(h, activation), p_mlp)
    pending = _linear(g, w2_c, b2_c)
    # g (the GLU's output) is not kept: the GLU backward writes it again as it reads h (memory: a
    # [T, intermediate] tensor per layer, ~9 % of a layer's saved activations in ModernBERT-base)
    saved = (a_c, x, ln_w, mean, rstd, y_c, h, mask_o, mask_g, wo_c, wi_c, w2_c)
    return x, pending, saved, (a.dtype, a.shape, s.dtype, o.dtype, pending.dtype)


def out_mlp_bwd(saved, facts, meta, params, needs, dx, dpending, partial: bool = False):
    """Gradients ``(da, ds, dwo, dbo, d ln_w, d ln_b, dwi, dbi, dw2, db2)`` of :func:`out_mlp_fwd`; ``params``:
    its ``(wo, bo, ln_w, ln_b, wi, bi, w2, b2)``, ``needs``: which of them want a gradient; ``partial``: as
    :func:`attn_in_bwd`'s."""
    kern, _eps, _cdt, activation, p_out, p_mlp = meta
    a_c, x, ln_w_saved, mean, rstd, y_c, h, mask_o, mask_g, wo_c, wi_c, w2_c = saved
    wo, bo, ln_w, ln_b, wi, bi, w2, b2 = params
    a_dtype, a_shape, s_dtype, o_dtype, p_dtype = facts
    if dpending is None:
        dpending = torch.zeros(x.shape[0], w2_c.shape[0], dtype=p_dtype, device=x.device)
    dp = as_dtype(dpending, h.dtype)
    dh, g = kern.glu_bwd(_undrop(torch.mm(dp, w2_c), mask_g, p_mlp), h, activation, forward_out=True)
    g = _undrop(g, mask_g, p_mlp)  # the dropped output the forward multiplied by mlp.Wo
    dw2, db2 = _linear_weight_grads(dp, g, needs[6], needs[7], w2, b2)
    g = None
    dy, dwi, dbi = _linear_bwd(dh, y_c, wi_c, needs[4], needs[5], wi, bi)
    two = s_dtype != o_dtype
    ds, do, dlnw, dlnb = kern.ln_bwd(dy, x, ln_w_saved, mean, rstd, dx, ln_b is not None, s_dtype,
                                     o_dtype if two else None, reduce=not partial)
    dlnw, dlnb = _norm_grads(partial, needs[2], needs[3], dlnw, dlnb, ln_w, ln_b)
    do = as_dtype(_undrop(do if two else ds, mask_o, p_out), a_c.dtype)
    da, dwo, dbo = _linear_bwd(do, a_c, wo_c, needs[0], needs[1], wo, bo)
    return as_dtype(da.view(a_shape), a_dtype), ds, dwo, dbo, dlnw, dlnb, dwi, dbi, dw2, db2


def weights_read(in_saved, out_saved) -> tuple:
    """What a layer's backward reads of its weights (``None`` where absent): the two norms' weights and the four
    projections' weights as the forward used them (the compute-dtype copies, or the parameters themselves), from
    :func:`attn_in_fwd`'s and :func:`out_mlp_fwd`'s ``saved``."""
    return in_saved[1], in_saved[5], out_saved[2], out_saved[9], out_saved[10], out_saved[11]


class AttentionIn(torch.autograd.Function):
    """:func:`attn_in_fwd` as one autograd node. Returns ``(s, q, k, v)``; ``s`` is an empty placeholder when
    ``pending`` is ``None`` (the caller's ``x`` is the residual)."""

    @staticmethod
    def forward(ctx, x, pending, ln_w, ln_b, w, b, cos, sin, rows, meta):
        cdt = meta[3]
        s, q, k, v, saved, facts = attn_in_fwd(x, pending, ln_w, ln_b, cast(w, cdt), cast(b, cdt), cos, sin, rows,
                                               meta)
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.facts, ctx.params = meta, facts, (ln_w, ln_b, w, b)
        if s is None:
            s = x.new_empty(0)
            ctx.mark_non_differentiable(s)
        return s, q, k, v

    @staticmethod
    @first_order  # raw kernels: a double backward raises rather than returning wrong second derivatives
    def backward(ctx, ds, dq, dk, dv):
        expire()  # the next forward casts the weights again (a hand-written update may come first)
        grads = attn_in_bwd(ctx.saved_tensors, ctx.facts, ctx.meta, ctx.params, ctx.needs_input_grad[2:6],
                            ds, dq, dk, dv)
        return (*grads, None, None, None, None)


class AttentionOutMlp(torch.autograd.Function):
    """:func:`out_mlp_fwd` as one autograd node. Returns ``(x, pending)``."""

    @staticmethod
    def forward(ctx, a, s, wo, bo, ln_w, ln_b, wi, bi, w2, b2, meta):
        cdt = meta[2]
        x, pending, saved, facts = out_mlp_fwd(a, s, cast(wo, cdt), cast(bo, cdt), ln_w, ln_b, cast(wi, cdt),
                                               cast(bi, cdt), cast(w2, cdt), cast(b2, cdt), meta)
        ctx.save_for_backward(*saved)
        ctx.meta, ctx.facts, ctx.params = meta, facts, (wo, bo, ln_w, ln_b, wi, bi, w2, b2)
        return x, pending

    @staticmethod
    @first_order
    def backward(ctx, dx, dpending):
        expire()
        grads = out_mlp_bwd(ctx.saved_tensors, ctx.facts, ctx.meta, ctx.params, ctx.needs_input_grad[2:10],
                            dx, dpending)
        return (*grads, None)


def compute_dtype(device_type: str, activations: torch.dtype) -> torch.dtype | None:
    """The dtype projections run in: autocast's when autocast is on for ``device_type``, else ``None`` (as is);
    ``None`` too for float64 ``activations``, which autocast does not cast (stock runs a float64 model in float64
    under it)."""
    if activations is not torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# :func:`layer_args`'s parameters, flattened per layer (``(*in_params, *out_params)``): the slots of a layer
SLOTS_PER_LAYER = 12
PROJECTION_SLOTS = frozenset((2, 3, 4, 5, 8, 9, 10, 11))  # Wqkv, Wo, Wi, mlp.Wo (weight, bias)
NORM_SLOTS = frozenset((0, 1, 6, 7))  # attn_norm, mlp_norm (weight, bias): their kernels read the parameters


_keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)


def take_layers(ctx) -> tuple[list, bool]:
    """A stack node's backward start (``model.stack``, ``model.stack_pointers``): ``(ctx.layers, keep)``, ``keep``
    whether the graph is retained (``backward(retain_graph=True)``; assumed where torch cannot say); without it the
    node lets go of its activations (``ctx.layers`` becomes ``None``). A second backward after they went raises."""
    layers = ctx.layers
    if layers is None:
        raise RuntimeError("Trying to backward through the graph a second time (the packed encoder's stack node "
                           "freed its activations); specify retain_graph=True on the first backward")
    keep = _keep_graph is None or _keep_graph()
    if not keep:
        ctx.layers = None
    return layers, keep


def slot_needs(present: tuple, needs_input_grad, n_layers: int) -> list:
    """Per weight slot (``SLOTS_PER_LAYER`` per layer) whether it wants a gradient, from a stack node's
    ``needs_input_grad`` of its weight inputs (the ``present`` slots, in order)."""
    needs = [False] * (n_layers * SLOTS_PER_LAYER)
    for slot, need in zip(present, needs_input_grad):
        needs[slot] = need
    return needs


def check_versions(read: tuple, index: int) -> None:
    """Raise autograd's in-place error if a weight layer ``index``'s backward reads (``read``: ``(tensor, version)``
    pairs taken in forward) changed since."""
    for t, version in read:
        if t._version != version:
            raise RuntimeError(
                f"one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a weight of the packed encoder's layer {index} (shape {tuple(t.shape)}) is at "
                f"version {t._version}; expected version {version}")


def layer_args(layer: nn.Module, params: ModernBertParams, kernels, cdt: torch.dtype | None):
    """``(in_params, in_meta, out_params, out_meta)`` of one encoder layer's two blocks (read from the live modules
    on every call: weights, norms' eps, dropout modes)."""
    attn, mlp = sub(layer, "attn"), sub(layer, "mlp")
    ln_w, ln_b, eps, has_norm = _norm_params(sub(layer, "attn_norm"))
    m_w, m_b, m_eps, _ = _norm_params(sub(layer, "mlp_norm"))
    wqkv, wo, wi, wo2 = sub(attn, "Wqkv"), sub(attn, "Wo"), sub(mlp, "Wi"), sub(mlp, "Wo")
    return ((ln_w, ln_b, param(wqkv, "weight"), param(wqkv, "bias", None)),
            (kernels, eps, has_norm, cdt, params.num_attention_heads, params.head_dim),
            (param(wo, "weight"), param(wo, "bias", None), m_w, m_b, param(wi, "weight"), param(wi, "bias", None),
             param(wo2, "weight"), param(wo2, "bias", None)),
            (kernels, m_eps, cdt, params.activation, rate(sub(attn, "out_drop")), rate(sub(mlp, "drop"))))


def run_layer_blocks(layer: nn.Module, step, params: ModernBertParams, batch, kernels, carry: list, rope_tables_for,
                     is_global: bool, cdt: torch.dtype | None):
    """One encoder layer as two block functions around the attention backend; ``carry`` is ``[x, pending]``
    (emptied). Returns ``(x, pending)``."""
    x, pending = carry
    carry.clear()
    in_params, in_meta, out_params, out_meta = layer_args(layer, params, kernels, cdt)
    s, q, k, v = AttentionIn.apply(x, pending, *in_params, *rope_tables_for(is_global), in_meta)
    if pending is None:
        s = x
    x = pending = None
    extra = {} if batch.key_lens is None else {"key_lens": batch.key_lens}
    attn_p = params.attention_dropout_of(layer.attn)  # read per call, as stock HF does
    a = step.attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, window=step.window, scale=params.scaling,
                       dropout_p=attn_p, **extra)
    q = k = v = None
    return AttentionOutMlp.apply(a, s, *out_params, out_meta)
