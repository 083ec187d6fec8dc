"""CUDA-graph replay of the packed forward, for inference batches (queries, passages, documents), and, opt-in
(``GraphConfig(training=True)``, :mod:`.training`), of the forward and backward of calls with gradients.

A packed forward launches ~110 kernels; on the H200 machine's CPU that host work (12-14 ms per forward) exceeds
the GPU time of batch-8 queries (~0.7 ms) and even of 8 documents of ~900 tokens (~6 ms). One graph replay per
call removes that floor. Design, and why:

- **Packed graphs** (the default), keyed by coarse buckets ``(tokens, seqs, seqlen)`` (:mod:`.buckets`): varied
  traffic reuses a handful of graphs instead of one per exact ``(N, Smax)`` shape, and every attention
  backend works (the bucket is an ordinary varlen batch, resolved by ``plan_attention`` at capture and
  baked in), so ``cuda_graph=True`` engages under ``auto`` too. Padding rows sit in dummy sequences, never
  in a real sequence's ``cu_seqlens`` range, and everything else is row-wise, so padding is invisible to
  real tokens whatever its content.
- **Rectangular graphs, opt-in** (``GraphConfig(sync_free=True)``, :mod:`.rectangular`): the packed path
  pays one validation sync in ``unpad``, and under graphs the host waits there for the previous replay, so
  host and GPU never overlap (batch-8 queries at 0.70x ``torch.compile``, whose graphs never wait). A sync-free
  graph takes the padded ``[B, S]`` call staged into ``[B_b, S_b]`` buffers (admission and bucket from shapes
  only), unpads on the device inside the graph (each row's real tokens then a dummy sequence of its padding),
  and checks the inputs there; the check counts reach the host through pinned memory and an event and are
  raised by the next call (:mod:`.deferred`), with the offending call's output NaN. It computes every padded
  row, so it is meant for host-bound calls (measured against the packed graphs by shape in
  ``docs/architecture.md``; ``tests/gpu/test_graphs.py`` checks capture and the absence of a host sync).
- **One pool per encoder** shared by its graphs, packed and rectangular (replays are serialised by a lock
  and, across streams, by a stream wait), warm-up on a side stream, static input buffers, outputs copied for
  the caller. A call copies its batch into the encoder's fixed-address inbox before its host sync, and each
  graph's first node copies it on into the bucket's buffers, so after the sync a replay is one launch
  (:mod:`packed_encoders.ops.triton.stage`; on CPU the runner stages with PyTorch copies).
- **On by default** (``pack(model)``, ``cuda_graph=None``): buckets captured lazily on first use, each capture
  checked against its eager warm-up, an LRU over a memory budget (``GraphConfig.max_memory_bytes``, else a
  fraction of the free GPU memory, :mod:`packed_encoders.tuning`) as well as ``max_graphs``.
- **Autocast is served**: a graph is captured under the call's autocast dtype (keyed by it), with autocast's
  cast cache off, so it replays the casts the eager forward runs.
- **Eager whenever the graph could differ** from the eager forward: grad (unless training graphs are on), dropout,
  ``output_hidden_states``, ``inputs_embeds``, another device, out of bounds, the kill switch
  ``PACKED_ENCODERS_GRAPH=0`` (read at ``pack()``), or inside ``no_cuda_graph(model)``. Graphs are dropped when
  the weights' device, dtype or storage changes. The router (:mod:`packed_encoders.router`) makes that choice.
"""

from .buckets import Bucket, admit, bucket_for, round_seqs, round_tokens
from .config import GraphConfig, normalize
from .manager import GraphManager
from .route import describe_graphs, graph_forward, precapture_encoders

__all__ = [
    "Bucket", "GraphConfig", "GraphManager", "admit", "bucket_for", "describe_graphs", "graph_forward",
    "normalize", "precapture_encoders", "round_seqs", "round_tokens",
]
