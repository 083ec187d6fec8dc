"""`GraphConfig`: the bounds and bucket grid of CUDA-graph replay (host-side facts only)."""

from __future__ import annotations

import functools

import numbers
from dataclasses import dataclass, field, fields, replace

from ..errors import PackedEncodersError
from .buckets import precapture_buckets, round_seqs, round_tokens


def _is_pow2(x: int) -> bool:
    return x > 0 and not (x & (x - 1))


DEFAULT_MAX_TOKENS = 32768
DEFAULT_SEQLEN_BUCKETS = (128, 512, 2048)
SYNC_FREE_SEQLEN_BUCKETS = (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True)
class GraphConfig:
    """Bounds for serving packed batches from captured CUDA graphs.

    A call is admitted when it has at most ``max_seqs`` sequences, ``max_tokens`` real tokens and no
    sequence longer than ``max_seqlen``; everything else runs the eager packed forward. An admitted call is
    served by the graph of its bucket ``(tokens, seqs, seqlen)``:

    - tokens: total tokens rounded up on a geometric grid, ``token_steps_per_octave`` steps between powers
      of two and never finer than ``token_multiple`` (padding waste <= 1 / token_steps_per_octave above
      ``token_multiple * token_steps_per_octave`` tokens; below, the ``token_multiple`` step dominates);
    - seqs: the sequence count rounded up to a power of two (at least ``min_seq_bucket``), plus enough
      dummy-sequence slots to hold the padding tokens in sequences no longer than the bucket's seqlen;
    - seqlen: the smallest entry of ``seqlen_buckets`` (plus ``max_seqlen``) >= the longest sequence.
      The defaults: 128 (queries; the kernels tile queries by 64-128 rows, so every ``max_seqlen <= 128``
      costs the same), 512 (passages; the longest sequences for which the calibrated H200 policy
      still picks the in-tree Triton kernel on global layers) and 2048 (documents; FlashAttention on
      global layers). Each seqlen bucket bakes in its own attention plan.

    Documents are served too: with one host sync per call and ~110 launches per forward, a batch of 8
    documents of ~900 tokens is host-bound in eager mode on an H200 (see ``docs/architecture.md``).

    Attributes:
        max_seqlen: longest sequence served by a graph (default 2048).
        max_seqs: most (real) sequences per call served by a graph.
        max_tokens: most real tokens per call; ``None`` (default) means ``min(DEFAULT_MAX_TOKENS,
            max_seqs * max_seqlen)``. ``DEFAULT_MAX_TOKENS`` = 32768: 256 queries of 128 tokens, or 16
            documents of 2048; larger batches are GPU-bound, so a graph gains little there while its pool
            would hold their activations.
        seqlen_buckets: finer seqlen buckets below ``max_seqlen`` (increasing); ``None`` (default) means the
            entries of ``DEFAULT_SEQLEN_BUCKETS`` = (128, 512, 2048) below ``max_seqlen`` (kept as ``None``,
            so ``dataclasses.replace(config, max_seqlen=...)`` recomputes them), ``()`` none.
        token_multiple, token_steps_per_octave: the token grid (both powers of two). 16 steps per octave
            (default) pad at most 1/16 of a bucket above 1,024 tokens; on the H200 documents benchmark
            (batches of 8 x ~930 tokens) 16 replayed 0.2-2.7 % faster than 8 in two A/B runs, at 5 graphs
            instead of 3. Broad length mixes reach about twice the buckets 8 steps would (batch-8 documents
            of 45-2,048 tokens: 41 against 21), hence ``max_graphs`` 64.
        min_seq_bucket: smallest sequence-count bucket.
        max_graphs: LRU bound on captured graphs (per encoder). Graphs share one memory pool; each keeps its
            static input and ``[tokens, hidden]`` output buffers.
        warmup: eager forwards on a side stream before each capture (>= 1: lazy library
            initialisation and kernel compilation must not happen under capture).
        precapture: buckets captured ahead of traffic, as ``(num_seqs, total_tokens, max_seqlen)`` or
            ``(num_seqs, total_tokens)``, which takes the smallest seqlen bucket that can hold
            ``total_tokens`` in ``num_seqs`` sequences (``(8, 512)``: the 128 bucket of batch-8 queries);
            captured at ``pack``/``set_cuda_graph`` time when the model is on CUDA, else on its first CUDA
            call, and again after an invalidation. They are packed buckets: ``sync_free`` graphs are captured
            on first use.
        sync_free: opt-in (default ``False``) **rectangular graphs with no host sync per call**, for padded
            calls (``input_ids`` ``[B, S]`` of an integer dtype, an integer or bool ``attention_mask`` or none;
            no ``inputs_embeds``, ``position_ids``, ``output_hidden_states`` or ColBERT query-only trailing
            positions; ``B <= max_seqs``, ``S <= max_seqlen``, ``B * S <= token_limit``, and the bucket's
            ``B_b * S_b <= sync_free_max_tokens``). Such a call is
            staged into a graph of shape ``[B_b, S_b]`` (``B`` rounded up to a power of two, at least
            ``min_seq_bucket``; ``S_b`` the smallest entry of :attr:`sync_free_seqlen_grid` >= ``S``) that
            unpads on the device, so the host never reads a device value and can enqueue the next call while
            the GPU runs this one. The graph computes all ``B_b * S_b`` rows, padding included: it suits
            launch-bound calls (short queries) and loses on large or ragged batches, where the packed path
            computes real tokens only (see ``docs/architecture.md``). Every other call takes the packed path
            (one sync).

            **Errors are reported one call late.** The input checks of the eager path (mask values other
            than 0/1, holes inside a sequence, ids outside the vocabulary, non-zero ``token_type_ids`` at
            real tokens) run on the device inside the graph; the graph stays safe whatever the input (ids
            are clamped before the lookup). A call that fails a check returns an output that is **NaN
            everywhere** (``[B, S, hidden]``, padded positions included), and its error is raised as a
            :class:`~packed_encoders.PackedEncodersError` naming the problem and the call it belongs to by
            the **next call on that encoder** (or :func:`~packed_encoders.check_errors`) once the GPU has
            finished the offending call (``event.query()``, never a wait); that next call then does not
            run. ``check_errors(model, wait=True)`` waits for every pending check (use it at the end of a
            loop). This mode trades the immediate error for no sync.
        max_memory_bytes: the byte budget of the encoder's graphs (static buffers plus the pool's growth at each
            capture; LRU eviction past it, see :class:`~packed_encoders.graphs.manager.GraphManager`); ``None``
            (default) means ``PACKED_ENCODERS_GRAPH_MEMORY`` (default 0.1) of the GPU's free memory measured at
            ``pack()``, or at the first capture for a model moved to CUDA later.
        sync_free_max_tokens: the largest rectangular graph, in padded rows ``B_b * S_b`` (default 2048:
            batch 8 up to 256 wide, batch 32 up to 64; on the H200 the break-even against the packed graphs);
            larger calls take the packed path. Read only with ``sync_free``.
        training: opt-in (default ``False``) **training graphs**: calls with gradients (on CUDA, no dropout in
            force, no gradient checkpointing, no ``inputs_embeds`` / ``output_hidden_states``, within the bounds
            above) replay a captured forward and, at their backward, a captured backward; the encoder is one
            autograd node whose gradients reach ``.grad`` through autograd as usual
            (:mod:`packed_encoders.graphs.training`). Others run the eager training path, the reason counted in
            ``describe()``.
        training_slots: most forwards with gradients awaiting their backward that training graphs serve at once
            (each slot holds its own activations); default 2 (a query batch and a document batch before one loss).
            Read only with ``training``, as is ``training_steps_per_octave``. A training bucket (its forward and
            backward graphs) counts as one graph for ``max_graphs``.
        training_steps_per_octave: the token grid of training graphs (a power of two; default 8: at most 1/8 of a
            bucket is padding above 512 tokens). Coarser than inference's: a training graph costs a forward and a
            backward capture, and training batches vary more.

    The padded widths ``S_b`` of the sync-free graphs are the property ``sync_free_seqlen_grid``: with
    ``seqlen_buckets`` unset, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048 below
    ``max_seqlen``, then ``max_seqlen`` itself (``max_seqlen=100``: 32, 48, 64, 96, 100); else
    ``seqlen_buckets`` (and ``max_seqlen``).

    Raises:
        PackedEncodersError: a bound that is not a positive int, a grid parameter that is not a power of two,
            ``seqlen_buckets`` that are not increasing positive ints, a precapture entry that is not 2 or 3
            ints or lies outside the bounds, more precapture buckets than ``max_graphs``, or (with
            ``sync_free``) a ``sync_free_max_tokens`` below the smallest rectangular graph.
    """

    max_seqlen: int = 2048
    max_seqs: int = 256
    max_tokens: int | None = None
    seqlen_buckets: tuple[int, ...] | None = None
    token_multiple: int = 64
    token_steps_per_octave: int = 16
    min_seq_bucket: int = 8
    max_graphs: int = 64
    warmup: int = 2
    precapture: tuple[tuple[int, ...], ...] = field(default=())
    sync_free: bool = False
    sync_free_max_tokens: int = 2048
    max_memory_bytes: int | None = None
    training: bool = False
    training_slots: int = 2
    training_steps_per_octave: int = 8

    def __post_init__(self):
        for name in ("sync_free", "training"):
            if not isinstance(getattr(self, name), bool):
                raise PackedEncodersError(f"GraphConfig.{name}={getattr(self, name)!r} must be a bool")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("seqlen_buckets", "precapture", "sync_free", "training"):
                continue
            if value is None and f.name in ("max_tokens", "max_memory_bytes"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PackedEncodersError(f"GraphConfig.{f.name}={value!r} must be a positive int")
        for name in ("token_multiple", "token_steps_per_octave", "training_steps_per_octave"):
            if not _is_pow2(getattr(self, name)):
                raise PackedEncodersError(f"GraphConfig.{name}={getattr(self, name)} must be a power of two "
                                          "(so the token grid is idempotent and nested across octaves)")
        if self.seqlen_buckets is not None:
            buckets = _int_tuple(self.seqlen_buckets, "seqlen_buckets")
            increasing = list(buckets) == sorted(set(buckets))
            if any(v < 1 for v in buckets) or not increasing or (buckets and buckets[-1] > self.max_seqlen):
                raise PackedEncodersError(f"GraphConfig.seqlen_buckets={self.seqlen_buckets!r} must be strictly "
                                          f"increasing positive ints <= max_seqlen={self.max_seqlen}")
            object.__setattr__(self, "seqlen_buckets", buckets)
        if self.max_tokens is not None and self.max_tokens > self.max_seqs * self.max_seqlen:
            raise PackedEncodersError(f"GraphConfig.max_tokens={self.max_tokens} exceeds max_seqs * max_seqlen "
                                      f"= {self.max_seqs * self.max_seqlen}: no call could reach it")
        try:
            raw = list(self.precapture)
        except TypeError:
            raise PackedEncodersError(f"GraphConfig.precapture={self.precapture!r}: expected a sequence of "
                                      "(num_seqs, total_tokens[, max_seqlen]) tuples") from None
        entries = []
        for item in raw:
            entry = _int_tuple(item, "precapture entry")
            if len(entry) not in (2, 3):
                raise PackedEncodersError(f"GraphConfig.precapture entry {item!r}: expected (num_seqs, total_tokens) "
                                          "or (num_seqs, total_tokens, max_seqlen)")
            n, t = entry[:2]
            s = entry[2] if len(entry) == 3 else self.seqlen_for(n, t)
            if not (1 <= n <= self.max_seqs and 1 <= s <= self.max_seqlen and 1 <= t <= self.token_limit
                    and t <= n * s):
                raise PackedEncodersError(
                    f"GraphConfig.precapture entry {item!r} is outside the bounds (1 <= num_seqs <= {self.max_seqs}, "
                    f"1 <= max_seqlen <= {self.max_seqlen}, 1 <= total_tokens <= min({self.token_limit}, "
                    "num_seqs * max_seqlen))")
            entries.append(entry)
        object.__setattr__(self, "precapture", tuple(entries))
        count = len(precapture_buckets(self))
        if count > self.max_graphs:
            raise PackedEncodersError(f"GraphConfig.precapture maps to {count} buckets but max_graphs="
                                      f"{self.max_graphs}: the LRU would evict pre-captured graphs before "
                                      "traffic arrives")
        if self.sync_free:
            smallest = round_seqs(1, self.min_seq_bucket) * self.sync_free_seqlen_grid[0]
            if self.sync_free_max_tokens < smallest:
                raise PackedEncodersError(
                    f"GraphConfig.sync_free_max_tokens={self.sync_free_max_tokens} is below the smallest "
                    f"rectangular graph ({smallest} padded rows: min_seq_bucket rows of the narrowest width "
                    f"{self.sync_free_seqlen_grid[0]}), so no call could be served sync-free")

    @property
    def token_limit(self) -> int:
        """The admission bound on real tokens (``max_tokens``, or ``min(DEFAULT_MAX_TOKENS, max_seqs *
        max_seqlen)``)."""
        if self.max_tokens is not None:
            return self.max_tokens
        return min(DEFAULT_MAX_TOKENS, self.max_seqs * self.max_seqlen)

    @functools.cached_property  # read by every admitted call; the config is frozen
    def seqlen_grid(self) -> tuple[int, ...]:
        """Every seqlen bucket, increasing; the last is ``max_seqlen``."""
        if self.seqlen_buckets is None:
            grid = tuple(b for b in DEFAULT_SEQLEN_BUCKETS if b < self.max_seqlen)
        else:
            grid = self.seqlen_buckets
        return grid if grid and grid[-1] == self.max_seqlen else grid + (self.max_seqlen,)

    @property
    def sync_free_seqlen_grid(self) -> tuple[int, ...]:
        """The padded-width buckets ``S_b`` of ``sync_free`` graphs, increasing; the last is ``max_seqlen``.

        ``seqlen_buckets`` when set; else the entries of ``SYNC_FREE_SEQLEN_BUCKETS`` (32, 48, 64, 96, 128,
        ... 1536, 2048: powers of two and 1.5x steps) below ``max_seqlen``. Finer than the packed grid on
        purpose: a packed bucket rounds the token count on its own fine grid and its seqlen only picks the
        attention plan, whereas a rectangular graph computes ``B_b * S_b`` rows, so ``S_b`` sets the GPU work
        of the whole call. Half-octave steps keep the padded width under 1.5x the call's own; nothing below
        32, where a batch-8 graph is launch-bound and a finer bucket would only add captures. Within
        ``sync_free_max_tokens`` (2048) batch-8 traffic reaches 7 widths, within ``max_graphs`` (64).
        """
        if self.seqlen_buckets is None:
            grid = tuple(b for b in SYNC_FREE_SEQLEN_BUCKETS if b < self.max_seqlen)
        else:
            grid = self.seqlen_buckets
        return grid if grid and grid[-1] == self.max_seqlen else grid + (self.max_seqlen,)

    def seqlen_for(self, num_seqs: int, total_tokens: int) -> int:
        """The smallest seqlen bucket that can hold ``total_tokens`` in ``num_seqs`` sequences (``max_seqlen``
        when none can): what a precapture entry without a seqlen means."""
        return next((s for s in self.seqlen_grid if num_seqs * s >= total_tokens), self.max_seqlen)

    def with_precapture(self, num_seqs: int, min_tokens: int, max_tokens: int,
                        max_seqlen: int | None = None) -> "GraphConfig":
        """A copy that also pre-captures every token bucket from ``min_tokens`` to ``max_tokens`` for ``num_seqs``
        sequences: e.g. ``(8, 8, 1024)`` for batch-8 queries, ``(8, 4096, 8192, 2048)`` for documents. Without
        ``max_seqlen`` each entry takes :meth:`seqlen_for` (so ``(8, 8, 2048)`` uses the 128 bucket up to
        1,024 tokens and the 512 bucket above).

        Raises:
            PackedEncodersError: ``num_seqs`` or ``min_tokens`` below 1, ``max_tokens < min_tokens``, or a range
                the bounds cannot serve (``max_tokens`` past ``token_limit`` or ``num_seqs * max_seqlen``).
        """
        n, lo, hi = (_int_tuple((num_seqs, min_tokens, max_tokens), "with_precapture arguments"))
        seqlen = None if max_seqlen is None else _int_tuple((max_seqlen,), "with_precapture max_seqlen")[0]
        if n < 1 or lo < 1 or hi < lo:
            raise PackedEncodersError(f"with_precapture({num_seqs}, {min_tokens}, {max_tokens}): needs num_seqs >= 1 "
                                      "and 1 <= min_tokens <= max_tokens")
        cap = min(self.token_limit, n * (self.max_seqlen if seqlen is None else seqlen))
        if hi > cap:
            raise PackedEncodersError(f"with_precapture: max_tokens={hi} is past what {n} sequences can be served "
                                      f"with here ({cap} tokens: token_limit {self.token_limit}, max_seqlen "
                                      f"{self.max_seqlen if seqlen is None else seqlen})")
        extra, t = [], lo
        while t <= hi:
            extra.append((n, t, self.seqlen_for(n, t) if seqlen is None else seqlen))
            t = round_tokens(t, self.token_multiple, self.token_steps_per_octave) + 1
        return replace(self, precapture=tuple(self.precapture) + tuple(extra))


def _int_tuple(values, what: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints; bools, floats, strings or a non-sequence raise a named error."""
    try:
        items = tuple(values)
    except TypeError:
        raise PackedEncodersError(f"GraphConfig {what} {values!r}: expected a sequence of ints") from None
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in items):
        raise PackedEncodersError(f"GraphConfig {what} {values!r}: expected ints")
    return tuple(int(v) for v in items)


def normalize(option) -> GraphConfig | None:
    """``pack(cuda_graph=...)``: ``None`` (auto) and ``True`` -> ``GraphConfig()``, ``False`` -> off (``None``),
    a config as is. (Whether the option was ``None`` is kept apart: ``PackOptions.graph_auto``.)

    Raises:
        PackedEncodersError: any other value.
    """
    if option is False:
        return None
    if option is None or option is True:
        return GraphConfig()
    if isinstance(option, GraphConfig):
        return option
    raise PackedEncodersError(f"cuda_graph={option!r}: expected None (auto), a bool or a packed_encoders.GraphConfig")
