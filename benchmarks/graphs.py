"""CUDA graphs for short-sequence inference: stock HF sdpa vs pe.pack eager vs pe.pack with graphs.

    python benchmarks/graphs.py                 # stock, eager, graphs (lazy), graphs (pre-captured),
                                                # graphs_sync_free (GraphConfig(sync_free=True)); < 6 min
    python benchmarks/graphs.py --compile       # + torch.compile(max-autotune, dynamic=True), minutes more
    python benchmarks/graphs.py --variants graphs --out /tmp/g.json
    python benchmarks/graphs.py --variants stock,graphs_sync_free,compile --workloads queries_b8

Model: ModernBERT-base geometry, random init from ``transformers.ModernBertConfig()`` defaults, bf16, eval,
``torch.inference_mode``. Workloads (fixed seeds, the same batches for every variant, right padding as a
tokenizer pads): queries lognormal (median 30 tokens, sigma 0.5, clipped to [4, 128]) at batch 8 and 128;
documents lognormal (median 600, sigma 0.6, clipped to [16, 2048]) at batch 8.

Each variant runs in a fresh process. Per workload: parity against the stock forward on the first batch
(per-token cosine over real tokens, min and mean), one warm pass (graphs are captured there), then
``--trials`` timed passes over all batches (host overhead included: the input is a padded batch already on the
GPU, the output a padded ``last_hidden_state``); sequences/s is the median. The graphs variants also report
pack() -> first batch served (fresh process, validation and capture included), capture seconds, graph
memory (the graph pool's segments, exact; and the growth of ``memory_reserved`` from before pack() to after
the query workloads, an upper bound that includes validation), and documents with graphs on vs off,
interleaved in one process (documents exceed max_seqlen, so "on" must not be slower). ``graphs_sync_free``
serves padded calls from rectangular graphs with no host sync (``GraphConfig(sync_free=True)``): its timed
passes issue every batch before the one closing synchronize, so host and GPU overlap as under
``torch.compile``; it also records the sync-free fallbacks and checks that no input error was deferred.
Rows go to ``--out`` as JSON with GPU, driver, library versions and the git sha.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("stock", "eager", "graphs", "graphs_warm", "graphs_sync_free")
WORKLOADS = {  # name: (batch size, number of batches, median, sigma, lo, hi)
    "queries_b8": (8, 48, 30, 0.5, 4, 128),
    "queries_b128": (128, 8, 30, 0.5, 4, 128),
    "documents_b8": (8, 8, 600, 0.6, 16, 2048),
}


def _lengths(rng, n, median, sigma, lo, hi):
    return [int(min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))) for _ in range(n)]


def make_workloads(vocab: int, device):
    import random

    import torch

    out = {}
    for i, (name, (bs, nb, median, sigma, lo, hi)) in enumerate(WORKLOADS.items()):
        rng = random.Random(1000 + i)
        g = torch.Generator().manual_seed(2000 + i)
        batches = []
        for _ in range(nb):
            lengths = _lengths(rng, bs, median, sigma, lo, hi)
            s = max(lengths)
            ids = torch.randint(5, vocab, (bs, s), generator=g)
            mask = (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()
            ids = ids * mask
            batches.append((ids.to(device), mask.to(device), lengths))
        out[name] = batches
    return out


def _versions() -> dict:
    import torch

    from packed_encoders.calibrate import dist_version as ver

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
    except Exception:
        driver = None
    sha = os.environ.get("PE_GIT_SHA")  # as benchmarks/common.py: a copied tree's own git may be stale
    if not sha:
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=20).stdout.strip() or None
        except Exception:
            sha = None
    return {"gpu": torch.cuda.get_device_name(), "driver": driver, "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": ver("transformers"), "triton": ver("triton"),
            "cutlass_dsl": ver("nvidia-cutlass-dsl"), "git_sha": sha or os.environ.get("GIT_SHA")}


def _parity(fast, stock, mask) -> dict:
    import torch

    real = mask.bool()
    cos = torch.nn.functional.cosine_similarity(fast[real].float(), stock[real].float(), dim=-1)
    return {"cos_min": round(float(cos.min()), 6), "cos_mean": round(float(cos.mean()), 6)}


def _time_pass(fn, batches) -> float:
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for ids, mask, _ in batches:
        fn(ids, mask)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def worker(variant: str, trials: int, names: Sequence[str] = tuple(WORKLOADS)) -> dict:
    import torch
    from transformers import ModernBertConfig, ModernBertModel

    sys.path.insert(0, str(ROOT))
    import packed_encoders as pe

    torch.manual_seed(0)
    config = ModernBertConfig()
    config._attn_implementation = "sdpa"
    model = ModernBertModel(config).eval().to("cuda", torch.bfloat16)
    workloads = {k: v for k, v in make_workloads(config.vocab_size, "cuda").items() if k in names}
    torch.cuda.synchronize()
    row: dict = {"variant": variant, **_versions(), "model": "ModernBERT-base geometry, random init, bf16",
                 "workloads": {k: dict(zip(("batch", "batches", "median_len", "sigma", "min_len", "max_len"), v))
                               for k, v in WORKLOADS.items()}, "trials": trials, "results": {}}

    def stock(ids, mask):
        return type(model).forward(model, input_ids=ids, attention_mask=mask).last_hidden_state

    def packed(ids, mask):
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    fn = packed
    first_ids, first_mask, _ = workloads["queries_b8"][0]
    reserved0 = torch.cuda.memory_reserved()
    with torch.inference_mode():
        if variant == "stock":
            fn = stock
        elif variant == "eager":
            t0 = time.perf_counter()
            pe.pack(model)
            packed(first_ids, first_mask)
            torch.cuda.synchronize()
            row["pack_to_first_batch_s"] = round(time.perf_counter() - t0, 3)
        elif variant in ("graphs", "graphs_warm", "graphs_sync_free"):
            cfg = pe.GraphConfig(sync_free=variant == "graphs_sync_free")
            if variant == "graphs_warm":  # every token bucket batch-8 queries can reach
                cfg = cfg.with_precapture(8, 8, 8 * 128)
            reserved0 = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            pe.pack(model, cuda_graph=cfg)
            packed(first_ids, first_mask)
            torch.cuda.synchronize()
            row["pack_to_first_batch_s"] = round(time.perf_counter() - t0, 3)
            row["graphs_after_first_batch"] = pe.describe(model)["encoders"][0]["cuda_graph"]["graphs"]
        elif variant == "compile":
            fn = torch.compile(stock, mode="max-autotune", dynamic=True)
        else:
            raise SystemExit(f"unknown variant {variant}")

        for name, batches in workloads.items():
            res: dict = {}
            ids, mask, _ = batches[0]
            if variant != "stock":
                res["parity_vs_stock"] = _parity(fn(ids, mask), stock(ids, mask), mask)
            t0 = time.perf_counter()
            _time_pass(fn, batches)                                    # warm pass: captures / compiles
            res["first_pass_s"] = round(time.perf_counter() - t0, 3)
            times = [_time_pass(fn, batches) for _ in range(trials)]
            seqs = sum(len(b[2]) for b in batches)
            res["seq_per_s"] = round(seqs / statistics.median(times), 1)
            res["seq_per_s_trials"] = [round(seqs / t, 1) for t in times]
            if variant.startswith("graphs") and name.startswith("documents"):
                on, off = [], []
                for _ in range(trials):                                  # interleaved: same thermal state
                    on.append(_time_pass(fn, batches))
                    with pe.no_cuda_graph(model):
                        off.append(_time_pass(fn, batches))
                res["graphs_on_seq_per_s"] = round(seqs / statistics.median(on), 1)
                res["graphs_off_seq_per_s"] = round(seqs / statistics.median(off), 1)
                res["on_over_off"] = round(statistics.median(off) / statistics.median(on), 4)
            row["results"][name] = res
            if name == "queries_b128":  # before documents: eager document activations would inflate it
                row["reserved_growth_bytes"] = torch.cuda.memory_reserved() - reserved0
        if variant.startswith("graphs"):
            torch.cuda.synchronize()
            g = pe.describe(model)["encoders"][0]["cuda_graph"]
            row["graph_state"] = {k: g.get(k) for k in ("graphs", "hits", "misses", "evictions", "capture_seconds",
                                                          "fallbacks", "capture_failures", "pool_reserved_bytes",
                                                          "static_bytes")}
            row["graph_buckets"] = [(b["tokens"], b["seqs"], b["seqlen"], b["attention"], b.get("layout", "packed"))
                                    for b in g["buckets"]]
            if variant == "graphs_sync_free":
                pe.check_errors(model, wait=True)  # the benchmark's inputs are valid: nothing may be deferred
                row["sync_free"] = pe.describe(model)["encoders"][0]["cuda_graph"]["sync_free"]
    row["max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return row


def _seq(row: dict, workload: str) -> float:
    return row["results"].get(workload, {}).get("seq_per_s", float("nan"))


def _summary(rows: list[dict]) -> str:
    by = {r["variant"]: r for r in rows}
    lines = [f"{'variant':<17}" + "".join(f"{w:>16}" for w in WORKLOADS) + f"{'pack->1st (s)':>16}"]
    for v, r in by.items():
        lines.append(f"{v:<17}" + "".join(f"{_seq(r, w):>16,.0f}" for w in WORKLOADS)
                     + f"{r.get('pack_to_first_batch_s', float('nan')):>16}")
    stock = by.get("stock")
    for v in ("graphs", "graphs_warm", "graphs_sync_free"):
        r = by.get(v)
        if r is None:
            continue
        q8, q128 = (_seq(r, w) for w in ("queries_b8", "queries_b128"))
        if stock:
            s8, s128 = (_seq(stock, w) for w in ("queries_b8", "queries_b128"))
            lines.append(f"{v}: queries b8 {q8 / s8:.1f}x stock (target >= 10x), b128 {q128 / s128:.1f}x (>= 6x)")
        if "compile" in by:
            c8 = _seq(by["compile"], "queries_b8")
            lines.append(f"{v}: queries b8 {q8 / c8:.2f}x torch.compile (target >= 1.3x)")
        d = r["results"].get("documents_b8", {})
        gs = r.get("graph_state", {})
        lines.append(f"{v}: documents on/off {d.get('on_over_off', float('nan')):.3f} (>= ~1 within noise); pack->first batch "
                     f"{r['pack_to_first_batch_s']} s (<= 10 s); {gs.get('graphs')} graphs, capture "
                     f"{gs.get('capture_seconds')} s, pool {gs.get('pool_reserved_bytes')} B, reserved growth "
                     f"{r.get('reserved_growth_bytes')} B")
    sf, gr = by.get("graphs_sync_free"), by.get("graphs")
    if sf and gr:
        lines.append("graphs_sync_free / graphs: " + ", ".join(
            f"{w} {_seq(sf, w) / _seq(gr, w):.2f}x" for w in WORKLOADS if w in sf["results"] and w in gr["results"])
            + f"; sync-free fallbacks {sf.get('sync_free', {}).get('fallbacks')}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS + ('compile',)}")
    ap.add_argument("--compile", action="store_true", help="also run torch.compile(max-autotune, dynamic=True)")
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma list of {tuple(WORKLOADS)}")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "graphs.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trials < 5:
        ap.error("--trials must be >= 5 (medians of at least five)")
    if args.worker:
        row = worker(args.worker, args.trials, args.workloads.split(","))
        Path(args.worker_out).write_text(json.dumps(row))
        return
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        ap.error(f"unknown workloads {sorted(unknown)}; choose from {tuple(WORKLOADS)}")
    if args.compile and "compile" not in variants:
        variants.append("compile")
    rows = []
    t_all = time.perf_counter()
    for v in variants:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            tmp = f.name
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--worker", v, "--worker-out", tmp, "--trials",
                               str(args.trials), "--workloads", args.workloads], cwd=ROOT)
        if proc.returncode:
            print(f"variant {v} failed (exit {proc.returncode})", file=sys.stderr)
            continue
        row = json.loads(Path(tmp).read_text())
        row["process_seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        print(f"[{v}] {row['process_seconds']} s: " + json.dumps(row["results"]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(_summary(rows))
    print(f"total {time.perf_counter() - t_all:.0f} s; rows in {out}")


if __name__ == "__main__":
    main()
