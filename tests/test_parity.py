"""Packed forward vs stock HF ModernBERT (fp32, CPU): padded, left-padded, packed kwargs, packed_forward."""

from __future__ import annotations

import warnings

import pytest
import torch

import packed_encoders as pe
from packed_encoders.model.params import ModernBertParams
from tests.helpers import assert_close_real, make_model, padded_batch, stock, stock_positions


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padded_matches_stock(config_name, attn):
    model = make_model(config_name, attn_implementation=attn)
    w = model.config.local_attention // 2
    lengths = [1, w, w + 1, w + 2, 3 * w, 40]
    ids, mask = padded_batch(lengths, side="mixed")
    with torch.no_grad():
        ref = stock(model, input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask)).last_hidden_state
        pe.pack(model)
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert out.shape == ref.shape
    assert_close_real(out, ref, mask)
    assert out[~mask.bool()].abs().max() == 0  # documented convention: zeros at padded positions


def test_left_equals_right_padding():
    model = pe.pack(make_model("base_like"))
    lengths = [5, 17, 30, 9]
    ids_r, mask_r = padded_batch(lengths, side="right")
    ids_l = torch.zeros_like(ids_r)
    mask_l = torch.zeros_like(mask_r)
    s = ids_r.shape[1]
    for row, n in enumerate(lengths):
        ids_l[row, s - n:] = ids_r[row, :n]
        mask_l[row, s - n:] = 1
    with torch.no_grad():
        r = model(input_ids=ids_r, attention_mask=mask_r).last_hidden_state
        l = model(input_ids=ids_l, attention_mask=mask_l).last_hidden_state
    for row, n in enumerate(lengths):
        torch.testing.assert_close(r[row, :n], l[row, s - n:], atol=1e-5, rtol=1e-5)


def test_pad_count_invariance():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([7, 33, 12])
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).last_hidden_state
        ids2 = torch.cat([ids, torch.full((3, 50), 5)], 1)
        mask2 = torch.cat([mask, torch.zeros(3, 50, dtype=torch.long)], 1)
        b = model(input_ids=ids2, attention_mask=mask2).last_hidden_state
    torch.testing.assert_close(a, b[:, : ids.shape[1]], atol=1e-5, rtol=1e-5)
    assert b[:, ids.shape[1]:].abs().max() == 0


@pytest.mark.parametrize("length_of", ["half", "w+1", "w+2", "3w", "2w+1"])
def test_window_boundaries_single_sequence(length_of):
    model = make_model("base_like", attn_implementation="eager")
    w = model.config.local_attention // 2
    n = {"half": w // 2, "w+1": w + 1, "w+2": w + 2, "3w": 3 * w, "2w+1": 2 * w + 1}[length_of]
    ids, mask = padded_batch([n])
    with torch.no_grad():
        ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
        pe.pack(model)
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_no_mask_and_tuple_output():
    model = make_model("large_like")
    ids, _ = padded_batch([20, 20])
    with torch.no_grad():
        ref = stock(model, input_ids=ids).last_hidden_state
        pe.pack(model)
        out = model(ids, return_dict=False)
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], ref, atol=1e-4, rtol=1e-4)


def test_output_hidden_states_match_stock():
    model = make_model("odd")
    ids, mask = padded_batch([4, 19, 11], side="mixed")
    kw = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    with torch.no_grad():
        ref = stock(model, position_ids=stock_positions(mask), **kw)
        pe.pack(model)
        out = model(**kw)
    assert len(out.hidden_states) == len(ref.hidden_states) == model.config.num_hidden_layers + 1
    for a, b in zip(out.hidden_states, ref.hidden_states):
        assert_close_real(a, b, mask)
        assert a[~mask.bool()].abs().max() == 0



@pytest.mark.parametrize("tie", [False, True, None])
def test_untied_last_hidden_state_matches_stock(tie):
    """``config.tie_last_hidden_states = False`` (a ``PretrainedConfig`` option): where this transformers honours it,
    stock's last ``hidden_states`` entry is the last layer's output before ``final_norm``, and so is the packed one
    (padded and packed calls)."""
    model = make_model("tiny")
    model.config.tie_last_hidden_states = tie
    ids, mask = padded_batch([4, 9, 7], side="mixed")
    kw = dict(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    with torch.no_grad():
        ref = stock(model, position_ids=stock_positions(mask), **kw).hidden_states
        pe.pack(model)
        out = model(**kw).hidden_states
        flat = model(input_ids=ids[mask.bool()][None], position_ids=stock_positions(mask)[mask.bool()][None],
                     output_hidden_states=True).hidden_states
    for a, b, c in zip(out, ref, flat):
        assert_close_real(a, b, mask)
        torch.testing.assert_close(c[0], b[mask.bool()], atol=1e-4, rtol=1e-4)

def test_explicit_position_ids_are_honoured():
    model = make_model("base_like")
    ids, mask = padded_batch([9, 14])
    pos = torch.arange(ids.shape[1])[None].expand(2, -1) * 2  # RoPE is relative: scale, not shift
    with torch.no_grad():
        ref = stock(model, input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        pe.pack(model)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        default = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_close_real(out, ref, mask)
    err = (out - ref)[mask.bool()].abs().max()
    assert (out - default).abs().max() > 20 * err + 1e-5  # the positions actually changed the result


def test_inputs_embeds():
    model = make_model("ettin_like")
    ids, mask = padded_batch([6, 21], side="left")
    embeds = model.embeddings.tok_embeddings(ids)
    with torch.no_grad():
        ref = stock(model, inputs_embeds=embeds, attention_mask=mask,
                    position_ids=stock_positions(mask)).last_hidden_state
        pe.pack(model)
        out = model(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        by_ids = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert_close_real(out, ref, mask)
    torch.testing.assert_close(out, by_ids, atol=1e-6, rtol=1e-6)


def test_all_zero_mask_row():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([8, 13, 5])
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).last_hidden_state
        mask0 = mask.clone()
        mask0[1] = 0
        out = model(input_ids=ids, attention_mask=mask0).last_hidden_state
        empty = model(input_ids=ids, attention_mask=torch.zeros_like(mask)).last_hidden_state
    assert out[1].abs().max() == 0
    torch.testing.assert_close(out[[0, 2]], full[[0, 2]], atol=1e-6, rtol=1e-6)
    assert empty.shape == full.shape and empty.abs().max() == 0


def _packed_inputs(lengths, vocab=211, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lengths])
    return ids, cu, pos


def test_packed_forward_matches_padded():
    model = make_model("mmbert_like")
    lengths = [3, 30, 1, 17]
    ids, cu, pos = _packed_inputs(lengths)
    padded = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True)
    mask = (torch.arange(padded.shape[1])[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        ref = stock(model, input_ids=padded, attention_mask=mask).last_hidden_state
        params = ModernBertParams.from_hf_config(model.config)
        flat = pe.packed_forward(model, params, torch.cat(ids), cu, max(lengths), pos)
        flat_default_pos = pe.packed_forward(model, None, torch.cat(ids), cu, max(lengths))
    torch.testing.assert_close(flat, ref[mask.bool()], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(flat, flat_default_pos, atol=0, rtol=0)


def test_hf_packed_kwargs_and_packed_position_ids():
    """HF v5 / sentence-transformers flattening collator: [1, T] ids, cu_seq_lens_q/k, max_length_q/k."""
    model = make_model("base_like")
    lengths = [5, 12, 20]
    ids, cu, pos = _packed_inputs(lengths)
    flat_ids = torch.cat(ids)[None]
    with torch.no_grad():
        expected = pe.packed_forward(model, None, flat_ids[0], cu, max(lengths), pos)
        pe.pack(model)
        out = model(input_ids=flat_ids, position_ids=pos[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(),
                    max_length_q=max(lengths), max_length_k=max(lengths), seq_idx=torch.zeros(1)).last_hidden_state
        with pytest.warns(RuntimeWarning, match="restart at 0"):  # base_like: not loaded with FlashAttention
            by_pos = model(input_ids=flat_ids, position_ids=pos[None]).last_hidden_state
    assert out.shape == (1, sum(lengths), model.config.hidden_size)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_pos[0], expected, atol=1e-5, rtol=1e-5)


def test_restarting_position_ids_are_counted_and_warned_once():
    """Stock reads such a call as one sequence (ModernBERT's layers get position_ids for RoPE only)."""
    model = pe.pack(make_model("base_like", attn_implementation="sdpa"))
    ids, cu, pos = _packed_inputs([5, 12])
    flat = torch.cat(ids)[None]
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=flat, position_ids=torch.arange(flat.shape[1])[None])  # one sequence: as stock
        assert not caught and pe.describe(model)["encoders"][0]["restarting_position_ids_calls"] == 0
        model(input_ids=flat, position_ids=pos[None])
        model(input_ids=flat, position_ids=pos[None])
        model(input_ids=flat, position_ids=pos[None], cu_seq_lens_q=cu, max_length_q=12)  # said: not counted
    assert len(caught) == 1 and "restart at 0" in str(caught[0].message), caught
    assert caught[0].filename == __file__  # the warning names this call
    assert pe.describe(model)["encoders"][0]["restarting_position_ids_calls"] == 2


def test_sequences_are_isolated():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([10, 25, 7])
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask).last_hidden_state
        ids2 = ids.clone()
        ids2[1] = torch.randint(3, 200, ids2[1].shape)
        b = model(input_ids=ids2, attention_mask=mask).last_hidden_state
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


@pytest.mark.parametrize("name", ["base_like", "odd"])
def test_padded_outputs_all_matches_stock_at_trailing_positions(name):
    """HF computes outputs at masked positions too (they attend, nobody attends to them)."""
    model = make_model(name, attn_implementation="sdpa")
    w = model.config.local_attention // 2
    ids, mask = padded_batch([3, 4 * w, w + 2, 1], pad_to=4 * w + 3)
    with torch.no_grad():
        ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
        pe.pack(model, padded_outputs="all")
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        pe.pack(model, padded_outputs=ids.shape[1] - 1)  # narrower than this call: zeros convention
        zeros = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert zeros[~mask.bool()].abs().max() == 0
    assert_close_real(zeros, ref, mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float64_model_under_autocast_runs_in_float64(dtype):
    """Autocast casts no float64 tensor: stock runs a float64 model in float64 under it, with or without grad."""
    model = make_model("base_like").double()
    ids, mask = padded_batch([5, 17, 33, 2])
    with torch.no_grad():
        want = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    pe.pack(model)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=dtype):
            got = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert got.dtype == torch.float64
        assert_close_real(got.detach(), want, mask, atol=1e-9, rtol=1e-9)
