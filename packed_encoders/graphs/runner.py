"""`GraphRunner`: one captured packed forward for one bucket (CUDA; a capture-free mode runs anywhere).

Static buffers: ``ids`` / ``pos`` int64 ``[tokens]``, ``cu`` int32 ``[seqs + 1]``; the output ``[tokens,
hidden]`` lives in the shared graph pool. On CUDA (with Triton) the graph's first node copies the batch from the
encoder's shared :class:`~packed_encoders.ops.triton.stage.Inbox` into these buffers, reading only device
values, so the router can fill the inbox before the call's host sync and the replay is one launch after it
(:mod:`packed_encoders.ops.triton.stage`). Elsewhere a replay stages with device-to-device copies and a rewrite
of the dummy/empty tail of ``cu`` from host ints. The replay hands the first ``T`` output rows to ``finish``,
which must copy them (the caller owns the result).
Padding rows keep whatever ids and positions they last held: always valid, and by construction
(see :mod:`.buckets`) never visible to real tokens.
"""

from __future__ import annotations

import contextlib
import gc
import importlib

import torch

from ..batch import PackedBatch
from ..model.forward import encoder_forward, live_inv_freq, plan_attention
from ..model.plan import rules_for
from ..ops import quack_gemm, rope_tables
from .buckets import Bucket


class StaticInputs:
    """A bucket's static inputs, shared by the packed inference and training runners: ``ids`` / ``pos`` int64
    ``[tokens]``, ``cu`` int32 ``[seqs + 1]`` (first in the capture layout: sequences of ``seqlen`` tokens),
    ``kl`` int32 ``[seqs]`` for query-only batches, ``steps`` (the dummy boundaries), the RoPE theta tables."""

    def _init_static(self, model, params, bucket: Bucket, device, query_only: bool) -> PackedBatch:
        """Allocate the buffers (call under ``torch.no_grad()`` and ``inference_mode(False)``: normal tensors, so
        staging works whether the caller is in inference_mode or not); returns the batch the forward reads."""
        t, n, s = bucket.tokens, bucket.seqs, bucket.seqlen
        self.bucket = bucket
        self.steps = torch.arange(1, n + 1, dtype=torch.int32, device=device) * s   # dummy boundaries
        self.cu = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.cu[1:] = self.steps.clamp(max=t)                  # capture layout: sequences of s tokens
        self.ids = torch.zeros(t, dtype=torch.long, device=device)
        self.pos = torch.arange(t, device=device) % s
        self.tables = theta_tables(model, params, s, device)   # positions past them run eagerly
        self.rope_rows = min(cos.shape[0] for cos, _ in self.tables) if self.tables else 1 << 62
        self.kl = torch.full((n,), s, dtype=torch.int32, device=device) if query_only else None
        return PackedBatch(input_ids=self.ids, inputs_embeds=None, cu_seqlens=self.cu, max_seqlen=s,
                           position_ids=self.pos, max_position=self.rope_rows, key_lens=self.kl)

    def _static_tensors(self) -> tuple:
        return (self.steps, self.cu, self.ids, self.pos) + (() if self.kl is None else (self.kl,))

    def _copy_in(self, batch: PackedBatch) -> None:
        """Stage ``batch`` (within the bucket) with PyTorch copies: its rows, then the dummy / empty tail of
        ``cu`` from host ints."""
        total, num = batch.total_tokens, batch.num_seqs
        self.ids[:total].copy_(batch.input_ids)
        self.pos[:total].copy_(batch.position_ids)
        self.cu[:num + 1].copy_(batch.cu_seqlens)
        if self.kl is not None:
            self.kl[:num].copy_(batch.key_lens)
        extra = self.bucket.seqs - num
        if extra:
            tail = self.cu[num + 1:]
            torch.add(self.steps[:extra], total, out=tail)   # dummy sequences of <= seqlen padding tokens,
            tail.clamp_(max=self.bucket.tokens)               # then empty sequences at the end


class GraphRunner(StaticInputs):
    """Capture the packed forward of ``model`` for ``bucket`` with ``state``'s ops and the attention backend
    ``requested`` resolved for the bucket's shapes (and baked in).

    Args:
        pool: a ``torch.cuda.graph_pool_handle()`` shared by every graph of the encoder.
        stream: side stream for warm-up and capture.
        warmup: eager forwards before capture (lazy cuBLAS/kernel initialisation happens there).
        capture: ``False`` skips the CUDA graph and runs the forward on the static buffers at every replay:
            the same layout and staging, on any device (CPU tests of the bucket layout use it).
        query_only: batches carry ``key_lens`` (query-only tails, ColBERT query expansion); a static ``kl``
            buffer is staged per replay, dummy sequences keep ``kl = seqlen`` (all their rows are keys).
        fused_stage: stage through an inbox and the in-graph Triton copy (:mod:`packed_encoders.ops.triton.stage`)
            instead of five PyTorch ops per replay; ``None``: on CUDA when Triton imports.
        inbox: the encoder's shared :class:`~packed_encoders.ops.triton.stage.Inbox` (``fused_stage`` only; ``None``:
            one of the bucket's size, owned by this runner). It must stay on this device.
        autocast: the CUDA autocast dtype the graph is captured under (``None``: autocast off), so that a call
            under that autocast state replays the casts its eager forward would run (caching off: a captured
            cast must read the live weights, not a cast cached outside the graph).
        casts: the encoder's :class:`~packed_encoders.ops.weight_cast.StaticCopies` for ``autocast`` (``None``:
            none): the graph reads those copies of the projection weights instead of casting them, and each
            replay first refreshes them (a cast only when a weight changed).
        outputs: ``outputs(dtype, tokens, hidden) -> tensor``: the ``[tokens, hidden]`` static output, a view of
            a buffer the encoder's graphs share (one replay's output is copied out before the next replay, which the
            manager's lock and stream order ensure) and the manager holds and counts; ``None``: the output is the
            graph's own.

    ``graph_bytes``: the memory the graph holds (its static buffers, not a shared output, plus the pool's growth
    while capturing), for the manager's budget. After capture the graph is replayed once on the warm-up's inputs
    and must match the warm-up's eager output, or the capture fails (the bucket then runs eagerly, said in
    ``describe()``).

    Raises:
        PackedEncodersError: the requested backend cannot run the bucket (as the eager path would).
        RuntimeError: the forward is not capturable (an op syncs or allocates on the host under capture).
    """

    def __init__(self, model, state, bucket: Bucket, requested: str, *, pool=None, stream=None, warmup: int = 1,
                 capture: bool = True, query_only: bool = False, fused_stage: bool | None = None,
                 inbox=None, autocast=None, outputs=None, casts=None):
        params = state.params
        self.casts = casts
        rules = rules_for(state.tuning)  # the switches read at pack(), as the eager route runs them
        weight = model.embeddings.tok_embeddings.weight
        device = weight.device
        self.device = device
        self.requested = requested
        s = bucket.seqlen
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, autocast_state(device, autocast), torch.inference_mode(False), torch.no_grad():
            batch = self._init_static(model, params, bucket, device, query_only)
            self.plan, self.plan_summary, self.plan_reasons = resolve_plan(params, batch, requested,
                                                                           autocast or weight.dtype, state.policy,
                                                                           graph=capture)
            ops, plan = state.ops, self.plan
            self.inbox = None
            if fused_stage is None:
                fused_stage = fused_stage_available(device)
            if fused_stage:
                from ..ops.triton.stage import Inbox, unbox

                self.inbox = inbox if inbox is not None else Inbox(bucket.tokens, bucket.seqs, device)
                if self.inbox.device != device:
                    raise RuntimeError(f"an inbox on {self.inbox.device} for a graph on {device} (router bug)")
                # The warm-up reads the inbox: empty it (on the current stream, which the warm-up waits for), or
                # it would run on whatever an earlier call left, a batch that may not fit this bucket or that
                # failed its input checks. The call being served then stages again (owner cleared).
                self.inbox.clear()

            shared = None
            if outputs is not None:
                shared = outputs(output_dtype(device, autocast, weight.dtype), bucket.tokens, params.hidden_size)

            def forward():
                if self.inbox is not None:  # captured: the replay reads whatever batch the inbox holds then
                    unbox(self.inbox, self.ids, self.pos, self.cu, self.kl, s)
                with serving(casts):
                    return encoder_forward(model, params, batch, attention=plan, ops=ops, rules=rules, out=shared)

            if casts is not None:
                casts.refresh()

            self.graph, self._forward, self.out, pool_bytes = capture_or_run(forward, device, capture, pool, stream,
                                                                             warmup)
        self.shared_out = shared is not None and self.out.data_ptr() == shared.data_ptr()
        static = self._static_tensors() + (() if self.shared_out else (self.out,))
        self.static_bytes = sum(x.numel() * x.element_size() for x in static)
        self.graph_bytes = self.static_bytes + pool_bytes

    def replay(self, batch: PackedBatch, finish, staged: bool = False):
        """Serve ``batch`` (within the bucket, on this device; the router checked) and return
        ``finish(out[:T])``; ``finish`` must copy. Launches copies and the graph on the current stream.
        ``staged``: the inbox already holds ``batch`` (filled before the sync, nothing written since)."""
        if (batch.key_lens is None) != (self.kl is None):
            raise RuntimeError("graph bucket captured with and without key_lens mixed up (router bug)")
        if self.inbox is not None:
            if not staged:
                fill_from(self.inbox, batch)
        else:
            self._copy_in(batch)
        if self.casts is not None:
            self.casts.refresh()
        if self.graph is not None:
            self.graph.replay()
            out = self.out
        else:
            with torch.no_grad():
                out = self._forward()
        return finish(out[:batch.total_tokens])


def serving(casts):
    """``casts.serving()`` (:class:`~packed_encoders.ops.weight_cast.StaticCopies`), or nothing for ``None``."""
    return contextlib.nullcontext() if casts is None else casts.serving()


def output_dtype(device: torch.device, autocast, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the packed forward's result: fp32 under CUDA autocast (``final_norm`` runs in fp32 there, as
    ``F.layer_norm`` does, and an fp32 autocast keeps fp32 activations), else the weights' dtype."""
    if device.type == "cuda" and autocast is not None:
        return torch.float32
    return weight_dtype


def triton_kernels_available(device: torch.device, module: str) -> bool:
    """Whether the kernels of ``packed_encoders.ops.triton.<module>`` can run on ``device``: CUDA, with Triton
    importable (else the graphs' PyTorch ops do the same work)."""
    if device.type != "cuda":
        return False
    try:
        importlib.import_module(f"..ops.triton.{module}", __package__)
    except Exception:  # noqa: BLE001 - no (working) Triton
        return False
    return True


def fused_stage_available(device: torch.device) -> bool:
    """Whether the inbox staging kernels (:mod:`packed_encoders.ops.triton.stage`) can run on ``device``."""
    return triton_kernels_available(device, "stage")


def fill_from(inbox, batch: PackedBatch) -> None:
    """Fill ``inbox`` with ``batch`` after its sync (one launch; dtypes and layout normalised for the kernel)."""
    from ..ops.triton.stage import fill_inbox, fillable

    ids, pos, cu, kl = batch.input_ids, batch.position_ids, batch.cu_seqlens, batch.key_lens
    if not fillable(ids, pos, cu, kl):
        ids, pos = ids.long().contiguous(), pos.long().contiguous()
        cu = cu.to(torch.int32).contiguous()
        kl = None if kl is None else kl.to(torch.int32).contiguous()
    fill_inbox(inbox, ids, pos, cu, kl)


def theta_tables(model, params, rows: int, device) -> list:
    """The RoPE tables of ``rows`` positions a runner keeps for the theta fallback, or ``[]``.

    RoPE from HF's live ``inv_freq`` buffers is computed inside the graph for any position; only the fallback
    reads tables, which must exist before capture (building them under capture would copy host -> device)
    and stay referenced by the runner (a later eager call may replace the cached entry)."""
    if all(live_inv_freq(model, g, params)[0] is not None for g in set(params.layer_is_global)):
        return []
    return [rope_tables(theta, params.head_dim, rows, device)
            for theta in sorted({params.rope_theta_global, params.rope_theta_local})]


def resolve_plan(params, batch: PackedBatch, requested: str, dtype: torch.dtype, policy, *, graph: bool = True,
                 grad: bool = False):
    """``(plan, summary, reasons)`` baked into a graph: the attention plan for the bucket's shapes (from the
    policy's graph tables; ``graph=False`` for runners that do not capture; ``grad`` for training graphs), the
    backend per layer kind (for ``describe()``), and each fallback reason once."""
    plan = plan_attention(params, batch, requested, grad=grad, dtype=dtype, dropout=False, policy=policy,
                          graph=graph)
    summary = {("global" if w is None else f"window {w}"): d.backend for w, d in plan.items()}
    return plan, summary, list(dict.fromkeys(r for d in plan.values() for r in d.reasons))


def autocast_state(device: torch.device, autocast):
    """The autocast state a runner captures under: ``autocast`` (a dtype) with caching off, or autocast off
    (a call outside autocast must not capture casts a surrounding context would add)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    if autocast is None:
        return torch.autocast("cuda", enabled=False)
    return torch.autocast("cuda", dtype=autocast, cache_enabled=False)


def capture_or_run(forward, device, capture: bool, pool, stream, warmup: int):
    """``(graph, forward, static output, pool bytes)``: with ``capture`` the captured graph, ``None`` and the
    pool's growth during the capture; without, no graph and ``forward`` itself, run once here and again at
    every replay, and 0."""
    if not capture:
        return None, forward, forward(), 0
    before = _pool_bytes(pool, device)
    graph, out = _capture(forward, device, pool, stream, warmup)
    return graph, None, out, max(0, _pool_bytes(pool, device) - before)


def _pool_bytes(pool, device) -> int:
    """The graph pool's reserved bytes, or (when the allocator snapshot format is unknown) the device's."""
    got = pool_reserved_bytes(pool)
    return got if got is not None else int(torch.cuda.memory_reserved(device))


def _capture(forward, device, pool, stream, warmup: int):
    """Warm up on ``stream``, then capture one ``forward()`` into ``pool``; returns ``(graph, static output)``.

    Both under the in-graph size rule of the quack GEMM route, so that the warm-up compiles what the capture
    launches (compiling under capture would load modules, which capture forbids)."""
    with quack_gemm.graph_rules():
        return _warm_and_capture(forward, device, pool, stream, warmup)


def _tensors(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def verify_replay(graph, eager, captured) -> None:
    """Replay ``graph`` once on the warm-up's inputs and compare with the warm-up's eager output ``eager``
    (the same kernels on the same inputs: a mismatch means the capture recorded something else, e.g. a host
    value baked in). One sync, per capture only.

    Raises:
        RuntimeError: the replay differs (the manager then runs the bucket eagerly and says why)."""
    graph.replay()
    for want, got in zip(_tensors(eager), _tensors(captured)):
        if not torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2, equal_nan=True):
            raise RuntimeError("the captured graph's replay differs from its eager warm-up on the same inputs "
                               f"(max abs diff {float((got.float() - want.float()).abs().nan_to_num().max()):.3g})")


@contextlib.contextmanager
def no_gc():
    """No garbage collection within the block (a capture: collecting an unreachable graph mid-capture is an
    error)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _warm_and_capture(forward, device, pool, stream, warmup: int):
    stream.wait_stream(torch.cuda.current_stream(device))
    eager = None
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            eager = forward()
        # A copy: a forward that writes into a static output (the octave's shared one) returns that same tensor
        # to the capture, and the check would compare the buffer with itself (passing any capture).
        if eager is not None:
            eager = tuple(t.clone() for t in _tensors(eager))
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with no_gc(), torch.cuda.graph(graph, pool=pool, stream=stream):
        out = forward()
    if eager is not None:
        verify_replay(graph, eager, out)
    return graph, out


def pool_reserved_bytes(pool) -> int | None:
    """Bytes reserved by the segments of graph pool ``pool`` (from the allocator snapshot), or None."""
    if pool is None:
        return 0
    try:
        segments = torch.cuda.memory_snapshot()
        if segments and "segment_pool_id" not in segments[0]:
            return None
        want = tuple(pool)
        return sum(int(s["total_size"]) for s in segments if tuple(s["segment_pool_id"]) == want)
    except Exception:  # the snapshot format is not a stable API
        return None
