"""Sharded indexing (packed_encoders.index) on two gloo ranks against one process, a killed rank resumed, and
sentence-transformers' multi-process encode pool with a packed model."""

from __future__ import annotations

import json
import os
import random
import re

import pytest
import torch

from packed_encoders.index import index_corpus, load_index, load_model, plan_chunks, token_batches
from tests.dist_helpers import init, spawn

CHUNK_TOKENS = 300
BATCH_TOKENS = 128


def test_plan_balances_tokens_not_items():
    lengths = [400] * 10 + [10] * 400  # the first items are long: an item split would give rank 0 most tokens
    chunks = plan_chunks(lengths, 500, 2)
    per_rank = [sum(c.tokens for c in chunks if c.rank == r) for r in range(2)]
    items = [sum(c.stop - c.start for c in chunks if c.rank == r) for r in range(2)]
    assert abs(per_rank[0] - per_rank[1]) <= 500, per_rank
    assert items[0] < items[1] / 10, items
    assert [c.start for c in chunks[1:]] == [c.stop for c in chunks[:-1]] and chunks[-1].stop == len(lengths)
    assert all(c.tokens <= 500 for c in chunks)
    assert [c.rank for c in chunks] == sorted(c.rank for c in chunks)  # contiguous runs


def test_corpus_lines_that_cannot_be_encoded_are_named_by_file_and_line(tmp_path):
    import packed_encoders as pe
    from packed_encoders.index import scan_corpus

    good = json.dumps({"id": "a", "input_ids": [1, 5, 2]})
    cases = (('{"id": "b", "input_ids": [1, 2', "not a JSON line"), ('[1, 2]', "needs 'id' and 'input_ids'"),
             (json.dumps({"id": "b", "input_ids": [1, 2.5, 3]}), "'b': input_ids must be a list of integers"),
             (json.dumps({"id": "b", "input_ids": 0}), "'b': input_ids must be a list of integers"),
             (json.dumps({"id": "b", "input_ids": None}), "'b': input_ids must be a list of integers"),
             (json.dumps({"id": "b", "input_ids": []}), "'b' has no tokens"),
             (json.dumps({"id": "b", "input_ids": [1, 99, 2]}), "'b': token id 99 is outside the model's vocabulary"),
             (json.dumps({"id": "b", "input_ids": [-3, 2]}), "'b': token id -3 is outside"))
    for line, message in cases:
        path = tmp_path / "corpus.jsonl"
        path.write_text(good + "\n" + line + "\n")
        with pytest.raises(pe.PackedEncodersError) as info:
            scan_corpus(str(path), vocab_size=50)
        assert f"{path}:2: " in str(info.value) and message in str(info.value), str(info.value)
    path.write_text(good + "\n" + json.dumps({"id": "b", "input_ids": [1, 99, 2]}) + "\n")
    assert scan_corpus(str(path))[1] == [3, 3]  # no vocabulary given: any non-negative ids


def test_token_batches_respect_the_budget():
    lengths = [5, 90, 33, 200, 7, 64, 64]
    batches = token_batches(lengths, 128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 128 or len(b) == 1 for b in batches)
    assert batches[0] == [3]  # longest first


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tests.tiny_tokenizer import save_tiny_model

    tmp = tmp_path_factory.mktemp("index")
    model_dir = save_tiny_model(tmp / "model")
    rng = random.Random(0)
    corpus = tmp / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(60):
            n = rng.choice([rng.randint(3, 12), rng.randint(40, 90)])
            f.write(json.dumps({"id": f"doc{i}", "input_ids": [1] + [rng.randint(5, 70) for _ in range(n)] + [2]})
                    + "\n")
    return tmp, model_dir, str(corpus)


def _single(model_dir, corpus, out, output, device="cpu"):
    import packed_encoders as pe

    model = pe.pack(load_model(model_dir, torch.device(device), torch.float32))
    index_corpus(model, corpus, out, output=output, chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS,
                 progress=False)
    return load_index(out)


def _index_worker(rank, world, rendezvous, model_dir, corpus, jobs, backend):
    import torch.distributed as dist

    import packed_encoders as pe

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    init(rank, world, rendezvous, backend)
    model = pe.pack(load_model(model_dir, device, torch.float32))

    def die(index, rows, tokens):
        os._exit(1)  # a rank killed right after its first chunk

    for out, output, kill in jobs:
        index_corpus(model, corpus, out, output=output, chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS,
                     on_chunk=die if kill and rank == world - 1 else None)
    dist.destroy_process_group()


def check_sharded_run(tmp, model_dir, corpus, world, backend):
    """``world`` ranks index the corpus (pooled), the last rank is killed after its first chunk, the run is
    resumed (and a flat-token index made): both equal one process row for row; finished chunks are not redone."""
    import torch.multiprocessing as mp

    pooled, tokens = str(tmp / f"pooled_{backend}"), str(tmp / f"tokens_{backend}")
    with pytest.raises(mp.ProcessExitedException):
        spawn(_index_worker, world, tmp, model_dir, corpus, [(pooled, "pooled", True)], backend)
    done = sorted(f for f in os.listdir(os.path.join(pooled, "chunks")) if f.endswith(".done"))
    plan = json.load(open(os.path.join(pooled, "plan.json")))
    assert 0 < len(done) < len(plan["chunks"]) and not os.path.exists(os.path.join(pooled, "manifest.json"))
    kept = {f: os.stat(os.path.join(pooled, "chunks", f)).st_mtime_ns for f in done}
    spawn(_index_worker, world, tmp, model_dir, corpus, [(pooled, "pooled", False), (tokens, "tokens", False)],
          backend)
    assert all(os.stat(os.path.join(pooled, "chunks", f)).st_mtime_ns == t for f, t in kept.items())  # not redone
    ranks = {json.load(open(os.path.join(pooled, "chunks", f)))["rank"]
             for f in os.listdir(os.path.join(pooled, "chunks")) if f.endswith(".done")}
    assert ranks == set(range(world))

    for out, output in ((pooled, "pooled"), (tokens, "tokens")):
        got = load_index(out)  # checks every id once, in corpus order
        ref = _single(model_dir, corpus, str(tmp / f"single_{output}_{backend}"), output,
                      "cuda" if backend == "nccl" else "cpu")
        assert got["ids"] == ref["ids"] and len(got["ids"]) == 60
        torch.testing.assert_close(got["embeddings"], ref["embeddings"], atol=1e-5, rtol=1e-5)
        if output == "tokens":
            assert torch.equal(got["cu_seqlens"], ref["cu_seqlens"])
            assert got["embeddings"].shape[0] == json.load(open(os.path.join(out, "manifest.json")))["tokens"]


def test_two_ranks_equal_one_process_after_a_kill(setup):
    check_sharded_run(*setup, world=2, backend="gloo")


def _disagree_worker(rank, world, rendezvous, model_dir, corpus, out_root):
    import torch.distributed as dist

    import packed_encoders as pe

    init(rank, world, rendezvous)
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    other = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    with torch.no_grad():
        other.layers[0].mlp.Wo.weight.mul_(1.01)
    errors = {}
    for name, theirs in (("pooling", dict(pooling="cls")), ("out_dtype", dict(out_dtype=torch.bfloat16)),
                         ("model", dict(model=other)), ("chunk_tokens", dict(chunk_tokens=CHUNK_TOKENS // 2))):
        kw = dict(model=model, output="pooled", chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
        kw.update(theirs if rank == world - 1 else {})
        try:
            index_corpus(corpus=corpus, out_dir=os.path.join(out_root, name), **kw)
            errors[name] = None
        except pe.PackedEncodersError as exc:
            errors[name] = str(exc)
    with open(os.path.join(out_root, f"errors-{rank}.json"), "w") as f:
        json.dump(errors, f)
    dist.destroy_process_group()


def test_ranks_given_other_settings_are_refused(setup, tmp_path):
    """A rank started with another model, pooling, output dtype or chunking wrote its chunks into rank 0's index
    (mixed vectors, no error) or left rank 0 waiting: every rank now raises one error naming the difference, and
    nothing is written."""
    _, model_dir, corpus = setup
    spawn(_disagree_worker, 2, tmp_path, model_dir, corpus, str(tmp_path))
    for rank in range(2):
        errors = json.load(open(tmp_path / f"errors-{rank}.json"))
        for name, message in errors.items():
            assert message and "not given the same indexing run" in message, (name, message)
            assert re.search(rf"rank 0 -> rank 1: {name}[.:]", message) and len(message) < 400, (name, message)
            assert not (tmp_path / name).exists()


def _other_out_worker(rank, world, rendezvous, model_dir, corpus, out_root):
    import torch.distributed as dist

    import packed_encoders as pe
    import packed_encoders.index as index

    index.MARKER_WAIT_S = 0.5  # (rank 1 looks for rank 0's marker that long before it gives up)
    init(rank, world, rendezvous)
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    try:  # each rank its own output directory: rank 1 cannot see the plan rank 0 writes
        index_corpus(model, corpus, os.path.join(out_root, f"out-{rank}"), chunk_tokens=CHUNK_TOKENS,
                     batch_tokens=BATCH_TOKENS, progress=False)
        error = None
    except pe.PackedEncodersError as exc:
        error = str(exc)
    with open(os.path.join(out_root, f"error-{rank}.json"), "w") as f:
        json.dump(error, f)
    dist.destroy_process_group()


def test_a_rank_that_cannot_see_rank_0s_plan_is_named(setup, tmp_path):
    """A rank given another output directory (or one on a file system the ranks do not share) failed alone with
    ``TypeError: 'NoneType' object is not subscriptable`` while rank 0 encoded its share and waited for it: every
    rank now raises one error naming the rank and what it found, and that rank writes nothing."""
    _, model_dir, corpus = setup
    spawn(_other_out_worker, 2, tmp_path, model_dir, corpus, str(tmp_path))
    for rank in range(2):
        message = json.load(open(tmp_path / f"error-{rank}.json"))
        assert message and "rank 1 does not see the plan rank 0 wrote" in message, message
        assert os.path.join(str(tmp_path), "out-1") + ": not the directory rank 0 writes" in message, message
        assert "all ranks share" in message, message
    assert not (tmp_path / "out-1").exists()
    assert not any(n.endswith(".pt") for n in os.listdir(tmp_path / "out-0" / "chunks"))
    assert not any(n.startswith(".rank0-") for n in os.listdir(tmp_path / "out-0"))  # the marker went


def test_a_rank_reading_a_copy_of_rank_0s_plan_is_named(setup, tmp_path):
    """A rank whose output directory holds a copy of the same plan (an earlier run's directory copied, or a stale
    mirror on an unshared file system) read it as rank 0's and encoded into it; the run then ended with "chunks not
    finished; run the command again" on every rerun. Rank 0's per-run marker tells the copy from the directory."""
    import shutil

    _, model_dir, corpus = setup
    _single(model_dir, corpus, str(tmp_path / "out-0"), "pooled")
    shutil.copytree(tmp_path / "out-0", tmp_path / "out-1")
    before = sorted(os.listdir(tmp_path / "out-1" / "chunks"))
    spawn(_other_out_worker, 2, tmp_path, model_dir, corpus, str(tmp_path))
    for rank in range(2):
        message = json.load(open(tmp_path / f"error-{rank}.json"))
        assert message and "rank 1 does not see the plan rank 0 wrote" in message, message
        assert "not the directory rank 0 writes" in message, message
    assert sorted(os.listdir(tmp_path / "out-1" / "chunks")) == before


def test_single_process_matches_stock_model(setup):
    """The index holds the stock model's mean-pooled vectors (the packed path is checked against HF elsewhere;
    this checks the batching, sorting and pooling around it)."""
    tmp, model_dir, corpus = setup
    got = _single(model_dir, corpus, str(tmp / "single_check"), "pooled")
    model = load_model(model_dir, torch.device("cpu"), torch.float32)
    with open(corpus) as f:
        items = [json.loads(line) for line in f][:7]
    for item, vec in zip(items, got["embeddings"]):
        ids = torch.tensor([item["input_ids"]])
        ref = model(input_ids=ids).last_hidden_state[0].mean(0)
        torch.testing.assert_close(vec, ref, atol=1e-5, rtol=1e-4)


def test_command_line_matches_the_api(setup, tmp_path):
    from packed_encoders.index import main

    tmp, model_dir, corpus = setup
    out = str(tmp_path / "cli")
    assert main(["--model", model_dir, "--corpus", corpus, "--out", out, "--output", "tokens",
                 "--chunk-tokens", str(CHUNK_TOKENS), "--batch-tokens", str(BATCH_TOKENS)]) == 0
    got = load_index(out)
    ref = _single(model_dir, corpus, str(tmp_path / "api"), "tokens")
    assert got["ids"] == ref["ids"] and torch.equal(got["cu_seqlens"], ref["cu_seqlens"])
    torch.testing.assert_close(got["embeddings"], ref["embeddings"], atol=1e-5, rtol=1e-5)


def test_resume_refuses_another_corpus(setup, tmp_path):
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"id": 1, "input_ids": [1, 5, 2]}) + "\n")
    out = str(tmp_path / "out")
    _single(model_dir, corpus, out, "pooled")
    with pytest.raises(pe.PackedEncodersError, match=r"another corpus.*-> this run: corpus: .* -> .*other\.jsonl"):
        _single(model_dir, str(other), out, "pooled")
    with pytest.raises(pe.PackedEncodersError, match=r"-> this run: chunk_tokens: \d+ -> 7; output: 'pooled' -> "
                                                     r"'tokens'\)"):
        index_corpus(pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32)), corpus, out,
                     output="tokens", chunk_tokens=7, progress=False)


def test_resume_refusal_says_the_corpus_was_modified_when_given_by_a_relative_path(setup, tmp_path, monkeypatch):
    """The plan records the corpus's absolute path: a corpus given relative to the working directory (as on the
    command line) and only modified since (same size, a new mtime) must be named as modified, not as another file."""
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    local = tmp_path / "corpus.jsonl"
    local.write_bytes(open(corpus, "rb").read())
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "out")
    _single(model_dir, "corpus.jsonl", out, "pooled")
    st = os.stat(local)
    os.utime(local, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(pe.PackedEncodersError, match=r"-> 'corpus\.jsonl' \(\d+ bytes, modified since\)"):
        _single(model_dir, "corpus.jsonl", out, "pooled")


def test_resume_refuses_other_settings_or_another_model(setup, tmp_path):
    """A resumed run must encode the missing chunks as the first run did: another model, pooling, output dtype or
    pad id is refused (naming what changed), never mixed into the index; the same settings resume."""
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    out = str(tmp_path / "out")
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    kw = dict(output="pooled", chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    index_corpus(model, corpus, out, **kw)
    first = sorted(os.listdir(os.path.join(out, "chunks")))
    os.remove(os.path.join(out, "chunks", next(f for f in first if f.endswith(".done"))))  # a chunk left to redo
    other = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    with torch.no_grad():
        other.layers[0].mlp.Wo.weight.mul_(1.01)
    for changed, m, extra in (("model", other, {}), ("pooling", model, dict(pooling="cls")),
                              ("out_dtype", model, dict(out_dtype=torch.bfloat16)), ("pad_id", model, dict(pad_id=3))):
        with pytest.raises(pe.PackedEncodersError, match=rf"other settings \(plan.json -> this run: {changed}[.:]"):
            index_corpus(m, corpus, out, **kw, **extra)
    index_corpus(pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32)), corpus, out, **kw)  # resumes
    assert sorted(os.listdir(os.path.join(out, "chunks"))) == first
    assert load_index(out)["embeddings"].shape[0] == json.load(open(os.path.join(out, "plan.json")))["items"]


def test_sentence_transformers_multi_process_pool(setup):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    import packed_encoders as pe
    from tests.tiny_tokenizer import TEXTS

    _, model_dir, _ = setup
    transformer = Transformer(model_dir)
    model = SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                device="cpu")
    ref = model.encode(TEXTS, batch_size=3, convert_to_tensor=True)
    pe.pack(model)
    got = model.encode(TEXTS, batch_size=3, device=["cpu", "cpu"], convert_to_tensor=True)
    assert pe.is_packed(model)
    torch.testing.assert_close(got.cpu(), ref, atol=1e-5, rtol=1e-4)


def test_encoder_reads_sentence_transformer_outputs(setup):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    import packed_encoders as pe
    from packed_encoders.index import Encoder

    _, model_dir, corpus = setup
    transformer = Transformer(model_dir)
    model = pe.pack(SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                        device="cpu"))
    with open(corpus) as f:
        items = [json.loads(line)["input_ids"] for line in f][:5]
    pooled, none = Encoder(model)(items)
    flat, counts = Encoder(model, output="tokens")(items)
    assert none is None and counts.tolist() == list(map(len, items))
    assert not Encoder(model).bare and flat.shape[0] == sum(map(len, items))
    for i, item in enumerate(items):
        out = model({"input_ids": torch.tensor([item]), "attention_mask": torch.ones(1, len(item), dtype=torch.long)})
        torch.testing.assert_close(pooled[i], out["sentence_embedding"][0], atol=1e-5, rtol=1e-4)
        start = sum(map(len, items[:i]))
        torch.testing.assert_close(flat[start:start + len(item)], out["token_embeddings"][0], atol=1e-5, rtol=1e-4)


def test_empty_corpus_bad_ids_and_sizes_are_refused(tmp_path):
    import packed_encoders as pe
    from packed_encoders.index import index_corpus, scan_corpus

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(pe.PackedEncodersError, match="no items"):
        scan_corpus(str(empty))
    for bad in ([1], None, True):
        path = tmp_path / "bad.jsonl"
        path.write_text(json.dumps({"id": bad, "input_ids": [5]}) + "\n")
        with pytest.raises(pe.PackedEncodersError, match="bad.jsonl:1: the id .* is not a string or an integer"):
            scan_corpus(str(path))
    out = tmp_path / "out"
    for kwargs in ({"batch_tokens": 0}, {"chunk_tokens": -5}):
        with pytest.raises(pe.PackedEncodersError, match=next(iter(kwargs))):
            index_corpus(torch.nn.Linear(1, 1), str(empty), str(out), **kwargs)
    with pytest.raises(pe.PackedEncodersError, match="no such corpus file"):
        index_corpus(torch.nn.Linear(1, 1), str(tmp_path / "missing.jsonl"), str(out))
    assert not out.exists()  # refused before anything was made


def test_a_damaged_chunk_is_encoded_again_on_resume(setup, tmp_path):
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    out = str(tmp_path / "out")
    _single(model_dir, corpus, out, "pooled")
    want = load_index(out)
    chunk = os.path.join(out, "chunks", "chunk-000001.pt")
    data = open(chunk, "rb").read()
    with open(chunk, "wb") as f:
        f.write(data[:100])  # truncated after the run finished
    with pytest.raises(pe.PackedEncodersError, match="chunk-000001.pt: 100 bytes, the manifest recorded"):
        load_index(out)
    with pytest.warns(UserWarning, match=r"chunks \[1\]: encoding them again"):
        _single(model_dir, corpus, out, "pooled")  # the resume finds the changed file and encodes the chunk again
    got = load_index(out)
    assert got["ids"] == want["ids"] and torch.equal(got["embeddings"], want["embeddings"])
    os.remove(chunk)
    with pytest.warns(UserWarning, match=r"chunks \[1\]: encoding them again"):
        _single(model_dir, corpus, out, "pooled")
    assert torch.equal(load_index(out)["embeddings"], want["embeddings"])


def test_a_resume_removes_the_partial_writes_of_a_killed_run(setup, tmp_path):
    tmp, model_dir, corpus = setup
    out = str(tmp_path / "out")
    _single(model_dir, corpus, out, "pooled")
    want = load_index(out)
    chunk = os.path.join(out, "chunks", "chunk-000001")
    os.remove(chunk + ".pt")  # killed while rank 1 wrote it: the file not renamed yet, nor the manifest
    leftovers = [chunk + ".pt.1.tmp", os.path.join(out, "manifest.json.tmp")]
    for path in leftovers:
        with open(path, "wb") as f:
            f.write(b"partial")
    with pytest.warns(UserWarning, match=r"chunks \[1\]: encoding them again"):  # its marker names a missing file
        _single(model_dir, corpus, out, "pooled")
    assert not any(os.path.exists(p) for p in leftovers)
    assert not [n for n in os.listdir(os.path.join(out, "chunks")) if n.endswith(".tmp")]
    assert torch.equal(load_index(out)["embeddings"], want["embeddings"])


def test_pooling_counts_only_where_it_shapes_the_vectors(setup, tmp_path):
    """Token vectors are not pooled: the plan records no pooling for them, and a ``pooling`` given for them (or
    for a sentence-transformers model, which pools as its own modules say) is refused as the command line refuses
    ``--pooling`` there, rather than ignored."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    out = str(tmp_path / "out")
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    kw = dict(chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    index_corpus(model, corpus, out, output="tokens", **kw)
    assert json.load(open(os.path.join(out, "plan.json")))["settings"]["pooling"] is None
    with pytest.raises(pe.PackedEncodersError, match="pooling='cls' has no effect here: token vectors"):
        index_corpus(model, corpus, out, output="tokens", pooling="cls", **kw)
    transformer = Transformer(model_dir)
    st = pe.pack(SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                                     device="cpu"))
    with pytest.raises(pe.PackedEncodersError, match="pooling='mean' has no effect here: a SentenceTransformer"):
        index_corpus(st, corpus, str(tmp_path / "st"), pooling="mean", **kw)
    assert not os.path.exists(tmp_path / "st")


def test_command_line_errors_exit_2_with_a_message(setup, tmp_path, capsys):
    from packed_encoders.index import main

    tmp, model_dir, corpus = setup
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["--model", model_dir, "--corpus", str(empty), "--out", str(tmp_path / "out")]) == 2
    assert "no items" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", model_dir, "--corpus", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "o2")])
    assert "no such file" in capsys.readouterr().err and not (tmp_path / "o2").exists()


def test_command_line_pooling_that_would_not_apply_is_refused(setup, tmp_path, capsys):
    """``--pooling`` given where it shapes nothing (a sentence-transformers folder pools as its own modules say;
    token vectors are not pooled) exits 2 naming why, rather than writing other vectors than asked for; left out,
    the same runs go through, and a bare checkpoint's pooled output takes it."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer

    from packed_encoders.index import main

    tmp, model_dir, corpus = setup
    st_dir = str(tmp_path / "st")
    transformer = Transformer(model_dir)
    SentenceTransformer(modules=[transformer, Pooling(transformer.get_embedding_dimension(), "mean")],
                        device="cpu").save(st_dir)
    for model, extra, why in ((st_dir, [], "pools as its own modules say"),
                              (model_dir, ["--output", "tokens"], "not pooled")):
        out = tmp_path / f"refused-{len(extra)}"
        with pytest.raises(SystemExit) as info:
            main(["--model", model, "--corpus", corpus, "--out", str(out), "--pooling", "cls", *extra])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "--pooling cls has no effect here" in err and why in err, err
        assert not out.exists()
        assert main(["--model", model, "--corpus", corpus, "--out", str(tmp_path / f"ok-{len(extra)}"), *extra]) == 0
    out = str(tmp_path / "cls")
    assert main(["--model", model_dir, "--corpus", corpus, "--out", out, "--pooling", "cls"]) == 0
    assert json.load(open(os.path.join(out, "plan.json")))["settings"]["pooling"] == "cls"


def _stop_after_chunk(stop_at):
    def stop(index, rows, tokens):
        if index == stop_at:
            raise KeyboardInterrupt  # the run stopped here (its finished chunks are kept)
    return stop


def test_resume_reads_the_corpus_it_was_given_not_the_first_path(setup, tmp_path):
    """A corpus renamed between a stopped run and its resume (same size and mtime: the check passes) is read from
    the path given now; the old path, which may hold another file, is not read (it gave silently wrong vectors)."""
    import shutil

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    first, renamed, out = tmp_path / "corpus.jsonl", tmp_path / "corpus_v1.jsonl", str(tmp_path / "out")
    shutil.copy2(corpus, first)
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    kw = dict(chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    with pytest.raises(KeyboardInterrupt):
        index_corpus(model, str(first), out, on_chunk=_stop_after_chunk(0), **kw)
    os.rename(first, renamed)
    first.write_text(renamed.read_text().translate(str.maketrans("56", "65")))  # same layout, other tokens
    index_corpus(model, str(renamed), out, **kw)
    got, ref = load_index(out), _single(model_dir, corpus, str(tmp_path / "ref"), "pooled")
    assert got["ids"] == ref["ids"]
    torch.testing.assert_close(got["embeddings"], ref["embeddings"], atol=1e-5, rtol=1e-5)


def test_resume_refuses_another_sentence_transformers_pipeline(setup, tmp_path):
    """Pooling and Normalize modules have no weights: a resume with another pipeline (Normalize added, another
    pooling mode) is refused instead of mixing normalised and raw vectors in one index."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    import packed_encoders as pe

    _, model_dir, corpus = setup

    def st(mode, normalize=False):
        transformer = Transformer(model_dir)
        modules = [transformer, Pooling(transformer.get_embedding_dimension(), mode)]
        return pe.pack(SentenceTransformer(modules=modules + ([Normalize()] if normalize else []), device="cpu"))

    out = str(tmp_path / "out")
    kw = dict(chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    with pytest.raises(KeyboardInterrupt):
        index_corpus(st("mean"), corpus, out, on_chunk=_stop_after_chunk(0), **kw)
    # the message names the differing module field, not both whole fingerprints
    for other, field in ((st("mean", normalize=True), r"model\.modules\[2\]: \(absent\) -> \['2', 'Normalize'"),
                         (st("cls"), r"model\.modules\[1\]\[2\]\.pooling_mode\w*: ")):
        with pytest.raises(pe.PackedEncodersError, match=rf"other settings \(plan.json -> this run: {field}") as info:
            index_corpus(other, corpus, out, **kw)
        assert len(str(info.value)) < 300 + len(out), str(info.value)
    index_corpus(st("mean"), corpus, out, **kw)  # the same pipeline resumes
    assert len(load_index(out)["ids"]) == 60


def test_a_refused_corpus_or_output_path_writes_nothing(setup, tmp_path, capsys):
    import packed_encoders as pe
    from packed_encoders.index import main

    _, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    bad = tmp_path / "dup.jsonl"
    bad.write_text(json.dumps({"id": 1, "input_ids": [1, 5]}) + "\n" + json.dumps({"id": 1, "input_ids": [6]}) + "\n")
    with pytest.raises(pe.PackedEncodersError, match="duplicate id 1"):
        index_corpus(model, str(bad), str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(pe.PackedEncodersError, match="cannot make the output directory"):
        index_corpus(model, corpus, str(afile), progress=False)
    assert main(["--model", model_dir, "--corpus", corpus, "--out", str(afile)]) == 2
    assert "cannot make the output directory" in capsys.readouterr().err


def test_a_pad_id_outside_the_vocabulary_is_refused_before_anything_is_written(setup, tmp_path, capsys):
    """Padding carries ``pad_id`` into the embedding wherever a call runs HF's own forward: an id outside the table
    (or not an integer) is refused up front, by the API and the command line, rather than failing mid-run."""
    import packed_encoders as pe
    from packed_encoders.index import main

    _, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    vocab = model.config.vocab_size
    for bad in (-1, vocab, 10 ** 9, 1.0, True, None):
        with pytest.raises(pe.PackedEncodersError, match=re.escape(f"pad_id={bad!r} is not a token id")):
            index_corpus(model, corpus, str(tmp_path / "out"), pad_id=bad, progress=False)
    assert not (tmp_path / "out").exists()
    assert main(["--model", model_dir, "--corpus", corpus, "--out", str(tmp_path / "o2"), "--pad-id", "-1"]) == 2
    assert f"pad_id=-1 is not a token id of the model's vocabulary [0, {vocab})" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()
    index_corpus(model, corpus, str(tmp_path / "ok"), pad_id=vocab - 1, progress=False)  # the last id is one


def test_blank_lines_between_items_are_skipped_when_encoding(setup, tmp_path):
    """scan_corpus skips blank lines; the chunk reader read consecutive lines from the chunk's first offset and
    so hit a blank line inside a chunk (JSONDecodeError after the plan was written)."""
    tmp, model_dir, corpus = setup
    spaced = tmp_path / "spaced.jsonl"
    spaced.write_text("\r\n   \n".join(open(corpus).read().splitlines()) + "\n\n")
    got = _single(model_dir, str(spaced), str(tmp_path / "out"), "pooled")
    ref = _single(model_dir, corpus, str(tmp_path / "ref"), "pooled")
    assert got["ids"] == ref["ids"]
    torch.testing.assert_close(got["embeddings"], ref["embeddings"], atol=1e-5, rtol=1e-5)


def test_a_corpus_edited_during_the_run_is_refused(setup, tmp_path):
    """An edit after the plan was made (tokens changed in place, same layout) used to be encoded into the later
    chunks silently, next to chunks of the first version, and the run finished with a manifest."""
    import shutil

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    copy = tmp_path / "corpus.jsonl"
    shutil.copy2(corpus, copy)
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))

    def edit(index, rows, tokens):
        if index == 0:
            copy.write_text(copy.read_text().translate(str.maketrans("56", "65")))
            st = os.stat(copy)
            os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a coarse-mtime file system sees it too

    with pytest.raises(pe.PackedEncodersError, match="changed while it was being indexed"):
        index_corpus(model, str(copy), str(tmp_path / "out"), chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS,
                     progress=False, on_chunk=edit)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_resume_refuses_the_same_weights_with_another_config(setup, tmp_path):
    """Same weights, another sliding window in config.json: other vectors, and the fingerprint (weights only) was
    equal, so a resume mixed the two."""
    import shutil

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    edited = tmp_path / "model"
    shutil.copytree(model_dir, edited)
    config = json.load(open(edited / "config.json"))
    config["local_attention"] = 2 * config["local_attention"]
    json.dump(config, open(edited / "config.json", "w"))
    out = str(tmp_path / "out")
    kw = dict(chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    with pytest.raises(KeyboardInterrupt):
        index_corpus(pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32)), corpus, out,
                     on_chunk=_stop_after_chunk(0), **kw)
    with pytest.raises(pe.PackedEncodersError, match=r"other settings .*: model\.config\.local_attention: 8 -> 16\)"):
        index_corpus(pe.pack(load_model(str(edited), torch.device("cpu"), torch.float32)), corpus, out, **kw)


def _index_recording(model, corpus, out):
    """Index ``corpus`` into ``out`` in this process; the indices of the chunks this run encoded."""
    encoded = []
    index_corpus(model, corpus, out, chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False,
                 on_chunk=lambda index, rows, tokens: encoded.append(index))
    return encoded


def test_a_same_size_replaced_or_flipped_chunk_is_encoded_again_on_resume(setup, tmp_path):
    """A finished chunk file replaced by another valid chunk of the same size (other vectors: a copy from another
    run of the same shape), or with one byte flipped in place, fails its SHA-256: load_index refuses it, and a resume
    encodes that chunk alone again (with a warning) and gives the clean run's index."""
    import hashlib

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    out = str(tmp_path / "out")
    assert len(_index_recording(model, corpus, out)) > 3
    want = load_index(out)
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    for entry in manifest["chunks"]:
        raw = open(os.path.join(out, entry["file"]), "rb").read()
        assert entry["bytes"] == len(raw) and entry["sha256"] == hashlib.sha256(raw).hexdigest()

    chunk = os.path.join(out, "chunks", "chunk-000002.pt")
    size = os.path.getsize(chunk)
    data = torch.load(chunk, weights_only=True)
    data["embeddings"] = data["embeddings"] + 1.0  # same shape, ids and dtype: same size, other vectors
    torch.save(data, chunk + ".0.tmp")  # the name a run writes it under (torch.save records it in the archive)
    os.replace(chunk + ".0.tmp", chunk)
    assert os.path.getsize(chunk) == size
    with pytest.raises(pe.PackedEncodersError, match="chunk-000002.pt: its contents differ from the SHA-256"):
        load_index(out)
    with pytest.warns(UserWarning, match=r"differ from their completion marker .*chunks \[2\]: encoding them again"):
        assert _index_recording(model, corpus, out) == [2]
    got = load_index(out)
    assert got["ids"] == want["ids"] and torch.equal(got["embeddings"], want["embeddings"])

    raw = bytearray(open(chunk, "rb").read())
    raw[len(raw) // 2] ^= 0x10  # bit rot, in place
    open(chunk, "wb").write(raw)
    with pytest.warns(UserWarning, match=r"chunks \[2\]"):
        assert _index_recording(model, corpus, out) == [2]
    assert torch.equal(load_index(out)["embeddings"], want["embeddings"])


def test_an_intact_resume_encodes_only_the_unfinished_chunks(setup, tmp_path):
    """A stopped run's finished chunks pass their digest check on resume and are not encoded again (files
    untouched), nor are any chunks of a finished index run again; no warning."""
    import warnings

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    out = str(tmp_path / "out")
    with pytest.raises(KeyboardInterrupt):
        index_corpus(model, corpus, out, chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False,
                     on_chunk=_stop_after_chunk(2))
    chunks = os.path.join(out, "chunks")
    kept = {f: os.stat(os.path.join(chunks, f)).st_mtime_ns for f in os.listdir(chunks)}
    assert sorted(kept) == [f"chunk-{i:06d}.{s}" for i in range(3) for s in ("done", "pt")]
    planned = len(json.load(open(os.path.join(out, "plan.json")))["chunks"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _index_recording(model, corpus, out) == list(range(3, planned))
        assert all(os.stat(os.path.join(chunks, f)).st_mtime_ns == t for f, t in kept.items())
        assert _index_recording(model, corpus, out) == []  # finished: nothing encoded again
        got = load_index(out)
    ref = _single(model_dir, corpus, str(tmp_path / "ref"), "pooled")
    assert got["ids"] == ref["ids"] and torch.equal(got["embeddings"], ref["embeddings"])


def test_a_marker_without_a_digest_is_not_trusted(setup, tmp_path):
    """The documented rule for a completion marker without ``sha256`` (an older version's, size alone): its chunk
    is encoded again, with a warning, and its new marker records the digest. A manifest without digests is loaded
    unchecked, with a warning."""
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    out = str(tmp_path / "out")
    _index_recording(model, corpus, out)
    want = load_index(out)
    for index in (1, 3):
        path = os.path.join(out, "chunks", f"chunk-{index:06d}.done")
        marker = json.load(open(path))
        del marker["sha256"]  # size still right
        json.dump(marker, open(path, "w"))
    older = r"2 completion marker\(s\) written by an older version .*chunks \[1, 3\]: encoding them again"
    with pytest.warns(UserWarning, match=older):
        assert _index_recording(model, corpus, out) == [1, 3]
    assert all("sha256" in json.load(open(os.path.join(out, "chunks", f"chunk-{i:06d}.done"))) for i in (1, 3))
    assert torch.equal(load_index(out)["embeddings"], want["embeddings"])

    manifest_path = os.path.join(out, "manifest.json")
    manifest = json.load(open(manifest_path))
    for entry in manifest["chunks"]:
        del entry["sha256"], entry["bytes"]
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.warns(UserWarning, match="records no SHA-256 for .* chunk file.*loaded unchecked"):
        got = load_index(out)
    assert torch.equal(got["embeddings"], want["embeddings"])


def test_a_chunk_with_another_chunks_file_and_marker_is_encoded_again(setup, tmp_path):
    """A chunk whose file and marker were both overwritten by another chunk's (a bad copy): the marker agrees with
    the file, but not with the plan's chunk (index, rows, tokens), so a resume encodes it again, with a warning.
    load_index names a chunk file holding other items than the plan's."""
    import hashlib
    import shutil

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    out = str(tmp_path / "out")
    _index_recording(model, corpus, out)
    want = load_index(out)
    chunk = os.path.join(out, "chunks", "chunk-")
    for suffix in ("pt", "done"):
        shutil.copy(f"{chunk}000002.{suffix}", f"{chunk}000001.{suffix}")
    with pytest.warns(UserWarning, match=r"describe another chunk .*chunks \[1\]: encoding them again"):
        assert _index_recording(model, corpus, out) == [1]
    assert torch.equal(load_index(out)["embeddings"], want["embeddings"])

    shutil.copy(f"{chunk}000002.pt", f"{chunk}000001.pt")  # and the manifest made to agree with the copy
    manifest_path = os.path.join(out, "manifest.json")
    manifest = json.load(open(manifest_path))
    raw = open(f"{chunk}000001.pt", "rb").read()
    manifest["chunks"][1].update(bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(pe.PackedEncodersError, match=r"\['chunks/chunk-000001.pt'\] hold other items than the plan"):
        load_index(out)


def test_markers_made_under_another_plan_are_not_trusted(setup, tmp_path):
    """plan.json deleted (or chunks/ copied into a new --out): a run with another model writes a new plan, and the
    old markers, made under another plan, are not trusted: every chunk is encoded again, with a warning, never mixed
    with the other model's. The same model and corpus keep them."""
    import shutil
    import warnings

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    other = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    with torch.no_grad():
        other.layers[0].mlp.Wo.weight.mul_(1.01)
    out, copy = str(tmp_path / "out"), str(tmp_path / "copy")
    planned = _index_recording(model, corpus, out)
    shutil.copytree(os.path.join(out, "chunks"), os.path.join(copy, "chunks"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _index_recording(model, corpus, copy) == []  # the same plan again: every chunk kept
    assert torch.equal(load_index(copy)["embeddings"], load_index(out)["embeddings"])

    os.remove(os.path.join(out, "plan.json"))
    with pytest.warns(UserWarning, match=r"written under another plan .*chunks \[0, 1, 2, "):
        assert _index_recording(other, corpus, out) == planned
    ref = str(tmp_path / "ref")
    _index_recording(other, corpus, ref)
    assert torch.equal(load_index(out)["embeddings"], load_index(ref)["embeddings"])


def test_a_missing_or_damaged_plan_or_manifest_is_named(setup, tmp_path):
    """A damaged manifest.json or a missing or damaged plan.json raised a raw JSONDecodeError / KeyError /
    FileNotFoundError from load_index and index_corpus: each now raises PackedEncodersError naming the file and the
    way out. A deleted plan is written again by the next run, which keeps the chunks made under the same plan."""
    import shutil

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    out = tmp_path / "out"
    _index_recording(model, corpus, str(out))
    want = load_index(str(out))
    for name, text, problem in (("manifest.json", "{", "not JSON"), ("manifest.json", "{}", "no chunks"),
                                ("manifest.json", '{"chunks": [1]}', "malformed chunk list"),
                                ("plan.json", None, "missing"), ("plan.json", "{", "not JSON"),
                                ("plan.json", '{"ids": []}', "no corpus, corpus_bytes")):
        damaged = tmp_path / "damaged"
        shutil.rmtree(damaged, ignore_errors=True)
        shutil.copytree(out, damaged)
        if text is None:
            os.remove(damaged / name)
        else:
            (damaged / name).write_text(text)
        with pytest.raises(pe.PackedEncodersError, match=f"{name}: .*{problem}.*run the indexing command on"):
            load_index(str(damaged))
        if name == "plan.json" and text is not None:
            with pytest.raises(pe.PackedEncodersError, match=f"{name}: .*{problem}.*deleting a damaged plan.json"):
                _index_recording(model, corpus, str(damaged))
    os.remove(damaged / "plan.json")  # as the message says
    assert _index_recording(model, corpus, str(damaged)) == []  # plan.json written again, every chunk kept
    assert torch.equal(load_index(str(damaged))["embeddings"], want["embeddings"])


def test_a_new_plan_removes_the_manifest_of_the_old_one(setup, tmp_path, monkeypatch):
    """plan.json deleted and a run with other settings stopped before its first chunk: load_index said nothing and
    returned the old run's vectors under the new plan. The new plan removes the old manifest (the run is then
    "not finished"), and a manifest written under another plan than plan.json's is refused."""
    import shutil

    import packed_encoders as pe
    from packed_encoders import index as ix

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    out = str(tmp_path / "out")
    _index_recording(model, corpus, out)
    finished = str(tmp_path / "finished")
    shutil.copytree(out, finished)
    os.remove(os.path.join(out, "plan.json"))

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ix, "_encode_chunk", stopped)
    with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="written under another plan"):
        index_corpus(model, corpus, out, pooling="cls", chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS,
                     progress=False)
    with pytest.raises(pe.PackedEncodersError, match="has no manifest.json: the indexing run has not finished"):
        load_index(out)
    shutil.copy(os.path.join(finished, "manifest.json"), os.path.join(out, "manifest.json"))  # put back by hand
    with pytest.raises(pe.PackedEncodersError, match="manifest.json was written for another plan.json"):
        load_index(out)


@pytest.mark.parametrize("key,value", [("sha256", None), ("sha256", "0" * 10), ("first_item", "0"), ("rows", None),
                                       ("rows", -1), ("file", 5), ("bytes", "12")])
def test_a_manifest_entry_of_another_type_is_named(setup, tmp_path, key, value):
    """A manifest chunk entry of another type than load_index reads (a null sha256 loaded the chunk unchecked; the
    others raised bare TypeErrors): PackedEncodersError naming the manifest."""
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    out = tmp_path / "out"
    _index_recording(pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32)), corpus, str(out))
    path = out / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["chunks"][0][key] = value
    path.write_text(json.dumps(manifest))
    with pytest.raises(pe.PackedEncodersError, match="manifest.json: a malformed chunk list"):
        load_index(str(out))


@pytest.mark.parametrize("out_dtype", [torch.int64, torch.bool, "float16"])
def test_an_out_dtype_that_is_not_a_floating_dtype_is_refused_before_anything_is_written(setup, tmp_path, out_dtype):
    """torch.int64 / torch.bool stored the vectors cast to integers, silently; a string failed inside .to() after
    plan.json was written."""
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    out = tmp_path / "out"
    with pytest.raises(pe.PackedEncodersError, match="out_dtype=.*expected a floating torch.dtype"):
        index_corpus(model, corpus, str(out), out_dtype=out_dtype, progress=False)
    assert not out.exists()



def test_a_model_left_in_train_mode_is_indexed_in_eval_mode_and_left_as_it_was(setup, tmp_path):
    """A model in train mode (an evaluation callback of a training loop) was indexed with its dropout on: vectors
    off the model's by a cosine of 0.94, silently. The run is in eval mode; every module keeps its own mode."""
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    model = load_model(model_dir, torch.device("cpu"), torch.float32)
    model.config.attention_dropout = model.config.mlp_dropout = model.config.embedding_dropout = 0.5
    model = pe.pack(type(model)(model.config).eval())
    model.load_state_dict(load_model(model_dir, torch.device("cpu"), torch.float32).state_dict())
    model.train()
    model.layers[1].eval()  # a caller's own choice for one module, kept
    modes = [m.training for m in model.modules()]
    out = str(tmp_path / "out")
    index_corpus(model, corpus, out, chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    assert [m.training for m in model.modules()] == modes
    got = load_index(out)["embeddings"]
    ref = _single(model_dir, corpus, str(tmp_path / "ref"), "pooled")["embeddings"]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_resume_refuses_a_model_whose_weights_keep_their_sum(setup, tmp_path):
    """The model fingerprint was the sum of the weights: a row permutation of one matrix (other vectors, same sum)
    resumed into the index, mixing two models' vectors."""
    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    out = str(tmp_path / "out")
    kw = dict(chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    with pytest.raises(KeyboardInterrupt):
        index_corpus(pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32)), corpus, out,
                     on_chunk=_stop_after_chunk(0), **kw)
    other = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    with torch.no_grad():
        w = other.layers[0].mlp.Wo.weight
        w.copy_(w.flip(0))
    with pytest.raises(pe.PackedEncodersError, match=r"other settings .*: model\.sha256: "):
        index_corpus(other, corpus, out, **kw)


def test_resume_refuses_a_corpus_rewritten_with_its_size_and_mtime(setup, tmp_path):
    """A corpus rewritten at the same size with its old modification time put back (cp -p, rsync -t, a restored
    backup) passed the size / mtime check: the resumed run encoded the new items next to chunks of the old ones."""
    import shutil

    import packed_encoders as pe

    tmp, model_dir, corpus = setup
    copy = tmp_path / "corpus.jsonl"
    shutil.copy2(corpus, copy)
    out = str(tmp_path / "out")
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    kw = dict(chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    with pytest.raises(KeyboardInterrupt):
        index_corpus(model, str(copy), out, on_chunk=_stop_after_chunk(0), **kw)
    st = os.stat(copy)
    copy.write_text(copy.read_text().translate(str.maketrans("56", "65")))  # same layout, other tokens
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(pe.PackedEncodersError, match=r"another corpus .*the size and modification time plan\.json "
                                                     r"records, other contents \(SHA-256\)"):
        index_corpus(model, str(copy), out, **kw)
    shutil.copy2(corpus, copy)  # the first version back: the run resumes
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    index_corpus(model, str(copy), out, **kw)
    got, ref = load_index(out), _single(model_dir, corpus, str(tmp_path / "ref"), "pooled")
    torch.testing.assert_close(got["embeddings"], ref["embeddings"], atol=1e-5, rtol=1e-5)


def test_load_index_names_a_path_that_is_not_a_directory(tmp_path):
    import packed_encoders as pe

    for path in (tmp_path / "missing", tmp_path / "file.jsonl"):
        if path.name.endswith(".jsonl"):
            path.write_text("{}\n")
        with pytest.raises(pe.PackedEncodersError, match="no such directory"):
            load_index(str(path))


def _multi_vector_model(model_dir, skiplist=()):
    """A sentence-transformers v6 multi-vector model (Transformer, a Dense to 16, MultiVectorMask), or a skip."""
    st = pytest.importorskip("sentence_transformers")
    if not hasattr(st, "MultiVectorEncoder"):
        pytest.skip("sentence-transformers has no MultiVectorEncoder (v6)")
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.base.modules.dense import Dense
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    torch.manual_seed(0)
    transformer = Transformer(model_dir)
    dense = Dense(transformer.get_embedding_dimension(), 16, bias=False, activation_function=torch.nn.Identity(),
                  module_input_name="token_embeddings", module_output_name="token_embeddings")
    return st.MultiVectorEncoder(modules=[transformer, dense, MultiVectorMask(skiplist_words=list(skiplist))],
                                 device="cpu")


def test_a_multi_vector_model_indexes_the_vectors_it_scores(setup, tmp_path, capsys):
    """Its folder loads as the multi-vector model it is (not converted to a SentenceTransformer, which drops the
    projection and scoring mask and adds a mean pooling); its token index holds, per item, the vectors
    ``encode_document`` returns (its skiplist left out); a pooled index, which it cannot give, is refused before
    anything is written."""
    from packed_encoders.index import main
    from tests.tiny_tokenizer import TEXTS

    import packed_encoders as pe

    _, model_dir, _ = setup
    model = _multi_vector_model(model_dir, skiplist=["the", "a", "of"])
    folder = str(tmp_path / "mv")
    model.save(folder)
    loaded = load_model(folder, torch.device("cpu"), torch.float32)
    assert type(loaded) is type(model) and [type(m) for m in loaded] == [type(m) for m in model]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": i, "input_ids": model.tokenizer(t)["input_ids"]}) + "\n"
                              for i, t in enumerate(TEXTS[:4])))
    want = model.encode_document(TEXTS[:4])
    assert sum(map(len, want)) < sum(len(model.tokenizer(t)["input_ids"]) for t in TEXTS[:4])  # some skipped
    out = str(tmp_path / "tokens")
    assert main(["--model", folder, "--corpus", str(corpus), "--out", out, "--output", "tokens"]) == 0
    got = load_index(out)
    for i, ref in enumerate(want):
        torch.testing.assert_close(got["embeddings"][got["cu_seqlens"][i]:got["cu_seqlens"][i + 1]], ref.float(),
                                   atol=1e-5, rtol=1e-4)
    pe.pack(loaded)
    with pytest.raises(pe.PackedEncodersError, match="'sentence_embedding' of the model's forward, which a "
                                                       "MultiVectorEncoder does not return"):
        index_corpus(loaded, str(corpus), str(tmp_path / "pooled"), progress=False)
    assert not (tmp_path / "pooled").exists()
    assert main(["--model", folder, "--corpus", str(corpus), "--out", str(tmp_path / "pooled")]) == 2
    assert "does not return" in capsys.readouterr().err and not (tmp_path / "pooled").exists()


def test_a_sentence_transformers_folder_of_another_model_type_is_refused(tmp_path, capsys):
    from packed_encoders.errors import PackedEncodersError
    from packed_encoders.index import main

    folder = tmp_path / "sparse"
    folder.mkdir()
    (folder / "modules.json").write_text("[]")
    (folder / "config_sentence_transformers.json").write_text(json.dumps({"model_type": "SparseEncoder"}))
    with pytest.raises(PackedEncodersError, match="holds a sentence-transformers 'SparseEncoder'"):
        load_model(str(folder), torch.device("cpu"), torch.float32)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": 0, "input_ids": [1, 5, 2]}) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["--model", str(folder), "--corpus", str(corpus), "--out", str(tmp_path / "out")])
    assert info.value.code == 2 and "SparseEncoder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_pylate_colbert_folder_loads_as_sentence_transformers_multi_vector_model(setup, tmp_path):
    """A PyLate ColBERT save (model type ``ColBERT``, PyLate's Dense) is a multi-vector model to
    sentence-transformers v6, which loads it with its scoring mask and normalisation: the index loads it so."""
    st = pytest.importorskip("sentence_transformers")
    _, model_dir, _ = setup
    model = _multi_vector_model(model_dir)
    folder = tmp_path / "colbert"
    st.MultiVectorEncoder(modules=[model[0], model[1]], device="cpu").save(str(folder))
    config = json.loads((folder / "config_sentence_transformers.json").read_text())
    (folder / "config_sentence_transformers.json").write_text(json.dumps({**config, "model_type": "ColBERT"}))
    modules = json.loads((folder / "modules.json").read_text())
    for m in modules:
        if m["type"].endswith("Dense"):
            m["type"] = "pylate.models.Dense.Dense"
    (folder / "modules.json").write_text(json.dumps(modules))
    want = st.MultiVectorEncoder(str(folder), device="cpu", local_files_only=True)
    got = load_model(str(folder), torch.device("cpu"), torch.float32)
    assert type(got) is type(want) and [type(m) for m in got] == [type(m) for m in want]


@pytest.mark.parametrize("text, why", [("{not json", "unreadable or not JSON"), ("[1]", "holds a list"),
                                       ('{"model_type": null}', "holds a sentence-transformers None")])
def test_a_malformed_sentence_transformers_config_is_named(tmp_path, capsys, text, why):
    from packed_encoders.index import main

    folder = tmp_path / "st"
    folder.mkdir()
    (folder / "modules.json").write_text("[]")
    (folder / "config_sentence_transformers.json").write_text(text)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": 0, "input_ids": [1, 5, 2]}) + "\n")
    with pytest.raises(SystemExit) as info:
        main(["--model", str(folder), "--corpus", str(corpus), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2 and why in err and "config_sentence_transformers.json" in err, err


def test_token_vectors_and_a_mask_of_other_lengths_are_refused_before_anything_is_written(setup, tmp_path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Transformer

    import packed_encoders as pe

    class Prefix(torch.nn.Module):  # adds a vector per item but leaves the mask as it was
        def forward(self, features):
            t = features["token_embeddings"]
            return {**features, "token_embeddings": torch.cat([t[:, :1], t], 1)}

    _, model_dir, corpus = setup
    model = pe.pack(SentenceTransformer(modules=[Transformer(model_dir), Prefix()], device="cpu"))
    with pytest.raises(pe.PackedEncodersError, match="token_embeddings of shape .* attention_mask of shape"):
        index_corpus(model, corpus, str(tmp_path / "out"), output="tokens", progress=False)
    assert not (tmp_path / "out").exists()


def _wrapped_worker(rank, world, rendezvous, model_dir, corpus, tmp):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import packed_encoders as pe
    from packed_encoders.errors import PackedEncodersError

    init(rank, world, rendezvous)
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    index_corpus(DistributedDataParallel(model), corpus, os.path.join(tmp, "ddp"), chunk_tokens=CHUNK_TOKENS,
                 batch_tokens=BATCH_TOKENS, progress=False)
    fully_shard(model)
    with pytest.raises(PackedEncodersError, match="sharded .*FSDP2.*needs the whole model"):
        index_corpus(model, corpus, os.path.join(tmp, "fsdp"), progress=False)
    assert not os.path.exists(os.path.join(tmp, "fsdp"))
    dist.destroy_process_group()


def test_wrapped_models_index_as_the_model_inside_and_sharded_ones_are_refused(setup, tmp_path):
    """A model in ``DistributedDataParallel``, ``DataParallel`` or ``torch.compile`` indexes as the model inside it
    (the same vectors and fingerprint: a run with the bare model resumes it as its own); one whose weights are
    FSDP2 shards is refused, naming why, before anything is written."""
    import packed_encoders as pe

    _, model_dir, corpus = setup
    ref = _single(model_dir, corpus, str(tmp_path / "bare"), "pooled")
    model = pe.pack(load_model(model_dir, torch.device("cpu"), torch.float32))
    for name, wrapped in (("compiled", torch.compile(model)), ("dp", torch.nn.DataParallel(torch.compile(model)))):
        out = str(tmp_path / name)
        index_corpus(wrapped, corpus, out, chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
        got = load_index(out)
        assert got["ids"] == ref["ids"]
        torch.testing.assert_close(got["embeddings"], ref["embeddings"], atol=1e-5, rtol=1e-5)
        index_corpus(model, corpus, out, chunk_tokens=CHUNK_TOKENS, batch_tokens=BATCH_TOKENS, progress=False)
    spawn(_wrapped_worker, 1, tmp_path, model_dir, corpus, str(tmp_path))
    torch.testing.assert_close(load_index(str(tmp_path / "ddp"))["embeddings"], ref["embeddings"], atol=1e-5,
                               rtol=1e-5)
