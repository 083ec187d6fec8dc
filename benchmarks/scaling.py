"""Multi-GPU scaling: sharded indexing tokens/s and DDP training step time on 1, 2, 4, ... GPUs (torchrun, NCCL).

Each GPU count runs in fresh ``torchrun --standalone`` processes. Indexing: ``packed_encoders.index`` over a
corpus of real documents (the token cache's ``passages``, else the built-in sample's documents, repeated to
``--index-tokens``), bf16, after a warm-up pass; the plan is written before the clock starts. Training: fp32 master
weights under bf16 autocast, per GPU 16 queries (<= 128 tokens) + 16 documents (<= 2048), mean pooling, in-batch
contrastive loss, AdamW, as three variants: ``ddp`` (one backward), and a GradCache step in mini-batches of 8 rows
with a DDP all-reduce per mini-batch (``gradcache_per_chunk``) or one per step (``gradcache_once``,
``pe.grad_cache_sync``). Median of ``--steps`` steps after 3 warm-up steps.

    python -m benchmarks.scaling --gpus 1,2,4 --out benchmarks/results/h200/scaling.jsonl
    python -m benchmarks.scaling --render benchmarks/results/h200/scaling.jsonl        # markdown table
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

QUERIES, DOCUMENTS, CHUNK_ROWS = 16, 16, 8


# --------------------------------------------------------------------------------------------- data

def _documents_and_queries() -> tuple[list[list[int]], list[list[int]], str]:
    """Real token ids: (documents <= 2048, queries <= 128, source)."""
    try:
        from benchmarks.data import load_corpus

        corpus = load_corpus(build=False)
        docs = [corpus["passages"][i].tolist() for i in range(len(corpus["passages"]))]
        queries = [corpus["queries"][i].tolist() for i in range(len(corpus["queries"]))]
        return docs, queries, f"token cache {corpus.path}"
    except (FileNotFoundError, KeyError):
        from packed_encoders.data import load_sample

        sample = load_sample()
        return ([d["ids"] for d in sample["documents"]], [q["ids"] for q in sample["queries"]],
                "packed_encoders built-in sample")


def _write_inputs(workdir: Path, index_tokens: int, vocab_size: int) -> dict:
    docs, queries, source = _documents_and_queries()
    clip = lambda seq: [t % vocab_size for t in seq]  # noqa: E731  (a model of another vocabulary)
    corpus, tokens, i = workdir / "corpus.jsonl", 0, 0
    with open(corpus, "w") as f:
        while tokens < index_tokens:
            ids = clip(docs[i % len(docs)])
            f.write(json.dumps({"id": i, "input_ids": ids}) + "\n")
            tokens, i = tokens + len(ids), i + 1
    train = workdir / "train.json"
    train.write_text(json.dumps({"queries": [clip(q) for q in queries], "documents": [clip(d) for d in docs]}))
    return {"corpus": str(corpus), "corpus_items": i, "corpus_tokens": tokens, "train": str(train),
            "data_source": source}


# ------------------------------------------------------------------------------------------ workers

def _setup():
    """NCCL on ``cuda:LOCAL_RANK``; gloo on CPU (the smoke run)."""
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    if not torch.cuda.is_available():
        dist.init_process_group("gloo")
        return dist, dist.get_rank(), dist.get_world_size(), torch.device("cpu")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    return dist, dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _index_worker(args) -> dict | None:
    import packed_encoders as pe
    from packed_encoders.index import Encoder, _write_plan, index_corpus, load_model, run_settings, token_batches

    dist, rank, world, device = _setup()
    model = pe.pack(load_model(args.model_dir, device, torch.bfloat16 if device.type == "cuda" else torch.float32))
    with open(args.corpus) as src:  # warm-up on this rank alone (kernels, autotuning): 64 documents
        warm = [json.loads(line)["input_ids"] for _, line in zip(range(64), src)]
    encoder = Encoder(model)
    for batch in token_batches([len(x) for x in warm], args.batch_tokens):
        encoder([warm[i] for i in batch])
    settings = dict(batch_tokens=args.batch_tokens, chunk_tokens=args.chunk_tokens, progress=False)
    out = Path(args.workdir) / f"index-{world}-{uuid.uuid4().hex[:8]}" if rank == 0 else None
    box = [str(out) if out else None]
    dist.broadcast_object_list(box, src=0)
    out = Path(box[0])
    t0 = time.perf_counter()
    if rank == 0:
        out.mkdir(parents=True)
        (out / "chunks").mkdir()
        settings_of_run = run_settings(model, encoder, "pooled", "mean", torch.float32, 0)  # index_corpus's defaults
        _write_plan(str(out), args.corpus, args.chunk_tokens, "pooled", world, settings_of_run, encoder.vocab_size)
    plan_s = time.perf_counter() - t0
    dist.barrier()
    _sync(device)
    t0 = time.perf_counter()
    manifest = index_corpus(model, args.corpus, str(out), **settings)
    _sync(device)
    seconds = time.perf_counter() - t0
    dist.barrier()
    if rank != 0:
        return None
    busy = [0.0] * world
    tokens = [0] * world
    for f in (out / "chunks").glob("*.done"):
        d = json.loads(f.read_text())
        busy[d["rank"]] += d["seconds"]
        tokens[d["rank"]] += d["tokens"]
    return {"task": "index", "world": world, "seconds": seconds, "plan_s": plan_s, "tokens": manifest["tokens"],
            "items": manifest["items"], "tokens_per_s": manifest["tokens"] / seconds, "rank_busy_s": busy,
            "rank_tokens": tokens, "batch_tokens": args.batch_tokens, "chunk_tokens": args.chunk_tokens}


def _padded(seqs, device, pad_id):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)


def _train_worker(args) -> dict | None:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModel

    import packed_encoders as pe

    dist, rank, world, device = _setup()
    data = json.loads(Path(args.train).read_text())
    model = AutoModel.from_pretrained(args.model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                      local_files_only=True).to(device).train()
    pe.pack(model)
    pad_id = model.config.pad_token_id or 0
    ddp = DDP(model, device_ids=None if device.index is None else [device.index])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def batch(step):
        start = (step * world + rank)
        q = [data["queries"][(start * QUERIES + i) % len(data["queries"])] for i in range(QUERIES)]
        d = [data["documents"][(start * DOCUMENTS + i) % len(data["documents"])] for i in range(DOCUMENTS)]
        return _padded(q, device, pad_id), _padded(d, device, pad_id)

    def embed(ids, mask):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = ddp(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return (out.float() * m).sum(1) / m.sum(1)

    def loss_of(q, d):
        scores = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T * 20
        return F.cross_entropy(scores, torch.arange(len(q), device=q.device))

    def step_ddp(b):
        (qi, qm), (di, dm) = b
        loss_of(embed(qi, qm), embed(di, dm)).backward()

    def gradcache(b):
        parts = [(ids[i:i + CHUNK_ROWS], mask[i:i + CHUNK_ROWS]) for ids, mask in b
                 for i in range(0, len(ids), CHUNK_ROWS)]
        with torch.no_grad():
            reps = [embed(*p).requires_grad_() for p in parts]
        half = len(parts) // 2
        loss_of(torch.cat(reps[:half]), torch.cat(reps[half:])).backward()
        for p, r in zip(parts, reps):
            (embed(*p) * r.grad).sum().backward()

    def step_once(b):
        with pe.grad_cache_sync(ddp):
            gradcache(b)

    rows = []
    for variant, fn in (("ddp", step_ddp), ("gradcache_per_chunk", gradcache), ("gradcache_once", step_once)):
        times = []
        for step in range(3 + args.steps):
            b = batch(step)
            dist.barrier()
            _sync(device)
            t0 = time.perf_counter()
            fn(b)
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
            if step >= 3:
                times.append(time.perf_counter() - t0)
        gathered = [None] * world
        dist.all_gather_object(gathered, statistics.median(times))
        rows.append({"task": "train", "variant": variant, "world": world, "step_ms": 1e3 * max(gathered),
                     "rank_step_ms": [1e3 * t for t in gathered], "steps": args.steps,
                     "per_gpu_batch": f"{QUERIES} queries + {DOCUMENTS} documents", "chunk_rows": CHUNK_ROWS,
                     "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda"
                     else None})
    return rows if rank == 0 else None


def worker_main(args) -> int:
    import torch.distributed as dist

    result = _index_worker(args) if args.worker == "index" else _train_worker(args)
    if result is not None:
        rows = result if isinstance(result, list) else [result]
        with open(args.row_file, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------------------- parent

def _run(world: int, worker: str, args, inputs: dict, row_file: Path) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "benchmarks.scaling", "--worker", worker, "--model-dir", args.model_dir, "--workdir", args.workdir,
           "--corpus", inputs["corpus"], "--train", inputs["train"], "--row-file", str(row_file),
           "--batch-tokens", str(args.batch_tokens), "--chunk-tokens", str(args.chunk_tokens),
           "--steps", str(args.steps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
    else:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout, env=env)
    return p.returncode, (p.stdout + p.stderr)[-3000:]


def parent_main(args) -> int:
    from benchmarks.common import environment, write_rows
    from benchmarks.models import save_random_model

    available = torch.cuda.device_count() if args.device == "cuda" else max(args.gpus)
    if not available:
        print("benchmarks.scaling needs CUDA GPUs (--device cpu runs the smoke version with gloo)", file=sys.stderr)
        return 2
    tmp = tempfile.TemporaryDirectory(prefix="pe-scaling-")
    args.workdir = tmp.name
    workdir = Path(tmp.name)
    if args.model:
        args.model_dir, model_name = args.model, args.model
    else:
        args.model_dir = str(save_random_model(args.config, workdir / "model", torch.float32))
        model_name = f"{args.config} (random init)"
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model_dir, local_files_only=True).vocab_size
    inputs = _write_inputs(workdir, args.index_tokens, vocab)
    env = environment(args.device)
    run_id = f"scaling-{time.strftime('%Y%m%d-%H%M%S')}"
    rows = []
    for world in args.gpus:
        if world > available:
            print(f"{world} GPUs: skipped ({available} visible)")
            continue
        for worker in ("index", "train"):
            row_file = workdir / f"rows-{world}-{worker}.jsonl"
            rc, tail = _run(world, worker, args, inputs, row_file)
            if rc != 0:
                print(f"{world} GPUs {worker}: exit {rc}\n{tail}", file=sys.stderr)
                rows.append({"run_id": run_id, "runner": "scaling", "task": worker, "world": world, "error": tail,
                             **env})
                continue
            for line in row_file.read_text().splitlines():
                r = json.loads(line)
                rows.append({"run_id": run_id, "runner": "scaling", "model": model_name, **inputs, **r, **env})
                print(json.dumps({k: r[k] for k in r if not isinstance(r[k], list)}))
    write_rows(Path(args.out), rows)
    print(render(rows))
    return 0


def render(rows: list[dict]) -> str:
    """Markdown: one line per (run, GPU count): indexing tokens/s and speedup over the run's 1-GPU row, the ranks'
    busy-time spread, and the three training variants' step times."""
    out = []
    for run_id in sorted({r.get("run_id") for r in rows}):
        run = [r for r in rows if r.get("run_id") == run_id and "error" not in r]
        if not run:
            continue
        first = run[0]
        out.append(f"\n**{run_id}** — {first.get('gpu', '?')}, torch {first.get('torch')}, {first.get('model')}, "
                   f"{first.get('data_source')}, git {first.get('git_sha')}\n")
        out.append("| GPUs | index tokens/s | speedup | rank busy min/max s | train step ms: ddp | "
                   "GradCache all-reduce per mini-batch | GradCache once per step | queries+docs/s (ddp) |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|")
        index = {r["world"]: r for r in run if r["task"] == "index"}
        train = {(r["world"], r["variant"]): r for r in run if r["task"] == "train"}
        base = index.get(1, {}).get("tokens_per_s")
        for world in sorted({r["world"] for r in run}):
            ix = index.get(world)
            tps = ix["tokens_per_s"] if ix else None
            busy = f"{min(ix['rank_busy_s']):.1f} / {max(ix['rank_busy_s']):.1f}" if ix else "-"
            cells = [str(world), "-" if tps is None else f"{tps:,.0f}",
                     f"{tps / base:.2f}x" if tps and base else "-", busy]
            for variant in ("ddp", "gradcache_per_chunk", "gradcache_once"):
                t = train.get((world, variant))
                cells.append("-" if t is None else f"{t['step_ms']:.1f}")
            t = train.get((world, "ddp"))
            cells.append("-" if t is None else f"{world * (QUERIES + DOCUMENTS) / t['step_ms'] * 1e3:,.0f}")
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "h200" / "scaling.jsonl"))
    ap.add_argument("--config", default="modernbert-base")
    ap.add_argument("--model", default=None, help="a local ModernBERT checkpoint instead of a random-init config")
    ap.add_argument("--index-tokens", type=int, default=8_000_000)
    ap.add_argument("--batch-tokens", type=int, default=65536)
    ap.add_argument("--chunk-tokens", type=int, default=1 << 20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: gloo ranks on the CPU, to smoke-test the script (--config tiny)")
    ap.add_argument("--render", nargs="+", default=None, metavar="JSONL", help="print the markdown table and exit")
    # worker side (set by the parent)
    ap.add_argument("--worker", choices=("index", "train"), default=None, help=argparse.SUPPRESS)
    for name in ("--model-dir", "--workdir", "--corpus", "--train", "--row-file"):
        ap.add_argument(name, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        from benchmarks.common import read_rows

        print(render(read_rows(args.render)))
        return 0
    if args.worker:
        return worker_main(args)
    return parent_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
