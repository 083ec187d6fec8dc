"""``batch.unpad``'s two-launch Triton path (``ops.triton.unpad``), on CPU under the Triton interpreter, against the
PyTorch path (its reference): same packed batch, same statistics, same errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

from packed_encoders import batch as B  # noqa: E402
from packed_encoders.errors import PackedEncodersError  # noqa: E402

VOCAB = 97


@pytest.fixture
def fused(monkeypatch):
    """Route unpad through the Triton path on CPU (the kernels run interpreted)."""
    from packed_encoders.ops.triton import unpad as tu

    monkeypatch.setattr(B, "_fused_unpad", lambda ids, emb, mask, tt, pos, b: tu.supported(mask, ids, tt, pos, b))


def _inputs(lengths, side="mixed", width=None, seed=0, mask_dtype=torch.long):
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(width or 0, max(lengths, default=0))
    ids = torch.randint(3, VOCAB, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "left" or (side == "mixed" and row % 2):
            mask[row, s - n:] = 1
        else:
            mask[row, :n] = 1
    return ids, mask.to(mask_dtype)


def _both(**kw):
    """``(fused PackedBatch or exception, torch PackedBatch or exception)``."""
    from packed_encoders.ops.triton import unpad as tu

    out = []
    for use in (True, False):
        orig = B._fused_unpad
        B._fused_unpad = (lambda ids, emb, mask, tt, pos, b: tu.supported(mask, ids, tt, pos, b)) if use else \
            (lambda *a: False)
        try:
            out.append(B.unpad(vocab_size=VOCAB, **kw))
        except PackedEncodersError as e:
            out.append(e)
        finally:
            B._fused_unpad = orig
    return out


def _same(a, b):
    if isinstance(b, Exception):
        assert isinstance(a, PackedEncodersError) and str(a) == str(b)
        return
    assert a.total_tokens == b.total_tokens and a.max_seqlen == b.max_seqlen and a.max_position == b.max_position
    assert a.padded_shape == b.padded_shape
    torch.testing.assert_close(a.cu_seqlens, b.cu_seqlens)
    torch.testing.assert_close(a.input_ids, b.input_ids)
    torch.testing.assert_close(a.position_ids.long(), b.position_ids.long())
    torch.testing.assert_close(a.indices, b.indices)
    if b.key_lens is None:
        assert a.key_lens is None
    else:
        torch.testing.assert_close(a.key_lens, b.key_lens)


@pytest.mark.parametrize("lengths, side, width", [
    ([5, 17, 33, 2, 30], "mixed", None), ([0, 12, 0, 30], "left", 32), ([64, 64, 1], "right", None),
    ([0, 0], "right", 8), ([1], "right", None), ([1500, 3, 2100], "mixed", None),  # > one 1,024-column block
])
@pytest.mark.parametrize("trailing", [False, True])
def test_matches_the_torch_path(lengths, side, width, trailing):
    ids, mask = _inputs(lengths, side, width)
    _same(*_both(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                 trailing_query_only=trailing))


@pytest.mark.parametrize("case", ["bool_mask", "int32_ids", "no_mask", "position_ids", "position_ids_row",
                                  "token_types", "strided"])
def test_input_variants(case):
    ids, mask = _inputs([7, 19, 4], "mixed", 24, seed=1)
    kw = dict(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None)
    if case == "bool_mask":
        kw["attention_mask"] = mask.bool()
    elif case == "int32_ids":
        kw["input_ids"] = ids.int()
    elif case == "no_mask":
        kw["attention_mask"] = None
    elif case == "position_ids":
        kw["position_ids"] = torch.randint(0, 500, ids.shape)
    elif case == "position_ids_row":
        kw["position_ids"] = torch.arange(24)[None] + 3  # [1, S], broadcast over rows
    elif case == "token_types":
        kw["token_type_ids"] = torch.zeros_like(ids)
    elif case == "strided":
        wide_ids, wide_mask = _inputs([7, 19, 4], "mixed", 48, seed=1)
        kw["input_ids"], kw["attention_mask"] = wide_ids[:, ::2], wide_mask[:, ::2]
    _same(*_both(**kw))


@pytest.mark.parametrize("problem, message", [
    ("mask2", "only 0 and 1"), ("hole", "holes inside"), ("oov", "outside the vocabulary"),
    ("negative_id", "outside the vocabulary"), ("tt", "token_type_ids"), ("negpos", "negative entries"),
])
def test_errors_match(problem, message):
    ids, mask = _inputs([5, 9, 12], "mixed", 16, seed=2)
    kw = dict(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None)
    if problem == "mask2":
        mask[0, 0] = 2
    elif problem == "hole":
        mask[2, 3] = 0
    elif problem == "oov":
        ids[1, -1] = VOCAB
    elif problem == "negative_id":
        ids[1, -2] = -1
    elif problem == "tt":
        kw["token_type_ids"] = torch.zeros_like(ids)
        kw["token_type_ids"][0, 1] = 1
    elif problem == "negpos":
        pos = torch.arange(16).repeat(3, 1)
        pos[1, -1] = -4
        kw["position_ids"] = pos
    fused, ref = _both(**kw)
    assert isinstance(ref, PackedEncodersError) and message in str(ref)
    _same(fused, ref)


def test_padding_ids_outside_the_vocabulary_are_ignored():
    ids, mask = _inputs([3, 6], "right", 8, seed=3)
    ids[mask == 0] = -100  # label-style padding: only real tokens are checked
    _same(*_both(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None))


def test_the_switch_and_the_cpu_default_use_the_torch_path(monkeypatch):
    ids, mask = _inputs([3, 6], "right", 8)
    assert not B._fused_unpad(ids, None, mask, None, None, 2)  # CPU tensors: the PyTorch ops
    # the switch (PACKED_ENCODERS_FUSED_UNPAD=0, read at pack() and passed as fused=False) never asks the kernels
    monkeypatch.setattr(B, "_fused_unpad", lambda *a: pytest.fail("fused=False consulted the Triton unpad"))
    ref = B.unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=VOCAB, fused=False)
    assert ref.cu_seqlens.tolist() == [0, 3, 9]


def test_float_masks_and_embeddings_stay_on_the_torch_path():
    from packed_encoders.ops.triton import unpad as tu

    ids, mask = _inputs([3, 6], "right", 8)
    assert not tu.supported(mask.float(), ids, None, None, 2)
    assert tu.supported(mask.bool(), ids, None, None, 2)
    assert not B._fused_unpad(None, torch.zeros(2, 8, 4), mask, None, None, 2)


@pytest.mark.parametrize("far, raises", [(None, False), (9, True), (13, False)])
def test_far_padding_is_counted_alike(far, raises):
    """``far_padding_stock`` (eager attention's half window): rows with real tokens padded more than that past them
    raise ``StockOnlyInput`` on both paths; rows without real tokens are not counted. Lengths 5 (left: no padding
    after), 9 and 3 (right: 7 and 13 past them) in a width of 16 with an empty row."""
    from packed_encoders.errors import StockOnlyInput

    ids, mask = _inputs([5, 0, 9, 3], "mixed", 16, seed=4)
    mask[0] = 0
    mask[0, 11:] = 1  # a left-padded row: nothing after its real tokens
    mask[2] = 0
    mask[2, :3] = 1  # right padding 13 past
    mask[1] = 0
    mask[3] = 0
    mask[3, :9] = 1  # right padding 7 past
    fused, ref = _both(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                       token_type_ids=None, trailing_query_only=True, far_padding_stock=far)
    if raises:
        assert isinstance(ref, StockOnlyInput) and "1 row(s)" in str(ref), ref
    else:
        assert not isinstance(ref, Exception), ref
    _same(fused, ref)


@pytest.mark.parametrize("lengths, side, padded_at_zero", [
    ([5, 9, 12], "right", 0), ([5, 9, 12], "left", 2), ([5, 9, 12], "mixed", 1), ([0, 9, 12], "right", 1),
    ([12, 12, 12], "left", 0),
])
def test_rows_padded_at_position_zero_are_counted_alike(lengths, side, padded_at_zero):
    """``column_zero_stock`` (a ``classifier_pooling="cls"`` head reads column 0): rows whose position 0 is padding
    (left-padded, or without real tokens) raise ``StockOnlyInput`` naming their count on both paths, counted at the
    one sync (the Triton path in its second kernel)."""
    from packed_encoders.errors import StockOnlyInput

    ids, mask = _inputs(lengths, side, 12, seed=5)
    fused, ref = _both(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                       token_type_ids=None, column_zero_stock=True)
    if padded_at_zero:
        assert isinstance(ref, StockOnlyInput) and f"pads position 0 of {padded_at_zero} row(s)" in str(ref), ref
    else:
        assert not isinstance(ref, Exception), ref
    _same(fused, ref)
    # the same batch without a head reading column 0: no count, no error
    fused, ref = _both(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                       token_type_ids=None)
    assert not isinstance(ref, Exception)
    _same(fused, ref)
