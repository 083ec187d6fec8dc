"""One call through the router: gather its host facts, choose its route once, run the route.

Adapters (the patched HF forward, ``packed_forward``) turn their caller's arguments into the inputs here and
the result back into their caller's outputs; everything between — which route, the one host sync of a padded
call, staging a graph's batch before that sync, the replay or the eager forward, the counters ``describe()``
shows — happens here. Facts are read from the encoder's frozen ``state.tuning`` and from torch's modes, never
from the environment.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .batch import PackedBatch, unpad
from .graphs import route as graphs
from .model.dropout import applies_attention_dropout, applies_dropout, dropout_modules
from .model.calls import graph_refusal, read_calls
from .model.forward import activation_dtype, encoder_forward, input_grads_hooked, plan_attention
from .model.plan import last_plan, rules_for
from .model.stack import last_pointers_off
from .router import Eager, Facts, PackedGraph, RectangularGraph, Route, Stock, TrainingGraph, choose

_INTEGER = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _integer(t: torch.Tensor | None, allow_bool: bool = True) -> bool:
    return t is None or t.dtype in _INTEGER or (allow_bool and t.dtype == torch.bool)


def _embedding(model: nn.Module) -> nn.Embedding:
    """``model.embeddings.tok_embeddings`` through the module dicts (each ``nn.Module.__getattr__`` costs a
    microsecond of host time per call; read live, so a moved or resized embedding is seen)."""
    return model._modules["embeddings"]._modules["tok_embeddings"]


def raise_earlier_errors(state) -> None:
    """Raise the input errors of this encoder's earlier sync-free graph calls whose GPU work has completed
    (``GraphConfig.sync_free`` reports them one call late); never waits. Every call starts with it."""
    graphs.poll_deferred(state)


def _dropout_modules(model: nn.Module, state):
    """The dropout-applying modules, from the structure snapshot (rebuilt whenever the module tree changes; the
    structure check runs before every route)."""
    snap = state.runtime.get("structure")
    return dropout_modules(model) if snap is None else snap["dropout"]


def module_calls(model: nn.Module, state):
    """The encoder's called Linear slots (:class:`~packed_encoders.model.calls.ModuleCalls`, ``None``: every slot
    an ``nn.Linear``), from the structure snapshot (the structure check before every route keeps it current), or
    read from the live modules where there is none."""
    snap = state.runtime.get("structure")
    return read_calls(model) if snap is None else snap["calls"]


def autocast_dtype(weight: torch.Tensor) -> torch.dtype | None:
    """The CUDA autocast dtype a call of the encoder whose embedding weight is ``weight`` runs under, the key of its
    graphs and weight copies; ``None`` when off, off CUDA, or for a float64 model (autocast casts no float64
    tensor: such a model runs in float64 under it, as stock does)."""
    if weight.is_cuda and weight.dtype is not torch.float64 and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def mode_facts(model: nn.Module, state) -> dict:
    """The facts every graph route admits on: the encoder's switches, grad / autocast / dropout, its device, its
    called Linear slots (:func:`~packed_encoders.model.calls.graph_refusal`). ``dropout`` reads each module's live
    mode and rate (Monte-Carlo dropout in an eval model, a rate set after ``pack()``): a graph would replay a forward
    without dropout."""
    weight = _embedding(model)._parameters["weight"]
    on_cuda = weight.is_cuda
    dropout = applies_dropout(_dropout_modules(model, state), state.params.attention_dropout)
    grad = torch.is_grad_enabled()
    config = state.options.cuda_graph
    # (read where a graph route would otherwise be open: the adapters' state costs ~2-3 us per called slot)
    asks = config is not None and (config.training or not grad)
    refusal, adapters = graph_refusal(model, module_calls(model, state), grad) if asks else (None, None)
    facts = dict(module_calls=refusal, adapters=adapters,
                 kill_switch=not state.tuning.graphs, suspended=state.runtime.get("graphs_suspended", 0) > 0,
                 grad=grad, dropout=dropout,
                 autocast=autocast_dtype(weight),
                 model_on_cuda=on_cuda)
    if grad and config is not None and config.training:
        facts.update(checkpointing=bool(_gradient_checkpointing(model)),
                     input_grads=input_grads_hooked(_embedding(model)))
    return facts


def padded_route(model: nn.Module, state, *, structure: str | None = None, input_ids=None, inputs_embeds=None,
                 attention_mask=None, position_ids=None, token_type_ids=None, trailing: bool = False,
                 hidden_states: bool = False, position_zero: bool = False) -> Route:
    """The route of a padded ``[B, S]`` call (``structure``: what the packed forward would skip, if anything;
    ``position_zero``: a head reads position 0, checked for padding at the call's sync)."""
    config = state.options.cuda_graph
    if structure is not None or config is None:
        return choose(Facts(structure=structure, graphs=config))
    facts = Facts(graphs=config, hidden_states=hidden_states, inputs_embeds=inputs_embeds is not None, padded=True,
                  **mode_facts(model, state))
    if config.sync_free:
        _sync_free_facts(facts, model, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids,
                         trailing)
        facts.position_zero = position_zero
    return choose(facts)


def _sync_free_facts(facts: Facts, model, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids,
                     trailing: bool) -> None:
    """The padded call's shapes, dtypes and devices, which the sync-free path admits on."""
    emb = _embedding(model)
    weight = emb.weight
    src = input_ids if input_ids is not None else inputs_embeds
    facts.well_formed = src.dim() >= 2 and (input_ids is None or input_ids.dim() == 2) and all(
        t is None or tuple(t.shape) == tuple(src.shape[:2]) for t in (attention_mask, token_type_ids))
    if not facts.well_formed:
        return
    tensors = [t for t in (input_ids, attention_mask, token_type_ids) if t is not None]
    facts.position_ids = position_ids is not None
    facts.query_only = trailing
    facts.integer_inputs = _integer(input_ids, allow_bool=False) and _integer(attention_mask) and _integer(
        token_type_ids)
    facts.same_device = all(t.device == weight.device for t in tensors)
    facts.batch, facts.width = int(src.shape[0]), int(src.shape[1])
    facts.vocab = emb.num_embeddings


def packed_route(model: nn.Module, state, batch: PackedBatch, *, structure: str | None = None,
                 hidden_states: bool = False) -> Route:
    """The route of an already packed call (its sizes are host facts)."""
    config = state.options.cuda_graph
    if structure is not None or config is None:
        return choose(Facts(structure=structure, graphs=config))
    return choose(Facts(graphs=config, hidden_states=hidden_states, inputs_embeds=batch.inputs_embeds is not None,
                        same_device=batch.device == _embedding(model)._parameters["weight"].device,
                        num_seqs=batch.num_seqs, total_tokens=batch.total_tokens, max_seqlen=batch.max_seqlen,
                        **mode_facts(model, state)))


def _gradient_checkpointing(model: nn.Module) -> tuple | bool:
    """HF's per-layer choice (``gradient_checkpointing_enable(every_n_layers=...)`` flags each layer): per layer the
    checkpoint function HF would call (its kwargs and CPU offload included), ``True`` for the default, or ``None``;
    ``False`` when no layer is checkpointed. transformers v4 flags the model only, for every layer."""
    default = getattr(model, "gradient_checkpointing", False)
    flags = [getattr(layer, "gradient_checkpointing", default) for layer in model.layers]
    if not any(flags):
        return False
    return tuple((vars(layer).get("_gradient_checkpointing_func") or True) if flag else None
                 for layer, flag in zip(model.layers, flags))


def run_packed(model: nn.Module, state, batch: PackedBatch, *, hidden_states: list | None = None,
               hidden_pre_norm_last: bool = False, attention_backend: str | None = None) -> torch.Tensor:
    """The eager route: the packed encoder with ``state``'s options; records the attention plan for
    ``describe()``. Returns ``[T, hidden_size]``."""
    params = state.params
    grad = torch.is_grad_enabled()
    modules = _dropout_modules(model, state)
    dropout = applies_attention_dropout(modules, params.attention_dropout)
    requested = attention_backend or state.options.attention_backend
    if dropout and requested == "auto":
        requested = "sdpa"  # the only backend with attention-probability dropout; describe() reports it
    plan = plan_attention(params, batch, requested, grad=grad, dtype=activation_dtype(model), dropout=dropout,
                          policy=state.policy)
    state.last_plan = {("global" if w is None else f"window {w}"): d.backend for w, d in plan.items()}
    state.last_fallbacks = list(dict.fromkeys(r for d in plan.values() for r in d.reasons))  # once per reason
    out = encoder_forward(model, params, batch, attention=plan, ops=state.ops,
                          gradient_checkpointing=_gradient_checkpointing(model), hidden_states=hidden_states,
                          hidden_pre_norm_last=hidden_pre_norm_last, rules=rules_for(state.tuning),
                          calls=module_calls(model, state))
    state.runtime["eager_plan"] = last_plan()  # this thread's forward just ran it; describe() shows its facts
    state.runtime["eager_dropout"] = applies_dropout(modules, params.attention_dropout)
    state.runtime["eager_stack_pointers_off"] = last_pointers_off()
    return out


def empty_output(model: nn.Module, state, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[0, hidden]`` in ``dtype`` (default :func:`activation_dtype`) for a call without a real token. With
    gradients enabled it is tied by a zero term to every trainable parameter (and to ``src`` when it requires
    gradients, ``inputs_embeds``): stock's forward runs its layers over the padding, so a backward through a loss
    over such a batch gives those zeros as gradients; without the tie it would raise (no tensor requiring
    gradients), and DDP would find parameters without a gradient."""
    out = torch.zeros(0, state.params.hidden_size, device=src.device, dtype=dtype or activation_dtype(model))
    if torch.is_grad_enabled():
        leaves = [p for p in model.parameters() if p.requires_grad] + ([src] if src.requires_grad else [])
        if leaves:
            out = out + torch.stack([t.reshape(-1)[:0].sum() for t in leaves]).sum().to(out.dtype)
    return out


def serve_batch(model: nn.Module, state, route: Route, batch: PackedBatch, *, hidden_states: list | None = None,
                hidden_pre_norm_last: bool = False, backend: str | None = None) -> torch.Tensor:
    """Run ``route`` (not :class:`Stock`) on an already packed ``batch``; returns ``[T, hidden]`` owned by the
    caller."""
    if isinstance(route, PackedGraph):
        out = graphs.graph_forward(model, state, batch, torch.clone, bucket=route.bucket, autocast=route.autocast,
                                   backend=backend, adapters=route.adapters)
        if out is not None:
            return out
    elif isinstance(route, TrainingGraph):
        out = graphs.train_forward(model, state, batch, bucket=route.bucket, autocast=route.autocast, backend=backend)
        if out is not None:
            return out
    elif isinstance(route, Eager):
        graphs.note_eager(model, state, route.reason)
    return run_packed(model, state, batch, hidden_states=hidden_states, hidden_pre_norm_last=hidden_pre_norm_last,
                      attention_backend=backend)


def serve_padded(model: nn.Module, state, route: Route, *, input_ids, inputs_embeds, attention_mask, position_ids,
                 token_type_ids, trailing: bool, hidden_states: bool, hidden_pre_norm_last: bool = False,
                 leading_stock: bool = False, column_zero_stock: bool = False, empty_rows_stock: bool = False,
                 far_padding_stock: int | None = None):
    """Run ``route`` (not :class:`Stock`) on a padded call; returns ``(last [B, S, hidden], hidden states as a
    tuple of [B, S, hidden] or None)``. Padded positions are zeros, except computed trailing ones
    (``leading_stock``: padding before real tokens raises ``StockOnlyInput``; ``column_zero_stock``: so does padding
    at a row's position 0; ``empty_rows_stock``: a row without real tokens; ``far_padding_stock``: padding reaching
    farther than that half window past a row's real tokens; see ``batch.unpad``)."""
    if isinstance(route, RectangularGraph):
        last = graphs.sync_free_forward(model, state, route.bucket, input_ids=input_ids, attention_mask=attention_mask,
                                        token_type_ids=token_type_ids, autocast=route.autocast,
                                        adapters=route.adapters)
        if last is not None:
            return last, None
        route = PackedGraph(None, route.autocast, adapters=route.adapters)  # (not captured: the synced path)
    prepared = None
    if isinstance(route, PackedGraph):
        if route.sync_free_refusal is not None:
            graphs.note_eager(model, state, None, route.sync_free_refusal)
        # before unpad's host sync, while the GPU may still run the previous call: after it, the GPU idles
        prepared = graphs.prepare(model, state, route.adapters)
    elif isinstance(route, Eager):
        graphs.note_eager(model, state, route.reason, route.sync_free_refusal)
    before_sync = (functools.partial(graphs.prestage, prepared)
                   if prepared is not None and state.tuning.prestage else None)
    batch = unpad(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                  position_ids=position_ids, token_type_ids=token_type_ids,
                  vocab_size=_embedding(model).num_embeddings, trailing_query_only=trailing,
                  leading_stock=leading_stock, column_zero_stock=column_zero_stock,
                  empty_rows_stock=empty_rows_stock, far_padding_stock=far_padding_stock,
                  before_sync=before_sync, fused=state.tuning.fused_unpad,
                  # GradCache: a training step's no-grad forward of a chunk, then its forward with gradients
                  remember=state.tuning.unpad_reuse and model.training and not torch.is_grad_enabled(),
                  reuse=state.tuning.unpad_reuse and torch.is_grad_enabled())
    if batch.lengths_reused:
        state.runtime["unpad_syncs_skipped"] = state.runtime.get("unpad_syncs_skipped", 0) + 1
    hidden = [] if hidden_states else None
    if batch.total_tokens == 0:
        out = empty_output(model, state, input_ids if input_ids is not None else inputs_embeds)
        if hidden is not None:
            hidden.extend([out] * (state.params.num_hidden_layers + 1))
    else:
        if prepared is not None:
            last = graphs.graph_forward(model, state, batch, batch.pad, autocast=route.autocast, prepared=prepared)
            if last is not None:
                return last, None
        out = None
        if isinstance(route, TrainingGraph):
            out = graphs.train_forward(model, state, batch, autocast=route.autocast)
        if out is None:
            out = run_packed(model, state, batch, hidden_states=hidden, hidden_pre_norm_last=hidden_pre_norm_last)
    return batch.pad(out), None if hidden is None else tuple(batch.pad(h) for h in hidden)


__all__ = ["Eager", "PackedGraph", "RectangularGraph", "Stock", "empty_output", "mode_facts", "module_calls",
           "packed_route", "padded_route", "raise_earlier_errors", "run_packed", "serve_batch", "serve_padded"]
