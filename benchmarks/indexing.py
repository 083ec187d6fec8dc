"""Indexing throughput: the corpus in batches of 128 documents (<= 2048 tokens), documents/s and tokens/s.

Same protocol as ``inference.py`` (fresh process per variant, parity gate, >= 5 timed passes, peak reserved
memory). For the ColBERT family, the ``hf_sdpa`` row also writes the index a padded pipeline produces
(per batch ``[B, S, 128]`` fp16 + mask) and the ``packed`` row the packed one (flat ``[T, 128]`` fp16 +
``cu_seqlens``) to a temporary folder and reports their sizes on disk.

    python -m benchmarks.indexing --families colbert --out benchmarks/results
    python -m benchmarks.indexing --quick --device cpu --config tiny
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

from benchmarks.common import at_least
from benchmarks.harness import Endpoint, main

# documents per timed pass: (full, --quick, --quick on CPU)
SIZES = (512, 256, 8)
INDEX_VARIANTS = {"hf_sdpa": "padded", "packed": "packed"}


def endpoints(args) -> list[Endpoint]:
    import torch

    cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    n = args.num_seqs or SIZES[2 if (args.quick and cpu) else 1 if args.quick else 0]
    return [Endpoint("indexing", args.corpus, min(args.batch, n), n)]


def extra_args(ap) -> None:
    ap.add_argument("--batch", type=at_least(1), default=128, help="documents per call")
    ap.add_argument("--corpus", default="long", choices=("long", "passages"),
                    help="cached set to index (long: BoolQ 5-shot prompts, p50 ~925 tokens)")
    ap.add_argument("--num-seqs", type=at_least(1), default=None, help="documents per timed pass")


def _file_size(arrays: dict) -> int:
    with tempfile.TemporaryDirectory(prefix="pe-index-") as d:
        path = os.path.join(d, "index.npz")
        np.savez(path, **arrays)
        return os.path.getsize(path)


def index_size(args, ep, family, applied, batches) -> dict | None:
    """On-disk size of the ColBERT index this variant's pipeline writes (``hf_sdpa``: padded, ``packed``)."""
    import torch

    layout = INDEX_VARIANTS.get(args.variant)
    if family.name != "colbert" or layout is None:
        return None
    arrays, lengths = {}, []
    with torch.inference_mode():
        for i, b in enumerate(batches):
            tokens, _ = applied.step(b)
            if layout == "padded":
                arrays[f"emb_{i}"] = tokens.to(torch.float16).cpu().numpy()
                arrays[f"mask_{i}"] = b.attention_mask.bool().cpu().numpy()
                lengths += b.attention_mask.sum(1).tolist()
            else:
                arrays[f"emb_{i}"] = tokens.to(torch.float16).cpu().numpy()
                lengths += torch.diff(b.cu_seqlens).tolist()
    if layout == "packed":
        flat = np.concatenate([arrays.pop(k) for k in sorted(arrays, key=lambda k: int(k.split("_")[1]))])
        cu = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        arrays = {"embeddings": flat, "cu_seqlens": cu}
    return {"index": {"layout": layout, "documents": len(lengths), "tokens": int(sum(lengths)),
                      "dim": int(tokens.shape[-1]), "bytes": _file_size(arrays)}}


if __name__ == "__main__":
    sys.exit(main("indexing", "benchmarks.indexing", endpoints, __doc__.split("\n\n")[0], extra=index_size,
                  extra_args=extra_args))
