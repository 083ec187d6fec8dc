"""Shared benchmark machinery: environment row, variants of another tree's package (``NAME@DIR``), timing, memory,
parity gate, batching, result rows.

Units: times in seconds unless a key says ``_ms``; memory in bytes (``_gib`` keys are GiB); throughput in
sequences/s and real (non-pad) tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` as well as `python -m benchmarks.x`
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------------ arguments

def at_least(low: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer ``>= low`` (argparse names the option in its error)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}")
        return value
    return parse


DTYPES = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")


def device_of(name: str | None) -> str:
    """``--device`` (``None``: cuda when available, else cpu), refused here when torch cannot parse it or it names
    CUDA on a machine without, rather than in every child."""
    device = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.device(device)
    except RuntimeError as exc:
        raise SystemExit(f"--device {device}: {exc}") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda but CUDA is not available")
    return device


# ------------------------------------------------------------------------------------ environment

def git_sha(tree=None) -> str | None:
    """``git rev-parse`` of the checkout ``tree`` (default: this one; ``-dirty`` if tracked files changed), or
    ``None``; for this checkout ``$PE_GIT_SHA`` overrides it where the tree was copied without ``.git``."""
    if tree is None and os.environ.get("PE_GIT_SHA"):
        return os.environ["PE_GIT_SHA"]
    cwd = ROOT if tree is None else tree
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=cwd, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha + ("-dirty" if dirty else "")) if sha else None
    except (OSError, subprocess.SubprocessError):
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str) -> dict:
    """Versions and hardware of this run (one dict, repeated in every result row)."""
    # imported here: importing this module must leave packed_encoders unimported (see code_tree_first)
    from packed_encoders.calibrate import dist_version

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": dist_version("transformers"),
        "sentence_transformers": dist_version("sentence-transformers"),
        "pylate": dist_version("pylate"),
        "triton": dist_version("triton", "pytorch-triton"),
        "cutlass_dsl": dist_version("nvidia-cutlass-dsl"),
        "fa4": dist_version("flash-attn-4", "flash-attn-cute", "flash_attn_cute", "flash-attn", "flash_attn"),
        "quack": dist_version("quack-kernels", "quack"),
        "packed_encoders": dist_version("packed-encoders") or _module_version("packed_encoders"),
        "git_sha": git_sha(),
        "device": device,
        "cpu": platform.processor() or platform.machine(),
        "host_cpus": os.cpu_count(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        idx = torch.device(device).index or 0
        env["gpu"] = torch.cuda.get_device_name(idx)
        env["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(idx)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(idx).total_memory / 2**30, 1)
        env["driver"] = _driver()
    return env


KIT = ("cutlass_dsl", "fa4", "quack")


def missing_kit(env: dict) -> tuple[str, ...]:
    """The parts of the CuteDSL / FA4 kit (``KIT``) an sm_90+ GPU run lacks; empty on CPU and older GPUs.

    Without them ``pe.pack`` still runs (Triton kernels, cuBLAS, varlen attention) but slower: a documents run
    whose ``PYTHONPATH`` lost the kit measured 1,442 seq/s against 1,731 with it (H200, tenth session). Rows say so
    rather than pass for kit numbers."""
    cap = env.get("capability") or ""
    if not cap.startswith("sm_") or int(cap[3:] or 0) < 90:
        return ()
    return tuple(k for k in KIT if not env.get(k))


def _module_version(name: str) -> str | None:
    try:
        return getattr(__import__(name), "__version__", None)
    except Exception:  # noqa: BLE001
        return None


# ------------------------------------------------------------------------ another tree's package (NAME@DIR)

def code_tree_first(argv: list[str]) -> None:
    """Put the tree ``DIR`` of ``--code DIR`` in ``argv`` (a ``NAME@DIR`` variant's child process) first on
    ``sys.path``; without ``--code`` nothing changes.

    A harness calls it at the top of its module, before anything imports ``packed_encoders``: a package cannot be
    swapped once imported, which is why importing this module leaves it unimported."""
    if "--code" in argv[:-1]:
        sys.path.insert(0, str(Path(argv[argv.index("--code") + 1]).resolve()))


def parse_variant(spec: str, names) -> tuple[str, str, str | None]:
    """``(spec, NAME, DIR or None)`` of a variant spec ``NAME`` or ``NAME@DIR``, ``NAME`` one of ``names``, ``DIR``
    resolved to an absolute path.

    Raises:
        SystemExit: naming the spec, for a ``NAME`` not in ``names`` or a ``DIR`` without a
            ``packed_encoders/__init__.py``.
    """
    spec = spec.strip()
    name, at, code = spec.partition("@")
    if name not in names:
        raise SystemExit(f"unknown variant {name!r} in {spec!r}; choose from {', '.join(names)}")
    if at and not (Path(code) / "packed_encoders" / "__init__.py").is_file():
        raise SystemExit(f"{spec!r}: {code} holds no packed_encoders package")
    return spec, name, (str(Path(code).resolve()) if at else None)


def import_package(code: str | None):
    """``packed_encoders``; with ``code`` (a ``NAME@DIR`` child's ``DIR``) checked to come from that tree.

    Raises:
        SystemExit: naming both paths, when the package was imported from elsewhere (``code_tree_first`` ran too
            late, or not at all).
    """
    import packed_encoders as pe

    if code and not Path(pe.__file__).resolve().is_relative_to(Path(code).resolve()):
        raise SystemExit(f"packed_encoders came from {pe.__file__}, not from {code}")
    return pe


def code_fields(code: str | None, package) -> dict:
    """What a row records of the tree it ran: nothing for this checkout's package; for a ``NAME@DIR`` child
    ``code_dir`` (``DIR``, absolute) and ``package_file`` (the ``__init__.py`` the child imported)."""
    if not code:
        return {}
    return {"code_dir": str(Path(code).resolve()), "package_file": package.__file__}


def file_name(spec: str) -> str:
    """``spec`` (a ``NAME@DIR`` variant names a path) as one file or folder name: ``-_.`` and alphanumerics kept,
    anything else ``_``."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in spec)


# ------------------------------------------------------------------------------------------ timing

def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def device_work(events) -> list:
    """The profiler's device events that are GPU work (kernels, memcpys, memsets): not the GPU-timeline spans of
    user annotations (``record_function`` ranges such as ``Optimizer.step#AdamW.step``), which overlap the kernels
    they enclose."""
    from torch.autograd import DeviceType

    ranges = {e.name for e in events if e.device_type == DeviceType.CPU and getattr(e, "is_user_annotation", False)}
    return [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
            and e.name not in ranges]


def device_idle(device_events, step_starts: Sequence[float], top: int = 10, min_gap_us: float = 20.0) -> dict:
    """Where the GPU waits inside profiled steps: ``{"gpu_idle_ms_per_step", "idle_gaps"}``.

    ``device_events``: :func:`device_work`'s events (``name``, ``time_range.start`` / ``.end`` in us);
    ``step_starts``: each profiled step's start on the profiler's clock (us, ascending). A device event belongs to
    the last step started before it; a step's idle is its device span (first start to last end) less the time any
    of its events runs. ``idle_gaps``: the ``top`` places by idle time, each gap of at least ``min_gap_us`` named by
    the device events on either side (``before -> after``, names cut to 60 characters), with its ms and count per
    step. Under the profiler the host is slower than without it, so the gaps are larger than in an unprofiled step.
    """
    n = max(len(step_starts), 1)
    per_step: list[list] = [[] for _ in range(n)]
    for e in sorted(device_events, key=lambda e: e.time_range.start):
        i = sum(1 for s in step_starts[1:] if s <= e.time_range.start)
        per_step[i].append(e)
    idle_us, places = 0.0, {}
    for events in per_step:
        if not events:
            continue
        end, prev = events[0].time_range.start, None
        for e in events:
            start, stop = e.time_range.start, e.time_range.end
            if start > end:
                idle_us += start - end
                if start - end >= min_gap_us and prev is not None:
                    key = f"{prev.name[:60]} -> {e.name[:60]}"
                    place = places.setdefault(key, [0.0, 0])
                    place[0] += start - end
                    place[1] += 1
            if stop >= end:
                end, prev = stop, e
    ranked = sorted(places.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_idle_ms_per_step": idle_us / 1e3 / n,
            "idle_gaps": [{"place": k, "ms": round(us / 1e3 / n, 3), "count": round(c / n, 1)}
                          for k, (us, c) in ranked]}


def timed_pass(step: Callable, batches: Sequence, device: str) -> float:
    """Seconds for one pass of ``step`` over ``batches`` (CUDA events on GPU, perf_counter on CPU)."""
    synchronize(device)
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for b in batches:
            step(b)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    for b in batches:
        step(b)
    return time.perf_counter() - t0


def time_trials(step: Callable, batches: Sequence, device: str, *, trials: int = 5, warmup_passes: int = 1,
                after_warmup: Callable[[], None] | None = None) -> dict:
    """Warm up (the first pass is reported), call ``after_warmup``, then time ``trials`` passes.

    Returns:
        ``first_batch_s`` (latency of the very first call, compile/capture included), ``first_pass_s`` (the
        first full pass: every batch shape seen once), ``trial_s`` (list), ``median_s``, ``min_s``, ``max_s``.
    """
    synchronize(device)
    t0 = time.perf_counter()
    step(batches[0])
    synchronize(device)
    first_batch = time.perf_counter() - t0
    first_pass = first_batch + timed_pass(step, batches[1:], device)
    for _ in range(max(warmup_passes - 1, 0)):
        timed_pass(step, batches, device)
    if after_warmup is not None:
        after_warmup()
    times = [timed_pass(step, batches, device) for _ in range(trials)]
    return {"first_batch_s": first_batch, "first_pass_s": first_pass, "trial_s": times,
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def throughput(timing: dict, n_seqs: int, n_tokens: int) -> dict:
    """Sequences/s and tokens/s at the median, best (min time) and worst (max time) trial."""
    out = {}
    for key, t in (("median", timing["median_s"]), ("best", timing["min_s"]), ("worst", timing["max_s"])):
        out[f"seqs_per_s_{key}"] = n_seqs / t
        out[f"tokens_per_s_{key}"] = n_tokens / t
    return out


# ------------------------------------------------------------------------------------------ memory

def reset_memory(device: str) -> None:
    """Release cached blocks and start peak tracking from here (CUDA only)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory(device: str) -> dict:
    """Peak reserved / allocated bytes since :func:`reset_memory` (empty on CPU)."""
    if not device.startswith("cuda"):
        return {}
    return {"peak_reserved_bytes": torch.cuda.max_memory_reserved(),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated()}


# -------------------------------------------------------------------------------------------- data

def sample_indices(n_total: int, n: int, seed: int = 0) -> np.ndarray:
    """``n`` distinct sequence indices drawn with a fixed seed (same workload for every variant)."""
    rng = np.random.default_rng(seed)
    return rng.choice(n_total, size=min(n, n_total), replace=False)


@dataclass
class PaddedBatch:
    """Right-padded ``input_ids`` / ``attention_mask`` ``[B, S]`` on the device (S = longest in batch)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    n_tokens: int

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())


@dataclass
class PackedInputs:
    """A padding-free batch as a collator would emit it, on the device.

    ``input_ids`` int64 ``[T]``, ``cu_seqlens`` int32 ``[N + 1]``, ``max_seqlen`` host int,
    ``position_ids`` int64 ``[T]`` (restarting at 0), ``seq_index`` int64 ``[T]`` (sequence of each token,
    for pooling), ``lengths`` int ``[N]`` on the device (as the pooling divisor).
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    seq_index: torch.Tensor
    lengths: torch.Tensor
    n_tokens: int


def chunks(indices: np.ndarray, batch: int) -> list[np.ndarray]:
    return [indices[i:i + batch] for i in range(0, len(indices), batch)]


def padded_batch(seqs: list[np.ndarray], pad_id: int, device: str) -> PaddedBatch:
    """Dynamic padding to the longest sequence of the batch, as HF / sentence-transformers collators do."""
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for row, s in enumerate(seqs):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    return PaddedBatch(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device),
                       int(sum(len(s) for s in seqs)))


def packed_inputs(seqs: list[np.ndarray], device: str) -> PackedInputs:
    """A padding-free collator: concatenate, cumulative lengths, restarting positions (all host-side)."""
    lengths = np.array([len(s) for s in seqs], dtype=np.int64)
    cu = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    ids = np.concatenate(seqs).astype(np.int64)
    pos = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1].astype(np.int64), lengths)
    seq_index = np.repeat(np.arange(len(seqs), dtype=np.int64), lengths)
    t = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return PackedInputs(t(ids), t(cu), int(lengths.max()), t(pos), t(seq_index), t(lengths), int(cu[-1]))


def make_batches(token_set, indices: np.ndarray, batch: int, pad_id: int, device: str, packed: bool) -> list:
    """Batches of ``batch`` sequences of ``token_set`` in ``indices`` order, padded or packed."""
    out = []
    for idx in chunks(indices, batch):
        seqs = [np.asarray(token_set[int(i)], dtype=np.int64) for i in idx]
        out.append(packed_inputs(seqs, device) if packed else padded_batch(seqs, pad_id, device))
    return out


def workload_stats(token_set, indices: np.ndarray, batch: int) -> dict:
    """Lengths of the timed sequences and how much a padded batch pays for padding."""
    from benchmarks.data import length_stats

    lengths = token_set.lengths[indices]
    padded = sum(len(c) * int(c.max()) for c in chunks(lengths, batch))
    stats = length_stats(lengths)
    stats["padded_tokens"] = int(padded)
    stats["padding_fraction"] = round(1 - stats["tokens"] / padded, 4) if padded else 0.0
    return stats


# ------------------------------------------------------------------------------------------ parity

# Thresholds: bf16/fp16 as in packed_encoders.validation (per-token min 0.995, mean 0.999), pooled per text
# min 0.999; fp32 much tighter.
THRESHOLDS = {
    "low": {"token_cos_min": 0.995, "token_cos_mean": 0.999, "pooled_cos_min": 0.999},
    "fp32": {"token_cos_min": 0.9999, "token_cos_mean": 0.99999, "pooled_cos_min": 0.9999},
}


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12)


def parity(ref: list[tuple[torch.Tensor, torch.Tensor]], got: list[tuple[torch.Tensor, torch.Tensor]],
           dtype: torch.dtype) -> dict:
    """Compare per-text outputs: lists of ``(tokens [L, D], pooled [D])`` for the same texts.

    Returns per-token cosine min/mean over every real token, per-text pooled cosine min, the thresholds and
    ``passed``.
    """
    tok = torch.cat([_cos(r[0], g[0]) for r, g in zip(ref, got)])
    pooled = torch.stack([_cos(r[1], g[1]) for r, g in zip(ref, got)])
    th = THRESHOLDS["fp32" if dtype == torch.float32 else "low"]
    res = {"texts": len(ref), "tokens": int(tok.numel()), "token_cos_min": float(tok.min()),
           "token_cos_mean": float(tok.mean()), "pooled_cos_min": float(pooled.min()), "thresholds": th}
    res["passed"] = bool(res["token_cos_min"] >= th["token_cos_min"] and res["token_cos_mean"] >=
                         th["token_cos_mean"] and res["pooled_cos_min"] >= th["pooled_cos_min"])
    return res


def split_padded(tokens: torch.Tensor, pooled: torch.Tensor | None, mask: torch.Tensor) -> list:
    """``[B, S, D]`` (+ ``[B, D]``) -> per text ``(tokens [L, D], pooled [D])``; mean-pools when needed."""
    out = []
    for row in range(tokens.shape[0]):
        real = tokens[row][mask[row].bool()]
        out.append((real, pooled[row] if pooled is not None else real.float().mean(0)))
    return out


def split_packed(tokens: torch.Tensor, pooled: torch.Tensor | None, cu_seqlens: torch.Tensor) -> list:
    """``[T, D]`` (+ ``[N, D]``) -> per text ``(tokens [L, D], pooled [D])``."""
    cu = cu_seqlens.tolist()
    out = []
    for s in range(len(cu) - 1):
        real = tokens[cu[s]:cu[s + 1]]
        out.append((real, pooled[s] if pooled is not None else real.float().mean(0)))
    return out


def segment_mean(x: torch.Tensor, seq_index: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Mean of ``x [T, D]`` per sequence -> ``[N, D]`` (mean pooling on a packed batch)."""
    out = x.new_zeros((lengths.numel(), x.shape[-1]), dtype=torch.float32)
    out.index_add_(0, seq_index, x.float())
    return (out / lengths[:, None]).to(x.dtype)


# ------------------------------------------------------------------------------------------- rows

def dtype_of(name: str) -> torch.dtype:
    """A :data:`DTYPES` name's dtype."""
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
            "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}[name]


def default_dtype(device: str) -> str:
    return "bf16" if device.startswith("cuda") else "fp32"


def write_rows(path: Path, rows: list[dict]) -> None:
    """Append rows to a JSON-lines file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")


def finish_rows(path: Path, partial: Path, rows: list[dict], t_start: float) -> None:
    """Stamp ``rows`` with the run's wall time (s since ``t_start``) and write them to ``path`` in place of the
    ``partial`` file the runner appended to as it went."""
    wall = time.perf_counter() - t_start
    for r in rows:
        r["run_wall_s"] = round(wall, 1)
    partial.unlink(missing_ok=True)
    write_rows(path, rows)
    print(f"\n{len(rows)} rows -> {path} ({wall:.0f} s)\n")


def read_rows(paths) -> list[dict]:
    rows = []
    for p in paths:
        for line in Path(p).read_text(encoding="utf-8").splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def run_child(argv: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``python -m <argv>`` from the repository root; returns ``(returncode, output, seconds)``: the child's
    whole stdout (where children print their result lines) followed by the last 4,000 characters of its stderr
    (compilers' warnings there can be long enough to push a result line out of a shared tail)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout, env={**os.environ, **(env or {})})
        out, rc = p.stdout + "\n" + p.stderr[-4000:], p.returncode
    except subprocess.TimeoutExpired as exc:
        out = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or ""))
        out += f"\n[timeout after {timeout:.0f} s]"
        rc = 124
    return rc, out, time.perf_counter() - t0
