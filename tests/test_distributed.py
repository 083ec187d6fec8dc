"""DDP, GradCache with one all-reduce per step, and FSDP2 on a packed model: two gloo ranks on CPU.

One spawn runs every training check (a process start costs more than the checks); rank 0 writes each check's
numbers to a JSON file and the tests below assert on them. ``tests/gpu/test_distributed.py`` runs the same workers
with NCCL, one rank per GPU.
"""

from __future__ import annotations

import json
import os
import traceback
import warnings

import pytest
import torch

from tests.dist_helpers import init, spawn

WORLD = 2
CHUNK = 2  # GradCache mini-batch size (rows)
DEVICE = torch.device("cpu")  # set per worker process: cuda:<rank> under NCCL
Q_LENS = [5, 17, 9, 30, 12, 7, 22, 3]
D_LENS = [40, 25, 61, 33, 18, 50, 29, 44]


def _rel_diff(got: dict, ref: dict) -> float:
    """max over parameters of max|got - ref| / max|ref|; inf when the parameter sets differ."""
    if set(got) != set(ref):
        return float("inf")
    return max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp_min(1e-12)) for n in ref)


def _grads(module, prefix_strip: str = "") -> dict:
    out = {}
    for n, p in module.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # FSDP2: DTensor shards
        out[n.removeprefix(prefix_strip)] = g.detach().clone()
    return out


def _packed_ran(model) -> bool:
    import packed_encoders as pe

    entry = pe.describe(model)["encoders"][0]
    return bool(entry["last_attention"]) and not any("stock forward" in f for f in entry["attention_fallbacks"])


def _count_all_reduces(fn) -> int:
    """All-reduce collectives run by ``fn`` (DDP's bucket reductions included), from the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if "all_reduce" in e.name and e.name.startswith(("gloo", "nccl")))


def _model():
    from tests.helpers import make_model

    return make_model("base_like").to(DEVICE).train()


def _share(n: int, rank: int, world: int) -> slice:
    """Rank ``rank``'s contiguous share of ``n`` rows."""
    per = n // world
    return slice(rank * per, rank * per + per)


def _batch(rank, world):
    from tests.helpers import padded_batch

    ids, mask = padded_batch(Q_LENS + D_LENS, seed=3)
    target = torch.randn(*ids.shape, 128, generator=torch.Generator().manual_seed(5))
    return ids.to(DEVICE), mask.to(DEVICE), target.to(DEVICE), _share(len(ids), rank, world)


def _mse(out, mask, target, n_tokens, scale=1.0):
    return ((out - target)[mask.bool()] ** 2).sum() / n_tokens * scale


def _stock_grads(ids, mask, target):
    """One process, stock HF, the global batch (the oracle every data-parallel variant must reproduce)."""
    from tests.helpers import stock

    ref = _model()
    out = stock(ref, input_ids=ids, attention_mask=mask).last_hidden_state
    _mse(out, mask, target, int(mask.sum())).backward()
    return _grads(ref)


def _ddp_check(rank, world, ref, order, pack_kw=None, **ddp_kw):
    """Two DDP steps on this rank's rows (``pack_kw``: ``pe.pack``'s options): the gradients' relative difference
    from ``ref``, whether the packed forward ran, and ``describe()``'s training-graph entry (``None`` without)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import packed_encoders as pe

    ids, mask, target, rows = _batch(rank, world)
    model = _model()
    pack_kw = pack_kw or {}
    wrapped = (DDP(pe.pack(model, **pack_kw), **ddp_kw) if order == "ddp_of_packed"
               else pe.pack(DDP(model, **ddp_kw), **pack_kw))
    for _ in range(2):  # the second step shows DDP's steady state (static_graph records the first)
        wrapped.zero_grad(set_to_none=True)
        out = wrapped(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state
        _mse(out, mask[rows], target[rows], int(mask.sum()), world).backward()
    return {"rel": _rel_diff(_grads(model), ref), "packed": _packed_ran(model),
            "training": pe.describe(model)["encoders"][0]["cuda_graph"].get("training")}


def _mean_pool(out, mask):
    m = mask.unsqueeze(-1).to(out.dtype)
    return (out * m).sum(1) / m.sum(1)


def _gradcache_step(ddp, ids, mask, rows):
    """A hand-written GradCache step: embed chunks without grad, loss on the cached reps, re-embed chunk by chunk
    with the reps' gradients (one backward, hence one DDP all-reduce, per chunk). ``rows``: this rank's queries;
    query ``i``'s document is row ``8 + i``."""
    q_rows, d_rows = range(rows.start, rows.stop), range(8 + rows.start, 8 + rows.stop)
    chunks = [list(r[i:i + CHUNK]) for r in (q_rows, d_rows) for i in range(0, len(r), CHUNK)]

    def embed(c):
        return _mean_pool(ddp(input_ids=ids[c], attention_mask=mask[c]).last_hidden_state, mask[c])

    with torch.no_grad():
        reps = [embed(c).requires_grad_() for c in chunks]
    half = len(chunks) // 2
    q, d = torch.cat(reps[:half]), torch.cat(reps[half:])
    scores = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(d, dim=-1).T * 20
    torch.nn.functional.cross_entropy(scores, torch.arange(len(q), device=q.device)).backward()
    for c, r in zip(chunks, reps):
        (embed(c) * r.grad).sum().backward()


def _gradcache_check(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import packed_encoders as pe
    from packed_encoders.distributed import all_reduce_gradients

    ids, mask, _, _ = _batch(rank, world)
    rows = _share(8, rank, world)  # this rank's queries (and their documents)
    out = {"chunks": 2 * -(-(rows.stop - rows.start) // CHUNK)}
    for mode in ("per_chunk", "once", "small_buckets"):
        model = _model()
        ddp = DDP(pe.pack(model))
        if mode == "per_chunk":
            out["per_chunk_all_reduces"] = _count_all_reduces(lambda: _gradcache_step(ddp, ids, mask, rows))
        elif mode == "once":
            def once():
                with pe.grad_cache_sync(ddp):
                    _gradcache_step(ddp, ids, mask, rows)
            out["once_all_reduces"] = _count_all_reduces(once)
        else:
            with ddp.no_sync():
                _gradcache_step(ddp, ids, mask, rows)
            out["small_bucket_calls"] = all_reduce_gradients(ddp, bucket_bytes=64 * 1024)
        out[mode] = _grads(model)
        out[f"{mode}_packed"] = _packed_ran(model)
    out["small_buckets_rel"] = _rel_diff(out.pop("small_buckets"), out["per_chunk"])
    out["rel"] = _rel_diff(out.pop("once"), out.pop("per_chunk"))
    return out


def _st_check(rank, world, model_dir):
    """sentence-transformers' CachedMultipleNegativesRankingLoss through DDP(packed SentenceTransformer): its own
    synchronisation, grad_cache_sync, and one process averaging the two ranks' losses."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from torch.nn.parallel import DistributedDataParallel as DDP

    import packed_encoders as pe
    from tests.tiny_tokenizer import TEXTS

    anchors, positives = TEXTS, TEXTS[1:] + TEXTS[:1]

    def st_model():
        torch.manual_seed(0)
        transformer = Transformer(model_dir)
        return SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                   device=str(DEVICE)).train()

    def features(model, r):
        rows = _share(len(anchors), r, world)
        return [{k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in model.tokenize(texts[rows]).items()}
                for texts in (anchors, positives)]

    out = {}
    reference = st_model()
    pe.pack(reference)
    loss = CachedMultipleNegativesRankingLoss(reference, mini_batch_size=CHUNK)
    for r in range(world):  # DDP averages the ranks' gradients: the mean of the local losses
        (loss(features(reference, r), None) / world).backward()
    ref = _grads(reference)
    for mode in ("st_own_sync", "grad_cache_sync"):
        model = pe.pack(st_model())
        ddp = DDP(model)
        loss = CachedMultipleNegativesRankingLoss(model, mini_batch_size=CHUNK)
        loss.model = ddp  # what sentence-transformers' trainer does with the wrapped model
        value = loss(features(model, rank), None)
        if mode == "st_own_sync":
            out[f"{mode}_all_reduces"] = _count_all_reduces(value.backward)
        else:
            def once():
                with pe.grad_cache_sync(ddp):
                    value.backward()
            out[f"{mode}_all_reduces"] = _count_all_reduces(once)
        out[f"{mode}_rel"] = _rel_diff(_grads(model), ref)
        out[f"{mode}_packed"] = _packed_ran(model)
    return out


def _fsdp_check(rank, world, ref):
    from torch.distributed.fsdp import fully_shard

    import packed_encoders as pe

    ids, mask, target, rows = _batch(rank, world)
    out = {}
    # one FSDP unit holding the whole encoder: its hooks gather every weight around the packed forward
    model = pe.pack(_model())
    fully_shard(model)
    o = model(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state
    _mse(o, mask[rows], target[rows], int(mask.sum()), world).backward()
    out["root_rel"] = _rel_diff(_grads(model), ref)
    out["root_packed"] = _packed_ran(model)
    # weights edited through their shards between evaluation calls under autocast: FSDP2 gathers them into the same
    # parameters, often at the same address, keeping their version counters; each call must read the new values
    model, reference = pe.pack(_model()).eval(), pe.pack(_model()).eval()  # the reference unsharded
    fully_shard(model)
    real = mask[rows].bool()
    rels = []
    for _ in range(3):
        with torch.no_grad():
            for p, r in zip(model.parameters(), reference.parameters()):
                p.mul_(1.25)
                r.mul_(1.25)
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
                got = model(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state[real].float()
                want = reference(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state[real].float()
        model.reshard()
        rels.append(((got - want).norm() / want.norm()).item())
    out["autocast_edit_rels"] = rels
    # the encoder its own unit under a parent's, and an in-place op on its output: a returned view would drop
    # FSDP2's pre-backward all-gather (warned at each call; the backward failed)
    parent = torch.nn.Module()
    parent.encoder = pe.pack(_model())
    fully_shard(parent.encoder)
    fully_shard(parent)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = parent.encoder(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state
    o.mul_(1.0)
    _mse(o, mask[rows], target[rows], int(mask.sum()), world).backward()
    out["inplace_rel"] = _rel_diff(_grads(parent.encoder), ref)
    out["inplace_warnings"] = [str(w.message) for w in caught]
    # sharded before pack(): validation gathers the weights itself (it calls the forwards outside FSDP2's hooks)
    model = _model()
    fully_shard(model)
    pe.pack(model)
    o = model(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state
    _mse(o, mask[rows], target[rows], int(mask.sum()), world).backward()
    out["sharded_first_rel"] = _rel_diff(_grads(model), ref)
    out["sharded_first_packed"] = _packed_ran(model)
    # the unit above the pack() target: its weights cannot be gathered from here, said instead of torch's
    # "mixed torch.Tensor and DTensor"
    parent = torch.nn.Module()
    parent.encoder = _model()
    fully_shard(parent)
    try:
        pe.pack(parent.encoder)
        out["outside_error"] = None
    except pe.PackedEncodersError as exc:
        out["outside_error"] = str(exc)
    # per-layer units, sharded after pack(): the stock forward runs, said in a warning and in describe()
    model = pe.pack(_model())
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        o = model(input_ids=ids[rows], attention_mask=mask[rows]).last_hidden_state
    _mse(o, mask[rows], target[rows], int(mask.sum()), world).backward()
    out["layers_rel"] = _rel_diff(_grads(model), ref)
    out["layers_warning"] = [str(w.message) for w in caught if "stock forward" in str(w.message)]
    out["layers_describe"] = pe.describe(model)["encoders"][0]["attention_fallbacks"]
    # per-layer units, then pack(): refused
    model = _model()
    for layer in model.layers:
        fully_shard(layer)
    try:
        pe.pack(model)
        out["pack_error"] = None
    except pe.UnsupportedTargetError as exc:
        out["pack_error"] = str(exc)
    return out


def _packed_forward_check(rank, world):
    """packed_forward called directly on what a distributed wrapper's forward would prepare: refused, naming it."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import packed_encoders as pe

    ids = torch.randint(5, 100, (12,), device=DEVICE)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    out = {}
    for name, make in (("ddp", lambda: DDP(pe.pack(_model()))), ("fsdp2", lambda: fully_shard(pe.pack(_model())))):
        try:
            pe.packed_forward(make(), None, ids, cu, 7)
            out[name] = None
        except pe.PackedEncodersError as exc:
            out[name] = str(exc)
    out["plain_shape"] = list(pe.packed_forward(pe.pack(_model()), None, ids, cu, 7).shape)  # unwrapped: served
    return out


def _train_worker(rank, world, rendezvous, out_dir, model_dir, backend="gloo"):
    import torch.distributed as dist

    global DEVICE
    if backend == "nccl":
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    init(rank, world, rendezvous, backend)
    ids, mask, target, _ = _batch(rank, world)
    ref = _stock_grads(ids, mask, target)
    checks = {
        "ddp_of_packed": lambda: _ddp_check(rank, world, ref, "ddp_of_packed"),
        "ddp_of_packed_find_unused": lambda: _ddp_check(rank, world, ref, "ddp_of_packed",
                                                        find_unused_parameters=True),
        "ddp_of_packed_static_graph": lambda: _ddp_check(rank, world, ref, "ddp_of_packed", static_graph=True),
        "pack_of_ddp": lambda: _ddp_check(rank, world, ref, "pack_of_ddp"),
        "gradcache_loop": lambda: _gradcache_check(rank, world),
        "st_cached_mnrl": lambda: _st_check(rank, world, model_dir),
        "fsdp2": lambda: _fsdp_check(rank, world, ref),
        "packed_forward": lambda: _packed_forward_check(rank, world),
    }
    # fp32 on both sides; CUDA attention kernels may round their products to TF32
    results = {"tolerance": 1e-4 if backend == "gloo" else 5e-3, "world": world}
    for name, fn in checks.items():
        try:
            results[name] = fn()
        except Exception:  # recorded for the test that reads it; the other checks still run
            results[name] = {"error": traceback.format_exc()}
    if rank == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from tests.tiny_tokenizer import save_tiny_model

    tmp = tmp_path_factory.mktemp("dist_train")
    model_dir = save_tiny_model(tmp / "model")
    spawn(_train_worker, WORLD, tmp, str(tmp), model_dir)
    with open(tmp / "results.json") as f:
        return json.load(f)


def _get(results, name):
    entry = results[name]
    assert "error" not in entry, entry.get("error")
    return entry


@pytest.mark.parametrize("name", ["ddp_of_packed", "ddp_of_packed_find_unused", "ddp_of_packed_static_graph",
                                  "pack_of_ddp"])
def test_ddp_gradients_equal_one_process(results, name):
    entry = _get(results, name)
    assert entry["packed"], "the packed forward did not run"
    assert entry["rel"] < results["tolerance"], entry


def test_gradcache_loop_syncs_once_with_same_gradients(results):
    entry = _get(results, "gradcache_loop")
    assert entry["per_chunk_packed"] and entry["once_packed"]
    if results["world"] > 1:  # DDP may skip communication in a world of one
        assert entry["per_chunk_all_reduces"] >= entry["chunks"]  # one per mini-batch backward
    assert entry["once_all_reduces"] == 2  # the presence mask and one bucket
    assert entry["rel"] < results["tolerance"] / 10, entry  # the same kernels, summed in another order
    # gradients of 64 KiB and more (this model's largest are ~100 KiB) take a bucket each: many collectives
    assert entry["small_bucket_calls"] > 10 and entry["small_buckets_rel"] < results["tolerance"] / 10, entry


def test_st_cached_loss_under_ddp(results):
    entry = _get(results, "st_cached_mnrl")
    assert entry["st_own_sync_packed"] and entry["grad_cache_sync_packed"]
    assert entry["grad_cache_sync_all_reduces"] == 2
    assert max(entry["st_own_sync_rel"], entry["grad_cache_sync_rel"]) < results["tolerance"], entry


def test_fsdp2(results):
    entry = _get(results, "fsdp2")
    assert entry["root_packed"] and entry["root_rel"] < results["tolerance"], entry
    assert max(entry["autocast_edit_rels"]) < 1e-3, entry  # against the same kernels unsharded (0 on CPU); stale: 2e-3+
    assert entry["inplace_rel"] < results["tolerance"] and not entry["inplace_warnings"], entry
    assert entry["sharded_first_packed"] and entry["sharded_first_rel"] < results["tolerance"], entry
    assert entry["outside_error"] and "sharded" in entry["outside_error"] and "validate=False" in entry["outside_error"]
    assert entry["layers_rel"] < results["tolerance"], entry
    assert entry["layers_warning"] and "FSDP2" in entry["layers_warning"][0]
    assert any("FSDP2" in f and "layers.0" in f for f in entry["layers_describe"])
    assert entry["pack_error"] and "FSDP2" in entry["pack_error"] and "fully_shard" in entry["pack_error"]


def test_packed_forward_refuses_what_a_distributed_wrapper_would_prepare(results):
    r = _get(results, "packed_forward")
    assert "DistributedDataParallel" in r["ddp"] and "all-reduce" in r["ddp"], r
    assert "sharded" in r["fsdp2"] and "gathers" in r["fsdp2"], r
    assert r["plain_shape"][0] == 12, r


def test_grad_cache_sync_without_ddp_is_a_no_op():
    import packed_encoders as pe

    lin = torch.nn.Linear(3, 2)
    with pe.grad_cache_sync(lin):
        lin(torch.ones(1, 3)).sum().backward()
    torch.testing.assert_close(lin.weight.grad, torch.ones(2, 3))
