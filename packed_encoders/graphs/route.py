"""Routing between graph replay and the eager packed forward, and the user-facing switches.

``graph_forward`` is called by the patched HF forward and by ``packed_forward`` after the batch is built
(its one host sync already paid). It reads host facts only, then either replays a graph or returns
``None`` so the caller runs the eager path. ``sync_free_forward`` is called by the patched HF forward
*before* ``unpad`` when ``GraphConfig.sync_free`` is on: it serves a padded call from a rectangular graph
(:mod:`.rectangular`) without any host sync, or returns ``None`` so the call takes the synced path.
Graph state lives in ``PackState.runtime`` (never copied or pickled) under ``"graphs"``; ``no_cuda_graph``
nesting depth under ``"graphs_suspended"``; pending sync-free input checks under ``"graph_checks"``
(:class:`.deferred.DeferredChecks`).
"""

from __future__ import annotations

import contextlib
import operator
import threading
from dataclasses import asdict, replace
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from ..errors import PackedEncodersError
from ..switches import switched_off
from . import buckets as B
from .buckets import Bucket, CallFacts, RectBucket, RectFacts, admit, admit_rect, precapture_buckets
from .config import GraphConfig, normalize
from .manager import GraphManager

ENV = "PACKED_ENCODERS_GRAPH"
_RUNTIME_LOCK = threading.Lock()


def kill_switch() -> bool:
    """True when ``PACKED_ENCODERS_GRAPH`` is 0/false/off/no (read on every call)."""
    return switched_off(ENV)


def _manager(state) -> GraphManager | None:
    config = state.options.cuda_graph
    if config is None:
        return None
    mgr = state.runtime.get("graphs")
    if mgr is None or (mgr.config is not config and mgr.config != config):
        with _RUNTIME_LOCK:
            mgr = state.runtime.get("graphs")
            if mgr is None or (mgr.config is not config and mgr.config != config):
                mgr = GraphManager(config)
                state.runtime["graphs"] = mgr
    return mgr


_PARAMETERS = operator.itemgetter("_parameters")  # from a module's instance __dict__ (cheaper than getattr)
_DATA_PTR = torch.Tensor.data_ptr


def _weights(model) -> tuple:
    """``(module __dict__s, names, slot values, params)``: every ``_parameters`` slot of every module (``None``
    ones too, so a bias added later is seen) as parallel tuples, and the non-``None`` parameters; listed once
    per manager, so a call checks them with C-level ``map`` instead of a Python loop."""
    slots = [(vars(m), n, p) for m in model.modules() for n, p in m._parameters.items()]
    return (tuple(m for m, _, _ in slots), tuple(n for _, n, _ in slots), tuple(p for _, _, p in slots),
            tuple(p for _, _, p in slots if p is not None))


def fingerprint(model, mgr: GraphManager) -> tuple:
    """Device, dtype and the storage address of every parameter: a captured graph reads weights by address,
    so ``.to(dtype)``, ``.to(device)``, ``.half()`` or reassigning ``param.data`` must drop it.

    The ``(module, name)`` slots are listed once per manager (walking the module tree every call costs more
    than the graph saves); each call checks, reading each module's ``_parameters`` live, that every slot still
    holds the listed Parameter object (or ``None``), so ``load_state_dict(assign=True)``, ``param =
    nn.Parameter(...)`` or a bias added where there was none re-lists and, storage having moved, drops the
    graphs. Swapping whole submodules is not seen: call ``set_cuda_graph(model, True)`` after it. The listed
    objects stay referenced, so a replaced parameter's old storage is never freed under a graph.
    """
    weights = mgr.weights
    if weights is None or not all(map(operator.is_, map(dict.get, map(_PARAMETERS, weights[0]), weights[1]),
                                      weights[2])):
        weights = mgr.weights = _weights(model)
    params = weights[3]
    w0 = params[0]
    return (w0.device, w0.dtype, *map(_DATA_PTR, params))


def _mode_facts(model, state, weight: torch.Tensor, hidden_states: bool) -> dict:
    """The facts both graph paths admit on: switches, grad / autocast / dropout modes, the model's device."""
    on_cuda = weight.device.type == "cuda"
    return dict(kill_switch=kill_switch(), suspended=state.runtime.get("graphs_suspended", 0) > 0,
                grad=torch.is_grad_enabled(), autocast=on_cuda and torch.is_autocast_enabled("cuda"),
                dropout=model.training and state.params.has_dropout, hidden_states=hidden_states,
                model_on_cuda=on_cuda)


def call_facts(model, state, batch, *, hidden_states: bool, mode: dict | None = None) -> CallFacts:
    """Host-visible facts of one call (no device reads); ``mode``: :func:`_mode_facts`, when read already."""
    weight = model.embeddings.tok_embeddings.weight
    return CallFacts(
        **(mode if mode is not None else _mode_facts(model, state, weight, hidden_states)),
        inputs_embeds=batch.inputs_embeds is not None,
        same_device=batch.device == weight.device,
        num_seqs=batch.num_seqs,
        total_tokens=batch.total_tokens,
        max_seqlen=batch.max_seqlen,
    )


def _capture_kw(model, mgr: GraphManager) -> dict:
    """The shared pool, the capture side stream on the model's device and the warm-up count, for a runner."""
    device = model.embeddings.tok_embeddings.weight.device
    if mgr.pool is None:
        mgr.pool = torch.cuda.graph_pool_handle()
    if mgr.stream is None or mgr.stream.device != device:
        mgr.stream = torch.cuda.Stream(device)
    return dict(pool=mgr.pool, stream=mgr.stream, warmup=mgr.config.warmup)


def _build(model, state, mgr: GraphManager, bucket: Bucket, requested: str, query_only: bool = False):
    from .runner import GraphRunner, fused_stage_available

    device = model.embeddings.tok_embeddings.weight.device
    fused = fused_stage_available(device)
    _order_streams(mgr, device)  # the capture empties the shared inbox, which a replay on another stream may read
    return GraphRunner(model, state, bucket, requested, query_only=query_only, fused_stage=fused,
                       inbox=_inbox(mgr, device) if fused else None, **_capture_kw(model, mgr))


def _inbox(mgr: GraphManager, device: torch.device):
    """The encoder's inbox on ``device``, sized for every admitted call (caller holds ``mgr.lock``)."""
    inbox = mgr.inbox
    if inbox is None or inbox.device != device:
        from ..ops.triton.stage import Inbox

        inbox = mgr.inbox = Inbox(mgr.config.token_limit, mgr.config.max_seqs, device)
    return inbox


def _precapture(model, state, mgr: GraphManager) -> None:
    """Capture ``config.precapture`` once per weights fingerprint (caller holds ``mgr.lock``)."""
    if not mgr.config.precapture or mgr.precaptured_for == mgr.fingerprint:
        return
    mgr.precaptured_for = mgr.fingerprint
    requested = state.options.attention_backend
    for bucket in precapture_buckets(mgr.config):
        mgr.get((requested, bucket, False), lambda b=bucket: _build(model, state, mgr, b, requested))


def _order_streams(mgr: GraphManager, device: torch.device) -> None:
    """Every graph of an encoder shares one pool, and each bucket one set of static buffers: a replay issued
    on another stream than the last one waits for it (host order alone is not device order)."""
    if device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    if mgr.last_stream is not None and mgr.last_stream != stream:
        stream.wait_stream(mgr.last_stream)
    mgr.last_stream = stream


class Prepared(NamedTuple):
    """What :func:`prepare` read before the call's host sync: the manager, the mode facts, the weights
    fingerprint it checked (``None``: not checked), and the call's token for inbox ownership (a bare object,
    so the inbox never references the manager back)."""

    mgr: GraphManager
    mode: dict
    fingerprint: Any
    token: Any = None
    device: Any = None  # the model's device when the modes were accepted (``fingerprint`` set)


def prepare(model, state, *, hidden_states: bool, inputs_embeds: bool = False) -> Prepared | None:
    """The batch-independent part of :func:`graph_forward`, run before the call's one host sync.

    After the sync the GPU idles until the graph is launched, so everything that does not depend on the
    batch's sizes happens here, while the previous replay still runs: the mode facts and, for a call whose
    modes admission accepts, the weights fingerprint (with the invalidation and precapture it may trigger).
    A call that admission will refuse touches no graph, as when admission came first. ``None`` when graphs are
    off for the encoder."""
    mgr = _manager(state)
    if mgr is None:
        return None
    weight = model.embeddings.tok_embeddings.weight
    mode = _mode_facts(model, state, weight, hidden_states)
    checked = None
    if mode["model_on_cuda"] and B.mode_refusal(SimpleNamespace(**mode, inputs_embeds=inputs_embeds)) is None:
        with mgr.lock:
            fp = fingerprint(model, mgr)
            if fp != mgr.fingerprint and len(mgr) and weight.is_cuda:
                # graphs are about to be dropped while the previous call's replay may still run (we are
                # before this call's sync): wait for it first; weights change rarely, so this sync is too
                torch.cuda.current_stream(weight.device).synchronize()
            mgr.check_fingerprint(fp)
            _precapture(model, state, mgr)
            checked = mgr.fingerprint
    return Prepared(mgr, mode, checked, object(), weight.device)


PRESTAGE_ENV = "PACKED_ENCODERS_GRAPH_PRESTAGE"  # "0": stage after the sync (A/B, or to rule it out)


def prestage(prepared: Prepared | None, ids: torch.Tensor | None, pos: torch.Tensor, cu: torch.Tensor,
             key_lens: torch.Tensor | None) -> None:
    """``unpad``'s hook before its host sync: copy the batch into the encoder's inbox, so that after the sync a
    replay is one launch (see :mod:`packed_encoders.ops.triton.stage`). ``ids`` / ``pos`` may hold more rows
    than the batch's tokens (``unpad``'s padded-size buffers). Skipped, leaving the staging to the replay, when
    the call's modes refuse graphs, it is not on the model's CUDA device, it has more sequences than
    ``max_seqs``, or the kernels cannot take it. The inbox then names ``prepared.token`` as its owner:
    :func:`graph_forward` stages again when another call has filled it (or a capture has emptied it) since. A
    call that admission refuses after the sync has paid one launch here for nothing."""
    if prepared is None or prepared.fingerprint is None or ids is None or switched_off(PRESTAGE_ENV):
        return
    from ..ops.triton.stage import fill_inbox, fillable
    from .runner import fused_stage_available

    mgr = prepared.mgr
    num = cu.shape[0] - 1
    if num > mgr.config.max_seqs or not fillable(ids, pos, cu, key_lens) or not fused_stage_available(cu.device):
        return  # (fused_stage_available: CUDA with Triton)
    with mgr.lock:
        if mgr.fingerprint is not prepared.fingerprint or cu.device != prepared.device:
            return  # the weights moved since prepare(), or the batch is on another device: no graph serves it
        inbox = _inbox(mgr, cu.device)
        _order_streams(mgr, cu.device)  # a replay on another stream may still read the inbox
        fill_inbox(inbox, ids, pos, cu, key_lens)
        inbox.owner = prepared.token


def graph_forward(model, state, batch, finish, *, hidden_states: bool = False, backend: str | None = None,
                  prepared: Prepared | None = None):
    """Serve ``batch`` from a captured graph and return ``finish(out)`` (``out``: a view of the static
    ``[T, hidden]`` output, which ``finish`` must copy), or ``None`` when the call must run eagerly.

    ``prepared``: :func:`prepare`'s result for this call, read before its host sync (``None``: read here).
    A bucket whose capture fails (warned once, listed by ``describe()``) runs eagerly from then on.
    """
    if prepared is None:  # the fingerprint is then checked below, once admission has accepted the call
        mgr = _manager(state)
        if mgr is None:
            return None
        weight = model.embeddings.tok_embeddings.weight
        prepared = Prepared(mgr, _mode_facts(model, state, weight, hidden_states), None)
    mgr = prepared.mgr
    if prepared.fingerprint is not None:  # prepare() accepted the modes, with the model on CUDA
        bucket = B.admit_sizes(mgr.config, batch.device == prepared.device, batch.num_seqs, batch.total_tokens,
                               batch.max_seqlen)
    else:
        bucket = admit(mgr.config, call_facts(model, state, batch, hidden_states=hidden_states, mode=prepared.mode))
    if isinstance(bucket, str):
        mgr.note_fallback(bucket)
        if bucket == B.NOT_CUDA and len(mgr):
            with mgr.lock:  # the model left the GPU: free its graphs now rather than on its return
                mgr.check_fingerprint(fingerprint(model, mgr))
        return None
    requested = backend or state.options.attention_backend
    query_only = batch.key_lens is not None  # ColBERT query expansion: its own graphs, key_lens staged
    key = (requested, bucket, query_only)
    device = batch.device
    with mgr.lock:
        if prepared.fingerprint is None:  # not checked before the sync (a thread that changed weights since
            mgr.check_fingerprint(fingerprint(model, mgr))  # and checked them cleared the graphs: get() rebuilds)
            _precapture(model, state, mgr)
        cached = key in mgr
        runner = mgr.get(key, lambda: _build(model, state, mgr, bucket, requested, query_only))
        if isinstance(runner, str):
            mgr.note_fallback(runner)
            return None
        if batch.max_position > runner.rope_rows:
            mgr.note_fallback(B.POSITIONS)
            return None
        _order_streams(mgr, device)
        inbox = getattr(runner, "inbox", None)
        staged = inbox is not None and prepared.token is not None and inbox.owner is prepared.token
        if inbox is not None:
            inbox.owner = None  # cleared before the replay: if it raises, no later call takes the inbox as its own
        out = runner.replay(batch, finish, staged=staged)
        mgr.hits += cached
        if inbox is not None:
            if staged:
                mgr.staged_before_sync += 1
            else:
                mgr.staged_after_sync += 1
    state.last_plan = dict(runner.plan_summary)
    state.last_fallbacks = list(runner.plan_reasons)
    return out


_INTEGER = frozenset({torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8})


def _integer(t: torch.Tensor | None, allow_bool: bool = True) -> bool:
    return t is None or t.dtype in _INTEGER or (allow_bool and t.dtype == torch.bool)


def rect_call_facts(model, state, *, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids,
                    trailing: bool, hidden_states: bool) -> RectFacts:
    """Host-visible facts of one padded call for the sync-free path (shapes, dtypes, devices, flags)."""
    weight = model.embeddings.tok_embeddings.weight
    src = input_ids if input_ids is not None else inputs_embeds
    tensors = [t for t in (input_ids, attention_mask, token_type_ids) if t is not None]
    return RectFacts(
        **_mode_facts(model, state, weight, hidden_states),
        inputs_embeds=inputs_embeds is not None,
        position_ids=position_ids is not None,
        query_only=trailing,
        integer_inputs=_integer(input_ids, allow_bool=False) and _integer(attention_mask)
        and _integer(token_type_ids),
        same_device=all(t.device == weight.device for t in tensors),
        batch=int(src.shape[0]),
        width=int(src.shape[1]),
    )


def _build_rect(model, state, mgr: GraphManager, bucket: RectBucket, requested: str):
    from .rectangular import RectRunner

    return RectRunner(model, state, bucket, requested, **_capture_kw(model, mgr))


def deferred_checks(state):
    """The encoder's :class:`.deferred.DeferredChecks` (created on first use)."""
    checks = state.runtime.get("graph_checks")
    if checks is None:
        from .deferred import DeferredChecks

        with _RUNTIME_LOCK:
            checks = state.runtime.get("graph_checks")
            if checks is None:
                checks = state.runtime["graph_checks"] = DeferredChecks()
    return checks


def poll_deferred(state) -> None:
    """Raise the input errors of earlier sync-free calls whose GPU work has completed (never waits).

    Raises:
        PackedEncodersError: an earlier sync-free call of this encoder failed its input checks.
    """
    checks = state.runtime.get("graph_checks")
    if checks is not None:
        checks.poll()


def sync_free_forward(model, state, *, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids,
                      trailing: bool, hidden_states: bool):
    """Serve a padded call from a rectangular graph with no host sync and return its ``[B, S, hidden]``
    output (owned by the caller), or ``None`` when it must take the synced path (``unpad``).

    Only host-visible facts are read (shapes, dtypes, devices, modes). The call's input checks are reported
    one call late (see ``GraphConfig.sync_free`` and :mod:`.deferred`).
    """
    mgr = _manager(state)
    if mgr is None or not mgr.config.sync_free:
        return None
    if input_ids is not None and input_ids.dim() != 2:
        return None  # unpad raises for the shape
    src = input_ids if input_ids is not None else inputs_embeds
    for t in (attention_mask, token_type_ids):
        if t is not None and tuple(t.shape) != tuple(src.shape[:2]):
            return None  # unpad raises for the shape
    vocab = model.embeddings.tok_embeddings.num_embeddings
    facts = rect_call_facts(model, state, input_ids=input_ids, inputs_embeds=inputs_embeds,
                            attention_mask=attention_mask, position_ids=position_ids,
                            token_type_ids=token_type_ids, trailing=trailing, hidden_states=hidden_states)
    bucket = admit_rect(mgr.config, facts, vocab)
    if isinstance(bucket, str):
        mgr.note_sync_free_fallback(bucket)
        return None
    requested = state.options.attention_backend
    key = (requested, bucket, False)
    checks = deferred_checks(state)
    with mgr.lock:
        mgr.check_fingerprint(fingerprint(model, mgr))
        _precapture(model, state, mgr)
        cached = key in mgr
        runner = mgr.get(key, lambda: _build_rect(model, state, mgr, bucket, requested))
        if isinstance(runner, str):
            mgr.note_sync_free_fallback(runner)
            return None
        _order_streams(mgr, input_ids.device)
        out, flags = runner.replay(input_ids, attention_mask, token_type_ids)
        checks.record(flags, (facts.batch, facts.width), vocab)
        mgr.hits += cached
    state.last_plan = dict(runner.plan_summary)
    state.last_fallbacks = list(runner.plan_reasons)
    return out


def check_errors(model, *, wait: bool = False):
    """Raise the input errors of earlier ``GraphConfig(sync_free=True)`` calls on every packed encoder inside
    ``model``; returns ``model`` when there are none.

    Without ``wait`` only calls whose GPU work has completed are read (never a sync); ``wait=True`` waits for
    every pending call first (one sync: use it after the last call of a loop). The next call on an encoder
    runs the non-waiting check by itself.

    Raises:
        PackedEncodersError: an earlier sync-free call failed its input checks (each failure reported once), or
            ``model`` has no packed encoder, or ``wait`` is not a bool.
    """
    if not isinstance(wait, bool):
        raise PackedEncodersError(f"check_errors: wait={wait!r} must be a bool")
    pairs = _packed_states(model)
    if not pairs:
        raise PackedEncodersError("check_errors: no packed ModernBERT encoder inside the model; call pe.pack first")
    for _, state in pairs:
        checks = state.runtime.get("graph_checks")
        if checks is not None:
            checks.poll(wait=wait)
    return model


def precapture_encoders(states) -> None:
    """At ``pack``/``set_cuda_graph``: capture each encoder's ``precapture`` buckets if it is on CUDA."""
    for model, state in states:
        mgr = _manager(state)
        if mgr is None or not mgr.config.precapture or kill_switch():
            continue
        if model.embeddings.tok_embeddings.weight.device.type != "cuda":
            continue  # captured on the first CUDA call instead
        with mgr.lock, torch.no_grad():
            mgr.check_fingerprint(fingerprint(model, mgr))
            _precapture(model, state, mgr)


def _packed_states(model):
    from ..adapters.locate import find_encoders
    from ..adapters.state import get_state

    return [(m, s) for _, m in find_encoders(model) if (s := get_state(m)) is not None]


@contextlib.contextmanager
def no_cuda_graph(model):
    """Run every packed encoder inside ``model`` eagerly within the block (model-wide, all threads; nests).

    Captured graphs are kept and serve again after the block.

    Raises:
        PackedEncodersError: ``model`` has no packed encoder.
    """
    states = [s for _, s in _packed_states(model)]
    if not states:
        raise PackedEncodersError("no_cuda_graph: no packed ModernBERT encoder inside the model; call pe.pack first")
    with _RUNTIME_LOCK:
        for s in states:
            s.runtime["graphs_suspended"] = s.runtime.get("graphs_suspended", 0) + 1
    try:
        yield model
    finally:
        with _RUNTIME_LOCK:
            for s in states:
                s.runtime["graphs_suspended"] = max(0, s.runtime.get("graphs_suspended", 0) - 1)


def set_cuda_graph(model, enabled: bool, config: GraphConfig | None = None):
    """Turn CUDA-graph replay on or off for every packed encoder inside ``model``; returns ``model``.

    ``enabled=True`` keeps the current config (or ``GraphConfig()``) unless ``config`` is given; a new config,
    or enabling again, drops captured graphs (re-listing the parameters). ``enabled=False`` frees them.

    Raises:
        PackedEncodersError: ``model`` has no packed encoder, or ``config`` given with ``enabled=False``.
    """
    if not isinstance(enabled, bool):
        raise PackedEncodersError(f"set_cuda_graph(enabled={enabled!r}): expected a bool")
    if config is not None and not enabled:
        raise PackedEncodersError("set_cuda_graph(enabled=False) takes no config")
    pairs = _packed_states(model)
    if not pairs:
        raise PackedEncodersError("set_cuda_graph: no packed ModernBERT encoder inside the model; call pe.pack first")
    for _, state in pairs:
        new = (normalize(config) or state.options.cuda_graph or GraphConfig()) if enabled else None
        state.options = replace(state.options, cuda_graph=new)
        state.runtime.pop("graphs", None)
    if enabled:
        precapture_encoders(pairs)
    return model


def describe_graphs(state, device: torch.device | None = None) -> dict:
    """JSON-serialisable graph state of one encoder for ``describe()``; with the encoder's ``device``, also
    ``idle_reason``: why no call can replay a graph right now (``None`` when calls can)."""
    config = state.options.cuda_graph
    out = {"enabled": config is not None, "kill_switch": kill_switch(),
           "suspended": state.runtime.get("graphs_suspended", 0) > 0}
    if config is None:
        return out
    if device is not None:
        out["idle_reason"] = (f"{ENV} is off" if out["kill_switch"] else
                              "inside no_cuda_graph()" if out["suspended"] else
                              None if device.type == "cuda" else
                              f"the model is on {device.type}: graphs engage on CUDA only (calls run eagerly)")
    out["config"] = asdict(config)
    mgr = state.runtime.get("graphs")
    if config.sync_free:
        checks = state.runtime.get("graph_checks")
        if checks is not None:
            checks.refresh()  # reads completed checks (never waits, never raises)
        out["sync_free"] = {"fallbacks": {} if mgr is None else dict(mgr.sync_free_fallbacks),
                            "calls": 0 if checks is None else checks.calls,
                            "pending_checks": 0 if checks is None else checks.pending,
                            "unreported_errors": 0 if checks is None else checks.unreported,
                            "errors_raised": 0 if checks is None else checks.errors_raised}
    if mgr is None:
        out.update(graphs=0, buckets=[], hits=0, misses=0)
        return out
    from .runner import pool_reserved_bytes

    buckets = [{"backend": req, "tokens": b.tokens, "seqs": b.seqs, "seqlen": b.seqlen, "query_only": q,
                "attention": dict(getattr(r, "plan_summary", {})),
                **({"layout": "rectangular", "batch": b.batch, "dead_padding": getattr(r, "dead_padding", False)}
                   if isinstance(b, RectBucket) else {})}
               for (req, b, q), r in zip(mgr.keys(), mgr.runners())]
    out.update(graphs=len(mgr), buckets=buckets, hits=mgr.hits, misses=mgr.misses, evictions=mgr.evictions,
               invalidations=mgr.invalidations, capture_seconds=round(mgr.capture_seconds, 4),
               fallbacks=dict(mgr.fallbacks), capture_failures=mgr.failures(),
               staged={"before_sync": mgr.staged_before_sync, "after_sync": mgr.staged_after_sync},
               static_bytes=sum(getattr(r, "static_bytes", 0) for r in mgr.runners())
               + (0 if mgr.inbox is None else mgr.inbox.nbytes),
               pool_reserved_bytes=pool_reserved_bytes(mgr.pool) if mgr.pool is not None else 0)
    return out
