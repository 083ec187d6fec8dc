"""CUDA-graph replay of the packed forward, for inference batches (queries, passages, documents).

A packed forward launches ~110 kernels; on the H200 machine's CPU that host work (12-14 ms per forward) exceeds
the GPU time of batch-8 queries (~0.7 ms) and even of 8 documents of ~900 tokens (~6 ms). One graph replay per
call removes that floor. Design, and why:

- **Packed graphs only**, keyed by coarse buckets ``(tokens, seqs, seqlen)`` (:mod:`.buckets`): varied
  traffic reuses a handful of graphs instead of one per exact ``(N, Smax)`` shape, and every attention
  backend works (the bucket is an ordinary varlen batch, resolved by ``plan_attention`` at capture and
  baked in), so ``cuda_graph=True`` engages under ``auto`` too. Padding rows sit in dummy sequences, never
  in a real sequence's ``cu_seqlens`` range, and everything else is row-wise, so padding is invisible to
  real tokens whatever its content.
- **No rectangular ``[B, S]`` graphs yet**: the padded call still pays its one validation sync in ``unpad``,
  so a rectangular graph would save only the post-sync gather launches. Measured since: that sync is what
  keeps batch-8 queries at 0.70x ``torch.compile`` (whose graphs never wait for the host); a sync-free
  rectangular path (unpadding on the device inside the graph, input checks reported without a host read) is
  the next step.
- **One pool per encoder** shared by its graphs (replays are serialised by a lock and, across streams,
  by a stream wait), warm-up on a side stream, static input buffers, outputs copied for the caller.
- **Eager whenever the graph could differ** from the eager forward: grad, autocast, dropout,
  ``output_hidden_states``, ``inputs_embeds``, another device, out of bounds, the kill switch
  ``PACKED_ENCODERS_GRAPH=0``, or inside ``no_cuda_graph(model)``. Graphs are dropped when the weights'
  device, dtype or storage changes.
"""

from .buckets import Bucket, admit, bucket_for, round_seqs, round_tokens
from .config import GraphConfig, normalize
from .manager import GraphManager
from .route import (check_errors, describe_graphs, graph_forward, no_cuda_graph, precapture_encoders,
                    set_cuda_graph)

__all__ = [
    "Bucket", "GraphConfig", "GraphManager", "admit", "bucket_for", "check_errors", "describe_graphs",
    "graph_forward", "no_cuda_graph", "normalize", "precapture_encoders", "round_seqs", "round_tokens",
    "set_cuda_graph",
]
