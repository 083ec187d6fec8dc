"""Training graphs (``GraphConfig(training=True)``) on CPU: routing, slots, and the autograd node's gradients.

A CPU model runs :class:`~packed_encoders.graphs.training.TrainRunner` with ``capture=False``: the same slots,
static inputs with dummy padding sequences, per-slot gradient buffers and autograd node as on CUDA, with the
forward run eagerly per replay. The captured graphs themselves are tested on the GPU
(``tests/gpu/test_train_graphs.py``).
"""

from __future__ import annotations

import gc

import pytest
import torch

import packed_encoders as pe
from packed_encoders.adapters.state import get_state
from packed_encoders.batch import unpad
from packed_encoders.call import run_packed
from packed_encoders.errors import PackedEncodersError
from packed_encoders.graphs import buckets as B
from packed_encoders.graphs import route
from packed_encoders.graphs.config import GraphConfig
from packed_encoders.graphs.training import TOO_MANY_PENDING, TWICE, Lease, Slots
from packed_encoders.router import Eager, Facts, PackedGraph, TrainingGraph, choose
from tests.helpers import VOCAB, padded_batch, set_checkpointing, tiny_model

TRAIN = GraphConfig(max_seqlen=64, training=True)


def batch_of(lengths, seed=0):
    ids, mask = padded_batch(lengths, "mixed", seed=seed)
    return unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                 vocab_size=VOCAB)


def packed_model(**kw):
    model = tiny_model(**kw).train()
    with pytest.warns(UserWarning, match="CUDA graphs start once"):  # served on CUDA only
        pe.pack(model, validate=False, attention_backend="sdpa", cuda_graph=TRAIN)
    return model, get_state(model)


def grads_of(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def assert_same_grads(a, b, atol=1e-5, rtol=1e-4):
    assert a.keys() == b.keys()
    for n in a:
        if a[n] is None or b[n] is None:
            assert a[n] is None and b[n] is None, n
        else:
            torch.testing.assert_close(a[n], b[n], atol=atol, rtol=rtol, msg=n)


def loss_of(out, seed):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return (out * w).sum()


# ------------------------------------------------------------------------------------------ routing


def test_router_serves_grad_calls_with_training_graphs():
    facts = dict(graphs=TRAIN, grad=True, model_on_cuda=True)
    assert choose(Facts(padded=True, **facts)) == TrainingGraph(None, None)
    route_ = choose(Facts(num_seqs=20, total_tokens=1050, max_seqlen=60, autocast=torch.bfloat16, **facts))
    assert isinstance(route_, TrainingGraph) and route_.autocast is torch.bfloat16
    # the training grid (8 steps per octave) is coarser than inference's (16)
    assert route_.bucket == B.bucket_for(TRAIN, 20, 1050, 60, TRAIN.training_steps_per_octave)
    assert route_.bucket.tokens == 1152 and B.bucket_for(TRAIN, 20, 1050, 60).tokens == 1088
    # without GraphConfig.training: eager, as before; no grad: the inference graph
    assert choose(Facts(graphs=GraphConfig(), grad=True, padded=True)) == Eager(B.GRAD)
    assert isinstance(choose(Facts(graphs=TRAIN, padded=True)), PackedGraph)


@pytest.mark.parametrize("fact,reason", [
    ("dropout", B.DROPOUT), ("checkpointing", B.CHECKPOINTING), ("hidden_states", B.HIDDEN_STATES),
    ("inputs_embeds", B.EMBEDS), ("input_grads", B.INPUT_GRADS), ("kill_switch", B.KILL_SWITCH),
    ("suspended", B.SUSPENDED)])
def test_router_refusals_of_training_graphs(fact, reason):
    assert choose(Facts(graphs=TRAIN, grad=True, padded=True, model_on_cuda=True, **{fact: True})) == Eager(reason)
    assert choose(Facts(graphs=TRAIN, grad=True, padded=True, model_on_cuda=False)) == Eager(B.NOT_CUDA)
    big = Facts(graphs=TRAIN, grad=True, num_seqs=2, total_tokens=10, max_seqlen=65, model_on_cuda=True)
    assert choose(big) == Eager(B.TOO_LONG)


def test_mode_facts_see_checkpointing_and_input_grads():
    from packed_encoders.call import mode_facts

    model, state = packed_model()
    facts = mode_facts(model, state)
    assert facts["grad"] and not facts["checkpointing"] and not facts["input_grads"]
    set_checkpointing(model)
    assert mode_facts(model, state)["checkpointing"]
    set_checkpointing(model, on=False)
    model.enable_input_require_grads()
    assert mode_facts(model, state)["input_grads"]
    with torch.no_grad():
        assert "checkpointing" not in mode_facts(model, state)  # gathered for calls with gradients only


# -------------------------------------------------------------------------------------------- slots


def test_slots_take_the_lowest_free_and_release_by_generation():
    slots = Slots(2)
    a, b = Lease(slots, slots.take()), Lease(slots, slots.take())
    assert (a.k, b.k) == (0, 1) and slots.take() is None
    a.release()
    c = Lease(slots, slots.take())
    assert c.k == 0 and c.generation == a.generation + 1
    a.release()  # a stale release does not free the slot's new holder
    assert slots.pending == {0, 1}


def test_lease_is_released_when_its_node_is_freed():
    slots = Slots(1)

    class Owner:
        pass

    owner = Owner()
    lease = Lease(slots, slots.take())
    lease.attach(owner)
    assert slots.pending == {0}
    del owner
    gc.collect()
    assert slots.pending == set()
    assert lease.k == 0


# ------------------------------------------------------------------------------------ gradients (CPU)


def test_training_graph_matches_the_eager_training_path():
    model, state = packed_model()
    batch = batch_of([30, 7, 50, 1, 19])
    loss_of(run_packed(model, state, batch), 0).backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    out = route.train_forward(model, state, batch)
    assert out is not None and out.grad_fn is not None
    torch.testing.assert_close(out, run_packed(model, state, batch).detach(), atol=1e-5, rtol=1e-5)
    loss_of(out, 0).backward()
    assert_same_grads(grads_of(model), want)
    mgr = state.runtime["graphs"]
    assert mgr.train_slots.pending == set()  # released by the backward


def test_two_forwards_before_one_backward_take_two_slots():
    """A query batch and a document batch, then one loss: autograd sums both nodes' gradients only after both
    ran, so each slot has its own gradient buffers."""
    model, state = packed_model()
    qa, qb = batch_of([5, 9, 3], seed=1), batch_of([40, 33], seed=2)
    (loss_of(run_packed(model, state, qa), 1) + loss_of(run_packed(model, state, qb), 2)).backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    a = route.train_forward(model, state, qa)
    b = route.train_forward(model, state, qb)
    mgr = state.runtime["graphs"]
    assert mgr.train_slots.pending == {0, 1}
    assert route.train_forward(model, state, qa) is None  # a third pending forward: eager
    assert mgr.fallbacks[TOO_MANY_PENDING] == 1
    (loss_of(a, 1) + loss_of(b, 2)).backward()
    assert_same_grads(grads_of(model), want)


def test_gradients_accumulate_and_never_alias_the_buffers():
    model, state = packed_model()
    batches = [batch_of([30, 7, 50], seed=s) for s in range(3)]
    for i, b in enumerate(batches):
        loss_of(run_packed(model, state, b), i).backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    for i, b in enumerate(batches):  # GradCache-like: forward and backward per chunk, into the same .grad
        loss_of(route.train_forward(model, state, b), i).backward()
    assert_same_grads(grads_of(model), want)
    kept = {n: p.grad for n, p in model.named_parameters()}
    snapshot = {n: g.clone() for n, g in kept.items()}
    model.zero_grad(set_to_none=True)
    loss_of(route.train_forward(model, state, batches[0]), 7).backward()
    for n in kept:  # the first step's .grad tensors were not overwritten by the next backward
        torch.testing.assert_close(kept[n], snapshot[n], atol=0, rtol=0, msg=n)
    buffers = {t.data_ptr() for t in state.runtime["graphs"].train_grads.values()}
    assert not buffers & {p.grad.data_ptr() for p in model.parameters()}


def test_autograd_grad_and_hooks_get_tensors_they_own():
    model, state = packed_model()
    batch = batch_of([20, 11])
    params = list(model.parameters())
    ref = torch.autograd.grad(loss_of(run_packed(model, state, batch), 1), params)
    g1 = torch.autograd.grad(loss_of(route.train_forward(model, state, batch), 1), params)
    kept = [g.clone() for g in g1]
    g2 = torch.autograd.grad(loss_of(route.train_forward(model, state, batch), 2), params)
    for a, b, c, r in zip(g1, kept, g2, ref):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # not overwritten by the next backward
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)
        assert a.data_ptr() != c.data_ptr()
    # a parameter hook runs once per backward, on the gradient the eager path gives
    seen = []
    handle = params[0].register_hook(lambda g: seen.append(g.clone()) or g * 0.5)
    loss_of(run_packed(model, state, batch), 3).backward()
    want = params[0].grad.clone()
    model.zero_grad(set_to_none=True)
    loss_of(route.train_forward(model, state, batch), 3).backward()
    handle.remove()
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], seen[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(params[0].grad, want, atol=1e-5, rtol=1e-4)


def test_optimizer_steps_are_seen_by_the_next_forward():
    model, state = packed_model()
    batch = batch_of([20, 11])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out0 = route.train_forward(model, state, batch)
    loss_of(out0, 0).backward()
    opt.step()
    out1 = route.train_forward(model, state, batch)
    torch.testing.assert_close(out1.detach(), run_packed(model, state, batch).detach(), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out0.detach(), out1.detach())


def test_autocast_graphs_read_weight_copies_that_follow_the_optimizer(monkeypatch):
    """Under autocast the training graphs read the encoder's static low-precision weight copies: a fused optimizer
    step (no version bump) is seen by the next forward, and a backward whose forward read copies that a later
    forward recast raises instead of computing gradients for other weights."""
    from torch import nn

    from packed_encoders.graphs import training
    from packed_encoders.model.plan import Rules

    # the per-block training path (the one CUDA takes), which casts through ops.weight_cast, on CPU
    monkeypatch.setattr(training, "rules_for", lambda tuning: Rules(lean=True, blocks=True))
    model, state = packed_model()
    batch = batch_of([20, 11])
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16)  # CPU autocast: the blocks cast to bf16 as on CUDA

    def forward():
        with bf16:
            return route.train_forward(model, state, batch, autocast=torch.bfloat16)

    def eager():
        with bf16, torch.no_grad():
            return run_packed(model, state, batch).float()

    out0 = forward()
    copies = state.runtime["graphs"].casts[torch.bfloat16]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(copies.copies) == sum(1 + (m.bias is not None) for m in linears)
    torch.testing.assert_close(out0.detach().float(), eager(), atol=2e-2, rtol=2e-2)
    loss_of(out0.float(), 0).backward()
    opt.step()
    out1 = forward()
    assert not torch.allclose(out0.detach(), out1.detach())
    torch.testing.assert_close(out1.detach().float(), eager(), atol=2e-2, rtol=2e-2)
    loss_of(out1.float(), 1).backward()
    del out0, out1
    for p in model.parameters():  # a hand-written step through .data (no version bump, no optimizer step)
        p.data.add_(p.grad, alpha=-0.05)
    out2 = forward()  # the copies are cast again after a backward: the update is read
    torch.testing.assert_close(out2.detach().float(), eager(), atol=2e-2, rtol=2e-2)
    del out2
    with torch.no_grad():
        torch._foreach_zero_(list(copies.copies))  # the forward reads the copies (no change since: no recast)
    assert not torch.allclose(forward().detach().float(), eager(), atol=2e-2, rtol=2e-2)
    gc.collect()
    pending = forward()  # slot 0
    opt.step()
    forward()  # slot 1: recasts the copies slot 0's backward would read
    with pytest.raises(PackedEncodersError, match="modified in place"):
        loss_of(pending.float(), 2).backward()


def test_a_second_backward_through_a_forward_raises():
    model, state = packed_model()
    batch = batch_of([20, 11])
    out = route.train_forward(model, state, batch)
    loss = loss_of(out, 0)
    loss.backward(retain_graph=True)  # one backward: fine, and the slot is free again
    assert state.runtime["graphs"].train_slots.pending == set()
    with pytest.raises(PackedEncodersError, match="second backward"):
        loss.backward(retain_graph=True)
    route.train_forward(model, state, batch)  # the slot serves a new forward
    with pytest.raises(PackedEncodersError, match="second backward"):
        loss.backward()
    assert "no_cuda_graph" in TWICE


def test_a_parameter_changed_in_place_before_the_backward_raises():
    model, state = packed_model()
    batch = batch_of([20, 11])
    loss = loss_of(route.train_forward(model, state, batch), 0)
    with torch.no_grad():
        model.layers[0].mlp.Wo.weight.mul_(1.5)
    with pytest.raises(PackedEncodersError, match="modified in place"):
        loss.backward()


def test_graphs_switched_off_and_on_keep_the_training_config():
    model, state = packed_model()
    pe.set_cuda_graph(model, False)
    pe.set_cuda_graph(model, True)
    assert pe.describe(model)["encoders"][0]["cuda_graph"]["config"]["training"]


def test_frozen_parameters_get_no_gradient_and_change_the_key():
    model, state = packed_model()
    batch = batch_of([20, 11])
    for p in model.embeddings.parameters():
        p.requires_grad_(False)
    loss_of(run_packed(model, state, batch), 0).backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    loss_of(route.train_forward(model, state, batch), 0).backward()
    got = grads_of(model)
    assert got["embeddings.tok_embeddings.weight"] is None
    assert_same_grads(got, want)
    for p in model.parameters():
        p.requires_grad_(False)
    assert route.train_forward(model, state, batch) is None
    assert state.runtime["graphs"].fallbacks[B.FROZEN] == 1


def test_padded_call_through_the_patched_forward_routes_to_training_graphs(monkeypatch):
    """The HF call path: the router's TrainingGraph route (forced on for the CPU model) serves the call."""
    model, state = packed_model()
    ids, mask = padded_batch([12, 30, 5])
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    loss_of(ref, 3).backward()
    want = grads_of(model)
    model.zero_grad(set_to_none=True)
    calls = []
    real = route.train_forward

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(route, "train_forward", spy)
    monkeypatch.setattr("packed_encoders.call.choose", lambda facts: TrainingGraph(None, None)
                        if facts.grad else choose(facts))
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    loss_of(out, 3).backward()
    assert calls == [1]
    assert_same_grads(grads_of(model), want)
    d = pe.describe(model)["encoders"][0]["cuda_graph"]
    assert d["training"]["hits"] == 0 and d["training"]["gradient_buffer_bytes"] > 0
    assert any(b.get("training") for b in d["buckets"])


@pytest.mark.parametrize("kw", [dict(training="yes"), dict(training_slots=0), dict(training_steps_per_octave=3),
                                dict(training_slots=True)])
def test_config_rejects_bad_training_fields(kw):
    with pytest.raises(PackedEncodersError, match="GraphConfig.training"):
        GraphConfig(**kw)


def test_manager_drop_removes_matching_runners_and_their_bytes():
    from packed_encoders.graphs.manager import GraphManager

    class R:
        def __init__(self, n):
            self.graph_bytes = n

    mgr = GraphManager(GraphConfig())
    for key, n in ((("train", "auto", 1, False, None, 0, ()), 10), (("train", "auto", 2, False, None, 1, ()), 20),
                   (("auto", 3, False, None), 5)):
        mgr.get(key, lambda n=n: R(n))
    assert mgr.graph_bytes == 35
    assert mgr.drop(lambda k: k[0] == "train" and k[5] == 0) == 1
    assert mgr.graph_bytes == 25 and len(mgr) == 2 and mgr.evictions == 1


def test_training_graphs_are_outside_the_byte_budget():
    """A training graph's memory is its slot's pool (a step's activations, which the eager path holds too): a bucket
    larger than the inference graphs' budget is kept, and counts for neither the budget nor its evictions."""
    from packed_encoders.graphs.manager import GraphManager

    class R:
        def __init__(self, n, budgeted=True):
            self.graph_bytes, self.budgeted = n, budgeted

    mgr = GraphManager(GraphConfig(), budget_bytes=100)
    mgr.get(("auto", 3, False, None), lambda: R(60))
    train = mgr.get(("train", "auto", 1, False, None, 0, ()), lambda: R(10**9, budgeted=False))
    assert isinstance(train, R) and len(mgr) == 2 and mgr.graph_bytes == 60 and mgr.evictions == 0
    assert isinstance(mgr.get(("auto", 4, False, None), lambda: R(500)), str)  # an inference graph: over budget
    assert mgr.drop(lambda k: k[0] == "train") == 1 and mgr.graph_bytes == 60
    model, state = packed_model()
    route.train_forward(model, state, batch_of([20, 11]))
    (runner,) = state.runtime["graphs"].runners()
    assert runner.budgeted is False


def test_a_node_does_not_keep_its_runner_after_its_backward():
    """A loop holds the last step's `loss` (hence its autograd nodes) until the next step reassigns it; a runner
    dropped meanwhile (a pool restart, an eviction) must be freed then, not kept by the spent node."""
    import weakref

    model, state = packed_model()
    batch = batch_of([20, 11])
    loss = loss_of(route.train_forward(model, state, batch), 0)
    mgr = state.runtime["graphs"]
    (key,) = [k for k in mgr.keys() if k[0] == "train"]
    runner = weakref.ref(mgr.get(key, None))
    loss.backward(retain_graph=True)
    assert mgr.drop(lambda k: k == key) == 1
    gc.collect()
    assert runner() is None, "the spent node still references the dropped runner"
    assert loss.grad_fn is not None  # the step's graph itself is still alive
    with pytest.raises(PackedEncodersError, match="second backward"):
        loss.backward()


def test_allocating_to_routes_the_stream_to_the_pool_and_gives_its_use_back(monkeypatch):
    """The warm-ups' allocator hooks: begin on the current stream, then end and release the use begin took, also
    when the block raises; without the hooks (a torch that lacks them) the block runs unrouted."""
    from packed_encoders.graphs.training import allocating_to

    calls = []
    monkeypatch.setattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool",
                        lambda d, p: calls.append(("begin", d, p)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, p: calls.append(("end", d, p)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, p: calls.append(("release", d, p)), raising=False)
    pool = (0, 7)
    with allocating_to(pool, torch.device("cuda", 1)):
        calls.append("body")
    assert calls == [("begin", 1, pool), "body", ("end", 1, pool), ("release", 1, pool)]
    calls.clear()
    with pytest.raises(KeyError):
        with allocating_to(pool, torch.device("cuda", 0)):
            raise KeyError("x")
    assert calls == [("begin", 0, pool), ("end", 0, pool), ("release", 0, pool)]
    calls.clear()
    monkeypatch.delattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool")
    with allocating_to(pool, torch.device("cuda", 0)):
        calls.append("body")
    assert calls == ["body"]


def test_weight_cast_off_caches_nothing():
    from packed_encoders.ops import weight_cast

    w = torch.nn.Parameter(torch.randn(4, 4))
    with weight_cast.off():
        a, b = weight_cast.cast(w, torch.bfloat16), weight_cast.cast(w, torch.bfloat16)
    assert a is not b and torch.equal(a, b) and a.dtype == torch.bfloat16
    c, d = weight_cast.cast(w, torch.bfloat16), weight_cast.cast(w, torch.bfloat16)
    assert c is d  # cached again outside the block
