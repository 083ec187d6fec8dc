"""Inference throughput: queries (<= 128 tokens) and documents (<= 2048) in batches of ``--batch`` (8), and the
untuned workloads of :mod:`benchmarks.workloads` (``mixed``: 1 long + 15 short, batch 16; ``fixed512``: 32 x 512;
``fixed32``: 32 x 32; each at its own batch).

Each (family, variant) runs in a fresh process (compile and graph variants: per endpoint too); every row
passes the parity gate against stock HF before it is written. See ``benchmarks/README.md``.

    python -m benchmarks.inference --families hf,st,colbert --out benchmarks/results
    python -m benchmarks.inference --quick --device cpu --config tiny          # CPU smoke run
"""

from __future__ import annotations

import sys

from benchmarks.common import at_least
from benchmarks.harness import Endpoint, main
from benchmarks.workloads import UNTUNED

# sequences per timed pass: (full, --quick, --quick on CPU)
SIZES = {"queries": (512, 128, 32), "documents": (256, 64, 8)}
# untuned endpoints -> their derived set (batch and sizes in benchmarks.workloads.UNTUNED)
UNTUNED_ENDPOINTS = {"mixed": "untuned_mixed", "fixed512": "untuned_512", "fixed32": "untuned_32"}


def endpoints(args) -> list[Endpoint]:
    import torch

    cpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu"
    pick = 2 if (args.quick and cpu) else 1 if args.quick else 0
    out = []
    for name in args.endpoints.split(","):
        name = name.strip()
        if name in UNTUNED_ENDPOINTS:
            set_name = UNTUNED_ENDPOINTS[name]
            batch, full, quick = UNTUNED[set_name]
            n = args.num_seqs or (batch if (args.quick and cpu) else quick if args.quick else full)
            out.append(Endpoint(name, set_name, batch, n))
            continue
        if name not in SIZES:
            raise SystemExit(f"unknown endpoint {name!r}; choose from {', '.join([*SIZES, *UNTUNED_ENDPOINTS])}")
        n = args.num_seqs or SIZES[name][pick]
        out.append(Endpoint(name, "queries" if name == "queries" else args.doc_set, args.batch, n))
    return out


def extra_args(ap) -> None:
    ap.add_argument("--batch", type=at_least(1), default=8, help="sequences per call")
    ap.add_argument("--endpoints", default="queries,documents",
                    help="comma list of queries, documents, mixed, fixed512, fixed32")
    ap.add_argument("--doc-set", default="long", choices=("long", "passages"),
                    help="cached set used as documents (long: BoolQ 5-shot prompts, p50 ~925 tokens)")
    ap.add_argument("--num-seqs", type=at_least(1), default=None, help="sequences per timed pass (per endpoint)")


if __name__ == "__main__":
    sys.exit(main("inference", "benchmarks.inference", endpoints, __doc__.split("\n\n")[0],
                  extra_args=extra_args))
