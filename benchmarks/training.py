"""Training steps: stock HF vs ``torch.compile`` vs ``pe.pack`` vs fully packed, on real text, one process each.

Workloads (fp32 master weights, bf16 autocast on CUDA, AdamW lr 1e-4; step ``s`` gets the same texts in every
variant; ModernBERT's dropouts are 0, so the runs differ only by arithmetic):

===========  ==================================================================================================
workload     one step
===========  ==================================================================================================
single       16 NQ-open queries + 16 BoolQ 5-shot documents, mean pooling, in-batch InfoNCE (cosine x 20)
colbert      ColBERT GradCache: 32 queries, 128 documents (query i: positive 4i, negatives 4i+1..4i+3),
             hidden -> 128 projection (no bias), L2-normalised token vectors, MaxSim, cross-entropy over the
             128 documents; chunks of 16: a no-grad forward of every chunk, the loss and its gradients w.r.t.
             the token vectors, then per chunk a forward with grad and ``backward`` of the cached gradients
long         8 queries + 8 long documents (2-9 BoolQ 5-shot prompts concatenated, cut at 8,192 tokens), as
             ``single``
===========  ==================================================================================================

Variants (each in a fresh process per workload, cold inductor cache):

=================  ================================================================================================
hf_sdpa            stock ``ModernBertModel`` (sdpa), padded batches (dynamic padding, as collators pad)
hf_eager           the same with HF's eager attention: a second stock implementation, whose loss curve against
                   ``hf_sdpa`` is the bf16 noise the packed variants' curves are judged by
compile            the same model after ``model.compile(dynamic=True)`` (default mode: max-autotune's training
                   compile does not fit a 10-minute run); compile time is in ``warmup_s`` / ``wall_s``
pack               ``pe.pack(model)``, the same padded calls
pack_train_graphs  ``pe.pack(model, cuda_graph=pe.GraphConfig(training=True))``: training CUDA graphs, the same
                   padded calls (``long``: ``max_seqlen`` / ``max_tokens`` raised to its documents,
                   :func:`train_graph_config`)
packed             ``pe.pack(model)``, then ``pe.packed_forward`` on padding-free batches
pack_varlen        ``pe.pack(model, attention_backend="varlen", validate=False)``: torch's FlashAttention-2 on every
                   layer whatever the policy prefers (the attention A/B against ``pack``; CUDA; runs only when
                   ``--variants`` names it; validation cannot run a named flash backend on fp32 weights outside
                   autocast)
st_sdpa / st_pack  sentence-transformers' ``SentenceTransformerTrainer`` + ``MultipleNegativesRankingLoss``
                   (workloads single / long), stock or packed; bf16 via the trainer (``bf16=True``)
pylate_sdpa /      PyLate's ``ColBERT`` (projection to 128) + ``losses.CachedContrastive(mini_batch_size=16)`` in the
pylate_pack        plain loop (workload colbert), stock or packed, on the same ids (no ``[Q]`` / ``[D]`` markers, no
                   query expansion, empty skiplist); skipped where pylate does not import
=================  ================================================================================================

A variant may name another source tree of the package: ``pack@/path/to/tree`` runs ``pack`` as above (its calls,
its child environment, its skip rules) with ``packed_encoders`` imported from that tree (e.g. ``git worktree add
/tmp/before <commit>``; the child checks where the package came from), so code before and after a change are
trained by the same harness in one run, on the same texts. Its rows keep the whole spec as ``variant`` (a table
line of their own, ratios against the run's ``hf_sdpa``) and carry ``code_dir``, ``code_sha`` and ``package_file``.

Every plain-loop variant computes the loss with the same code from packed token vectors
(:mod:`packed_encoders.pooling`): padded outputs are gathered to their real tokens first, so variants differ only
in the encoder.

Measured per (workload, variant): ``step_ms`` per timed step (wall clock, the step synchronised at its end:
forward, loss, backward, ``optimizer.step``, ``zero_grad``), its median; ``wall_s`` (model load -> last timed
step: pack / compile / capture and warm-up included; imports excluded); peak reserved / allocated memory over the
timed steps (warm-up separately);
the loss of every step. Then ``--profile-steps`` more steps under ``torch.profiler``:

* ``gpu_ms_per_step``: the sum of the device time of every kernel, memcpy and memset of those steps / steps
  (busy GPU time; idle gaps between launches are not counted). Spans the profiler draws on the GPU's timeline for a
  ``record_function`` range (``Optimizer.step#AdamW.step``: the span of the optimizer's kernels) are not kernels
  and are left out: counted, they would add the optimizer's kernels a second time.
* ``host_ms_per_step``: the CPU wall time of the step's Python and dispatch: from the step's start until its last
  call returns (before the closing synchronize), minus the time the CPU spent blocked on the GPU inside the step
  (``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaEventSynchronize`` and blocking ``cudaMemcpy*``
  as the profiler records them), / steps. It includes the profiler's own per-op overhead (a few us per op).
* ``host_timer_ms_median``: the same span measured without the profiler, over the timed steps (host timers,
  median): no profiler overhead, but any wait on the GPU inside the step counts (e.g. a padded call's length
  read, which waits for the work queued before it).
* ``top_device_ms_per_step`` (in ``profile``): the 40 kernels with the most device time, ms and calls per step.
* ``gpu_idle_ms_per_step`` and ``idle_gaps`` (in ``profile``, plain-loop variants): the time the GPU waits inside a
  step's device span and the 10 places with the most of it, each named by the kernels on either side
  (:func:`benchmarks.common.device_idle`): where a step that should be GPU-bound waits on its host. Measured under
  the profiler, whose per-op host cost makes the gaps larger than in an unprofiled step.

    python -m benchmarks.training --workloads single --config modernbert-base      # one workload, all variants
    python -m benchmarks.training --quick                                           # 12 steps, a few minutes
    python -m benchmarks.training --quick --device cpu --config tiny               # CPU smoke run
    python -m benchmarks.training --workloads colbert --variants hf_sdpa,pack,pack@/tmp/before   # before / after
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.common import ROOT, device_work

# A child training with another tree's package (``NAME@DIR``, its hidden ``--code DIR``) puts that tree first before
# anything imports packed_encoders (the imports above do not): the package cannot be swapped once imported.
if __name__ == "__main__":
    common.code_tree_first(sys.argv)

VARIANTS = ("hf_sdpa", "hf_eager", "compile", "pack", "pack_train_graphs", "packed", "st_sdpa", "st_pack",
            "pylate_sdpa", "pylate_pack")
NAMED_VARIANTS = ("pack_varlen",)  # run only when --variants names them
TRAINER_VARIANTS = ("st_sdpa", "st_pack")
PYLATE_VARIANTS = ("pylate_sdpa", "pylate_pack")
QUICK_CPU_VARIANTS = ("hf_sdpa", "pack", "packed")
LR, INFONCE_SCALE, COLBERT_DIM = 1e-4, 20.0, 128


@dataclass
class Workload:
    """``queries`` + ``docs`` texts per step (``docs_per_query`` documents each), pooled by ``pooling``;
    ``chunk``: GradCache chunk size (``None``: one forward per side with grad); ``max_doc_tokens`` / ``concat``:
    documents are ``concat`` (lo, hi) cached documents joined, their last ``max_doc_tokens`` kept."""

    name: str
    queries: int
    docs_per_query: int
    pooling: str  # "mean" or "maxsim"
    chunk: int | None = None
    max_doc_tokens: int = 2048
    concat: tuple[int, int] = (1, 1)

    @property
    def docs(self) -> int:
        return self.queries * self.docs_per_query


def train_graph_config(wl: Workload):
    """The training-graph config for ``wl``: the defaults, with ``max_seqlen`` and ``max_tokens`` raised to cover a
    call of the workload's longest documents where they pass the defaults (2,048 tokens; ``long``), as a user
    training on such documents sets them."""
    import packed_encoders as pe

    config = pe.GraphConfig(training=True)
    if wl.max_doc_tokens <= config.max_seqlen:
        return config
    per_call = wl.docs if wl.chunk is None else min(wl.chunk, wl.docs)
    return pe.GraphConfig(training=True, max_seqlen=wl.max_doc_tokens, max_tokens=per_call * wl.max_doc_tokens)


def workloads(names: str, quick_cpu: bool) -> list[Workload]:
    full = {"single": Workload("single", 16, 1, "mean"),
            "colbert": Workload("colbert", 32, 4, "maxsim", chunk=16),
            "long": Workload("long", 8, 1, "mean", max_doc_tokens=8192, concat=(2, 9))}
    tiny = {"single": Workload("single", 4, 1, "mean", max_doc_tokens=256),
            "colbert": Workload("colbert", 4, 4, "maxsim", chunk=4, max_doc_tokens=128),
            "long": Workload("long", 2, 1, "mean", max_doc_tokens=512, concat=(2, 3))}
    table = tiny if quick_cpu else full
    out = []
    for n in (x.strip() for x in names.split(",") if x.strip()):
        if n not in table:
            raise SystemExit(f"unknown workload {n!r}; choose from {', '.join(table)}")
        out.append(table[n])
    return out


# --------------------------------------------------------------------------------------------- data

def _permutation(n_total: int, n: int, seed: int) -> np.ndarray:
    """``n`` indices: a seeded permutation of the set, repeated if the run needs more than the set holds."""
    rng = np.random.default_rng(seed)
    reps = -(-n // n_total)
    return np.concatenate([rng.permutation(n_total) for _ in range(reps)])[:n]


def step_texts(corpus, wl: Workload, steps: int, seed: int) -> list[tuple[list, list]]:
    """Per step, ``(queries, documents)`` as lists of int64 id arrays (``[CLS] ... [SEP]``); the same for every
    variant."""
    q_set, d_set = corpus["queries"], corpus["long"]
    qi = _permutation(len(q_set), steps * wl.queries, seed)
    rng = np.random.default_rng(seed + 1)
    counts = rng.integers(wl.concat[0], wl.concat[1] + 1, size=steps * wl.docs)
    di = _permutation(len(d_set), int(counts.sum()), seed + 2)
    cls_id, sep_id = int(corpus.meta["cls_id"]), int(corpus.meta["sep_id"])
    docs, at = [], 0
    for c in counts:
        parts = [np.asarray(d_set[int(i)][1:-1], dtype=np.int64) for i in di[at:at + c]]
        at += c
        # the end of a longer body: BoolQ 5-shot prompts open with the same few-shot examples (~800 tokens), so cut
        # at their start the documents of a small max_doc_tokens would all be one text
        body = np.concatenate(parts)[-(wl.max_doc_tokens - 2):]
        docs.append(np.concatenate([[cls_id], body, [sep_id]]).astype(np.int64))
    queries = [np.asarray(q_set[int(i)], dtype=np.int64) for i in qi]
    return [(queries[s * wl.queries:(s + 1) * wl.queries], docs[s * wl.docs:(s + 1) * wl.docs])
            for s in range(steps)]


@dataclass
class Chunk:
    """One encoder call's sequences, padded (``ids`` / ``mask`` ``[B, S]``, ``real`` int64 ``[T]`` flat positions of
    the real tokens) and packed (``packed``: :class:`benchmarks.common.PackedInputs`), all on the device."""

    ids: torch.Tensor
    mask: torch.Tensor
    real: torch.Tensor
    packed: common.PackedInputs


def make_chunk(seqs: list[np.ndarray], pad: int, device: str) -> Chunk:
    b = common.padded_batch(seqs, pad, device)
    width = b.input_ids.shape[1]
    real = np.concatenate([row * width + np.arange(len(s)) for row, s in enumerate(seqs)]).astype(np.int64)
    return Chunk(b.input_ids, b.attention_mask, torch.from_numpy(real).to(device), common.packed_inputs(seqs, device))


@dataclass
class StepBatch:
    """A step's query and document chunks (one chunk per side without GradCache) and each side's ``cu_seqlens``
    over all its chunks (int32, device), for the loss."""

    queries: list[Chunk]
    docs: list[Chunk]
    q_cu: torch.Tensor
    d_cu: torch.Tensor
    tokens: int
    padded_tokens: int


def make_step(queries, docs, wl: Workload, pad: int, device: str) -> StepBatch:
    def split(seqs):
        size = wl.chunk or len(seqs)
        return [make_chunk(seqs[i:i + size], pad, device) for i in range(0, len(seqs), size)]

    def cu(seqs):
        out = np.zeros(len(seqs) + 1, dtype=np.int32)
        np.cumsum([len(s) for s in seqs], out=out[1:])
        return torch.from_numpy(out).to(device)

    qc, dc = split(queries), split(docs)
    chunks = qc + dc
    return StepBatch(qc, dc, cu(queries), cu(docs), sum(c.packed.n_tokens for c in chunks),
                     sum(int(c.ids.numel()) for c in chunks))


# ------------------------------------------------------------------------------------------- losses

def info_nce(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """In-batch InfoNCE on cosine similarity x 20 (MultipleNegativesRankingLoss), fp32: ``[N, H]`` x2 -> scalar."""
    q, d = F.normalize(q.float(), dim=-1), F.normalize(d.float(), dim=-1)
    return F.cross_entropy(INFONCE_SCALE * q @ d.t(), torch.arange(q.shape[0], device=q.device))


def colbert_loss(q: torch.Tensor, q_cu: torch.Tensor, d: torch.Tensor, d_cu: torch.Tensor, per_query: int):
    """Cross-entropy over MaxSim scores ``[Nq, Nd]``; query ``i``'s positive is document ``per_query * i``."""
    from packed_encoders.pooling import maxsim

    scores = maxsim(q, q_cu, d, d_cu)
    labels = torch.arange(scores.shape[0], device=scores.device) * per_query
    return F.cross_entropy(scores, labels)


# ------------------------------------------------------------------------------------------ the step

class Trainee:
    """The model of one variant plus the loss head: ``encode(chunk) -> [T, H]`` and ``step(batch) -> loss``."""

    def __init__(self, variant: str, wl: Workload, model_dir: str, device: str):
        from transformers import AutoModel

        import packed_encoders as pe

        self.variant, self.wl, self.device = variant, wl, device
        self.notes: list[str] = []
        torch.manual_seed(0)
        attention = "eager" if variant == "hf_eager" else "sdpa"
        model = AutoModel.from_pretrained(model_dir, attn_implementation=attention, dtype=torch.float32,
                                          local_files_only=True)
        self.model = model.to(device).train()
        params = list(self.model.parameters())
        self.proj = None
        if wl.pooling == "maxsim":
            torch.manual_seed(0)  # the same random projection in every process
            self.proj = torch.nn.Linear(model.config.hidden_size, COLBERT_DIM, bias=False).to(device)
            params += list(self.proj.parameters())
        self.opt = torch.optim.AdamW(params, lr=LR)
        t0 = time.perf_counter()
        self.info: dict = {}
        if variant == "compile":
            self.model.compile(dynamic=True)
            self.info["compile"] = {"mode": "default", "dynamic": True, "target": type(model).__name__}
        elif variant == "pack_train_graphs":
            config = train_graph_config(wl)
            pe.pack(self.model, cuda_graph=config)
            self.info["graph_config"] = {"max_seqlen": config.max_seqlen, "max_tokens": config.max_tokens}
        elif variant in ("pack", "packed"):
            pe.pack(self.model)
        elif variant == "pack_varlen":
            pe.pack(self.model, attention_backend="varlen", validate=False)
        self.setup_s = time.perf_counter() - t0
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
                         else nullcontext())

    def encode(self, c: Chunk) -> torch.Tensor:
        """Token vectors ``[T, H]`` (``[T, 128]`` normalised for ColBERT) of the chunk's real tokens."""
        import packed_encoders as pe

        if self.variant == "packed":
            b = c.packed
            x = pe.packed_forward(self.model, None, b.input_ids, b.cu_seqlens, b.max_seqlen, b.position_ids)
        else:
            h = self.model(input_ids=c.ids, attention_mask=c.mask).last_hidden_state
            x = h.flatten(0, 1).index_select(0, c.real)
        if self.proj is not None:
            x = F.normalize(self.proj(x).float(), dim=-1)
        return x

    def loss(self, q: torch.Tensor, d: torch.Tensor, b: StepBatch) -> torch.Tensor:
        from packed_encoders.pooling import mean_pool

        if self.wl.pooling == "mean":
            return info_nce(mean_pool(q, b.q_cu), mean_pool(d, b.d_cu))
        return colbert_loss(q, b.q_cu, d, b.d_cu, self.wl.docs_per_query)

    def step(self, b: StepBatch) -> torch.Tensor:
        if self.wl.chunk is None:
            with self.autocast:
                loss = self.loss(self.encode(b.queries[0]), self.encode(b.docs[0]), b)
            loss.backward()
        else:  # GradCache
            chunks = b.queries + b.docs
            with torch.no_grad(), self.autocast:
                reps = [self.encode(c).detach().requires_grad_() for c in chunks]
            nq = len(b.queries)
            loss = self.loss(torch.cat(reps[:nq]), torch.cat(reps[nq:]), b)
            loss.backward()
            for c, r in zip(chunks, reps):
                with self.autocast:
                    x = self.encode(c)
                x.backward(r.grad.to(x.dtype))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


class PyLateTrainee:
    """PyLate's ColBERT and CachedContrastive loss, driven by the plain loop: ``step(batch) -> loss``."""

    def __init__(self, variant: str, wl: Workload, model_dir: str, device: str):
        from pylate import losses, models

        import packed_encoders as pe

        self.variant, self.wl, self.device, self.info = variant, wl, device, {}
        torch.manual_seed(0)
        self.colbert = models.ColBERT(model_name_or_path=model_dir, embedding_size=COLBERT_DIM, device=device,
                                      skiplist_words=[], model_kwargs={"attn_implementation": "sdpa",
                                                                       "dtype": torch.float32})
        self.colbert.train()
        self.model = self.colbert[0].auto_model
        self._restore_vocabulary(model_dir)
        self.loss_fn = losses.CachedContrastive(self.colbert, mini_batch_size=wl.chunk or wl.queries)
        self.opt = torch.optim.AdamW(self.colbert.parameters(), lr=LR)
        self.notes = ["PyLate's own MaxSim / loss; ids as the other variants get them (no [Q]/[D], no expansion)"]
        t0 = time.perf_counter()
        if variant == "pylate_pack":
            pe.pack(self.colbert)
        self.setup_s = time.perf_counter() - t0
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda")
                         else nullcontext())

    def _restore_vocabulary(self, model_dir: str) -> None:
        """PyLate sizes the embedding table to its tokenizer after adding [Q] / [D]; the benchmark's placeholder
        tokenizer is tiny, so put back the saved table (the same weights as every other variant)."""
        from transformers import AutoModel

        saved = AutoModel.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
        weight = saved.get_input_embeddings().weight
        if self.model.get_input_embeddings().weight.shape != weight.shape:
            self.model.resize_token_embeddings(weight.shape[0], mean_resizing=False)
            with torch.no_grad():
                self.model.get_input_embeddings().weight.copy_(weight)

    def step(self, b: StepBatch) -> torch.Tensor:
        def features(chunks):
            width = max(c.ids.shape[1] for c in chunks)
            ids = torch.cat([F.pad(c.ids, (0, width - c.ids.shape[1])) for c in chunks])
            mask = torch.cat([F.pad(c.mask, (0, width - c.mask.shape[1])) for c in chunks])
            return ids, mask

        q_ids, q_mask = features(b.queries)
        d_ids, d_mask = features(b.docs)
        k = self.wl.docs_per_query  # PyLate's layout: [anchors, positives, negatives 1..k-1], one row per query
        feats = [{"input_ids": q_ids, "attention_mask": q_mask}]
        feats += [{"input_ids": d_ids[j::k], "attention_mask": d_mask[j::k]} for j in range(k)]
        with self.autocast:  # the cached re-forward runs inside backward
            loss = self.loss_fn(feats)
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


# -------------------------------------------------------------------------------------- profiling

_BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
             "cudaMemcpyAsync")


STEP_RANGE = "benchmarks.training.step"  # the profiler range around each profiled step (where its GPU work starts)


def profile_steps(run_step, n: int, device: str) -> dict:
    """Run ``n`` steps under ``torch.profiler``; host / GPU ms per step as defined in the module docstring."""
    host = []
    with _profiler(device) as prof:
        for _ in range(n):
            common.synchronize(device)
            t0 = time.perf_counter()
            with torch.profiler.record_function(STEP_RANGE):
                run_step()
            host.append(time.perf_counter() - t0)
            common.synchronize(device)
    return _profile_summary(prof, host, device.startswith("cuda"))


def _profiler(device: str):
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else []))


def _profile_summary(prof, host_s: list[float], cuda: bool) -> dict:
    """``host_s``: per profiled step, seconds from its start until its last call returned (before the sync)."""
    from torch.autograd import DeviceType

    events = prof.events()
    n = len(host_s)
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    device_events = device_work(events)
    starts = sorted(e.time_range.start for e in cpu if e.name == STEP_RANGE)
    # an asynchronous host-to-device copy returns at once; a cudaMemcpyAsync that lasts waits for the GPU
    blocked_us = sum(e.time_range.elapsed_us() for e in cpu if e.name in _BLOCKING
                     and (e.name != "cudaMemcpyAsync" or e.time_range.elapsed_us() > 20))
    return {"profiled_steps": n, "host_ms_per_step": (sum(host_s) * 1e3 - blocked_us / 1e3) / n,
            "blocked_ms_per_step": blocked_us / 1e3 / n,
            "gpu_ms_per_step": sum(e.time_range.elapsed_us() for e in device_events) / 1e3 / n if cuda else None,
            "gpu_kernels_only": True,  # rows without it counted Optimizer.step's GPU span too (render.gpu_ms)
            "device_events_per_step": len(device_events) / n,
            "aten_ops_per_step": sum(e.name.startswith("aten::") for e in cpu) / n,
            "top_device_ms_per_step": _top_device(device_events, n) if cuda else None,
            # (steps run by the trainer's own loop carry no STEP_RANGE: their idle is not split by step)
            **(common.device_idle(device_events, starts) if cuda and starts else {})}


def _top_device(device_events, n: int, top: int = 40) -> list[dict]:
    """The ``top`` kernels (memcpys, memsets) by device time: ``{name (first 120 characters), ms, calls}`` per
    step, where the GPU time of a step goes."""
    totals: dict[str, list] = {}
    for e in device_events:
        t = totals.setdefault(e.name[:120], [0.0, 0])
        t[0] += e.time_range.elapsed_us()
        t[1] += 1
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": k, "ms": round(us / 1e3 / n, 3), "calls": round(c / n, 1)} for k, (us, c) in ranked]


# ------------------------------------------------------------------------------------------- child

def run_child(args) -> int:
    from benchmarks.data import load_corpus, length_stats
    from benchmarks.models import config_summary

    device = args.device
    spec = json.loads(args.workload_json)
    wl = Workload(**{**spec, "concat": tuple(spec["concat"])})
    corpus = load_corpus(args.tokens, build=False)
    if device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    env = common.environment(device)
    import transformers  # noqa: F401 - imported before the clock starts, as the trainer variants import it

    pe = common.import_package(args.code)
    t_start = time.perf_counter()
    if args.variant in TRAINER_VARIANTS:
        return run_trainer_child(args, wl, corpus, env)
    trainee = (PyLateTrainee if args.variant in PYLATE_VARIANTS else Trainee)(args.variant, wl, args.model_dir,
                                                                             device)
    config = trainee.model.config
    pad = int(config.pad_token_id or 0)
    total = args.warmup + args.steps + args.profile_steps
    texts = step_texts(corpus, wl, total, args.seed)
    top = max(int(max(s.max() for s in q + d)) for q, d in texts)
    if top >= config.vocab_size:
        raise SystemExit(f"cached ids reach {top} but the vocabulary is {config.vocab_size}")
    batches = [make_step(q, d, wl, pad, device) for q, d in texts]
    losses, step_s = [], []
    common.reset_memory(device)

    def one(i):
        return trainee.step(batches[i])

    t_warm = time.perf_counter()
    first_step_s = None
    for i in range(args.warmup):
        losses.append(one(i))
        common.synchronize(device)
        if i == 0:
            first_step_s = time.perf_counter() - t_warm
    warmup_s = time.perf_counter() - t_warm
    memory = {f"{k.removesuffix('_bytes')}_warmup_bytes": v for k, v in common.peak_memory(device).items()}
    common.reset_memory(device)
    host_s = []
    for i in range(args.warmup, args.warmup + args.steps):
        common.synchronize(device)
        t0 = time.perf_counter()
        losses.append(one(i))
        host_s.append(time.perf_counter() - t0)
        common.synchronize(device)
        step_s.append(time.perf_counter() - t0)
    memory.update(common.peak_memory(device))
    wall_s = time.perf_counter() - t_start
    at = [args.warmup + args.steps]

    def next_step():
        losses.append(one(at[0]))
        at[0] += 1

    prof = profile_steps(next_step, args.profile_steps, device) if args.profile_steps else {}
    describe = None
    if args.variant not in ("hf_sdpa", "hf_eager", "compile", "pylate_sdpa"):
        describe = pe.describe(trainee.model)["encoders"]
    ms = [s * 1e3 for s in step_s]
    row = {
        "runner": "training", "workload": wl.name, "variant": args.variant, "status": "ok",
        "model": args.model_label, "config": config_summary(config), "workload_spec": asdict(wl),
        "precision": "fp32 master weights + bf16 autocast" if device.startswith("cuda") else "fp32",
        "optimizer": f"AdamW(lr={LR})", "warmup_steps": args.warmup, "timed_steps": args.steps,
        "step_ms": ms, "step_ms_median": statistics.median(ms), "step_ms_min": min(ms), "step_ms_max": max(ms),
        "first_step_s": first_step_s, "warmup_s": warmup_s, "setup_s": trainee.setup_s, "wall_s": wall_s,
        "peak_reserved_bytes": None, **memory, "host_ms_per_step": prof.get("host_ms_per_step"),
        "host_timer_ms_median": statistics.median(host_s) * 1e3, "gpu_ms_per_step": prof.get("gpu_ms_per_step"),
        "profile": prof, "losses": [float(x) for x in losses],
        "tokens_per_step": statistics.mean(b.tokens for b in batches),
        "padded_tokens_per_step": statistics.mean(b.padded_tokens for b in batches),
        "doc_lengths": length_stats([len(d) for _, ds in texts for d in ds]),
        "query_lengths": length_stats([len(q) for qs, _ in texts for q in qs]),
        "describe": describe, "notes": trainee.notes, **trainee.info, **common.code_fields(args.code, pe),
        "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    common.write_rows(Path(args.row_out), [row])
    return 0


def run_trainer_child(args, wl: Workload, corpus, env) -> int:
    """sentence-transformers' trainer + MultipleNegativesRankingLoss on pre-tokenized ids (stock or packed)."""
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer import losses
    from transformers import TrainerCallback

    import packed_encoders as pe
    from benchmarks.data import length_stats
    from benchmarks.models import _st_transformer, config_summary
    from sentence_transformers.sentence_transformer.modules import Pooling

    if wl.pooling != "mean":
        raise SystemExit(f"{args.variant} runs the single-vector workloads only")
    device, t_start = args.device, time.perf_counter()
    cuda = device.startswith("cuda")
    tr = _st_transformer(args.model_dir, "sdpa", torch.float32)
    model = SentenceTransformer(modules=[tr, Pooling(tr.get_embedding_dimension(), "mean")], device=device)
    t0 = time.perf_counter()
    if args.variant == "st_pack":
        pe.pack(model)
    setup_s = time.perf_counter() - t0
    config = tr.auto_model.config
    pad = int(config.pad_token_id or 0)
    total = args.warmup + args.steps + args.profile_steps
    texts = step_texts(corpus, wl, total, args.seed)
    data = Dataset.from_dict({"anchor": [q.tolist() for qs, _ in texts for q in qs],
                              "positive": [d.tolist() for _, ds in texts for d in ds]})

    def collate(features):  # dynamic padding of pre-tokenized ids, as the trainer's collator pads
        out = {}
        for col in ("anchor", "positive"):
            b = common.padded_batch([np.asarray(f[col], dtype=np.int64) for f in features], pad, "cpu")
            out[f"{col}_input_ids"], out[f"{col}_attention_mask"] = b.input_ids, b.attention_mask
        return out

    loss = losses.MultipleNegativesRankingLoss(model, scale=INFONCE_SCALE)
    step_losses, marks, host_marks, memory = [], [], [], {}
    loss.register_forward_hook(lambda m, i, o: step_losses.append(o.detach()))
    prof_state: dict = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            common.synchronize(device)
            if state.global_step == args.warmup:
                memory.update({f"{k.removesuffix('_bytes')}_warmup_bytes": v
                               for k, v in common.peak_memory(device).items()})
                memory["warmup_s"] = time.perf_counter() - t_start
                common.reset_memory(device)
            if state.global_step == args.warmup + args.steps and args.profile_steps:
                memory.update(common.peak_memory(device))
                prof_state["prof"] = _profiler(device)
                prof_state["prof"].__enter__()
            marks.append(time.perf_counter())

        def on_step_end(self, a, state, control, **kw):
            host_marks.append(time.perf_counter() - marks[-1])
            common.synchronize(device)
            marks[-1] = time.perf_counter() - marks[-1]

    targs = SentenceTransformerTrainingArguments(
        output_dir=str(Path(args.row_out).parent / f"st-{wl.name}"), per_device_train_batch_size=wl.queries,
        max_steps=total, learning_rate=LR, warmup_steps=0, lr_scheduler_type="constant", seed=0, data_seed=0,
        max_grad_norm=0.0, bf16=cuda, use_cpu=not cuda, report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, disable_tqdm=True, remove_unused_columns=False, optim="adamw_torch",
        weight_decay=0.01)
    trainer = SentenceTransformerTrainer(model=model, args=targs, train_dataset=data, loss=loss,
                                         data_collator=collate, callbacks=[Timer()])
    trainer.get_train_dataloader = _sequential_loader(trainer, data, collate, wl.queries)
    trainer.train()
    prof = {}
    if "prof" in prof_state:
        prof_state["prof"].__exit__(None, None, None)
        prof = _profile_summary(prof_state["prof"], host_marks[-args.profile_steps:], cuda)
    else:
        memory.update(common.peak_memory(device))
    wall_s = time.perf_counter() - t_start
    ms = [s * 1e3 for s in marks[args.warmup:args.warmup + args.steps]]
    row = {
        "runner": "training", "workload": wl.name, "variant": args.variant, "status": "ok",
        "model": args.model_label, "config": config_summary(config), "workload_spec": asdict(wl),
        "precision": "fp32 master weights + bf16 autocast (trainer bf16=True)" if cuda else "fp32",
        "optimizer": f"AdamW(lr={LR}, weight_decay=0.01) via the trainer", "warmup_steps": args.warmup,
        "timed_steps": args.steps, "step_ms": ms, "step_ms_median": statistics.median(ms),
        "step_ms_min": min(ms), "step_ms_max": max(ms), "first_step_s": marks[0] if marks else None,
        "warmup_s": memory.pop("warmup_s", None), "setup_s": setup_s, "wall_s": wall_s,
        "peak_reserved_bytes": None, **memory,
        "host_ms_per_step": prof.get("host_ms_per_step"), "gpu_ms_per_step": prof.get("gpu_ms_per_step"),
        "host_timer_ms_median": (statistics.median(host_marks[args.warmup:args.warmup + args.steps]) * 1e3
                                 if len(host_marks) >= args.warmup + args.steps else None),
        "profile": prof, "losses": [float(x) for x in step_losses],
        "doc_lengths": length_stats([len(d) for _, ds in texts for d in ds]),
        "query_lengths": length_stats([len(q) for qs, _ in texts for q in qs]),
        "describe": pe.describe(model)["encoders"] if args.variant == "st_pack" else None,
        "notes": ["step time includes the trainer's own per-step work (collate, accelerate, callbacks)"],
        **common.code_fields(args.code, pe), "env": env, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    common.write_rows(Path(args.row_out), [row])
    return 0


def _sequential_loader(trainer, data, collate, batch):
    """The trainer's loader without shuffling, so step ``s`` sees the plain loop's step-``s`` texts."""
    from torch.utils.data import DataLoader

    return lambda *a, **k: trainer.accelerator.prepare(DataLoader(data, batch_size=batch, shuffle=False,
                                                                  collate_fn=collate, drop_last=True))


# ------------------------------------------------------------------------------------------ parent

def why_skip(variant: str, wl: Workload, device: str, quick_cpu: bool, explicit: bool) -> str | None:
    import importlib.util

    if variant in PYLATE_VARIANTS:
        if wl.pooling != "maxsim":
            return "the PyLate variants run the ColBERT workload"
        if importlib.util.find_spec("pylate") is None:
            return "pylate is not installed here (stage its wheels to run it)"
    if variant in TRAINER_VARIANTS:
        if wl.pooling != "mean":
            return "the sentence-transformers trainer variants run the single-vector workloads (single, long)"
        if importlib.util.find_spec("sentence_transformers") is None:
            return "sentence-transformers is not installed"
    if variant == "pack_varlen" and not device.startswith("cuda"):
        return "torch varlen needs CUDA"
    if variant == "compile" and quick_cpu and not explicit:
        return "skipped under --quick on CPU: torch.compile builds C++ kernels for minutes"
    if quick_cpu and not explicit and variant not in QUICK_CPU_VARIANTS:
        return f"not in the --quick CPU smoke sweep ({', '.join(QUICK_CPU_VARIANTS)}); name it in --variants"
    return None


def run_parent(args) -> int:
    from benchmarks import render
    from benchmarks.models import model_dir_for

    device = common.device_of(args.device)
    quick_cpu = args.quick and device == "cpu"
    if args.steps is None:
        args.steps = 3 if quick_cpu else 10 if args.quick else 47
    if args.warmup is None:
        args.warmup = 1 if quick_cpu else 2 if args.quick else 3
    if args.profile_steps is None:
        args.profile_steps = 1 if quick_cpu else 3
    if args.steps < 20 and not args.quick:
        print(f"note: --steps {args.steps} < 20 (the protocol asks for >= 20 timed steps)", file=sys.stderr)
    wls = workloads(args.workloads, quick_cpu)
    specs = [common.parse_variant(v, VARIANTS + NAMED_VARIANTS)
             for v in (args.variants or ",".join(VARIANTS)).split(",") if v.strip()]
    try:
        from benchmarks.data import load_corpus

        load_corpus(args.tokens, build=False)
    except FileNotFoundError as exc:
        raise SystemExit(f"{exc}\n(the GPU machine has no network: build the cache here and carry "
                         "benchmarks/.cache/tokens.npz)") from None
    env = common.environment(device)
    work = Path(tempfile.mkdtemp(prefix="pe-training-"))
    t_start = time.perf_counter()
    try:
        model_dir, label = model_dir_for(args, work, torch.float32)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        run_id = args.run_id or f"{label}@{stamp}"
        print(f"training: {label} on {env.get('gpu', device)}; torch {env['torch']}, transformers "
              f"{env['transformers']}, git {env['git_sha']}; run {run_id}; {args.warmup} warm-up + {args.steps} timed "
              f"+ {args.profile_steps} profiled steps")
        missing = common.missing_kit(env)
        if missing:
            print(f"WARNING: {', '.join(missing)} not installed on this {env.get('capability')} GPU: packed variants "
                  "run without quack GEMMs / FA4 / CuteDSL (check PYTHONPATH)", file=sys.stderr)
        path = Path(args.out) / f"training_{label.replace(':', '-')}_{stamp}.jsonl"
        partial = path.with_suffix(".jsonl.partial")
        command = " ".join([os.path.basename(sys.executable), "-m", "benchmarks.training"] + sys.argv[1:])
        rows = []
        for wl in wls:
            for spec, name, code in specs:
                base = {"runner": "training", "workload": wl.name, "variant": spec, "model": label, "env": env,
                        "run_id": run_id, "command": command}
                if code:
                    base.update(code_dir=code, code_sha=common.git_sha(code))
                reason = why_skip(name, wl, device, quick_cpu, bool(args.variants))
                if reason:
                    row = {**base, "status": "skipped", "reason": reason}
                    print(f"  [{wl.name}/{spec}] skipped: {reason}")
                else:
                    row = _spawn(args, work, model_dir, label, wl, name, code, device, base)
                common.write_rows(partial, [row])
                rows.append(row)
        common.finish_rows(path, partial, rows, t_start)
        print(render.training_markdown(rows))
        return 0 if all(r["status"] != "error" for r in rows) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _spawn(args, work, model_dir, label, wl, name, code, device, base) -> dict:
    """Run variant ``name`` (with the package of the tree ``code``, if given) on ``wl`` in a child process: its
    row, or an error row; ``base``: the row's fields from the parent (``variant`` is the full spec)."""
    spec = base["variant"]
    row_out = work / f"row-{wl.name}-{common.file_name(spec)}.jsonl"
    argv = ["benchmarks.training", "--child", "--variant", name, "--model-dir", model_dir, "--model-label", label,
            "--row-out", str(row_out), "--workload-json", json.dumps(asdict(wl)), "--device", device,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile-steps", str(args.profile_steps),
            "--seed", str(args.seed), "--cpu-threads", str(args.cpu_threads)]
    if args.tokens:
        argv += ["--tokens", args.tokens]
    if code:
        argv += ["--code", code]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-{wl.name}-{common.file_name(spec)}"),
           "TOKENIZERS_PARALLELISM": "false"}
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(args.cpu_threads)
    rc, tail, secs = common.run_child(argv, args.timeout, env)
    if rc != 0 or not row_out.exists():
        reason = tail.strip().splitlines()[-1] if tail.strip() else f"exit code {rc}"
        print(f"  [{wl.name}/{spec}] ERROR (exit {rc}): {reason}")
        return {**base, "status": "error", "reason": reason, "log_tail": tail[-2000:]}
    # the child knows its variant by NAME and its own environment; the row names the full spec
    row = {**common.read_rows([row_out])[0], **{k: base[k] for k in ("variant", "run_id", "command", "code_sha")
                                                if k in base}, "process_wall_s": round(secs, 1)}
    print(f"  [{wl.name}/{spec}] {row['step_ms_median']:,.1f} ms/step (host {_ms(row['host_ms_per_step'])}, "
          f"GPU {_ms(row['gpu_ms_per_step'])}), first loss {row['losses'][0]:.4f}, "
          f"peak reserved {(row.get('peak_reserved_bytes') or 0) / 2**30:.2f} GiB, wall {row['wall_s']:.0f} s")
    return row


def _ms(x) -> str:
    return "-" if x is None else f"{x:,.1f} ms"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"),
                    help="directory for JSON rows (default: the untracked benchmarks/results; committed H200 rows go "
                         "in benchmarks/results/h200)")
    ap.add_argument("--quick", action="store_true", help="12 steps per variant (CPU: tiny workloads, 3 steps)")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--config", default="modernbert-base", help="random-init geometry (benchmarks/models.py), "
                                                                "e.g. modernbert-large")
    ap.add_argument("--model", default=None, help="local checkpoint directory instead of a random model")
    ap.add_argument("--workloads", default="single,colbert,long", help="comma list of single, colbert, long")
    ap.add_argument("--variants", default=None,
                    help=f"comma list (default: all of {', '.join(VARIANTS)}; {', '.join(NAMED_VARIANTS)} only when "
                         "named); NAME@DIR: NAME with the package of the tree DIR")
    ap.add_argument("--steps", type=common.at_least(1), default=None, help="timed steps (default 47; --quick 10)")
    ap.add_argument("--warmup", type=common.at_least(0), default=None,
                    help="untimed first steps (default 3; --quick 2)")
    ap.add_argument("--profile-steps", type=common.at_least(0), default=None,
                    help="steps under torch.profiler after the timed ones (default 3)")
    ap.add_argument("--tokens", default=None, help="token cache (default benchmarks/.cache/tokens.npz)")
    ap.add_argument("--seed", type=int, default=0, help="which texts each step gets")
    ap.add_argument("--run-id", default=None, help="shared by rows of several commands (ratios are taken within a "
                                                   "run id); default: model label @ time")
    ap.add_argument("--timeout", type=float, default=560, help="seconds per child process")
    ap.add_argument("--cpu-threads", type=int, default=1, help="torch threads on CPU")
    for name in ("--child", "--variant", "--workload-json", "--model-dir", "--model-label", "--row-out", "--code"):
        ap.add_argument(name, help=argparse.SUPPRESS, **({"action": "store_true"} if name == "--child" else {}))
    args = ap.parse_args(argv)
    if args.child:
        return run_child(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
