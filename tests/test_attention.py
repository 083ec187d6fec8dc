"""CPU tests of packed attention: the sdpa backend, the Triton kernel under TRITON_INTERPRET=1 (tiny shapes),
the dispatch policy (synthetic shapes and files) and calibrate's fit (synthetic sweeps)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings

import pytest
import torch

from packed_encoders import calibrate  # noqa: E402
from packed_encoders.attention import BACKENDS, Workload, resolve  # noqa: E402
from packed_encoders.attention import dispatch, triton_short  # noqa: E402
from packed_encoders.attention.dispatch import DEFAULT_POLICY, Cell, Policy, Table, select_policy  # noqa: E402
from packed_encoders.attention.reference import parity  # noqa: E402
from packed_encoders.attention.triton_short import TileConfig, triton_short_attention  # noqa: E402
from packed_encoders.errors import PackedEncodersError  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("interpret_on_cpu")  # CPU: the Triton kernel runs interpreted
needs_interpreter = pytest.mark.usefixtures("supported_interpreter")  # the tests that launch the kernel


def packed(lengths, heads=2, head_dim=64, dtype=torch.bfloat16, seed=0):
    """q, k contiguous and v a strided view of a fused [T, 3, heads, head_dim] projection."""
    _, q, k, v, cu, smax = calibrate.make_inputs(lengths, heads, head_dim, dtype, DEV, seed=seed)
    return q, k, v, cu, smax


def check(out, q, k, v, cu, window, key_lens=None):
    err, allowed = parity(out, q, k, v, cu, window, key_lens=key_lens)
    assert err <= allowed, f"max err {err:.4g} > allowed {allowed:.4g}"


# ------------------------------------------------------------------------------------------------ sdpa

@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_matches_reference(window, dtype):
    lengths = [4, 5, 8, 9, 0, 1, 23, 0, 2]  # window edges w, w+1, 2w, 2w+1 for w=4; empties inside
    q, k, v, cu, smax = packed(lengths, heads=3, head_dim=16, dtype=dtype)
    out = BACKENDS["sdpa"].fn(q, k, v, cu, smax, window=window, scale=16 ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    check(out, q, k, v, cu, window)


def test_sdpa_all_length_one_and_single_sequence():
    for lengths in ([1] * 7, [19]):
        q, k, v, cu, smax = packed(lengths, heads=2, head_dim=8, dtype=torch.float32)
        for window in (None, 3):
            check(BACKENDS["sdpa"].fn(q, k, v, cu, smax, window=window, scale=8 ** -0.5), q, k, v, cu, window)


@pytest.mark.parametrize("window", [None, 3])
def test_key_lens_query_only_tails(window):
    """Query-only tails (ColBERT query expansion): they attend to the keys, nobody attends to them, and
    a tail row with no key in its window gets zeros. sdpa here; the Triton kernel below."""
    lengths, key_lens = [6, 12, 0, 5, 9], [4, 12, 0, 1, 2]
    q, k, v, cu, smax = packed(lengths, heads=2, head_dim=16, dtype=torch.float32)
    kl = torch.tensor(key_lens, dtype=torch.int32, device=DEV)
    out = BACKENDS["sdpa"].fn(q, k, v, cu, smax, window=window, scale=16 ** -0.5, key_lens=kl)
    check(out, q, k, v, cu, window, key_lens=kl)
    if window is not None:
        assert out[6 + 12 + 5 + 2 + 3:].abs().max() == 0  # sequence 4, rows past key 1 + window 3: no key


def test_small_sdpa_calls_leave_torchs_choice_where_its_efficient_kernel_is_off_or_missing(monkeypatch):
    """Small CUDA calls take the memory-efficient kernel directly only where torch's own choice could: not when
    the user switched it off, nor bf16 below sm_80 (torch has no such kernel there)."""
    from packed_encoders.attention import sdpa

    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(sdpa, "_capability", lambda index: (9, 0))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        assert not sdpa._efficient_kernel(cuda0, torch.bfloat16)
    assert sdpa._efficient_kernel(cuda0, torch.bfloat16) is (torch.version.hip is None)
    monkeypatch.setattr(sdpa, "_capability", lambda index: (7, 5))
    assert not sdpa._efficient_kernel(cuda0, torch.bfloat16)
    assert sdpa._efficient_kernel(cuda0, torch.float16) is (torch.version.hip is None)


@pytest.mark.parametrize("lengths,key_lens", [([6, 12, 0, 5, 9], [4, 12, 0, 1, 2]), ([3], [3]), ([1, 1], [1, 0]),
                                              ([32] * 4, [5, 32, 1, 17])])
def test_key_layout_is_flash_attentions_view_of_query_only_tails(lengths, key_lens):
    """The varlen backend's query-only tails: each sequence's first ``key_lens`` tokens become its own key
    sequence (``cu_seqlens_k``). Attention with separate query / key sequences over them (FlashAttention's varlen
    contract, fp32 per sequence here) equals the ``key_lens`` reference."""
    from packed_encoders.attention import flash

    q, k, v, cu, smax = packed(lengths, heads=2, head_dim=8, dtype=torch.float32)
    kl = torch.tensor(key_lens, dtype=torch.int32, device=DEV)
    cu_k, src, real = flash.key_layout(cu, kl, q.shape[0])
    n_keys = sum(key_lens)
    assert cu_k.dtype == torch.int32 and cu_k.tolist() == [sum(key_lens[:i]) for i in range(len(key_lens) + 1)]
    assert real.tolist() == [j < n_keys for j in range(q.shape[0])]
    starts = cu.tolist()
    assert src[:n_keys].tolist() == [starts[s] + p for s, n in enumerate(key_lens) for p in range(n)]
    assert bool((src[n_keys:] == 0).all())
    k2, v2 = k.index_select(0, src), v.index_select(0, src)
    out = torch.zeros_like(q)
    bounds = cu_k.tolist()
    for s in range(len(lengths)):
        rows, keys = slice(starts[s], starts[s + 1]), slice(bounds[s], bounds[s + 1])
        if keys.stop > keys.start:
            att = torch.einsum("qhd,khd->hqk", q[rows], k2[keys]) * 8 ** -0.5
            out[rows] = torch.einsum("hqk,khd->qhd", att.softmax(-1), v2[keys])
    check(out, q, k, v, cu, None, key_lens=kl)


def test_key_layout_counts_a_sequences_own_tokens_only():
    """A CUDA graph's static ``key_lens`` keeps the bucket's length (here 32) for the dummy sequences that fill it:
    the key rows stay within each sequence and within the tokens."""
    from packed_encoders.attention import flash

    cu = torch.tensor([0, 20, 40, 60, 128, 128, 128, 128, 128], dtype=torch.int32)  # 3 chunks, a 68-token dummy
    kl = torch.tensor([10, 10, 10, 32, 32, 32, 32, 32], dtype=torch.int32)
    cu_k, src, real = flash.key_layout(cu, kl, 128)
    assert cu_k.tolist() == [0, 10, 20, 30, 62, 62, 62, 62, 62]
    assert int(src.max()) < 128 and int(real.sum()) == 62


def test_keys_only_backward_drops_the_rows_past_the_last_key():
    """FlashAttention leaves the key / value gradients of rows past the last key unwritten; whatever they hold,
    nothing of them reaches token 0 (where those rows were gathered from)."""
    from packed_encoders.attention import flash

    q, k, v, cu, smax = packed([6, 12, 5], heads=2, head_dim=8, dtype=torch.float32)
    k, v = k.detach().clone().requires_grad_(True), v.detach().clone().requires_grad_(True)
    kl = torch.tensor([4, 12, 1], dtype=torch.int32, device=DEV)
    cu_k, k2, v2 = flash._keys_only(k, v, cu, kl, None)
    grad = torch.ones_like(k2)
    grad[17:] = float("nan")  # rows past the 17 keys
    torch.autograd.backward((k2, v2), (grad, grad))
    for g in (k.grad, v.grad):
        assert bool(g.isfinite().all())
        assert g[:4].eq(1).all() and g[4:6].eq(0).all() and g[6:18].eq(1).all() and g[18:19].eq(1).all()
        assert g[19:].eq(0).all()
    with pytest.raises(ValueError, match="window"):
        flash._keys_only(k, v, cu, kl, 64)


def test_varlen_takes_key_lens_on_global_layers_only():
    varlen = dataclasses.replace(BACKENDS["varlen"], availability=lambda: None)
    w = Workload(4, 100, 32, 12, 64, None, True, torch.bfloat16, "cuda", query_only=True)
    assert varlen.why_not(w) is None
    assert "global layers only" in varlen.why_not(dataclasses.replace(w, window=8))
    assert BACKENDS["sdpa"].why_not(dataclasses.replace(w, window=8)) is None


# ------------------------------------------------------------------------------------------------ triton kernel

SMALL = TileConfig(16, 16)  # small tiles: many tile boundaries on tiny inputs


def run(q, k, v, cu, smax, window, config=None):
    return triton_short_attention(q, k, v, cu, smax, window=window, scale=q.shape[-1] ** -0.5, config=config)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 8])
def test_triton_ragged_window_edges_and_empties(dtype, window):
    # w=8 stands for ModernBERT's 64: lengths w, w+1, 2w, 2w+1 are the 64/65/128/129 edges; tiles of 16 put
    # the edges on tile boundaries; empty sequences sit inside cu_seqlens; one row spans a sequence change.
    lengths = [8, 0, 9, 16, 17, 0, 0, 1, 33, 2]
    q, k, v, cu, smax = packed(lengths, dtype=dtype)
    check(run(q, k, v, cu, smax, window, SMALL), q, k, v, cu, window)


@needs_interpreter
@pytest.mark.parametrize("grid", ["stream", "seq"])
def test_triton_one_long_among_many_short(grid):
    lengths = [3, 1, 40, 5, 2]
    q, k, v, cu, smax = packed(lengths, heads=3)
    cfg = TileConfig(16, 16, heads_per_program=2, grid=grid)  # 3 heads, 2 per program: a masked head slot
    for window in ((None, 5) if grid == "stream" else (5,)):
        check(run(q, k, v, cu, smax, window, cfg), q, k, v, cu, window)


@needs_interpreter
@pytest.mark.parametrize("window", [None, 3])
def test_triton_key_lens(window):
    lengths, key_lens = [6, 20, 0, 5, 9], [4, 17, 0, 1, 2]
    q, k, v, cu, smax = packed(lengths)
    kl = torch.tensor(key_lens, dtype=torch.int32, device=DEV)
    out = triton_short_attention(q, k, v, cu, smax, window=window, scale=64 ** -0.5, key_lens=kl, config=SMALL)
    check(out, q, k, v, cu, window, key_lens=kl)


@needs_interpreter
def test_triton_single_sequence_all_ones_and_default_tiles():
    for lengths in ([37], [1] * 21):
        q, k, v, cu, smax = packed(lengths)
        check(run(q, k, v, cu, smax, None), q, k, v, cu, None)  # tile table (32 x 64)
    q, k, v, cu, smax = packed([37])
    check(run(q, k, v, cu, smax, 6), q, k, v, cu, 6)


@needs_interpreter
def test_triton_head_dim_128_and_loose_max_seqlen():
    q, k, v, cu, _ = packed([5, 20, 11], heads=1, head_dim=128, dtype=torch.float16)
    out = run(q, k, v, cu, 64, 4)  # max_seqlen is an upper bound: 64 > 20 changes the launch, not the result
    check(out, q, k, v, cu, 4)


@needs_interpreter
def test_triton_cross_sequence_isolation():
    lengths = [7, 12, 9]  # tiles of 16 straddle A|B and B|C
    q, k, v, cu, smax = packed(lengths)
    before = run(q, k, v, cu, smax, None, SMALL)
    b = slice(7, 19)
    q2, k2 = q.clone(), k.clone()
    q2[b].normal_()
    k2[b].mul_(-3.0)
    fused = v.new_empty(v.shape[0], 2, *v.shape[1:])
    v2 = fused[:, 1]
    v2.copy_(v)
    v2[b].normal_()
    after = run(q2, k2, v2, cu, smax, None, SMALL)
    for keep in (slice(0, 7), slice(19, 28)):
        assert torch.equal(before[keep], after[keep])
    assert not torch.equal(before[b], after[b])


@needs_interpreter
def test_triton_deterministic():
    q, k, v, cu, smax = packed([13, 30, 2])
    a = run(q, k, v, cu, smax, 5, SMALL)
    assert torch.equal(a, run(q, k, v, cu, smax, 5, SMALL))


@needs_interpreter
def test_triton_empty_batch_and_errors():
    q, k, v, cu, smax = packed([3, 4])
    empty = q[:0]
    assert run(empty, empty, empty, torch.zeros(1, dtype=torch.int32), 0, None).shape == (0, 2, 64)
    with pytest.raises(ValueError, match="dropout"):
        triton_short_attention(q, k, v, cu, smax, window=None, scale=0.1, dropout_p=0.1)
    with pytest.raises(ValueError, match="float16"):
        run(q.float(), k.float(), v.float(), cu, smax, None)
    with pytest.raises(ValueError, match="int32"):
        run(q, k, v, cu.long(), smax, None)
    with pytest.raises(ValueError, match="head_dim"):
        run(q[..., :32], k[..., :32], v[..., :32], cu, smax, None)
    with pytest.raises(ValueError, match="unit stride"):
        run(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu, smax, None)
    with pytest.raises(ValueError):
        TileConfig(24, 16)


def test_tile_table_keeps_compiled_variants_few():
    for head_dim in triton_short.HEAD_DIMS:
        per_kind = {local: {triton_short.tile_config(s, head_dim, local) for s in range(1, triton_short.MAX_SEQLEN + 1)}
                    for local in (False, True)}
        assert all(len(c) <= 3 for c in per_kind.values())
        assert len(per_kind[False] | per_kind[True]) <= 4
        for cfg in per_kind[False] | per_kind[True]:
            assert cfg.grid in ("stream", "seq") and cfg.block_m >= 16
    assert triton_short.tile_config(10 ** 6, 64, False) == triton_short.tile_config(triton_short.MAX_SEQLEN, 64, False)
    for name, make in triton_short.VARIANTS.items():
        assert isinstance(make(100, 64, True), TileConfig), name


def _w(**kw):
    base = dict(num_seqs=8, total_tokens=250, max_seqlen=64, heads=12, head_dim=64, window=None, grad=False,
                dtype=torch.bfloat16, device_type="cuda")
    return Workload(**(base | kw))


def test_triton_envelope_and_registration():
    assert BACKENDS["triton"].has_backward is False
    env = triton_short.envelope
    assert env(_w()) is None and env(_w(heads=7, head_dim=128, window=3)) is None
    assert "CUDA" in env(_w(device_type="cpu"))
    assert "fp16/bf16" in env(_w(dtype=torch.float32))
    assert "head_dim" in env(_w(head_dim=96))
    assert "envelope" in env(_w(max_seqlen=triton_short.MAX_SEQLEN + 1))
    assert env(_w(max_seqlen=triton_short.MAX_SEQLEN)) is None
    # local layers: the key span per tile is bounded by the window, so any max_seqlen is inside
    assert env(_w(max_seqlen=8192, window=64)) is None
    assert "window" in env(_w(max_seqlen=8192, window=triton_short.MAX_LOCAL_WINDOW + 1))
    assert "envelope" in env(_w(max_seqlen=8192, window=8191))  # a band covering every sequence is global


def test_import_does_not_import_triton():
    code = "import sys, packed_encoders; assert 'triton' in __import__('packed_encoders').attention.BACKENDS; " \
           "assert 'triton' not in sys.modules, 'triton imported at import time'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------------------ policy

def _cells(*pairs):
    return tuple(Cell(t, tuple(o)) for t, o in pairs)


def test_table_lookup_bounds():
    t = Table(False, "global", ((64, _cells((1000, ["a"]), (None, ["b"]))), (512, _cells((4096, ["c"]))),))
    assert t.order(_w(max_seqlen=64, total_tokens=1000)) == ("a",)
    assert t.order(_w(max_seqlen=1, total_tokens=1001)) == ("b",)
    assert t.order(_w(max_seqlen=65, total_tokens=10)) == ("c",)
    assert t.order(_w(max_seqlen=4096, total_tokens=10 ** 6)) == ("c",)  # past every bound: last row and cell


def test_policy_geometry_and_grad_tables():
    def table(grad, kind, name, heads=None, head_dim=None):
        return Table(grad, kind, ((None, _cells((None, [name]))),), heads, head_dim)

    p = Policy("p", (table(False, "global", "g12", 12, 64), table(False, "global", "g16", 16, 64),
                     table(False, "global", "generic"), table(False, "local", "l"), table(True, "global", "tg")))
    assert p.order(_w(heads=16)) == ("g16",)
    assert p.order(_w(heads=13)) == ("g12",)
    assert p.order(_w(heads=8, head_dim=128)) == ("generic",)
    assert p.order(_w(window=64)) == ("l",)
    assert p.order(_w(grad=True)) == ("tg",)
    assert p.order(_w(grad=True, window=64)) == ("l",)  # no grad table for local: the inference one
    assert Policy.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_graph_tables_serve_graph_captures_only():
    def table(kind, name, graph=False, heads=None):
        return Table(False, kind, ((None, _cells((None, [name]))),), heads, 64 if heads else None, graph)

    p = Policy("p", (table("global", "eager"), table("global", "graph", graph=True), table("local", "local")))
    assert p.order(_w()) == ("eager",)
    assert p.order(_w(graph=True)) == ("graph",)
    assert p.order(_w(graph=True, window=64)) == ("local",)  # no graph table for local: the eager one
    assert p.order(_w(grad=True, graph=True)) == ("graph",)  # training falls back to the inference tables
    assert p.order(_w(grad=True)) == ("eager",)
    only_graph = Policy("g", (table("global", "graph", graph=True),))
    assert only_graph.order(_w()) == DEFAULT_POLICY.order(_w())  # eager calls never read graph tables
    # a graph table of the nearest geometry beats none, an eager table of the exact geometry does not matter
    q = Policy("q", (table("global", "eager12", heads=12), table("global", "graph16", graph=True, heads=16)))
    assert q.order(_w(heads=12, graph=True)) == ("graph16",)
    data = p.to_dict()
    assert [t.get("graph", False) for t in data["tables"]] == [False, True, False]
    assert "graph" not in data["tables"][0]  # files without graph tables keep their old form
    assert Policy.from_dict(json.loads(json.dumps(data))) == p
    merged = Policy("base", (table("global", "old"), table("global", "stale", graph=True)), {"x": 1},
                    {"date": "a"}).with_graph_tables(Policy("new", p.tables, {}, {"date": "b"}))
    assert merged.order(_w()) == ("old",) and merged.order(_w(graph=True)) == ("graph",)
    assert merged.match == {"x": 1} and merged.meta["graph_tables"] == {"date": "b"}
    with pytest.raises(ValueError, match="no graph tables"):
        merged.with_graph_tables(Policy("none", (table("global", "e"),)))
    # graph tables replace those of their own kind only: a training-graph table stays under inference ones
    trained = Table(True, "global", ((None, _cells((None, ["trained"]))),), graph=True)
    kept = Policy("t", merged.tables + (trained,)).with_graph_tables(Policy("new", p.tables))
    assert kept.order(_w(grad=True, graph=True)) == ("trained",) and kept.order(_w(graph=True)) == ("graph",)


def test_graph_timed_sweep_fits_graph_tables_joined_to_a_base(tmp_path, capsys):
    rows = [r for r in synthetic_rows() if not r["grad"]]
    policy, report = calibrate.fit_policy(rows, graph=True)
    assert report["violations"] == [] and all(t.graph for t in policy.tables)
    base = Policy("base", (Table(False, "global", ((None, _cells((None, ["varlen"]))),)),),
                  {"device_name": "NVIDIA H200", "capability": [9, 0]}, {"date": "base"})
    base.save(tmp_path / "base.json")
    sweep = {"format": calibrate.SWEEP_FORMAT, "rows": rows,
             "meta": {"gpu": "NVIDIA H200", "capability": [9, 0], "date": "2026-12-01", "timing": "graph"}}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    out = tmp_path / "out.json"
    assert calibrate.main(["--from-sweep", str(tmp_path / "sweep.json"), "--merge", str(tmp_path / "base.json"),
                           "--out", str(out)]) == 0
    assert "joined to the eager tables of 'base'" in capsys.readouterr().out
    joined = Policy.load(out)
    assert joined.name.startswith("NVIDIA H200") and joined.meta["graph_tables"]["timing"] == "graph"
    assert joined.match == {"device_name": "NVIDIA H200", "capability": [9, 0]} and joined.meta["date"] == "base"
    assert joined.order(_w(max_seqlen=2048, total_tokens=65536)) == ("varlen",)  # eager: the base's table
    assert joined.order(_w(max_seqlen=64, total_tokens=256, graph=True))[0] == best_at(
        rows, window=None, heads=12, max_seqlen=64, total_tokens=256)
    # again without --merge: the file already at the output path is the base, its old graph tables replaced
    assert calibrate.main(["--from-sweep", str(tmp_path / "sweep.json"), "--out", str(out)]) == 0
    again = Policy.load(out)
    assert again.tables == joined.tables
    # an eager recalibration over that file keeps its graph tables
    eager = dict(sweep, meta=dict(sweep["meta"], timing="loop"), rows=synthetic_rows())
    (tmp_path / "eager.json").write_text(json.dumps(eager))
    assert calibrate.main(["--from-sweep", str(tmp_path / "eager.json"), "--out", str(out)]) == 0
    assert "kept the graph tables" in capsys.readouterr().out
    kept = Policy.load(out)
    assert [t for t in kept.tables if t.graph] == [t for t in joined.tables if t.graph]
    assert kept.meta["graph_tables"] == joined.meta["graph_tables"]  # the graph tables' provenance, not the base's
    assert any(t.grad for t in kept.tables) and not any(t.grad for t in joined.tables)
    # a graph recalibration over a base with training-graph tables keeps those (the sweep times inference only)
    trained = Policy("trained", kept.tables + (Table(True, "global", ((None, _cells((None, ["fa4"]))),),
                                                     graph=True),), kept.match, kept.meta)
    trained.save(out)
    assert calibrate.main(["--from-sweep", str(tmp_path / "sweep.json"), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    regraphed = Policy.load(out)
    assert regraphed.order(_w(grad=True, graph=True)) == ("fa4",)
    assert [t for t in regraphed.tables if t.graph and not t.grad] == [t for t in joined.tables if t.graph]
    assert "1 training-graph tables kept" in said
    # a graph-timed sweep without inference rows writes nothing
    (tmp_path / "train.json").write_text(json.dumps(dict(sweep, rows=[r for r in synthetic_rows() if r["grad"]])))
    assert calibrate.main(["--from-sweep", str(tmp_path / "train.json"), "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()
    # a family default as the base: the written file names the measured card, not the family
    family = tmp_path / "family.json"
    Policy("family", base.tables, {"capability_major": 9}).save(family)
    assert calibrate.main(["--from-sweep", str(tmp_path / "sweep.json"), "--merge", str(family),
                           "--out", str(tmp_path / "card.json")]) == 0
    assert Policy.load(tmp_path / "card.json").specificity("NVIDIA H100", (9, 0)) is None


def test_shipped_policies_and_card_matching(tmp_path):
    h200 = select_policy("NVIDIA H200", (9, 0), user_dir=tmp_path)
    assert h200.match.get("device_name") == "NVIDIA H200"
    assert h200.order(_w()) [0] == "triton"
    assert h200.order(_w(grad=True))[0] != "triton"
    # 8 documents: eager calls and graph captures take FA4 (its direct calls cost FlashAttention-2's host time)
    docs = dict(max_seqlen=1884, total_tokens=7600)
    assert h200.order(_w(**docs))[0] == "fa4" and h200.order(_w(graph=True, **docs))[0] == "fa4"
    assert h200.order(_w(graph=True, window=64, **docs))[0] == "triton"
    # training: eager steps and training graphs take FA4; many short queries FlashAttention-2
    step = dict(grad=True, max_seqlen=1884, total_tokens=15000)
    for window in (None, 64):
        assert h200.order(_w(window=window, **step))[0] == "fa4"
        assert h200.order(_w(window=window, graph=True, **step))[0] == "fa4"
        assert h200.order(_w(window=window, grad=True, max_seqlen=100, total_tokens=8000))[0] == "varlen"
        assert h200.order(_w(window=window, grad=True, max_seqlen=8192, total_tokens=40000))[0] == "fa4"
    h100 = select_policy("NVIDIA H100 80GB HBM3", (9, 0), user_dir=tmp_path)
    assert h100.match == {"capability_major": 9}
    # other Hopper cards take the H200's tables, eager and graph, until calibrated (its end-to-end adjustments,
    # FA4's direct calls and Triton for local layers, measured faster on an H100 too)
    assert h100.tables == h200.tables and any(t.graph for t in h100.tables)
    assert select_policy("NVIDIA A100-SXM4-40GB", (8, 0), user_dir=tmp_path).match == {"capability_major": 8}
    assert select_policy("NVIDIA GeForce RTX 5090", (12, 0), user_dir=tmp_path) is DEFAULT_POLICY
    for path in dispatch.SHIPPED_DIR.glob("*.json"):
        loaded = Policy.load(path)
        names = {n for t in loaded.tables for _, cells in t.rows for c in cells for n in c.order}
        assert names <= set(dispatch.CHOICES), path
        for t in loaded.tables:
            if t.grad:
                assert "triton" not in {n for _, cells in t.rows for c in cells for n in c.order}


def test_user_calibration_beats_shipped_and_explicit_wins(tmp_path):
    mine = Policy("mine", DEFAULT_POLICY.tables, {"device_name": "NVIDIA H200", "capability": [9, 0]})
    mine.save(tmp_path / "nvidia-h200-sm90.json")
    (tmp_path / "broken.json").write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select_policy("NVIDIA H200", (9, 0), user_dir=tmp_path).name == "mine"
    assert any("broken.json" in str(w.message) for w in caught)
    other = tmp_path / "explicit.json"
    Policy("explicit", DEFAULT_POLICY.tables, {"device_name": "Other"}).save(other)
    with pytest.warns(UserWarning, match="explicitly"):
        assert select_policy("NVIDIA H200", (9, 0), user_dir=tmp_path, explicit=str(other)).name == "explicit"
    with pytest.raises(PackedEncodersError, match="PACKED_ENCODERS_POLICY"):
        select_policy("NVIDIA H200", (9, 0), explicit=str(tmp_path / "broken.json"))


def test_cache_paths(monkeypatch, tmp_path):
    monkeypatch.setenv("PACKED_ENCODERS_CACHE", str(tmp_path))
    path = dispatch.user_policy_path("NVIDIA H200", (9, 0))
    assert path == tmp_path / "policies" / "nvidia-h200-sm90.json"
    assert dispatch.load_policy("cpu") is DEFAULT_POLICY
    # a policy file named for a CPU model is not read, and the policy's name (describe()) says so
    named = dispatch.load_policy("cpu", policy_file=str(tmp_path / "missing.json"))
    assert named.tables == DEFAULT_POLICY.tables and "missing.json not read" in named.name


@pytest.fixture
def all_available(monkeypatch):
    """Pretend every backend is installed (availability only: envelopes stay real), FlashAttention-4 in a release
    whose compiled kernels ``fa4_direct`` calls."""
    for name, b in list(BACKENDS.items()):
        monkeypatch.setitem(BACKENDS, name, dataclasses.replace(b, availability=lambda: None))
    monkeypatch.setattr(dispatch.fa4_direct, "version_status", lambda: None)


def test_resolve_explicit_raises_and_auto_reports(all_available, monkeypatch):
    with pytest.raises(PackedEncodersError, match="triton.*envelope"):
        resolve("triton", _w(max_seqlen=triton_short.MAX_SEQLEN + 1))
    with pytest.raises(PackedEncodersError, match="no backward"):
        resolve("triton", _w(grad=True))
    with pytest.raises(PackedEncodersError, match="not one of"):
        resolve("nope", _w())
    pol = Policy("t", tuple(Table(g, k, ((None, _cells((None, ["triton", "fa4", "varlen", "sdpa"]))),))
                            for g in (False, True) for k in ("global", "local")))
    assert resolve("auto", _w(), pol).backend == "triton"
    long = resolve("auto", _w(max_seqlen=4096, total_tokens=8192), pol)
    assert long.backend == "fa4" and "envelope" in long.reasons[0]
    trained = resolve("auto", _w(grad=True), pol)
    assert trained.backend == "fa4" and trained.reasons == []  # training skips triton by design, silently
    assert resolve("flash", _w(), pol).backend == "fa4"
    assert resolve("auto", _w(device_type="cpu", dtype=torch.float32), pol).backend == "sdpa"
    monkeypatch.setitem(BACKENDS, "varlen", dataclasses.replace(BACKENDS["varlen"], availability=lambda: "gone"))
    monkeypatch.setitem(BACKENDS, "fa4", dataclasses.replace(BACKENDS["fa4"], availability=lambda: "gone"))
    with pytest.raises(PackedEncodersError, match="flash"):
        resolve("flash", _w(), pol)


# ------------------------------------------------------------------------------------------------ calibrate

def test_lengths_for():
    for total, smax in ((256, 64), (8600, 128), (4096, 2048), (5, 5)):
        lens = calibrate.lengths_for(total, smax)
        assert sum(lens) == total and max(lens) == smax and min(lens) >= 1
        assert lens == calibrate.lengths_for(total, smax)
    with pytest.raises(ValueError):
        calibrate.lengths_for(10, 20)


def synthetic_rows(noise=0.0):
    """A card where triton wins short batches, varlen the middle, FA4 long ones; sdpa is always slow."""
    rows = []
    for grad in (False, True):
        for heads in (12, 16):
            for window in (None, 64):
                for smax in (64, 128, 512, 2048):
                    if window is not None and window >= smax - 1:
                        continue
                    for total in (256, 4096, 65536):
                        if total < smax:
                            continue
                        work = total * min(smax, 128 if window else smax) * heads / 1e7
                        times = {"sdpa": 0.5 + 10 * work, "varlen": 0.05 + 1.0 * work, "fa4": 0.09 + 0.6 * work}
                        if not grad:
                            times["triton"] = 0.02 + (0.5 if smax <= 128 else 3.0) * work
                        for b, t in times.items():
                            rows.append({"grad": grad, "window": window, "heads": heads, "head_dim": 64,
                                         "dtype": "bfloat16", "total_tokens": total, "max_seqlen": smax,
                                         "num_seqs": max(1, total // smax), "backend": b, "variant": None,
                                         "in_envelope": True, "ms": t * (1 + noise), "error": None})
    rows.append(dict(rows[0], backend="triton", in_envelope=False, ms=1e-6))  # outside the envelope: ignored
    rows.append(dict(rows[0], backend="triton", variant="m16", ms=1e-6))     # a variant: ignored
    rows.append(dict(rows[0], backend="fa4", ms=None, error="boom"))         # a failure: ignored
    return rows


def best_at(rows, **key):
    sel = [r for r in rows if all(r[k] == v for k, v in key.items()) and r["ms"] is not None
           and r["in_envelope"] and r["variant"] is None]
    return min(sel, key=lambda r: r["ms"])["backend"]


def test_fit_policy_picks_best_everywhere():
    rows = synthetic_rows()
    policy, report = calibrate.fit_policy(rows, name="synthetic")
    assert report["violations"] == [] and report["points"] > 0 and report["worst_ratio"] <= 1.05
    for key in ({"grad": False, "window": None, "heads": 12, "max_seqlen": 64, "total_tokens": 256},
                {"grad": False, "window": None, "heads": 16, "max_seqlen": 2048, "total_tokens": 65536},
                {"grad": True, "window": 64, "heads": 12, "max_seqlen": 512, "total_tokens": 4096}):
        w = _w(heads=key["heads"], max_seqlen=key["max_seqlen"], total_tokens=key["total_tokens"],
               window=key["window"], grad=key["grad"])
        assert policy.order(w)[0] == best_at(rows, head_dim=64, **key)
    assert all("triton" not in c.order for t in policy.tables if t.grad for _, cells in t.rows for c in cells)
    assert any(t.heads is None for t in policy.tables)  # a generic table for unmeasured geometries
    assert all(c.order[-1] == "sdpa" or "sdpa" in c.order for t in policy.tables for _, cs in t.rows for c in cs)
    again = Policy.from_dict(json.loads(json.dumps(policy.to_dict())))
    assert calibrate.evaluate(again, rows)["violations"] == []


def test_fit_merges_within_tolerance_and_reports_violations():
    # varlen within 3% of fa4 everywhere: one cell per row, not one per point
    rows = [r for r in synthetic_rows() if r["backend"] in ("varlen", "fa4") and not r["grad"]]
    for r in rows:
        if r["backend"] == "varlen" and r["ms"] is not None:
            fa4 = next(x for x in rows if x["backend"] == "fa4" and x["ms"] is not None and all(
                x[k] == r[k] for k in ("window", "heads", "max_seqlen", "total_tokens")))
            r["ms"] = fa4["ms"] * 1.03
    policy, report = calibrate.fit_policy(rows)
    assert report["violations"] == []
    assert all(len(cells) == 1 for t in policy.tables for _, cells in t.rows)
    wrong = Policy("wrong", tuple(Table(False, k, ((None, _cells((None, ["sdpa", "varlen"]))),))
                                  for k in ("global", "local")))
    bad = calibrate.evaluate(wrong, synthetic_rows())
    assert bad["violations"] and all(v["ratio"] > 1.05 for v in bad["violations"])
    assert "over 1.05x" in calibrate.report_markdown(bad, 0.05)


def test_from_sweep_cli_writes_a_loadable_policy(tmp_path, capsys):
    sweep = {"format": calibrate.SWEEP_FORMAT, "meta": {"gpu": "NVIDIA H200", "capability": [9, 0],
                                                          "date": "2026-12-01"}, "rows": synthetic_rows()}
    src, out = tmp_path / "sweep" / "sweep.json", tmp_path / "policy.json"
    src.parent.mkdir()
    src.write_text(json.dumps(sweep))
    assert calibrate.main(["--from-sweep", str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| max_seqlen" in printed and "policy pick vs best" in printed
    policy = Policy.load(out)
    assert policy.specificity("NVIDIA H200", (9, 0)) == 3
    assert select_policy("NVIDIA H200", (9, 0), user_dir=tmp_path).name == policy.name
    md = calibrate.triton_speedup_markdown(synthetic_rows()).split("\n")
    assert "speed-up" in md[0] and len(md) > 2 and all(line.endswith("x |") for line in md[2:])


@needs_interpreter
def test_sweep_point_and_parity_check_run_on_cpu(monkeypatch):
    # The sweep's per-point code (inputs, closures, grad, row shape) on the one backend CPU has; the clock
    # is replaced by one call of the closure.
    calls = []
    monkeypatch.setattr(calibrate, "time_ms", lambda fn, **kw: (calls.append(fn()), 1.0)[1])
    rows = calibrate._sweep_point(True, 2, 16, 4, 32, 96, torch.float32, torch.device("cpu"), "loop",
                                  {"sdpa", "triton"}, ("m16",), False)
    assert [(r["backend"], r["ms"], r["error"]) for r in rows] == [("sdpa", 1.0, None)]
    assert rows[0]["num_seqs"] >= 3 and rows[0]["total_tokens"] == 96 and len(calls) == 1
    assert calls[0][0].shape == (96, 3, 2, 16)  # d(qkv) from the grad closure
    rows = calibrate._sweep_point(False, 2, 16, None, 32, 96, torch.float32, torch.device("cpu"), "loop",
                                  {"sdpa"}, (), False)
    assert rows[0]["ms"] == 1.0 and rows[0]["grad"] is False
    assert calibrate.parity_check(["sdpa"], [(2, 16)], [None, 64], torch.float32, "cpu") == {}
    assert "torch" in calibrate.environment(None)


_AOT = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from packed_encoders.attention import triton_short_kernel, triton_short
from packed_encoders.ops.triton._runtime import compile_options
kernel = triton_short_kernel.packed_attn_fwd
jit = JITFunction(getattr(kernel, "fn", kernel))
pointers = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "CU": "*i32", "KL": "*i32", "qk_scale": "fp32"}
seen = set()
for smax, local, has_kl in ((64, False, True), (triton_short.MAX_SEQLEN, True, False), (128, True, True)):
    cfg = triton_short.tile_config(smax, 64, local)
    const = {"HEAD_DIM": 64, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
             "HEADS_PER_PROGRAM": cfg.heads_per_program, "LOCAL": local, "PER_SEQ": cfg.grid == "seq",
             "DOT_F32": False, "HAS_KL": has_kl}
    sig = {n: pointers.get(n, "constexpr" if n in const else "i32") for n in jit.arg_names}
    compiled = triton.compile(ASTSource(jit, sig, const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **compile_options()})
    assert "ex2.approx" in compiled.asm["ptx"]  # exp2 softmax
    seen.add(cfg)
print(len(seen))
"""


def test_kernel_compiles_for_sm90_without_a_gpu():
    # The interpreter accepts programs the compiler rejects (it once ran a kernel reading a non-constexpr
    # global): compile the table's launch shapes for Hopper ahead of time, no driver needed. In a fresh
    # process without TRITON_INTERPRET: the kernel module's @triton.jit functions take their form (compiled or
    # interpreted) when it is first imported, and this process imported it for the interpreted tests.
    pytest.importorskip("triton")
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) >= 2


@needs_interpreter
def test_triton_refuses_grad_and_custom_op_runs():
    q, k, v, cu, smax = packed([9, 4])
    with pytest.raises(ValueError, match="no backward"):
        run(q.clone().requires_grad_(True), k, v, cu, smax, None)
    with torch.no_grad():
        run(q.clone().requires_grad_(True), k, v, cu, smax, None)
    op = triton_short._custom_op()
    out = op(q, k, v, cu, smax, 3, 64 ** -0.5, None)
    assert torch.equal(out, run(q, k, v, cu, smax, 3))
    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake:
        shaped = op(*(fake.from_tensor(t) for t in (q, k, v, cu)), smax, None, 0.125, None)
    assert shaped.shape == q.shape and shaped.is_contiguous()


@pytest.mark.parametrize("value", ["0", "false", "off", ""])
def test_triton_on_cpu_needs_the_interpreter_switched_on(monkeypatch, value):
    # the switch reads as Triton's own knobs read it: "false" / "off" are off (not just "0")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    q, k, v, cu, smax = packed([9, 4])
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        run(q, k, v, cu, smax, None)


def test_load_policy_by_device_and_refreshes(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("PACKED_ENCODERS_CACHE", str(tmp_path))  # for user_policy_path (calibration's writer)
    cache = str(tmp_path)  # pack() passes its Tuning's cache_dir and policy_file; load_policy reads no variable
    cuda = torch.device("cuda", 0)
    assert dispatch.load_policy(cuda, cache=cache).match == {"device_name": "NVIDIA H200", "capability": [9, 0]}
    mine = Policy("calibrated here", DEFAULT_POLICY.tables, {"device_name": "NVIDIA H200", "capability": [9, 0]})
    mine.save(dispatch.user_policy_path("NVIDIA H200", (9, 0)))
    assert dispatch.load_policy(cuda, cache=cache).name == "calibrated here"  # seen at the next pack
    other = tmp_path / "other.json"
    Policy("explicit", DEFAULT_POLICY.tables, {"device_name": "NVIDIA H200"}).save(other)
    monkeypatch.setenv("PACKED_ENCODERS_POLICY", str(other))
    assert dispatch.load_policy(cuda, cache=cache).name == "calibrated here"  # not read here
    assert dispatch.load_policy(cuda, cache=cache, policy_file=str(other)).name == "explicit"


def test_benchmark_report_from_a_synthetic_sweep(monkeypatch, tmp_path, capsys):
    # benchmarks/attention.py's reporting (JSON, markdown, refitted policy) on synthetic timings; the GPU
    # parts (sweep, headline) are replaced.
    import pathlib
    import runpy

    bench = runpy.run_path(str(pathlib.Path(__file__).parents[1] / "benchmarks" / "attention.py"))
    meta = {"gpu": "NVIDIA H200", "capability": [9, 0], "torch": "x", "triton": "y", "flash_attn": "z",
            "cutlass_dsl": None, "git_sha": None, "timing": "loop", "date": "2026-12-01", "left_out": {}}
    fake_sweep = {"format": calibrate.SWEEP_FORMAT, "meta": meta, "rows": synthetic_rows()}
    main = bench["main"]
    g = main.__globals__
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(g, "headline", lambda timing, variants, log: [
        {"workload": "8 queries <= 64", "heads": 12, "head_dim": 64, "window": None, "total_tokens": 250,
         "max_seqlen": 64, "num_seqs": 8, "backend": b, "variant": v, "ms": ms, "error": None}
        for b, v, ms in (("varlen", None, 0.057), ("triton", "table", 0.03))])
    monkeypatch.setitem(g, "load_policy", lambda device: select_policy("NVIDIA H200", (9, 0), user_dir=tmp_path))
    monkeypatch.setattr(calibrate, "sweep", lambda *a, **k: json.loads(json.dumps(fake_sweep)))
    assert main(["--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "1.90x" in printed and "Refitted policy" in printed and "Shipped policy" in printed
    (result,) = tmp_path.glob("attention-nvidia-h200-sm90-*.json")
    data = json.loads(result.read_text())
    assert data["refit_report"]["violations"] == [] and data["shipped_policy"]["report"]["points"] > 0
    refit = Policy.load(tmp_path / "policy-nvidia-h200-sm90.json")
    assert calibrate.policy_from_sweep(data)[0].tables == refit.tables  # the JSON refits to the same policy


def test_torch_varlen_forward_saving_hands_its_backward_what_aten_pairs(monkeypatch):
    """The training stack's FlashAttention-2 pair (CUDA ops, faked here): the backward op receives the forward's
    inputs, output, log-sum-exp and RNG state, with the same sequence layout, scale and window."""
    from packed_encoders.attention import flash

    calls = {}
    out, lse, seed, offset = (torch.full((1,), float(i)) for i in range(4))

    def fwd(q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, **kw):
        calls["fwd"] = (q, k, v, cu_q, cu_k, max_q, max_k, p, causal, debug, kw)
        return out, lse, seed, offset, None

    def bwd(dout, q, k, v, o, l, cu_q, cu_k, max_q, max_k, p, causal, s, off, **kw):
        calls["bwd"] = (dout, q, k, v, o, l, cu_q, cu_k, max_q, max_k, p, causal, s, off, kw)
        return "dq", "dk", "dv"

    monkeypatch.setattr(flash, "_FLASH_FORWARD", fwd)
    monkeypatch.setattr(flash, "_FLASH_BACKWARD", bwd)
    q, k, v, cu, dout = (torch.zeros(1) for _ in range(5))
    a, saved = flash.torch_varlen_forward_saving(q, k, v, cu, 7, window=64, scale=0.125)
    assert a is out
    assert calls["fwd"][:10] == (q, k, v, cu, cu, 7, 7, 0.0, False, False)
    assert calls["fwd"][10] == {"scale": 0.125, "window_size_left": 64, "window_size_right": 64}
    assert flash.torch_varlen_backward(dout, saved) == ("dq", "dk", "dv")
    assert calls["bwd"][:14] == (dout, q, k, v, out, lse, cu, cu, 7, 7, 0.0, False, seed, offset)
    assert calls["bwd"][14] == {"scale": 0.125, "window_size_left": 64, "window_size_right": 64}
    flash.torch_varlen_forward_saving(q, k, v, cu, 7, window=None, scale=0.125)
    assert calls["fwd"][10]["window_size_left"] == -1  # global: no window
