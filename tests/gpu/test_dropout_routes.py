"""On the GPU, a call that applies dropout is never served by a CUDA graph (captured without dropout): the router's
dropout fact reads each module's live mode and rate, so Monte-Carlo dropout in an eval model, an attention rate set
after pack() and a dropout module swapped in after pack() run the eager forward, with dropout; back in eval mode
the graphs serve again. Default graphs and the sync-free rectangular graphs. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

import packed_encoders as pe
from packed_encoders.graphs.config import GraphConfig
from tests.gpu.test_graphs import graph_model
from tests.helpers import DROPOUT_AFTER_PACK, enable_dropout, padded_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GRAPHS = {
    "default": dict(),
    "sync_free": dict(cuda_graph=GraphConfig(sync_free=True, sync_free_max_tokens=1 << 16)),
}


def _served_by_graphs(model) -> int:
    info = pe.describe(model)["encoders"][0]["cuda_graph"]
    return info["hits"] + info["misses"]  # replays of a captured graph, captures


@pytest.mark.parametrize("where", DROPOUT_AFTER_PACK)
@pytest.mark.parametrize("graphs", list(GRAPHS))
def test_live_dropout_is_never_replayed_from_a_graph(graphs, where):
    model = graph_model("tiny64")  # every dropout rate 0 in the config
    pe.pack(model, **GRAPHS[graphs])
    ids, mask = padded_batch([7, 19, 30, 2], "mixed", vocab_size=model.config.vocab_size, device="cuda")
    real = mask.bool()

    def run():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state.clone()
        if graphs == "sync_free":
            pe.check_errors(model, wait=True)
        return out

    with torch.no_grad():
        run()
        clean = run()
        served = _served_by_graphs(model)
        assert served >= 1 and pe.describe(model)["encoders"][0]["cuda_graph"]["hits"] >= 1  # a clean call replayed
        enable_dropout(model, where)
        assert not model.training
        a, b = run(), run()
        assert _served_by_graphs(model) == served, "a call with dropout was served by a graph"
        assert (a - b)[real].float().abs().max() > 1e-2, "the eager route applied no dropout"
        assert torch.isfinite(a[real]).all()
        model.eval()  # every module back in eval mode: graphs serve again, without dropout
        again = run()
        assert _served_by_graphs(model) > served
    torch.testing.assert_close(again, clean, atol=0, rtol=0)
