"""`unpad(remember=, reuse=)`: one call over the same, unchanged input tensors takes the earlier call's lengths
without the host sync (GradCache's second forward); anything that changed them, or a new tensor, reads them again."""

from __future__ import annotations

import gc
import threading
import warnings

import numpy as np
import pytest
import torch

import packed_encoders as pe
from packed_encoders.batch import LENGTHS, LengthsMemo, unpad
from packed_encoders.errors import PackedEncodersError, StockOnlyInput
from tests.helpers import padded_batch, tiny_model


@pytest.fixture(autouse=True)
def _fresh_memo():
    LENGTHS.clear()
    yield
    LENGTHS.clear()


@pytest.fixture
def syncs(monkeypatch):
    """How many ``Tensor.tolist`` calls (the unpad's one sync) ran."""
    count = [0]
    original = torch.Tensor.tolist

    def counted(self):
        count[0] += 1
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    return count


def _unpad(ids, mask, remember=True, reuse=True, **kw):
    return unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=kw.pop("position_ids", None),
                 token_type_ids=None, vocab_size=kw.pop("vocab_size", 211), remember=remember, reuse=reuse, **kw)


def _same(a, b):
    assert (a.max_seqlen, a.max_position, a.total_tokens, a.padded_shape) == \
        (b.max_seqlen, b.max_position, b.total_tokens, b.padded_shape)
    for name in ("input_ids", "cu_seqlens", "position_ids", "indices", "key_lens"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), name


def test_views_sliced_again_at_the_same_offsets_reuse_the_lengths(syncs):
    """PyLate / sentence-transformers slice each chunk from the batch's features in both passes: new view objects
    over the same memory. An entry serves one call."""
    ids, mask = padded_batch([3, 7, 1, 5, 2, 6], side="right", pad_to=8)
    first = _unpad(ids[2:5], mask[2:5], reuse=False)
    assert syncs[0] == 1
    again = _unpad(ids[2:5], mask[2:5], remember=False)
    assert syncs[0] == 1 and again.lengths_reused and not first.lengths_reused  # no sync
    _same(again, first)
    assert not _unpad(ids[2:5], mask[2:5], remember=False).lengths_reused and syncs[0] == 2  # used up
    other = _unpad(ids[0:3], mask[0:3])  # another chunk of the same batch: its own lengths
    assert syncs[0] == 3 and other.cu_seqlens.tolist() == [0, 3, 10, 11]


def _cut(m):
    m[1, 4:] = 0


def _cut_no_grad(m):
    with torch.no_grad():
        _cut(m)


def _cut_inference(m):
    with torch.inference_mode():
        _cut(m)


EDITS = {  # each shortens row 1 of a [4, 12] mask to 4 tokens, in place
    "setitem": _cut,
    "no_grad": _cut_no_grad,
    "inference_mode": _cut_inference,
    "out=": lambda m: torch.mul(m, (torch.arange(12) < 4) | (torch.arange(4)[:, None] != 1), out=m),
    "masked_fill_": lambda m: m.masked_fill_((torch.arange(12) >= 4) & (torch.arange(4)[:, None] == 1), 0),
    "index_put_": lambda m: m.index_put_((torch.tensor([1]), torch.arange(4, 12)), torch.tensor(0)),
    "transposed_view_copy_": lambda m: m.t()[4:, 1].copy_(torch.zeros(8, dtype=m.dtype)),
    "_foreach_copy_": lambda m: torch._foreach_copy_([m[1]], [torch.tensor([1] * 4 + [0] * 8)]),
}


@pytest.mark.parametrize("edit", EDITS.values(), ids=EDITS.keys())
def test_in_place_edits_are_seen(edit):
    ids, mask = padded_batch([5, 9, 3, 12], pad_to=12)
    _unpad(ids[1:3], mask[1:3])
    edit(mask)
    b = _unpad(ids[1:3], mask[1:3])
    assert not b.lengths_reused and b.cu_seqlens.tolist() == [0, 4, 7]


@pytest.mark.parametrize("edit", ["numpy", "data"])
def test_writes_without_a_version_bump_are_not_seen_by_the_memo(edit):
    """The documented limit (``LengthsMemo``): a write that bumps no version counter. Hence entries only from
    no-grad calls in train mode, read by calls with gradients, once. On the CPU reading the device facts costs no
    sync, so the reused ones are checked against them: a clear error instead of a stale layout."""
    ids, mask = padded_batch([5, 9, 3, 12], pad_to=12)
    _unpad(ids, mask)
    version = mask._version
    (mask.numpy() if edit == "numpy" else mask.data)[1, 4:] = 0
    assert mask._version == version
    with pytest.raises(PackedEncodersError, match="PACKED_ENCODERS_UNPAD_REUSE=0"):
        _unpad(ids, mask)


def test_a_stale_layout_stays_inside_its_buffers():
    """On CUDA nothing is read back: a reused call's device layout (here one whose mask changed since, written
    without a version bump) is made to agree with the remembered lengths, so every kernel after it reads and writes
    inside its buffers and tables (wrong values, not an index past them)."""
    from packed_encoders.attention.sdpa import sdpa_varlen
    from packed_encoders.batch import _in_bounds

    # cu_seqlens come from the remembered lengths, whatever the device computed (its mask may have grown or shrunk)
    ids = torch.tensor([4, -3, 900, 7] + [1] * 27)         # 31 rows (B * S + 1), some never written (garbage)
    positions = torch.arange(31) * 5 - 20
    indices = torch.arange(31) * 3 - 2
    key_lens = torch.tensor([9, 1, 25], dtype=torch.int32)
    # remembered: lengths 5, 3, 4 (12 tokens), positions below 6, a [3, 10] call, vocabulary 100
    got_cu, got_ids, got_pos, got_idx, got_kl = _in_bounds([5, 3, 4], 6, 100, 30, torch.device("cpu"), ids,
                                                           positions, indices, key_lens)
    assert got_cu.dtype == torch.int32 and got_cu.tolist() == [0, 5, 8, 12]
    assert got_ids.shape == (12,) and int(got_ids.min()) >= 0 and int(got_ids.max()) < 100
    assert int(got_pos.min()) >= 0 and int(got_pos.max()) < 6 and got_pos.shape == (12,)
    assert int(got_idx.min()) >= 0 and int(got_idx.max()) < 30 and got_idx.shape == (12,)
    assert got_kl.tolist() == [5, 1, 4]
    assert ids[1] == -3 and positions[0] == -20  # the streams themselves are not written
    q = torch.randn(12, 2, 8)
    for window in (None, 1):  # the attention after it stays in its rows
        assert sdpa_varlen(q, q, q, got_cu, 5, window=window, scale=0.3, key_lens=got_kl).shape == q.shape
    same = _in_bounds([5, 3, 4], 6, 100, 30, torch.device("cpu"), got_ids, got_pos, got_idx, got_kl)
    assert all(torch.equal(a, b) for a, b in zip(same, (got_cu, got_ids, got_pos, got_idx, got_kl)))


def test_an_in_place_change_reads_the_lengths_again(syncs):
    ids, mask = padded_batch([3, 7], side="right", pad_to=8)
    _unpad(ids, mask)
    mask[1, 6:] = 0  # through the tensor: its version counter moves
    b = _unpad(ids, mask)
    assert syncs[0] == 2 and b.cu_seqlens.tolist() == [0, 3, 9]
    base_ids = ids.clone()
    view = base_ids[:, :8]
    _unpad(view, mask)
    base_ids[0, 0] = 500  # through the base: a view shares its version counter; id 500 is out of the vocabulary
    with pytest.raises(PackedEncodersError, match="outside the vocabulary"):
        _unpad(base_ids[:, :8], mask)


def test_a_new_tensor_is_not_mistaken_for_a_freed_one():
    """The memo holds its tensors weakly: once the owner of the memory is gone, an entry is never read again (the
    caching allocator may hand the same address to the next tensor)."""
    ids, mask = padded_batch([3, 7], side="right", pad_to=8)
    flags = (None, 211, False, False, False, False, None)  # unpad's defaults, as _unpad passes them
    _unpad(ids, mask)
    sig, owners = LengthsMemo.key((ids, mask, None, None), flags)
    assert LENGTHS.take(sig, owners) is not None  # the key is the one unpad stored
    _unpad(ids, mask)
    assert len(LENGTHS) == 1
    del ids, mask, owners
    gc.collect()
    ids2, mask2 = padded_batch([4, 4], side="right", pad_to=8)
    assert LENGTHS.take(sig, (ids2, mask2)) is None  # whatever sits at those addresses now is another object


def test_a_large_gradcache_step_reuses_its_chunks():
    """More chunk-columns than a small memo would hold (384 here): the no-grad pass stores them in order, the pass
    with gradients takes them in the same order."""
    mini, chunks = 2, 192
    columns = [padded_batch([3 + i % 9 for i in range(mini * chunks)], pad_to=12, seed=c) for c in range(2)]
    calls = [(i[a:a + mini], m[a:a + mini]) for i, m in columns for a in range(0, mini * chunks, mini)]
    for i, m in calls:
        _unpad(i, m, reuse=False)
    assert sum(_unpad(i, m, remember=False).lengths_reused for i, m in calls) == len(calls)


def test_threads_editing_their_own_batches_never_see_stale_lengths():
    errors = []

    def worker(k):
        g = torch.Generator().manual_seed(k)
        ids, mask = padded_batch([3, 9, 4, 12], pad_to=12, seed=k)
        for _ in range(50):
            row, n = int(torch.randint(0, 4, (1,), generator=g)), int(torch.randint(1, 13, (1,), generator=g))
            mask[row] = 0
            mask[row, :n] = 1
            _unpad(ids, mask)
            b = _unpad(ids[1:3], mask[1:3])
            if b.cu_seqlens.diff().tolist() != mask[1:3].sum(1).tolist():
                errors.append(k)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize("flags", [dict(reuse=False), dict(remember=False)])
def test_either_flag_off_syncs_every_call(syncs, flags):
    ids, mask = padded_batch([3, 7], side="right", pad_to=8)
    _unpad(ids, mask, **flags)
    _unpad(ids, mask, **flags)
    assert syncs[0] == 2


def test_options_are_part_of_the_key(syncs):
    ids, mask = padded_batch([3, 7], side="right", pad_to=8)
    plain = _unpad(ids, mask)
    trailing = _unpad(ids, mask, trailing_query_only=True)
    assert syncs[0] == 2 and trailing.total_tokens == 16 and plain.total_tokens == 10
    with pytest.raises(PackedEncodersError, match="outside the vocabulary"):
        _unpad(ids, mask, vocab_size=100)  # ids drawn below 211; a smaller vocabulary is checked again
    pos = torch.arange(8)[None].expand(2, 8) * 3
    assert _unpad(ids, mask, position_ids=pos).max_position == 19 and syncs[0] == 4


def test_failed_calls_are_not_remembered(syncs):
    ids, mask = padded_batch([3, 7], side="right", pad_to=8)
    holes = mask.clone()
    holes[1, 2] = 0
    for _ in range(2):
        with pytest.raises(StockOnlyInput):
            _unpad(ids, holes)
    assert syncs[0] == 2


def test_inference_tensors_are_not_remembered(syncs):
    with torch.inference_mode():
        ids, mask = padded_batch([3, 7], side="right", pad_to=8)
    _unpad(ids, mask)
    _unpad(ids, mask)
    assert syncs[0] == 2


def test_non_tensor_token_type_ids_are_ignored_as_before():
    """Stock ignores ``token_type_ids``; a NumPy array (or a list) there is not keyed (nor an error), is checked as
    a tensor would be, and raises no warning (NumPy 2 deprecates its ``__array_wrap__`` on a tensor operand)."""
    model = tiny_model().train()
    pe.pack(model)
    ids, mask = padded_batch([5, 9, 3, 12], pad_to=12)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=np.zeros((4, 12), dtype=np.int64))
        ref = model(input_ids=ids, attention_mask=mask)
        with pytest.raises(pe.PackedEncodersError, match="token_type_ids"):  # as torch.ones_like(ids) does
            model(input_ids=ids, attention_mask=mask, token_type_ids=np.ones((4, 12), dtype=np.int64))
        listed = model(input_ids=ids, attention_mask=mask, token_type_ids=[[0] * 12] * 4)  # (a list: as an array)
        with pytest.raises(pe.PackedEncodersError, match="token_type_ids has shape"):
            model(input_ids=ids, attention_mask=mask, token_type_ids=[[0] * 11] * 4)
        with pytest.raises(pe.PackedEncodersError, match="token_type_ids must be"):  # ragged
            model(input_ids=ids, attention_mask=mask, token_type_ids=[[0] * 12] * 3 + [[0] * 11])
    torch.testing.assert_close(listed.last_hidden_state, ref.last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, rtol=0, atol=0)


def test_a_gradcache_loop_on_a_packed_model(syncs, monkeypatch):
    """The no-grad pass (train mode) remembers, the pass with gradients over the same slices reuses, once; the
    gradients equal those of calls that read their lengths (the switch off, re-packed). Eval-mode and gradient
    calls are not remembered."""
    model = tiny_model().train()
    pe.pack(model)
    ids, mask = padded_batch([5, 9, 3, 12, 7, 1], side="right", pad_to=12, vocab_size=model.config.vocab_size)
    model(input_ids=ids[:3], attention_mask=mask[:3])
    with torch.no_grad():
        model.eval()
        model(input_ids=ids[:3], attention_mask=mask[:3])
        model.train()
    assert len(LENGTHS) == 0

    def step():
        model.zero_grad(set_to_none=True)
        chunks = [(0, 3), (3, 6)]
        with torch.no_grad():
            reps = [model(input_ids=ids[a:b], attention_mask=mask[a:b]).last_hidden_state for a, b in chunks]
        before = syncs[0]
        for (a, b), r in zip(chunks, reps):
            out = model(input_ids=ids[a:b], attention_mask=mask[a:b]).last_hidden_state
            torch.testing.assert_close(out, r, rtol=0, atol=0)
            (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        return syncs[0] - before, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reused, grads = step()
    assert reused == 0 and pe.describe(model)["encoders"][0]["unpad_syncs_skipped"] == 2
    before = syncs[0]
    model(input_ids=ids[:3], attention_mask=mask[:3])  # the entry was used: this call syncs
    assert syncs[0] == before + 1
    monkeypatch.setenv("PACKED_ENCODERS_UNPAD_REUSE", "0")
    pe.pack(model)
    assert pe.describe(model)["encoders"][0]["tuning"]["unpad_reuse"] is False
    read, grads_off = step()
    assert read == 2 and pe.describe(model)["encoders"][0]["unpad_syncs_skipped"] == 0  # (a new state, re-packed)
    assert grads.keys() == grads_off.keys() and len(grads) > 10
    for name in grads:
        torch.testing.assert_close(grads[name], grads_off[name], rtol=0, atol=0, msg=name)


def test_the_stale_lengths_error_advice_works_when_followed(monkeypatch):
    """The error names the switch and says to pack again: the switch alone changes nothing (read at pack())."""
    model = pe.pack(tiny_model())
    model.train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0

    def grad_cache_step():
        ids, mask = padded_batch([5, 9, 3])
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
        mask.data[0, 4] = 0  # bumps no version counter
        return model(input_ids=ids, attention_mask=mask).last_hidden_state

    with pytest.raises(PackedEncodersError, match=r"PACKED_ENCODERS_UNPAD_REUSE=0 and call pe.pack\(model\) again"):
        grad_cache_step()
    monkeypatch.setenv("PACKED_ENCODERS_UNPAD_REUSE", "0")
    with pytest.raises(PackedEncodersError, match="PACKED_ENCODERS_UNPAD_REUSE=0"):
        grad_cache_step()  # not packed again: the frozen tuning still reuses
    pe.pack(model)
    out = grad_cache_step()
    assert out[0, 4:].abs().max() == 0  # the edited mask's lengths were read
