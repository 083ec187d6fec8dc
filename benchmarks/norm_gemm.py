"""(Residual +) LayerNorm fused into the next small-M GEMM vs the two launches the forward runs now, on one CUDA GPU.

    python benchmarks/norm_gemm.py [--out benchmarks/results/norm_gemm.json] [--ms 16,96,256] [--hot-weights]

ModernBERT-base pairs, bf16, batches of query size (M = 16 .. 256 tokens):

- ``mlp``: residual + ``mlp_norm`` then ``Wi`` + GeGLU. Now: the Triton residual LayerNorm, then the GLU-fused
  Triton GEMM (``small_gemm.glu_linear``). Fused: ``ops.triton.norm_gemm.norm_linear(..., "gelu")``.
- ``attn``: residual + ``attn_norm`` then ``Wqkv`` (2304 x 768). Now: the Triton residual LayerNorm, then cuBLAS
  ``F.linear``. Fused: ``norm_linear(...)`` (a Triton GEMM replaces cuBLAS).

Each fused variant runs under every config of :func:`configs`; times are per call inside a CUDA graph of 50 calls
whose weights cycle through copies exceeding twice the L2 cache (``benchmarks/gemm_small.py``'s method). Every
variant is first checked against the two-launch path (max abs diff / max abs value < 1e-2). Prints a table per
pair and M with the best config and its speed-up; ``--out`` writes JSON rows. This decides whether
``PACKED_ENCODERS_NORM_GEMM`` (off by default) should be on, and with which ``norm_gemm.DEFAULT_*``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gemm_small import DTYPE, measure, weight_copies  # noqa: E402

MS = (16, 64, 96, 128, 256)
HIDDEN, INTER = 768, 1152


def configs() -> list:
    """The launch configs timed for each pair: 16-row tiles (whole rows of s in registers), the rest swept."""
    from packed_encoders.ops.triton.small_gemm import Config  # imports Triton: after main's CUDA check

    return [Config(16, n, k, w, s) for n in (16, 32, 64) for k in (64, 128) for w in (4, 8) for s in (1, 3)]


def pair(kind: str, m: int, hot: bool, gen: torch.Generator, sweep: list, device: str = "cuda") -> list[dict]:
    from packed_encoders.ops.triton import layer_norm as tln
    from packed_encoders.ops.triton import norm_gemm, small_gemm

    n = 2 * INTER if kind == "mlp" else 3 * HIDDEN
    act = "gelu" if kind == "mlp" else None
    weights = weight_copies(HIDDEN, n, hot, gen)
    nw = len(weights)
    x = torch.randn((m, HIDDEN), generator=gen, device=device).to(DTYPE)
    d = torch.randn((m, HIDDEN), generator=gen, device=device).to(DTYPE)
    lw = (1 + 0.2 * torch.randn((HIDDEN,), generator=gen, device=device)).to(DTYPE)

    def now(i):
        _, normed, _, _ = tln.forward(x, d, lw, None, 1e-5, DTYPE, DTYPE)
        w = weights[i % nw]
        return small_gemm.glu_linear(normed, w, None, "gelu") if act else F.linear(normed, w)

    def fused(config):
        return lambda i: norm_gemm.norm_linear(x, d, lw, None, 1e-5, weights[i % nw], None, act, config)[1]

    ref = now(0)
    rows = []
    impls = [("two launches", now, None),
             ("fused default", fused(None), norm_gemm.DEFAULT_GLU if act else norm_gemm.DEFAULT_LINEAR)]
    impls += [(f"cfg{j}", fused(c), c) for j, c in enumerate(sweep)]
    for name, fn, cfg in impls:
        row = measure(name, fn, ref)
        row.update(pair=kind, M=m, N=n, K=HIDDEN, weight_copies=nw, config=list(cfg) if cfg else None)
        rows.append(row)
        status = f"{row['us']:.2f} us" if "us" in row else row["error"]
        print(f"  {kind} M={m} {name} {tuple(cfg) if cfg else ''}: {status}", flush=True)
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def summarize(rows: list[dict]) -> str:
    lines = ["| pair | M | two launches us | fused default us | best config (m, n, k, warps, stages) | best us | "
             "speed-up |", "|---|---:|---:|---:|---|---:|---:|"]
    for kind, m in sorted({(r["pair"], r["M"]) for r in rows}):
        group = [r for r in rows if (r["pair"], r["M"]) == (kind, m)]
        base = next(r for r in group if r["impl"] == "two launches")
        default = next(r for r in group if r["impl"] == "fused default")
        timed = [r for r in group if r["impl"].startswith("cfg") and "us" in r]
        best = min(timed, key=lambda r: r["us"]) if timed else None
        fmt = lambda r: f"{r['us']:.2f}" if r and "us" in r else "-"  # noqa: E731
        speed = f"{base['us'] / best['us']:.2f}x" if best and "us" in base else "-"
        lines.append(f"| {kind} | {m} | {fmt(base)} | {fmt(default)} | {tuple(best['config']) if best else '-'} | "
                     f"{fmt(best)} | {speed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON file for the result rows")
    p.add_argument("--ms", default=None, help="comma-separated token counts (default 16,64,96,128,256)")
    p.add_argument("--hot-weights", action="store_true", help="one weight copy (L2-resident) instead of a cycle")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/norm_gemm.py needs a CUDA GPU: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    from benchmarks.common import environment

    sweep = configs()
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else MS
    env = environment("cuda")
    print(f"# LayerNorm-prologue GEMMs on {env.get('gpu')} (torch {env['torch']}, triton {env['triton']}), bf16, "
          f"{len(sweep)} configs, M {list(ms)}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    rows = [r for kind in ("mlp", "attn") for m in ms for r in pair(kind, m, args.hot_weights, gen, sweep)]
    elapsed = time.perf_counter() - t0
    print(f"\n{summarize(rows)}\n\n({elapsed:.0f} s in all)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "hot_weights": args.hot_weights, "elapsed_s": round(elapsed, 1),
                                        "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
