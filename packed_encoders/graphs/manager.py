"""`GraphManager`: the per-encoder cache of captured graphs (LRU), their shared pool, and counters.

Device-free on purpose: capturing is delegated to a ``build`` callable, so the cache policy (hits,
misses, LRU bound and promotion, failed buckets, invalidation) is tested on CPU with fake runners.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter, OrderedDict
from typing import Any, Callable, Hashable

from typing import TYPE_CHECKING

from .buckets import CAPTURE_FAILED, OVER_BUDGET

if TYPE_CHECKING:
    from .config import GraphConfig


class GraphManager:
    """LRU of runners keyed by ``(requested backend, Bucket or RectBucket, query_only)``, valid for one weights
    fingerprint (packed and rectangular graphs share the pool, the LRU bound and the invalidation).

    ``lock`` serialises capture and replay: all graphs of one manager share one memory pool, so two
    replays must never overlap (their intermediates alias), whichever graphs they are.

    Memory: each runner may carry ``graph_bytes`` (its static buffers plus the pool's growth while it was
    captured). With ``budget_bytes`` set, a capture that takes the total past it evicts least recently used
    graphs until it fits (evicted graphs' pool blocks are reused by later captures, so the pool stops growing);
    a graph over the budget by itself is dropped and its bucket runs eagerly (:data:`.buckets.OVER_BUDGET`).
    ``max_graphs`` bounds the count either way. A runner with ``budgeted = False`` (a training graph, whose
    memory is its slot's pool: shared by the slot's buckets and as large as the largest one's activations, which
    the eager training path holds at its peak too) counts toward ``max_graphs`` only. The static outputs the
    packed graphs of one octave share (``outputs``) and the weight copies graphs under autocast read (``casts``)
    are the manager's, held until :meth:`clear` whichever graphs are evicted: they count against the budget too
    (:meth:`output_bytes`, :meth:`cast_bytes`), outside ``graph_bytes``.
    """

    def __init__(self, config: GraphConfig, budget_bytes: int | None = None):
        self.config = config
        self.budget_bytes = budget_bytes      # None: no byte budget (set on the first CUDA capture)
        self.graph_bytes = 0                  # sum of the cached runners' graph_bytes
        self.lock = threading.RLock()
        self.fingerprint: Any = None
        self.pool: Any = None                # torch.cuda graph pool handle, created by the first capture
        self.last_stream: Any = None         # the stream of the last replay (cross-stream ordering)
        self.precaptured_for: Any = None     # the fingerprint precapture last ran for
        self.listed: Any = None               # what the graphs read, listed (route.Listed; see route.fingerprint)
        self.stream: Any = None               # side stream for warm-up and capture
        self.inbox: Any = None                # ops.triton.stage.Inbox shared by the packed graphs (CUDA)
        self.staged_before_sync = 0           # inbox replays served as filled before the call's sync
        self.staged_after_sync = 0            # ... that staged again after it (no prestage, refilled, or captured)
        self._runners: OrderedDict[Hashable, Any] = OrderedDict()
        self._failed: dict[Hashable, str] = {}
        self.hits = 0                         # calls served by an already captured graph (counted by the router)
        self.misses = 0                       # captures
        self.evictions = 0
        self.invalidations = 0
        self.capture_seconds = 0.0
        self.fallbacks: Counter[str] = Counter()
        self.sync_free_fallbacks: Counter[str] = Counter()  # padded calls that took the synced path, and why
        # training graphs (GraphConfig.training): a pool per slot, the gradient buffers, the pending slots
        self.train_pools: dict[int, Any] = {}        # per slot, its .training.SlotPool
        self.train_grads: dict[int, Any] = {}       # parameter index -> gradient buffer
        self.train_slots: Any = None
        self.train_hits = 0
        # (device, dtype, hidden, rows) -> the static output the packed graphs of buckets of <= rows tokens share
        self.outputs: dict[tuple, Any] = {}
        # autocast dtype -> ops.weight_cast.StaticCopies of the projection weights, read by the graphs of that dtype
        self.casts: dict[Any, Any] = {}

    def output_bytes(self) -> int:
        """Bytes of the shared static outputs (``outputs``)."""
        return sum(t.numel() * t.element_size() for t in list(self.outputs.values()))

    def cast_bytes(self) -> int:
        """Bytes of the weight copies (``casts``)."""
        return sum(c.nbytes() for c in list(self.casts.values()) if c is not None)

    def __len__(self) -> int:
        return len(self._runners)

    def keys(self) -> list:
        """Cached keys, least recently used first."""
        return list(self._runners)

    def check_fingerprint(self, fingerprint: Any) -> bool:
        """Drop every graph (and the pool) when the weights moved, changed dtype or device; True if it did."""
        if fingerprint == self.fingerprint:
            return False
        changed = self.fingerprint is not None
        if changed:
            self.invalidations += 1
            if self.last_stream is not None:
                # a replay may still run there (a packed call checks before any sync): the buffers its graph reads
                # and writes (static inputs, the shared outputs) are freed below; weights change rarely
                self.last_stream.synchronize()
        self.clear()
        self.fingerprint = fingerprint
        return changed

    def clear(self) -> None:
        self._runners.clear()
        self.graph_bytes = 0
        self._failed.clear()
        self.pool = None
        self.last_stream = None
        self.precaptured_for = None
        # a pending backward keeps its runner (and its pool, gradient buffers and slot bookkeeping) alive
        self.train_pools, self.train_grads, self.train_slots = {}, {}, None
        self.outputs = {}
        self.casts = {}

    def note_fallback(self, reason: str) -> None:
        self.fallbacks[reason] += 1

    def note_sync_free_fallback(self, reason: str) -> None:
        self.sync_free_fallbacks[reason] += 1

    def __contains__(self, key: Hashable) -> bool:
        return key in self._runners

    def get(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The runner for ``key``, capturing it with ``build()`` on a miss; a reason string when it
        cannot be captured (the failure is remembered, warned about once, and reported by describe()).

        Any exception from ``build`` marks the bucket failed, including a backend whose envelope rejects the
        bucket's padded shapes but may accept the real batch: the eager path then decides (and raises if the
        batch itself cannot run).
        """
        runner = self._runners.get(key)
        if runner is not None:
            self._runners.move_to_end(key)
            return runner
        failed = self._failed.get(key)
        if failed is not None:
            return OVER_BUDGET if failed.startswith(OVER_BUDGET) else CAPTURE_FAILED
        # Evict before capturing: the freed graph's pool blocks are reused by the new capture, and no
        # graph is destroyed while another is being captured.
        while len(self._runners) >= self.config.max_graphs:
            self._evict()
        t0 = time.perf_counter()
        try:
            runner = build()
        except Exception as exc:  # a backend or op that cannot be captured: serve eagerly, say so once
            self._failed[key] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"packed_encoders: CUDA-graph capture failed for {key}; this bucket runs eagerly "
                          f"({type(exc).__name__}: {exc})", RuntimeWarning, stacklevel=3)
            return CAPTURE_FAILED
        finally:
            self.capture_seconds += time.perf_counter() - t0
        self.misses += 1
        cost = _cost(runner)
        if self.budget_bytes is not None and cost > self.budget_bytes:
            self._failed[key] = f"{OVER_BUDGET} ({cost} > {self.budget_bytes} bytes)"
            return OVER_BUDGET
        while (self._runners and self.budget_bytes is not None
               and self.graph_bytes + self.output_bytes() + self.cast_bytes() + cost > self.budget_bytes):
            self._evict()
        self._runners[key] = runner
        self.graph_bytes += cost
        return runner

    def drop(self, predicate: Callable[[Hashable], bool]) -> int:
        """Remove the cached runners whose key satisfies ``predicate`` (counted as evictions); returns how many."""
        keys = [k for k in self._runners if predicate(k)]
        for k in keys:
            self.graph_bytes -= _cost(self._runners.pop(k))
        self.evictions += len(keys)
        return len(keys)

    def _evict(self) -> None:
        _, runner = self._runners.popitem(last=False)
        self.graph_bytes -= _cost(runner)
        self.evictions += 1

    def is_failed(self, key: Hashable) -> bool:
        return key in self._failed

    def failures(self) -> dict:
        return {str(k): v for k, v in self._failed.items()}

    def runners(self) -> list:
        return list(self._runners.values())


def _cost(runner) -> int:
    """The bytes ``runner`` counts against the budget (none when it is not ``budgeted``)."""
    return (getattr(runner, "graph_bytes", 0) or 0) if getattr(runner, "budgeted", True) else 0
