"""Host time against GPU time of eager packed calls and training steps, per call path, each in a fresh process.

    python -m benchmarks.host                         # H200: ModernBERT-base random init, ~3-4 minutes
    python -m benchmarks.host --device cpu --config tiny --tokens /tmp/tokens.npz   # CPU smoke (host proxy only)

Workloads (real text from the token cache, ``python -m benchmarks.data``): eager inference calls of ``queries`` b8
(NQ-open), ``documents`` b8 (BoolQ 5-shot prompts, p50 ~925 tokens), ``passages`` b32 (BoolQ / SciQ), padded as a
collator pads them, model in bf16; and the single-vector ``train`` step: 16 queries + 16 documents, fp32 master
weights under bf16 autocast, mean pooling, in-batch InfoNCE, AdamW.

Variants (environment of the child process):

- ``stock``: HF's own forward (sdpa), not packed.
- ``old``: ``pe.pack(model)`` with ``PACKED_ENCODERS_LEAN=0``: every op checks its inputs and routes per call, one
  autograd node per op, quack's routes from their per-op size rules.
- ``new``: ``pe.pack(model)`` (the lean path: op choices planned once per call class, unchecked launches, one
  autograd node per layer block, cached autocast weight casts).
- ``new_noquack``: ``new`` with ``PACKED_ENCODERS_QUACK_GEMM=0`` (installing the ``cute`` extra must not slow a call).
- ``new_eager``: ``new`` with ``PACKED_ENCODERS_GRAPH=0``: the eager path a call takes when no graph serves it.
- ``new_eager_varlen``: ``new_eager`` packed with ``attention_backend="varlen"`` (FlashAttention-2 on every layer,
  whatever the policy prefers).

A variant may name another source tree of the package: ``new_eager@/path/to/tree`` runs ``new_eager``'s environment
with ``packed_encoders`` imported from that tree (e.g. ``git worktree add /tmp/before <commit>``), so code before
and after a change are timed by the same harness in one run; its rows carry ``code_dir``, ``code_sha`` and
``package_file`` (the package the child imported, checked to lie in that tree).
``--rounds R`` runs every variant R times, round-robin, each run a fresh process: the host's speed drifts between
runs (up to 3x on the H200 machine), so before / after pairs compare within a round, and the table shows each
variant's median over rounds with its range.

Per (workload, variant): ``host_ms`` (median time for the call to return, GPU idle at the start: the host's share),
``gpu_ms`` (kernel time per call from ``torch.profiler``), ``wall_ms`` (median per call back to back, CUDA events),
``python_calls`` (cProfile, one call), ``aten_ops`` (torch.profiler CPU events named ``aten::``), ``launches`` and
``memsets`` (CUDA runtime / driver calls that enqueue a kernel or a memset, per call; 0 on CPU), for packed
inference the per-token cosine against stock on the first batch, and for ``train`` ``phase_host_ms`` (host timers
per part of the step, medians: queries forward, documents forward, loss, backward, optimizer step + ``zero_grad``).
Rows go to ``--out`` as JSON lines (appended to a ``.jsonl.partial`` file as each variant's process ends, so a run
killed by a time limit keeps what it measured); a table is printed. Host time per layer = ``host_ms /
num_hidden_layers``.
``--profile-dir DIR`` also writes where each call's host time goes (cProfile by function, one call; torch.profiler
by operator) per variant and workload, in the first round only (a file per round, variant and workload outnumbers
what a remote run may return).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import common
from benchmarks.common import (ROOT, device_work, environment, finish_rows, git_sha, run_child, synchronize,
                               write_rows)

# A child timing another tree's package (``NAME@DIR``, its hidden ``--code DIR``) puts that tree first before
# anything imports packed_encoders (the imports above do not): the package cannot be swapped once imported.
if __name__ == "__main__":
    common.code_tree_first(sys.argv)

VARIANTS = {
    "stock": {},
    "old": {"PACKED_ENCODERS_LEAN": "0"},
    "new": {"PACKED_ENCODERS_LEAN": "1"},
    "new_noquack": {"PACKED_ENCODERS_LEAN": "1", "PACKED_ENCODERS_QUACK_GEMM": "0"},
    "new_eager": {"PACKED_ENCODERS_LEAN": "1", "PACKED_ENCODERS_GRAPH": "0"},
}
VARIANTS["new_eager_varlen"] = VARIANTS["new_eager"]  # the same environment, other pack() arguments
# pe.pack() arguments of a variant (beyond its environment)
PACK_KWARGS = {"new_eager_varlen": {"attention_backend": "varlen"}}
WORKLOADS = {"queries": ("queries", 8), "documents": ("long", 8), "passages": ("passages", 32)}
N_BATCHES = 12
REPS = {"host": 20, "train_host": 8, "wall_passes": 3, "profiled": 3}
QUICK = {"host": 3, "train_host": 2, "wall_passes": 1, "profiled": 1}


def _batches(corpus, set_name: str, batch: int, n: int, seed: int, device: str, max_len: int | None = None):
    from benchmarks.common import padded_batch

    ts = corpus[set_name]
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(ts), size=batch * n, replace=len(ts) < batch * n)  # small caches repeat sequences
    out = []
    for i in range(0, len(idx) - batch + 1, batch):
        seqs = [np.asarray(ts[int(j)], dtype=np.int64)[:max_len] for j in idx[i:i + batch]]
        out.append(padded_batch(seqs, 0, device))
    return out


# CUDA runtime / driver calls that enqueue one kernel, and the memsets enqueued beside them (cuBLASLt's algorithms
# that zero their workspace): each costs host time of its own, so an eager call's host time follows their count
_LAUNCH_CALLS = frozenset({"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"})
_MEMSET_CALLS = frozenset({"cudaMemsetAsync", "cuMemsetD8Async", "cuMemsetD32Async"})


def _profile(step, args, device: str, n: int = 3, table_to: list | None = None) -> tuple[float, int, int, int]:
    """``(kernel ms per call, aten ops per call, kernel launches per call, memsets per call)``; ``table_to``: a list
    that receives the profiler's table of operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    synchronize(device)
    with profile(activities=acts) as prof:
        for i in range(n):
            step(args[i % len(args)])
        synchronize(device)
    if table_to is not None:
        table_to.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    gpu_us = 0.0
    aten = launches = memsets = 0
    events = prof.events()
    for e in events:
        if e.name.startswith("aten::"):
            aten += 1
        elif e.name in _LAUNCH_CALLS:
            launches += 1
        elif e.name in _MEMSET_CALLS:
            memsets += 1
    if device.startswith("cuda"):
        gpu_us = sum(e.time_range.elapsed_us() for e in device_work(events))  # kernels, memcpys, memsets
    return gpu_us / 1e3 / n, aten // n, launches // n, memsets // n


def _measure(step, args, device: str, reps: int, counts: dict, profile_to: Path | None = None) -> dict:
    for a in args[:3]:  # warm-up: compiles, captures nothing (eager)
        step(a)
    synchronize(device)
    host = []
    for i in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        step(args[i % len(args)])
        host.append(time.perf_counter() - t0)
    synchronize(device)
    walls = []
    for _ in range(counts["wall_passes"]):
        synchronize(device)
        t0 = time.perf_counter()
        for a in args:
            step(a)
        synchronize(device)
        walls.append((time.perf_counter() - t0) / len(args))
    pr = cProfile.Profile()
    pr.enable()
    step(args[0])
    pr.disable()
    synchronize(device)
    table = [] if profile_to is not None else None
    gpu_ms, aten, launches, memsets = _profile(step, args, device, counts["profiled"], table)
    if profile_to is not None:  # where the host time goes: Python functions, then operators
        text = io.StringIO()
        stats = pstats.Stats(pr, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("ncalls").print_stats(40)  # the many small calls that add up
        profile_to.parent.mkdir(parents=True, exist_ok=True)
        profile_to.write_text(f"cProfile, one call\n{text.getvalue()}\ntorch.profiler, {counts['profiled']} calls\n"
                              f"{table[0]}\n")
    return {"host_ms": statistics.median(host) * 1e3, "wall_ms": statistics.median(walls) * 1e3, "gpu_ms": gpu_ms,
            "python_calls": pstats.Stats(pr).total_calls, "aten_ops": aten, "launches": launches, "memsets": memsets}


def _profile_path(args, workload: str) -> Path | None:
    return Path(args.profile_dir) / f"{workload}.txt" if args.profile_dir else None


def child(args) -> dict:
    pe = common.import_package(args.code)
    from benchmarks.data import load_corpus
    from benchmarks.models import make_config

    device = args.device
    corpus = load_corpus(args.tokens, build=False)
    config = make_config(args.config)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    from transformers import ModernBertModel

    packed = args.variant != "stock"
    counts = QUICK if args.quick else REPS
    cap = 48 if args.quick else None  # the CPU smoke test truncates sequences: compute is not what it checks
    rows = []
    for workload in args.workloads.split(","):
        if workload == "train":
            model = ModernBertModel(config).to(device).train()  # fp32 masters
            if packed:
                pe.pack(model, validate=False, **PACK_KWARGS.get(args.variant, {}))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
            q = _batches(corpus, "queries", 16, 4, 1, device, cap)
            d = _batches(corpus, "long", 16, 4, 2, device, cap)
            pairs = list(zip(q, d))
            def encode(b):
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                    h = model(input_ids=b.input_ids, attention_mask=b.attention_mask).last_hidden_state
                m = b.attention_mask.unsqueeze(-1).float()
                return torch.nn.functional.normalize((h.float() * m).sum(1) / m.sum(1), dim=-1)

            def step(pair, marks=None):
                qb, db = pair
                t0 = time.perf_counter()
                eq = encode(qb)
                t1 = time.perf_counter()
                ed = encode(db)
                t2 = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(eq @ ed.t() / 0.05, torch.arange(eq.shape[0], device=device))
                t3 = time.perf_counter()
                loss.backward()
                t4 = time.perf_counter()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if marks is not None:
                    marks.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, time.perf_counter() - t4))

            row = _measure(step, pairs, device, counts["train_host"], counts, _profile_path(args, workload))
            marks: list = []
            for i in range(counts["train_host"]):  # where a step's host time goes, GPU idle at each step's start
                synchronize(device)
                step(pairs[i % len(pairs)], marks)
            synchronize(device)
            phases = ("queries_forward", "documents_forward", "loss", "backward", "optimizer")
            row["phase_host_ms"] = {name: statistics.median(m[j] for m in marks) * 1e3 for j, name in enumerate(phases)}
        else:
            set_name, batch = WORKLOADS[workload]
            batches = _batches(corpus, set_name, batch, 3 if args.quick else N_BATCHES, 0, device, cap)
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
            model = ModernBertModel(config).to(device, dtype).eval()
            cos = None
            if packed:
                b = batches[0]
                with torch.no_grad():
                    ref = type(model).forward(model, input_ids=b.input_ids, attention_mask=b.attention_mask)
                pe.pack(model, validate=False, **PACK_KWARGS.get(args.variant, {}))
                with torch.no_grad():
                    got = model(input_ids=b.input_ids, attention_mask=b.attention_mask)
                real = b.attention_mask.bool()
                cos = torch.nn.functional.cosine_similarity(got.last_hidden_state[real].float(),
                                                            ref.last_hidden_state[real].float(), dim=-1).min().item()

            def step(b):
                with torch.no_grad():
                    model(input_ids=b.input_ids, attention_mask=b.attention_mask)

            row = _measure(step, batches, device, counts["host"], counts, _profile_path(args, workload))
            row["token_cos_min"] = cos
            row["tokens_per_call"] = float(np.mean([int(b.attention_mask.sum()) for b in batches]))
        row.update(runner="host", workload=workload, variant=args.variant, config=args.config,
                   layers=config.num_hidden_layers,
                   host_us_per_layer=row["host_ms"] * 1e3 / config.num_hidden_layers,
                   describe=pe.describe(model)["encoders"][0].get("kernels") if packed else None)
        row.update(common.code_fields(args.code, pe))
        rows.append(row)
        model = None  # dropped before empty_cache; not `del`: the closures above read the name
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return {"rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config", default="modernbert-base")
    ap.add_argument("--tokens", default=None, help="token cache (default: benchmarks.data's)")
    ap.add_argument("--variants", default="stock,old,new,new_noquack",
                    help=f"comma list of {', '.join(VARIANTS)}; NAME@DIR: NAME with the package of the tree DIR")
    ap.add_argument("--rounds", type=int, default=1, help="run the variants this many times, round-robin")
    ap.add_argument("--workloads", default="queries,documents,passages,train")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host"))
    ap.add_argument("--quick", action="store_true", help="few repetitions (CPU smoke test)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per variant (its fresh process)")
    ap.add_argument("--profile-dir", default=None,
                    help="write where each call's host time goes (cProfile by function, torch.profiler by operator) "
                         "to DIR/round0_<variant>/<workload>.txt (first round only)")
    ap.add_argument("--child", dest="variant", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--code", default=None, help=argparse.SUPPRESS)  # the child's package tree (NAME@DIR)
    args = ap.parse_args(argv)
    if args.variant is not None:
        print("HOSTJSON " + json.dumps(child(args)))
        return 0
    specs = [parse_variant(v) for v in args.variants.split(",") if v.strip()]
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    rows = []
    env = environment(args.device)
    t_start = time.perf_counter()
    path = Path(args.out) / f"host_{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    partial = path.with_suffix(".jsonl.partial")  # rows so far, should the run be killed (a remote time limit)
    for round_ in range(args.rounds):
        for spec, variant, code in specs:
            argv_child = ["benchmarks.host", "--child", variant, "--device", args.device, "--config", args.config,
                          "--workloads", args.workloads] + (["--tokens", args.tokens] if args.tokens else []) \
                + (["--quick"] if args.quick else []) + (["--code", code] if code else [])
            if args.profile_dir and round_ == 0:
                folder = Path(args.profile_dir) / f"round{round_}_{common.file_name(spec)}"
                argv_child += ["--profile-dir", str(folder)]
            rc, out, secs = run_child(argv_child, timeout=args.timeout, env=VARIANTS[variant])
            line = next((ln for ln in out.splitlines() if ln.startswith("HOSTJSON ")), None)
            if rc != 0 or line is None:
                print(f"[{spec}] failed (rc {rc}, {secs:.0f} s):\n{out[-2500:]}", file=sys.stderr)
                new = [{"runner": "host", "variant": spec, "round": round_, "status": "failed", "tail": out[-2000:]}]
            else:
                new = json.loads(line[len("HOSTJSON "):])["rows"]
                for r in new:
                    r.update(status="ok", variant=spec, round=round_)
                    if code:
                        r["code_sha"] = git_sha(code)
                print(f"[{spec}] round {round_ + 1}/{args.rounds}: {secs:.0f} s", file=sys.stderr)
            for r in new:
                r["env"] = env
            write_rows(partial, new)
            rows += new
    finish_rows(path, partial, rows, t_start)
    print(table(rows))
    print(f"rows: {path}")
    return 0


def parse_variant(spec: str) -> tuple[str, str, str | None]:
    """:func:`benchmarks.common.parse_variant` against this harness's ``VARIANTS``."""
    return common.parse_variant(spec, VARIANTS)


def table(rows: list[dict]) -> str:
    """Markdown: per (workload, variant) the median over rounds of host / GPU / wall ms (host range when there
    are several rounds), Python calls and aten ops of the first round, the parity cosine."""
    lines = ["| workload | variant | rounds | host ms median (range) | us/layer | GPU ms | wall ms | python calls "
             "| aten ops | launches (memsets) | cos min |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    groups: dict = {}
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| - | {r['variant']} | failed (round {r.get('round', 0) + 1}) | | | | | | | | |")
            continue
        groups.setdefault((r["workload"], r["variant"]), []).append(r)
    for (workload, variant), rs in groups.items():
        med = {k: statistics.median(x[k] for x in rs) for k in ("host_ms", "gpu_ms", "wall_ms")}
        hosts = [x["host_ms"] for x in rs]
        spread = f" ({min(hosts):.2f}-{max(hosts):.2f})" if len(rs) > 1 else ""
        cos = "" if rs[0].get("token_cos_min") is None else f"{rs[0]['token_cos_min']:.5f}"
        lines.append(f"| {workload} | {variant} | {len(rs)} | {med['host_ms']:.2f}{spread} "
                     f"| {med['host_ms'] * 1e3 / rs[0]['layers']:.0f} | {med['gpu_ms']:.2f} | {med['wall_ms']:.2f} "
                     f"| {rs[0]['python_calls']} | {rs[0]['aten_ops']} | {_launches(rs[0])} | {cos} |")
    return "\n".join(lines)


def _launches(row: dict) -> str:
    """``launches (memsets)`` per call, blank for rows recorded before the harness counted them."""
    if row.get("launches") is None:
        return ""
    return f"{row['launches']} ({row.get('memsets', 0)})"


if __name__ == "__main__":
    raise SystemExit(main())
