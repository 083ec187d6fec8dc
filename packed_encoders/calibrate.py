"""Calibrate the attention dispatch policy on this machine's GPU.

    python -m packed_encoders.calibrate [--out PATH] [--quick] [--sweep-out PATH]
    python -m packed_encoders.calibrate --from-sweep SWEEP.json --out PATH   # refit only, no GPU needed
    python -m packed_encoders.calibrate --timing graph [--merge BASE.json]    # graph tables, joined to a policy

Sweeps total tokens x max sequence length x geometry (12 x 64 and 16 x 64 heads), global and local (half
window 64) layers, gradients off and on, timing every attention backend that can run here; fits a policy
(:class:`~packed_encoders.attention.dispatch.Policy`) whose pick is within ``--tolerance`` (5%) of the best
backend at every measured point where one table cell can say so, reports the points where it cannot, prints
the crossovers and writes the policy where ``pack()`` finds it (:func:`~packed_encoders.attention.dispatch.
user_policy_path`, or ``--out``; ``PACKED_ENCODERS_POLICY=path`` makes ``pack()`` use any file).

The sweep (:func:`sweep`) and the fit (:func:`fit_policy`, a pure function of the sweep rows) are shared with
``benchmarks/attention.py``.

``--timing graph`` times inference calls as CUDA-graph replays (GPU time only: what a backend costs inside the
captured graphs, where its host time per call does not count) and fits *graph tables*
(:class:`~packed_encoders.attention.dispatch.Table` ``graph=True``), which dispatch uses only when it plans a
graph capture. Those are joined to the eager tables of ``--merge BASE.json`` (default: the file at the output
path if there is one, else the policy ``pack()`` selects for this card), so one file serves both.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from .attention.backends import BACKENDS, Workload
from .attention.dispatch import (DEFAULT_POLICY, POLICY_ENV, Cell, Policy, Table, select_policy, user_policy_path,
                                 window_kind)
from .attention.reference import parity

SWEEP_FORMAT = "packed_encoders.attention_sweep"
WINDOW = 64  # ModernBERT's half window (local_attention 128)


@dataclass(frozen=True)
class Grid:
    total_tokens: tuple[int, ...]
    max_seqlen: tuple[int, ...]
    geometries: tuple[tuple[int, int], ...]  # (heads, head_dim)
    windows: tuple[int | None, ...] = (None, WINDOW)
    grads: tuple[bool, ...] = (False, True)


FULL = Grid((256, 1024, 4096, 16384, 65536, 131072), (32, 64, 128, 256, 512, 1024, 2048), ((12, 64), (16, 64)))
QUICK = Grid((256, 4096, 65536), (64, 128, 512, 2048), ((12, 64),))


# ----------------------------------------------------------------------------------------------- workloads

def lengths_for(total: int, max_len: int, seed: int = 0) -> list[int]:
    """Ragged lengths summing to ``total``, longest exactly ``max_len`` (needs ``total >= max_len``).

    Lognormal around ``max_len / 4`` clipped to ``[1, max_len]`` (queries and documents are both right-skewed),
    shuffled so the longest is not always first. Deterministic for a seed.
    """
    if total < max_len or max_len < 1:
        raise ValueError(f"total {total} must be >= max_len {max_len} >= 1")
    rng = random.Random(seed * 1_000_003 + total * 31 + max_len)
    lens, left = [max_len], total - max_len
    mu = math.log(max(max_len / 4, 1.0))
    while left > 0:
        n = min(left, max(1, min(max_len, round(rng.lognormvariate(mu, 0.8)))))
        lens.append(n)
        left -= n
    rng.shuffle(lens)
    return lens


def make_inputs(lengths: list[int], heads: int, head_dim: int, dtype: torch.dtype, device, *, grad: bool = False,
                seed: int = 0):
    """``q, k, v`` views of one fused ``[T, 3, heads, head_dim]`` tensor (as the model produces them),
    ``cu_seqlens`` int32 and ``max_seqlen``. With ``grad`` the fused tensor is a leaf requiring grad."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = sum(lengths)
    qkv = torch.randn(total, 3, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    if grad:
        qkv.requires_grad_(True)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    q, k, v = qkv.unbind(1)
    if not grad:  # rope produces contiguous q and k; v stays a view of the projection
        q, k = q.contiguous(), k.contiguous()
    return qkv, q, k, v, cu.to(device), max(lengths) if lengths else 0


# ----------------------------------------------------------------------------------------------- timing

def time_ms(fn: Callable[[], object], *, reps: int = 5, rep_ms: float = 1.0, timing: str = "loop") -> float:
    """Median milliseconds per call of ``fn`` on the current CUDA stream.

    ``loop``: back-to-back eager calls between two events (host launch overhead counts when it exceeds the
    GPU time, as in an eager forward); ``graph``: the same calls replayed from a CUDA graph (GPU time only,
    as under the graph runners).
    """
    fn()
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    end.synchronize()
    est = max(start.elapsed_time(end) / 3, 1e-3)
    n = max(1, min(500, math.ceil(rep_ms / est)))
    run = lambda: [fn() for _ in range(n)]  # noqa: E731
    if timing == "graph":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay
    elif timing != "loop":
        raise ValueError(f"timing must be 'loop' or 'graph' (got {timing!r})")
    times = []
    for _ in range(reps):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / n)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------- sweep

def _call(backend: str, q, k, v, cu, max_seqlen, window, scale, config=None):
    if config is not None:
        from .attention.triton_short import triton_short_attention

        return triton_short_attention(q, k, v, cu, max_seqlen, window=window, scale=scale, config=config)
    return BACKENDS[backend].fn(q, k, v, cu, max_seqlen, window=window, scale=scale)


def parity_check(backends: Iterable[str], geometries, windows, dtype=torch.bfloat16, device="cuda") -> dict[str, str]:
    """Forward parity of each backend on ragged lengths across the window edges; ``{backend: failure}``."""
    lengths = [1, 64, 65, 128, 129, 7, 300, 33]
    failures = {}
    for heads, head_dim in geometries:
        _, q, k, v, cu, smax = make_inputs(lengths, heads, head_dim, dtype, device, seed=1)
        scale = head_dim ** -0.5
        for window in windows:
            for name in backends:
                if name in failures:
                    continue
                try:
                    out = _call(name, q, k, v, cu, smax, window, scale)
                    err, allowed = parity(out, q, k, v, cu, window, scale)
                    if not err <= allowed:
                        failures[name] = f"parity {heads}x{head_dim} window={window}: max err {err:.3g} > {allowed:.3g}"
                except Exception as exc:  # a backend that cannot run here is left out, with the reason
                    failures[name] = f"{type(exc).__name__}: {exc}"
    return failures


def runnable(w: Workload) -> list[str]:
    return [name for name, b in BACKENDS.items() if b.why_not(w) is None]


def sweep(grid: Grid = FULL, *, dtype: torch.dtype = torch.bfloat16, timing: str = "loop",
          backends: Iterable[str] | None = None, triton_variants: Iterable[str] = (), beyond_envelope: bool = False,
          log: Callable[[str], None] = print) -> dict:
    """Time every runnable backend at every grid point on the current CUDA device.

    Returns ``{"format", "meta", "rows"}``; a row is one (point, backend): ``grad, window, heads, head_dim,
    dtype, total_tokens, max_seqlen, num_seqs, backend, variant, in_envelope, ms`` (``None`` on error) and
    ``error``. ``triton_variants`` names entries of ``triton_short.VARIANTS`` also timed at inference points
    up to ``triton_short.VARIANT_MAX_SEQLEN``;
    ``beyond_envelope`` also times the Triton kernel past its envelope (rows with ``in_envelope: false``,
    never fitted).
    """
    if not torch.cuda.is_available():
        raise RuntimeError("calibration needs a CUDA GPU")
    device = torch.device("cuda", torch.cuda.current_device())
    wanted = set(backends) if backends is not None else set(BACKENDS)
    failures = parity_check(sorted(wanted & set(BACKENDS)), grid.geometries, grid.windows, dtype, device)
    for name, why in failures.items():
        log(f"[calibrate] leaving out {name}: {why}")
    meta = environment(device) | {"timing": timing, "dtype": str(dtype).replace("torch.", ""),
                                  "grid": {"total_tokens": grid.total_tokens, "max_seqlen": grid.max_seqlen,
                                           "geometries": grid.geometries, "windows": grid.windows,
                                           "grads": grid.grads}, "left_out": failures}
    rows = []
    t0 = time.time()
    for grad in grid.grads:
        for heads, head_dim in grid.geometries:
            for window in grid.windows:
                for smax in grid.max_seqlen:
                    if window is not None and window >= smax - 1:
                        continue  # the forward runs such layers as global
                    for total in grid.total_tokens:
                        if total < smax:
                            continue
                        rows += _sweep_point(grad, heads, head_dim, window, smax, total, dtype, device, timing,
                                             wanted - set(failures), triton_variants, beyond_envelope)
                log(f"[calibrate] grad={grad} {heads}x{head_dim} done ({time.time() - t0:.0f}s)")
    return {"format": SWEEP_FORMAT, "meta": meta, "rows": rows}


def _sweep_point(grad, heads, head_dim, window, smax, total, dtype, device, timing, wanted, variants, beyond):
    from .attention import triton_short

    lengths = lengths_for(total, smax)
    qkv, q, k, v, cu, _ = make_inputs(lengths, heads, head_dim, dtype, device, grad=grad)
    scale = head_dim ** -0.5
    base = {"grad": grad, "window": window, "heads": heads, "head_dim": head_dim,
            "dtype": str(dtype).replace("torch.", ""), "total_tokens": total, "max_seqlen": smax,
            "num_seqs": len(lengths)}
    w = Workload(len(lengths), total, smax, heads, head_dim, window, grad, dtype, device.type)
    names = [n for n in runnable(w) if n in wanted]
    jobs = [(n, None, None, True) for n in names]
    if not grad and "triton" in wanted and triton_short.triton_status() is None:
        inside = triton_short.envelope(w) is None
        if not inside and beyond:
            jobs.append(("triton", None, None, False))
        if inside and smax <= triton_short.VARIANT_MAX_SEQLEN:
            for name in variants:
                cfg = triton_short.VARIANTS[name](smax, head_dim, window is not None)
                jobs.append(("triton", name, cfg, inside))
    out = []
    for name, variant, cfg, inside in jobs:
        row = dict(base, backend=name, variant=variant, in_envelope=inside, ms=None, error=None)
        try:
            if grad:
                dout = torch.randn_like(q)

                def fn():
                    o = _call(name, q, k, v, cu, smax, window, scale)
                    return torch.autograd.grad(o, qkv, dout)
            else:
                def fn():
                    return _call(name, q, k, v, cu, smax, window, scale, cfg)
            with torch.set_grad_enabled(grad):
                row["ms"] = time_ms(fn, timing="loop" if grad else timing)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        out.append(row)
    return out


def dist_version(*dists: str) -> str | None:
    """The installed version of the first of ``dists`` (distribution names) that is installed, else ``None``."""
    import importlib.metadata as md

    for d in dists:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            continue
    return None


def environment(device) -> dict:
    """GPU, driver and library versions for result rows."""
    import subprocess

    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip() or None
        except Exception:
            return None

    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    fa4 = dist_version("flash-attn-4", "flash_attn_4", "flash-attn")
    if fa4 is None:
        try:
            import flash_attn

            fa4 = getattr(flash_attn, "__version__", None)
        except Exception:
            pass
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton_version, "flash_attn": fa4,
           "cutlass_dsl": dist_version("nvidia-cutlass-dsl"), "git_sha": run(["git", "rev-parse", "HEAD"])}
    if device is not None and torch.device(device).type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = list(torch.cuda.get_device_capability(device))
        env["driver"] = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return env


# ----------------------------------------------------------------------------------------------- fit

def _usable(rows: Iterable[dict]) -> list[dict]:
    return [r for r in rows if r.get("ms") is not None and r.get("in_envelope", True)
            and r.get("variant") in (None, "table") and r["backend"] in _known_backends()]


def _known_backends() -> set[str]:
    return set(BACKENDS) | {"sdpa", "varlen", "fa4", "triton"}


def _points(rows: Iterable[dict]) -> dict:
    """``{(grad, kind, heads, head_dim): {(max_seqlen, total_tokens): {backend: ms}}}``."""
    out: dict = {}
    for r in _usable(rows):
        key = (bool(r["grad"]), window_kind(r["window"]), r["heads"], r["head_dim"])
        cell = out.setdefault(key, {}).setdefault((r["max_seqlen"], r["total_tokens"]), {})
        cell[r["backend"]] = min(r["ms"], cell.get(r["backend"], math.inf))
    return out


def _ratios(times: dict[str, float]) -> dict[str, float]:
    best = min(times.values())
    return {b: t / best for b, t in times.items()}


def _fit_rows(grid: dict, tolerance: float) -> tuple:
    """Table rows from ``{(max_seqlen, total_tokens): {backend: worst ratio to the best}}``.

    Along total_tokens, consecutive points share one cell while some backend stays within ``tolerance`` of
    the best at all of them (greedy, so cells are as wide as the data allows); the cell picks the candidate
    with the lowest mean ratio and orders the rest by mean ratio as fallbacks. Adjacent max_seqlen rows with
    the same bounds and picks merge.
    """
    rows = []
    for smax in sorted({s for s, _ in grid}):
        line = [(t, grid[(smax, t)]) for t in sorted(t for s, t in grid if s == smax)]
        segments: list[tuple[set, list]] = []
        for total, ratios in line:
            ok = {b for b, r in ratios.items() if r <= 1 + tolerance} or {min(ratios, key=ratios.get)}
            if segments and segments[-1][0] & ok:
                segments[-1] = (segments[-1][0] & ok, segments[-1][1] + [(total, ratios)])
            else:
                segments.append((ok, [(total, ratios)]))
        cells = []
        for i, (cands, members) in enumerate(segments):
            names = {b for _, r in members for b in r}
            mean = {b: statistics.fmean(r.get(b, math.inf) for _, r in members) for b in names}
            pick = min(cands, key=lambda b: (mean[b], b))
            order = [pick] + sorted((b for b in names if b != pick), key=lambda b: (mean[b], b))
            if "sdpa" not in order:
                order.append("sdpa")  # dependency-free last resort
            cells.append(Cell(None if i == len(segments) - 1 else members[-1][0], tuple(order)))
        rows.append([smax, tuple(cells)])
    merged = []
    for smax, cells in rows:
        sig = tuple((c.total_tokens_le, c.order[0]) for c in cells)
        if merged and merged[-1][2] == sig:
            merged[-1] = [smax, cells, sig]
        else:
            merged.append([smax, cells, sig])
    if merged:
        merged[-1][0] = None
    return tuple((s, c) for s, c, _ in merged)


def fit_policy(rows: Iterable[dict], *, tolerance: float = 0.05, name: str = "calibrated", match: dict | None = None,
               meta: dict | None = None, graph: bool = False) -> tuple[Policy, dict]:
    """Fit a policy from sweep rows (pure: no GPU, no clock). Returns ``(policy, report)``.

    One table per measured (grad, window kind, heads, head_dim), plus a geometry-free table per (grad,
    window kind) for unmeasured geometries (its cells must hold for every measured geometry at once).
    ``report`` is :func:`evaluate` of the fitted policy on the same rows. ``graph``: the inference rows were
    timed as CUDA-graph replays, so their tables are graph tables (``Table.graph``).
    """
    rows = list(rows)
    points = _points(rows)
    tables = []
    for (grad, kind, heads, head_dim), pts in sorted(points.items(), key=lambda kv: str(kv[0])):
        grid = {p: _ratios(t) for p, t in pts.items()}
        tables.append(Table(grad, kind, _fit_rows(grid, tolerance), heads, head_dim, graph and not grad))
    for grad in (False, True):
        for kind in ("global", "local"):
            geos = [pts for (g, k, _, _), pts in points.items() if g == grad and k == kind]
            if len(geos) < 2:
                continue
            combined: dict = {}
            for p in {p for pts in geos for p in pts}:
                here = [_ratios(pts[p]) for pts in geos if p in pts]
                names = {b for r in here for b in r}
                # worst ratio over the geometries; a backend missing at one of them cannot be vouched for
                combined[p] = {b: max(r.get(b, math.inf) for r in here) for b in names}
            tables.append(Table(grad, kind, _fit_rows(combined, tolerance), graph=graph and not grad))
    policy = Policy(name, tuple(tables), dict(match or {}), dict(meta or {}) | {"fitted": True, "tolerance": tolerance})
    report = evaluate(policy, rows, tolerance, graph=graph)
    summary = {k: report[k] for k in ("points", "worst_ratio", "violations")}  # the per-point picks stay out
    policy = Policy(policy.name, policy.tables, policy.match, policy.meta | {"fit_report": summary})
    return policy, report


def evaluate(policy: Policy, rows: Iterable[dict], tolerance: float = 0.05, graph: bool = False) -> dict:
    """The policy's pick against the best measured backend at every measured point.

    The pick is the first backend of the policy's order that was measured at the point (as dispatch skips
    what cannot run). Returns ``{"points", "worst_ratio", "violations": [...], "picks": [...]}`` where a
    violation is a point whose pick is slower than ``(1 + tolerance)`` x the best. ``graph``: the inference
    rows were timed as graph replays, so they are looked up as graph captures.
    """
    picks, violations = [], []
    for (grad, kind, heads, head_dim), pts in sorted(_points(rows).items(), key=lambda kv: str(kv[0])):
        for (smax, total), times in sorted(pts.items()):
            w = Workload(0, total, smax, heads, head_dim, None if kind == "global" else WINDOW, grad, torch.bfloat16,
                         "cuda", graph=graph and not grad)
            order = policy.order(w)
            pick = next((b for b in order if b in times), None)
            best = min(times, key=times.get)
            ratio = math.inf if pick is None else times[pick] / times[best]
            entry = {"grad": grad, "window": kind, "heads": heads, "head_dim": head_dim, "max_seqlen": smax,
                     "total_tokens": total, "pick": pick, "best": best, "ratio": round(ratio, 4)}
            picks.append(entry)
            if ratio > 1 + tolerance:
                violations.append(entry)
    worst = max((p["ratio"] for p in picks), default=1.0)
    return {"points": len(picks), "worst_ratio": worst, "violations": violations, "picks": picks}


# ----------------------------------------------------------------------------------------------- reports

def crossover_markdown(rows: Iterable[dict]) -> str:
    """One markdown table per (grad, window kind, geometry): rows max_seqlen, columns total tokens; each cell
    the fastest backend and how much slower the runner-up is."""
    out = []
    for (grad, kind, heads, head_dim), pts in sorted(_points(rows).items(), key=lambda kv: str(kv[0])):
        totals = sorted({t for _, t in pts})
        out.append(f"\n**{'training (fwd+bwd)' if grad else 'inference (fwd)'}, {kind}"
                   f"{'' if kind == 'global' else f' (window {WINDOW})'}, {heads}x{head_dim}**: fastest backend "
                   "(runner-up / fastest)\n")
        out.append("| max_seqlen \\ total tokens | " + " | ".join(str(t) for t in totals) + " |")
        out.append("|---|" + "---|" * len(totals))
        for smax in sorted({s for s, _ in pts}):
            cells = []
            for t in totals:
                times = pts.get((smax, t))
                if not times:
                    cells.append("")
                    continue
                ranked = sorted(times, key=times.get)
                margin = times[ranked[1]] / times[ranked[0]] if len(ranked) > 1 else math.inf
                cells.append(f"{ranked[0]} {times[ranked[0]]:.3f} ms ({margin:.2f}x)")
            out.append(f"| {smax} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def triton_speedup_markdown(rows: Iterable[dict]) -> str:
    """Inference points inside the Triton envelope: best of varlen/FA4 over Triton (>= 1.3 is the target)."""
    lines = ["| window | geometry | max_seqlen | total tokens | seqs | triton ms | best flash ms | speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    rows = list(rows)
    seqs = {(r["grad"], r["window"], r["heads"], r["head_dim"], r["max_seqlen"], r["total_tokens"]): r["num_seqs"]
            for r in rows}
    for (grad, kind, heads, head_dim), pts in sorted(_points(rows).items(), key=lambda kv: str(kv[0])):
        if grad:
            continue
        for (smax, total), times in sorted(pts.items()):
            flash = [times[b] for b in ("varlen", "fa4") if b in times]
            if "triton" not in times or not flash:
                continue
            n = seqs.get((grad, None if kind == "global" else WINDOW, heads, head_dim, smax, total), "")
            lines.append(f"| {kind} | {heads}x{head_dim} | {smax} | {total} | {n} | {times['triton']:.4f} | "
                         f"{min(flash):.4f} | {min(flash) / times['triton']:.2f}x |")
    return "\n".join(lines)


def report_markdown(report: dict, tolerance: float) -> str:
    lines = [f"policy pick vs best at {report['points']} points: worst {report['worst_ratio']:.3f}x; "
             f"{len(report['violations'])} point(s) over {1 + tolerance:.2f}x"]
    for v in report["violations"]:
        lines.append(f"- grad={v['grad']} {v['window']} {v['heads']}x{v['head_dim']} Smax={v['max_seqlen']} "
                     f"T={v['total_tokens']}: pick {v['pick']} is {v['ratio']:.3f}x {v['best']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- CLI

def policy_from_sweep(data: dict, *, tolerance: float = 0.05) -> tuple[Policy, dict]:
    """Fit the policy of the card a sweep JSON was measured on (name and capability from its meta)."""
    if data.get("format") != SWEEP_FORMAT:
        raise ValueError(f"not an attention sweep (format {data.get('format')!r})")
    meta = data.get("meta", {})
    gpu, cap = meta.get("gpu"), meta.get("capability")
    match = {"device_name": gpu, "capability": cap} if gpu and cap else {}
    keep = {k: meta.get(k) for k in ("date", "torch", "triton", "flash_attn", "cutlass_dsl", "driver", "git_sha",
                                     "timing")}
    return fit_policy(data["rows"], tolerance=tolerance, name=f"{gpu or 'unknown GPU'} (calibrated {meta.get('date')})",
                      match=match, meta={"source": "packed_encoders.calibrate sweep", **keep},
                      graph=meta.get("timing") == "graph")


def _base_policy(merge: str | None, out, gpu: str | None, capability) -> Policy | None:
    """The policy a new fit is joined to: ``merge``, else the file at ``out``, else the policy ``pack()`` would
    select for the card (``$PACKED_ENCODERS_POLICY`` included); ``None`` when that is the built-in default."""
    if merge:
        return Policy.load(merge)
    if out is not None and Path(out).exists():
        return Policy.load(out)
    base = select_policy(gpu or "", tuple(capability or (0, 0)), explicit=os.environ.get(POLICY_ENV) or None)
    return None if base is DEFAULT_POLICY else base


def _join(fitted: Policy, base: Policy | None, graph_timed: bool) -> tuple[Policy, str | None]:
    """``(policy to write, what was joined)``. A graph-timed fit keeps ``base``'s eager tables and replaces its
    inference graph tables (:meth:`Policy.with_graph_tables`: ``base``'s training-graph tables stay); an eager fit
    keeps ``base``'s graph tables (a recalibration must not drop them). The card ``match`` and name are the fit's:
    the graph tables were measured on that card."""
    if graph_timed:
        if not any(t.graph for t in fitted.tables):
            raise ValueError("the graph-timed sweep has no inference rows: no graph table to fit")
        if base is None:
            return fitted, None
        joined = base.with_graph_tables(fitted)
        training = sum(t.graph and t.grad for t in joined.tables)
        return Policy(fitted.name, joined.tables, fitted.match or base.match, joined.meta), \
            f"graph tables joined to the eager tables of {base.name!r}" + (
                f" (its {training} training-graph tables kept)" if training else "")
    if base is None or not any(t.graph for t in base.tables):
        return fitted, None
    return fitted.with_graph_tables(base), f"kept the graph tables of {base.name!r}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m packed_encoders.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="policy file to write (default: the per-card cache path pack() reads)")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (12x64 only, fewer sizes)")
    ap.add_argument("--from-sweep", metavar="SWEEP_JSON", help="fit from an existing sweep instead of measuring")
    ap.add_argument("--sweep-out", metavar="PATH", help="also write the raw sweep rows here")
    ap.add_argument("--tolerance", type=float, default=0.05)
    ap.add_argument("--timing", choices=("loop", "graph"), default="loop",
                    help="loop: eager back-to-back calls (default); graph: CUDA-graph replay of inference calls "
                         "only, fitted as graph tables and joined to the eager tables of --merge")
    ap.add_argument("--merge", metavar="BASE_JSON",
                    help="the policy the fit joins: a graph-timed fit keeps its eager tables, an eager fit its "
                         "graph tables (default: the file at the output path if it exists, else the policy "
                         "pack() selects for this card)")
    args = ap.parse_args(argv)

    out = args.out
    if args.from_sweep:
        try:
            with open(args.from_sweep) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("format") != SWEEP_FORMAT:
                raise ValueError(f"not an attention sweep this module wrote (format {SWEEP_FORMAT!r})")
        except (OSError, ValueError) as exc:
            print(f"calibrate: --from-sweep {args.from_sweep}: {exc}", file=sys.stderr)
            return 2
        base = None
    else:
        if not torch.cuda.is_available():
            print("calibrate: measuring needs a CUDA GPU (torch.cuda.is_available() is False); --from-sweep "
                  "fits a policy from a saved sweep on any machine", file=sys.stderr)
            return 2
        device = torch.cuda.current_device()
        gpu = torch.cuda.get_device_name(device)
        cap = torch.cuda.get_device_capability(device)
        if out is None:
            out = user_policy_path(gpu, tuple(cap))
        base = _base_policy(args.merge, out, gpu, cap)  # read before the sweep: a bad file fails in seconds
        grid = QUICK if args.quick else FULL
        if args.timing == "graph":  # inference points only: the base's training-graph tables are kept (_join)
            grid = Grid(grid.total_tokens, grid.max_seqlen, grid.geometries, grid.windows, (False,))
        data = sweep(grid, timing=args.timing, log=lambda s: print(s, file=sys.stderr))
        if args.sweep_out:
            with open(args.sweep_out, "w") as f:
                json.dump(data, f)
    meta = data.get("meta", {})
    policy, report = policy_from_sweep(data, tolerance=args.tolerance)
    print(crossover_markdown(data["rows"]))
    print()
    print(report_markdown(report, args.tolerance))
    if out is None:
        if not meta.get("gpu"):
            print("no GPU named in the sweep: pass --out", file=sys.stderr)
            return 2
        out = user_policy_path(meta["gpu"], tuple(meta["capability"]))
    if args.from_sweep:
        base = _base_policy(args.merge, out, meta.get("gpu"), meta.get("capability"))
    try:
        policy, joined = _join(policy, base, meta.get("timing") == "graph")
    except ValueError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    if joined:
        print(joined)
    policy.save(out)
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
