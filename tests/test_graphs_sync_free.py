"""``GraphConfig(sync_free=True)`` on CPU: rectangular graphs that unpad on the device, deferred input errors.

The layout tests use ``RectRunner(capture=False)``: the same static buffers, staging, in-graph unpadding and
gather as a captured graph, with the forward run eagerly at each replay. Routing tests swap the CUDA-only
pieces (the device fact and the capture) for that runner; the completion event of the deferred checks is
replaced by a controllable stand-in where a test needs a call still "running".
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace

import pytest
import torch

import packed_encoders as pe
from packed_encoders import call
from packed_encoders.adapters.state import get_state
from packed_encoders.errors import PackedEncodersError
from packed_encoders.graphs import buckets as B
from packed_encoders.graphs import deferred, route
from packed_encoders.graphs.buckets import RectBucket, RectFacts, admit_rect, rect_bucket_for
from packed_encoders.graphs.config import GraphConfig
from packed_encoders.graphs.rectangular import RectRunner, device_unpad

from tests.helpers import VOCAB, padded_batch, tiny_model

SF = GraphConfig(sync_free=True)


def eager_padded(model, ids, mask, **kw):
    with pe.no_cuda_graph(model):
        return model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state


def fwd(model, ids, mask, **kw):
    return model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state


def info(model):
    return pe.describe(model)["encoders"][0]["cuda_graph"]


class FakeEvent:
    """A CUDA event stand-in whose completion the test controls (``done``); ``synchronize`` completes it."""

    instances: list = []
    complete_on_record = True

    def __init__(self):
        self.done = True
        FakeEvent.instances.append(self)

    def record(self, stream=None):
        self.done = FakeEvent.complete_on_record

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Route on CPU: pretend the model is on CUDA and build capture-free runners; count builds."""
    builds = []
    real_mode = call.mode_facts

    def mode(*a, **k):  # the router's mode facts
        return {**real_mode(*a, **k), "model_on_cuda": True}

    def build(model, state, mgr, bucket, requested, query_only=False, autocast=None):
        from packed_encoders.graphs.runner import GraphRunner

        builds.append(bucket)
        return GraphRunner(model, state, bucket, requested, capture=False, query_only=query_only)

    def build_rect(model, state, mgr, bucket, requested, autocast=None):
        builds.append(bucket)
        return RectRunner(model, state, bucket, requested, capture=False)

    monkeypatch.setattr(call, "mode_facts", mode)
    monkeypatch.setattr(route, "_build", build)
    monkeypatch.setattr(route, "_build_rect", build_rect)
    monkeypatch.delenv("PACKED_ENCODERS_GRAPH", raising=False)
    return builds


@pytest.fixture
def pending_events(monkeypatch):
    """Deferred-check events that stay pending after record until the test completes them."""
    FakeEvent.instances = []
    FakeEvent.complete_on_record = False
    monkeypatch.setattr(deferred, "make_event", lambda device: FakeEvent())
    return FakeEvent


def rect_runner(model, lengths_or_shape, backend="sdpa", config=SF, dead_padding=None):
    b, s = lengths_or_shape
    state = get_state(model)
    return RectRunner(model, state, rect_bucket_for(config, b, s, VOCAB), backend, capture=False,
                      dead_padding=dead_padding)


# --------------------------------------------------------------------------------------------- config


def test_config_field_default_validation_and_grid():
    assert GraphConfig().sync_free is False and asdict(GraphConfig())["sync_free"] is False
    assert SF.sync_free is True and SF != GraphConfig() and SF == GraphConfig(sync_free=True)
    for bad in (1, 0, "yes", None):
        with pytest.raises(PackedEncodersError, match="sync_free"):
            GraphConfig(sync_free=bad)
    assert SF.sync_free_seqlen_grid == (32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
    assert GraphConfig(sync_free=True, max_seqlen=100).sync_free_seqlen_grid == (32, 48, 64, 96, 100)
    assert replace(SF, max_seqlen=128).sync_free_seqlen_grid == (32, 48, 64, 96, 128)
    assert SF.sync_free_max_tokens == 2048
    for bad in (0, -1, 1.5, True, 16, 255):   # 16 and 255: below the smallest graph, 8 rows x 32
        with pytest.raises(PackedEncodersError, match="sync_free_max_tokens"):
            GraphConfig(sync_free=True, sync_free_max_tokens=bad)
    assert GraphConfig(sync_free=True, sync_free_max_tokens=256).sync_free_max_tokens == 256
    assert GraphConfig(sync_free_max_tokens=16).sync_free is False   # unread without sync_free
    assert GraphConfig(max_seqlen=64, seqlen_buckets=(16,), sync_free=True).sync_free_seqlen_grid == (16, 64)
    assert SF.seqlen_grid == GraphConfig().seqlen_grid, "the packed grid is unchanged"
    assert pe.pack(tiny_model(), validate=False, cuda_graph=SF) is not None
    assert get_state(pe.pack(tiny_model(), validate=False, cuda_graph=True)).options.cuda_graph.sync_free is False


def test_rect_bucket_and_admission():
    cfg = GraphConfig(sync_free=True, max_seqlen=256, max_seqs=16, max_tokens=1024, sync_free_max_tokens=4096)
    assert rect_bucket_for(cfg, 3, 20, VOCAB) == RectBucket(8, 32, VOCAB)
    assert rect_bucket_for(cfg, 9, 33, VOCAB) == RectBucket(16, 48, VOCAB)
    assert rect_bucket_for(cfg, 9, 49, VOCAB) == RectBucket(16, 64, VOCAB)
    assert rect_bucket_for(cfg, 16, 256, VOCAB).tokens == 16 * 256
    b = RectBucket(8, 64, VOCAB)
    assert (b.tokens, b.seqs, b.seqlen) == (512, 16, 64)
    ok = RectFacts(batch=16, width=64)
    assert admit_rect(cfg, ok, VOCAB) == RectBucket(16, 64, VOCAB)
    cases = [
        (dict(kill_switch=True, grad=True), B.KILL_SWITCH), (dict(suspended=True), B.SUSPENDED),
        (dict(grad=True), B.GRAD), (dict(dropout=True), B.DROPOUT),
        (dict(hidden_states=True), B.HIDDEN_STATES), (dict(inputs_embeds=True), B.EMBEDS),
        (dict(position_ids=True), B.POSITION_IDS), (dict(query_only=True), B.QUERY_ONLY),
        (dict(position_zero=True), B.POSITION_ZERO),
        (dict(integer_inputs=False), B.INPUT_DTYPES), (dict(model_on_cuda=False), B.NOT_CUDA),
        (dict(same_device=False), B.OTHER_DEVICE), (dict(batch=0), B.EMPTY), (dict(width=0), B.EMPTY),
        (dict(batch=17), B.TOO_MANY_SEQS), (dict(width=257, batch=2), B.TOO_WIDE),
        (dict(batch=5, width=205), B.TOO_MANY_PADDED),
    ]
    for change, reason in cases:
        assert admit_rect(cfg, RectFacts(**{**ok.__dict__, **change}), VOCAB) == reason, change
    assert isinstance(admit_rect(cfg, RectFacts(batch=4, width=256), VOCAB), RectBucket)  # B * S == limit
    small = replace(cfg, sync_free_max_tokens=512)   # the padded bucket, not the call, meets this cap
    assert admit_rect(small, RectFacts(batch=8, width=64), VOCAB) == RectBucket(8, 64, VOCAB)
    assert admit_rect(small, RectFacts(batch=5, width=65), VOCAB) == B.TOO_MANY_PADDED   # 8 x 96 > 512


# --------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize("lengths,side,width", [
    ([5], "right", None), ([5, 17, 33, 2, 30], "left", None), ([5, 17, 33, 2, 30], "mixed", None),
    ([0, 12, 0, 30], "mixed", None), ([3] * 9, "right", 40), ([64, 1, 64, 20], "mixed", None),
    ([0, 0], "right", 7),
])
@pytest.mark.parametrize("backend,dead_padding", [("sdpa", None), ("auto", None), ("sdpa", True)])
def test_rect_layout_matches_eager(lengths, side, width, backend, dead_padding):
    """``dead_padding=True``: padding sequences get no keys (zeros out of attention); real tokens unchanged."""
    model = pe.pack(tiny_model(), validate=False, attention_backend=backend)
    ids, mask = padded_batch(lengths, side, pad_to=width)
    b, s = ids.shape
    runner = rect_runner(model, (b, s), backend, dead_padding=dead_padding)
    assert runner.dead_padding is bool(dead_padding)  # on CPU the plan is sdpa: off unless asked
    assert runner.bucket.batch >= b and runner.bucket.width >= s
    assert runner.bucket.batch > b or runner.bucket.width > s, "the bucket is larger than the call"
    with torch.no_grad():
        eager = fwd(model, ids, mask)
        got, flags = runner.replay(ids, mask)
    assert got.shape == (b, s, 64) and flags.tolist() == [0, 0, 0, 0]
    real = mask.bool()
    torch.testing.assert_close(got[real], eager[real], atol=2e-5, rtol=2e-5)
    assert torch.equal(got[~real], torch.zeros_like(got[~real])), "padded positions are exactly zero"


def test_device_unpad_layout_is_the_host_reference():
    """Row b owns stream rows [b*S, (b+1)*S): its real tokens in order, then its padding; cu_seqlens interleaves
    each real sequence with the dummy sequence of its padding; every sequence fits max_seqlen = S."""
    lengths = [5, 0, 32, 1, 9]
    ids, mask = padded_batch(lengths, "mixed", pad_to=32)
    bucket = rect_bucket_for(SF, 5, 32, VOCAB)
    s = bucket.width
    model = pe.pack(tiny_model(), validate=False)
    runner = rect_runner(model, (5, 32))
    runner.stage(ids, mask, None)
    u = device_unpad(runner.bufs, s, VOCAB)
    cu = u["cu"].tolist()
    expect = []
    for row in range(bucket.batch):
        n = lengths[row] if row < len(lengths) else 0
        expect += [row * s, row * s + n]
    assert cu == expect + [bucket.tokens]
    assert all(0 <= hi - lo <= s for lo, hi in zip(cu, cu[1:]))
    stream = u["ids"].view(bucket.batch, s)
    for row, n in enumerate(lengths):
        assert torch.equal(stream[row, :n], ids[row][mask[row].bool()])
    back = u["back"].view(bucket.batch, s)[:5, :32]
    for row in range(5):   # the inverse rotation sends each real position to its stream row
        cols = mask[row].nonzero().flatten()
        assert torch.equal(back[row, cols] - row * s, torch.arange(len(cols)))
    assert runner.bufs["pos"].view(bucket.batch, s)[3].tolist() == list(range(s)), "positions restart per row"


def test_padding_content_never_reaches_real_tokens():
    model = pe.pack(tiny_model(), validate=False, attention_backend="sdpa")
    ids, mask = padded_batch([30, 7, 50, 1, 19], "mixed")
    runner = rect_runner(model, ids.shape)
    with torch.no_grad():
        ref, _ = runner.replay(ids, mask)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            noise = torch.randint(-5, 10 * VOCAB, runner.bufs["ids"].shape, generator=g)
            runner.bufs["ids"].copy_(noise)     # stale ids outside the staged block, as a larger call leaves them
            junk = torch.where(mask.bool(), ids, noise[:5, :50])   # the caller's padding ids: anything at all
            got, flags = runner.replay(junk, mask)
            assert flags.tolist() == [0, 0, 0, 0], "padding ids are not checked (as unpad)"
            assert torch.equal(got, ref), "padding content changed real outputs"


def test_smaller_calls_after_larger_ones_clear_the_stale_mask():
    model = pe.pack(tiny_model(), validate=False, attention_backend="sdpa")
    runner = rect_runner(model, (8, 64))
    calls = [padded_batch([60, 64, 3, 9, 40, 1, 64, 33], "mixed", seed=1), padded_batch([10, 2], "left", seed=2),
             padded_batch([5, 17, 8], "right", pad_to=60, seed=3), padded_batch([64] * 8, "mixed", seed=4),
             padded_batch([1], "mixed", seed=5)]
    with torch.no_grad():
        for ids, mask in calls:
            got, flags = runner.replay(ids, mask)
            eager = fwd(model, ids, mask)
            real = mask.bool()
            assert flags.tolist() == [0, 0, 0, 0]
            torch.testing.assert_close(got[real], eager[real], atol=2e-5, rtol=2e-5)
            assert not got[~real].any()
            b, s = ids.shape
            assert not runner.bufs["mask"][b:].any() and not runner.bufs["mask"][:, s:].any()


def test_mask_none_bool_and_int32_inputs():
    model = pe.pack(tiny_model(), validate=False, attention_backend="sdpa")
    ids, mask = padded_batch([12, 12, 12], "right")
    runner = rect_runner(model, ids.shape)
    with torch.no_grad():
        ref = fwd(model, ids, mask)
        for m in (None, mask.bool(), mask.int()):
            got, flags = runner.replay(ids.int(), m)
            assert flags.tolist() == [0, 0, 0, 0]
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("problem,index", [
    ("oov", 2), ("negative", 2), ("mask2", 0), ("hole", 1), ("token_types", 3), ("mask_neg", 0),
])
def test_bad_inputs_flag_and_fill_nan(problem, index):
    model = pe.pack(tiny_model(), validate=False, attention_backend="sdpa")
    ids, mask = padded_batch([10, 20, 5], "mixed")
    tt = None
    if problem == "oov":
        ids[0, 3] = VOCAB
    elif problem == "negative":
        ids[2, 0] = -7
    elif problem == "mask2":
        mask[0, 2] = 2
    elif problem == "mask_neg":
        mask[2, 1] = -1
    elif problem == "hole":
        mask[1, 10] = 0   # row 1 is left padded: a hole inside its real tokens
    elif problem == "token_types":
        tt = torch.zeros_like(ids)
        tt[1, 15] = 1
    runner = rect_runner(model, ids.shape)
    with torch.no_grad():
        got, flags = runner.replay(ids, mask, tt)
        expect = [0, 0, 0, 0]
        expect[index] = 1
        assert flags.tolist() == expect
        assert torch.isnan(got).all(), "a call failing a check is NaN everywhere"
        # the next valid call on the same runner is clean (token types left behind are cleared)
        ids2, mask2 = padded_batch([10, 20, 5], "mixed", seed=7)
        good, flags = runner.replay(ids2, mask2)
        assert flags.tolist() == [0, 0, 0, 0] and not torch.isnan(good).any()
        if tt is not None:
            assert not runner.bufs["tt"].any()


def test_describe_flags_wording_matches_unpad():
    from packed_encoders.batch import unpad

    ids, mask = padded_batch([4, 6], "right")
    ids[0, 1] = VOCAB + 3
    with pytest.raises(PackedEncodersError) as eager:
        unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
              vocab_size=VOCAB)
    assert deferred.describe_flags([0, 0, 1, 0], VOCAB) == [str(eager.value)]
    assert deferred.describe_flags([0, 0, 0, 0], VOCAB) == []
    assert len(deferred.describe_flags([1, 2, 3, 4], VOCAB)) == 4


# --------------------------------------------------------------------------------------------- routing


def test_sync_free_serves_padded_calls(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    calls = [padded_batch([5, 17, 33], "mixed"), padded_batch([3, 9], "left", seed=1),
             padded_batch([30, 1, 2, 7], "right", seed=2),
             padded_batch([0, 4], "mixed", seed=3)]
    with torch.no_grad():
        for ids, mask in calls:
            got = fwd(model, ids, mask)
            eager = eager_padded(model, ids, mask)
            torch.testing.assert_close(got, eager, atol=2e-5, rtol=2e-5)
            assert not got[mask == 0].any()
        out = model(input_ids=ids, attention_mask=mask, return_dict=False)
        assert isinstance(out, tuple) and torch.equal(out[0], got)
    g = info(model)
    json.dumps(pe.describe(model))
    assert all(b.__class__ is RectBucket for b in cpu_graphs), "no packed graph was built"
    assert {(b["layout"], b["batch"], b["seqlen"]) for b in g["buckets"]} == {("rectangular", 8, 48),
                                                                                 ("rectangular", 8, 32)}
    assert g["misses"] == 2 and g["hits"] == 3
    assert g["sync_free"] == {"fallbacks": {B.SUSPENDED: 4}, "calls": 5, "pending_checks": 0, "unreported_errors": 0,
                              "errors_raised": 0}
    assert get_state(model).last_plan, "the attention plan is recorded for describe()"


def test_inference_mode_then_no_grad(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    ids, mask = padded_batch([5, 17, 33], "mixed")
    bad = ids.clone()
    bad[0, 0] = VOCAB
    with torch.inference_mode():
        a = fwd(model, ids, mask)            # runner, slots and buffers first created under inference mode
        fwd(model, bad, mask)
    with torch.no_grad():
        with pytest.raises(PackedEncodersError, match="call #2"):
            fwd(model, ids, mask)
        b = fwd(model, ids, mask)
    assert torch.equal(a, b) and info(model)["misses"] == 1


def test_outside_the_envelope_takes_the_synced_path(cpu_graphs, monkeypatch):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=GraphConfig(sync_free=True, max_seqlen=64, max_seqs=4))
    ids, mask = padded_batch([5, 17, 33], "mixed")
    with torch.no_grad():
        eager = eager_padded(model, ids, mask)
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(ids.shape[1])[None].expand_as(ids))
        embeds = model(inputs_embeds=model.embeddings.tok_embeddings(ids), attention_mask=mask).last_hidden_state
        hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        fwd(model, ids, mask.float())                                           # floating mask
        fwd(model, *padded_batch([3] * 5, "mixed"))                                    # 5 > max_seqs
        fwd(model, *padded_batch([3, 2], "mixed", pad_to=65))                          # wider than max_seqlen
    grad = fwd(model, ids, mask)                                                # grad enabled
    assert grad.requires_grad
    for out in (embeds, hidden.last_hidden_state, grad.detach()):
        torch.testing.assert_close(out, eager, atol=2e-5, rtol=2e-5)
    assert len(hidden.hidden_states) == 4
    sf = info(model)["sync_free"]["fallbacks"]
    assert sf == {B.SUSPENDED: 1, B.POSITION_IDS: 1, B.EMBEDS: 1, B.HIDDEN_STATES: 1, B.INPUT_DTYPES: 1,
                  B.TOO_MANY_SEQS: 1, B.TOO_WIDE: 1, B.GRAD: 1}
    # the synced path served what its own bounds admit, from packed graphs
    assert any(isinstance(b, B.Bucket) for b in cpu_graphs) and not any(isinstance(b, RectBucket) for b in cpu_graphs)
    assert info(model)["sync_free"]["calls"] == 0


def test_query_only_trailing_mode_takes_the_synced_path(cpu_graphs):
    model = tiny_model()
    ids = torch.randint(3, VOCAB, (3, 40), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(40)[None] < torch.tensor([5, 17, 33])[:, None]).long()
    with torch.no_grad():
        eager = fwd(pe.pack(model, validate=False, padded_outputs="all"), ids, mask)
        pe.pack(model, validate=False, padded_outputs="all", cuda_graph=SF)
        got = fwd(model, ids, mask)
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=2e-5)
    assert info(model)["sync_free"]["fallbacks"] == {B.QUERY_ONLY: 1}


def test_a_head_reading_position_zero_takes_the_synced_path(cpu_graphs):
    """A ``classifier_pooling="cls"`` head's call is checked for padding at position 0 at the host sync, which the
    sync-free path does not make: it takes the synced path, and a left-padded call runs the stock forward."""
    import copy

    import transformers

    head = tiny_model(cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls").eval()
    stock = copy.deepcopy(head)
    pe.pack(head, validate=False, cuda_graph=SF)
    for side in ("right", "left"):
        ids, mask = padded_batch([5, 17, 33], side)
        with torch.no_grad():
            got = head(input_ids=ids, attention_mask=mask).logits
            want = stock(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert info(head)["sync_free"]["fallbacks"] == {B.POSITION_ZERO: 2}
    calls = pe.describe(head)["encoders"][0]["stock_forward_calls"]
    assert sum(n for reason, n in calls.items() if "position 0" in reason) == 1  # the left-padded call only


def test_shape_errors_still_raise_immediately(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    ids, mask = padded_batch([5, 7], "mixed")
    with torch.no_grad():
        with pytest.raises(PackedEncodersError, match="attention_mask has shape"):
            fwd(model, ids, mask[:, :-1])
        with pytest.raises(PackedEncodersError, match="integer tensor"):
            fwd(model, ids.float(), mask)


def test_bad_input_raises_on_the_next_call(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    ids, mask = padded_batch([5, 17, 33], "mixed")
    bad = ids.clone()
    bad[1, 20] = VOCAB + 10   # row 1 is left padded: position 20 is real
    with torch.no_grad():
        out = fwd(model, bad, mask)
        assert out.shape == ids.shape + (64,) and torch.isnan(out).all()
        with pytest.raises(PackedEncodersError, match=r"previous call.*call #1 \(input \[3, 33\]\).*1 input_ids are "
                                                      r"outside the vocabulary \[0, 211\)"):
            fwd(model, ids, mask)
        good = fwd(model, ids, mask)          # reported once; the failed call did not run the next one
        torch.testing.assert_close(good, eager_padded(model, ids, mask), atol=2e-5, rtol=2e-5)
        m2 = mask.clone()
        m2[0, 0] = 2
        assert torch.isnan(fwd(model, ids, m2)).all()
        with pytest.raises(PackedEncodersError, match="attention_mask must hold only 0 and 1"):
            pe.check_errors(model)
        pe.check_errors(model)                # nothing left
        holes = mask.clone()
        holes[2, 10] = 0
        assert torch.isnan(fwd(model, ids, holes)).all()
        with pytest.raises(PackedEncodersError, match="holes inside 1 sequence"):   # packed_forward polls too
            pe.packed_forward(model, None, ids[0, :5], torch.tensor([0, 5], dtype=torch.int32), 5)
    assert info(model)["sync_free"]["errors_raised"] == 3


def test_errors_wait_for_the_event(cpu_graphs, pending_events):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    ids, mask = padded_batch([5, 17, 33], "mixed")
    bad = ids.clone()
    bad[0, 0] = -1
    with torch.no_grad():
        fwd(model, bad, mask)                  # call 1: bad, still "running"
        fwd(model, ids, mask)                  # call 2: no error yet (call 1 not complete), never waits
        pe.check_errors(model)
        assert info(model)["sync_free"]["pending_checks"] == 2
        pending_events.instances[0].done = True  # slot of call 1 completes
        with pytest.raises(PackedEncodersError, match=r"call #1 .*outside the vocabulary"):
            fwd(model, ids, mask)
        fwd(model, bad, mask)                  # call 3 (bad), pending
        with pytest.raises(PackedEncodersError, match=r"call #3 "):
            pe.check_errors(model, wait=True)  # waits (synchronize) for every pending call
    assert info(model)["sync_free"]["pending_checks"] == 0


def test_full_slot_ring_waits_for_the_oldest(cpu_graphs, pending_events, monkeypatch):
    monkeypatch.setattr(deferred, "SLOTS", 2)
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    ids, mask = padded_batch([5, 17, 33], "mixed")
    bad = ids.clone()
    bad[0, 0] = VOCAB
    with torch.no_grad():
        fwd(model, bad, mask)       # call 1 (bad) pending
        fwd(model, ids, mask)       # call 2 pending: the ring is full
        fwd(model, ids, mask)       # call 3 waits for call 1 and harvests it; its error is not raised mid-call
        with pytest.raises(PackedEncodersError, match=r"call #1 "):
            fwd(model, ids, mask)
    checks = get_state(model).runtime["graph_checks"]
    assert checks.pending == 2 and checks.calls == 3


def test_invalidation_and_lru(cpu_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=GraphConfig(sync_free=True, max_graphs=2))
    ids, mask = padded_batch([7, 12], "mixed")
    with torch.no_grad():
        fwd(model, ids, mask)
        model.double()
        out = fwd(model, ids, mask)
        eager = eager_padded(model, ids, mask)
        assert out.dtype == torch.float64 and torch.allclose(out, eager, atol=1e-10)
        for width in (40, 100, 200):   # three rectangular buckets through an LRU of two
            fwd(model, *padded_batch([3, 9], "mixed", pad_to=width))
    g = info(model)
    assert g["invalidations"] == 1 and g["graphs"] == 2 and g["evictions"] == 2


def test_copies_drop_pending_checks(cpu_graphs):
    import copy

    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    ids, mask = padded_batch([4, 9], "mixed")
    bad = ids.clone()
    bad[0, 0] = VOCAB
    with torch.no_grad():
        fwd(model, bad, mask)
        twin = copy.deepcopy(model)
        torch.testing.assert_close(fwd(twin, ids, mask), eager_padded(twin, ids, mask), atol=2e-5, rtol=2e-5)
        with pytest.raises(PackedEncodersError):
            fwd(model, ids, mask)


def test_pack_validates_the_sync_free_path(cpu_graphs, monkeypatch):
    from packed_encoders import graph_check as check

    monkeypatch.setattr(check, "_eligible", lambda config, weight, tuning: config is not None)
    model = pe.pack(tiny_model(), cuda_graph=GraphConfig(max_seqlen=64, sync_free=True),
                    validation_lengths=(1, 9, 40))
    report = get_state(model).report
    assert report.passed, report.failures
    assert any(c.startswith("cuda_graph (sync_free): replay vs eager") for c in report.checks)
    # the check captured a rectangular graph, then dropped it with the packed one (the workload captures its own)
    assert info(model)["misses"] == 2 and info(model)["graphs"] == 0

    real = check.sync_free_forward
    monkeypatch.setattr(check, "sync_free_forward", lambda *a, **k: real(*a, **k) * 1.5 + 0.3)
    with pytest.raises(pe.ValidationError, match=r"cuda_graph \(sync_free\): non-zero values at padded"):
        pe.pack(tiny_model(), cuda_graph=SF, validation_lengths=(1, 9, 40))
    monkeypatch.setattr(check, "sync_free_forward", lambda *a, **k: None)
    with pytest.raises(pe.ValidationError, match=r"cuda_graph \(sync_free\): the check batch .* not served"):
        pe.pack(tiny_model(), cuda_graph=SF, validation_lengths=(1, 9, 40))


def test_check_errors_needs_a_packed_model():
    with pytest.raises(PackedEncodersError, match="no packed"):
        pe.check_errors(tiny_model())
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    assert pe.check_errors(model) is model
    with pytest.raises(PackedEncodersError, match="wait"):
        pe.check_errors(model, wait="x")


def test_cpu_model_off_the_fake_takes_the_synced_path():
    model = pe.pack(tiny_model(), validate=False, cuda_graph=SF)
    ids, mask = padded_batch([4, 9], "mixed")
    with torch.no_grad():
        out = fwd(model, ids, mask)
        assert torch.equal(out, eager_padded(model, ids, mask))
    assert info(model)["sync_free"]["fallbacks"] == {B.NOT_CUDA: 1, B.SUSPENDED: 1}
