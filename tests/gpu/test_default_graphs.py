"""``pe.pack(model)`` with no options serves inference from CUDA graphs: lazily captured buckets, autocast
served, an LRU memory budget, ``cuda_graph=False`` opting out, a model moved to CUDA after ``pack()``, switches
read at ``pack()``. Skipped without CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch

import packed_encoders as pe
from packed_encoders.graphs import buckets as B
from packed_encoders.graphs.config import GraphConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
CFG = dict(hidden_size=128, num_attention_heads=2, intermediate_size=192, num_hidden_layers=4, local_attention=16,
           vocab_size=331, max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2,
           cls_token_id=1, sep_token_id=2)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for name in ("PACKED_ENCODERS_GRAPH", "PACKED_ENCODERS_GRAPH_MEMORY"):
        monkeypatch.delenv(name, raising=False)


def make_model(dtype=torch.bfloat16, device=DEV, seed=0):
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(seed)
    config = ModernBertConfig(**CFG)
    config._attn_implementation = "sdpa"
    model = ModernBertModel(config).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.add_(0.2 * torch.randn(m.weight.shape))
    return model.to(device, dtype)


def padded(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(3, CFG["vocab_size"], (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids.to(DEV), mask.to(DEV)


def fwd(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


def info(model):
    return pe.describe(model)["encoders"][0]["cuda_graph"]


def cos_min(a, b, mask):
    real = mask.bool()
    return float(torch.nn.functional.cosine_similarity(a[real].float(), b[real].float(), dim=-1).min())


def test_default_pack_serves_inference_from_graphs():
    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for the default on a CUDA model
        pe.pack(model)
    ids, mask = padded([5, 17, 33, 120, 2, 64, 9, 80])
    with torch.no_grad():
        first = fwd(model, ids, mask)    # captures the bucket (and checks the replay against its warm-up)
        second = fwd(model, ids, mask)   # replays it
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
    state = info(model)
    assert state["mode"] == "auto" and state["idle_reason"] is None
    assert state["graphs"] == 1 and state["misses"] == 1 and state["hits"] == 1, state
    assert not state["capture_failures"]
    assert torch.equal(first, second)
    assert cos_min(second, eager, mask) >= 0.995
    assert torch.equal(second[mask == 0], torch.zeros_like(second[mask == 0]))
    assert state["memory"]["budget_bytes"] > 0 and 0 < state["memory"]["graph_bytes"] <= state["memory"]["budget_bytes"]
    tuning = pe.describe(model)["encoders"][0]["tuning"]
    assert tuning["graphs"] and tuning["free_memory_bytes"] > 0
    # calls a graph cannot serve run eagerly, the reason counted
    with torch.no_grad():
        fwd(model, *padded([3000, 5]))                       # longer than max_seqlen (2048)
    fwd(model, ids, mask)                                    # grad enabled
    assert info(model)["fallbacks"] == {B.TOO_LONG: 1, B.GRAD: 1, B.SUSPENDED: 1}


def test_packed_forward_default_uses_graphs():
    model = pe.pack(make_model())
    ids, mask = padded([7, 30, 12])
    flat, lengths = ids[mask.bool()], mask.sum(1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    with torch.no_grad():
        a = pe.packed_forward(model, None, flat, cu, int(lengths.max()))
        b = pe.packed_forward(model, None, flat, cu, int(lengths.max()))
    assert torch.equal(a, b) and info(model)["hits"] == 1


def test_autocast_is_served_by_graphs_captured_under_it():
    model = make_model(torch.float32)  # fp32 master weights, bf16 autocast: the usual mixed-precision inference
    pe.pack(model)
    ids, mask = padded([5, 17, 33, 100])
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fwd(model, ids, mask)
        graph = fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
    with torch.no_grad():
        plain = fwd(model, ids, mask)   # fp32, no autocast: its own graph
        plain = fwd(model, ids, mask)
    state = info(model)
    assert state["graphs"] == 2 and {b["autocast"] for b in state["buckets"]} == {"bfloat16", None}, state
    assert graph.dtype == eager.dtype and cos_min(graph, eager, mask) >= 0.995
    assert cos_min(plain, eager, mask) >= 0.99
    with pe.no_cuda_graph(model), torch.no_grad():
        fp32_eager = fwd(model, ids, mask)
    assert (plain - fp32_eager)[mask.bool()].abs().max() <= 1e-3 * fp32_eager.abs().max() + 1e-4


def test_a_float64_model_under_autocast_is_served_in_float64():
    """Autocast casts no float64 tensor: a float64 model runs in float64 under it (as stock does), so its graph is
    keyed as without autocast and no low-precision weight copies are made."""
    model, stock = make_model(torch.float64), make_model(torch.float64)
    pe.pack(model)
    ids, mask = padded([5, 17, 33, 100])
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        fwd(model, ids, mask)
        graph = fwd(model, ids, mask)
        want = fwd(stock, ids, mask)
    state = info(model)
    assert state["hits"] == 1 and {b["autocast"] for b in state["buckets"]} == {None}, state
    assert state["memory"]["weight_copy_bytes"] == 0
    assert graph.dtype == want.dtype == torch.float64
    assert (graph - want)[mask.bool()].abs().max() <= 1e-9


def test_lru_budget_evicts_and_refuses_graphs_too_large():
    model = make_model()
    pe.pack(model, validate=False)
    shapes = ([300] * 8, [100] * 8, [40] * 8)  # three token buckets
    with torch.no_grad():
        for lengths in shapes:
            fwd(model, *padded(lengths))
    costs = [b["bytes"] for b in info(model)["buckets"]]  # capture order (each used once)
    assert len(costs) == 3 and all(c > 0 for c in costs), costs
    # room for the first graph and half the second: capturing the second evicts the first (LRU)
    budget = costs[0] + costs[1] // 2
    pe.pack(model, validate=False, cuda_graph=GraphConfig(max_memory_bytes=budget))
    with torch.no_grad():
        for lengths in shapes:
            ids, mask = padded(lengths)
            out = fwd(model, ids, mask)
            with pe.no_cuda_graph(model):
                eager = fwd(model, ids, mask)
            assert cos_min(out, eager, mask) >= 0.995
            assert info(model)["memory"]["graph_bytes"] <= budget
    state = info(model)
    assert state["evictions"] >= 1 and state["misses"] == 3 and state["graphs"] < 3, state
    # a budget below one graph: the bucket runs eagerly, said in describe()
    pe.pack(model, validate=False, cuda_graph=GraphConfig(max_memory_bytes=1024))
    ids, mask = padded([40] * 8)
    with torch.no_grad():
        out = fwd(model, ids, mask)
        fwd(model, ids, mask)
        with pe.no_cuda_graph(model):
            eager = fwd(model, ids, mask)
    state = info(model)
    assert state["graphs"] == 0 and state["fallbacks"].get(B.OVER_BUDGET) == 2, state
    assert any(B.OVER_BUDGET in v for v in state["capture_failures"].values())
    assert cos_min(out, eager, mask) >= 0.995


def test_cuda_graph_false_opts_out_and_switches_are_read_at_pack(monkeypatch):
    model = pe.pack(make_model(), cuda_graph=False)
    ids, mask = padded([5, 17])
    with torch.no_grad():
        fwd(model, ids, mask)
        fwd(model, ids, mask)
    assert info(model) == {"enabled": False, "mode": "off", "kill_switch": False, "suspended": False}
    monkeypatch.setenv("PACKED_ENCODERS_GRAPH", "0")
    pe.pack(model)  # re-reads: the kill switch holds for this packing
    with torch.no_grad():
        fwd(model, ids, mask)
    monkeypatch.delenv("PACKED_ENCODERS_GRAPH")
    with torch.no_grad():
        fwd(model, ids, mask)  # still off: read at pack()
    assert info(model)["graphs"] == 0 and info(model)["fallbacks"] == {B.KILL_SWITCH: 2}
    pe.pack(model)
    with torch.no_grad():
        fwd(model, ids, mask)
        fwd(model, ids, mask)
    assert info(model)["graphs"] == 1 and info(model)["hits"] == 1


def test_a_model_moved_to_cuda_after_pack_starts_using_graphs():
    model = make_model(torch.float32, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pe.pack(model)  # on CPU: eager, no warning
    ids, mask = padded([5, 17, 40])
    with torch.no_grad():
        cpu_out = model(input_ids=ids.cpu(), attention_mask=mask.cpu()).last_hidden_state
    assert info(model)["fallbacks"] == {B.NOT_CUDA: 1}
    model.to(DEV, torch.bfloat16)
    with torch.no_grad():
        fwd(model, ids, mask)
        out = fwd(model, ids, mask)
    state = info(model)
    assert state["graphs"] == 1 and state["hits"] == 1 and state["memory"]["budget_bytes"] > 0, state
    assert cos_min(out.float().cpu(), cpu_out, mask.cpu()) >= 0.99


@pytest.mark.parametrize("autocast", [False, True])
def test_buckets_of_one_octave_share_one_static_output(autocast):
    """Three buckets of one octave: one shared output buffer (fp32 under autocast, as final_norm returns there),
    every call's output equal to the eager forward's, calls interleaved across the buckets."""
    model = pe.pack(make_model(dtype=torch.float32 if autocast else torch.bfloat16), validate=False)
    batches = [padded(lengths, seed=i) for i, lengths in enumerate(([800, 900, 500], [1000, 900, 700], [1000, 1000, 1000, 200]))]
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast else torch.no_grad
    with torch.no_grad(), ctx():
        with pe.no_cuda_graph(model):
            want = [fwd(model, *b) for b in batches]
        got = [[fwd(model, *b) for b in batches] for _ in range(2)]
    cg = info(model)
    tokens = sorted({b["tokens"] for b in cg["buckets"]})
    assert len(tokens) == 3 and len({(t - 1).bit_length() for t in tokens}) == 1, tokens
    rows = 1 << (tokens[-1] - 1).bit_length()
    elem = 4 if autocast else 2
    assert cg["memory"]["shared_output_bytes"] == rows * CFG["hidden_size"] * elem
    for outs in got:
        for g, w, (_, mask) in zip(outs, want, batches):
            real = mask.bool()
            assert g.dtype == w.dtype
            cos = torch.nn.functional.cosine_similarity(g[real].float(), w[real].float(), dim=-1)
            assert cos.min().item() > 0.999


@pytest.mark.parametrize("change", ["linear", "norm_eps", "layers_reordered", "rotary_buffer"])
def test_a_module_tree_change_after_capture_recaptures(change):
    """A captured graph holds the modules it was captured with (weights by address, ``eps`` as an argument, the
    layer order): a Linear swapped for a new one, a norm's ``eps`` set or two layers of one attention type
    reordered, or a rotary ``inv_freq`` buffer reassigned after the first calls must not replay the old modules or
    buffer. Against stock HF with the same change."""
    import copy

    model = make_model()
    stock = copy.deepcopy(model)
    pe.pack(model)
    ids, mask = padded([5, 17, 33, 120, 2, 64, 9, 80])
    with torch.no_grad():
        fwd(model, ids, mask)
        fwd(model, ids, mask)  # replayed
    assert info(model)["hits"] == 1
    for target in (model, stock):
        torch.manual_seed(1)
        if change == "linear":
            old = target.layers[1].attn.Wqkv
            new = torch.nn.Linear(old.in_features, old.out_features, bias=old.bias is not None)
            target.layers[1].attn.Wqkv = new.to(DEV, old.weight.dtype)
        elif change == "norm_eps":
            target.layers[2].mlp_norm.eps = 0.5
        elif change == "rotary_buffer":  # a capture reads the buffer by address
            rotary = next(m for m in target.modules() if type(m).__name__ == "ModernBertRotaryEmbedding")
            for name in [n for n in rotary._buffers if n.endswith("inv_freq")]:
                setattr(rotary, name, getattr(rotary, name) * 1.5)
        else:  # layers 1 and 2 are both local (global every 3rd layer)
            target.layers[1], target.layers[2] = target.layers[2], target.layers[1]
    with torch.no_grad():
        got, want = fwd(model, ids, mask), fwd(stock, ids, mask)
    assert cos_min(got, want, mask) >= 0.995
    assert info(model)["invalidations"] >= 1
