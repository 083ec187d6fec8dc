"""Attention backends on this GPU: the calibration sweep, the Triton kernel's target workloads, the policy.

    PYTHONPATH=. python benchmarks/attention.py [--quick] [--timing loop|graph] [--out-dir benchmarks/results]

Runs :func:`packed_encoders.calibrate.sweep` (parity first, then CUDA-event medians; total tokens x max
length x heads 12x64 / 16x64, global and window 64, grad off and on, every available backend, plus Triton
launch-shape variants), then times the design notes' two query workloads (8 queries <= 64 tokens, ~250 tokens;
256 queries <= 128 tokens, ~8.6k tokens) on lognormal query lengths. Writes, under ``--out-dir``:

- ``attention-<card>-<timestamp>.json``: a sweep file (``calibrate --from-sweep`` reads it) with the
  headline rows, the shipped policy's and the refitted policy's pick vs best at every point;
- ``attention-<card>-<timestamp>.md``: crossover tables, Triton vs best FlashAttention inside its envelope,
  the headline table and the picks;
- ``policy-<card>.json``: the policy refitted from this sweep (what to ship for this card).

Full run: under 6 minutes on an H200; ``--quick``: under 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch

from packed_encoders import calibrate
from packed_encoders.attention import BACKENDS, Workload, triton_short
from packed_encoders.attention.dispatch import card_slug, load_policy
from packed_encoders.attention.reference import parity

HEADLINE = (("8 queries <= 64", 8, 64), ("256 queries <= 128", 256, 128))


def query_lengths(n: int, cap: int, seed: int = 0) -> list[int]:
    """``n`` query lengths, lognormal around 30 tokens, capped (the design notes' query distribution)."""
    rng = random.Random(seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(28), 0.5)))) for _ in range(n)]


def headline(timing: str, variants, log) -> list[dict]:
    rows = []
    for label, n, cap in HEADLINE:
        lengths = query_lengths(n, cap)
        for heads, head_dim in ((12, 64), (16, 64)):
            _, q, k, v, cu, smax = calibrate.make_inputs(lengths, heads, head_dim, torch.bfloat16, "cuda")
            scale = head_dim ** -0.5
            for window in (None, 64):
                w = Workload(n, sum(lengths), smax, heads, head_dim, window, False, torch.bfloat16, "cuda")
                jobs = [(b, None, None) for b in calibrate.runnable(w)]
                if "triton" in BACKENDS and BACKENDS["triton"].why_not(w) is None:
                    jobs += [("triton", v_, triton_short.VARIANTS[v_](smax, head_dim, window is not None))
                             for v_ in variants]
                for name, variant, cfg in jobs:
                    row = {"workload": label, "heads": heads, "head_dim": head_dim, "window": window,
                           "total_tokens": sum(lengths), "max_seqlen": smax, "num_seqs": n, "backend": name,
                           "variant": variant, "ms": None, "error": None}
                    try:
                        out = calibrate._call(name, q, k, v, cu, smax, window, scale, cfg)
                        err, allowed = parity(out, q, k, v, cu, window, scale)
                        if not err <= allowed:
                            raise AssertionError(f"parity: max err {err:.3g} > {allowed:.3g}")
                        row["ms"] = calibrate.time_ms(lambda: calibrate._call(name, q, k, v, cu, smax, window, scale,
                                                                              cfg), timing=timing)
                    except Exception as exc:
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows.append(row)
        log(f"[bench] headline {label} done")
    return rows


def headline_markdown(rows: list[dict]) -> str:
    lines = ["| workload | geometry | window | T | backend | ms | vs best of varlen/fa4 |", "|---|---|---|---|---|---|---|"]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["workload"], r["heads"], r["head_dim"], r["window"]), []).append(r)
    for (label, heads, head_dim, window), rs in groups.items():
        flash = [r["ms"] for r in rs if r["backend"] in ("varlen", "fa4") and r["ms"] is not None]
        best_flash = min(flash) if flash else None
        for r in sorted(rs, key=lambda r: (r["ms"] is None, r["ms"] or 0)):
            name = r["backend"] + (f" [{r['variant']}]" if r["variant"] else "")
            ms = f"{r['ms']:.4f}" if r["ms"] is not None else f"error: {r['error'][:60]}"
            speed = f"{best_flash / r['ms']:.2f}x" if best_flash and r["ms"] else ""
            lines.append(f"| {label} | {heads}x{head_dim} | {window or 'global'} | {r['total_tokens']} | {name} | "
                         f"{ms} | {speed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--timing", choices=("loop", "graph"), default="loop")
    ap.add_argument("--out-dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--variants", default=None,
                    help=f"comma-separated Triton launch variants of {sorted(triton_short.VARIANTS)} "
                         "(default: all; --quick: table,seq-grid)")
    ap.add_argument("--beyond-envelope", action="store_true", help="also time Triton past its envelope")
    ap.add_argument("--tolerance", type=float, default=0.05)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    variants = args.variants.split(",") if args.variants else (
        ["table", "seq-grid"] if args.quick else sorted(triton_short.VARIANTS))
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.time()
    data = calibrate.sweep(calibrate.QUICK if args.quick else calibrate.FULL, timing=args.timing,
                           triton_variants=[v for v in variants if v != "table"],
                           beyond_envelope=args.beyond_envelope, log=log)
    data["headline"] = headline(args.timing, variants, log)
    shipped = load_policy(torch.device("cuda"))
    policy, report = calibrate.policy_from_sweep(data, tolerance=args.tolerance)
    data["shipped_policy"] = {"name": shipped.name, "report": calibrate.evaluate(shipped, data["rows"], args.tolerance)}
    data["refit_report"] = report
    data["meta"]["wall_s"] = round(time.time() - t0, 1)

    meta = data["meta"]
    slug = card_slug(meta["gpu"], tuple(meta["capability"]))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    os.makedirs(args.out_dir, exist_ok=True)
    base = os.path.join(args.out_dir, f"attention-{slug}-{stamp}")
    with open(base + ".json", "w") as f:
        json.dump(data, f)
    policy.save(os.path.join(args.out_dir, f"policy-{slug}.json"))
    md = [f"# Attention on {meta['gpu']} (sm_{meta['capability'][0]}{meta['capability'][1]})",
          f"torch {meta['torch']}, triton {meta['triton']}, flash_attn {meta['flash_attn']}, "
          f"cutlass-dsl {meta['cutlass_dsl']}, driver {meta.get('driver')}, git {meta['git_sha']}, "
          f"timing {meta['timing']}, {meta['wall_s']} s",
          "", "## The design notes' query workloads", headline_markdown(data["headline"]),
          "", "## Triton vs the best of torch varlen_attn / FA4 (inside its envelope)",
          calibrate.triton_speedup_markdown(data["rows"]),
          "", "## Crossovers", calibrate.crossover_markdown(data["rows"]),
          "", f"## Shipped policy ({shipped.name})", calibrate.report_markdown(data["shipped_policy"]["report"],
                                                                                args.tolerance),
          "", "## Refitted policy", calibrate.report_markdown(report, args.tolerance)]
    if meta.get("left_out"):
        md += ["", "## Left out", *[f"- {k}: {v}" for k, v in meta["left_out"].items()]]
    with open(base + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nwrote {base}.json, {base}.md and {os.path.join(args.out_dir, f'policy-{slug}.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
