"""CUDA-graph replay on the GPU: parity with the eager packed forward, isolation of padding, fallbacks,
LRU, invalidation, the kill switch, host syncs. Skipped without CUDA.

Parity rule (DESIGN.md): per real token, ``max|graph - fp32| <= 2 * max|eager - fp32| + eps`` where fp32 is
the eager packed forward of an fp32 copy, and per-token cosine(graph, eager) >= 0.995 (validate()'s bf16 floor).
"""

from __future__ import annotations

import copy
import math
import random
import warnings

import pytest
import torch

import packed_encoders as pe
from packed_encoders.adapters.state import get_state
from packed_encoders.graphs import buckets as B
from packed_encoders.graphs.buckets import precapture_buckets
from packed_encoders.graphs.config import GraphConfig
from tests.helpers import make_model, packed_inputs, padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
TINY = {
    # head_dim 64, window 8 (so 128-token queries cross it), global every 3rd layer
    "tiny64": dict(hidden_size=128, num_attention_heads=2, intermediate_size=192, num_hidden_layers=4,
                   local_attention=16, vocab_size=331),
    # 4 heads of 32, biases, tanh GELU, global every 2nd layer
    "tiny_odd": dict(hidden_size=128, num_attention_heads=4, intermediate_size=160, num_hidden_layers=3,
                     local_attention=32, global_attn_every_n_layers=2, attention_bias=True, mlp_bias=True,
                     norm_bias=True, hidden_activation="gelu_pytorch_tanh", vocab_size=331),
}


def graph_model(name="tiny64", dtype=torch.bfloat16, seed=0):
    """A random model of ``TINY[name]`` (or ModernBERT-base geometry for "base") on the GPU."""
    if name == "base":
        return make_model("base", seed=seed, dtype=dtype, device=DEV)
    return make_model("base_like", seed=seed, dtype=dtype, device=DEV, max_position_embeddings=8192, **TINY[name])


def queries(batch, seed=0, cap=128):
    rng = random.Random(seed)
    return [min(cap, max(1, int(rng.lognormvariate(math.log(30), 0.6)))) for _ in range(batch)]


def fwd(model, ids, mask, **kw):
    return model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state


def info(model):
    return pe.describe(model)["encoders"][0]["cuda_graph"]


def check_parity(graph, eager, ref32, mask):
    real = mask.bool()
    g, e, r = graph[real].float(), eager[real].float(), ref32[real].float()
    cos = torch.nn.functional.cosine_similarity(g, e, dim=-1)
    assert float(cos.min()) >= 0.995, f"per-token cosine min {float(cos.min()):.6f}"
    bound = 2 * (e - r).abs().max() + 1e-2 * r.abs().max() * 2 ** -8
    assert (g - r).abs().max() <= bound, f"graph err {(g - r).abs().max():.4g} > bound {bound:.4g}"


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.delenv("PACKED_ENCODERS_GRAPH", raising=False)


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("backend", ["auto", "sdpa", "varlen"])
def test_replay_matches_eager(name, backend):
    model = graph_model(name)
    ref_model = copy.deepcopy(model).float()
    pe.pack(ref_model, validate=False, attention_backend="sdpa")
    pe.pack(model, validate=False, attention_backend=backend, cuda_graph=True)
    vocab = model.config.vocab_size
    batches = [[1, 5, 128, 17], [127, 3, 64, 100, 33, 9, 2], queries(8, 1), queries(8, 2), queries(37, 3),
               [128] * 16, [2] * 3]
    with torch.no_grad():
        for seed, lengths in enumerate(batches):
            ids, mask = padded_batch(lengths, "mixed", vocab_size=vocab, seed=seed, device=DEV)
            graph = fwd(model, ids, mask)
            with pe.no_cuda_graph(model):
                eager = fwd(model, ids, mask)
            check_parity(graph, eager, fwd(ref_model, ids, mask), mask)
            assert torch.equal(graph[mask == 0], torch.zeros_like(graph[mask == 0]))
    state = info(model)
    assert state["graphs"] >= 3 and state["misses"] == state["graphs"]
    assert state.get("fallbacks", {}).keys() <= {B.SUSPENDED}
    assert all(b["seqlen"] == 128 for b in state["buckets"])
    if backend != "auto":
        assert all(set(b["attention"].values()) == {backend} for b in state["buckets"])


def test_base_size_queries_reuse_buckets():
    model = graph_model("base")
    ref_model = copy.deepcopy(model).float()
    pe.pack(ref_model, validate=False, attention_backend="sdpa")
    pe.pack(model, validate=False, cuda_graph=True)
    with torch.no_grad():
        for batch, seed in [(8, s) for s in range(12)] + [(128, 100), (128, 101)]:
            ids, mask = padded_batch(queries(batch, seed), "mixed", vocab_size=model.config.vocab_size, seed=seed,
                                    device=DEV)
            graph = fwd(model, ids, mask)
            if seed % 4 == 0 or batch == 128:
                with pe.no_cuda_graph(model):
                    eager = fwd(model, ids, mask)
                check_parity(graph, eager, fwd(ref_model, ids, mask), mask)
    state = info(model)
    assert state["hits"] + state["misses"] == 14 and state["graphs"] <= 8 and state["hits"] >= 6
    assert state["pool_reserved_bytes"] is None or state["pool_reserved_bytes"] > 0


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "auto"])
def test_padding_never_reaches_real_tokens(backend):
    model = pe.pack(graph_model("tiny64"), validate=False, attention_backend=backend, cuda_graph=True)
    vocab = model.config.vocab_size
    ids, mask = padded_batch([100, 7, 128, 1, 45], "mixed", vocab_size=vocab, seed=0, device=DEV)
    with torch.no_grad():
        first = fwd(model, ids, mask)
        (runner,) = get_state(model).runtime["graphs"].runners()
        t = int(mask.sum())
        assert runner.bucket.tokens > t
        for seed in range(3):
            g = torch.Generator(device=DEV).manual_seed(seed)
            runner.ids[t:] = torch.randint(0, vocab, (runner.bucket.tokens - t,), device=DEV, generator=g)
            runner.pos[t:] = torch.randint(0, runner.bucket.seqlen, (runner.bucket.tokens - t,), device=DEV,
                                           generator=g)
            assert torch.equal(fwd(model, ids, mask), first), "padding content changed real outputs"
        # a different batch in the same bucket leaves other stale content behind
        other_ids, _ = padded_batch([100, 7, 128, 1, 45], "mixed", vocab_size=vocab, seed=9, device=DEV)
        fwd(model, other_ids, mask)
        assert torch.equal(fwd(model, ids, mask), first)
    assert info(model)["graphs"] == 1


def test_every_fallback_runs_eagerly():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=GraphConfig(max_seqs=8, max_seqlen=128))
    vocab = model.config.vocab_size
    ids, mask = padded_batch([5, 40, 77], "mixed", vocab_size=vocab, device=DEV)

    def fallbacks():
        return info(model).get("fallbacks", {})

    with torch.no_grad(), pe.no_cuda_graph(model):
        eager = fwd(model, ids, mask)
    out = fwd(model, ids, mask)                                                     # grad enabled
    # Eager too, but a backend with a backward (the Triton attention kernel is inference-only): close, not equal.
    assert out.requires_grad and "grad enabled" in str(fallbacks())
    torch.testing.assert_close(out.detach(), eager, atol=3e-2, rtol=3e-2)
    with torch.no_grad():
        fwd(model, ids, mask, output_hidden_states=True)
        model(inputs_embeds=model.embeddings.tok_embeddings(ids), attention_mask=mask)
        fwd(model, *padded_batch([3] * 9, "mixed", vocab_size=vocab, device=DEV))   # > max_seqs
        fwd(model, *padded_batch([129, 3], "mixed", vocab_size=vocab, device=DEV))  # > max_seqlen
        with pytest.raises(RuntimeError):
            fwd(model, ids.cpu(), mask.cpu())                                       # eager raises as unpacked
    fp32 = pe.pack(graph_model("tiny64", dtype=torch.float32), validate=False, cuda_graph=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = fwd(fp32, ids, mask)
    assert info(fp32)["fallbacks"] == {} and info(fp32)["graphs"] == 1  # autocast: a graph captured under it
    assert info(fp32)["buckets"][0]["autocast"] == "bfloat16"
    assert fallbacks() == {B.SUSPENDED: 1, B.GRAD: 1, B.HIDDEN_STATES: 1, B.EMBEDS: 1, B.TOO_MANY_SEQS: 1,
                           B.TOO_LONG: 1, B.OTHER_DEVICE: 1}
    assert info(model)["graphs"] == 0


def test_documents_past_the_bounds_run_eagerly_and_match():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=True)
    ids, mask = padded_batch([2049, 700, 1300], "mixed", vocab_size=model.config.vocab_size, device=DEV)
    with torch.no_grad():
        out = fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            assert torch.equal(out, fwd(model, ids, mask))
    assert info(model)["fallbacks"] == {B.TOO_LONG: 1, B.SUSPENDED: 1}


@pytest.mark.parametrize("lengths", [[2048, 700, 1300], [926, 1100, 880, 1884, 950, 1010, 700, 990], [300, 511, 17]])
def test_documents_replay_matches_eager(lengths):
    """The default config serves documents (seqlen buckets 512 and 2048; local layers on the Triton kernel at any
    max_seqlen, global ones on FlashAttention past 512)."""
    model = pe.pack(graph_model("base"), validate=False, cuda_graph=True)
    ids, mask = padded_batch(lengths, "mixed", vocab_size=model.config.vocab_size, device=DEV)
    with torch.no_grad():
        out = fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
    state = info(model)
    assert state["graphs"] == 1 and state["fallbacks"] == {B.SUSPENDED: 1}
    real = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out[real].float(), eager[real].float(), dim=-1)
    assert float(cos.min()) > 0.999
    assert torch.count_nonzero(out[~real]) == 0


def test_lru_bound_and_recapture():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=GraphConfig(max_graphs=2))
    vocab = model.config.vocab_size
    shapes = [[10], [30] * 4, [100] * 8, [10]]
    with torch.no_grad():
        for lengths in shapes:
            ids, mask = padded_batch(lengths, "mixed", vocab_size=vocab, device=DEV)
            out = fwd(model, ids, mask)
            with pe.no_cuda_graph(model):
                eager = fwd(model, ids, mask)
            assert float(torch.nn.functional.cosine_similarity(out[mask.bool()].float(),
                                                               eager[mask.bool()].float(), dim=-1).min()) > 0.999
    state = info(model)
    assert state["graphs"] == 2 and state["evictions"] == 2 and state["misses"] == 4


def test_recapture_after_dtype_and_device_change():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=True)
    ids, mask = padded_batch([20, 64, 3], "mixed", vocab_size=model.config.vocab_size, device=DEV)
    with torch.no_grad():
        fwd(model, ids, mask)
        model.float()
        out = fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, eager, atol=1e-4, rtol=1e-4)
        assert info(model)["invalidations"] == 1
        model.cpu()
        fwd(model, ids.cpu(), mask.cpu())
        assert info(model)["graphs"] == 0, "leaving the GPU frees the graphs"
        model.to(DEV, torch.bfloat16)
        out = fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
    assert out.dtype == torch.bfloat16 and info(model)["graphs"] == 1
    assert float(torch.nn.functional.cosine_similarity(out[mask.bool()].float(), eager[mask.bool()].float(),
                                                       dim=-1).min()) > 0.999


def test_kill_switch_read_at_pack(monkeypatch):
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "0")
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=True)
    ids, mask = padded_batch([20, 64, 3], "mixed", vocab_size=model.config.vocab_size, device=DEV)
    with torch.no_grad():
        fwd(model, ids, mask)
        monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "1")
        fwd(model, ids, mask)  # still off: the switches are read at pack()
        assert info(model)["graphs"] == 0 and info(model)["fallbacks"] == {B.KILL_SWITCH: 2}
        pe.pack(model, validate=False, cuda_graph=True)  # re-reads them
        fwd(model, ids, mask)
        fwd(model, ids, mask)
    state = info(model)
    assert state["graphs"] == 1 and state["hits"] == 1


def test_one_host_sync_per_padded_call_none_in_replay():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=True)
    ids, mask = padded_batch(queries(8, 5), "mixed", vocab_size=model.config.vocab_size, device=DEV)
    flat_ids, cu, max_len = packed_inputs(ids, mask)
    with torch.no_grad():
        fwd(model, ids, mask)
        pe.packed_forward(model, None, flat_ids, cu, max_len)  # capture (same bucket) outside the count
        torch.cuda.synchronize()
        for call in (lambda: fwd(model, ids, mask), lambda: pe.packed_forward(model, None, flat_ids, cu, max_len)):
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    call()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            syncs = [w for w in caught if "synchroniz" in str(w.message)]
            assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert info(model)["hits"] == 3


def test_packed_forward_with_graphs_sees_hooks_and_a_new_window():
    """A captured graph reads no module: packed_forward checks the live model before replaying one."""
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=True)
    ids, mask = padded_batch(queries(8, 5), "mixed", vocab_size=model.config.vocab_size, device=DEV)
    flat_ids, cu, max_len = packed_inputs(ids, mask)
    with torch.no_grad():
        first = pe.packed_forward(model, None, flat_ids, cu, max_len)  # captured
        again = pe.packed_forward(model, None, flat_ids, cu, max_len)  # replayed
        assert info(model)["hits"] >= 1
        torch.testing.assert_close(again, first, atol=0, rtol=0)
        handle = model.layers[1].mlp.register_forward_hook(lambda m, i, o: o * 0)
        with pytest.raises(pe.PackedEncodersError, match="forward hooks"):
            pe.packed_forward(model, None, flat_ids, cu, max_len)
        handle.remove()
        model.config.local_attention = 8
        with pytest.raises(pe.PackedEncodersError, match="sliding_window"):
            pe.packed_forward(model, None, flat_ids, cu, max_len)
        model.config.local_attention = 16
        torch.testing.assert_close(pe.packed_forward(model, None, flat_ids, cu, max_len), first, atol=0, rtol=0)


def test_inference_mode_and_streams():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=True)
    ids, mask = padded_batch([33, 12, 90], "mixed", vocab_size=model.config.vocab_size, device=DEV)
    with torch.inference_mode():
        a = fwd(model, ids, mask)                      # captured under inference mode
    with torch.no_grad():
        b = fwd(model, ids, mask)                      # replayed outside it
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            c = fwd(model, ids, mask)
        torch.cuda.current_stream().wait_stream(side)
        d = fwd(model, ids, mask)
    assert torch.equal(a, b) and torch.equal(b, c) and torch.equal(c, d)
    assert info(model)["misses"] == 1 and info(model)["hits"] == 3


def test_inbox_is_filled_before_the_sync_and_refilled_when_taken(monkeypatch):
    """A graph call copies its batch into the inbox before its one sync and launches only the graph after it;
    a call whose inbox another call (here on another stream) refilled in between stages again."""
    import functools

    from packed_encoders import batch as PB
    from packed_encoders.graphs import route
    from packed_encoders.ops.triton import stage

    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=True)
    vocab = model.config.vocab_size
    # one bucket
    (ids_a, mask_a), (ids_b, mask_b) = (padded_batch([33, 12, 90], "mixed", vocab_size=vocab, seed=1, device=DEV),
                                        padded_batch([60, 30, 45], "mixed", vocab_size=vocab, seed=2, device=DEV))
    with torch.no_grad():
        with pe.no_cuda_graph(model):
            want_a, want_b = fwd(model, ids_a, mask_a), fwd(model, ids_b, mask_b)
        fwd(model, ids_a, mask_a)  # capture
        events = []
        real_fill, real_tolist = stage.fill_inbox, torch.Tensor.tolist
        monkeypatch.setattr(stage, "fill_inbox", lambda *a: events.append("fill") or real_fill(*a))
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: events.append("sync") or real_tolist(t))
        got_a = fwd(model, ids_a, mask_a)
        assert events == ["fill", "sync"]
        state = get_state(model)
        prepared = route.prepare(model, state)
        batch_a = PB.unpad(input_ids=ids_a, inputs_embeds=None, attention_mask=mask_a, position_ids=None,
                           token_type_ids=None, vocab_size=vocab, before_sync=functools.partial(route.prestage, prepared))
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got_b = fwd(model, ids_b, mask_b)
        events.clear()
        again_a = route.graph_forward(model, state, batch_a, batch_a.pad, prepared=prepared)
        assert events == ["fill"]
        torch.cuda.synchronize()
    assert torch.equal(again_a, got_a)  # the same graph on the same batch
    assert info(model)["misses"] == 1  # a and b shared the graph (and its buffers)
    for got, want, mask in ((got_a, want_a, mask_a), (got_b, want_b, mask_b)):
        real = mask.bool()
        cos = torch.nn.functional.cosine_similarity(got[real].float(), want[real].float(), dim=-1)
        assert float(cos.min()) >= 0.995


def test_precapture_at_pack_and_set_cuda_graph():
    cfg = GraphConfig().with_precapture(8, 8, 512)
    model = pe.pack(graph_model("tiny64"), validate=True, cuda_graph=cfg)
    n = info(model)["graphs"]
    # the pack-time graph check's batch reaches max_seqlen (2048): its bucket was captured, checked and dropped
    assert n == len(precapture_buckets(cfg)) and info(model)["misses"] == n + 1
    assert any(c.startswith("cuda_graph: replay vs eager") for c in get_state(model).report.checks)
    hits = info(model)["hits"]
    ids, mask = padded_batch([30] * 8, "mixed", vocab_size=model.config.vocab_size, device=DEV)
    with torch.no_grad():
        fwd(model, ids, mask)
    assert info(model)["misses"] == n + 1 and info(model)["hits"] == hits + 1
    pe.set_cuda_graph(model, False)
    assert not info(model)["enabled"]
    pe.set_cuda_graph(model, True, GraphConfig(precapture=((8, 200),)))
    assert info(model)["graphs"] == 1


# ------------------------------------------------------------------ sync-free (rectangular) graphs

# every batch below on the rectangular path, past the default sync_free_max_tokens (2048 padded rows)
SYNC_FREE = GraphConfig(sync_free=True, sync_free_max_tokens=1 << 16)


def sync_free_info(model):
    return info(model)["sync_free"]


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("backend", ["auto", "sdpa", "varlen"])
def test_sync_free_replay_matches_eager(name, backend):
    model = graph_model(name)
    ref_model = copy.deepcopy(model).float()
    pe.pack(ref_model, validate=False, attention_backend="sdpa")
    pe.pack(model, validate=False, attention_backend=backend, cuda_graph=SYNC_FREE)
    vocab = model.config.vocab_size
    batches = [[1, 5, 128, 17], [127, 3, 64, 100, 33, 9, 2], queries(8, 1), queries(8, 2), queries(37, 3),
               [128] * 16, [2] * 3, [0, 9, 0, 30], [300, 12, 511]]
    with torch.no_grad():
        for seed, lengths in enumerate(batches):
            ids, mask = padded_batch(lengths, "mixed", vocab_size=vocab, seed=seed, device=DEV)
            graph = fwd(model, ids, mask)
            with pe.no_cuda_graph(model):
                eager = fwd(model, ids, mask)
            check_parity(graph, eager, fwd(ref_model, ids, mask), mask)
            assert torch.count_nonzero(graph[mask == 0]) == 0, "padded positions are exactly zero"
        pe.check_errors(model, wait=True)
    state = info(model)
    assert all(b.get("layout") == "rectangular" for b in state["buckets"]), state["buckets"]
    assert state.get("fallbacks", {}).keys() <= {B.SUSPENDED}
    assert sync_free_info(model)["fallbacks"].keys() <= {B.SUSPENDED}
    assert sync_free_info(model)["calls"] == len(batches) and sync_free_info(model)["errors_raised"] == 0
    if backend != "auto":
        assert all(set(b["attention"].values()) == {backend} for b in state["buckets"])


def test_sync_free_base_queries_match_eager():
    model = graph_model("base")
    ref_model = copy.deepcopy(model).float()
    pe.pack(ref_model, validate=False, attention_backend="sdpa")
    pe.pack(model, validate=True, cuda_graph=SYNC_FREE)   # the pack-time check covers the rectangular path
    assert any(c.startswith("cuda_graph (sync_free)") for c in get_state(model).report.checks)
    with torch.no_grad():
        for batch, seed in [(8, s) for s in range(6)] + [(128, 100)]:
            ids, mask = padded_batch(queries(batch, seed), "mixed", vocab_size=model.config.vocab_size, seed=seed,
                                    device=DEV)
            graph = fwd(model, ids, mask)
            with pe.no_cuda_graph(model):
                eager = fwd(model, ids, mask)
            check_parity(graph, eager, fwd(ref_model, ids, mask), mask)
    pe.check_errors(model, wait=True)


def test_sync_free_no_host_sync_per_call():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=SYNC_FREE)
    vocab = model.config.vocab_size
    calls = [padded_batch(queries(8, s), "mixed", vocab_size=vocab, seed=s, device=DEV) for s in range(4)]
    with torch.no_grad():
        for ids, mask in calls:   # capture each bucket, create the pinned slots and events outside the count
            fwd(model, ids, mask)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs = [fwd(model, ids, mask) for ids, mask in calls * 3]
                pe.check_errors(model)   # the non-waiting check reads completed slots only
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert syncs == [], syncs
    assert sync_free_info(model)["calls"] == 16 and info(model)["hits"] >= 12
    for out, (ids, mask) in zip(outs, calls * 3):
        assert torch.count_nonzero(out[mask == 0]) == 0 and torch.isfinite(out).all()


@pytest.mark.parametrize("problem", ["oov", "huge", "negative", "mask2", "hole", "token_types"])
def test_sync_free_deferred_error_on_the_next_call(problem):
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=SYNC_FREE)
    vocab = model.config.vocab_size
    # row 0 right padded, row 1 left padded (full)
    ids, mask = padded_batch([20, 64, 3], "mixed", vocab_size=vocab, device=DEV)
    bad_ids, bad_mask, tt = ids.clone(), mask.clone(), None
    if problem == "oov":
        bad_ids[0, 5] = vocab
    elif problem == "huge":
        bad_ids[1, 7] = 10 ** 12                        # clamped in the graph: no device-side assert
    elif problem == "negative":
        bad_ids[0, 0] = -3
    elif problem == "mask2":
        bad_mask[0, 1] = 2
    elif problem == "hole":
        bad_mask[1, 30] = 0
    else:
        tt = torch.zeros_like(ids)
        tt[0, 2] = 1
    words = {"oov": "outside the vocabulary", "huge": "outside the vocabulary", "negative": "outside the vocabulary",
             "mask2": "only 0 and 1", "hole": "holes", "token_types": "token_type_ids"}[problem]
    with torch.no_grad():
        fwd(model, ids, mask)                           # capture
        out = model(input_ids=bad_ids, attention_mask=bad_mask, token_type_ids=tt).last_hidden_state
        torch.cuda.synchronize()                        # the offending call is complete: the next call reports it
        assert torch.isnan(out).all()
        with pytest.raises(pe.PackedEncodersError, match=rf"call #2 \(input \[3, 64\]\).*{words}"):
            fwd(model, ids, mask)
        good = fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
        real = mask.bool()
        cos = torch.nn.functional.cosine_similarity(good[real].float(), eager[real].float(), dim=-1)
        assert float(cos.min()) > 0.999
        model(input_ids=bad_ids, attention_mask=bad_mask, token_type_ids=tt)
        with pytest.raises(pe.PackedEncodersError, match=words):
            pe.check_errors(model, wait=True)
    assert sync_free_info(model)["errors_raised"] == 2


def test_sync_free_streams_inference_mode_and_invalidation():
    model = pe.pack(graph_model("tiny64"), validate=False, cuda_graph=SYNC_FREE)
    ids, mask = padded_batch([33, 12, 90], "mixed", vocab_size=model.config.vocab_size, device=DEV)
    with torch.inference_mode():
        a = fwd(model, ids, mask)
    with torch.no_grad():
        b = fwd(model, ids, mask)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            c = fwd(model, ids, mask)
        torch.cuda.current_stream().wait_stream(side)
        d = fwd(model, ids, mask)
        assert torch.equal(a, b) and torch.equal(b, c) and torch.equal(c, d)
        model.float()
        e = fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
    torch.testing.assert_close(e, eager, atol=1e-4, rtol=1e-4)
    assert info(model)["invalidations"] == 1 and info(model)["misses"] == 2
    pe.check_errors(model, wait=True)


def test_capture_check_catches_a_replay_differing_from_its_warm_up_in_a_static_output():
    """The capture's check (replay once, compare with the warm-up) holds a copy of the warm-up's result: a forward
    writing into a static output (an octave's shared one) returns that buffer at warm-up and capture alike. Here
    the forward fills it with a Python counter, which the capture bakes in (2 where the warm-up wrote 1)."""
    from packed_encoders.graphs.runner import _warm_and_capture

    out = torch.zeros(64, 8, device=DEV)
    calls = []

    def forward():
        calls.append(None)
        return out.fill_(float(len(calls)))

    with pytest.raises(RuntimeError, match="differs from its eager warm-up"):
        _warm_and_capture(forward, torch.device(DEV), torch.cuda.graph_pool_handle(), torch.cuda.Stream(DEV),
                          warmup=1)
    assert len(calls) == 2
