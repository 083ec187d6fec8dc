"""Workloads nobody tuned for, derived from the real-text sets of :mod:`benchmarks.data` (no new text).

=================  =====  ===========================================================================================
set                batch  what each batch holds
=================  =====  ===========================================================================================
``untuned_mixed``  16     one ~1,500-token document (BoolQ 5-shot prompts joined, cut at 1,500) and 15 NQ queries
``untuned_512``    32     32 documents cut to 512 tokens (``long`` set)
``untuned_32``     32     32 passages cut to 32 tokens (``passages`` set)
=================  =====  ===========================================================================================

A cut keeps ``[CLS]`` and ends on the sequence's own ``[SEP]``. These sets are consumed in order (the mixed
set is laid out batch by batch), not sampled: :func:`indices`.
"""

from __future__ import annotations

import numpy as np

from benchmarks.common import sample_indices
from benchmarks.data import TokenSet

LONG_TOKENS = 1500
# set name -> (batch it is laid out for, sequences in a full run, in a --quick run)
UNTUNED = {"untuned_mixed": (16, 256, 64), "untuned_512": (32, 256, 64), "untuned_32": (32, 512, 128)}


def _cut(seq: np.ndarray, n: int) -> np.ndarray:
    return seq if len(seq) <= n else np.concatenate([seq[:n - 1], seq[-1:]])


def _mixed(long: TokenSet, queries: TokenSet, n_batches: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_batches):
        body = []
        for i in rng.permutation(len(long)):  # join documents (inner [CLS]/[SEP] dropped) until 1,500 tokens
            seq = long[int(i)]
            body.append(seq[1:-1] if body else seq[:-1])
            if sum(len(b) for b in body) >= LONG_TOKENS - 1:
                break
        doc = np.concatenate(body)[:LONG_TOKENS - 1]
        out.append(np.concatenate([doc, long[0][-1:]]))
        out += [queries[int(i)] for i in rng.choice(len(queries), 15, replace=False)]
    return out


def derive(corpus, name: str, seed: int = 0) -> TokenSet:
    """The derived set ``name`` (one of :data:`UNTUNED`) from ``corpus``'s ``long``, ``passages`` and
    ``queries`` sets."""
    batch, full, _ = UNTUNED[name]
    if name == "untuned_mixed":
        seqs = _mixed(corpus["long"], corpus["queries"], full // batch, seed)
    else:
        width, source = (512, corpus["long"]) if name == "untuned_512" else (32, corpus["passages"])
        keep = np.flatnonzero(source.lengths >= width)
        picked = np.random.default_rng(seed).choice(keep, size=min(full, len(keep)), replace=False)
        seqs = [_cut(source[int(i)], width) for i in picked]
    return TokenSet.from_lists(name, [s.tolist() for s in seqs], corpus["queries"].ids.dtype)


def token_set(corpus, name: str) -> TokenSet:
    """A cached set of ``corpus`` or a derived one."""
    return derive(corpus, name) if name in UNTUNED else corpus[name]


def indices(ts: TokenSet, n: int, seed: int) -> np.ndarray:
    """The sequences a workload times: the first ``n`` of a derived set (laid out in batch order), else ``n``
    drawn with ``seed``."""
    if ts.name in UNTUNED:
        return np.arange(min(n, len(ts)))
    return sample_indices(len(ts), n, seed)
