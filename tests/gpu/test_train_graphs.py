"""Training CUDA graphs on the GPU (``GraphConfig(training=True)``), ModernBERT-base geometry, fp32 master weights
under bf16 autocast: the captured forward + backward against the eager training path and stock HF.

Run: ``python -m pytest -q tests/gpu/test_train_graphs.py`` (skipped without CUDA).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import packed_encoders as pe  # noqa: E402
from packed_encoders.graphs import buckets as B  # noqa: E402
from packed_encoders.pooling import mean_pool  # noqa: E402
from tests.gpu.test_training import _compare, _encode, _grads, _inputs, _inputs_slice, _lengths, _model  # noqa: E402

DEV = torch.device("cuda")
TRAIN = pe.GraphConfig(training=True)


def _graphs(model):
    return pe.describe(model)["encoders"][0]["cuda_graph"]


def _step(model, q, d, mode="stock", opt=None):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eq, ed = mean_pool(_encode(model, q, mode), q["cu"]), mean_pool(_encode(model, d, mode), d["cu"])
    eq, ed = F.normalize(eq.float(), dim=-1), F.normalize(ed.float(), dim=-1)
    loss = F.cross_entropy(20 * eq @ ed.t(), torch.arange(eq.shape[0], device=DEV))
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = _grads(model)
    if opt is not None:
        opt.step()
    return loss.item(), grads


@pytest.mark.parametrize("mode", ["stock", "packed"])  # padded calls through the patched forward; packed_forward
def test_single_vector_steps_match_the_eager_path_and_stock(mode):
    base = _model()
    eager, graphs = copy.deepcopy(base), copy.deepcopy(base)
    data = [(_inputs(_lengths(16, 8, 30, 10 + i), 10 + i), _inputs(_lengths(16, 300, 1500, 20 + i), 20 + i))
            for i in range(3)]
    ref_loss, ref = _step(base, *data[0])
    pe.pack(eager)
    pe.pack(graphs, cuda_graph=TRAIN)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-4)
    opt_g = torch.optim.AdamW(graphs.parameters(), lr=1e-4)
    for i, (q, d) in enumerate(data):
        le, ge = _step(eager, q, d, mode, opt_e)
        lg, gg = _step(graphs, q, d, mode, opt_g)
        assert abs(le - lg) < 2e-3, (i, le, lg)
        _compare(ge, gg, 0.999)
        if i == 0:
            assert abs(lg - ref_loss) < 5e-4, (lg, ref_loss)
            _compare(ref, gg, 0.999)
    g = _graphs(graphs)
    assert not g["capture_failures"], g["capture_failures"]
    assert any(b.get("training") for b in g["buckets"]), g
    assert g["training"]["pending_slots"] == 0


def test_gradcache_chunks_accumulate_as_the_eager_path():
    base = _model()
    eager, graphs = copy.deepcopy(base), copy.deepcopy(base)
    pe.pack(eager)
    pe.pack(graphs, cuda_graph=TRAIN)
    d = _inputs(_lengths(32, 100, 1200, 5), 5)
    parts = [_inputs_slice(d, i, 8) for i in range(0, 32, 8)]

    def step(model):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            reps = [mean_pool(_encode(model, c, "stock"), c["cu"]).float().requires_grad_() for c in parts]
        loss = torch.cat(reps).pow(2).sum(-1).log().mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        for c, r in zip(parts, reps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = mean_pool(_encode(model, c, "stock"), c["cu"]).float()
            x.backward(r.grad)
        return _grads(model)

    _compare(step(eager), step(graphs), 0.999)
    g = _graphs(graphs)
    assert not g["capture_failures"] and any(b.get("training") for b in g["buckets"]), g


def test_kept_grads_are_not_overwritten_by_later_steps():
    model = _model()
    pe.pack(model, cuda_graph=TRAIN)
    q, d = _inputs(_lengths(8, 8, 30, 1), 1), _inputs(_lengths(8, 200, 600, 2), 2)
    _step(model, q, d)
    kept = {n: p.grad for n, p in model.named_parameters()}
    snapshot = {n: g.clone() for n, g in kept.items()}
    _step(model, d, q)
    for n in kept:
        torch.testing.assert_close(kept[n], snapshot[n], atol=0, rtol=0, msg=n)


def test_dropout_takes_the_eager_path_visibly():
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(attention_dropout=0.1, mlp_dropout=0.1)
    config._attn_implementation = "sdpa"
    model = ModernBertModel(config).to(DEV).train()
    pe.pack(model, cuda_graph=TRAIN)
    q, d = _inputs(_lengths(4, 8, 30, 1), 1), _inputs(_lengths(4, 200, 600, 2), 2)
    _step(model, q, d)
    g = _graphs(model)
    assert g["fallbacks"].get(B.DROPOUT, 0) >= 2 and not any(b.get("training") for b in g["buckets"])


def test_a_smaller_bucket_warms_up_inside_the_slot_pool():
    """A slot whose pool holds a large bucket's graphs captures a smaller bucket: its eager warm-ups (a whole
    training forward + backward) allocate from the pool's free blocks, not beside them in the general pool."""
    model = _model()
    pe.pack(model, cuda_graph=TRAIN)
    big = _inputs(_lengths(16, 1000, 1500, 3), 3)    # ~20k tokens
    small = _inputs(_lengths(16, 300, 500, 4), 4)    # ~6.4k tokens: another bucket of the same slot

    def step(b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = _encode(model, b, "stock")
        out.float().pow(2).mean().backward()
        torch.cuda.synchronize()

    step(big)
    pools = _graphs(model)["training"]["pool_reserved_bytes"]
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    step(small)
    grew = torch.cuda.max_memory_reserved() - before
    g = _graphs(model)
    assert sum(1 for b in g["buckets"] if b.get("training")) == 2, g["buckets"]
    assert not g["capture_failures"], g["capture_failures"]
    # the gradients' copies (fp32, ~0.6 GB) are the general pool's; a warm-up there would add ~3 GB
    assert grew < 0.2 * pools, (grew, pools)


def test_graphs_under_autocast_read_weight_copies_that_follow_the_weights():
    """The inference and training graphs of fp32 weights under bf16 autocast read the encoder's bf16 copies of its
    projection weights, recast before a replay when a weight changed: an in-place edit and a fused optimizer step
    (which bumps no version counter) are both seen by the next replay."""
    model = _model()
    pe.pack(model, cuda_graph=TRAIN)
    q, d = _inputs(_lengths(8, 8, 30, 1), 1), _inputs(_lengths(8, 200, 600, 2), 2)

    def infer():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return _encode(model, q, "stock").float()

    def eager():
        with pe.no_cuda_graph(model):
            return infer()

    def close(a, b):
        return float(F.cosine_similarity(a, b, dim=-1).min()) > 0.999

    first = infer()
    assert close(first, eager())
    with torch.no_grad():
        model.layers[-1].mlp.Wo.weight.normal_()  # in place, ~50x the init scale: a visible change
    second = infer()
    assert not close(first, second) and close(second, eager())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=True)
    _step(model, q, d, opt=opt)  # training graphs, then a step that changes every weight without a version bump
    third = infer()
    assert not close(second, third) and close(third, eager())
    g = _graphs(model)
    assert g["hits"] >= 2 and any(b.get("training") for b in g["buckets"]), g
    linears = sum(p.numel() for n, p in model.named_parameters() if n.startswith("layers.") and "norm" not in n)
    assert g["memory"]["weight_copy_bytes"] == 2 * linears
