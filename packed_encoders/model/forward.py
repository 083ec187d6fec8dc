"""The packed ModernBERT forward: ``[T]`` token ids -> ``[T, hidden_size]``, HF semantics, no padding.

Per layer (HF ``ModernBertEncoderLayer``): ``attn_norm`` (Identity on layer 0) -> ``Wqkv`` -> RoPE with
the layer type's theta -> variable-length attention (local layers: ``|i - j| <= local_attention // 2``)
-> ``Wo`` -> residual -> ``mlp_norm`` -> ``Wi`` -> GLU -> ``mlp.Wo`` -> residual; then ``final_norm``.
Each layer's MLP residual is deferred into the next norm (residual + LayerNorm in one op).
Weights are read from the live HF modules on every call; nothing is copied. A projection slot holding anything but an
``nn.Linear`` (a peft LoRA layer, a wrapped or quantised Linear) is called instead, ``module(x)`` on the packed
``[T, in_features]`` rows (:mod:`.calls`).
"""

from __future__ import annotations

import functools
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from ..attention.backends import Workload
from ..attention.dispatch import Decision, Policy, resolve
from ..batch import PackedBatch
from ..ops import TORCH_OPS, OpSet, rope_tables
from ..ops.rope import cached_pair_freq_table, cached_position_tables
from ..ops.weight_cast import cast, expire
from .blocks import compute_dtype, run_layer_blocks
from .calls import ModuleCalls, merged_weights, read_calls
from .calls import call as call_module
from .dropout import applies_attention_dropout, dropout_modules, rate
from .params import ModernBertParams
from .plan import NOT_ASKED, Rules, plan_for
from .pointers import run as run_pointers
from .stack import run_stack, stack_problem


def _dropout(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Apply an HF dropout module's rate in its own mode (``nn.Identity`` or eval: nothing)."""
    p = rate(module)
    return F.dropout(x, p, training=True) if p else x


def _norm_args(m: nn.Module):
    return m.weight, getattr(m, "bias", None), m.eps


def input_grads_hooked(embedding: nn.Module) -> bool:
    """Whether transformers' ``enable_input_require_grads()`` hook is on the token ``embedding`` (the packed forward
    then makes the embedding output require gradients, as the hook does)."""
    return any(getattr(h, "__name__", "") == "make_inputs_require_grads" for h in embedding._forward_hooks.values())


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype activations take in the packed forward (autocast's dtype when autocast is on, but for a float64
    model: autocast casts no float64 tensor, so stock runs such a model in float64 under it)."""
    weight = model.embeddings.tok_embeddings.weight
    if weight.dtype is torch.float64:
        return weight.dtype
    if weight.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    if weight.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return weight.dtype


def live_inv_freq(model: nn.Module, is_global: bool, params: ModernBertParams):
    """HF's own inverse-frequency buffer for a layer type, or ``None`` when the model has none we can read.

    transformers v5 keeps ``rotary_emb.{full,sliding}_attention_inv_freq``; v4 one ``rotary_emb.inv_freq`` per
    attention module. These are buffers, so ``model.to(torch.bfloat16)`` rounds them (and ``.float()`` keeps
    the rounded values): stock HF then rotates with the rounded frequencies, and so must we to match it."""
    rotary = getattr(model, "rotary_emb", None)
    name = "full_attention" if is_global else "sliding_attention"
    inv = getattr(rotary, f"{name}_inv_freq", None) if rotary is not None else None
    scaling = getattr(rotary, f"{name}_attention_scaling", 1.0) if rotary is not None else 1.0
    if inv is None:
        for index, layer in enumerate(model.layers):
            if params.layer_is_global[index] == is_global:
                inv = getattr(getattr(getattr(layer, "attn", None), "rotary_emb", None), "inv_freq", None)
                break
    if inv is None or inv.shape[-1] != params.head_dim // 2:
        return None, 1.0
    return inv, float(scaling or 1.0)


def rope_pair_inputs(model: nn.Module, params: ModernBertParams, device: torch.device, is_global: bool):
    """``freq [2 * hidden]`` fp32 for ``OpSet.rope_linear`` (:func:`..ops.pair_freq_table` of the live ``inv_freq``,
    or of HF's default formula without a readable buffer), or ``None`` when the layer type's RoPE scales cos / sin
    (``attention_scaling != 1``), which the pair-order rotation does not model. Cached per source (see
    :func:`..ops.rope.cached_pair_freq_table`), so a graph replay reads a table instead of rebuilding it."""
    inv, scaling = live_inv_freq(model, is_global, params)
    if scaling != 1.0:
        return None
    heads = 2 * params.num_attention_heads
    if inv is None:
        theta = params.rope_theta_global if is_global else params.rope_theta_local
        return cached_pair_freq_table(("theta", float(theta), params.head_dim), heads, device)
    return cached_pair_freq_table(inv, heads, device)


def rope_inputs(model: nn.Module, params: ModernBertParams, batch: PackedBatch) -> dict:
    """``{is_global: (cos, sin, rows)}``: fp32 tables and the row of each token in them.

    From HF's live ``inv_freq`` buffers, ``position * inv_freq`` in fp32 as HF computes it, then ``cos / sin``:
    eager calls read tables over positions (:func:`..ops.rope.cached_position_tables`, cached while the buffer is
    unchanged: an eager call then launches nothing for them), rows ``position_ids``; a call that function declines
    (one being captured into a CUDA graph, traced, ...) computes per-token ``[T, head_dim // 2]`` tables on the
    device (no host work in a replay, and a replay reads the live buffer), rows ``arange(T)``. An fp64 model
    (``model.double()`` makes the buffers fp64 too) gets fp64 tables: HF computes its angles in fp32 whatever the
    model's dtype (an error ~1e-7 * position radians), which would cap an fp64 model at fp32 accuracy. Without a
    readable buffer: the cached theta tables (:func:`packed_encoders.ops.rope_tables`) indexed by ``position_ids``."""
    out = {}
    rows = None
    for is_global in set(params.layer_is_global):
        inv, scaling = live_inv_freq(model, is_global, params)
        if inv is None:
            theta = params.rope_theta_global if is_global else params.rope_theta_local
            cos, sin = rope_tables(theta, params.head_dim, batch.max_position, batch.device)
            out[is_global] = (cos, sin, batch.position_ids)
            continue
        compute = torch.promote_types(inv.dtype, torch.float32)
        tables = cached_position_tables(inv, scaling, compute, batch.max_position, batch.device)
        if tables is not None:
            out[is_global] = (*tables, batch.position_ids)
            continue
        if rows is None:
            rows = torch.arange(batch.total_tokens, device=batch.device)
        freqs = batch.position_ids.to(compute)[:, None] * inv.to(device=batch.device, dtype=compute)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        out[is_global] = (cos, sin, rows)
    return out


def plan_attention(params: ModernBertParams, batch: PackedBatch, requested: str, *, grad: bool,
                   dtype: torch.dtype, dropout: bool, policy: Policy | None = None,
                   graph: bool = False) -> dict[int | None, Decision]:
    """Resolve the attention backend once per distinct window (global: ``None``) from host-visible shapes;
    ``graph``: the plan is baked into a CUDA graph (the policy's graph tables apply)."""
    plan: dict[int | None, Decision] = {}
    for layer in range(params.num_hidden_layers):
        window = params.layer_window(layer)
        if window is not None and window >= batch.max_seqlen - 1:
            window = None  # the band covers every sequence: a global layer in effect, and cheaper
        if window in plan:
            continue
        w = Workload(num_seqs=batch.num_seqs, total_tokens=batch.total_tokens, max_seqlen=batch.max_seqlen,
                     heads=params.num_attention_heads, head_dim=params.head_dim, window=window, grad=grad,
                     dtype=dtype, device_type=batch.device.type, dropout=dropout,
                     query_only=batch.key_lens is not None, graph=graph)
        plan[window] = resolve(requested, w, policy)
    return plan


READ = object()  # encoder_forward's ``calls`` default: read the called slots from the live modules


def encoder_forward(model: nn.Module, params: ModernBertParams, batch: PackedBatch, *,
                    attention: Mapping[int | None, Decision] | None = None, attention_backend: str = "auto",
                    ops: OpSet = TORCH_OPS, gradient_checkpointing: bool | Sequence = False,
                    hidden_states: list | None = None, hidden_pre_norm_last: bool = False,
                    rules: Rules | None = None, out: torch.Tensor | None = None,
                    calls: ModuleCalls | None | object = READ) -> torch.Tensor:
    """Run the packed encoder on ``batch`` and return ``[T, hidden_size]`` (after ``final_norm``).

    Args:
        model: the live ``ModernBertModel`` whose parameters are read.
        attention: a plan from :func:`plan_attention`; built here from ``attention_backend`` when ``None``.
        ops: the per-token op implementations (plain PyTorch by default).
        gradient_checkpointing: recompute each layer in backward (only in train mode with grad enabled); or per
            layer ``None`` (not checkpointed), ``True`` (non-reentrant ``torch.utils.checkpoint``) or the function
            to call as ``fn(layer_fn, *inputs)`` (HF's ``_gradient_checkpointing_func``).
        hidden_states: when a list, receives HF v5's ``output_hidden_states`` entries as ``[T, H]`` tensors:
            the embedding output, the output of every layer but the last, then the final normed output
            (transformers v4 lists the last layer's output before ``final_norm``: ``hidden_pre_norm_last``).
        rules: the switches the op choices read (:class:`..model.plan.Rules`; default: the environment's).
        out: a ``[T, hidden_size]`` tensor to hold the result (a CUDA graph's static output, shared by the graphs
            of one encoder): written in place and returned when the result has its dtype (``final_norm``'s output:
            fp32 under CUDA autocast), else ignored. The op set's norm writes there directly where it can
            (``OpSet.norm_out``); other op sets' results are copied in.
        calls: the Linear slots whose module is called (:class:`.calls.ModuleCalls`, ``None``: every slot is an
            ``nn.Linear``), as the per-call structure snapshot holds them; by default read from the live modules.

    Raises:
        PackedEncodersError: a called module returned something else than ``[T, out_features]``.
    """
    grad = torch.is_grad_enabled()
    dtype = activation_dtype(model)
    cdt = compute_dtype(batch.device.type, dtype)
    if calls is READ:
        calls = read_calls(model)
    merged = None
    if calls is not None and not grad:  # peft LoRA layers as one Linear each (the others stay called)
        calls, merged = merged_weights(model, calls, cdt, ops.lora_merge)
    if attention is None:
        # Dropout follows each HF module's own mode and rate, as HF does (MC dropout toggles nn.Dropout modules)
        any_attn_p = applies_attention_dropout(dropout_modules(model), params.attention_dropout)
        attention = plan_attention(params, batch, attention_backend, grad=grad, dtype=dtype, dropout=any_attn_p)
    total = batch.total_tokens
    device = batch.device
    ckpt = (None,) * params.num_hidden_layers
    stack_off = NOT_ASKED
    if grad:  # as HF: a layer is checkpointed in train mode with grad
        flags = gradient_checkpointing
        if isinstance(flags, bool):
            flags = (flags,) * params.num_hidden_layers
        ckpt = tuple(fn if layer.training else None for fn, layer in zip(flags, model.layers))
        stack_off = stack_problem(any(ckpt), hidden_states is not None)
    plan = plan_for(params, ops, attention, tokens=total, max_seqlen=batch.max_seqlen, dtype=dtype, device=device,
                    grad=grad, rules=rules, stack_off=stack_off, calls=calls, merged=len(merged or ()))
    if plan.pointers and hidden_states is None and out is None:
        y = run_pointers(model, params, batch, plan, rope_inputs,
                         lambda: encoder_forward(model, params, batch, attention=attention, ops=ops, rules=rules,
                                                 calls=calls))
        if y is not None:
            return y
    run = plan.ops
    scale = params.scaling
    nh, hd = params.num_attention_heads, params.head_dim
    extra_kw = {} if batch.key_lens is None else {"key_lens": batch.key_lens}
    glu_path, glu_linear, linear = plan.glu, plan.glu_linear, plan.linear

    # RoPE inputs are built on first use: a forward whose q, k projections all rotate in their epilogue
    # (ops.rope_linear) needs no cos / sin, and each small op here is a kernel in every graph replay
    rope: dict = {}
    pair_freq: dict = {}
    positions = None

    def rope_tables_for(is_global: bool):
        if not rope:
            rope.update(rope_inputs(model, params, batch))
        return rope[is_global]

    def rope_linear(normed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, is_global: bool):
        nonlocal positions
        if is_global not in pair_freq:
            pair_freq[is_global] = rope_pair_inputs(model, params, device, is_global)
        freq = pair_freq[is_global]
        if freq is None:
            return None
        if positions is None:
            positions = batch.position_ids.float()
        return ops.rope_linear(normed, weight, bias, positions, freq, nh, hd)

    emb = model.embeddings
    if batch.inputs_embeds is not None:
        x = batch.inputs_embeds
    else:
        # padding_idx: the pad row gets no gradient, as nn.Embedding(padding_idx=...) in stock
        x = F.embedding(batch.input_ids, emb.tok_embeddings.weight, emb.tok_embeddings.padding_idx)
    if grad and not x.requires_grad and input_grads_hooked(emb.tok_embeddings):
        x = x.requires_grad_()  # transformers' enable_input_require_grads(), which the embedding's hook does
    x = run.layer_norm(x, *_norm_args(emb.norm))
    x = _dropout(x, emb.drop)
    if hidden_states is not None:
        hidden_states.append(x)

    if plan.kernels is not None:  # with gradients: one autograd node per layer block
        def run_layer(index: int, carry: list):
            return run_layer_blocks(model.layers[index], plan.layers[index], params, batch, plan.kernels, carry,
                                    rope_tables_for, params.layer_is_global[index], cdt)

    # Memory: the layer owns its inputs (``carry`` is emptied) and drops each activation once consumed, so the
    # peak of a no-grad forward is one layer's MLP working set, not every activation of the layer (H200, 128
    # documents of ~940 tokens, ModernBERT-base: 2.7 GiB peak allocated with them all held).
    else:
        # autocast without gradient: each fp32 weight's low-precision copy is made once and reused while the
        # weight is unchanged (ops.weight_cast), rather than cast again by every call; a norm feeding a projection
        # writes its output in the projection's dtype (fp32 under CUDA autocast as F.layer_norm's, then cast
        # inside F.linear: the same rounding, one pass and one launch fewer): the GEMM routes (quack, the Triton
        # Wi + GLU) then see the operands a bf16 model gives them
        wdt = cdt if not grad else None
        if grad:  # a training step whose backward is autograd's own: copies cached before it are not reused
            expire()

        def to_wdt(t: torch.Tensor) -> torch.Tensor:
            return t if wdt is None or t.dtype is wdt else t.to(wdt)

        def slot_weights(module: nn.Module, index: int, pos: int) -> tuple:
            """A projection's ``(weight, bias)`` in ``wdt``: a LoRA slot's merged pair, else the Linear's own."""
            hit = merged.get((index, pos)) if merged else None
            return hit or (cast(module.weight, wdt), cast(module.bias, wdt))

        # the layers own x (``carry`` is emptied) and read it no more after its residual norm, so the sum may be
        # written over it: only without gradient (autograd may have saved x; a kernel's write bumps no version
        # counter) and while hidden_states does not hold the layers' outputs
        in_place = plan.direct and hidden_states is None
        res_ln = (run.residual_in_place if in_place else None) or run.residual_layer_norm

        def run_layer(index: int, carry: list):
            x, pending = carry
            carry.clear()
            layer = model.layers[index]
            step = plan.layers[index]
            # a called slot's module gets its input as stock's gets it (the norm's own output dtype: fp32 under
            # autocast, which the module's GEMMs cast as stock's do); the others read their weights here
            called_qkv, called_o, called_i, called_o2 = step.calls
            attn = layer.attn
            wqkv = attn.Wqkv
            is_global = params.layer_is_global[index]
            attn_norm = layer.attn_norm
            norm_dt = None if called_qkv else wdt
            if isinstance(attn_norm, nn.Identity):
                if pending is not None:
                    x = x + pending
                normed = x
            elif pending is not None:
                x, normed = res_ln(x, pending, *_norm_args(attn_norm), out_dtype=norm_dt)
            else:
                normed = run.layer_norm(x, *_norm_args(attn_norm), out_dtype=norm_dt)
            pending = None
            if called_qkv:
                qkv, rotated = call_module(wqkv, normed, 3 * nh * hd, index, "attn.Wqkv", dtype), None
            else:
                normed = to_wdt(normed)
                w, b = slot_weights(wqkv, index, 0)
                rotated = rope_linear(normed, w, b, is_global) if step.rope_linear else None
                qkv = linear(normed, w, b) if rotated is None else None
            normed = None
            extra = dict(extra_kw)
            if rotated is not None:
                # q, k rotated in the projection's epilogue, both in pair order: q . k, hence attention, unchanged
                q, k, v = rotated
                rotated = None
            elif step.rope_in_attention:
                # the attention kernel rotates q and k as it loads them: no separate RoPE launch (inference only)
                q, k, v = qkv.view(total, 3, nh, hd).unbind(1)
                extra["rope"] = rope_tables_for(is_global)
            else:
                q, k, v = run.rope_qkv(qkv, *rope_tables_for(is_global), nh, hd)
            attn_p = params.attention_dropout_of(attn)  # read per call, as stock HF does
            a = step.attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, window=step.window, scale=scale,
                               dropout_p=attn_p, **extra)
            qkv = q = k = v = extra = None
            wo = attn.Wo
            a = a.reshape(total, nh * hd)
            if called_o:
                o = call_module(wo, a, params.hidden_size, index, "attn.Wo")
            else:
                o = linear(a, *slot_weights(wo, index, 1))
            o = _dropout(o, attn.out_drop)
            a = None
            x, normed = res_ln(x, o, *_norm_args(layer.mlp_norm), out_dtype=None if called_i else wdt)
            o = None
            mlp = layer.mlp
            wi = mlp.Wi
            if called_i:  # the module, then the GLU op (no fused Wi + GLU GEMM: it reads Wi's weight)
                h = call_module(wi, normed, 2 * params.intermediate_size, index, "mlp.Wi", dtype)
                h = run.glu(h, params.activation)
            else:
                normed = to_wdt(normed)
                w, b = slot_weights(wi, index, 2)
                if glu_path == "split":
                    h = run.glu(F.linear(normed, w, b), params.activation)
                else:  # "small_gemm" (one Triton launch) or "route" (the op set's own rules, e.g. quack's epilogue)
                    h = glu_linear(normed, w, b, params.activation)
            normed = None
            g = _dropout(h, mlp.drop)
            h = None
            wo = mlp.Wo
            if called_o2:
                return x, call_module(wo, g, params.hidden_size, index, "mlp.Wo")
            return x, linear(g, *slot_weights(wo, index, 3))

    pending = None
    last = params.num_hidden_layers - 1
    layers = range(params.num_hidden_layers)
    if plan.stack:  # with gradients, where the call allows it: every layer in one autograd node
        x, pending = run_stack(model, params, batch, plan, x, rope_tables_for, cdt)
        layers = ()
    for index in layers:
        fn = ckpt[index]
        if fn is True:
            fn = functools.partial(_checkpoint, use_reentrant=False)
        if fn:
            x, pending = fn(lambda i, a, b: run_layer(i, [a, b]), index, x, pending)
        else:
            carry = [x, pending]
            x = pending = None
            x, pending = run_layer(index, carry)
        if hidden_states is not None and index < last:
            x, pending = x + pending, None
            hidden_states.append(x)
    into = {"out": out} if out is not None and run.norm_out else {}
    if pending is None:
        y = run.layer_norm(x, *_norm_args(model.final_norm), **into)
    else:
        x, y = run.residual_layer_norm(x, pending, *_norm_args(model.final_norm), **into)
    if out is not None and y is not out and y.dtype == out.dtype and y.shape == out.shape:
        y = out.copy_(y)
    if hidden_states is not None:
        hidden_states.append(x if hidden_pre_norm_last else y)
    return y
