"""CUDA-graph replay of the packed forward, for short-sequence inference (queries).

Query encoding (8-256 sequences of <= 128 tokens) is launch-bound: hundreds of small kernels per forward.
One graph replay per call removes that floor. Design, and why:

- **Packed graphs only**, keyed by coarse buckets ``(tokens, seqs, seqlen)`` (:mod:`.buckets`): varied
  traffic reuses a handful of graphs instead of one per exact ``(N, Smax)`` shape, and every attention
  backend works (the bucket is an ordinary varlen batch, resolved by ``plan_attention`` at capture and
  baked in), so ``cuda_graph=True`` engages under ``auto`` too. Padding rows sit in dummy sequences, never
  in a real sequence's ``cu_seqlens`` range, and everything else is row-wise, so padding is invisible to
  real tokens whatever its content.
- **No rectangular ``[B, S]`` graphs**: the padded call still pays its one validation sync in ``unpad``,
  so a rectangular graph would save only the post-sync gather launches while computing ``B x S_bucket``
  tokens (2-4x the real ones for ~30-token queries in a 128 bucket) with dense masks on SDPA only.
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
from .route import describe_graphs, graph_forward, no_cuda_graph, precapture_encoders, set_cuda_graph

__all__ = [
    "Bucket", "GraphConfig", "GraphManager", "admit", "bucket_for", "describe_graphs", "graph_forward",
    "no_cuda_graph", "normalize", "precapture_encoders", "round_seqs", "round_tokens", "set_cuda_graph",
]
