"""The untuned benchmark workloads (derived from the real-text sets) and the table order of the renderer."""

from __future__ import annotations

import numpy as np

from benchmarks import render, workloads
from benchmarks.data import TokenSet

CLS, SEP = 50281, 50282


def _set(name, lengths, seed):
    rng = np.random.default_rng(seed)
    return TokenSet.from_lists(name, [[CLS, *rng.integers(10, 50000, n - 2).tolist(), SEP] for n in lengths],
                               np.uint16)


def test_untuned_sets_have_the_issue_shapes():
    rng = np.random.default_rng(0)
    corpus = {"long": _set("long", rng.integers(600, 1200, 40), 1), "queries": _set("queries", rng.integers(8, 20, 300), 2),
              "passages": _set("passages", rng.integers(20, 300, 900), 3)}
    mixed = workloads.token_set(corpus, "untuned_mixed")
    lengths = mixed.lengths.reshape(-1, 16)
    assert (lengths[:, 0] == 1500).all() and (lengths[:, 1:] < 20).all() and len(mixed) == 256
    assert all(mixed[i][0] == CLS and mixed[i][-1] == SEP for i in range(0, 256, 16))
    assert not np.isin(mixed[0][1:-1], [CLS, SEP]).any(), "joined documents drop their inner [CLS] / [SEP]"
    for name, width in (("untuned_512", 512), ("untuned_32", 32)):
        ts = workloads.token_set(corpus, name)
        assert (ts.lengths == width).all() and ts[0][0] == CLS and ts[0][-1] == SEP
    assert list(workloads.indices(mixed, 32, seed=5)) == list(range(32)), "laid out in batch order"
    assert len(set(workloads.indices(corpus["queries"], 32, seed=5))) == 32


def test_the_default_pack_rows_lead_the_tables():
    rows = [{"variant": v, "status": "ok", "run_id": "r", "runner": "inference", "endpoint": "queries",
             "family": "hf", "seqs_per_s_median": s, "seqs_per_s_worst": s, "seqs_per_s_best": s,
             "tokens_per_s_median": s, "first_pass_s": 1.0, "parity": {}} for v, s in
            (("hf_sdpa", 100.0), ("pack_graphs", 900.0), ("pack", 1000.0))]
    text = render.table(rows)
    body = [line.split("|")[1].strip() for line in text.splitlines()[2:]]
    assert body == ["pack", "hf_sdpa", "pack_graphs"]
    assert "| pack | 1,000.0" in text and "10.00x" in text
