"""Every layer of the encoder as one autograd node, for eager training forwards.

The per-block path (:func:`.blocks.run_layer_blocks`) records three autograd nodes per layer: two block functions
and the attention's. Each Python ``autograd.Function`` costs host time in forward (``apply``: argument scan, node,
saved variables) and again in backward (the engine's call into Python); ModernBERT-base makes 66 nodes per forward.
:class:`EncoderStack` runs the same block functions (:func:`.blocks.attn_in_fwd`, :func:`.blocks.out_mlp_fwd` and
their backwards, so the maths and the kernels are the per-block path's) for every layer inside one node, the
attention included: torch varlen's FlashAttention-2 forward and backward ops are called directly
(``aten::_flash_attention_forward`` / ``_backward``, the pair aten's own autograd node runs), so are
FlashAttention-4's compiled kernels where :mod:`..attention.fa4_direct` serves the call; any other backend runs
under a local autograd graph that the stack's backward differentiates.

The backward walks the layers in reverse and drops each layer's activations once its gradients are made (the
per-block path frees them node by node; a stack holding them all would add every weight gradient to the peak),
unless the graph is retained (``backward(retain_graph=True)``), when it keeps them for the next backward.

Query-only tails (``key_lens``, ColBERT query expansion) reach the attention as the per-block path passes them.
Where it does not run (:func:`stack_problem` names why): gradient checkpointing (it recomputes layer by layer),
``output_hidden_states`` (every layer's output leaves the stack), active saved-tensor hooks (``save_on_cpu`` and other
offloading see what ``save_for_backward`` saves; the stack keeps its activations on its context), and a
``torch.distributed`` world of more than one process: DDP's reducer overlaps each gradient bucket's all-reduce with the
rest of the backward as the bucket's parameters receive their gradients, which a single node delivering every gradient
at its end would serialise.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from ..attention.flash import fa4_backward, fa4_forward_saving, torch_varlen_backward, torch_varlen_forward_saving
from ..batch import PackedBatch
from ..ops.weight_cast import cast_group, expire
from .blocks import NORM_SLOTS as _NORMS
from .blocks import PROJECTION_SLOTS as _PROJECTIONS
from .blocks import SLOTS_PER_LAYER as _PER_LAYER
from .blocks import (as_dtype, attn_in_bwd, attn_in_fwd, check_versions, first_order, layer_args, out_mlp_bwd,
                     out_mlp_fwd, slot_needs, take_layers, weights_read)
from .params import ModernBertParams
from .stack_pointers import PointerStack, prepare

_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_LAST = threading.local()  # .pointers_off: why this thread's last stack call did not run on raw pointers


def _saved_tensor_hooks_active() -> bool:
    """Whether ``torch.autograd.graph.saved_tensors_hooks`` are on (``save_on_cpu``, activation offloading or
    compression); assumed on where torch cannot say."""
    return _saved_hooks is None or _saved_hooks(False) is not None


def _distributed_world() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def stack_problem(checkpointed: bool, hidden_states: bool) -> str | None:
    """Why a training forward cannot run as one :class:`EncoderStack` node, or ``None``."""
    if checkpointed:
        return "gradient checkpointing (layers recomputed one by one)"
    if hidden_states:
        return "output_hidden_states (every layer's output is returned)"
    if _saved_tensor_hooks_active():
        return ("saved-tensor hooks are on (e.g. torch.autograd.graph.save_on_cpu): the per-block nodes pass their "
                "activations through them")
    if _distributed_world():
        return "a torch.distributed world of several processes (DDP overlaps all-reduces with the layers' backward)"
    return None


class _Call:
    """What the stack's forward and backward share: the batch, the plan, each layer's block arguments, RoPE tables."""

    __slots__ = ("args", "batch", "cdt", "compute", "model", "params", "plan", "present", "tables")

    def __init__(self, model, params, batch, plan, cdt, args, tables, present, compute):
        self.model, self.params, self.batch, self.plan, self.cdt = model, params, batch, plan, cdt
        self.args, self.tables = args, tables  # per layer: blocks.layer_args; {is_global: (cos, sin, rows)}
        self.present = present  # the weight slots that hold a tensor (the node's inputs after x), in order
        self.compute = compute  # per slot: a projection's weight in the compute dtype (None elsewhere)


def _attend(call: _Call, index: int, q, k, v):
    """``(a, saved)``: layer ``index``'s attention of ``q, k, v`` ``[T, heads, head_dim]`` and what
    :func:`_attend_bwd` needs."""
    step = call.plan.layers[index]
    batch, params = call.batch, call.params
    attn_p = params.attention_dropout_of(call.model.layers[index].attn)  # read per call, as stock HF does
    key_lens = batch.key_lens  # (the plan gives query-only tails only to backends that take key_lens)
    if step.backend in ("varlen", "fa4") and not attn_p and not torch.compiler.is_compiling():
        if step.backend == "varlen":
            a, saved = torch_varlen_forward_saving(q, k, v, batch.cu_seqlens, batch.max_seqlen, window=step.window,
                                                   scale=params.scaling, key_lens=key_lens)
            return a, (torch_varlen_backward, saved)
        got = fa4_forward_saving(q, k, v, batch.cu_seqlens, batch.max_seqlen, window=step.window,
                                 scale=params.scaling)
        if got is not None:  # (else FlashAttention-4's public entry point, under autograd below)
            return got[0], (fa4_backward, got[1])
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        a = step.attention(q, k, v, batch.cu_seqlens, batch.max_seqlen, window=step.window, scale=params.scaling,
                           dropout_p=attn_p, **({} if key_lens is None else {"key_lens": key_lens}))
    return a.detach(), (None, (q, k, v, a))


def _attend_bwd(saved, da, keep: bool):
    direct, saved = saved
    if direct is not None:  # the backward of a forward run outside autograd
        return direct(da, saved)
    q, k, v, a = saved
    return torch.autograd.grad(a, (q, k, v), da, retain_graph=keep)


class EncoderStack(torch.autograd.Function):
    """``(x, pending)`` after every layer, from the embedding output ``x`` ``[T, H]``; one autograd node.

    ``weights``: each layer's :func:`.blocks.layer_args` parameters, flattened (``_PER_LAYER`` slots per layer),
    the present ones only (``call.present``): inputs, so that autograd delivers their gradients. What the backward
    reads of them is checked for in-place changes since the forward (as ``save_for_backward`` would; saving ~130
    weights through it costs more host time than comparing their version counters)."""

    @staticmethod
    def forward(ctx, x, call: _Call, *weights):
        layers = []
        pending = None
        last = len(call.args) - 1
        compute = call.compute  # the projections' weights in the compute dtype (run_stack)
        for index, (in_params, in_meta, out_params, out_meta) in enumerate(call.args):
            at = index * _PER_LAYER
            cos, sin, rows = call.tables[call.params.layer_is_global[index]]
            s, q, k, v, in_saved, in_facts = attn_in_fwd(x, pending, in_params[0], in_params[1], compute[at + 2],
                                                         compute[at + 3], cos, sin, rows, in_meta)
            a, att_saved = _attend(call, index, q, k, v)
            q = k = v = None
            x, pending, out_saved, out_facts = out_mlp_fwd(a, x if s is None else s, *compute[at + 4:at + 6],
                                                           out_params[2], out_params[3], *compute[at + 8:at + 12],
                                                           out_meta)
            a = s = None
            if index == last:  # an output of this node: a detached alias, or ctx -> tensor -> node would be a cycle
                out_saved = (out_saved[0], x.detach(), *out_saved[2:])
            read = tuple((t, t._version) for t in weights_read(in_saved, out_saved) if t is not None)
            layers.append((in_saved, in_facts, att_saved, out_saved, out_facts, read))
        ctx.call, ctx.layers = call, layers
        return x, pending

    @staticmethod
    @first_order  # raw kernels: a double backward raises rather than returning wrong second derivatives
    def backward(ctx, dx, dpending):
        expire()  # the next forward casts the weights again (a hand-written update may come first)
        call = ctx.call
        layers, keep = take_layers(ctx)
        needs = slot_needs(call.present, ctx.needs_input_grad[2:], len(call.args))
        grads = [None] * len(needs)
        for index in range(len(call.args) - 1, -1, -1):
            in_params, in_meta, out_params, out_meta = call.args[index]
            in_saved, in_facts, att_saved, out_saved, out_facts, read = layers[index]
            check_versions(read, index)
            if not keep:
                layers[index] = None
            at = index * _PER_LAYER
            out_grads = out_mlp_bwd(out_saved, out_facts, out_meta, out_params, needs[at + 4:at + 12], dx, dpending,
                                    partial=True)
            out_saved = None
            da, ds = out_grads[0], out_grads[1]
            grads[at + 4:at + 12] = out_grads[2:]
            dq, dk, dv = _attend_bwd(att_saved, da, keep)
            att_saved = da = None
            has_pending = in_facts[0]
            in_grads = attn_in_bwd(in_saved, in_facts, in_meta, in_params, needs[at:at + 4],
                                   ds if has_pending else None, dq, dk, dv, partial=True)
            dx, dpending = in_grads[0], in_grads[1]
            if not has_pending:  # s was x itself: its gradient joins x's
                dx = dx + ds
            grads[at:at + 4] = in_grads[2:]
        _reduce_norm_grads(call, grads)
        return (dx, None, *(grads[slot] for slot in call.present))


def _reduce_norm_grads(call: _Call, grads: list) -> None:
    """The norms' gradients, which the layers left as fp32 partial sums (``[P, H]``), reduced: one stack and one sum
    per shape for every layer (instead of a sum per norm), each then in its parameter's dtype."""
    by_shape: dict = {}
    for slot, g in enumerate(grads):
        if g is not None and slot % _PER_LAYER in _NORMS:
            by_shape.setdefault(g.shape, []).append(slot)
    for slots in by_shape.values():
        sums = torch.stack([grads[slot] for slot in slots]).sum(1)
        for row, slot in enumerate(slots):
            index, at = divmod(slot, _PER_LAYER)
            in_params, _, out_params, _ = call.args[index]
            param = (*in_params, *out_params)[at]
            grads[slot] = as_dtype(sums[row], param.dtype)


def run_stack(model: nn.Module, params: ModernBertParams, batch: PackedBatch, plan, x: torch.Tensor,
              rope_tables_for, cdt: torch.dtype | None):
    """Every layer of ``model`` on ``x`` ``[T, H]`` (the embedding output) as one autograd node: on raw pointers
    (:class:`.stack_pointers.PointerStack`) where the call allows it, else :class:`EncoderStack`
    (:func:`last_pointers_off` says why). Returns ``(x, pending)``: the last layer's residual stream and its MLP
    output, to be summed into ``final_norm``."""
    args = tuple(layer_args(layer, params, plan.kernels, cdt) for layer in model.layers)
    tables = {g: rope_tables_for(g) for g in set(params.layer_is_global)}
    slots = [w for in_params, _, out_params, _ in args for w in (*in_params, *out_params)]
    present = tuple(i for i, w in enumerate(slots) if w is not None)
    projections = [i for i in present if i % _PER_LAYER in _PROJECTIONS]
    compute = [None] * len(slots)
    for i, copy in zip(projections, cast_group(tuple(slots[i] for i in projections), cdt)):
        compute[i] = copy
    fast = prepare(model, params, batch, plan, x, args, tables, present, compute, cdt)
    _LAST.pointers_off = fast if isinstance(fast, str) else None
    if not isinstance(fast, str):
        return PointerStack.apply(x, fast, *(slots[i] for i in present))
    return EncoderStack.apply(x, _Call(model, params, batch, plan, cdt, args, tables, present, compute),
                              *(slots[i] for i in present))


def last_pointers_off() -> str | None:
    """Why this thread's last stack call ran as :class:`EncoderStack` rather than on raw pointers (``None``: it ran
    on raw pointers, or no stack call ran yet)."""
    return getattr(_LAST, "pointers_off", None)


__all__ = ["EncoderStack", "last_pointers_off", "run_stack", "stack_problem"]
