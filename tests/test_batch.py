"""Index work between padded and packed layouts is exact; bad input raises clearly."""

from __future__ import annotations

import pytest
import torch

from packed_encoders.batch import from_packed, unpad
from packed_encoders.errors import PackedEncodersError
from tests.helpers import padded_batch


def _unpad(ids, mask, **kw):
    return unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=kw.get("position_ids"),
                 token_type_ids=kw.get("token_type_ids"), vocab_size=kw.get("vocab_size", 211))


@pytest.mark.parametrize("side", ["right", "left", "mixed"])
def test_unpad_exact(side):
    lengths = [3, 0, 7, 1, 5]
    ids, mask = padded_batch(lengths, side=side, pad_to=9)
    b = _unpad(ids, mask)
    assert b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 3, 3, 10, 11, 16]
    assert b.max_seqlen == 7 and b.total_tokens == 16 and b.num_seqs == 5
    assert torch.equal(b.input_ids, ids[mask.bool()])
    assert b.position_ids.tolist() == [0, 1, 2] + list(range(7)) + [0] + list(range(5))
    padded = b.pad(b.input_ids[:, None].float())[..., 0]
    assert torch.equal(padded, torch.where(mask.bool(), ids, 0).float())


def test_pad_returns_a_tensor_of_its_own_not_a_view():
    """Stock's output is no view; FSDP2 warns about a returned view, and an in-place op on it drops the hook that
    all-gathers the weights before the backward (tests/test_distributed.py: the backward failed)."""
    ids, mask = padded_batch([3, 5], side="left", pad_to=6)
    b = _unpad(ids, mask)
    packed = torch.randn(b.total_tokens, 4, requires_grad=True)
    out = b.pad(packed)
    assert out._base is None and out.shape == (2, 6, 4)
    torch.testing.assert_close(out[mask.bool()], packed)
    assert not out[~mask.bool()].any()
    out.mul_(2).sum().backward()
    torch.testing.assert_close(packed.grad, torch.full_like(packed, 2.0))


def test_user_position_ids_are_gathered():
    ids, mask = padded_batch([2, 4], side="left")
    pos = torch.arange(4)[None].expand(2, 4) * 10
    b = _unpad(ids, mask, position_ids=pos)
    assert b.position_ids.tolist() == [20, 30, 0, 10, 20, 30]
    assert b.max_position == 31
    # one row of positions for the whole batch, [S] or [1, S], broadcast alike; a wrong shape is named as given
    for shared in (pos[0], pos[:1]):
        assert _unpad(ids, mask, position_ids=shared).position_ids.tolist() == b.position_ids.tolist()
    with pytest.raises(PackedEncodersError, match=r"shape \(3,\); expected \(2, 4\), \(1, 4\) or \(4,\)"):
        _unpad(ids, mask, position_ids=torch.arange(3))


@pytest.mark.parametrize("mutate, match", [
    (lambda ids, m: (ids, m.index_fill(1, torch.tensor([2]), 0)), "holes"),
    (lambda ids, m: (ids, m * 2), "only 0 and 1"),
    (lambda ids, m: (ids, m[:, :-1]), "shape"),
    (lambda ids, m: (ids.index_fill(1, torch.tensor([0]), 500), m), "outside the vocabulary"),
    (lambda ids, m: (ids.index_fill(1, torch.tensor([0]), -1), m), "outside the vocabulary"),
])
def test_bad_input(mutate, match):
    ids, mask = padded_batch([6, 6])
    ids, mask = mutate(ids, mask)
    with pytest.raises(PackedEncodersError, match=match):
        _unpad(ids, mask)


def test_oov_at_padding_is_fine_and_token_types():
    ids, mask = padded_batch([3, 6])
    ids[0, 5] = 10_000  # a padded slot
    _unpad(ids, mask)
    tt = torch.zeros_like(ids)
    _unpad(ids, mask, token_type_ids=tt)
    tt[1, 2] = 1
    with pytest.raises(PackedEncodersError, match="token_type_ids"):
        _unpad(ids, mask, token_type_ids=tt)


def test_from_packed_checks():
    ids = torch.arange(3, 13)
    ok = from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=torch.tensor([0, 4, 10]), max_seqlen=6,
                     position_ids=None, vocab_size=50)
    assert ok.position_ids.tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    for cu, mx, match in [([0, 4, 9], 6, "end at"), ([1, 4, 10], 6, "start at 0"), ([0, 6, 4, 10], 6, "non-decreasing"),
                          ([0, 4, 10], 5, "max_seqlen")]:
        with pytest.raises(PackedEncodersError, match=match):
            from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=torch.tensor(cu), max_seqlen=mx,
                        position_ids=None, vocab_size=50)
    for cu in (torch.tensor([0, 4.5, 10]), torch.tensor([[0, 4, 10]]), [0, 4, 10], torch.tensor([0, 4, 10],
                                                                                             dtype=torch.int16)):
        with pytest.raises(PackedEncodersError, match="cu_seqlens must be a 1-D int32 or int64 tensor"):
            from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=6, position_ids=None,
                        vocab_size=50)
    derived = from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=None, max_seqlen=None,
                          position_ids=torch.tensor([0, 1, 2, 0, 1, 0, 1, 2, 3, 4]), vocab_size=50)
    assert derived.cu_seqlens.tolist() == [0, 3, 5, 10] and derived.max_seqlen == 5


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.int32])
def test_narrow_integer_ids_are_widened_not_wrapped(dtype):
    """A vocabulary size past the ids' own range must not wrap in the checks (int8 ids against 211)."""
    ids, mask = padded_batch([3, 5])
    ids = ids % 100
    ref = _unpad(ids, mask)
    got = _unpad(ids.to(dtype), mask)
    assert got.input_ids.dtype in (torch.int32, torch.int64) and torch.equal(got.input_ids.long(), ref.input_ids)
    with pytest.raises(PackedEncodersError, match="outside the vocabulary"):
        _unpad(ids.to(dtype), mask, vocab_size=50)
    packed = from_packed(input_ids=ref.input_ids.to(dtype), inputs_embeds=None, cu_seqlens=ref.cu_seqlens,
                         max_seqlen=ref.max_seqlen, position_ids=None, vocab_size=211)
    assert torch.equal(packed.input_ids.long(), ref.input_ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_float_and_bool_ids_are_refused(dtype):
    ids, mask = padded_batch([3, 5])
    with pytest.raises(PackedEncodersError, match="integer tensor"):
        _unpad(ids.to(dtype), mask)
    with pytest.raises(PackedEncodersError, match="integer tensor"):
        from_packed(input_ids=ids.reshape(-1).to(dtype), inputs_embeds=None, cu_seqlens=None, max_seqlen=None,
                    position_ids=None, vocab_size=211)


@pytest.mark.parametrize("cu", [[0, 2**32 + 4, 10], [0, 4 - 2**32, 10], [0, 4, 2**32 + 10]])
def test_int64_cu_seqlens_are_checked_before_narrowing(cu):
    """int64 entries past int32 must not wrap into a valid-looking cu_seqlens ([0, 4, 10] here) and be accepted."""
    with pytest.raises(PackedEncodersError, match="cu_seqlens must start at 0"):
        from_packed(input_ids=torch.arange(3, 13), inputs_embeds=None, cu_seqlens=torch.tensor(cu, dtype=torch.int64),
                    max_seqlen=None, position_ids=None, vocab_size=50)
