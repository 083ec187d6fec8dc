"""The one-launch Triton unpad / scatter of the sync-free rectangular graphs, on CPU under the Triton
interpreter, against the PyTorch reference ``rectangular.device_unpad`` and against the eager forward."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

import packed_encoders as pe  # noqa: E402
from packed_encoders.adapters.state import get_state  # noqa: E402
from packed_encoders.graphs.buckets import rect_bucket_for  # noqa: E402
from packed_encoders.graphs.config import GraphConfig  # noqa: E402
from packed_encoders.graphs.rectangular import RectRunner, device_unpad, fused_unpad_available  # noqa: E402

from tests.helpers import VOCAB, padded_batch, tiny_model  # noqa: E402

from .test_graphs_sync_free import fwd  # noqa: E402

SF = GraphConfig(sync_free=True)


@pytest.fixture(scope="module")
def kernels():
    from packed_encoders.ops.triton import rect_unpad

    return rect_unpad


def _bufs(ids, mask, tt, b_b, s_b):
    """Static buffers as a RectRunner stages them: the call's block top-left, zeros elsewhere."""
    out = {k: torch.zeros(b_b, s_b, dtype=torch.long) for k in ("ids", "mask", "tt")}
    b, s = ids.shape
    out["ids"][:b, :s] = ids
    out["mask"][:b, :s] = mask
    if tt is not None:
        out["tt"][:b, :s] = tt
    out["row0"] = (torch.arange(b_b) * s_b)[:, None]
    out["cols"] = torch.arange(s_b)
    out["end"] = torch.full((1,), b_b * s_b)
    return out


CASES = [
    ([5, 17, 33, 2, 30], "mixed", 64, 8, None),
    ([0, 12, 0, 30], "left", 32, 4, None),
    ([64, 64, 1], "right", 64, 4, None),
    ([0, 0], "right", 32, 2, None),
    ([3, 9, 27], "mixed", 100, 4, "oov"),
    ([3, 9, 27], "mixed", 32, 4, "hole"),
    ([3, 9, 27], "mixed", 32, 4, "mask2"),
    ([3, 9, 27], "mixed", 32, 4, "tt"),
    ([3, 9, 27], "mixed", 32, 4, "negative"),
]


def _inputs(lengths, side, width, problem):
    ids, mask = padded_batch(lengths, side, pad_to=width)
    tt = None
    if problem == "oov":
        ids[2, mask[2].nonzero()[0, 0]] = VOCAB + 3
    elif problem == "negative":
        ids[1, mask[1].nonzero()[0, 0]] = -1
    elif problem == "hole":
        cols = mask[2].nonzero().flatten()
        mask[2, cols[len(cols) // 2]] = 0
    elif problem == "mask2":
        mask[0, mask[0].nonzero()[0, 0]] = 2
    elif problem == "tt":
        tt = torch.zeros_like(ids)
        tt[1, mask[1].nonzero()[-1, 0]] = 1
    return ids, mask, tt


@pytest.mark.parametrize("lengths,side,s_b,b_b,problem", CASES)
def test_unpad_and_scatter_match_the_reference(kernels, lengths, side, s_b, b_b, problem):
    ids, mask, tt = _inputs(lengths, side, min(s_b, max(lengths) + 3) if max(lengths) < s_b else s_b, problem)
    bufs = _bufs(ids, mask, tt, b_b, s_b)
    ref = device_unpad(bufs, s_b, VOCAB)
    stream_ids, cu, first, row_flags, kl = kernels.unpad(bufs["mask"], bufs["ids"], bufs["tt"], VOCAB,
                                                         key_lens=True)
    lens = ref["lens"]
    assert cu.dtype == torch.int32 and cu.tolist() == ref["cu"].tolist()
    assert kl.dtype == torch.int32 and kl.tolist() == ref["kl"].tolist()
    assert kl[0::2].tolist() == lens.tolist() and not kl[1::2].any()
    assert first[lens > 0].tolist() == ref["first"][lens > 0].tolist()
    assert row_flags.sum(0).tolist() == ref["flags"].tolist()
    # real tokens in order at the head of every row's block; padding rows hold in-vocabulary ids
    got_rows, ref_rows = stream_ids.view(b_b, s_b), ref["ids"].view(b_b, s_b)
    for row in range(b_b):
        n = int(lens[row])
        assert torch.equal(got_rows[row, :n], ref_rows[row, :n]), row
    assert int(stream_ids.min()) >= 0 and int(stream_ids.max()) < VOCAB

    hidden = torch.randn(b_b * s_b, 48)
    out, flags_sum = kernels.scatter(hidden, bufs["mask"], first, row_flags)
    assert flags_sum.tolist() == ref["flags"].tolist()
    if int(ref["flags"].sum()):
        assert torch.isnan(out).all()
        return
    expect = torch.where(ref["real"][..., None], hidden.index_select(0, ref["back"]).view(b_b, s_b, -1), 0.0)
    assert torch.equal(out, expect)


def test_scatter_keeps_the_dtype_and_bf16_bits(kernels):
    ids, mask = padded_batch([7, 30, 1], "mixed", pad_to=32)
    bufs = _bufs(ids, mask, None, 4, 32)
    _, _, first, flags, kl = kernels.unpad(bufs["mask"], bufs["ids"], bufs["tt"], VOCAB)
    assert kl is None
    ref = device_unpad(bufs, 32, VOCAB)
    hidden = torch.randn(4 * 32, 40).to(torch.bfloat16)
    out, _ = kernels.scatter(hidden, bufs["mask"], first, flags)
    expect = torch.where(ref["real"][..., None], hidden.index_select(0, ref["back"]).view(4, 32, -1), 0)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expect)


def _runner(model, shape, fused, dead_padding=None):
    return RectRunner(model, get_state(model), rect_bucket_for(SF, *shape, VOCAB), "sdpa", capture=False,
                      fused=fused, dead_padding=dead_padding)


@pytest.mark.parametrize("dead_padding", [None, True])
@pytest.mark.parametrize("lengths,side", [([5, 17, 33, 2, 30], "mixed"), ([0, 12, 0, 30], "left"), ([64, 1], "right")])
def test_fused_runner_matches_the_reference_runner_and_eager(lengths, side, dead_padding):
    model = pe.pack(tiny_model(), validate=False, attention_backend="sdpa")
    ids, mask = padded_batch(lengths, side)
    fused = _runner(model, ids.shape, True, dead_padding)
    plain = _runner(model, ids.shape, False, dead_padding)
    assert fused.fused and not plain.fused
    assert fused.dead_padding is plain.dead_padding is bool(dead_padding)  # sdpa: off unless asked
    with torch.no_grad():
        got, flags = fused.replay(ids, mask)
        ref, ref_flags = plain.replay(ids, mask)
        eager = fwd(model, ids, mask)
    assert flags.tolist() == ref_flags.tolist() == [0, 0, 0, 0]
    assert torch.equal(got, ref), "same layout, same kernels downstream: bit-identical"
    real = mask.bool()
    torch.testing.assert_close(got[real], eager[real], atol=2e-5, rtol=2e-5)


def test_fused_runner_flags_bad_input_and_recovers():
    model = pe.pack(tiny_model(), validate=False, attention_backend="sdpa")
    ids, mask = padded_batch([10, 20, 5], "mixed")
    ids[0, 3] = VOCAB
    runner = _runner(model, ids.shape, True)
    with torch.no_grad():
        got, flags = runner.replay(ids, mask)
        assert flags.tolist() == [0, 0, 1, 0] and torch.isnan(got).all()
        ids2, mask2 = padded_batch([10, 20, 5], "mixed", seed=7)
        good, flags = runner.replay(ids2, mask2)
    assert flags.tolist() == [0, 0, 0, 0] and not torch.isnan(good).any()


def test_fused_is_chosen_on_cuda_only():
    assert fused_unpad_available(torch.device("cpu")) is False


@pytest.mark.parametrize("lengths,query_only", [
    ([5, 17, 33], False), ([40] * 7, False), ([64, 64], False), ([1, 17, 33, 2, 64], False),
    ([3, 0, 9], True),  # key_lens staged for the real sequences only
])
def test_one_launch_staging_matches_the_torch_staging(lengths, query_only):
    """``ops.triton.stage`` writes exactly what the runner's five PyTorch staging ops write (interpreted)."""
    from packed_encoders.graphs.buckets import bucket_for
    from packed_encoders.graphs.runner import GraphRunner

    from .test_graphs_logic import batch_of

    model = tiny_model()
    pe.pack(model, validate=False)
    state = get_state(model)
    batch = batch_of(lengths)
    if query_only:
        batch = type(batch)(**{**batch.__dict__, "key_lens": torch.tensor(lengths, dtype=torch.int32)})
    bucket = bucket_for(GraphConfig(max_seqlen=64), batch.num_seqs, batch.total_tokens, batch.max_seqlen)
    assert bucket.seqs > batch.num_seqs  # dummy or empty sequences to write
    outs, bufs = [], []
    for fused in (False, True):
        runner = GraphRunner(model, state, bucket, "sdpa", capture=False, query_only=query_only, fused_stage=fused)
        runner.ids.fill_(7)
        runner.pos.fill_(3)  # padding rows keep what they held: staging must not touch them
        with torch.no_grad():
            outs.append(runner.replay(batch, torch.clone))
        bufs.append([runner.ids.clone(), runner.pos.clone(), runner.cu.clone()]
                    + ([runner.kl.clone()] if query_only else []))
    for a, b in zip(*bufs):
        assert torch.equal(a, b)
    assert torch.equal(outs[0], outs[1])


def test_staging_kernel_only_on_cuda():
    from packed_encoders.graphs.runner import fused_stage_available

    assert fused_stage_available(torch.device("cpu")) is False
