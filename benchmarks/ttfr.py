"""Time to first result of ``pe.pack(model)`` with no options: pack (with validation) plus the first batch.

Each run is a fresh process (imports, CUDA context and kernel caches as a user's notebook would have them);
``--runs 2`` runs it twice, so the second run finds the Triton / quack / inductor disk caches warm. Per run:

- ``import_s``: ``import packed_encoders`` (+ transformers); ``load_s``: build the model (random init from a
  config, or ``--model DIR``) and move it to the device; ``cuda_init_s``: the first CUDA op;
- ``pack_s``, split into ``tuning_and_state_s`` (switches, op set, attention policy), ``validate_s`` (stock vs
  packed on the check batch, kernel compiles included), ``install_s`` and the rest;
- ``first_batch_s``: the first ``[B, S]`` call, synchronized (with automatic graphs its bucket is captured
  there, ``capture_s`` of it); ``second_batch_s``: the same call again (a replay); ``next_bucket_s``: a call of
  another bucket (one more capture);
- ``ttfr_s = pack_s + first_batch_s`` (the issue's bar: <= 10 s with warm caches).

    python -m benchmarks.ttfr --runs 2                         # ModernBERT-base, bf16, documents batch 8
    python -m benchmarks.ttfr --runs 2 --workload queries --out benchmarks/results/h200
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = {"documents": (8, 925, 0.25, 2048), "queries": (8, 12, 0.3, 128), "passages": (32, 102, 0.6, 1070)}


def _lengths(workload: str, seed: int) -> list[int]:
    batch, p50, sigma, cap = WORKLOADS[workload]
    rng = random.Random(seed)
    return [min(cap, max(3, int(rng.lognormvariate(math.log(p50), sigma)))) for _ in range(batch)]


def child(args) -> dict:
    t = {}
    t0 = time.perf_counter()
    import torch
    import transformers  # noqa: F401

    import packed_encoders as pe
    from packed_encoders import api

    t["import_s"] = time.perf_counter() - t0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    if device == "cuda":
        torch.zeros(1, device=device)
        torch.cuda.synchronize()
    t["cuda_init_s"] = time.perf_counter() - t0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    t0 = time.perf_counter()
    if args.model:
        model = transformers.AutoModel.from_pretrained(args.model, torch_dtype=dtype, attn_implementation="sdpa")
    else:
        sys.path.insert(0, str(ROOT))
        from benchmarks.models import make_config

        config = make_config(args.config)
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = transformers.ModernBertModel(config)
    model = model.to(device, dtype).eval()
    if device == "cuda":
        torch.cuda.synchronize()
    t["load_s"] = time.perf_counter() - t0

    phases = {"make_state": 0.0, "check_encoder": 0.0, "install": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            s = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - s
        return wrapper

    for name in phases:  # pack() calls these by the names it imported
        setattr(api, name, timed(name, getattr(api, name)))
    t0 = time.perf_counter()
    pe.pack(model)
    if device == "cuda":
        torch.cuda.synchronize()
    t["pack_s"] = time.perf_counter() - t0
    t["tuning_and_state_s"], t["validate_s"], t["install_s"] = (phases["make_state"], phases["check_encoder"],
                                                                 phases["install"])
    t["pack_other_s"] = t["pack_s"] - sum(phases.values())

    vocab = model.config.vocab_size

    def batch(seed):
        lengths = _lengths(args.workload, seed)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, vocab - 5, (len(lengths), max(lengths)), generator=g)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            mask[row, :n] = 1
        return ids.to(device), mask.to(device), lengths

    def call(ids, mask):
        s = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=mask)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - s

    ids, mask, lengths = batch(0)
    capture0 = 0.0
    t["first_batch_s"] = call(ids, mask)
    graphs = pe.describe(model)["encoders"][0]["cuda_graph"]
    t["capture_s"] = graphs.get("capture_seconds", 0.0) - capture0
    t["second_batch_s"] = call(ids, mask)
    other = batch(1)
    while other[2] == lengths:  # pragma: no cover - another bucket, not the same call
        other = batch(int(time.time()))
    before = pe.describe(model)["encoders"][0]["cuda_graph"].get("capture_seconds", 0.0)
    t["next_bucket_s"] = call(other[0], other[1])
    graphs = pe.describe(model)["encoders"][0]["cuda_graph"]
    t["next_bucket_capture_s"] = graphs.get("capture_seconds", 0.0) - before
    t["ttfr_s"] = t["pack_s"] + t["first_batch_s"]
    info = pe.describe(model)["encoders"][0]
    return {"timings": {k: round(v, 4) for k, v in t.items()}, "workload": args.workload, "lengths": lengths,
            "config": args.model or args.config, "dtype": args.dtype, "device": device,
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
            "graphs": {k: graphs.get(k) for k in ("mode", "graphs", "hits", "misses", "fallbacks", "capture_failures")},
            "validated": info.get("validated"), "kernels": info.get("kernels")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="fresh processes, one after the other")
    ap.add_argument("--workload", default="documents", choices=sorted(WORKLOADS))
    ap.add_argument("--config", default="modernbert-base", help="random-init config (benchmarks/models.py)")
    ap.add_argument("--model", default=None, help="local checkpoint directory instead")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=None, help="directory: append the rows to ttfr_<stamp>.jsonl there")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("TTFR_ROW " + json.dumps(child(args)), flush=True)
        return 0
    rows = []
    forward = ["--workload", args.workload, "--config", args.config, "--dtype", args.dtype]
    forward += (["--model", args.model] if args.model else []) + (["--device", args.device] if args.device else [])
    for run in range(args.runs):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "benchmarks.ttfr", "--child", *forward], cwd=ROOT,
                              capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        wall = time.perf_counter() - t0
        line = next((x for x in proc.stdout.splitlines() if x.startswith("TTFR_ROW ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode or 1
        row = json.loads(line.removeprefix("TTFR_ROW "))
        row.update(run=run + 1, process_wall_s=round(wall, 2), runner="ttfr", variant="pack")
        rows.append(row)
        t = row["timings"]
        print(f"run {run + 1}: ttfr {t['ttfr_s']:.2f} s = pack {t['pack_s']:.2f} (state {t['tuning_and_state_s']:.2f}, "
              f"validate {t['validate_s']:.2f}, install {t['install_s']:.3f}, other {t['pack_other_s']:.2f}) + first "
              f"batch {t['first_batch_s']:.3f} (capture {t['capture_s']:.3f}); second {t['second_batch_s'] * 1e3:.2f} ms; "
              f"another bucket {t['next_bucket_s']:.3f} s; import {t['import_s']:.2f}, load {t['load_s']:.2f}, "
              f"process {wall:.1f} s; graphs {row['graphs']}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"ttfr_{args.workload}_{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{len(rows)} rows -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
