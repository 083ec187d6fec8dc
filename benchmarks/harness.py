"""Parent / child orchestration shared by ``inference.py`` and ``indexing.py``.

The parent builds (or points at) the model directory, checks which variants can run here, then starts one
child process per (family, variant) -- per endpoint too for the cold-start variants -- and collects their
rows. A child loads the model, computes stock-HF reference outputs, applies its variant, times it, then
checks parity; a parity failure exits with code 3, and the parent then aborts and publishes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from benchmarks import common, workloads
from benchmarks.common import ROOT

PARITY_EXIT = 3


@dataclass
class Endpoint:
    """One workload: ``n_seqs`` sequences of the cached set ``set_name`` in batches of ``batch``."""

    name: str
    set_name: str
    batch: int
    n_seqs: int


def add_args(ap: argparse.ArgumentParser) -> None:
    """Options shared by the runners (the child-only ones are hidden)."""
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory for JSON rows")
    ap.add_argument("--quick", action="store_true", help="smaller sweep (fewer sequences)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--dtype", default=None, choices=common.DTYPES, help="bf16 (CUDA default), fp16 or fp32 (CPU "
                    "default)")
    ap.add_argument("--config", default="modernbert-base", help="random-init config (see benchmarks/models.py)")
    ap.add_argument("--model", default=None, help="local checkpoint directory instead of a random model")
    ap.add_argument("--families", default="hf", help="comma list of hf, st, colbert (or 'all')")
    ap.add_argument("--variants", default=None, help="comma list (default: all; see benchmarks/variants.py)")
    ap.add_argument("--trials", type=common.at_least(1), default=5, help="timed passes over the workload (>= 5)")
    ap.add_argument("--warmup", type=common.at_least(0), default=1, help="untimed passes (the first one is "
                    "reported)")
    ap.add_argument("--tokens", default=None, help="token cache (default benchmarks/.cache/tokens.npz)")
    ap.add_argument("--seed", type=int, default=0, help="which sequences are drawn")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per child process")
    ap.add_argument("--cpu-threads", type=int, default=1,
                    help="torch threads on CPU (1: small shared CI machines thrash with more)")
    for name in ("--child", "--variant", "--family", "--endpoint-json", "--model-dir", "--model-label",
                 "--row-out"):
        ap.add_argument(name, help=argparse.SUPPRESS, **({"action": "store_true"} if name == "--child" else {}))


def resolve_device(args) -> tuple[str, str]:
    device = common.device_of(args.device)
    return device, args.dtype or common.default_dtype(device)


def parse_families(text: str) -> list[str]:
    from benchmarks.models import FAMILIES

    names = list(FAMILIES) if text == "all" else [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in names if f not in FAMILIES]
    if bad:
        raise SystemExit(f"unknown families {bad}; choose from {', '.join(FAMILIES)} or all")
    return names


def _load_corpus(args):
    from benchmarks.data import load_corpus

    try:
        return load_corpus(args.tokens, build=False)
    except FileNotFoundError as exc:
        raise SystemExit(f"{exc}\n(the GPU machine has no network: build the cache here and carry "
                         f"benchmarks/.cache/tokens.npz)") from None


# ------------------------------------------------------------------------------------------ parent

def run_parent(args, runner: str, endpoints: list[Endpoint], module: str) -> int:
    """Run every (family, variant) child for ``endpoints``; write rows; print the tables. Returns the exit code."""
    from transformers import AutoConfig

    from benchmarks import render
    from benchmarks.data import format_stats
    from benchmarks.models import model_dir_for
    from benchmarks.variants import COLD_START_VARIANTS, VARIANTS, parse_variants, why_skip

    if args.trials < 5:
        print(f"note: --trials {args.trials} < 5 (the protocol asks for >= 5)", file=sys.stderr)
    device, dtype_name = resolve_device(args)
    dtype = common.dtype_of(dtype_name)
    families = parse_families(args.families)
    variants = parse_variants(args.variants) if args.variants else list(VARIANTS)
    corpus = _load_corpus(args)
    env = common.environment(device)
    work = Path(tempfile.mkdtemp(prefix=f"pe-{runner}-"))
    t_start = time.perf_counter()
    try:
        model_dir, label = model_dir_for(args, work, dtype)
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        print(f"{runner}: {label} ({dtype_name}) on {env.get('gpu', device)}; torch {env['torch']}, "
              f"transformers {env['transformers']}, git {env['git_sha']}")
        missing = common.missing_kit(env)
        if missing:
            print(f"WARNING: {', '.join(missing)} not installed on this {env.get('capability')} GPU: "
                  "packed variants run without quack GEMMs / FA4 / CuteDSL (check PYTHONPATH)", file=sys.stderr)
        for ep in endpoints:
            ts = workloads.token_set(corpus, ep.set_name)
            idx = workloads.indices(ts, ep.n_seqs, args.seed)
            s = common.workload_stats(ts, idx, ep.batch)
            print(f"  {ep.name} (set {ep.set_name}, batch {ep.batch}, padding {s['padding_fraction']:.0%}) "
                  + format_stats("", s).strip())
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(args.out) / f"{runner}_{label.replace(':', '-')}_{stamp}.jsonl"
        partial = path.with_suffix(".jsonl.partial")  # rows so far, should the run be killed
        command = " ".join([os.path.basename(sys.executable), "-m", module] + sys.argv[1:])
        base = {"runner": runner, "model": label, "dtype": dtype_name, "env": env}
        rows, failed = [], None

        def publish(new_rows):
            for r in new_rows:
                r.update(run_id=f"{label}@{stamp}", command=command)
            common.write_rows(partial, new_rows)
            rows.extend(new_rows)

        for family in families:
            for variant in variants:
                reason = why_skip(variant, device, dtype, config, args.quick, bool(args.variants))
                if reason:
                    publish([{**base, "family": family, "variant": variant, "endpoint": ep.name,
                              "status": "skipped", "reason": reason} for ep in endpoints])
                    print(f"  [{family}/{variant}] skipped: {reason}")
                    continue
                groups = [[ep] for ep in endpoints] if variant in COLD_START_VARIANTS else [endpoints]
                for group in groups:
                    got, rc, tail = _spawn(args, module, work, model_dir, label, family, variant, group,
                                           device, dtype_name)
                    if rc == PARITY_EXIT:
                        failed = (family, variant, tail)
                        break
                    if rc != 0:
                        reason = tail.strip().splitlines()[-1] if tail.strip() else f"exit code {rc}"
                        publish([{**base, "family": family, "variant": variant, "endpoint": ep.name,
                                  "status": "error", "reason": reason, "log_tail": tail[-2000:]} for ep in group])
                        print(f"  [{family}/{variant}] ERROR (exit {rc}): {reason}")
                    publish(got)
                    for r in got:
                        print(f"  [{family}/{variant}] {r['endpoint']}: {r['seqs_per_s_median']:,.1f} seq/s, "
                              f"{r['tokens_per_s_median']:,.0f} tok/s (first pass {r['first_pass_s']:.2f} s)")
                if failed:
                    break
            if failed:
                break
        if failed:
            partial.unlink(missing_ok=True)
            family, variant, tail = failed
            print(f"\nPARITY FAILURE in {family}/{variant}: nothing is published.\n{tail}", file=sys.stderr)
            return PARITY_EXIT
        common.finish_rows(path, partial, rows, t_start)
        print(render.markdown(rows))
        return 0 if all(r.get("status") != "error" for r in rows) else 1  # (the error rows are published)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _spawn(args, module, work, model_dir, label, family, variant, group, device, dtype_name):
    row_out = work / f"rows-{family}-{variant}-{group[0].name}.jsonl"
    argv = [module, "--child", "--variant", variant, "--family", family, "--model-dir", model_dir,
            "--model-label", label, "--row-out", str(row_out), "--endpoint-json",
            json.dumps([asdict(e) for e in group]), "--device", device, "--dtype", dtype_name,
            "--trials", str(args.trials), "--warmup", str(args.warmup), "--seed", str(args.seed),
            "--config", args.config]
    if args.tokens:
        argv += ["--tokens", args.tokens]
    if args.quick:
        argv.append("--quick")
    env = {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{family}-{variant}-{group[0].name}"),
           "TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.cpu_threads)
        argv += ["--cpu-threads", str(args.cpu_threads)]
    rc, tail, secs = common.run_child(argv, args.timeout, env)
    rows = common.read_rows([row_out]) if rc == 0 and row_out.exists() else []
    for r in rows:
        r["process_wall_s"] = round(secs, 1)
    return rows, rc, tail


# ------------------------------------------------------------------------------------------- child

def run_child(args, extra=None) -> int:
    """One (family, variant) in this process, for the endpoints in ``--endpoint-json``; writes rows."""
    import torch

    from benchmarks.models import build_family, config_summary, pad_token_id
    from benchmarks.variants import apply_variant, attention_for, refresh_describe

    device, dtype = args.device, common.dtype_of(args.dtype)
    endpoints = [Endpoint(**e) for e in json.loads(args.endpoint_json)]
    corpus = _load_corpus(args)
    env = common.environment(device)
    torch.set_grad_enabled(False)
    if device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    variant = args.variant
    t0 = time.perf_counter()
    family = build_family(args.family, args.model_dir, attention_for(variant), dtype, device)
    load_s = time.perf_counter() - t0
    pad = pad_token_id(family)
    vocab = family.encoder.config.vocab_size
    plans = []
    for ep in endpoints:
        ts = workloads.token_set(corpus, ep.set_name)
        idx = workloads.indices(ts, ep.n_seqs, args.seed)
        top = int(ts.ids.max())
        if top >= vocab:
            raise SystemExit(f"cached ids reach {top} but the model's vocabulary is {vocab}: re-tokenize with "
                             f"`python -m benchmarks.data --tokenizer PATH`")
        lengths = ts.lengths[idx]
        chunks = common.chunks(idx, ep.batch)
        longest = max(range(len(chunks)), key=lambda i: lengths[i * ep.batch:(i + 1) * ep.batch].max())
        parity_idx = [chunks[0]] + ([chunks[longest]] if longest else [])
        plans.append((ep, ts, idx, parity_idx))

    # stock-HF reference (sdpa) on the parity batches, before the variant touches the model
    ref_family = family if variant != "hf_eager" else build_family(args.family, args.model_dir, "sdpa", dtype,
                                                                  device)
    with torch.inference_mode():
        refs = []
        for _, ts, _, parity_idx in plans:
            out = []
            for chunk in parity_idx:
                b = common.padded_batch([np.asarray(ts[int(i)], dtype=np.int64) for i in chunk], pad, device)
                tokens, pooled = ref_family.padded(b.input_ids, b.attention_mask)
                out += [(t.float().cpu(), p.float().cpu()) for t, p in
                        common.split_padded(tokens, pooled, b.attention_mask)]
            refs.append(out)
    if ref_family is not family:
        del ref_family
        common.reset_memory(device)

    applied = apply_variant(variant, family)
    rows = []
    for (ep, ts, idx, parity_idx), ref in zip(plans, refs):
        batches = common.make_batches(ts, idx, ep.batch, pad, device, applied.packed_inputs)
        n_tokens = int(ts.lengths[idx].sum())
        memory = {}

        def steady_state(memory=memory):  # peak of the warm-up (compile, capture) vs of the timed trials
            memory.update({f"{k.removesuffix('_bytes')}_first_pass_bytes": v
                           for k, v in common.peak_memory(device).items()})
            common.reset_memory(device)

        common.reset_memory(device)
        with torch.inference_mode():
            timing = common.time_trials(applied.step, batches, device, trials=args.trials,
                                        warmup_passes=args.warmup, after_warmup=steady_state)
        memory.update(common.peak_memory(device))
        with torch.inference_mode():
            got = []
            for chunk in parity_idx:  # copy each output out at once: graph replays reuse output buffers
                seqs = [np.asarray(ts[int(i)], dtype=np.int64) for i in chunk]
                if applied.packed_inputs:
                    b = common.packed_inputs(seqs, device)
                    tokens, pooled = applied.step(b)
                    per_text = common.split_packed(tokens, pooled, b.cu_seqlens)
                else:
                    b = common.padded_batch(seqs, pad, device)
                    tokens, pooled = applied.step(b)
                    per_text = common.split_padded(tokens, pooled, b.attention_mask)
                got += [(t.float().cpu(), p.float().cpu()) for t, p in per_text]
            check = common.parity(ref, got, dtype)
        if not check["passed"]:
            print(json.dumps({"parity": check, "family": args.family, "variant": variant, "endpoint": ep.name}),
                  file=sys.stderr)
            return PARITY_EXIT
        refresh_describe(applied, family)
        row = {
            "runner": args.runner, "endpoint": ep.name, "workload": ep.name, "family": args.family,
            "variant": variant,
            "status": "ok", "impl": family.impl, "notes": family.notes, "model": args.model_label,
            "config": config_summary(family.encoder.config), "dtype": args.dtype, "batch": ep.batch,
            "set": ep.set_name, "n_seqs": len(idx), "n_batches": len(batches), "n_tokens": n_tokens,
            "lengths": common.workload_stats(ts, idx, ep.batch), "trials": args.trials, "warmup": args.warmup,
            "load_s": load_s, "setup_s": applied.setup_s, **timing,
            "time_to_first_result_s": applied.setup_s + timing["first_batch_s"],
            **common.throughput(timing, len(idx), n_tokens), **memory, "parity": check, **applied.info,
            "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if extra is not None:
            row.update(extra(args, ep, family, applied, batches) or {})
        rows.append(row)
    common.write_rows(Path(args.row_out), rows)
    return 0


def main(runner: str, module: str, endpoints_fn, description: str, argv=None, extra=None,
         extra_args=None) -> int:
    ap = argparse.ArgumentParser(description=description)
    add_args(ap)
    if extra_args:
        extra_args(ap)
    args = ap.parse_args(argv)
    args.runner = runner
    if args.child:
        return run_child(args, extra)
    return run_parent(args, runner, endpoints_fn(args), module)
