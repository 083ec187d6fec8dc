"""Small-M GEMMs of ModernBERT-base on one CUDA GPU: cuBLAS ``F.linear`` vs ``ops.triton.small_gemm``.

    python benchmarks/gemm_small.py [--out benchmarks/results/gemm_small.json] [--quick] [--ms 256,512]
                                    [--hot-weights]

Shapes (K, N): Wqkv and Wi (768, 2304; timed once, they are the same GEMM), attention Wo (768, 768), MLP Wo
(1152, 768), at M in 128 .. 4096 tokens: ``F.linear`` against ``small_gemm.linear`` under EVERY config of
``small_gemm.CONFIGS`` (and its ``default_config``); for Wi also ``F.linear`` followed by the Triton GLU
(``ops.triton.glu.forward``, GeGLU) against the fused ``small_gemm.glu_linear``. bf16, with bias off (as
ModernBERT-base).

Timing is the one a packed forward sees inside a CUDA graph: 50 calls captured in one graph (after a warm-up
on a side stream, which capture requires: lazy cuBLAS/Triton initialisation must not happen while capturing),
replayed 10 times, per-call time = total / 500. The 50 calls cycle through copies of the weight that together
exceed twice the L2 cache, since in the forward each layer's weights come from HBM (``--hot-weights``: one
copy, L2-resident). Every implementation is first checked against ``F.linear`` (max abs diff / max abs value
< 1e-2); a mismatch or a compile failure is recorded and that config is not timed.

Prints a markdown table per op (cuBLAS time, the default config's time, the best config and its time, the
speed-up over cuBLAS), writes JSON rows (``--out``) and ends with the best config per (op, N, K, M) as a
Python dict literal for ``small_gemm.TUNED``. About 2 minutes on an H200, Triton compilation included
(``--quick``: M 256 and 512, no 128-row tiles).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DTYPE = torch.bfloat16
LINEAR_SHAPES = (("Wqkv / Wi", 768, 2304), ("attn Wo", 768, 768), ("mlp Wo", 1152, 768))  # (name, K, N)
GLU_SHAPE = ("Wi + GeGLU", 768, 2304)
MS = (128, 256, 512, 1024, 2048, 4096)
QUICK_MS = (256, 512)
CALLS, REPLAYS = 50, 10
TOLERANCE = 1e-2


def graph_us(fn, n_calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Per-call microseconds of ``fn(i)`` for i in 0..n_calls-1, captured in one CUDA graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            fn(i)
    graph.replay()  # first replay uploads the graph
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1000.0 / (n_calls * replays)
    del graph
    return us


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def weight_copies(k: int, n: int, hot: bool, gen: torch.Generator) -> list[torch.Tensor]:
    """Enough ``[N, K]`` weights to exceed twice the L2 cache (at most ``CALLS``), or one when ``hot``."""
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    copies = 1 if hot else max(1, min(CALLS, math.ceil(2 * l2 / (n * k * 2))))
    return [(torch.randn((n, k), generator=gen, device="cuda") * k ** -0.5).to(DTYPE) for _ in range(copies)]


def measure(name: str, fn, ref: torch.Tensor) -> dict:
    """Check ``fn(0)`` against ``ref`` then time it; errors (compile, launch, mismatch) go into the row."""
    row = {"impl": name}
    t0 = time.perf_counter()
    try:
        out = fn(0)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  a config that does not compile here (shared memory, registers) is recorded, not fatal
        row.update(error=f"{type(e).__name__}: {str(e)[:300]}")
        return row
    row["first_call_s"] = round(time.perf_counter() - t0, 3)  # compilation, on first use of a config
    row["rel_err"] = rel_err(out, ref)
    if not row["rel_err"] < TOLERANCE:
        row["error"] = f"mismatch: rel err {row['rel_err']:.3g} >= {TOLERANCE}"
        return row
    row["us"] = round(graph_us(fn), 3)
    return row


def implementations(op: str, x: torch.Tensor, weights: list[torch.Tensor], configs, default):
    """The reference output and ``[(name, fn(i), config)]`` for one op at one M: the baseline first."""
    from packed_encoders.ops.triton import glu as triton_glu
    from packed_encoders.ops.triton import small_gemm as sg

    nw = len(weights)
    if op == "glu":
        ref = triton_glu.forward(F.linear(x, weights[0]), "gelu")
        impls = [("cublas+glu", lambda i: triton_glu.forward(F.linear(x, weights[i % nw]), "gelu"), None),
                 ("default", lambda i: sg.glu_linear(x, weights[i % nw], None, "gelu"), default)]
        impls += [(f"cfg{j}", lambda i, c=c: sg.glu_linear(x, weights[i % nw], None, "gelu", c), c)
                  for j, c in configs]
    else:
        ref = F.linear(x, weights[0])
        impls = [("cublas", lambda i: F.linear(x, weights[i % nw]), None),
                 ("default", lambda i: sg.linear(x, weights[i % nw]), default)]
        impls += [(f"cfg{j}", lambda i, c=c: sg.linear(x, weights[i % nw], None, c), c) for j, c in configs]
    return ref, impls


def bench_shape(op: str, label: str, k: int, n: int, ms, configs, hot: bool, gen: torch.Generator) -> list[dict]:
    from packed_encoders.ops.triton import small_gemm as sg

    weights = weight_copies(k, n, hot, gen)
    nw = len(weights)
    rows = []
    for m in ms:
        x = torch.randn((m, k), generator=gen, device="cuda").to(DTYPE)
        ref, impls = implementations(op, x, weights, configs, sg.default_config(m, n, k, glu=op == "glu"))
        for name, fn, cfg in impls:
            row = measure(name, fn, ref)
            row.update(op=op, shape=label, K=k, N=n, M=m, weight_copies=nw, config=list(cfg) if cfg else None)
            rows.append(row)
            status = f"{row['us']:.2f} us" if "us" in row else row["error"]
            print(f"  {op} {label} M={m} {name} {tuple(cfg) if cfg else ''}: {status}", flush=True)
        torch.cuda.empty_cache()  # each graph kept its own pool of outputs
    return rows


def summarize(rows: list[dict]) -> tuple[str, dict]:
    """The markdown table and ``{(op, N, K, M): (Config, speed-up over the baseline)}`` of the best configs."""
    from packed_encoders.ops.triton.small_gemm import Config

    lines = [("| op | shape | K | N | M | baseline us | default cfg us | best config (m, n, k, warps, stages) "
              "| best us | speed-up |"), "|---|---|---|---|---|---|---|---|---|---|"]
    best_table = {}
    keys = sorted({(r["op"], r["shape"], r["K"], r["N"], r["M"]) for r in rows}, key=lambda t: (t[0], t[1], t[4]))
    for op, shape, k, n, m in keys:
        group = [r for r in rows if (r["op"], r["shape"], r["K"], r["N"], r["M"]) == (op, shape, k, n, m)]
        base = next((r for r in group if r["impl"].startswith("cublas")), {})
        default = next((r for r in group if r["impl"] == "default"), {})
        timed = [r for r in group if r["impl"].startswith("cfg") and "us" in r]
        best = min(timed, key=lambda r: r["us"]) if timed else None

        def fmt(r):
            return f"{r['us']:.2f}" if r and "us" in r else "-"
        speed = f"{base['us'] / best['us']:.2f}x" if best and "us" in base else "-"
        lines.append(f"| {op} | {shape} | {k} | {n} | {m} | {fmt(base)} | {fmt(default)} | "
                     f"{tuple(best['config']) if best else '-'} | {fmt(best)} | {speed} |")
        if best:
            best_table[(op, n, k, m)] = (Config(*best["config"]), speed)
    return "\n".join(lines), best_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON file for the result rows")
    p.add_argument("--quick", action="store_true", help="M 256 and 512 only, no 128-row tiles")
    p.add_argument("--ms", default=None, help="comma-separated token counts (default 128..4096)")
    p.add_argument("--hot-weights", action="store_true", help="one weight copy (L2-resident) instead of a cycle")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gemm_small.py needs a CUDA GPU: torch.cuda.is_available() is False", file=sys.stderr)
        return 2

    from benchmarks.common import environment
    from packed_encoders.ops.triton.small_gemm import CONFIGS

    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (QUICK_MS if args.quick else MS)
    configs = [(j, c) for j, c in enumerate(CONFIGS) if not (args.quick and c.block_m >= 128)]
    env = environment("cuda")
    print(f"# small GEMMs on {env.get('gpu')} (torch {env['torch']}, triton {env['triton']}), bf16, "
          f"{len(configs)} configs, M {list(ms)}, {'hot' if args.hot_weights else 'cycled'} weights", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.perf_counter()
    rows = []
    for label, k, n in LINEAR_SHAPES:
        rows += bench_shape("linear", label, k, n, ms, configs, args.hot_weights, gen)
    label, k, n = GLU_SHAPE
    rows += bench_shape("glu", label, k, n, ms, configs, args.hot_weights, gen)
    elapsed = time.perf_counter() - t0

    table, best = summarize(rows)
    print(f"\n{table}\n\n(baseline: cuBLAS F.linear; for glu F.linear + Triton GLU; {elapsed:.0f} s in all)")
    print("\n# best config per (op, N, K, M), for small_gemm.TUNED")
    print("TUNED = {")
    for (op, n, k, m), (cfg, speed) in best.items():
        print(f"    ({op!r}, {n}, {k}, {m}): Config{tuple(cfg)},  # {speed} vs baseline")
    print("}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"env": env, "hot_weights": args.hot_weights, "calls": CALLS,
                                        "replays": REPLAYS, "elapsed_s": round(elapsed, 1), "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
