"""The graph route's machinery: the per-encoder manager, weights fingerprint, staging and replay.

The router (:mod:`packed_encoders.router`) decides from host facts which route serves a call; this module runs
the two graph routes once chosen. ``graph_forward`` replays a packed graph after the batch is built (its one
host sync already paid; a padded call's bucket is admitted here from its sizes, or it returns ``None`` so the
caller runs the eager path). ``prepare`` / ``prestage`` do the batch-independent work and the inbox fill before
that sync. ``sync_free_forward`` replays a rectangular graph with no host sync (``GraphConfig.sync_free``).
Graph state lives in ``PackState.runtime`` (never copied or pickled) under ``"graphs"``; ``no_cuda_graph``
nesting depth under ``"graphs_suspended"``; pending sync-free input checks under ``"graph_checks"``
(:class:`.deferred.DeferredChecks`). Switches come from the encoder's frozen ``state.tuning``, never the
environment. Nothing here imports the adapters or the router (imports point down).
"""

from __future__ import annotations

import functools
import operator
import threading
from dataclasses import asdict
from typing import Any, NamedTuple

import torch
from torch import nn

from ..model.calls import MODULE_CALL, graph_refusal, read_calls, replay_state
from . import buckets as B
from .buckets import Bucket, RectBucket, precapture_buckets
from .manager import GraphManager

RUNTIME_LOCK = threading.Lock()  # guards PackState.runtime entries created on demand


def module_call_refusal(model) -> str | None:
    """Why no inference graph may serve the encoder ``model`` now: a projection slot holds a module the forward
    calls whose forward a replay would not follow (:func:`..model.calls.graph_refusal`); ``None`` when graphs may.
    Read from the live modules: for the paths that would capture without asking the router (``pack()``'s graph
    check and precapture, ``set_cuda_graph``, whose module tree may have changed since the last call's structure
    check) and ``describe()``; the router asks per call from the structure snapshot (``Facts.module_calls``)."""
    return graph_refusal(model, read_calls(model))[0]


def graph_key(requested: str, bucket, query_only: bool = False, autocast=None) -> tuple:
    """The manager key of an inference graph (packed or rectangular ``bucket``); training graphs' keys start with
    ``"train"`` (:func:`train_forward`)."""
    return (requested, bucket, query_only, autocast)


def _manager(state) -> GraphManager | None:
    config = state.options.cuda_graph
    if config is None:
        return None
    mgr = state.runtime.get("graphs")
    if mgr is None or (mgr.config is not config and mgr.config != config):
        with RUNTIME_LOCK:
            mgr = state.runtime.get("graphs")
            if mgr is None or (mgr.config is not config and mgr.config != config):
                mgr = GraphManager(config, budget_bytes=config.max_memory_bytes)
                state.runtime["graphs"] = mgr
    return mgr


_DATA_PTR = torch.Tensor.data_ptr


class Listed(NamedTuple):
    """What a captured graph reads of the model, listed once per manager (walking the module tree every call costs
    more than the graph saves) as parallel tuples a call checks with C-level ``map``: every ``_parameters`` and
    ``_buffers`` slot of every module (``module_dicts`` their modules' instance ``__dict__``s, ``kinds`` which of
    the two, ``names``, ``values``; ``None`` slots too, so a bias added later is seen), the non-``None``
    ``params`` (training graphs keep a gradient buffer per parameter), the ``tensors`` read by address (the
    parameters, and the buffers: the rotary ``inv_freq`` a capture computes its RoPE tables from), and the
    structure snapshot's ``tree`` they were listed under."""

    module_dicts: tuple
    kinds: tuple
    names: tuple
    values: tuple
    params: tuple
    tensors: tuple
    tree: Any


def _listed(model, tree) -> Listed:
    slots = [(vars(m), kind, n, t) for m in model.modules() for kind in ("_parameters", "_buffers")
             for n, t in getattr(m, kind).items()]
    params = tuple(t for _, kind, _, t in slots if kind == "_parameters" and t is not None)
    buffers = tuple(t for _, kind, _, t in slots if kind == "_buffers" and t is not None)
    return Listed(*(tuple(slot[i] for slot in slots) for i in range(4)), params, params + buffers, tree)


_READ = object()


def fingerprint(model, state, mgr: GraphManager, adapters=_READ) -> tuple:
    """Device, dtype, the module tree and the storage address of every parameter and buffer: a captured graph reads
    them by address, so ``.to(dtype)``, ``.to(device)``, ``.half()`` or reassigning ``param.data`` must drop it;
    with called projection slots, also their adapters' state (:func:`..model.calls.replay_state`: a captured peft
    LoRA forward launched its kernels for the active adapters and their ``scaling``): ``adapters``, as the call's
    router read it (:attr:`packed_encoders.router.Facts.adapters`), else read here.

    Each call checks, reading each module's ``_parameters`` / ``_buffers`` live, that every slot listed
    (:class:`Listed`) still holds the listed tensor (or ``None``), so ``load_state_dict(assign=True)``, ``param =
    nn.Parameter(...)``, a buffer reassigned (``rotary_emb.inv_freq = ...``) or a bias added where there was none
    re-lists and, storage having moved, drops the graphs. A graph also holds the modules it was captured with: a
    submodule swapped for another of its type, layers of one attention type reordered or a norm's ``eps`` set
    change the structure snapshot's ``tree`` (:func:`packed_encoders.adapters.structure.snapshot`, current here:
    the structure check runs before every route), which re-lists and drops the graphs too; so do modules coming
    and going inside a called slot (peft's ``add_adapter`` / ``delete_adapter`` after a capture, a module put into
    ``lora_A``: the snapshot lists them too). The listed objects stay referenced, so a replaced tensor's old storage
    is never freed under a graph.
    """
    snap = state.runtime.get("structure")
    tree = None if snap is None else snap["tree"]
    calls = read_calls(model) if snap is None else snap["calls"]
    listed = mgr.listed
    if listed is None or listed.tree != tree or not all(
            map(operator.is_, map(dict.get, map(operator.getitem, listed.module_dicts, listed.kinds), listed.names),
                listed.values)):
        listed = mgr.listed = _listed(model, tree)
    w0 = listed.params[0]
    if calls is None:
        held = ()
    else:
        held = (replay_state(model, calls) if adapters is _READ or adapters is None else adapters,)
    return (w0.device, w0.dtype, tree, *held, *map(_DATA_PTR, listed.tensors))


def _capture_kw(model, mgr: GraphManager) -> dict:
    """The shared pool, the capture side stream on the model's device and the warm-up count, for a runner."""
    device = model.embeddings.tok_embeddings.weight.device
    if mgr.pool is None:
        mgr.pool = torch.cuda.graph_pool_handle()
    if mgr.stream is None or mgr.stream.device != device:
        mgr.stream = torch.cuda.Stream(device)
    return dict(pool=mgr.pool, stream=mgr.stream, warmup=mgr.config.warmup)


def _budget(model, state, mgr: GraphManager) -> None:
    """Set the manager's memory budget on its first CUDA capture, when neither the config nor an earlier
    capture set it: ``state.tuning``'s fraction of the free memory measured at ``pack()`` (or now, for a model
    moved to CUDA after ``pack()``)."""
    if mgr.budget_bytes is not None:
        return
    device = model.embeddings.tok_embeddings.weight.device
    if device.type != "cuda":
        return
    free = None if state.tuning.free_memory_bytes is not None else int(torch.cuda.mem_get_info(device)[0])
    mgr.budget_bytes = state.tuning.graph_budget_bytes(free)


def _build(model, state, mgr: GraphManager, bucket: Bucket, requested: str, query_only: bool = False,
           autocast=None):
    from .runner import GraphRunner, fused_stage_available

    device = model.embeddings.tok_embeddings.weight.device
    fused = fused_stage_available(device)
    _order_streams(mgr, device)  # the capture empties the shared inbox, which a replay on another stream may read
    return GraphRunner(model, state, bucket, requested, query_only=query_only, fused_stage=fused,
                       inbox=_inbox(mgr, device) if fused else None, autocast=autocast,
                       outputs=functools.partial(shared_output, mgr, device), casts=static_casts(model, mgr, autocast),
                       **_capture_kw(model, mgr))


def static_casts(model, mgr: GraphManager, autocast):
    """The encoder's ``autocast`` copies of its projection weights and biases (``nn.Linear`` parameters in
    another floating dtype), which its graphs under that autocast read instead of casting the weights at every
    replay; ``None`` without autocast or such parameters (caller holds ``mgr.lock``)."""
    if autocast is None:
        return None
    if autocast not in mgr.casts:
        from ..ops.weight_cast import StaticCopies

        params = [p for m in model.modules() if isinstance(m, nn.Linear) for p in (m.weight, m.bias)
                  if p is not None and p.is_floating_point() and p.dtype != autocast]
        mgr.casts[autocast] = StaticCopies(params, autocast) if params else None
    return mgr.casts[autocast]


def shared_output(mgr: GraphManager, device: torch.device, dtype: torch.dtype, tokens: int,
                  hidden: int) -> torch.Tensor:
    """The ``[tokens, hidden]`` static output of a packed graph: a view of the buffer that every packed graph of
    the encoder with a bucket in the same octave ``(rows / 2, rows]`` shares (``rows``: a power of two). One
    replay's output is copied out (``finish``) before another replay of the encoder starts (its lock,
    :func:`_order_streams`), so the graphs need not own their outputs: 8 documents over three buckets of one
    octave hold one buffer instead of three. The manager holds the buffers (and counts them against its budget)
    until :meth:`GraphManager.clear` (caller holds ``mgr.lock``)."""
    rows = 1 << max(0, tokens - 1).bit_length()
    key = (device, dtype, hidden, rows)
    buf = mgr.outputs.get(key)
    if buf is None:
        buf = mgr.outputs[key] = torch.empty(rows, hidden, dtype=dtype, device=device)
    return buf[:tokens]


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
    _budget(model, state, mgr)
    for bucket in precapture_buckets(mgr.config):
        mgr.get(graph_key(requested, bucket), lambda b=bucket: _build(model, state, mgr, b, requested))


def graph_keys(state) -> frozenset:
    """The keys of the encoder's cached graphs (empty before its first capture)."""
    mgr = state.runtime.get("graphs")
    return frozenset() if mgr is None else frozenset(mgr.keys())


def release_check_graphs(state, before: frozenset) -> int:
    """Drop the graphs a pack-time check captured for its own batches (all but ``before``, :func:`graph_keys`
    taken ahead of it, and the precaptured buckets) and give their memory back; returns how many. A check
    batch's buckets are the check's: a workload may never call them, and a kept graph holds a pool's worth of
    activations (0.9 GB for ModernBERT-base's fp32 check batch)."""
    mgr = state.runtime.get("graphs")
    if mgr is None:
        return 0
    with mgr.lock:
        requested = state.options.attention_backend
        keep = before | {graph_key(requested, b) for b in precapture_buckets(mgr.config)}
        if mgr.last_stream is not None and any(k not in keep for k in mgr.keys()):
            mgr.last_stream.synchronize()  # a check's replay may still run (one that raised before its result)
        dropped = mgr.drop(lambda k: k not in keep)
        if dropped and not len(mgr):
            mgr.pool = None  # no graph uses it now: the allocator can release it; the next capture starts another
    if dropped and torch.cuda.is_available():
        torch.cuda.empty_cache()  # at pack(): the dropped graphs' blocks would otherwise stay reserved
    return dropped


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
    """What :func:`prepare` read before the call's host sync: the manager, the weights fingerprint it checked,
    and the call's token for inbox ownership (a bare object, so the inbox never references the manager back)."""

    mgr: GraphManager
    fingerprint: Any
    token: Any = None
    device: Any = None  # the model's device when prepare() ran


def prepare(model, state, adapters=_READ) -> Prepared:
    """The batch-independent part of :func:`graph_forward`, run before a padded call's one host sync once the
    router chose a packed graph for it (so its modes are accepted and the model is on CUDA).

    After the sync the GPU idles until the graph is launched, so everything that does not depend on the
    batch's sizes happens here, while the previous replay still runs: the weights fingerprint (with the
    invalidation and precapture it may trigger); ``adapters``: the route's (:func:`fingerprint`)."""
    mgr = _manager(state)
    weight = model.embeddings.tok_embeddings.weight
    with mgr.lock:
        fp = fingerprint(model, state, mgr, adapters)
        if fp != mgr.fingerprint and len(mgr) and weight.is_cuda:
            # graphs are about to be dropped while the previous call's replay may still run (we are
            # before this call's sync): wait for it first; weights change rarely, so this sync is too
            torch.cuda.current_stream(weight.device).synchronize()
        mgr.check_fingerprint(fp)
        _precapture(model, state, mgr)
        checked = mgr.fingerprint
    return Prepared(mgr, checked, object(), weight.device)


def prestage(prepared: Prepared | None, ids: torch.Tensor | None, pos: torch.Tensor, cu: torch.Tensor,
             key_lens: torch.Tensor | None) -> None:
    """``unpad``'s hook before its host sync: copy the batch into the encoder's inbox, so that after the sync a
    replay is one launch (see :mod:`packed_encoders.ops.triton.stage`). ``ids`` / ``pos`` may hold more rows
    than the batch's tokens (``unpad``'s padded-size buffers). Skipped, leaving the staging to the replay, when
    the call's modes refuse graphs, it is not on the model's CUDA device, it has more sequences than
    ``max_seqs``, or the kernels cannot take it. The inbox then names ``prepared.token`` as its owner:
    :func:`graph_forward` stages again when another call has filled it (or a capture has emptied it) since. A
    call that admission refuses after the sync has paid one launch here for nothing. The caller passes this hook
    only when the encoder's tuning has ``prestage`` on (``PACKED_ENCODERS_GRAPH_PRESTAGE``)."""
    if prepared is None or prepared.fingerprint is None or ids is None:
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


def graph_forward(model, state, batch, finish, *, bucket: Bucket | None = None, autocast=None,
                  backend: str | None = None, prepared: Prepared | None = None, adapters=_READ):
    """Serve ``batch`` from a captured graph and return ``finish(out)`` (``out``: a view of the static
    ``[T, hidden]`` output, which ``finish`` must copy), or ``None`` when the call must run eagerly.

    The router chose a packed graph for the call (its modes are accepted, the model is on CUDA). ``bucket``:
    the router's bucket for a packed call; ``None`` admits the batch's sizes here (a padded call, whose sizes
    its sync has just read); a refusal is counted. ``autocast``: the call's CUDA autocast dtype (graphs are
    keyed and captured by it). ``prepared``: :func:`prepare`'s result for this call, read before its host sync
    (``None``: the fingerprint is checked here, with the route's ``adapters``). A bucket whose capture fails
    (warned once, listed by ``describe()``) runs eagerly from then on.
    """
    mgr = prepared.mgr if prepared is not None else _manager(state)
    if bucket is None:
        device = prepared.device if prepared is not None else model.embeddings.tok_embeddings.weight.device
        bucket = B.admit_sizes(mgr.config, batch.device == device, batch.num_seqs, batch.total_tokens,
                               batch.max_seqlen)
        if isinstance(bucket, str):
            mgr.note_fallback(bucket)
            return None
    requested = backend or state.options.attention_backend
    query_only = batch.key_lens is not None  # ColBERT query expansion: its own graphs, key_lens staged
    key = graph_key(requested, bucket, query_only, autocast)
    device = batch.device
    with mgr.lock:
        if prepared is None or prepared.fingerprint is None:  # not checked before the sync (a thread that
            # changed weights since cleared the graphs: get() rebuilds)
            mgr.check_fingerprint(fingerprint(model, state, mgr, adapters))
            _precapture(model, state, mgr)
        cached = key in mgr
        _budget(model, state, mgr)
        runner = mgr.get(key, lambda: _build(model, state, mgr, bucket, requested, query_only, autocast))
        if isinstance(runner, str):
            mgr.note_fallback(runner)
            return None
        if batch.max_position > runner.rope_rows:
            mgr.note_fallback(B.POSITIONS)
            return None
        _order_streams(mgr, device)
        inbox = getattr(runner, "inbox", None)
        staged = (inbox is not None and prepared is not None and prepared.token is not None
                  and inbox.owner is prepared.token)
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


def train_forward(model, state, batch, *, bucket: Bucket | None = None, autocast=None, backend: str | None = None):
    """Serve a call with gradients from a training graph (``GraphConfig.training``, :mod:`.training`): returns
    ``[T, hidden]`` whose autograd node replays the captured backward, or ``None`` when the call must run the
    eager training path (the reason counted). ``bucket``: the router's, for a packed call; ``None`` admits the
    batch's sizes on the training token grid here (a padded call after its sync)."""
    from .training import TOO_MANY_PENDING, Lease, Slots, replay

    mgr = _manager(state)
    config = mgr.config
    if bucket is None:
        device = model.embeddings.tok_embeddings.weight.device
        bucket = B.admit_sizes(config, batch.device == device, batch.num_seqs, batch.total_tokens, batch.max_seqlen,
                               config.training_steps_per_octave)
        if isinstance(bucket, str):
            mgr.note_fallback(bucket)
            return None
    requested = backend or state.options.attention_backend
    query_only = batch.key_lens is not None
    with mgr.lock:
        mgr.check_fingerprint(fingerprint(model, state, mgr))
        trainable = tuple(p.requires_grad for p in mgr.listed.params)
        if not any(trainable):
            mgr.note_fallback(B.FROZEN)
            return None
        if mgr.train_slots is None:
            mgr.train_slots = Slots(config.training_slots)
        slot = mgr.train_slots.take()
        if slot is None:
            mgr.note_fallback(TOO_MANY_PENDING)
            return None
        lease = Lease(mgr.train_slots, slot)
        try:
            key = ("train", requested, bucket, query_only, autocast, slot, trainable)
            cached, failed = key in mgr, mgr.is_failed(key)
            _budget(model, state, mgr)
            runner = mgr.get(key, lambda: _build_train(model, state, mgr, bucket, requested, query_only, autocast,
                                                       slot, trainable))
            if isinstance(runner, str):
                if not failed and mgr.is_failed(key):  # a capture failed just now: later ones get a fresh pool
                    mgr.train_pools.pop(slot, None)    # and stream (torch may leave both mid-capture)
                    mgr.stream = None
                mgr.note_fallback(runner)
                lease.release()
                return None
            if batch.max_position > runner.rope_rows:
                mgr.note_fallback(B.POSITIONS)
                lease.release()
                return None
            _order_streams(mgr, batch.device)
            out = replay(runner, lease, batch)
        except BaseException:
            lease.release()
            raise
        mgr.train_hits += cached
    state.last_plan = dict(runner.plan_summary)
    state.last_fallbacks = list(runner.plan_reasons)
    return out


def _build_train(model, state, mgr: GraphManager, bucket: Bucket, requested: str, query_only: bool, autocast,
                 slot: int, trainable: tuple):
    """A :class:`.training.TrainRunner` for ``slot``: the slot's pool, the encoder's gradient buffers (caller holds
    the lock)."""
    from .training import SlotPool, TrainRunner

    params = mgr.listed.params
    buffers = mgr.train_grads  # one per parameter, shared by every slot: the node returns copies of them
    with torch.no_grad(), torch.inference_mode(False):
        grads = tuple(buffers.setdefault(i, torch.zeros_like(p)) for i, (p, t) in enumerate(zip(params, trainable))
                      if t)
    device = model.embeddings.tok_embeddings.weight.device
    if device.type == "cuda":
        kw = _capture_kw(model, mgr)
        pool = mgr.train_pools.get(slot)
        if pool is not None and bucket.tokens > pool.tokens:
            # A bucket larger than any this slot's pool has held: the slot's graphs are dropped and its pool
            # starts afresh with this one, so the smaller buckets captured after it reuse its blocks (a pool grows
            # by a whole activation set at each new largest bucket otherwise; they are recaptured on their
            # next call). No graph of the slot is pending: the slot was free to take.
            mgr.drop(lambda k: k[0] == "train" and k[5] == slot)
            del mgr.train_pools[slot]
            pool = None
            torch.cuda.empty_cache()  # the dropped pool's blocks, before the capture allocates a new one
        if pool is None:
            pool = mgr.train_pools[slot] = SlotPool(kw["stream"])
        pool.tokens = max(pool.tokens, bucket.tokens)
        kw["pool"] = pool.handle
        _order_streams(mgr, device)
    else:  # the same slots, staging and gradient buffers, run eagerly (CPU tests)
        kw = dict(capture=False)
    return TrainRunner(model, state, bucket, requested, tuple(p for p, t in zip(params, trainable) if t), grads,
                       query_only=query_only, autocast=autocast, casts=static_casts(model, mgr, autocast), **kw)


def note_eager(model, state, reason: str | None, sync_free_refusal: str | None = None) -> None:
    """Count why a call with graphs on runs eagerly (``describe()``'s ``fallbacks``); a model that left the GPU, or
    whose projection slots now hold modules the forward calls (LoRA layers put in), frees its graphs now rather than
    when they could serve again (the module tree will have changed by then: they would be captured again)."""
    mgr = _manager(state)
    if mgr is None:
        return
    if sync_free_refusal is not None:
        mgr.note_sync_free_fallback(sync_free_refusal)
    if reason is None:
        return
    mgr.note_fallback(reason)
    if (reason == B.NOT_CUDA or reason.startswith(MODULE_CALL)) and len(mgr):
        with mgr.lock:
            mgr.check_fingerprint(fingerprint(model, state, mgr))


def _build_rect(model, state, mgr: GraphManager, bucket: RectBucket, requested: str, autocast=None):
    from .rectangular import RectRunner

    return RectRunner(model, state, bucket, requested, autocast=autocast, **_capture_kw(model, mgr))


def deferred_checks(state):
    """The encoder's :class:`.deferred.DeferredChecks` (created on first use)."""
    checks = state.runtime.get("graph_checks")
    if checks is None:
        from .deferred import DeferredChecks

        with RUNTIME_LOCK:
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


def sync_free_forward(model, state, bucket: RectBucket, *, input_ids, attention_mask, token_type_ids,
                      autocast=None, adapters=_READ):
    """Serve a padded call from the rectangular graph of ``bucket`` (the router admitted it from host facts
    only) with no host sync; returns its ``[B, S, hidden]`` output (owned by the caller), or ``None`` when the
    bucket cannot be captured (the call then takes the synced path).

    The call's input checks are reported one call late (see ``GraphConfig.sync_free`` and :mod:`.deferred`).
    """
    mgr = _manager(state)
    requested = state.options.attention_backend
    key = graph_key(requested, bucket, autocast=autocast)
    checks = deferred_checks(state)
    with mgr.lock:
        mgr.check_fingerprint(fingerprint(model, state, mgr, adapters))
        _precapture(model, state, mgr)
        cached = key in mgr
        _budget(model, state, mgr)
        runner = mgr.get(key, lambda: _build_rect(model, state, mgr, bucket, requested, autocast))
        if isinstance(runner, str):
            mgr.note_sync_free_fallback(runner)
            return None
        _order_streams(mgr, input_ids.device)
        out, flags = runner.replay(input_ids, attention_mask, token_type_ids)
        checks.record(flags, (int(input_ids.shape[0]), int(input_ids.shape[1])), bucket.vocab)
        mgr.hits += cached
    state.last_plan = dict(runner.plan_summary)
    state.last_fallbacks = list(runner.plan_reasons)
    return out


def precapture_encoders(states) -> None:
    """At ``pack``/``set_cuda_graph``: capture each encoder's ``precapture`` buckets if it is on CUDA."""
    for model, state in states:
        mgr = _manager(state)
        if mgr is None or not mgr.config.precapture or not state.tuning.graphs or module_call_refusal(model):
            continue
        if model.embeddings.tok_embeddings.weight.device.type != "cuda":
            continue  # captured on the first CUDA call instead
        with mgr.lock, torch.no_grad():
            mgr.check_fingerprint(fingerprint(model, state, mgr))
            _precapture(model, state, mgr)


def describe_graphs(state, device: torch.device | None = None, model=None) -> dict:
    """JSON-serialisable graph state of one encoder for ``describe()``; with the encoder's ``device`` (and the
    encoder, ``model``), also ``idle_reason``: why no call can replay a graph right now (``None`` when calls can)."""
    config = state.options.cuda_graph
    out = {"enabled": config is not None, "mode": "off" if config is None else "auto" if state.options.graph_auto
           else "on", "kill_switch": not state.tuning.graphs, "suspended": state.runtime.get("graphs_suspended", 0) > 0}
    if config is None:
        return out
    out["serves"] = ("inference calls on CUDA (no grad, no dropout, no output_hidden_states or inputs_embeds) "
                     "within the config's bounds, under any autocast state (captured under it)"
                     + ("; with GraphConfig.training, calls with gradients too (no dropout, no gradient checkpointing, "
                        "no inputs that require gradients or output_hidden_states, at most training_slots forwards "
                        "awaiting their backward)" if config.training else "") + "; others run eagerly")
    if device is not None:
        calls = None if model is None else module_call_refusal(model)
        out["idle_reason"] = ("PACKED_ENCODERS_GRAPH is off" if out["kill_switch"] else
                              "inside no_cuda_graph()" if out["suspended"] else
                              f"the model is on {device.type}: graphs engage on CUDA only (calls run eagerly)"
                              if device.type != "cuda" else calls)
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

    buckets = []
    for key, r in zip(mgr.keys(), mgr.runners()):
        training = key[0] == "train"
        req, b, q, ac = key[1:5] if training else key
        buckets.append({"backend": req, "tokens": b.tokens, "seqs": b.seqs, "seqlen": b.seqlen, "query_only": q,
                        "autocast": None if ac is None else str(ac).replace("torch.", ""),
                        "attention": dict(getattr(r, "plan_summary", {})), "bytes": getattr(r, "graph_bytes", None),
                        **({"training": True, "slot": key[5]} if training else {}),
                        **({"layout": "rectangular", "batch": b.batch,
                            "dead_padding": getattr(r, "dead_padding", False)} if isinstance(b, RectBucket) else {})})
    if config.training:
        out["training"] = {"hits": mgr.train_hits,
                           "pending_slots": 0 if mgr.train_slots is None else len(mgr.train_slots.pending),
                           "gradient_buffer_bytes": sum(t.numel() * t.element_size() for t in mgr.train_grads.values()),
                           "pool_reserved_bytes": sum(pool_reserved_bytes(p.handle) or 0
                                                      for p in mgr.train_pools.values())}
    out.update(graphs=len(mgr), buckets=buckets, hits=mgr.hits, misses=mgr.misses, evictions=mgr.evictions,
               memory={"budget_bytes": mgr.budget_bytes, "graph_bytes": mgr.graph_bytes,
                       "shared_output_bytes": mgr.output_bytes(), "weight_copy_bytes": mgr.cast_bytes(),
                       "rule": "LRU evicts graphs until their bytes (static buffers + pool growth at capture), "
                               "the shared outputs and the weight copies fit the budget: "
                               "GraphConfig.max_memory_bytes, else PACKED_ENCODERS_GRAPH_MEMORY (default 0.1) of the "
                               "free GPU memory at pack() (or at the first capture)"},
               invalidations=mgr.invalidations, capture_seconds=round(mgr.capture_seconds, 4),
               fallbacks=dict(mgr.fallbacks), capture_failures=mgr.failures(),
               staged={"before_sync": mgr.staged_before_sync, "after_sync": mgr.staged_after_sync},
               static_bytes=sum(getattr(r, "static_bytes", 0) for r in mgr.runners()) + mgr.output_bytes()
               + mgr.cast_bytes() + (0 if mgr.inbox is None else mgr.inbox.nbytes),
               pool_reserved_bytes=pool_reserved_bytes(mgr.pool) if mgr.pool is not None else 0)
    return out
