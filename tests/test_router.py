"""The router (one pure function of host facts -> a typed route), the frozen tuning read at pack(), and the
default graphs on a CPU model (eager there, no error, no warning)."""

from __future__ import annotations

import warnings

import pytest
import torch

import packed_encoders as pe
from packed_encoders.adapters.state import get_state
from packed_encoders.graphs import buckets as B
from packed_encoders.graphs.buckets import RectBucket
from packed_encoders.graphs.config import GraphConfig
from packed_encoders.router import Eager, Facts, PackedGraph, RectangularGraph, Stock, TrainingGraph, choose
from packed_encoders.tuning import Tuning, read_tuning

VOCAB = 211
CFG = GraphConfig(max_seqlen=64, max_seqs=4, max_tokens=200)
SF = GraphConfig(max_seqlen=64, max_seqs=8, sync_free=True, sync_free_max_tokens=512)


def tiny_model(seed=0, layers=2):
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(seed)
    cfg = ModernBertConfig(hidden_size=64, num_attention_heads=2, intermediate_size=96, num_hidden_layers=layers,
                           local_attention=16, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    cfg._attn_implementation = "sdpa"
    return ModernBertModel(cfg).eval()


def padded(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), max(lengths)), generator=gen)
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids, mask


# ------------------------------------------------------------------------------------------------ router


def packed_facts(**kw):
    return Facts(**{"graphs": CFG, "num_seqs": 3, "total_tokens": 55, "max_seqlen": 33, **kw})


def test_every_route_from_synthetic_facts():
    bucket = B.bucket_for(CFG, 3, 55, 33)
    assert choose(packed_facts()) == PackedGraph(bucket)
    assert choose(packed_facts(autocast=torch.bfloat16)) == PackedGraph(bucket, torch.bfloat16)
    assert choose(packed_facts(structure="a forward hook on layers.0")) == Stock("a forward hook on layers.0")
    assert choose(packed_facts(graphs=None)) == Eager()
    assert choose(packed_facts(padded=True)) == PackedGraph(None)  # sizes after the sync
    # the sync-free path takes a padded call it admits, from shapes alone
    rect = choose(Facts(graphs=SF, padded=True, batch=3, width=40, vocab=VOCAB))
    assert rect == RectangularGraph(RectBucket(8, 48, VOCAB))
    assert choose(Facts(graphs=SF, padded=True, batch=3, width=40, vocab=VOCAB, position_ids=True)) == \
        PackedGraph(None, None, B.POSITION_IDS)
    assert choose(Facts(graphs=SF, padded=True, batch=3, width=40, vocab=VOCAB, grad=True)) == \
        Eager(B.GRAD, B.GRAD)
    # the first failing mode is the reason; every refusal is an Eager route
    cases = [
        (dict(kill_switch=True, grad=True), B.KILL_SWITCH), (dict(suspended=True, grad=True), B.SUSPENDED),
        (dict(grad=True), B.GRAD), (dict(dropout=True), B.DROPOUT), (dict(hidden_states=True), B.HIDDEN_STATES),
        (dict(inputs_embeds=True), B.EMBEDS), (dict(model_on_cuda=False), B.NOT_CUDA),
        (dict(model_on_cuda=False, grad=True, dropout=True), B.NOT_CUDA),  # (off CUDA, whatever the mode)
        (dict(same_device=False), B.OTHER_DEVICE), (dict(num_seqs=5), B.TOO_MANY_SEQS),
        (dict(total_tokens=201), B.TOO_MANY_TOKENS), (dict(max_seqlen=65), B.TOO_LONG),
    ]
    for change, reason in cases:
        assert choose(packed_facts(**change)) == Eager(reason), change
        if change.keys() & {"num_seqs", "total_tokens", "max_seqlen", "same_device"}:
            continue  # sizes of a padded call are admitted after its sync
        assert choose(packed_facts(padded=True, **change)) == Eager(reason), change
    # a structure problem wins over everything; graphs off wins over every graph refusal
    assert isinstance(choose(packed_facts(structure="x", graphs=None, grad=True)), Stock)
    assert choose(packed_facts(graphs=None, grad=True, model_on_cuda=False)) == Eager()


def test_called_projection_slots_take_every_call_off_the_graphs():
    """A projection slot holding a module the forward calls (a peft LoRA layer): every graph route steps aside for
    the eager path, with the reason, whatever else the call is; without it the same facts take their graphs."""
    reason = "module call at layers.0.attn.Wqkv (peft.tuners.lora.layer.Linear): CUDA graphs off"
    train = GraphConfig(max_seqlen=64, max_seqs=4, max_tokens=200, training=True)
    served = [packed_facts(), packed_facts(padded=True), packed_facts(autocast=torch.bfloat16),
              Facts(graphs=SF, padded=True, batch=3, width=40, vocab=VOCAB),
              Facts(graphs=train, grad=True, padded=True), Facts(graphs=train, grad=True, num_seqs=3, total_tokens=55,
                                                                 max_seqlen=33)]
    kinds = [PackedGraph, PackedGraph, PackedGraph, RectangularGraph, TrainingGraph, TrainingGraph]
    for facts, kind in zip(served, kinds):
        assert isinstance(choose(facts), kind), facts
        facts.module_calls = reason
        assert choose(facts) == Eager(reason), facts
    assert choose(packed_facts(module_calls=reason, graphs=None)) == Eager()  # graphs off: no reason to give
    assert isinstance(choose(packed_facts(module_calls=reason, structure="x")), Stock)


def test_module_calls_fact_reads_the_structure_snapshot():
    """``mode_facts`` gives the router the called slots from the structure snapshot (current after each call's
    structure check), so a LoRA layer put in after pack() and taken out again is followed."""
    from packed_encoders import call
    from packed_encoders.adapters.structure import structure_check

    model = pe.pack(tiny_model(), validate=False)
    state = get_state(model)

    def fact():
        assert structure_check(model, state) is None  # as each call does first (refreshes the snapshot)
        with torch.no_grad():  # (an inference graph's question: with gradients, training graphs' only)
            return call.mode_facts(model, state)["module_calls"]

    assert fact() is None
    plain = model.layers[1].mlp.Wi
    model.layers[1].mlp.Wi = torch.nn.Sequential(plain)
    assert fact().startswith("module call at layers.1.mlp.Wi (torch.nn.modules.container.Sequential): CUDA graphs "
                             "off")
    model.layers[1].mlp.Wi = plain
    assert fact() is None


def test_choose_reads_nothing_but_its_facts(monkeypatch):
    """Pure: the environment and torch's modes do not reach it."""
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "0")
    with torch.enable_grad():
        assert choose(packed_facts()) == PackedGraph(B.bucket_for(CFG, 3, 55, 33))


# ------------------------------------------------------------------------------------------------ tuning


def test_dropout_fact_reads_the_live_modules():
    """The router's dropout fact follows each module's own mode and rate, read per call: not model.training and
    not the config's rates at pack() (a graph would replay a forward without dropout)."""
    from packed_encoders import call
    from packed_encoders.adapters.structure import structure_check

    model = pe.pack(tiny_model(), validate=False)  # every rate 0 in the config
    state = get_state(model)

    def dropout():
        assert structure_check(model, state) is None  # as each call does first (refreshes the snapshot)
        return call.mode_facts(model, state)["dropout"]

    assert not dropout()
    model.train()
    assert not dropout(), "train mode with every rate 0 applies no dropout"
    model.eval()
    model.layers[1].mlp.drop.p = 0.2
    assert not dropout(), "a rate on a module in eval mode applies none"
    model.layers[1].mlp.drop.train()
    assert dropout() and not model.training, "Monte-Carlo dropout: a dropout module in train mode in an eval model"
    model.eval()
    model.embeddings.drop.p = 0.2
    model.embeddings.drop.train()
    assert dropout()
    model.eval()
    model.layers[0].attn.attention_dropout = 0.1  # the rate stock's attention reads per call, set after pack()
    assert not dropout()
    model.layers[0].attn.train()
    assert dropout()
    model.layers[0].attn.attention_dropout = 0.0
    assert not dropout()
    model.layers[0].attn.out_drop = torch.nn.Dropout(0.3)  # was an nn.Identity: a new module, in train mode
    assert dropout()
    model.eval()
    assert not dropout()


def test_tuning_is_read_at_pack_and_again_on_repack(monkeypatch):
    for name in ("PACKED_ENCODERS_GRAPH", "PACKED_ENCODERS_FUSED_UNPAD", "PACKED_ENCODERS_GRAPH_MEMORY"):
        monkeypatch.delenv(name, raising=False)
    model = pe.pack(tiny_model(), validate=False)
    state = get_state(model)
    assert state.tuning.graphs and state.tuning.fused_unpad
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "off")
    monkeypatch.setenv("PACKED_ENCODERS_FUSED_UNPAD", "0")
    with torch.no_grad():
        model(*padded([3, 5]))
    assert get_state(model) is state and state.tuning.graphs, "frozen: a call does not re-read the environment"
    pe.pack(model, validate=False)  # same options, other switches: re-packed with them
    new = get_state(model)
    assert new is not state and not new.tuning.graphs and not new.tuning.fused_unpad
    assert dict(new.tuning.env)["PACKED_ENCODERS_GRAPH"] == "off"
    pe.pack(model, validate=False)
    assert get_state(model) is new, "same options and switches: nothing to do"
    info = pe.describe(model)["encoders"][0]
    assert info["tuning"]["graphs"] is False and info["tuning"]["env"]["PACKED_ENCODERS_FUSED_UNPAD"] == "0"
    assert "at pack()" in info["tuning"]["read"] and "ops_reads" not in info["tuning"]
    assert info["cuda_graph"]["kill_switch"] is True
    with pytest.raises(AttributeError):
        new.tuning.graphs = True  # frozen


def test_tuning_values_and_the_graph_budget(monkeypatch):
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH_MEMORY", "0.25")
    t = read_tuning()
    assert t.graph_memory_fraction == 0.25 and t.free_memory_bytes is None  # no device: nothing measured
    assert t.graph_budget_bytes() is None and t.graph_budget_bytes(1000) == 250
    assert Tuning(free_memory_bytes=4000, graph_memory_fraction=0.5).graph_budget_bytes(10) == 2000
    for bad in ("0", "1.5", "lots"):
        monkeypatch.setenv("PACKED_ENCODERS_GRAPH_MEMORY", bad)
        with pytest.raises(pe.PackedEncodersError, match="PACKED_ENCODERS_GRAPH_MEMORY"):
            read_tuning()


# ------------------------------------------------------------------------------------------ default graphs


def test_default_pack_turns_graphs_on_and_stays_eager_and_quiet_on_cpu():
    model = tiny_model()
    ids, mask = padded([5, 17, 33])
    with torch.no_grad():
        want = pe.packed_forward(model, None, ids[mask.bool()],
                                 torch.tensor([0, 5, 22, 55], dtype=torch.int32), 33)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "model is on cpu" warning for the default
        pe.pack(model)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model(input_ids=ids, attention_mask=mask)  # with gradients: counted as off CUDA too
    state = get_state(model)
    assert state.options.graph_auto and state.options.cuda_graph == GraphConfig()
    info = pe.describe(model)["encoders"][0]["cuda_graph"]
    assert info["enabled"] and info["mode"] == "auto" and "on cpu" in info["idle_reason"]
    assert info["graphs"] == 0 and info["fallbacks"] == {B.NOT_CUDA: 2}
    torch.testing.assert_close(out[mask.bool()], want, atol=2e-5, rtol=2e-5)
    # an explicit request on a CPU model still warns
    with pytest.warns(UserWarning, match="on cpu"):
        pe.pack(tiny_model(), validate=False, cuda_graph=True)
    # cuda_graph=False opts out
    off = pe.pack(tiny_model(), validate=False, cuda_graph=False)
    assert pe.describe(off)["encoders"][0]["cuda_graph"] == {"enabled": False, "mode": "off", "kill_switch": False,
                                                             "suspended": False}


def test_default_graphs_serve_a_model_moved_to_cuda_later(monkeypatch):
    """A CPU-packed model whose weights later sit on CUDA is routed to graphs (the facts say 'on CUDA'), with no
    re-pack: pretend the move by patching the router's device fact, and build capture-free runners."""
    from packed_encoders import call
    from packed_encoders.graphs import route
    from packed_encoders.graphs.runner import GraphRunner

    model = pe.pack(tiny_model(), validate=False)
    ids, mask = padded([5, 17])
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).last_hidden_state
    real_mode = call.mode_facts
    monkeypatch.setattr(call, "mode_facts", lambda *a, **k: {**real_mode(*a, **k), "model_on_cuda": True})
    monkeypatch.setattr(route, "_build", lambda model, state, mgr, bucket, requested, query_only=False, autocast=None:
                        GraphRunner(model, state, bucket, requested, capture=False, query_only=query_only))
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
        model(input_ids=ids, attention_mask=mask)
    info = pe.describe(model)["encoders"][0]["cuda_graph"]
    assert info["graphs"] == 1 and info["hits"] == 1 and info["fallbacks"] == {B.NOT_CUDA: 1}
    torch.testing.assert_close(got, eager, atol=2e-5, rtol=2e-5)


def test_memory_budget_evicts_lru_and_refuses_a_graph_too_large_alone():
    from packed_encoders.graphs.manager import GraphManager

    class Fake:
        def __init__(self, nbytes):
            self.graph_bytes = nbytes

    mgr = GraphManager(GraphConfig(max_graphs=8), budget_bytes=100)
    assert mgr.get("a", lambda: Fake(40)).graph_bytes == 40
    mgr.get("b", lambda: Fake(40))
    mgr.get("a", lambda: Fake(0))          # a is now the most recently used
    mgr.get("c", lambda: Fake(40))         # 120 > 100: evicts b, the least recently used
    assert mgr.keys() == ["a", "c"] and mgr.graph_bytes == 80 and mgr.evictions == 1
    assert mgr.get("huge", lambda: Fake(101)) == B.OVER_BUDGET
    assert mgr.get("huge", lambda: Fake(1)) == B.OVER_BUDGET, "remembered: not captured again"
    assert mgr.keys() == ["a", "c"] and "huge" in mgr.failures()
    mgr.clear()
    assert mgr.graph_bytes == 0


def test_graph_keys_carry_the_autocast_dtype(monkeypatch):
    """Autocast is served: the route carries the dtype and the graph is keyed (and captured) by it."""
    from packed_encoders import call
    from packed_encoders.graphs import route
    from packed_encoders.graphs.runner import GraphRunner

    built = []

    def build(model, state, mgr, bucket, requested, query_only=False, autocast=None):
        built.append(autocast)
        return GraphRunner(model, state, bucket, requested, capture=False, query_only=query_only)

    real_mode = call.mode_facts
    flag = {"autocast": None}
    monkeypatch.setattr(call, "mode_facts",
                        lambda *a, **k: {**real_mode(*a, **k), "model_on_cuda": True, "autocast": flag["autocast"]})
    monkeypatch.setattr(route, "_build", build)
    model = pe.pack(tiny_model(), validate=False)
    ids, mask = padded([5, 17])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
        flag["autocast"] = torch.bfloat16
        model(input_ids=ids, attention_mask=mask)
        model(input_ids=ids, attention_mask=mask)
    info = pe.describe(model)["encoders"][0]["cuda_graph"]
    assert built == [None, torch.bfloat16] and info["graphs"] == 2 and info["hits"] == 1
    assert sorted(str(b["autocast"]) for b in info["buckets"]) == ["None", "bfloat16"]
