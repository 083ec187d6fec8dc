"""Cross-sequence isolation with non-finite values on every GPU backend: a NaN or Inf in one text leaves every
other text's output as it was, for each attention backend directly (sdpa, varlen, FA4, the Triton kernel with and
without fused RoPE), and for the packed model eagerly and under CUDA graphs (packed and sync-free rectangular);
a clean call after a poisoned one is unaffected (graph buffers are reused). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import packed_encoders as pe
from packed_encoders.attention import BACKENDS
from packed_encoders.graphs.config import GraphConfig
from tests.gpu.test_graphs import graph_model
from tests.helpers import padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DEV = "cuda"
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
# short (the Triton kernel's stream tiles hold several sequences) and long (past the window of 8, key tiles of
# the neighbouring sequence inside the band)
LENGTHS = {"short": [7, 19, 5, 30, 2, 11], "long": [300, 45, 700, 129]}


def _available(backend):
    if backend == "triton":
        from packed_encoders.attention.triton_short import triton_status

        return triton_status()
    return BACKENDS[backend].availability()


def _qkv(lengths, heads=4, head_dim=64, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return q, k, v, cu, max(lengths)


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("size", list(LENGTHS))
@pytest.mark.parametrize("backend", ["sdpa", "varlen", "fa4", "triton", "triton_rope"])
def test_attention_backend_keeps_sequences_apart(backend, size, window, bad):
    name = "triton" if backend == "triton_rope" else backend
    reason = _available(name)
    if reason is not None:
        pytest.skip(reason)
    lengths = LENGTHS[size]
    q, k, v, cu, smax = _qkv(lengths)
    extra = {}
    if backend == "triton_rope":
        total = q.shape[0]
        pos = torch.cat([torch.arange(n, device=DEV) for n in lengths]).float()
        inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, device=DEV).float() / 64))
        freqs = pos[:, None] * inv[None]
        extra["rope"] = (freqs.cos(), freqs.sin(), torch.arange(total, device=DEV))

    def run():
        return BACKENDS[name].fn(q, k, v, cu, smax, window=window, scale=0.125, **extra)

    clean = run()
    for poisoned in range(len(lengths)):
        start, end = int(cu[poisoned]), int(cu[poisoned + 1])
        saved = [t[start].clone() for t in (q, k, v)]
        for t in (q, k, v):
            t[start, 1, 5] = BAD[bad]
        out = run()
        others = torch.ones(q.shape[0], dtype=torch.bool, device=DEV)
        others[start:end] = False
        assert torch.isfinite(out[others]).all(), f"sequence {poisoned}'s {bad} reached another sequence"
        torch.testing.assert_close(out[others], clean[others], atol=0, rtol=0)
        for t, s in zip((q, k, v), saved):
            t[start] = s


MODES = {
    "sdpa": dict(attention_backend="sdpa"),
    "varlen": dict(attention_backend="varlen"),
    "fa4": dict(attention_backend="fa4"),
    "triton": dict(attention_backend="triton"),
    "auto": dict(),
    "graphs": dict(cuda_graph=True),
    "graphs_triton": dict(cuda_graph=True, attention_backend="triton"),
    "sync_free": dict(cuda_graph=GraphConfig(sync_free=True, sync_free_max_tokens=1 << 16)),
}


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("size", list(LENGTHS))
@pytest.mark.parametrize("mode", list(MODES))
def test_packed_model_keeps_rows_apart(mode, size, bad):
    model = graph_model("tiny64")
    backend = MODES[mode].get("attention_backend")
    if backend in ("varlen", "fa4", "triton") and _available(backend) is not None:
        pytest.skip(_available(backend))
    pe.pack(model, **MODES[mode])  # validated while clean
    vocab = model.config.vocab_size
    ids, mask = padded_batch(LENGTHS[size], "mixed", seed=1, vocab_size=vocab, device=DEV)
    ids[ids == 7] = 8
    with torch.no_grad():
        clean = model(input_ids=ids, attention_mask=mask).last_hidden_state.clone()
        saved = model.embeddings.tok_embeddings.weight[7].clone()
        model.embeddings.tok_embeddings.weight[7, :3] = BAD[bad]
        for row in range(ids.shape[0]):
            poisoned = ids.clone()
            poisoned[row, mask[row].nonzero()[1]] = 7  # the row's second real token
            out = model(input_ids=poisoned, attention_mask=mask).last_hidden_state
            if mode == "sync_free":
                pe.check_errors(model, wait=True)
            for r in range(ids.shape[0]):
                if r != row:
                    real = mask[r].bool()
                    assert torch.isfinite(out[r][real]).all(), f"{mode}: row {row}'s {bad} reached row {r}"
                    torch.testing.assert_close(out[r][real], clean[r][real], atol=0, rtol=0)
        model.embeddings.tok_embeddings.weight[7] = saved
        again = model(input_ids=ids, attention_mask=mask).last_hidden_state  # after poisoned calls
    torch.testing.assert_close(again, clean, atol=0, rtol=0)
