"""Training graphs (``GraphConfig(training=True)``) in real training loops on CPU, against eager training.

The router serves a call with gradients from a training graph only for a model on CUDA. Here
:func:`training_route_as_on_cuda` makes it see every call with gradients as on CUDA, so the patched forward takes
the :class:`~packed_encoders.router.TrainingGraph` route, whose CPU runner
(:class:`~packed_encoders.graphs.training.TrainRunner` with ``capture=False``) keeps the slots, the static inputs
padded to the bucket with dummy sequences, the shared gradient buffers and the one autograd node of the CUDA path,
with an eager forward per replay. The loops:

- sentence-transformers' trainer with ``MultipleNegativesRankingLoss`` (two forwards, one backward) and
  ``CachedMultipleNegativesRankingLoss`` (GradCache: a no-grad pass, then per mini-batch a forward with gradients
  and its backward), against the stock model (tests/test_training_loops.py);
- DDP over two gloo ranks (tests/test_distributed.py's checks): the reducer's gradient hooks fire through the node,
  and the averaged gradients equal one process's stock gradients of the whole batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import traceback
from unittest import mock

import pytest
import torch

import packed_encoders as pe
from packed_encoders.graphs import buckets as B
from packed_encoders.graphs import route
from packed_encoders.graphs.config import GraphConfig
from packed_encoders.graphs.training import TOO_MANY_PENDING, _Replay
from packed_encoders.router import choose
from tests.dist_helpers import init, spawn

TRAINING = {"cuda_graph": GraphConfig(training=True)}

pytestmark = pytest.mark.usefixtures("one_thread")


@dataclasses.dataclass
class Served:
    """What :func:`route.train_forward` was asked: calls with gradients it served (an autograd node returned) and
    calls it sent back to the eager path (``None``), plus any call made without gradients."""

    served: int = 0
    refused: int = 0
    without_grad: int = 0


@contextlib.contextmanager
def training_route_as_on_cuda():
    """Within the block, the router decides every call with gradients as for a model on CUDA (its other facts and
    refusals unchanged), and ``route.train_forward`` counts what it served; yields the :class:`Served` counts."""
    counts = Served()
    real = route.train_forward

    def spy(*args, **kwargs):
        counts.without_grad += not torch.is_grad_enabled()
        out = real(*args, **kwargs)
        if out is None:
            counts.refused += 1
        else:
            assert getattr(out.grad_fn, "_forward_cls", None) is _Replay, out.grad_fn  # the one node
            counts.served += 1
        return out

    def as_on_cuda(facts):
        return choose(dataclasses.replace(facts, model_on_cuda=True) if facts.grad else facts)

    with mock.patch.object(route, "train_forward", spy), mock.patch("packed_encoders.call.choose", as_on_cuda):
        yield counts


def _training_entry(model) -> dict:
    graphs = pe.describe(model)["encoders"][0]["cuda_graph"]
    return {**graphs["training"], "fallbacks": graphs["fallbacks"],
            "slots": sorted({b["slot"] for b in graphs["buckets"] if b.get("training")})}


# ------------------------------------------------------------------------- sentence-transformers' trainer


@pytest.fixture(scope="module")
def loops(tmp_path_factory):
    """tests/test_training_loops.py (imported here rather than at the top: the DDP ranks below import this module
    and need no sentence-transformers) and its tiny saved model."""
    pytest.importorskip("sentence_transformers")
    from tests import test_training_loops
    from tests.tiny_tokenizer import save_tiny_model

    return test_training_loops, save_tiny_model(tmp_path_factory.mktemp("tiny_modernbert_train_graphs"))


@pytest.mark.parametrize("loss_name", ["mnrl", "cached_mnrl"])
def test_sentence_transformer_trainer_on_training_graphs(loops, tmp_path, loss_name):
    """Same loss every step, same gradients before every optimizer step, same final weights as the stock model;
    every call with gradients was served by a training graph, and no forward is left holding a slot."""
    lib, model_dir = loops
    with training_route_as_on_cuda() as calls:
        model = lib.packed_matches_stock(model_dir, tmp_path, loss_name, pack_kw=TRAINING)
    # MNRL embeds the anchor and the positive columns with gradients, two slots pending until the one backward;
    # GradCache re-embeds both columns in mini-batches of 2 rows, each followed by its own backward (one slot)
    chunks = 2 * lib.BATCH // 2
    per_step, slots = (2, [0, 1]) if loss_name == "mnrl" else (chunks, [0])
    assert calls == Served(served=lib.STEPS * per_step), calls
    entry = _training_entry(model)
    assert entry["pending_slots"] == 0, entry
    assert entry["slots"] == slots and entry["gradient_buffer_bytes"] > 0, entry
    # GradCache's first pass (the same chunks) has no gradients: the inference route, eager on CPU; nothing else ran
    # eagerly
    assert entry["fallbacks"] == ({} if loss_name == "mnrl" else {B.NOT_CUDA: lib.STEPS * chunks}), entry


def test_more_forwards_than_slots_mix_graphs_and_eager(loops, tmp_path):
    """MNRL with one slot (``training_slots=1``): the anchor column takes the slot, the positive column, a second
    forward before the backward, runs the eager training path (counted); one backward through a training-graph node
    and an eager autograd graph still gives the stock gradients."""
    lib, model_dir = loops
    one_slot = {"cuda_graph": GraphConfig(training=True, training_slots=1)}
    with training_route_as_on_cuda() as calls:
        model = lib.packed_matches_stock(model_dir, tmp_path, "mnrl", pack_kw=one_slot)
    assert calls == Served(served=lib.STEPS, refused=lib.STEPS), calls
    entry = _training_entry(model)
    assert entry["pending_slots"] == 0 and entry["slots"] == [0], entry
    assert entry["fallbacks"] == {TOO_MANY_PENDING: lib.STEPS}, entry


# ------------------------------------------------------------------------------------------- DDP (gloo)

WORLD = 2
DDP_VARIANTS = {  # name -> (order, DDP kwargs), as tests/test_distributed.py's DDP checks
    "ddp_of_packed": ("ddp_of_packed", {}),
    "ddp_of_packed_find_unused": ("ddp_of_packed", {"find_unused_parameters": True}),
    "ddp_of_packed_static_graph": ("ddp_of_packed", {"static_graph": True}),
    # .grad is a view of the reducer's bucket: AccumulateGrad adds the node's gradients into it in place
    "ddp_of_packed_bucket_view": ("ddp_of_packed", {"gradient_as_bucket_view": True}),
    "pack_of_ddp": ("pack_of_ddp", {}),
}


def _gradcache_grads(rank, world, pack_kw, once: bool) -> dict:
    """tests/test_distributed.py's hand-written GradCache step through DDP (one backward per mini-batch; ``once``:
    inside ``grad_cache_sync``, one all-reduce); returns the gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.test_distributed import _batch, _gradcache_step, _grads, _model, _share

    ids, mask, _, _ = _batch(rank, world)
    model = _model()
    ddp = DDP(pe.pack(model, **pack_kw))
    with pe.grad_cache_sync(ddp) if once else contextlib.nullcontext():
        _gradcache_step(ddp, ids, mask, _share(8, rank, world))
    return _grads(model)


def _ddp_worker(rank, world, rendezvous, out_dir, backend="gloo"):
    """Every DDP check of this module on one rank (``backend="nccl"``: on ``cuda:<rank>``, where the route needs no
    forcing and the graphs are captured, tests/gpu/test_train_graphs_loops.py); writes ``results-<rank>.json``."""
    import torch.distributed as dist

    from tests import test_distributed as checks

    if backend == "nccl":
        checks.DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(checks.DEVICE)
    init(rank, world, rendezvous, backend)
    ids, mask, target, _ = checks._batch(rank, world)
    ref = checks._stock_grads(ids, mask, target)  # one process, stock HF, the whole batch
    # fp32 on both sides; CUDA attention kernels may round their products to TF32
    results = {"tolerance": 1e-4 if backend == "gloo" else 5e-3, "world": world}

    def record(name, fn):
        with training_route_as_on_cuda() as calls:
            try:
                results[name] = fn()
            except Exception:  # recorded for the test that reads it; the other checks still run
                results[name] = {"error": traceback.format_exc()}
        results[name]["calls"] = dataclasses.asdict(calls)

    for name, (order, ddp_kw) in DDP_VARIANTS.items():
        record(name, lambda: checks._ddp_check(rank, world, ref, order, pack_kw=TRAINING, **ddp_kw))
    eager = _gradcache_grads(rank, world, {"cuda_graph": False}, once=False)  # the eager packed path under DDP

    def gradcache():
        rows = checks._share(8, rank, world)  # this rank's queries (and their documents)
        per_chunk = _gradcache_grads(rank, world, TRAINING, once=False)
        once = _gradcache_grads(rank, world, TRAINING, once=True)
        return {"rel": checks._rel_diff(per_chunk, eager), "once_rel": checks._rel_diff(once, eager),
                "chunks": 2 * -(-(rows.stop - rows.start) // checks.CHUNK)}

    record("gradcache", gradcache)
    with open(os.path.join(out_dir, f"results-{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def run_ddp_world(tmp, world: int, backend: str = "gloo") -> list[dict]:
    """Spawn ``world`` ranks of :func:`_ddp_worker`; every rank's results."""
    spawn(_ddp_worker, world, tmp, str(tmp), backend)
    out = []
    for rank in range(world):
        with open(tmp / f"results-{rank}.json") as f:
            out.append(json.load(f))
    return out


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    return run_ddp_world(tmp_path_factory.mktemp("dist_train_graphs"), WORLD)


def _entries(ranks, name):
    for rank, results in enumerate(ranks):
        assert "error" not in results[name], f"rank {rank}: {results[name]['error']}"
    return [(results[name], results["tolerance"]) for results in ranks]


@pytest.mark.parametrize("name", list(DDP_VARIANTS))
def test_ddp_gradients_through_training_graphs_equal_one_process(ddp_results, name):
    """Two DDP steps per rank, each call served by a training graph: the averaged gradients equal one process's
    stock gradients of the whole batch (the reducer's hooks on AccumulateGrad fired through the node)."""
    for rank, (entry, tolerance) in enumerate(_entries(ddp_results, name)):
        assert entry["packed"], f"rank {rank}: the packed forward did not run"
        assert entry["calls"] == {"served": 2, "refused": 0, "without_grad": 0}, (rank, entry)
        assert entry["training"]["pending_slots"] == 0, (rank, entry)
        assert entry["rel"] < tolerance, (rank, entry)


def test_ddp_gradcache_through_training_graphs_equals_eager(ddp_results):
    """The hand-written GradCache step through DDP (a no-grad pass, then per mini-batch a forward with gradients
    and its backward, each an all-reduce; or one inside grad_cache_sync): training graphs give the eager packed
    path's averaged gradients."""
    for rank, (entry, tolerance) in enumerate(_entries(ddp_results, "gradcache")):
        # each mini-batch of queries and of documents re-embedded with gradients, in each of the two runs
        assert entry["calls"] == {"served": 2 * entry["chunks"], "refused": 0, "without_grad": 0}, (rank, entry)
        assert entry["rel"] < tolerance and entry["once_rel"] < tolerance, (rank, entry)
