"""The graph inbox (``ops.triton.stage``): a batch is copied into fixed-address buffers before the call's host
sync and into the bucket's buffers by the graph's first node, so that after the sync a replay is one launch.
On CPU under the Triton interpreter, with capture-free runners (the same layout and kernels as a capture)."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

import packed_encoders as pe  # noqa: E402
from packed_encoders import batch as PB  # noqa: E402
from packed_encoders import call  # noqa: E402
from packed_encoders.adapters.state import get_state  # noqa: E402
from packed_encoders.graphs import route  # noqa: E402
from packed_encoders.graphs import runner as grunner  # noqa: E402
from packed_encoders.graphs.buckets import bucket_for  # noqa: E402
from packed_encoders.graphs.config import GraphConfig  # noqa: E402
from packed_encoders.ops.triton import stage  # noqa: E402

from tests.helpers import VOCAB, padded_batch, tiny_model  # noqa: E402

from .test_graphs_logic import batch_of  # noqa: E402


def _torch_staging(batch, bucket, ids, pos, cu, kl):
    """What the runner's PyTorch staging writes (its reference)."""
    total, num = batch.total_tokens, batch.num_seqs
    ids[:total] = batch.input_ids
    pos[:total] = batch.position_ids
    cu[:num + 1] = batch.cu_seqlens
    cu[num + 1:] = torch.tensor(bucket.dummy_tail(total, num), dtype=torch.int32)
    if kl is not None:
        kl[:num] = batch.key_lens


@pytest.mark.parametrize("lengths,query_only", [([5, 17, 33], False), ([40] * 7, False), ([1, 0, 64], False),
                                                ([3, 0, 9], True)])
def test_fill_then_unbox_writes_what_the_torch_staging_writes(lengths, query_only):
    batch = batch_of(lengths)
    kl = torch.tensor(lengths, dtype=torch.int32) if query_only else None
    batch = type(batch)(**{**batch.__dict__, "key_lens": kl})
    bucket = bucket_for(GraphConfig(max_seqlen=64), batch.num_seqs, batch.total_tokens, batch.max_seqlen)
    inbox = stage.Inbox(512, 16, torch.device("cpu"))
    # extra rows past T (unpad's padded-size buffers) must be ignored: T is read on the device
    spare = torch.full((5,), 99, dtype=torch.long)
    stage.fill_inbox(inbox, torch.cat([batch.input_ids, spare]), torch.cat([batch.position_ids, spare]),
                     batch.cu_seqlens, kl)
    assert int(inbox.num) == batch.num_seqs
    got = [torch.full((bucket.tokens,), 7, dtype=torch.long), torch.full((bucket.tokens,), 3, dtype=torch.long),
           torch.zeros(bucket.seqs + 1, dtype=torch.int32)] + ([torch.zeros(bucket.seqs, dtype=torch.int32)]
                                                                if query_only else [])
    want = [t.clone() for t in got]
    stage.unbox(inbox, *got[:3], got[3] if query_only else None, bucket.seqlen)
    _torch_staging(batch, bucket, *want[:3], want[3] if query_only else None)
    for a, b in zip(got, want):
        assert torch.equal(a, b)  # padding rows untouched (7 / 3), real rows and cu_seqlens tail as the reference


def test_fill_stops_at_the_inbox_size():
    batch = batch_of([30, 30])
    inbox = stage.Inbox(40, 4, torch.device("cpu"))
    inbox.ids.fill_(-1)
    stage.fill_inbox(inbox, batch.input_ids, batch.position_ids, batch.cu_seqlens, None)
    assert torch.equal(inbox.ids, batch.input_ids[:40])  # no write past the buffer; never replayed (admission)


@pytest.fixture
def inbox_graphs(monkeypatch):
    """Route on CPU with capture-free runners staged through the encoder's inbox (the CUDA layout); logs
    inbox fills and host syncs in call order."""
    events = []
    real_mode, real_fill, real_tolist = call.mode_facts, stage.fill_inbox, torch.Tensor.tolist

    def mode(*a, **k):
        return {**real_mode(*a, **k), "model_on_cuda": True}

    def build(model, state, mgr, bucket, requested, query_only=False, autocast=None):
        return grunner.GraphRunner(model, state, bucket, requested, capture=False, query_only=query_only,
                                   fused_stage=True, inbox=route._inbox(mgr, torch.device("cpu")))

    def fill(*a, **k):
        events.append("fill")
        return real_fill(*a, **k)

    def tolist(self):
        events.append("sync")
        return real_tolist(self)

    monkeypatch.setattr(call, "mode_facts", mode)
    monkeypatch.setattr(route, "_build", build)
    monkeypatch.setattr(grunner, "fused_stage_available", lambda device: True)
    monkeypatch.setattr(stage, "fill_inbox", fill)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    monkeypatch.setattr(PB, "_fused_unpad", lambda *a: False)  # the PyTorch unpad (one tolist): events stay simple
    monkeypatch.delenv("PACKED_ENCODERS_GRAPH", raising=False)
    return events


def _forward(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("padded_outputs,grad_mode", [("zeros", torch.no_grad), ("all", torch.no_grad),
                                                       ("zeros", torch.inference_mode)])
def test_a_graph_call_stages_before_its_sync_only(inbox_graphs, padded_outputs, grad_mode):
    model = tiny_model()
    calls = [padded_batch([5, 17, 33], "mixed"), padded_batch([4, 9], "mixed", seed=1),
             padded_batch([30, 2, 8, 11], "mixed", seed=2), padded_batch([5, 17, 33], "mixed")]
    with grad_mode():
        pe.pack(model, validate=False, padded_outputs=padded_outputs)
        eager = [_forward(model, ids, mask) for ids, mask in calls]
        pe.pack(model, validate=False, padded_outputs=padded_outputs, cuda_graph=True)
        for rnd in range(2):
            for (ids, mask), want in zip(calls, eager):
                misses = pe.describe(model)["encoders"][0]["cuda_graph"]["misses"]
                inbox_graphs.clear()
                got = _forward(model, ids, mask)
                captured = pe.describe(model)["encoders"][0]["cuda_graph"]["misses"] > misses
                assert not (rnd and captured)
                # a capture empties the inbox for its warm-up, so that call stages again; otherwise nothing is
                # staged after the sync
                assert inbox_graphs == ["fill", "sync"] + (["fill"] if captured else [])
                torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    info = pe.describe(model)["encoders"][0]["cuda_graph"]
    assert info["hits"] >= len(calls) and info["misses"] >= 1 and not info["fallbacks"]
    # every capture call staged again after its sync; every other call was served as filled before it
    assert info["staged"] == {"before_sync": 2 * len(calls) - info["misses"], "after_sync": info["misses"]}


def _unpad(ids, mask, hook=None):
    return PB.unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                    token_type_ids=None, vocab_size=VOCAB, before_sync=hook)


def _graphed_with_reference(ids, mask):
    """A tiny model packed with graphs, and its eager packed output for ``(ids, mask)``; call under no_grad."""
    model = tiny_model()
    pe.pack(model, validate=False)
    want = _forward(model, ids, mask)
    pe.pack(model, validate=False, cuda_graph=True)
    return model, want


def test_a_call_whose_inbox_was_refilled_stages_again(inbox_graphs):
    """Call A fills the inbox before its sync; call B fills and replays before A's replay: A must serve its
    own batch (it stages again after its sync), not B's."""
    (ids_a, mask_a), (ids_b, mask_b) = padded_batch([5, 17, 33], "mixed"), padded_batch([4, 9, 12], "mixed", seed=1)
    with torch.no_grad():
        model, want_a = _graphed_with_reference(ids_a, mask_a)
        _forward(model, ids_b, mask_b)  # captures the bucket
        state = get_state(model)
        prepared = route.prepare(model, state)
        batch_a = _unpad(ids_a, mask_a, functools.partial(route.prestage, prepared))
        _forward(model, ids_b, mask_b)
        inbox_graphs.clear()
        got_a = route.graph_forward(model, state, batch_a, batch_a.pad, prepared=prepared)
    assert inbox_graphs == ["fill"]  # staged again after the sync
    torch.testing.assert_close(got_a, want_a, atol=2e-5, rtol=2e-5)


def test_refused_calls_leave_the_inbox_alone(inbox_graphs):
    model = pe.pack(tiny_model(), validate=False, cuda_graph=True)
    ids, mask = padded_batch([5, 17], "mixed")
    _forward(model, ids, mask)  # grad enabled: refused before the sync
    assert "fill" not in inbox_graphs


def test_unbox_stays_inside_the_bucket_whatever_the_inbox_holds():
    """A batch larger than the bucket (never replayed by the router) still yields ``cu_seqlens`` inside the
    bucket's rows and sequence count: garbage at worst, never an out-of-bounds read in the graph."""
    batch = batch_of([40, 40, 40, 40, 40])
    inbox = stage.Inbox(512, 16, torch.device("cpu"))
    stage.fill_inbox(inbox, batch.input_ids, batch.position_ids, batch.cu_seqlens, None)
    ids, pos = torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long)
    cu = torch.full((4,), -1, dtype=torch.int32)  # 3 sequences of a 64-token bucket
    stage.unbox(inbox, ids, pos, cu, None, 64)
    assert cu.tolist() == [0, 40, 64, 64]
    assert torch.equal(ids, batch.input_ids[:64])


def test_a_replay_that_raises_does_not_hand_its_batch_to_the_owner(inbox_graphs):
    """A fills the inbox before its sync; B (no prestage: another thread, say) refills it and its replay raises
    after the fill. A must still serve its own batch, not B's."""
    (ids_a, mask_a), (ids_b, mask_b) = padded_batch([5, 17, 33], "mixed"), padded_batch([4, 9, 12], "mixed", seed=1)
    with torch.no_grad():
        model, want_a = _graphed_with_reference(ids_a, mask_a)
        _forward(model, ids_a, mask_a)
        _forward(model, ids_b, mask_b)  # both buckets captured
        state = get_state(model)
        prepared = route.prepare(model, state)
        batch_a = _unpad(ids_a, mask_a, functools.partial(route.prestage, prepared))
        batch_b = _unpad(ids_b, mask_b)

        def finish_oom(t):
            raise torch.OutOfMemoryError("simulated")

        with pytest.raises(torch.OutOfMemoryError):
            route.graph_forward(model, state, batch_b, finish_oom, prepared=None)
        got_a = route.graph_forward(model, state, batch_a, batch_a.pad, prepared=prepared)
    torch.testing.assert_close(got_a, want_a, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("left_behind", ["too_long_refused", "oov_ids_raised", "long_sequence_replayed"])
def test_a_capture_warms_up_on_an_empty_inbox(inbox_graphs, monkeypatch, left_behind):
    """Whatever an earlier call left in the inbox (a batch refused as too long, ids that failed the checks, or
    a valid batch with sequences longer than the new bucket's seqlen), a later capture's warm-up must not
    run on it: the capture empties the inbox first."""
    model = tiny_model(local_attention=128)
    with torch.no_grad():
        pe.pack(model, validate=False, cuda_graph=GraphConfig(max_seqlen=64, seqlen_buckets=(16, 64)))
        if left_behind == "too_long_refused":
            # eager (past max_seqlen), but filled before the sync
            _forward(model, *padded_batch([1] * 11 + [200], "mixed"))
        elif left_behind == "oov_ids_raised":
            ids, mask = padded_batch([5, 17, 33], "mixed")
            ids[0, 0] = VOCAB + 1000
            with pytest.raises(pe.PackedEncodersError):
                _forward(model, ids, mask)
        else:
            monkeypatch.setenv("PACKED_ENCODERS_GRAPH_PRESTAGE", "0")
            _forward(model, *padded_batch([1] * 11 + [60], "mixed"))  # replayed from a seqlen-64 bucket
        ids = torch.randint(3, VOCAB, (11,))
        pos = torch.cat([torch.arange(5), torch.arange(6)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed capture warns
            cu = torch.tensor([0, 5, 11], dtype=torch.int32)
            model(input_ids=ids[None], position_ids=pos[None], cu_seq_lens_q=cu, max_length_q=6)  # a seqlen-16 bucket
    info = pe.describe(model)["encoders"][0]["cuda_graph"]
    assert not info["capture_failures"] and info["misses"] >= 1


def test_the_inbox_does_not_keep_a_dropped_manager_alive(inbox_graphs):
    import gc
    import weakref

    model = tiny_model()
    with torch.no_grad():
        pe.pack(model, validate=False, cuda_graph=GraphConfig(max_seqlen=64))
        _forward(model, *padded_batch([5, 17, 33], "mixed"))
        _forward(model, *padded_batch([1, 1, 1, 200], "mixed"))  # too long: filled before the sync, never replayed
        ref = weakref.ref(get_state(model).runtime["graphs"])
        gc.disable()
        try:
            pe.set_cuda_graph(model, False)  # frees the graphs now, not at the next cyclic collection
            alive = ref() is not None
        finally:
            gc.enable()
    assert not alive


def test_fill_widens_narrow_integer_inputs():
    inbox = stage.Inbox(16, 4, torch.device("cpu"))
    stage.fill_inbox(inbox, torch.tensor([5, 6, 7, 300], dtype=torch.int32),
                     torch.tensor([0, 1, 200, 3], dtype=torch.uint8), torch.tensor([0, 2, 4], dtype=torch.int32), None)
    assert inbox.ids[:4].tolist() == [5, 6, 7, 300] and inbox.pos[:4].tolist() == [0, 1, 200, 3]
    with pytest.raises(RuntimeError, match="sequences for an inbox"):
        stage.fill_inbox(inbox, torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.long),
                         torch.arange(6, dtype=torch.int32), None)
