"""CUDA-graph logic on CPU: bucket grid, admission, config, LRU, routing, the bucket layout, copies.

The layout tests use ``GraphRunner(capture=False)``: the same static buffers, dummy sequences and staging
as a captured graph, with the forward run eagerly at each replay. Routing tests swap the CUDA-only pieces
(the device check and the capture) for that runner, so every decision around them runs for real.
"""

from __future__ import annotations

import copy
import io
import json
import math
import random
import warnings

import pytest
from dataclasses import replace
import torch

import packed_encoders as pe
from packed_encoders import call
from packed_encoders.call import run_packed
from packed_encoders.adapters.state import get_state
from packed_encoders.batch import unpad
from packed_encoders.errors import PackedEncodersError
from packed_encoders.graphs import buckets as B
from packed_encoders.graphs import route
from packed_encoders.graphs.buckets import (Bucket, CallFacts, admit, bucket_for, pad_bound, precapture_buckets,
                                            round_seqs, round_tokens)
from packed_encoders.graphs.config import GraphConfig, normalize
from packed_encoders.graphs.manager import GraphManager
from packed_encoders.graphs.runner import GraphRunner
from tests.helpers import DROPOUT_AFTER_PACK, VOCAB, enable_dropout, make_model, padded_batch, tiny_model

def batch_of(lengths, seed=0):
    ids, mask = padded_batch(lengths, "mixed", seed=seed)
    return unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                 vocab_size=VOCAB)


# --------------------------------------------------------------------------------------------- grid


@pytest.mark.parametrize("multiple,steps", [(64, 8), (64, 4), (16, 2), (1, 1), (128, 16)])
def test_token_grid_is_monotone_idempotent_bounded(multiple, steps):
    prev = 0
    for t in range(1, 20000):
        r = round_tokens(t, multiple, steps)
        assert r >= t and r % multiple == 0
        assert r >= prev, "monotone"
        assert round_tokens(r, multiple, steps) == r, "idempotent"
        assert r - t < max(multiple, t / steps), f"waste at {t} -> {r}"  # <= 1/steps once past the floor
        assert r - t <= pad_bound(r, multiple, steps), "pad_bound covers every batch of the bucket"
        prev = r


def test_pad_bound_is_tight():
    worst = {}
    for t in range(1, 9000):
        r = round_tokens(t, 64, 8)
        worst[r] = max(worst.get(r, 0), r - t)
    assert all(worst[r] == pad_bound(r, 64, 8) for r in worst)


def test_round_seqs():
    assert [round_seqs(n, 8) for n in (1, 7, 8, 9, 16, 17, 128, 129)] == [8, 8, 8, 16, 16, 32, 128, 256]
    assert [round_seqs(n, 1) for n in (1, 2, 3, 5)] == [1, 2, 4, 8]
    assert round_seqs(5, 12) == 12


def test_dummy_layout_fits_every_admissible_batch():
    cfg = GraphConfig(max_seqlen=64, seqlen_buckets=(16, 32), max_seqs=64)
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 64)
        lengths = [rng.randint(0, 64) for _ in range(n)]
        t, s = max(1, sum(lengths)), max(lengths)
        b = bucket_for(cfg, n, t, s)
        assert b.seqlen >= s and b.seqlen in cfg.seqlen_grid and b.tokens >= t
        tail = b.dummy_tail(t, n)
        assert len(tail) == b.seqs - n
        bounds = [t] + tail
        assert bounds[-1] == b.tokens, "every padding token belongs to a dummy sequence"
        assert all(0 <= hi - lo <= b.seqlen for lo, hi in zip(bounds, bounds[1:])), "dummies fit max_seqlen"


def test_varied_query_traffic_reuses_few_graphs():
    cfg = GraphConfig()
    rng = random.Random(1)
    for batch, most in ((8, 12), (128, 8)):
        keys = set()
        for _ in range(2000):
            lengths = [min(128, max(3, int(rng.lognormvariate(math.log(30), 0.5)))) for _ in range(batch)]
            keys.add(bucket_for(cfg, batch, sum(lengths), max(lengths)))
        assert len(keys) <= most, (batch, sorted(k.tokens for k in keys))
        assert len({k.seqs for k in keys}) <= 2 and {k.seqlen for k in keys} == {128}


# --------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize("kw", [
    dict(max_seqlen=0), dict(max_seqs=-1), dict(max_graphs=0), dict(warmup=0), dict(max_seqlen=True),
    dict(token_multiple=48), dict(token_steps_per_octave=3), dict(seqlen_buckets=(64, 32)),
    dict(seqlen_buckets=(32, 4096)), dict(max_seqlen=128, seqlen_buckets=(32, 256)), dict(max_tokens=10 ** 9),
    dict(precapture=((0, 8),)), dict(max_seqlen=128, precapture=((8, 8 * 128 + 1),)),
    dict(precapture=((8, 40000),)), dict(precapture=((300, 900),)), dict(max_seqlen=128, precapture=((8, 100, 256),)),
    dict(precapture=((8,),)), dict(max_graphs=2, precapture=((8, 64), (8, 512), (8, 1024))),
])
def test_config_rejects(kw):
    with pytest.raises(PackedEncodersError):
        GraphConfig(**kw)


def test_config_defaults_and_normalize():
    cfg = GraphConfig()
    # queries, passages and documents each get their own seqlen bucket; the token bound caps graph memory
    assert cfg.max_seqlen == 2048 and cfg.token_limit == 32768 and cfg.seqlen_grid == (128, 512, 2048)
    assert GraphConfig(max_seqlen=128).seqlen_grid == (128,)
    assert GraphConfig(max_seqlen=128).token_limit == cfg.max_seqs * 128
    assert GraphConfig(max_seqlen=300).seqlen_grid == (128, 300)
    assert GraphConfig(seqlen_buckets=()).seqlen_grid == (2048,)
    assert GraphConfig(max_seqlen=128, seqlen_buckets=[32, 64]).seqlen_grid == (32, 64, 128)
    assert GraphConfig(seqlen_buckets=None) == cfg
    assert GraphConfig(max_seqlen=4096).seqlen_grid == (128, 512, 2048, 4096)
    # unset buckets stay unset, so replace() recomputes them for the new max_seqlen
    assert replace(cfg, max_seqlen=64).seqlen_grid == (64,)
    assert replace(GraphConfig(max_seqlen=256), max_seqlen=4096).seqlen_grid == GraphConfig(max_seqlen=4096).seqlen_grid
    import numpy as np
    assert GraphConfig(seqlen_buckets=[np.int64(64)], precapture=[(np.int32(8), 100)]).precapture == ((8, 100),)
    assert normalize(None) == GraphConfig() and normalize(False) is None  # None: automatic graphs
    assert normalize(True) == GraphConfig()
    assert normalize(cfg) is cfg
    with pytest.raises(PackedEncodersError):
        normalize("yes")
    assert hash(GraphConfig(precapture=[[8, 64]])) == hash(GraphConfig(precapture=((8, 64),)))


@pytest.mark.parametrize("kw", [
    dict(seqlen_buckets=(1.5,)), dict(seqlen_buckets=128), dict(seqlen_buckets=("128",)),
    dict(precapture=(8, 512)), dict(precapture=((8.9, 512.5),)), dict(precapture=((8, True),)), dict(precapture=8),
])
def test_config_rejects_non_int_entries(kw):
    with pytest.raises(PackedEncodersError):
        GraphConfig(**kw)


def test_precapture_without_seqlen_takes_the_smallest_bucket_that_fits():
    cfg = GraphConfig(precapture=((8, 512), (8, 3000), (8, 9000), (8, 100, 2048)))
    assert [b.seqlen for b in precapture_buckets(cfg)] == [128, 512, 2048, 2048]
    # the bucket a batch of 8 queries of 64 tokens is served from
    assert precapture_buckets(cfg)[0] == bucket_for(cfg, 8, 512, 64)


@pytest.mark.parametrize("args", [(8, 1024, 8), (0, 8, 64), (-1, 8, 64), (8, 0, 64), (8, 8, 64, 0),
                                  (8, 8, 20000), (8, 8, 2048, 128), (8.0, 8, 64)])
def test_with_precapture_rejects_what_it_cannot_serve(args):
    with pytest.raises(PackedEncodersError):
        GraphConfig().with_precapture(*args)


def test_with_precapture_covers_the_range():
    cfg = GraphConfig().with_precapture(8, 8, 1024)
    wanted = {bucket_for(cfg, 8, t, 128) for t in range(8, 1025)}
    assert set(precapture_buckets(cfg)) == wanted and len(wanted) <= cfg.max_graphs
    mixed = GraphConfig().with_precapture(8, 8, 2048)   # the 128 bucket up to 1,024 tokens, 512 above
    assert {b.seqlen for b in precapture_buckets(mixed)} == {128, 512}
    assert max(e[1] for e in mixed.precapture) > 1024
    docs = GraphConfig().with_precapture(8, 4096, 8192, max_seqlen=2048)
    wanted = {bucket_for(docs, 8, t, 2048) for t in range(4096, 8193)}
    assert set(precapture_buckets(docs)) == wanted and all(b.seqlen == 2048 for b in wanted)


# --------------------------------------------------------------------------------------------- admission


def test_admission_order_and_bounds():
    cfg = GraphConfig(max_seqlen=64, max_seqs=16, max_tokens=300)
    ok = CallFacts(num_seqs=16, total_tokens=300, max_seqlen=64)
    assert isinstance(admit(cfg, ok), Bucket)
    cases = [
        (dict(kill_switch=True, grad=True), B.KILL_SWITCH), (dict(suspended=True, grad=True), B.SUSPENDED),
        (dict(grad=True), B.GRAD), (dict(dropout=True), B.DROPOUT),
        (dict(hidden_states=True), B.HIDDEN_STATES), (dict(inputs_embeds=True), B.EMBEDS),
        (dict(model_on_cuda=False), B.NOT_CUDA), (dict(same_device=False), B.OTHER_DEVICE),
        (dict(num_seqs=17), B.TOO_MANY_SEQS), (dict(total_tokens=301), B.TOO_MANY_TOKENS),
        (dict(max_seqlen=65), B.TOO_LONG),
    ]
    for change, reason in cases:
        facts = CallFacts(**{**ok.__dict__, **change})
        assert admit(cfg, facts) == reason, change


def test_kill_switch_values(monkeypatch):
    from packed_encoders.tuning import read_tuning

    for value, off in (("0", True), ("false", True), (" OFF ", True), ("no", True), ("1", False), ("", False),
                       ("Yes", False), (" on", False), ("true", False)):
        monkeypatch.setenv("PACKED_ENCODERS_GRAPH", value)
        assert read_tuning().graphs is not off, value
    for value in ("disable", "n", "00", "0.0", "none"):  # never taken for on or off: an error naming the switch
        monkeypatch.setenv("PACKED_ENCODERS_GRAPH", value)
        with pytest.raises(pe.PackedEncodersError, match=f"PACKED_ENCODERS_GRAPH={value!r}"):
            read_tuning()
    monkeypatch.delenv("PACKED_ENCODERS_GRAPH")
    assert read_tuning().graphs is True


def test_unknown_variables_and_a_missing_policy_file_are_not_ignored(monkeypatch, tmp_path):
    from packed_encoders.tuning import read_tuning

    monkeypatch.setenv("PACKED_ENCODERS_GRAPHS", "0")  # (the switch is PACKED_ENCODERS_GRAPH)
    with pytest.warns(UserWarning, match="PACKED_ENCODERS_GRAPHS is not among"):
        tuning = read_tuning()
    assert tuning.graphs is True
    assert tuning.describe()["ignored_env"] == ["PACKED_ENCODERS_GRAPHS"]
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "1")
    with pytest.warns(UserWarning, match="PACKED_ENCODERS_GRAPHS is not among"):
        assert read_tuning().describe()["ignored_env"] == ["PACKED_ENCODERS_GRAPHS"]
    monkeypatch.delenv("PACKED_ENCODERS_GRAPH")
    monkeypatch.delenv("PACKED_ENCODERS_GRAPHS")
    monkeypatch.setenv("PACKED_ENCODERS_POLICY", str(tmp_path / "missing.json"))
    with pytest.raises(pe.PackedEncodersError, match="PACKED_ENCODERS_POLICY=.*no such file"):
        read_tuning()
    (tmp_path / "missing.json").write_text("{}")
    assert read_tuning().policy_file == str(tmp_path / "missing.json")


# --------------------------------------------------------------------------------------------- LRU


def test_lru_bound_promotion_and_eviction():
    mgr = GraphManager(GraphConfig(max_graphs=3))
    built = []

    def build(k):
        built.append(k)
        return f"runner{k}"

    for k in (1, 2, 3):
        assert mgr.get(k, lambda k=k: build(k)) == f"runner{k}"
    assert mgr.get(1, lambda: build(99)) == "runner1" and built == [1, 2, 3]   # hit: no build, promoted
    mgr.get(4, lambda: build(4))                                               # evicts 2, the LRU
    assert mgr.keys() == [3, 1, 4] and mgr.evictions == 1 and mgr.misses == 4 and len(mgr) == 3
    mgr.get(2, lambda: build(2))
    assert mgr.keys() == [1, 4, 2] and built == [1, 2, 3, 4, 2]


def test_failed_capture_is_remembered_and_warned_once():
    mgr = GraphManager(GraphConfig())
    calls = []

    def boom():
        calls.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.warns(RuntimeWarning, match="capture failed"):
        assert mgr.get("k", boom) == B.CAPTURE_FAILED
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mgr.get("k", boom) == B.CAPTURE_FAILED
    assert calls == [1] and len(mgr) == 0 and "k" in mgr.failures()


def test_fingerprint_change_drops_everything():
    mgr = GraphManager(GraphConfig())
    assert mgr.check_fingerprint(("cuda:0", torch.bfloat16, 1)) is False
    mgr.get("a", lambda: "ra")
    assert mgr.check_fingerprint(("cuda:0", torch.bfloat16, 1)) is False and len(mgr) == 1
    assert mgr.check_fingerprint(("cuda:0", torch.float32, 2)) is True
    assert len(mgr) == 0 and mgr.invalidations == 1 and mgr.pool is None


# --------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("lengths", [[5], [1, 17, 33, 2, 64], [40] * 7, [0, 12, 0, 30], [3] * 9])
@pytest.mark.parametrize("backend", ["sdpa", "auto"])
def test_bucket_layout_matches_eager(lengths, backend):
    model = tiny_model()
    pe.pack(model, validate=False, attention_backend=backend)
    state = get_state(model)
    batch = batch_of(lengths)
    cfg = GraphConfig(max_seqlen=64)
    bucket = bucket_for(cfg, batch.num_seqs, batch.total_tokens, batch.max_seqlen)
    assert bucket.tokens > batch.total_tokens or bucket.seqs > batch.num_seqs
    runner = GraphRunner(model, state, bucket, backend, capture=False)
    with torch.no_grad():
        eager = run_packed(model, state, batch)
        got = runner.replay(batch, torch.clone)
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=2e-5)


def test_padding_content_never_reaches_real_tokens():
    model = tiny_model()
    pe.pack(model, validate=False, attention_backend="sdpa")
    state = get_state(model)
    batch = batch_of([30, 7, 64, 1, 19])   # local window 8: past the window too
    bucket = bucket_for(GraphConfig(max_seqlen=64), batch.num_seqs, batch.total_tokens, batch.max_seqlen)
    runner = GraphRunner(model, state, bucket, "sdpa", capture=False)
    t = batch.total_tokens
    with torch.no_grad():
        ref = runner.replay(batch, torch.clone)
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            # scribble over every padding slot after staging, as a stale previous batch would leave it
            runner.ids[t:] = torch.randint(0, VOCAB, (bucket.tokens - t,), generator=g)
            runner.pos[t:] = torch.randint(0, bucket.seqlen, (bucket.tokens - t,), generator=g)
            out = runner._forward()[:t]
            assert torch.equal(out, ref), "padding content changed real outputs"
    # and the staged cu_seqlens is the host reference layout
    assert runner.cu.tolist() == batch.cu_seqlens.tolist() + bucket.dummy_tail(t, batch.num_seqs)


def test_staging_works_in_and_out_of_inference_mode():
    model = tiny_model()
    pe.pack(model, validate=False)
    state = get_state(model)
    with torch.inference_mode():
        batch = batch_of([9, 20])
        runner = GraphRunner(model, state, bucket_for(GraphConfig(), 2, 29, 20), "auto", capture=False)
        a = runner.replay(batch, torch.clone)
    with torch.no_grad():
        b = runner.replay(batch_of([9, 20]), torch.clone)
    assert not runner.ids.is_inference() and torch.equal(a, b)


def test_replay_output_is_owned_by_the_caller():
    model = tiny_model()
    pe.pack(model, validate=False)
    state = get_state(model)
    b1, b2 = batch_of([9, 20], seed=1), batch_of([11, 18], seed=2)
    bucket = bucket_for(GraphConfig(), 2, 29, 20)
    runner = GraphRunner(model, state, bucket, "auto", capture=False)
    with torch.no_grad():
        first = runner.replay(b1, torch.clone)
        keep = first.clone()
        runner.replay(b2, torch.clone)
    assert torch.equal(first, keep)


# --------------------------------------------------------------------------------------------- routing


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Route on CPU: pretend the model is on CUDA and build capture-free runners; count builds."""
    builds = []
    real_mode = call.mode_facts

    def mode(*a, **k):  # the router's mode facts
        return {**real_mode(*a, **k), "model_on_cuda": True}

    def build(model, state, mgr, bucket, requested, query_only=False, autocast=None):
        builds.append(bucket)
        return GraphRunner(model, state, bucket, requested, capture=False, query_only=query_only)

    monkeypatch.setattr(call, "mode_facts", mode)
    monkeypatch.setattr(route, "_build", build)
    monkeypatch.delenv("PACKED_ENCODERS_GRAPH", raising=False)
    return builds


def _forward(model, ids, mask, **kw):
    return model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state


def _graph_info(model):
    return pe.describe(model)["encoders"][0]["cuda_graph"]


def test_cuda_graph_true_engages_under_auto(cpu_graphs):
    model = tiny_model()
    ids, mask = padded_batch([5, 17, 33], "mixed")
    with torch.no_grad():
        eager = _forward(pe.pack(model, validate=False, cuda_graph=False), ids, mask)
        pe.pack(model, validate=False, cuda_graph=True)
        assert get_state(model).options.cuda_graph == GraphConfig()
        first = _forward(model, ids, mask)
        second = _forward(model, ids, mask)
    info = _graph_info(model)
    json.dumps(pe.describe(model))
    assert info["enabled"] and info["graphs"] == 1 and info["misses"] == 1 and info["hits"] == 1
    assert info["buckets"][0]["backend"] == "auto" and len(cpu_graphs) == 1
    torch.testing.assert_close(first, eager, atol=2e-5, rtol=2e-5)
    assert torch.equal(first, second)
    assert torch.equal(first[mask == 0], torch.zeros_like(first[mask == 0])), "padded positions are zeros"


def test_every_fallback_runs_eagerly(cpu_graphs, monkeypatch):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=GraphConfig(max_seqlen=64, max_seqs=4))
    ids, mask = padded_batch([5, 17, 33], "mixed")

    def fallbacks():
        return _graph_info(model).get("fallbacks", {})

    _forward(model, ids, mask)                                               # grad enabled
    assert fallbacks() == {B.GRAD: 1} and not cpu_graphs
    with torch.no_grad():
        _forward(model, ids, mask, output_hidden_states=True)
        model(inputs_embeds=model.embeddings.tok_embeddings(ids), attention_mask=mask)
        _forward(model, *padded_batch([3] * 5, "mixed"))                            # 5 > max_seqs
        _forward(model, *padded_batch([65, 2], "mixed"))                            # longer than max_seqlen
        with pe.no_cuda_graph(model):
            with pe.no_cuda_graph(model):
                _forward(model, ids, mask)
            _forward(model, ids, mask)
        model.train()
        _forward(model, ids, mask)                                           # train mode, no dropout: graphs
        model.eval()
    assert fallbacks() == {B.GRAD: 1, B.HIDDEN_STATES: 1, B.EMBEDS: 1, B.TOO_MANY_SEQS: 1, B.TOO_LONG: 1,
                           B.SUSPENDED: 2}
    assert len(cpu_graphs) == 1
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "0")  # read at pack(): this call still replays
    with torch.no_grad():
        _forward(model, ids, mask)
        assert len(cpu_graphs) == 1 and B.KILL_SWITCH not in fallbacks()
        pe.pack(model, validate=False, cuda_graph=GraphConfig(max_seqlen=64, max_seqs=4))  # re-reads the switches
        _forward(model, ids, mask)
    assert fallbacks() == {B.KILL_SWITCH: 1} and len(cpu_graphs) == 1


def test_dropout_in_training_runs_eagerly(cpu_graphs):
    model = tiny_model()
    pe.pack(model, validate=False, cuda_graph=True)
    for layer in model.layers:
        layer.attn.attention_dropout = 0.1  # the rate stock's attention reads per call (set after pack)
    model.train()
    with torch.no_grad():
        _forward(model, *padded_batch([4, 6], "mixed"))
    assert _graph_info(model)["fallbacks"] == {B.DROPOUT: 1} and not cpu_graphs


@pytest.mark.parametrize("where", DROPOUT_AFTER_PACK)
def test_live_dropout_in_an_eval_model_runs_eagerly(cpu_graphs, where):
    """A graph replays a forward without dropout: Monte-Carlo dropout (model.eval(), nn.Dropout modules back in
    train mode), an attention module in train mode with a rate set after pack(), or a dropout module swapped in
    after pack() must run eagerly (with the dropout), whatever model.training and the config's rates say."""
    model = tiny_model()  # all dropout rates 0 in the config
    pe.pack(model, validate=False, cuda_graph=True)
    ids, mask = padded_batch([4, 6], "mixed")
    with torch.no_grad():
        base = _forward(model, ids, mask)  # captured (CPU stand-in)
        assert len(cpu_graphs) == 1
        enable_dropout(model, where)
        assert not model.training
        a, b = _forward(model, ids, mask), _forward(model, ids, mask)
        assert _graph_info(model)["fallbacks"] == {B.DROPOUT: 2} and len(cpu_graphs) == 1
        real = mask.bool()
        assert (a - b)[real].abs().max() > 1e-3, "dropout applied on the eager route"
        model.eval()  # every module back in eval mode: the graph serves again, without dropout
        torch.testing.assert_close(_forward(model, ids, mask), base, atol=0, rtol=0)
    assert _graph_info(model)["fallbacks"] == {B.DROPOUT: 2} and len(cpu_graphs) == 1


def test_far_positions_are_served_by_graphs(cpu_graphs):
    """RoPE from HF's live inv_freq buffers is computed inside the graph: no table bounds the positions."""
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    ids, mask = padded_batch([6, 6], "mixed")
    far = torch.arange(6)[None].expand(2, 6) + 5000
    with torch.no_grad():
        _forward(model, ids, mask)
        out = model(input_ids=ids, attention_mask=mask, position_ids=far).last_hidden_state
        with pe.no_cuda_graph(model):
            eager = model(input_ids=ids, attention_mask=mask, position_ids=far).last_hidden_state
    assert get_state(model).runtime["graphs"].runners()[0].tables == []
    assert B.POSITIONS not in _graph_info(model).get("fallbacks", {}) and _graph_info(model)["hits"] == 1
    torch.testing.assert_close(out, eager, atol=2e-5, rtol=2e-5)


def test_packed_calls_and_packed_forward_use_graphs(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (40,), generator=g)
    cu = torch.tensor([0, 10, 25, 40], dtype=torch.int32)
    with torch.no_grad():
        with pe.no_cuda_graph(model):
            eager = pe.packed_forward(model, None, ids, cu, 15)
            hf_eager = model(input_ids=ids[None], cu_seq_lens_q=cu, max_length_q=15).last_hidden_state
        got = pe.packed_forward(model, None, ids, cu, 15)
        hf = model(input_ids=ids[None], cu_seq_lens_q=cu, max_length_q=15).last_hidden_state
        other = pe.packed_forward(model, None, ids, cu, 15, backend="sdpa")
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(other, eager, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(hf, hf_eager, atol=2e-5, rtol=2e-5)
    assert hf.shape == (1, 40, 64)
    info = _graph_info(model)
    assert info["hits"] == 1 and info["misses"] == 2, "auto bucket reused; an explicit backend is its own graph"
    assert sorted(b["backend"] for b in info["buckets"]) == ["auto", "sdpa"]
    # the returned tensors do not alias the static output
    keep = got.clone()
    with torch.no_grad():
        pe.packed_forward(model, None, torch.randint(3, VOCAB, (40,), generator=g), cu, 15)
    assert torch.equal(got, keep)


def test_lru_bound_through_routing(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=GraphConfig(max_graphs=2, token_multiple=16))
    with torch.no_grad():
        for lengths in ([10], [30], [60], [10]):
            _forward(model, *padded_batch(lengths, "mixed"))
    info = _graph_info(model)
    assert info["graphs"] == 2 and info["evictions"] == 2 and info["misses"] == 4 and info["hits"] == 0


def test_dtype_change_recaptures(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    ids, mask = padded_batch([7, 12], "mixed")
    with torch.no_grad():
        _forward(model, ids, mask)
        model.double()
        out = _forward(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = _forward(model, ids, mask)
    assert out.dtype == torch.float64 and torch.allclose(out, eager, atol=1e-10)
    info = _graph_info(model)
    assert info["invalidations"] == 1 and info["misses"] == 2 and info["graphs"] == 1


def test_set_cuda_graph_and_precapture(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False)
    with pytest.raises(PackedEncodersError):
        pe.set_cuda_graph(tiny_model(), True)
    with pytest.raises(PackedEncodersError):
        pe.set_cuda_graph(model, False, GraphConfig())
    cfg = GraphConfig(max_seqlen=32).with_precapture(2, 2, 64)
    with pytest.warns(UserWarning, match="CUDA graphs start once"):
        pe.set_cuda_graph(model, True, cfg)   # CPU model: precapture waits for the first admitted call
    assert not cpu_graphs
    with torch.no_grad():
        _forward(model, *padded_batch([5, 9], "mixed"))
    assert set(cpu_graphs) == set(precapture_buckets(cfg)) and _graph_info(model)["hits"] == 1
    pe.set_cuda_graph(model, False)
    assert _graph_info(model) == {"enabled": False, "mode": "off", "kill_switch": False, "suspended": False}
    pe.set_cuda_graph(model, True)  # back on: the config graphs had before they were switched off
    assert get_state(model).options.cuda_graph == cfg
    assert get_state(pe.set_cuda_graph(pe.pack(tiny_model(), validate=False, cuda_graph=False), True)).options \
        .cuda_graph == GraphConfig()


def test_repack_same_graph_option_keeps_state():
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    state = get_state(model)
    pe.pack(model, validate=False, cuda_graph=GraphConfig())
    assert get_state(model) is state
    pe.pack(model, validate=False)  # the default: automatic graphs (new state, same bounds)
    assert get_state(model) is not state and get_state(model).options.graph_auto
    assert get_state(model).options.cuda_graph == GraphConfig()
    pe.pack(model, validate=False, cuda_graph=False)
    assert get_state(model).options.cuda_graph is None
    with pytest.raises(PackedEncodersError):
        pe.pack(model, validate=False, cuda_graph="on")


def test_cpu_model_falls_back_without_patching():
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    ids, mask = padded_batch([4, 9], "mixed")
    with torch.no_grad():
        out = _forward(model, ids, mask)
        with pe.no_cuda_graph(model):
            ref = _forward(model, ids, mask)
    assert torch.equal(out, ref)
    info = _graph_info(model)
    assert info["fallbacks"] == {B.NOT_CUDA: 1, B.SUSPENDED: 1} and info["graphs"] == 0


def test_copies_drop_runners(cpu_graphs):
    import pickle

    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    ids, mask = padded_batch([4, 9], "mixed")
    with torch.no_grad():
        ref = _forward(model, ids, mask)
    assert len(get_state(model).runtime["graphs"]) == 1
    with pe.no_cuda_graph(model):
        twin = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)
        blob = pickle.dumps(get_state(model))
    for other in (twin, torch.load(io.BytesIO(buf.getvalue()), weights_only=False)):
        st = get_state(other)
        # no runners: at most the weak reference to the module the state belongs to (PackState._stale_previous)
        assert set(st.runtime) <= {"owner"} and st.options.cuda_graph == GraphConfig()
        with torch.no_grad():
            assert torch.equal(_forward(other, ids, mask), ref)
        assert _graph_info(other)["misses"] == 1, "the copy captures its own graphs"
    assert pickle.loads(blob).runtime == {}
    assert get_state(model).runtime["graphs_suspended"] == 0


# --------------------------------------------------------------------------------------------- pack gate


def test_pack_validates_the_graph_path(cpu_graphs, monkeypatch):
    from packed_encoders import graph_check as check

    monkeypatch.setattr(check, "_eligible", lambda config, weight, tuning: config is not None)
    model = pe.pack(tiny_model(), cuda_graph=GraphConfig(max_seqlen=64), validation_lengths=(1, 9, 40))
    report = get_state(model).report
    assert report.passed and any(c.startswith("cuda_graph: replay vs eager") for c in report.checks)
    info = _graph_info(model)
    assert info["misses"] == 1 and info["graphs"] == 0, "the check batch's bucket was captured, then dropped"
    model = pe.pack(tiny_model(), cuda_graph=GraphConfig(max_seqlen=64, precapture=((2, 64),)),
                    validation_lengths=(1, 9, 40))
    info = _graph_info(model)
    assert info["misses"] == 2 and info["graphs"] == 1, "a precaptured bucket stays"
    assert check.check_lengths(GraphConfig(max_seqlen=64), 8) == [1, 9, 18, 21, 64]
    assert check.check_lengths(GraphConfig(max_seqlen=128, max_seqs=2), 64) == [1, 42]

    real = check.graph_forward
    monkeypatch.setattr(check, "graph_forward", lambda *a, **k: real(*a, **k) * 1.5 + 0.3)
    with pytest.raises(pe.ValidationError, match="cuda_graph: fp32 max relative error"):
        pe.pack(tiny_model(), cuda_graph=True, validation_lengths=(1, 9, 40))
    monkeypatch.setattr(check, "graph_forward", lambda *a, **k: None)
    fresh = tiny_model()
    with pytest.raises(pe.ValidationError, match="not served by a graph"):
        pe.pack(fresh, cuda_graph=True, validation_lengths=(1, 9, 40))
    assert not pe.is_packed(fresh)


def test_pack_gate_is_a_no_op_off_cuda():
    model = pe.pack(tiny_model(), cuda_graph=True, validation_lengths=(1, 9, 40))
    assert not any(c.startswith("cuda_graph") for c in get_state(model).report.checks)


def test_describe_says_why_graphs_are_idle(monkeypatch):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    idle = lambda: pe.describe(model)["encoders"][0]["cuda_graph"]["idle_reason"]  # noqa: E731
    assert "on cpu" in idle(), "before any call, a CPU model says graphs cannot engage"
    with pe.no_cuda_graph(model):
        assert "no_cuda_graph" in idle()
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "0")
    assert "on cpu" in idle(), "the switches are read at pack()"
    pe.pack(model, validate=False, cuda_graph=True)
    assert "PACKED_ENCODERS_GRAPH" in idle()
    off = pe.describe(pe.pack(tiny_model(), validate=False, cuda_graph=False))["encoders"][0]["cuda_graph"]
    assert "idle_reason" not in off


def test_query_only_tails_get_their_own_graphs(cpu_graphs):
    """ColBERT query expansion (trailing masked positions computed): key_lens are staged, not dropped."""
    model = tiny_model()
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(40)[None] < torch.tensor([5, 17, 33])[:, None]).long()  # right padding
    with torch.no_grad():
        eager = _forward(pe.pack(model, validate=False, padded_outputs="all"), ids, mask)
        pe.pack(model, validate=False, padded_outputs="all", cuda_graph=True)
        graphed = _forward(model, ids, mask)
        assert _graph_info(model)["buckets"][0]["query_only"] is True
        plain = _forward(pe.pack(model, validate=False, padded_outputs="zeros", cuda_graph=True), ids, mask)
    torch.testing.assert_close(graphed, eager, atol=2e-5, rtol=2e-5)
    assert graphed[mask == 0].abs().max() > 0 and plain[mask == 0].abs().max() == 0


@pytest.mark.parametrize("change", ["new_parameter", "parameters_dict", "bias_added"])
def test_replaced_parameter_objects_drop_graphs(cpu_graphs, change):
    """A new Parameter object, a module given a whole new ``_parameters`` dict, or a bias where there was none:
    each is seen (the slots are read live each call) and drops the graphs."""
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    ids, mask = padded_batch([4, 9], "mixed")
    with torch.no_grad():
        before = _forward(model, ids, mask)
        layer = model.layers[1].mlp.Wo
        if change == "new_parameter":
            layer.weight = torch.nn.Parameter(layer.weight * 2)  # a new Parameter object with new storage
        elif change == "parameters_dict":
            layer._parameters = {"weight": torch.nn.Parameter(layer.weight * 2), "bias": layer.bias}
        else:
            assert layer.bias is None
            layer.bias = torch.nn.Parameter(torch.full((layer.out_features,), 0.5))
        after = _forward(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = _forward(model, ids, mask)
    assert _graph_info(model)["invalidations"] >= 1
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, eager, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("change", ["linear", "norm", "layers_reordered", "norm_eps", "rotary_buffer"])
def test_module_tree_changes_drop_graphs(cpu_graphs, change):
    """A change the packed forward follows live but a captured graph baked in: a submodule replaced by a new one of
    the same type (the graph reads the old one's weights by address), two layers of one attention type swapped
    (the graph runs them in the old order), a norm's ``eps`` set (a kernel argument at capture). Each moves the
    structure snapshot's tree, which drops the graphs; the next call captures the live modules."""
    model = pe.pack(tiny_model(layers=4), validate=False, cuda_graph=True)  # layers 1 and 2 both local
    ids, mask = padded_batch([4, 9], "mixed")
    with torch.no_grad():
        _forward(model, ids, mask)
        if change == "linear":
            model.layers[1].attn.Wqkv = torch.nn.Linear(model.config.hidden_size, 3 * model.config.hidden_size,
                                                        bias=False)
        elif change == "norm":
            model.final_norm = torch.nn.LayerNorm(model.config.hidden_size, eps=1e-3, bias=False)
        elif change == "layers_reordered":
            model.layers[1], model.layers[2] = model.layers[2], model.layers[1]
        elif change == "rotary_buffer":  # a capture computes its RoPE tables from the buffer, read by address
            rotary = next(m for m in model.modules() if type(m).__name__ == "ModernBertRotaryEmbedding")
            name = next(n for n in rotary._buffers if n.endswith("inv_freq"))
            setattr(rotary, name, getattr(rotary, name) * 1.5)
        else:
            model.final_norm.eps = 0.5
        _forward(model, ids, mask)
        assert _graph_info(model)["invalidations"] == 1
        _forward(model, ids, mask)  # the tree is unchanged since: the graphs stay
    assert _graph_info(model)["invalidations"] == 1


def test_hook_rescans_keep_graphs(cpu_graphs):
    """A known hook (``enable_input_require_grads``) makes every call after some other hook's registration rescan
    the tree and rebuild the snapshot; the modules did not change, so the graphs stay."""
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    model.enable_input_require_grads()
    ids, mask = padded_batch([4, 9], "mixed")
    with torch.no_grad():
        _forward(model, ids, mask)
        torch.zeros(1, requires_grad=True).register_hook(lambda g: g)  # moves RemovableHandle's counter
        _forward(model, ids, mask)
    assert _graph_info(model)["invalidations"] == 0


def test_weights_are_checked_before_the_sync_once_per_call(cpu_graphs, monkeypatch):
    """The fingerprint (and any invalidation it causes) is read before unpad's host sync, so that after the
    sync only batch-dependent work stands between it and the replay; it is not read twice."""
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    ids, mask = padded_batch([4, 9], "mixed")
    events = []
    real_fp, real_unpad = route.fingerprint, call.unpad
    monkeypatch.setattr(route, "fingerprint", lambda *a: events.append("fingerprint") or real_fp(*a))
    monkeypatch.setattr(call, "unpad", lambda **k: events.append("unpad") or real_unpad(**k))
    with torch.no_grad():
        _forward(model, ids, mask)
        events.clear()
        _forward(model, ids, mask)
    assert events == ["fingerprint", "unpad"]



@pytest.mark.parametrize("mode", ["grad_training", "hidden_states"])
def test_refused_calls_capture_nothing_before_the_sync(cpu_graphs, mode):
    """prepare() runs before admission: for a call admission refuses it must neither check the weights nor
    run the (deferred) precapture, or a graph would be captured in a mode it must not bake in."""
    model = tiny_model()
    pe.pack(model, validate=False, cuda_graph=GraphConfig(precapture=((2, 64),)))
    ids, mask = padded_batch([4, 9], "mixed")
    if mode == "grad_training":
        model.train()
        _forward(model, ids, mask)
    else:
        with torch.no_grad():
            _forward(model, ids, mask, output_hidden_states=True)
    assert cpu_graphs == []
    model.eval()
    with torch.no_grad():
        _forward(model, ids, mask)
    assert len(cpu_graphs) >= 1  # an admissible call runs the precapture


@pytest.mark.parametrize("backend, top", [("auto", 2048), ("sdpa", 2048), ("triton", 512)])
def test_graph_check_batch_stays_inside_an_explicit_backends_envelope(monkeypatch, backend, top):
    """The pack-time graph check's longest sequence is the longest seqlen bucket the requested backend runs on a
    global layer (the Triton kernel stops at 1,024 tokens, so bucket 512), else ``max_seqlen``."""
    from packed_encoders import graph_check as check
    from packed_encoders.attention import BACKENDS

    monkeypatch.setitem(BACKENDS, "triton", replace(BACKENDS["triton"], availability=lambda: None))  # as on a GPU
    state = get_state(pe.pack(make_model("base_like", hidden_size=128, num_attention_heads=2), validate=False))
    state.options = replace(state.options, attention_backend=backend)
    config = GraphConfig()
    assert check.backend_top(config, state, torch.bfloat16) == top
    assert max(check.check_lengths(config, 16, check.backend_top(config, state, torch.bfloat16))) == top


def test_packed_graphs_of_one_octave_share_one_static_output():
    """The static outputs of packed graphs whose buckets lie in one octave are views of one manager buffer; every
    replay's result still equals the eager forward (each is copied out before the next replay writes)."""
    import functools

    model = tiny_model()
    pe.pack(model, validate=False, attention_backend="sdpa")
    state = get_state(model)
    mgr = GraphManager(GraphConfig(max_seqlen=64))
    outputs = functools.partial(route.shared_output, mgr, torch.device("cpu"))
    cfg = GraphConfig(max_seqlen=64, token_multiple=16)
    runs = []
    for lengths in ([30, 7, 64], [40, 33, 50]):
        batch = batch_of(lengths)
        bucket = bucket_for(cfg, batch.num_seqs, batch.total_tokens, batch.max_seqlen)
        runs.append((batch, bucket, GraphRunner(model, state, bucket, "sdpa", capture=False, outputs=outputs)))
    (_, b1, r1), (_, b2, r2) = runs
    assert b1.tokens != b2.tokens and (b1.tokens - 1).bit_length() == (b2.tokens - 1).bit_length()
    assert r1.shared_out and r2.shared_out and r1.out.data_ptr() == r2.out.data_ptr()
    assert len(mgr.outputs) == 1 and next(iter(mgr.outputs.values())).shape[0] == 1 << (b1.tokens - 1).bit_length()
    # the buffer is the manager's, counted once by it, by neither runner
    buf = next(iter(mgr.outputs.values()))
    own = [r.static_bytes - sum(x.numel() * x.element_size() for x in r._static_tensors()) for r in (r1, r2)]
    assert own == [0, 0] and mgr.output_bytes() == buf.numel() * buf.element_size()
    with torch.no_grad():
        for batch, _, runner in runs + runs[::-1]:
            torch.testing.assert_close(runner.replay(batch, torch.clone), run_packed(model, state, batch),
                                       atol=2e-5, rtol=2e-5)


def test_shared_outputs_count_against_the_budget_after_their_first_graph_is_evicted():
    """A shared static output outlives the graph whose capture allocated it (the manager holds it until clear()):
    the budget keeps counting it, so the graphs cached plus the shared outputs never hold more than the budget.
    Here two graphs of one octave and the buffer exceed the budget: capturing the second evicts the first, and
    capturing the first again evicts the second."""
    import functools

    model = tiny_model()
    pe.pack(model, validate=False, attention_backend="sdpa")
    state = get_state(model)
    cfg = GraphConfig(max_seqlen=64, token_multiple=16)
    buckets = [bucket_for(cfg, b.num_seqs, b.total_tokens, b.max_seqlen)
               for b in (batch_of([30, 7, 64]), batch_of([40, 33, 50]))]
    assert (buckets[0].tokens - 1).bit_length() == (buckets[1].tokens - 1).bit_length()

    def held(mgr):  # what the cached graphs and the manager's shared outputs hold (CPU runners: no pool)
        return (sum(sum(x.numel() * x.element_size() for x in r._static_tensors()) for r in mgr.runners())
                + sum(t.numel() * t.element_size() for t in mgr.outputs.values()))

    def capture(mgr, bucket):
        outputs = functools.partial(route.shared_output, mgr, torch.device("cpu"))
        return mgr.get(bucket, lambda: GraphRunner(model, state, bucket, "sdpa", capture=False, outputs=outputs))

    probe = GraphManager(cfg)
    for bucket in buckets:
        capture(probe, bucket)
    budget = held(probe) - 1  # everything but one byte
    mgr = GraphManager(cfg, budget_bytes=budget)
    for bucket in buckets + buckets[:1]:
        assert capture(mgr, bucket).shared_out
        assert len(mgr) == 1 and held(mgr) <= budget, (mgr.keys(), held(mgr), budget)
    assert mgr.keys() == buckets[:1] and mgr.evictions == 2


def test_encoder_forward_writes_its_result_into_out():
    """``encoder_forward(out=)``: the result is ``out`` (copied in by ops without ``norm_out``) when the dtype fits;
    a mismatched ``out`` is left alone."""
    from packed_encoders.model.forward import encoder_forward

    model = tiny_model()
    pe.pack(model, validate=False, attention_backend="sdpa")
    state = get_state(model)
    batch = batch_of([12, 30, 5])
    with torch.no_grad():
        want = encoder_forward(model, state.params, batch)
        buf = torch.full((64, model.config.hidden_size), float("nan"))
        got = encoder_forward(model, state.params, batch, out=buf[:batch.total_tokens])
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
        wrong = torch.zeros(batch.total_tokens, model.config.hidden_size, dtype=torch.float64)
        got = encoder_forward(model, state.params, batch, out=wrong)
        assert got.data_ptr() != wrong.data_ptr() and torch.equal(got, want) and not wrong.any()


@pytest.mark.parametrize("faithful", [True, False])
def test_capture_check_compares_the_replay_with_a_copy_of_the_warm_up(monkeypatch, faithful):
    """After capture the graph is replayed once and compared with the warm-up's output. A forward that writes into a
    static output (an octave's shared one) returns that same tensor at warm-up and capture: the warm-up's result
    must be kept as a copy, or the check compares the buffer with itself and passes a capture that recorded
    something else (here: a replay writing 2 where the forward writes 1). The CUDA pieces are fakes."""
    import contextlib

    from packed_encoders.graphs import runner as R

    shared = torch.full((64, 8), float("nan"))
    out = shared[:48]

    def forward():
        return out.fill_(1.0)

    class Graph:
        def replay(self):
            out.fill_(1.0 if faithful else 2.0)

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None, stream=None: contextlib.nullcontext())
    if faithful:
        graph, got = R._warm_and_capture(forward, torch.device("cpu"), None, Stream(), warmup=1)
        assert isinstance(graph, Graph) and got.data_ptr() == shared.data_ptr()
    else:
        with pytest.raises(RuntimeError, match="differs from its eager warm-up"):
            R._warm_and_capture(forward, torch.device("cpu"), None, Stream(), warmup=1)


def test_shared_output_dtype_follows_the_forward_result():
    from packed_encoders.graphs.runner import output_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for autocast in (torch.bfloat16, torch.float16, torch.float32):  # final_norm returns fp32 under CUDA autocast
        assert output_dtype(cuda, autocast, torch.bfloat16) is torch.float32
    assert output_dtype(cuda, None, torch.bfloat16) is torch.bfloat16
    assert output_dtype(cpu, torch.bfloat16, torch.float32) is torch.float32  # CPU graphs are never captured


def test_a_weights_change_waits_for_the_last_replay_stream_before_freeing_buffers():
    class Stream:
        synced = 0

        def synchronize(self):
            Stream.synced += 1

    mgr = GraphManager(GraphConfig())
    mgr.last_stream = Stream()
    assert not mgr.check_fingerprint(("fp", 1)) and Stream.synced == 0  # the first fingerprint drops nothing
    mgr.last_stream = Stream()  # a replay ran since
    mgr.outputs[("k",)] = torch.empty(4)
    assert mgr.check_fingerprint(("fp", 2)) and Stream.synced == 1 and mgr.outputs == {}


def test_control_arguments_of_the_wrong_kind_are_refused():
    model = pe.pack(tiny_model(), validate=False)
    with pytest.raises(pe.PackedEncodersError, match="expected a packed_encoders.GraphConfig"):
        pe.set_cuda_graph(model, True, True)
    with pytest.raises(pe.PackedEncodersError, match="raise_on_failure='yes' must be True or False"):
        pe.validate(model, raise_on_failure="yes")
