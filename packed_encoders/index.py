"""Sharded corpus indexing with a packed model, on ``torch.distributed`` (one process per GPU under ``torchrun``).

    torchrun --nproc-per-node 8 -m packed_encoders.index --model PATH --corpus corpus.jsonl --out DIR
    python -m packed_encoders.index --model PATH --corpus corpus.jsonl --out DIR        # one process

Corpus: JSON lines of pre-tokenized items, ``{"id": <str or int>, "input_ids": [int, ...]}`` (ids unique; special
tokens included as the model expects them). The corpus is cut, in file order, into chunks of at most
``chunk_tokens`` tokens; chunks are the unit of work and of resumption, and are dealt to ranks as contiguous runs
balanced **by tokens** (not by item count). Inside a chunk, items are sorted by length and encoded in batches of at
most ``batch_tokens`` real tokens, with no padding (``pe.packed_forward``) for a bare ModernBERT encoder.

Output in ``DIR``:
    plan.json                      the corpus (path, size, mtime, SHA-256), the settings that shape the vectors (output,
                                   pooling, dtype, pad id, a fingerprint of the model), chunk boundaries
    chunks/chunk-000012.pt         per chunk: ``{"ids": [...], "embeddings": [n, D]}`` (pooled) or
                                   ``{"ids": [...], "embeddings": [T, D], "cu_seqlens": int64 [n + 1]}`` (tokens)
    chunks/chunk-000012.done       completion marker, JSON, renamed into place after the chunk file: the chunk's
                                   index, rows and tokens, the plan's fingerprint (``plan``), the file's ``bytes``
                                   and ``sha256`` (hex, of the bytes just written; the value ``sha256sum`` prints),
                                   the rank, world size and seconds it took
    manifest.json                  written by rank 0 when every chunk is done: chunks (file, rows, tokens, first
                                   item, bytes, sha256), the plan's fingerprint (``plan``), items, tokens, dim,
                                   dtype; removed when a new plan is written
Rows keep corpus order within a chunk, and chunks are numbered in corpus order.

A run killed at any point resumes by running the same command again (any number of ranks): a chunk is kept when its
marker is in place, was written under the same plan (it records :func:`plan_fingerprint`, a digest of the plan's
corpus size, mtime and SHA-256, chunking, output and settings), describes the plan's chunk (index, rows and tokens)
and its file has the marker's size and SHA-256 (each rank hashes the finished chunks it owns in this run, one
streamed read per file); the rest are encoded, among them a chunk written halfway, and, with a warning, a chunk
whose file is missing or whose size or digest differ (damaged or replaced since, even at the same size), one whose
marker describes another chunk (a file and marker copied over it) and one whose marker was written under another
plan (``plan.json`` deleted and written again for another model or settings, or chunks copied from another index). A
marker without a ``sha256``, chunk index or plan fingerprint (written by an older version) is not trusted: its chunk
is encoded again, with a warning. Rank 0 then checks every marker and file size (not the digests again) and copies
the digests into the manifest. A run with another corpus (size, modification time or, read again by rank 0, SHA-256:
a file rewritten at the same size with its old modification time put back), chunking, output, pooling, output dtype,
pad id or model (other weights, dtype, class, module pipeline or forward-shaping config) than ``plan.json`` records
is refused rather than mixing two indexes in one directory; a corpus changed while a run reads it is refused too,
and so are ranks started with different corpora, models or options (every rank raises, naming the difference) and a
rank that does not share rank 0's output directory (another directory, one not on a file system all ranks share, or
a copy of it: rank 0 makes a marker file per run there, which every rank must see). A deleted ``plan.json`` is
written again by the next run (which keeps the chunks made under the same plan); a damaged ``plan.json`` or
``manifest.json`` is refused, naming the file and the way out.

:func:`load_index` reads the result back, checks that the manifest was written under ``plan.json`` as it is,
checks each chunk file against the manifest's size and SHA-256 as it reads it (a manifest without digests, from an
older version, is loaded unchecked with a warning) and checks that
every chunk holds the plan's items for it (naming the chunk files that do not) and every corpus id appears
exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .adapters.fsdp import sharded
from .errors import PackedEncodersError
from .pooling import mean_pool

PLAN = "plan.json"
MANIFEST = "manifest.json"
# an empty file rank 0 makes in the output directory for each distributed run (removed once every rank looked):
# a rank that does not see it was given another directory, or one not shared with rank 0
MARKER_PREFIX = ".rank0-"
MARKER_WAIT_S = 10.0
OUTPUTS = ("pooled", "tokens")
POOLINGS = ("mean", "cls")
# what a completion marker records beyond its sizes; a marker without them (an older version's) is not trusted
MARKER_KEYS = ("index", "plan", "sha256")
# the plan's entries a chunk's vectors depend on: a marker records their digest (plan_fingerprint), and a chunk made
# under another plan is not reused (the corpus path is left out: a renamed corpus resumes)
PLAN_FINGERPRINT = ("corpus_bytes", "corpus_mtime_ns", "corpus_sha256", "chunk_tokens", "output", "settings",
                    "chunks")
# what a plan.json must hold (a damaged one is refused, naming the file)
# (an older version's plan has no corpus_sha256: its index loads, and a resumed run encodes its chunks again, their
# markers recording another plan fingerprint)
PLAN_KEYS = ("corpus", "corpus_bytes", "corpus_mtime_ns", "chunk_tokens", "output", "items", "tokens", "offsets",
             "lengths", "ids", "chunks")
# config fields that change a ModernBERT's vectors for the same weights (model_fingerprint records them)
FORWARD_CONFIG = ("hidden_activation", "norm_eps", "norm_bias", "attention_bias", "mlp_bias", "num_attention_heads",
                  "local_attention", "global_attn_every_n_layers", "global_rope_theta", "local_rope_theta",
                  "layer_types", "rope_parameters", "rope_scaling")


@dataclass(frozen=True)
class Chunk:
    index: int
    start: int  # first item (line) of the chunk
    stop: int
    tokens: int
    rank: int  # the rank that encodes it in this run


def _dist():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist, dist.get_rank(), dist.get_world_size()
    return None, 0, 1


def scan_corpus(path: str, vocab_size: int | None = None, hasher=None) -> tuple[list[int], list[int], list]:
    """``(offsets, lengths, ids)`` of every line of a JSONL corpus (byte offset, token count, item id); ``hasher``
    (a ``hashlib`` object), when given, is fed every byte of the file as it is read.

    Raises:
        PackedEncodersError: naming the file and line: a line that is not a JSON object, one without ``id`` /
            ``input_ids``, an empty item, ``input_ids`` that are not integers or (``vocab_size`` given) outside
            ``[0, vocab_size)``, or a duplicate id.
    """
    offsets, lengths, ids, seen = [], [], [], set()
    with open(path, "rb") as f:
        offset = 0
        for number, line in enumerate(f, 1):
            if hasher is not None:
                hasher.update(line)
            if line.strip():
                try:
                    item = json.loads(line)
                except ValueError as exc:  # (json.JSONDecodeError, UnicodeDecodeError)
                    raise PackedEncodersError(f"{path}:{number}: not a JSON line ({exc})") from None
                if not isinstance(item, dict) or "id" not in item or "input_ids" not in item:
                    raise PackedEncodersError(f"{path}:{number}: each line needs 'id' and 'input_ids'")
                if type(item["id"]) not in (str, int):
                    raise PackedEncodersError(f"{path}:{number}: the id {item['id']!r} is not a string or an integer")
                tokens = item["input_ids"]
                if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                    raise PackedEncodersError(f"{path}:{number}: item {item['id']!r}: input_ids must be a list of "
                                              "integers")
                if not tokens:
                    raise PackedEncodersError(f"{path}:{number}: item {item['id']!r} has no tokens")
                lo, hi = min(tokens), max(tokens)
                if lo < 0 or (vocab_size is not None and hi >= vocab_size):
                    raise PackedEncodersError(f"{path}:{number}: item {item['id']!r}: token id {lo if lo < 0 else hi} "
                                              f"is outside the model's vocabulary [0, {vocab_size or 'vocab_size'})")
                if item["id"] in seen:
                    raise PackedEncodersError(f"{path}:{number}: duplicate id {item['id']!r}")
                seen.add(item["id"])
                offsets.append(offset)
                lengths.append(len(item["input_ids"]))
                ids.append(item["id"])
            offset += len(line)
    if not ids:
        raise PackedEncodersError(f"{path}: no items (an index of nothing)")
    return offsets, lengths, ids


def plan_chunks(lengths: list[int], chunk_tokens: int, world: int) -> list[Chunk]:
    """Cut items (in order) into chunks of at most ``chunk_tokens`` tokens (an item longer than that is a chunk of
    its own) and deal them to ``world`` ranks as contiguous runs of about equal token counts: a chunk goes to the
    rank whose token range holds the chunk's middle token."""
    bounds, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if tokens and tokens + n > chunk_tokens:
            bounds.append((start, i, tokens))
            start, tokens = i, 0
        tokens += n
    if tokens:
        bounds.append((start, len(lengths), tokens))
    total = sum(lengths)
    chunks, before = [], 0
    for index, (a, b, n) in enumerate(bounds):
        rank = min(world - 1, int((before + n / 2) * world // max(total, 1)))
        chunks.append(Chunk(index, a, b, n, rank))
        before += n
    return chunks


def _chunk_path(out_dir: str, index: int, suffix: str) -> str:
    return os.path.join(out_dir, "chunks", f"chunk-{index:06d}.{suffix}")


def _remove_partial_writes(out_dir: str) -> None:
    """Delete the temporary files a killed run left (a chunk or the manifest written halfway, before its rename; a
    rank-0 marker, :data:`MARKER_PREFIX`). Rank 0 calls it before it broadcasts the plan, which every other rank waits
    for: no rank of this run is writing."""
    chunks = os.path.join(out_dir, "chunks")
    names = [os.path.join(chunks, n) for n in os.listdir(chunks) if n.endswith(".tmp")] if os.path.isdir(chunks) else []
    names += [os.path.join(out_dir, n) for n in os.listdir(out_dir) if n.startswith(MARKER_PREFIX)]
    for path in names + [os.path.join(out_dir, MANIFEST + ".tmp")]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def file_digest(path: str, block: int = 1 << 22) -> str:
    """The SHA-256 (hex) of a file, read in ``block``-byte pieces (a chunk file of any size in bounded memory; the
    same value as ``sha256sum``)."""
    h = hashlib.sha256()
    buf = bytearray(block)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def plan_fingerprint(plan: dict) -> str:
    """The SHA-256 (hex) of the plan's :data:`PLAN_FINGERPRINT` entries: equal for plans of the same corpus file,
    chunking, output and settings (:func:`run_settings`), whatever the corpus path."""
    fixed = {k: plan.get(k) for k in PLAN_FINGERPRINT}
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()


def _chunk_state(out_dir: str, chunk: Chunk, fingerprint: str, verify: bool = True) -> tuple[str, dict | None]:
    """``(state, marker)`` of ``chunk``: ``"done"`` when its completion marker is in place, records a digest, was
    written under this plan (its :func:`plan_fingerprint` is ``fingerprint``), describes this chunk of the plan (its
    index, rows and tokens) and the chunk file has the marker's size and (``verify``) SHA-256; otherwise
    ``"missing"`` (no marker: never finished), ``"old"`` (a marker without one of :data:`MARKER_KEYS`, an older
    version's: not trusted), ``"plan"`` (a marker written under another plan: another corpus, chunking, model or
    settings), ``"other"`` (a marker written for another chunk: copied or replaced since) or ``"changed"`` (the file
    is gone, or its size or digest differ from the marker's: damaged or replaced since, or an unreadable marker).
    Every state but ``"done"`` means the chunk is encoded again."""
    try:
        with open(_chunk_path(out_dir, chunk.index, "done")) as f:
            marker = json.load(f)
    except FileNotFoundError:
        return "missing", None
    except (OSError, ValueError):
        return "changed", None
    if not isinstance(marker, dict) or not all(k in marker for k in MARKER_KEYS):
        return "old", None
    if marker["plan"] != fingerprint:
        return "plan", marker
    if [marker.get(k) for k in ("index", "rows", "tokens")] != [chunk.index, chunk.stop - chunk.start, chunk.tokens]:
        return "other", marker
    path = _chunk_path(out_dir, chunk.index, "pt")
    try:
        if os.path.getsize(path) != marker.get("bytes") or (verify and file_digest(path) != marker["sha256"]):
            return "changed", marker
    except OSError:
        return "changed", marker
    return "done", marker


# why a chunk found with a marker is encoded again (the warning of _chunks_to_encode), by _chunk_state's state
NOT_TRUSTED = {
    "changed": "chunk file(s) differ from their completion marker (size or SHA-256; missing, damaged or replaced "
               "since they were written)",
    "plan": "completion marker(s) written under another plan (another corpus file, chunking, output, model or "
            "settings: a plan.json deleted or replaced since, or chunks copied from another index)",
    "other": "completion marker(s) describe another chunk (index, rows or tokens differ from this plan's chunk: "
             "copied or replaced since they were written)",
    "old": "completion marker(s) written by an older version (no digest, chunk index or plan fingerprint)",
}


def _chunks_to_encode(out_dir: str, chunks: list[Chunk], rank: int, fingerprint: str) -> list[Chunk]:
    """This rank's chunks that are not finished (each finished one's file hashed once against its marker); warns,
    naming them, about the chunks whose marker is not trusted (:data:`NOT_TRUSTED`)."""
    todo, why = [], {state: [] for state in NOT_TRUSTED}
    for c in chunks:
        if c.rank != rank:
            continue
        state, _ = _chunk_state(out_dir, c, fingerprint)
        if state != "done":
            todo.append(c)
            why.get(state, []).append(c.index)
    where = os.path.join(out_dir, "chunks")
    for state, indices in why.items():
        if indices:
            warnings.warn(f"packed_encoders.index: rank {rank}: {len(indices)} {NOT_TRUSTED[state]} in {where}, "
                          f"chunks {_some(indices)}: encoding them again", stacklevel=3)
    return todo


def _some(indices: list, n: int = 10) -> str:
    return str(indices[:n])[:-1] + (f", ... ({len(indices) - n} more)]" if len(indices) > n else "]")


def _read_items(corpus: str, offsets: list[int], start: int, stop: int) -> list[list[int]]:
    """The ``input_ids`` of items ``start:stop``, each read at its own offset (blank lines, which
    :func:`scan_corpus` skips, may lie between two items)."""
    out = []
    with open(corpus, "rb") as f:
        for i in range(start, stop):
            f.seek(offsets[i])
            out.append(json.loads(f.readline())["input_ids"])
    return out


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Positions of ``lengths`` grouped into batches of at most ``batch_tokens`` real tokens, longest first (similar
    lengths share a batch; an item longer than the budget is a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current, tokens = [], [], 0
    for i in order:
        if current and tokens + lengths[i] > batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append(i)
        tokens += lengths[i]
    if current:
        batches.append(current)
    return batches


class Encoder:
    """Runs a loaded model on a list of token-id lists: ``(vectors, counts)``, on the model's device: ``[n, D]``
    and ``None`` (pooled), or the flat token vectors of the items in order ``[T, D]`` and how many each item has
    (int64 ``[n]``, on the host) (tokens).

    A bare ``ModernBertModel`` (or the encoder of a HF task head) runs ``pe.packed_forward`` on the flat batch (no
    padding), then pools; its items keep a vector per token. Anything else (a SentenceTransformer, a
    sentence-transformers multi-vector model, a PyLate ColBERT, ...) is called with a padded
    ``{"input_ids", "attention_mask"}`` dict, and its ``sentence_embedding`` (pooled) or its ``token_embeddings``
    where the ``attention_mask`` its modules return is set (tokens) are read: the input's mask, or the scoring mask
    of a multi-vector model (sentence-transformers' ``MultiVectorMask``: skiplisted tokens left out), so the vectors
    are those its forward scores. Steps a model's ``encode`` takes after its forward (PyLate's L2 normalisation and
    skiplist) are not taken.

    Raises:
        PackedEncodersError: an ``output`` or ``pooling`` not of :data:`OUTPUTS` / :data:`POOLINGS`, a ``pad_id``
            outside the vocabulary, or (:meth:`check_outputs`) a forward without the output ``output`` reads.
    """

    def __init__(self, model, output: str = "pooled", pooling: str = "mean", pad_id: int = 0):
        from .adapters.locate import find_encoders

        if output not in OUTPUTS:
            raise PackedEncodersError(f"output={output!r} is not one of {OUTPUTS}")
        if pooling not in POOLINGS:
            raise PackedEncodersError(f"pooling={pooling!r} is not one of {POOLINGS}")
        encoders = find_encoders(model)
        self.bare = _bare(model, encoders)
        self.model = encoders[0][1] if self.bare else model
        self.output, self.pooling, self.pad_id = output, pooling, pad_id
        self.device = encoders[0][1].embeddings.tok_embeddings.weight.device
        self.vocab_size = int(encoders[0][1].config.vocab_size)
        if type(pad_id) is not int or not 0 <= pad_id < self.vocab_size:
            # the padded [B, S] batches carry it to the embedding wherever a call runs HF's own forward, which
            # would index out of the table (a device-side assert on CUDA, which ends the process's CUDA context)
            raise PackedEncodersError(f"pad_id={pad_id!r} is not a token id of the model's vocabulary "
                                      f"[0, {self.vocab_size})")

    @torch.inference_mode()
    def __call__(self, items: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        lens = torch.tensor([len(x) for x in items])
        if self.bare:
            from .api import packed_forward

            ids = torch.tensor([t for x in items for t in x], dtype=torch.long).to(self.device, non_blocking=True)
            cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32)
            flat = packed_forward(self.model, None, ids, cu.to(self.device), int(lens.max()))
            if self.output == "tokens":
                return flat, lens
            if self.pooling == "cls":
                return flat[cu[:-1].to(self.device)], None
            return mean_pool(flat, cu.to(self.device)), None
        ids = torch.full((len(items), int(lens.max())), self.pad_id, dtype=torch.long)
        mask = torch.zeros(ids.shape, dtype=torch.long)
        for row, x in enumerate(items):
            ids[row, :len(x)] = torch.tensor(x)
            mask[row, :len(x)] = 1
        mask = mask.to(self.device)
        out = self.model({"input_ids": ids.to(self.device), "attention_mask": mask})
        if self.output == "pooled":
            return out["sentence_embedding"], None
        vectors, scored = self._scored(out, mask)
        return vectors[scored], scored.sum(1).cpu()

    def _scored(self, out: dict, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_embeddings`` ``[B, S, D]`` of a forward's output and the bool ``[B, S]`` positions whose vectors
        the index keeps: the ``attention_mask`` the modules return, else the input's ``mask``."""
        vectors = out["token_embeddings"]
        scored = out.get("attention_mask", mask)
        if scored.shape != vectors.shape[:2]:
            raise PackedEncodersError(f"{type(self.model).__name__}'s forward returned token_embeddings of shape "
                                      f"{tuple(vectors.shape)} with an attention_mask of shape {tuple(scored.shape)}; "
                                      "the index reads a vector per position the mask sets")
        return vectors, scored.bool()

    def check_outputs(self) -> None:
        """A forward of a model called with a padded batch (:attr:`bare` false) gives what :attr:`output` reads
        (``sentence_embedding``; ``token_embeddings`` and a mask of their shape, :meth:`_scored`): one call on a
        one-token item, before anything is written.

        Raises:
            PackedEncodersError: naming the missing output (e.g. a multi-vector model, which pools nothing) or the
                shapes that differ.
        """
        if self.bare:
            return
        from .validation import eval_mode

        key = "sentence_embedding" if self.output == "pooled" else "token_embeddings"
        ids = torch.full((1, 1), self.pad_id, dtype=torch.long, device=self.device)
        with eval_mode(self.model), torch.inference_mode():
            out = self.model({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        if not isinstance(out, dict) or key not in out:
            other = " (output='tokens' reads its token vectors)" if self.output == "pooled" else ""
            raise PackedEncodersError(f"output={self.output!r} reads the {key!r} of the model's forward, which a "
                                      f"{type(self.model).__name__} does not return{other}")
        if self.output == "tokens":
            self._scored(out, torch.ones_like(ids))


def unwrapped(model):
    """The module inside a ``DistributedDataParallel`` / ``DataParallel`` or ``torch.compile`` wrapper (nested ones
    too), else ``model``: indexing is a forward without gradient, which needs neither the wrapper's gradient sync
    nor its compiled frames, and reads the model's own modules and ``state_dict`` (without the wrapper's prefix,
    so the run's fingerprint is the bare model's)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def pools_here(model) -> bool:
    """Whether ``--pooling`` shapes this model's pooled vectors: a bare ``ModernBertModel`` (or the encoder of a HF
    task head), run on the flat batch and pooled here; a sentence-transformers or PyLate model pools (or not) as its
    own modules say."""
    from .adapters.locate import find_encoders

    return _bare(model, find_encoders(model))


def pooling_problem(model, output: str, pooling: str | None) -> str | None:
    """Why an explicit ``pooling`` would shape none of the vectors (token vectors are not pooled; a
    sentence-transformers or PyLate model pools as its own modules say), or ``None``."""
    if pooling is None:
        return None
    if output == "tokens":
        return "token vectors (output tokens) are not pooled"
    if not pools_here(model):
        return f"a {type(model).__name__} pools as its own modules say"
    return None


def _bare(model, encoders) -> bool:
    # (encoders: find_encoders(model), which the Encoder has found already)
    return len(encoders) == 1 and (encoders[0][0] == "" or _is_hf_model(model))


def _is_hf_model(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PreTrainedModel)


def _encode_chunk(encoder: Encoder, items: list[list[int]], batch_tokens: int, out_dtype: torch.dtype) -> dict:
    """Encode ``items`` in length-sorted token-budget batches; rows come back in ``items`` order (one
    device-to-host copy per batch)."""
    lengths = [len(x) for x in items]
    rows: list = [None] * len(items)
    counts = [0] * len(items)  # vectors per item (tokens): a scoring mask may leave some out
    for batch in token_batches(lengths, batch_tokens):
        out, kept = encoder([items[i] for i in batch])
        out = out.to("cpu", out_dtype)
        parts = out.split(kept.tolist()) if kept is not None else out
        for i, part in zip(batch, parts):
            rows[i] = part
            counts[i] = part.shape[0]
    if encoder.output == "pooled":
        return {"embeddings": torch.stack(rows)}
    return {"embeddings": torch.cat(rows), "cu_seqlens": torch.tensor([0] + counts).cumsum(0)}


def state_digest(model) -> str:
    """The SHA-256 (hex) of ``model.state_dict()``: every entry's name, dtype, shape and bytes, in order (each
    tensor copied to the host in turn). Any change to a parameter or persistent buffer changes it, where a sum of
    the weights misses permutations and edits below its precision."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t = t.detach()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def model_fingerprint(model) -> dict:
    """The model's class, parameter count and dtype, :func:`state_digest` and its top-level modules (name, class
    and, where a module has one, ``get_config_dict()``: a sentence-transformers Pooling mode or a Normalize module)
    and the encoder config's :data:`FORWARD_CONFIG` fields: equal for the same model loaded again, different for
    other weights or buffers, another dtype, module pipeline or attention / RoPE / activation config."""
    params = list(model.parameters())
    # The pipeline around the encoder: parameter-free modules (a sentence-transformers Pooling mode, Normalize)
    # change the vectors without changing the weights. JSON round trip: the plan stores it as JSON.
    modules = [[name, type(m).__name__, m.get_config_dict() if callable(getattr(m, "get_config_dict", None)) else None]
               for name, m in model.named_children()]
    # The encoder's config fields that shape its forward without being weights (an edited config.json with the
    # same weights gives other vectors: another window, RoPE base, activation, norm epsilon, head split).
    config = next((m.config for m in model.modules() if hasattr(getattr(m, "config", None), "to_dict")), None)
    forward = {k: getattr(config, k, None) for k in FORWARD_CONFIG} if config is not None else None
    return {"class": type(model).__name__, "parameters": sum(p.numel() for p in params),
            "dtype": str(params[0].dtype).replace("torch.", "") if params else None, "sha256": state_digest(model),
            "modules": json.loads(json.dumps(modules, default=str)),
            "config": json.loads(json.dumps(forward, default=str))}


def _write_plan(out_dir: str, corpus: str, chunk_tokens: int, output: str, world: int, settings: dict,
                vocab_size: int | None) -> dict:
    hasher = hashlib.sha256()
    offsets, lengths, ids = scan_corpus(corpus, vocab_size, hasher)
    chunks = plan_chunks(lengths, chunk_tokens, world)
    try:  # only now that the corpus is known to be good: a refused run leaves nothing behind
        os.makedirs(os.path.join(out_dir, "chunks"), exist_ok=True)
    except OSError as exc:
        raise PackedEncodersError(f"{out_dir}: cannot make the output directory ({exc})") from None
    st = os.stat(corpus)
    plan = {"corpus": os.path.abspath(corpus), "corpus_bytes": st.st_size, "corpus_mtime_ns": st.st_mtime_ns,
            "corpus_sha256": hasher.hexdigest(), "chunk_tokens": chunk_tokens, "output": output, "settings": settings,
            "items": len(ids), "tokens": sum(lengths),
            "offsets": offsets, "lengths": lengths, "ids": ids,
            "chunks": [[c.index, c.start, c.stop, c.tokens] for c in chunks]}
    tmp = os.path.join(out_dir, PLAN + ".tmp")
    with open(tmp, "w") as f:
        json.dump(plan, f)
    # a manifest left by an earlier plan describes another index: gone before the new plan is in place, so a run
    # that stops before its own manifest leaves "not finished", never the old vectors under the new plan
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, MANIFEST))
    os.replace(tmp, os.path.join(out_dir, PLAN))
    return plan


def _corpus_changed(corpus: str, plan: dict) -> bool:
    """Whether ``corpus``'s size or modification time differ from those the plan recorded."""
    st = os.stat(corpus)
    return (st.st_size, st.st_mtime_ns) != (plan["corpus_bytes"], plan["corpus_mtime_ns"])


def _read_json(path: str, keys: tuple[str, ...], advice: str) -> dict:
    """The JSON object in ``path``, which must hold ``keys``.

    Raises:
        PackedEncodersError: naming ``path`` and what is wrong (missing, unreadable, not JSON, not an object with
            ``keys``), followed by ``advice`` (what to do).
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise PackedEncodersError(f"{path}: missing; {advice}") from None
    except (OSError, ValueError) as exc:  # ValueError: json.JSONDecodeError, UnicodeDecodeError
        raise PackedEncodersError(f"{path}: unreadable or not JSON ({exc}); {advice}") from None
    lacking = [k for k in keys if not isinstance(data, dict) or k not in data]
    if lacking:
        raise PackedEncodersError(f"{path}: not a complete {os.path.basename(path)} (no {', '.join(lacking)}); "
                                  f"{advice}")
    return data


def _read_plan(out_dir: str) -> dict:
    """``out_dir``'s plan, read with :func:`_read_json` (a damaged one is named, with the way out)."""
    return _read_json(os.path.join(out_dir, PLAN), PLAN_KEYS,
                      f"run the indexing command on {out_dir} again (deleting a damaged {PLAN} first): it writes a "
                      "new plan, keeps the chunks made under the same one and encodes the others")


def _load_plan(out_dir: str, corpus: str, chunk_tokens: int, output: str, settings: dict | None,
               contents: bool = True) -> dict | None:
    """The plan in ``out_dir``, or ``None``; raises when it is another corpus's or settings' (``settings``:
    compared when given; rank 0 checks them for every rank), or damaged. ``contents``: the corpus is read and its
    SHA-256 compared too (rank 0 does; the other ranks' corpus sizes and modification times are compared with
    rank 0's), so that a file rewritten at the same size and given its old modification time back (``cp -p``,
    ``rsync -t``, a restored backup) is not taken for the one the chunks were made from."""
    if not os.path.exists(os.path.join(out_dir, PLAN)):
        return None
    plan = _read_plan(out_dir)
    parts = [_difference({"chunk_tokens": plan["chunk_tokens"], "output": plan["output"]},
                         {"chunk_tokens": chunk_tokens, "output": output})]
    if _corpus_changed(corpus, plan):
        parts.insert(0, f"corpus: {plan['corpus']!r} ({plan['corpus_bytes']} bytes) -> {corpus!r} "
                        f"({os.stat(corpus).st_size} bytes"
                        f"{', modified since' if os.path.abspath(corpus) == plan['corpus'] else ''})")
    elif contents and plan.get("corpus_sha256") and file_digest(corpus) != plan["corpus_sha256"]:
        parts.insert(0, f"corpus: {corpus!r}: the size and modification time {PLAN} records, other contents "
                        "(SHA-256)")
    differs = "; ".join(p for p in parts if p)
    if differs:
        raise PackedEncodersError(f"{out_dir} holds an index of another corpus or settings ({PLAN} -> this run: "
                                  f"{differs}); use a new --out directory or delete it")
    if settings is not None and plan.get("settings") != settings:
        raise PackedEncodersError(f"{out_dir} holds an index made with other settings ({PLAN} -> this run: "
                                  f"{_difference(plan.get('settings') or {}, settings)}): resuming would mix two "
                                  "indexes; use a new --out directory or delete it")
    return plan


def _plan_seen(out_dir: str, corpus: str, chunk_tokens: int, output: str, fingerprint: str,
               marker: str) -> tuple[dict | None, str | None]:
    """``(plan, None)`` where a rank other than 0 sees, in ``out_dir``, the ``marker`` file rank 0 made for this run
    and reads the plan rank 0 wrote (its :func:`plan_fingerprint` is ``fingerprint``); otherwise ``(None, what it
    found instead)``. The marker tells a directory rank 0 shares from a copy holding the same plan; it is looked
    for a few seconds (:data:`MARKER_WAIT_S`), as a network file system may show a new file late."""
    path, wait, deadline = os.path.join(out_dir, marker), 0.05, time.monotonic() + MARKER_WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return None, f"{os.path.abspath(out_dir)}: not the directory rank 0 writes (no {marker} there)"
        time.sleep(wait)
        wait = min(2 * wait, 1.0)
    where = os.path.join(os.path.abspath(out_dir), PLAN)
    try:
        plan = _load_plan(out_dir, corpus, chunk_tokens, output, None, contents=False)
    except PackedEncodersError as exc:
        return None, str(exc)
    if plan is None:
        return None, f"{where}: missing"
    if plan_fingerprint(plan) != fingerprint:
        return None, f"{where}: another plan than rank 0's"
    return plan, None


_ABSENT = object()  # _difference's filler for a key or list item only one side has


def _difference(a, b, limit: int = 3) -> str:
    """Where ``a`` and ``b`` (nested dicts and lists: run settings, a model fingerprint) differ, narrowed to the
    differing leaves: the first ``limit`` as ``"path: a's -> b's"`` (``model.modules[1][2].pooling_mode: 'mean' ->
    'cls'``, values shortened), ``; ``-separated."""
    found = []

    def short(value) -> str:
        text = "(absent)" if value is _ABSENT else repr(value)
        return text if len(text) <= 60 else text[:57] + "..."

    def walk(x, y, path: str) -> None:
        if x == y:
            return
        if isinstance(x, dict) and isinstance(y, dict):
            for k in [*x, *(k for k in y if k not in x)]:
                walk(x.get(k, _ABSENT), y.get(k, _ABSENT), f"{path}.{k}" if path else str(k))
        elif isinstance(x, list) and isinstance(y, list):
            for i in range(max(len(x), len(y))):
                walk(x[i] if i < len(x) else _ABSENT, y[i] if i < len(y) else _ABSENT, f"{path}[{i}]")
        else:
            found.append(f"{path or 'value'}: {short(x)} -> {short(y)}")

    walk(a, b, "")
    return "; ".join(found[:limit]) + (f"; and {len(found) - limit} more" if len(found) > limit else "")


def run_settings(model, encoder: "Encoder", output: str, pooling: str, out_dtype: torch.dtype, pad_id: int) -> dict:
    """The settings besides the corpus and chunking that shape an index's vectors, as its plan records them (a resumed
    run with other settings is refused): the pooling where this module pools (a bare encoder's pooled output), the
    output dtype, the pad id and :func:`model_fingerprint`."""
    used = pooling if encoder.bare and output == "pooled" else None
    return {"pooling": used, "out_dtype": str(out_dtype).replace("torch.", ""), "pad_id": int(pad_id),
            "model": model_fingerprint(model)}


def index_corpus(model, corpus: str, out_dir: str, *, output: str = "pooled", pooling: str | None = None,
                 batch_tokens: int = 16384, chunk_tokens: int = 1 << 20, out_dtype: torch.dtype = torch.float32,
                 pad_id: int = 0, progress: bool = True,
                 on_chunk: Callable[[int, int, int], None] | None = None) -> dict | None:
    """Encode a JSONL corpus into ``out_dir`` (see the module docstring for formats), on this rank's share.

    Call it on every rank of an initialised ``torch.distributed`` group (or in a single process without one);
    ranks share the file system, rank 0's plan (one broadcast at the start) and a barrier at the end.

    Args:
        model: a packed (or packable) model on this rank's device: a ``ModernBertModel``, SentenceTransformer,
            PyLate ColBERT, ...; run in eval mode (no dropout), each module's own mode restored afterwards. In a
            ``DistributedDataParallel`` or ``torch.compile`` wrapper, the module inside it runs (:func:`unwrapped`).
        output: ``"pooled"`` (one vector per item) or ``"tokens"`` (a vector per token, flat, with ``cu_seqlens``).
        pooling: ``"mean"`` or ``"cls"``, for a bare ``ModernBertModel`` with ``output="pooled"`` (``None``: mean
            there; given where it would shape nothing, refused).
        batch_tokens: real tokens per forward (items are sorted by length inside a chunk).
        chunk_tokens: tokens per chunk file (the unit of resumption).
        out_dtype: dtype of the stored vectors.
        pad_id: the token id filling the padding of ``[B, S]`` batches (models other than a bare encoder, which runs
            on the flat batch); padding is masked, so the vectors do not depend on it.
        on_chunk: called ``(chunk_index, rows, tokens)`` after each chunk this rank completes.

    Returns:
        The manifest (a dict) on rank 0, ``None`` on the others.

    Raises:
        PackedEncodersError: a missing, empty or malformed corpus, ``batch_tokens`` / ``chunk_tokens`` below 1, an
            ``out_dtype`` that is not a floating ``torch.dtype``, a ``pooling`` that would shape none of the
            vectors (:func:`pooling_problem`), ``pad_id`` outside the model's vocabulary, a model whose weights
            are sharded (FSDP2, tensor parallelism: each rank needs the whole model), or
            ``out_dir`` holding an index of another corpus (its size, modification time or SHA-256 differ) or
            settings (chunking, output, pooling, ``out_dtype``, ``pad_id`` or the model: :func:`model_fingerprint`),
            or ranks called with different ones (or corpus files of different size or modification time), or a
            damaged ``plan.json`` in ``out_dir`` (naming it).
    """
    for name, value in (("batch_tokens", batch_tokens), ("chunk_tokens", chunk_tokens)):
        if type(value) is not int or value < 1:
            raise PackedEncodersError(f"{name}={value!r}: expected a positive number of tokens")
    model = unwrapped(model)
    if sharded(model):
        # every rank encodes its own chunks, a different number of forwards; a sharded forward all-gathers the
        # weights with every other rank, so ranks would wait on each other (or read shards)
        raise PackedEncodersError(f"index_corpus: the {type(model).__name__}'s weights are sharded (DTensor "
                                  "parameters: FSDP2 fully_shard or tensor parallelism), but each rank encodes "
                                  "its own chunks and needs the whole model; load it unsharded on every rank")
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise PackedEncodersError(f"out_dtype={out_dtype!r}: expected a floating torch.dtype (e.g. torch.float16)")
    problem = pooling_problem(model, output, pooling)
    if problem is not None:  # asked for and never applied: other vectors than requested
        raise PackedEncodersError(f"pooling={pooling!r} has no effect here: {problem}; leave pooling out")
    pooling = "mean" if pooling is None else pooling
    if not os.path.isfile(corpus):
        raise PackedEncodersError(f"{corpus}: no such corpus file (JSON lines of pre-tokenized items)")
    dist, rank, world = _dist()
    problem = [None]
    encoder = Encoder(model, output, pooling, pad_id)
    encoder.check_outputs()
    settings = run_settings(model, encoder, output, pooling, out_dtype, pad_id)
    # Every rank's, not rank 0's alone: the plan records rank 0's, and a rank run with another model, pooling or
    # output dtype wrote its chunks into the same index unnoticed (another chunking or output hung rank 0).
    st = os.stat(corpus)
    run = {"corpus_bytes": st.st_size, "corpus_mtime_ns": st.st_mtime_ns, "chunk_tokens": chunk_tokens,
           "output": output, **settings}
    runs = [run]
    if dist is not None:
        runs = [None] * world
        dist.all_gather_object(runs, run)
    if rank == 0:
        differ = [r for r, theirs in enumerate(runs) if theirs != run]
        if differ:
            problem = [f"the ranks were not given the same indexing run: ranks {differ} differ from rank 0 (rank 0 "
                       f"-> rank {differ[0]}: {_difference(run, runs[differ[0]])}); start every rank with the same "
                       "model, corpus and options"]
        else:
            try:
                plan = (_load_plan(out_dir, corpus, chunk_tokens, output, settings)
                        or _write_plan(out_dir, corpus, chunk_tokens, output, world, settings, encoder.vocab_size))
                _remove_partial_writes(out_dir)
            except PackedEncodersError as exc:
                problem = [str(exc)]
    marker = None
    if dist is not None:
        # every rank raises rank 0's error instead of waiting for it; rank 0's plan fingerprint and the name of a
        # marker file it made for this run ride along
        if rank == 0 and problem[0] is None:
            marker = MARKER_PREFIX + uuid.uuid4().hex
            with open(os.path.join(out_dir, marker), "w"):
                pass
        problem += [plan_fingerprint(plan) if marker else None, marker]
        dist.broadcast_object_list(problem, src=0)
    if problem[0] is not None:
        if dist is not None:
            # every rank past the broadcast before any leaves: a rank exiting while a peer still reads it reset the
            # connection, and gloo aborted the peer (SIGABRT instead of the refusal's exit)
            dist.barrier()
        raise PackedEncodersError(problem[0])
    if dist is not None:
        # Every rank reads the plan rank 0 wrote. One that cannot (given another --out, an output directory not on a
        # file system every rank shares, or a copy of it) would fail alone, or write into the copy, while the others
        # encode and wait for it: every rank raises instead, naming the rank and the directory.
        blind = None
        if rank != 0:
            plan, blind = _plan_seen(out_dir, corpus, chunk_tokens, output, problem[1], problem[2])
        views = [None] * world
        dist.all_gather_object(views, blind)
        if rank == 0:  # every rank has looked
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(out_dir, marker))
        failed = [r for r, why in enumerate(views) if why is not None]
        if failed:
            dist.barrier()  # (as above: no rank leaves while a peer still reads)
            raise PackedEncodersError(f"rank {failed[0]} does not see the plan rank 0 wrote ({views[failed[0]]}); "
                                      "every rank needs the same output directory on a file system all ranks "
                                      f"share (ranks {failed} cannot see it)")
    os.makedirs(os.path.join(out_dir, "chunks"), exist_ok=True)  # rank 0 made it (after the checks); others see it
    lengths = plan["lengths"]
    # owners are dealt for this run's world size: a resumed run may use another number of ranks
    chunks = plan_chunks(lengths, chunk_tokens, world)
    fingerprint = plan_fingerprint(plan)
    mine = _chunks_to_encode(out_dir, chunks, rank, fingerprint)
    bar = None
    if progress and rank == 0:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(c.tokens for c in mine), unit="tok", unit_scale=True,
                   desc=f"rank 0 of {world}, {len(mine)} chunks")
    from .validation import eval_mode

    # no dropout: an index's vectors do not depend on the mode the caller left the model in (an evaluation callback
    # of a training loop); each module's own mode comes back afterwards
    with eval_mode(model):
        for c in mine:
            _encode_and_write(c, corpus, out_dir, plan, encoder, batch_tokens, out_dtype, fingerprint, rank, world)
            if bar is not None:
                bar.update(c.tokens)
            if on_chunk is not None:
                on_chunk(c.index, c.stop - c.start, c.tokens)
    if bar is not None:
        bar.close()
    if dist is not None:
        dist.barrier()
    if rank != 0:
        return None
    return _write_manifest(out_dir, plan, chunks, output, out_dtype)


def _encode_and_write(c: Chunk, corpus: str, out_dir: str, plan: dict, encoder: Encoder, batch_tokens: int,
                      out_dtype: torch.dtype, fingerprint: str, rank: int, world: int) -> None:
    """Encode chunk ``c`` and put its file, then its completion marker, in place (each written aside and renamed)."""
    started = time.perf_counter()
    items = _read_items(corpus, plan["offsets"], c.start, c.stop)  # the file whose size and mtime were checked
    # (plan["corpus"] is where it was first: a renamed corpus may have another file in its place)
    if _corpus_changed(corpus, plan):  # after the read: an edit before or while reading is seen here
        raise PackedEncodersError(f"{corpus} changed while it was being indexed (its size or modification time "
                                  f"differ from the plan's): the chunks in {out_dir} would mix two versions; "
                                  "use a new --out directory or delete it")
    data = _encode_chunk(encoder, items, batch_tokens, out_dtype)
    data["ids"] = plan["ids"][c.start:c.stop]
    tmp = _chunk_path(out_dir, c.index, f"pt.{rank}.tmp")
    torch.save(data, tmp)
    size, digest = os.path.getsize(tmp), file_digest(tmp)  # the bytes just written (read back from the cache)
    with contextlib.suppress(FileNotFoundError):  # a stale marker (a chunk encoded again) never describes this file
        os.remove(_chunk_path(out_dir, c.index, "done"))
    os.replace(tmp, _chunk_path(out_dir, c.index, "pt"))
    seconds = time.perf_counter() - started
    # The marker too is renamed into place: a rank stopped mid-write (another rank's failure ends the whole
    # job) must not leave an empty marker that a resumed run takes for a finished chunk.
    marker = _chunk_path(out_dir, c.index, f"done.{rank}.tmp")
    with open(marker, "w") as f:
        json.dump({"index": c.index, "rows": c.stop - c.start, "tokens": c.tokens, "plan": fingerprint,
                   "bytes": size, "sha256": digest, "rank": rank, "world": world, "seconds": seconds}, f)
    os.replace(marker, _chunk_path(out_dir, c.index, "done"))


def _write_manifest(out_dir: str, plan: dict, chunks: list[Chunk], output: str, out_dtype: torch.dtype) -> dict:
    # Every chunk's file was hashed this run by the rank that owns it (written, or checked against its marker at the
    # start): here its marker and size only, not a second pass over the whole index on rank 0.
    fingerprint = plan_fingerprint(plan)
    states = [_chunk_state(out_dir, c, fingerprint, verify=False) for c in chunks]
    missing = [c.index for c, (state, _) in zip(chunks, states) if state != "done"]
    if missing:
        raise PackedEncodersError(f"chunks {_some(missing)} are not finished (no completion marker, or a chunk file "
                                  "changed since); run the command again")
    first = (_load_chunk(out_dir, _chunk_path(out_dir, chunks[0].index, "pt"), states[0][1]["bytes"])
             if chunks else None)  # (for its width: its digest was checked this run)
    manifest = {"corpus": plan["corpus"], "plan": fingerprint, "output": output, "items": plan["items"],
                "tokens": plan["tokens"],
                "dim": None if first is None else int(first["embeddings"].shape[-1]),
                "dtype": str(out_dtype).replace("torch.", ""),
                "chunks": [{"file": os.path.relpath(_chunk_path(out_dir, c.index, "pt"), out_dir), "rows": c.stop - c.start,
                            "tokens": c.tokens, "first_item": c.start, "bytes": marker["bytes"],
                            "sha256": marker["sha256"]} for c, (_, marker) in zip(chunks, states)]}
    tmp = os.path.join(out_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, MANIFEST))
    return manifest


def _load_chunk(out_dir: str, path: str, size: int | None = None, sha256: str | None = None) -> dict:
    """A chunk file's contents; with ``size`` / ``sha256``, the file is checked against them first (a streamed read:
    a chunk of token vectors can be gigabytes, so its bytes are not held beside the tensors decoded from them, which
    are memory-mapped)."""
    again = f"run the indexing command on {out_dir} again, which encodes a changed or missing chunk again"
    try:
        found = os.path.getsize(path)
        if size is not None and found != size:
            raise PackedEncodersError(f"{path}: {found} bytes, the manifest recorded {size} (truncated or replaced "
                                      f"since the index was finished); {again}")
        if sha256 is not None and file_digest(path) != sha256:
            raise PackedEncodersError(f"{path}: its contents differ from the SHA-256 the manifest recorded (damaged "
                                      f"or replaced since the index was finished); {again}")
    except OSError as exc:
        raise PackedEncodersError(f"{path}: unreadable ({exc.__class__.__name__}); {again}") from None
    try:
        return torch.load(path, weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - a truncated or corrupted file: name it and the way out
        raise PackedEncodersError(f"{path}: unreadable ({exc.__class__.__name__}); {again}") from None


def _chunk_entry_ok(entry) -> bool:
    """A manifest chunk entry of the types :func:`load_index` reads (``bytes`` / ``sha256`` absent in a manifest of
    an older version, never of another type)."""
    def count(x):
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    return (isinstance(entry, dict) and isinstance(entry.get("file"), str) and count(entry.get("rows"))
            and count(entry.get("first_item")) and ("bytes" not in entry or count(entry["bytes"]))
            and ("sha256" not in entry or (isinstance(entry["sha256"], str) and len(entry["sha256"]) == 64)))


def load_index(out_dir: str) -> dict:
    """Read a finished index: ``{"ids": [...], "embeddings": tensor, "cu_seqlens": tensor (tokens output)}``, rows
    in corpus order.

    Every chunk file is checked against the SHA-256 the manifest recorded for it as it is read. A manifest without
    digests (written by an older version) is loaded unchecked, with a warning.

    Raises:
        PackedEncodersError: no such directory, no manifest (the run did not finish), a damaged manifest (entries
            of other types included) or one written for another plan, a missing or damaged plan (naming the file),
            a chunk file that cannot be read or whose SHA-256 differs from the manifest's, or ids missing /
            duplicated against the plan (naming the chunk files that hold other items than the plan's).
    """
    if not os.path.isdir(out_dir):
        raise PackedEncodersError(f"{out_dir}: no such directory (the output directory of an indexing run)")
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.exists(path):
        raise PackedEncodersError(f"{out_dir} has no {MANIFEST}: the indexing run has not finished")
    again = f"run the indexing command on {out_dir} again, which writes it again"
    manifest = _read_json(path, ("chunks",), again)
    if not isinstance(manifest["chunks"], list) or not all(map(_chunk_entry_ok, manifest["chunks"])):
        raise PackedEncodersError(f"{path}: a malformed chunk list; {again}")
    plan = _read_plan(out_dir)
    if "plan" in manifest and manifest["plan"] != plan_fingerprint(plan):
        raise PackedEncodersError(f"{path} was written for another {PLAN} than {out_dir}'s (replaced since the index "
                                  f"was finished); {again}")
    expected = plan["ids"]
    if not isinstance(expected, list):
        raise PackedEncodersError(f"{os.path.join(out_dir, PLAN)}: its ids are not a list; run the indexing command "
                                  f"on {out_dir} again (deleting the damaged {PLAN} first)")
    unchecked = [entry["file"] for entry in manifest["chunks"] if "sha256" not in entry]
    if unchecked:
        warnings.warn(f"packed_encoders.index: {path} records no SHA-256 for {len(unchecked)} chunk file(s) (written "
                      "by an older version): they are loaded unchecked; running the indexing command on "
                      f"{out_dir} again encodes them again and records their digests", stacklevel=2)
    ids, embeddings, lens, wrong = [], [], [], []
    for entry in manifest["chunks"]:
        data = _load_chunk(out_dir, os.path.join(out_dir, entry["file"]), entry.get("bytes"), entry.get("sha256"))
        if data["ids"] != expected[entry["first_item"]:entry["first_item"] + entry["rows"]]:
            wrong.append(entry["file"])
        ids.extend(data["ids"])
        embeddings.append(data["embeddings"])
        if "cu_seqlens" in data:
            lens.append(data["cu_seqlens"].diff())
    if ids != expected:
        at_fault = f"; {_some(wrong)} hold other items than the plan's" if wrong else ""
        raise PackedEncodersError(f"{out_dir}: the chunks hold {len(ids)} rows ({len(set(ids))} distinct ids) for "
                                  f"{len(expected)} corpus items{at_fault}; run the indexing command on {out_dir} "
                                  "again to repair it")
    out = {"ids": ids, "embeddings": torch.cat(embeddings)}
    if lens:
        out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.long), torch.cat(lens).cumsum(0)])
    return out


# sentence-transformers' model types (config_sentence_transformers.json) the index command loads, and the class each
# loads into: the library loads a folder of another type into the class asked for by converting it (a multi-vector
# model opened as a SentenceTransformer loses its projection and scoring mask and gains a mean pooling); a PyLate
# ColBERT folder is a multi-vector model to sentence-transformers v6, which adds its scoring mask and normalisation
ST_CLASSES = {"SentenceTransformer": "SentenceTransformer", "MultiVectorEncoder": "MultiVectorEncoder",
              "ColBERT": "MultiVectorEncoder"}


def load_model(path: str, device: torch.device, dtype: torch.dtype):
    """A local checkpoint (no downloads): a sentence-transformers folder (``modules.json``) of a model type in
    :data:`ST_CLASSES`, loaded into the class it names, or a HF ModernBERT.

    Raises:
        PackedEncodersError: a sentence-transformers folder of another model type (a sparse or cross encoder), or
            whose ``config_sentence_transformers.json`` is not a JSON object."""
    if os.path.exists(os.path.join(path, "modules.json")):
        import sentence_transformers

        kind = "SentenceTransformer"  # (a folder with no model type: sentence-transformers' default)
        config = os.path.join(path, "config_sentence_transformers.json")
        if os.path.exists(config):
            advice = "sentence-transformers writes it as a JSON object when it saves a model"
            saved = _read_json(config, (), advice)
            if not isinstance(saved, dict):
                raise PackedEncodersError(f"{config}: holds a {type(saved).__name__}, not a JSON object; {advice}")
            kind = saved.get("model_type", kind)
        cls = getattr(sentence_transformers, ST_CLASSES.get(kind, "") if isinstance(kind, str) else "", None)
        if cls is None:
            raise PackedEncodersError(f"{path} holds a sentence-transformers {kind!r} ({config}); the index command "
                                      f"encodes {', '.join(ST_CLASSES)} folders and HF ModernBERT checkpoints")
        return cls(path, device=str(device), local_files_only=True).to(dtype).eval()
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                     local_files_only=True).to(device).eval()


def main(argv=None) -> int:
    import packed_encoders as pe

    ap = argparse.ArgumentParser(prog="python -m packed_encoders.index", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="local HF ModernBERT or sentence-transformers folder")
    ap.add_argument("--corpus", required=True, help="JSONL of {'id', 'input_ids'}")
    ap.add_argument("--out", required=True, help="output directory (resumes when it holds a run of this corpus)")
    ap.add_argument("--output", choices=OUTPUTS, default="pooled")
    ap.add_argument("--pooling", choices=POOLINGS, default=None,
                    help="mean (default) or cls: pools a bare ModernBERT checkpoint's output (--output pooled); "
                         "a sentence-transformers folder pools as its own modules say, and token vectors are not "
                         "pooled, so it is refused there")
    ap.add_argument("--batch-tokens", type=int, default=16384, help="real tokens per forward")
    ap.add_argument("--chunk-tokens", type=int, default=1 << 20,
                    help="tokens per chunk file, the unit dealt to ranks and of resumption (default 1,048,576: a "
                         "corpus of fewer than ranks x chunk tokens leaves ranks idle; lower it for small corpora)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                    help="model dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--out-dtype", choices=("bfloat16", "float16", "float32"), default="float32")
    ap.add_argument("--pad-id", type=int, default=None,
                    help="token id filling the padding of [B, S] batches (default: the model config's "
                         "pad_token_id); padding is masked, so the vectors do not depend on it")
    args = ap.parse_args(argv)
    for name in ("batch_tokens", "chunk_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(args, name)})")
    if not os.path.isfile(args.corpus):
        ap.error(f"--corpus {args.corpus}: no such file")
    if not os.path.isdir(args.model):
        ap.error(f"--model {args.model}: no such directory (a local checkpoint folder; nothing is downloaded)")

    import torch.distributed as dist

    distributed = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # set by torchrun
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if distributed:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    try:
        model = load_model(args.model, device, dtype)
    except PackedEncodersError as exc:
        ap.error(str(exc))
    why = pooling_problem(model, args.output, args.pooling)
    if why is not None:  # (before pack() and the corpus scan)
        ap.error(f"--pooling {args.pooling} has no effect here: {why}; leave --pooling out")
    pe.pack(model)
    pad_id = args.pad_id
    if pad_id is None:
        from .adapters.locate import find_encoders

        pad_id = getattr(find_encoders(model)[0][1].config, "pad_token_id", None) or 0
    try:
        manifest = index_corpus(model, args.corpus, args.out, output=args.output, pooling=args.pooling,
                                batch_tokens=args.batch_tokens, chunk_tokens=args.chunk_tokens,
                                out_dtype=getattr(torch, args.out_dtype), pad_id=pad_id)
    except PackedEncodersError as exc:  # (every rank raises rank 0's: all exit alike)
        print(f"packed_encoders.index: {exc}", file=sys.stderr)
        if distributed:
            dist.destroy_process_group()
        return 2
    if manifest is not None:
        print(f"{manifest['items']} items, {manifest['tokens']} tokens, {len(manifest['chunks'])} chunks -> {args.out}")
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
