"""Attention backend resolution from host-visible shapes only (so it also holds under CUDA-graph capture).

User-facing names: ``"auto"`` (the policy), ``"flash"`` (the policy restricted to FlashAttention
implementations), ``"sdpa"``, and the concrete ``"varlen"`` (torch), ``"fa4"``, ``"triton"``.
An explicit concrete name that cannot run raises; ``auto`` falls back and reports why.

A :class:`Policy` is data: tables of preference orders over ``max_seqlen`` x ``total_tokens`` buckets, one
table per (grad, window kind[, heads, head_dim]), loaded from JSON (``policies/*.json`` shipped with the
package, or a file written by ``python -m packed_encoders.calibrate``). See ``docs/attention.md``.
"""

from __future__ import annotations

import functools
import json
import os
import re
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ..errors import PackedEncodersError
from ..tuning import CACHE_ENV, POLICY_ENV
from . import fa4_direct
from .backends import BACKENDS, Workload

CHOICES = ("auto", "flash", "sdpa", "varlen", "fa4", "triton")
FLASH_FAMILY = ("fa4", "varlen")
POLICY_FORMAT = "packed_encoders.attention_policy"
POLICY_VERSION = 1
SHIPPED_DIR = Path(__file__).with_name("policies")
# Eager calls of at most this many tokens take FlashAttention-2 before FlashAttention-4's public entry point (where
# fa4_direct does not serve them): its Python planning per call cost more than its GPU time saved there (H200,
# 8 documents of ~926 tokens: 273 seq/s against 375 for stock; indexing batches of ~118k tokens kept FA4).
FA4_PUBLIC_MIN_TOKENS = 32768


@dataclass(frozen=True)
class Cell:
    """Backends to try, best first, for ``total_tokens <= total_tokens_le`` (``None``: no upper bound)."""

    total_tokens_le: int | None
    order: tuple[str, ...]


@dataclass(frozen=True)
class Table:
    """One preference table: rows by ``max_seqlen`` bucket, each row cells by ``total_tokens`` bucket.

    A workload takes the first row with ``max_seqlen <= max_seqlen_le`` and in it the first cell with
    ``total_tokens <= total_tokens_le``; past the last bound, the last row / cell. ``heads`` / ``head_dim``
    ``None`` means any geometry. ``graph``: the table serves only calls captured into CUDA graphs, where a
    backend's host time per call does not count (fitted from ``calibrate --timing graph``); other tables serve
    eager calls, and graph captures too when no graph table matches.
    """

    grad: bool
    window: str  # "global" | "local"
    rows: tuple[tuple[int | None, tuple[Cell, ...]], ...]
    heads: int | None = None
    head_dim: int | None = None
    graph: bool = False

    def order(self, w: Workload) -> tuple[str, ...]:
        cells = next((c for le, c in self.rows if le is None or w.max_seqlen <= le), self.rows[-1][1])
        cell = next((c for c in cells if c.total_tokens_le is None or w.total_tokens <= c.total_tokens_le), cells[-1])
        return cell.order

    def to_dict(self) -> dict:
        return {"grad": self.grad, "window": self.window, "heads": self.heads, "head_dim": self.head_dim,
                **({"graph": True} if self.graph else {}),
                "rows": [{"max_seqlen_le": le, "cells": [{"total_tokens_le": c.total_tokens_le, "order": list(c.order)}
                                                           for c in cells]} for le, cells in self.rows]}

    @classmethod
    def from_dict(cls, d: dict) -> "Table":
        if d.get("window") not in ("global", "local"):
            raise ValueError(f"table window must be 'global' or 'local' (got {d.get('window')!r})")
        rows = []
        for row in d["rows"]:
            cells = tuple(Cell(c.get("total_tokens_le"), tuple(c["order"])) for c in row["cells"])
            if not cells or any(not c.order for c in cells):
                raise ValueError("every policy row needs at least one cell with a non-empty order")
            rows.append((row.get("max_seqlen_le"), cells))
        if not rows:
            raise ValueError("a policy table needs at least one row")
        return cls(bool(d["grad"]), d["window"], tuple(rows), d.get("heads"), d.get("head_dim"),
                   bool(d.get("graph", False)))


def window_kind(window: int | None) -> str:
    return "global" if window is None else "local"


_TABLE_MEMO: dict = {}


@dataclass(frozen=True)
class Policy:
    """Backend preference tables for one card (or one compute capability) and where they came from.

    ``match``: ``{"device_name": str, "capability": [major, minor]}`` for one card,
    ``{"capability": [major, minor]}`` or ``{"capability_major": major}`` for a family default, ``{}`` for any.
    """

    name: str
    tables: tuple[Table, ...]
    match: dict = field(default_factory=dict, hash=False, compare=False)
    meta: dict = field(default_factory=dict, hash=False, compare=False)

    def table_for(self, w: Workload) -> Table | None:
        """The table for ``w``: same grad and window kind, a graph table for a graph capture when there is one
        (else the eager tables), then the closest geometry.

        Training workloads use an inference table when no grad table exists (dispatch then keeps only
        backends with a backward). Memoised per (policy, grad, window kind, graph, geometry): every call resolves
        it once per window, and the search is host time on each.
        """
        key = (id(self), w.grad, w.window is None, w.graph, w.heads, w.head_dim)
        hit = _TABLE_MEMO.get(key)
        if hit is not None and hit[0] is self:
            return hit[1]
        table = self._table_for(w)
        if len(_TABLE_MEMO) > 1024:
            _TABLE_MEMO.clear()
        _TABLE_MEMO[key] = (self, table)
        return table

    def _table_for(self, w: Workload) -> Table | None:
        kind = window_kind(w.window)
        for grad in ((True, False) if w.grad else (False,)):
            same = [t for t in self.tables if t.grad == grad and t.window == kind]
            graph = [t for t in same if t.graph] if w.graph else []
            same = graph or [t for t in same if not t.graph]
            if same:
                return min(same, key=lambda t: _geometry_distance(t, w))
        return None

    def with_graph_tables(self, other: "Policy") -> "Policy":
        """This policy's eager tables plus ``other``'s graph tables, ``meta["graph_tables"]`` saying where those
        came from (``other``'s own ``graph_tables`` entry when it has one, else its meta): how calibration joins
        a graph-timed fit to a policy, or keeps a policy's graph tables across an eager recalibration. ``other``'s
        replace this policy's graph tables of the same kind (inference or training, ``grad``); a kind ``other``
        has none of stays (a graph sweep times inference only: the training-graph tables are kept)."""
        graph = tuple(t for t in other.tables if t.graph)
        if not graph:
            raise ValueError(f"policy {other.name!r} has no graph tables")
        kinds = {t.grad for t in graph}
        source = other.meta.get("graph_tables") or {k: v for k, v in other.meta.items() if k != "graph_tables"}
        meta = dict(self.meta) | {"graph_tables": source}
        kept = tuple(t for t in self.tables if not t.graph or t.grad not in kinds)
        return Policy(self.name, kept + graph, dict(self.match), meta)

    def order(self, w: Workload) -> tuple[str, ...]:
        table = self.table_for(w)
        return table.order(w) if table is not None else ("varlen", "fa4", "sdpa")

    def to_dict(self) -> dict:
        return {"format": POLICY_FORMAT, "version": POLICY_VERSION, "name": self.name, "match": self.match,
                "meta": self.meta, "tables": [t.to_dict() for t in self.tables]}

    @classmethod
    def from_dict(cls, d: dict) -> "Policy":
        if d.get("format") != POLICY_FORMAT:
            raise ValueError(f"not an attention policy (format {d.get('format')!r}, expected {POLICY_FORMAT!r})")
        if d.get("version") != POLICY_VERSION:
            raise ValueError(f"attention policy version {d.get('version')!r} is not {POLICY_VERSION}")
        tables = tuple(Table.from_dict(t) for t in d["tables"])
        return cls(d.get("name", "unnamed"), tables, dict(d.get("match") or {}), dict(d.get("meta") or {}))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Policy":
        """Read a policy JSON file. Raises ``ValueError`` (bad content) or ``OSError``."""
        with open(path) as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not JSON ({exc})") from exc
        try:
            return cls.from_dict(d)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def save(self, path: str | os.PathLike) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(_dumps(self.to_dict()) + "\n")

    def specificity(self, device_name: str, capability: tuple[int, int]) -> int | None:
        """How precisely ``match`` names this device (3 card, 2 capability, 1 major, 0 any); None: no match."""
        m = self.match
        score = 0
        if "device_name" in m:
            if m["device_name"].strip().lower() != device_name.strip().lower():
                return None
            score += 1
        if "capability" in m:
            if tuple(m["capability"]) != tuple(capability):
                return None
            score += 2
        elif "capability_major" in m:
            if int(m["capability_major"]) != capability[0]:
                return None
            score += 1
        return score


def _dumps(d: dict) -> str:
    # indented JSON with each innermost list / cell on one line, so a policy diff reads like a table
    text = json.dumps(d, indent=1)
    text = re.sub(r"\[[^\[\]{}]*\]", lambda m: " ".join(m.group(0).split()).replace("[ ", "[").replace(" ]", "]"), text)
    return re.sub(r"\{[^{}\[\]]*(\[[^\[\]]*\])?[^{}\[\]]*\}",
                  lambda m: " ".join(m.group(0).split()).replace("{ ", "{").replace(" }", "}"), text)


def _geometry_distance(t: Table, w: Workload) -> tuple:
    # exact geometry first, then same head_dim with the nearest head count, then generic tables
    if t.heads is None and t.head_dim is None:
        return (2, 0)
    if t.head_dim == w.head_dim:
        return (0 if t.heads == w.heads else 1, abs((t.heads or w.heads) - w.heads))
    return (3, abs((t.heads or 0) * (t.head_dim or 0) - w.heads * w.head_dim))


def _uniform(order: tuple[str, ...]) -> tuple[Table, ...]:
    return tuple(Table(g, k, ((None, (Cell(None, order),)),)) for g in (False, True) for k in ("global", "local"))


# Used where no policy file matches (CPU, unknown cards): torch varlen_attn, then FA4, then sdpa.
DEFAULT_POLICY = Policy("builtin default (no policy file matched)", _uniform(("varlen", "fa4", "sdpa")))


def cache_dir() -> Path:
    """Where calibrated policies live: ``$PACKED_ENCODERS_CACHE``, else ``$XDG_CACHE_HOME/packed_encoders``,
    else ``~/.cache/packed_encoders``."""
    return _cache_dir(os.environ.get(CACHE_ENV))


def _cache_dir(cache: str | None) -> Path:
    if cache:
        return Path(cache)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "packed_encoders"


def card_slug(device_name: str, capability: tuple[int, int]) -> str:
    """File stem for a card: ``nvidia-h200-sm90``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return f"{slug}-sm{capability[0]}{capability[1]}"


def user_policy_path(device_name: str, capability: tuple[int, int]) -> Path:
    """Where ``python -m packed_encoders.calibrate`` writes the policy of this card by default."""
    return cache_dir() / "policies" / f"{card_slug(device_name, capability)}.json"


def _candidates(directory: Path):
    if directory.is_dir():
        for path in sorted(directory.glob("*.json")):
            try:
                yield path, Policy.load(path)
            except (OSError, ValueError) as exc:
                warnings.warn(f"packed_encoders: ignoring attention policy {path}: {exc}", stacklevel=3)


def select_policy(device_name: str, capability: tuple[int, int], *, user_dir: Path | None = None,
                  shipped_dir: Path = SHIPPED_DIR, explicit: str | None = None) -> Policy:
    """The policy for a card, from its name and compute capability (pure: no CUDA call).

    ``explicit`` (a path, e.g. ``$PACKED_ENCODERS_POLICY``) wins outright, with a warning when its ``match``
    names another card. Otherwise the most specific match (card > capability > major) wins, a user
    calibration beating a shipped file of equal specificity; no match gives :data:`DEFAULT_POLICY`.

    Raises:
        PackedEncodersError: ``explicit`` cannot be read or parsed.
    """
    if explicit:
        try:
            policy = Policy.load(explicit)
        except (OSError, ValueError) as exc:
            raise PackedEncodersError(f"{POLICY_ENV}={explicit}: {exc}") from exc
        if policy.specificity(device_name, capability) is None:
            warnings.warn(f"packed_encoders: {explicit} was fitted for {policy.match}, not {device_name} "
                          f"sm_{capability[0]}{capability[1]}; using it because it was named explicitly", stacklevel=2)
        return policy
    best, best_key = DEFAULT_POLICY, (-1, -1)
    for rank, directory in ((1, user_dir if user_dir is not None else cache_dir() / "policies"), (0, shipped_dir)):
        for _, policy in _candidates(directory):
            spec = policy.specificity(device_name, capability)
            if spec is not None and (spec, rank) > best_key:
                best, best_key = policy, (spec, rank)
    return best


def load_policy(device: torch.device | str | None = None, *, policy_file: str | None = None,
                cache: str | None = None) -> Policy:
    """The attention policy for ``device`` (default: the current CUDA device); CPU gets :data:`DEFAULT_POLICY`.

    Looks at ``policy_file``, then calibrated files under ``cache`` ``/policies`` (``None``:
    ``$XDG_CACHE_HOME/packed_encoders``, else ``~/.cache/packed_encoders``), then the files shipped in
    ``packed_encoders/attention/policies``. ``pack()`` passes ``PACKED_ENCODERS_POLICY`` and
    ``PACKED_ENCODERS_CACHE`` from its frozen ``Tuning``. Reads a few small JSON files: call it at pack time,
    not per batch.
    """
    device = torch.device(device) if device is not None else None
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        if policy_file:  # (describe() shows the policy's name: the file named is not silently dropped)
            return replace(DEFAULT_POLICY, name=f"{DEFAULT_POLICY.name}; {POLICY_ENV}={policy_file} not read: "
                                                f"the policies serve CUDA devices")
        return DEFAULT_POLICY
    name, cap = torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device))
    explicit = policy_file or None
    user_dir = _cache_dir(cache) / "policies"
    # Cached by the files' names and modification times, so a new calibration is picked up by the next pack().
    stamp = tuple(_stamps(Path(explicit)) if explicit else ()) + tuple(_stamps(user_dir)) + tuple(_stamps(SHIPPED_DIR))
    return _select_cached(name, cap, explicit, str(user_dir), stamp)


def _stamps(path: Path):
    files = sorted(path.glob("*.json")) if path.is_dir() else [path]
    for f in files:
        try:
            yield str(f), f.stat().st_mtime_ns
        except OSError:
            yield str(f), None


@functools.lru_cache(maxsize=16)
def _select_cached(name: str, cap: tuple, explicit: str | None, user_dir: str, stamp: tuple) -> Policy:
    return select_policy(name, cap, user_dir=Path(user_dir), explicit=explicit)


@dataclass
class Decision:
    backend: str
    reasons: list[str] = field(default_factory=list)


def cannot_serve(requested: str, *, device_type: str, heads: int, head_dim: int) -> str | None:
    """Why the explicitly named backend ``requested`` can serve no call of a model on ``device_type`` with this
    attention geometry (:meth:`Backend.why_not` of a one-token bf16 inference call: its availability on this
    machine, device and head_dim, the facts no batch changes), or ``None``. ``"flash"``: why no member of
    :data:`FLASH_FAMILY` can; ``"auto"`` always can (``sdpa`` runs anywhere). ``pack()`` asks it so that such a
    name is refused there, not on every call."""
    probe = Workload(num_seqs=1, total_tokens=1, max_seqlen=1, heads=heads, head_dim=head_dim, window=None,
                     grad=False, dtype=torch.bfloat16, device_type=device_type)
    if requested == "flash":
        reasons = [(name, BACKENDS[name].why_not(probe)) for name in FLASH_FAMILY if name in BACKENDS]
        if any(why is None for _, why in reasons):
            return None
        return "no FlashAttention backend can (" + "; ".join(f"{name}: {why}" for name, why in reasons) + ")"
    backend = BACKENDS.get(requested) if requested != "auto" else None
    return None if backend is None else backend.why_not(probe)


def resolve(requested: str, w: Workload, policy: Policy | None = None) -> Decision:
    """Pick the backend for one attention call.

    ``auto`` follows the policy's order for ``w`` (with gradients on, only backends that have a backward),
    skipping backends that cannot run ``w`` and recording why in ``Decision.reasons``; ``sdpa`` is the last
    resort. ``flash`` is the same restricted to :data:`FLASH_FAMILY`.

    Raises:
        PackedEncodersError: an unknown name, an explicit backend that cannot run ``w``, or ``flash`` when
            no FlashAttention backend can.
    """
    if requested not in CHOICES:
        raise PackedEncodersError(f"attention_backend={requested!r} is not one of {CHOICES}")
    if requested not in ("auto", "flash"):
        backend = BACKENDS.get(requested)
        if backend is None:
            raise PackedEncodersError(f"attention backend {requested!r} is not available in this build")
        reason = backend.why_not(w)
        if reason is not None:
            raise PackedEncodersError(f"attention_backend={requested!r} cannot run this batch: {reason}")
        return Decision(requested)
    order = (policy or DEFAULT_POLICY).order(w)
    if w.grad:
        # Training picks among backends with a backward by design: not a fallback worth reporting.
        order = tuple(n for n in order if n not in BACKENDS or BACKENDS[n].has_backward)
    if requested == "flash":
        order = tuple(n for n in order if n in FLASH_FAMILY) + tuple(n for n in FLASH_FAMILY if n not in order)
    if not w.graph and w.total_tokens <= FA4_PUBLIC_MIN_TOKENS and "fa4" in order \
            and "varlen" in order[order.index("fa4"):] and fa4_direct.workload_status(w.num_seqs, w.max_seqlen):
        # the eager tables rank FlashAttention-4 by its direct calls' host cost; through its public entry point
        # (hundreds of us of planning per call) it goes after FlashAttention-2 where that cost is not paid back
        order = tuple(n for n in order if n != "fa4")
        at = order.index("varlen") + 1
        order = order[:at] + ("fa4",) + order[at:]
    reasons = []
    for name in order:
        backend = BACKENDS.get(name)
        reason = "not registered" if backend is None else backend.why_not(w)
        if reason is None:
            return Decision(name, reasons)
        reasons.append(f"{name}: {reason}")
    if requested == "flash":
        raise PackedEncodersError("attention_backend='flash' cannot run this batch: " + "; ".join(reasons))
    return Decision("sdpa", reasons)
