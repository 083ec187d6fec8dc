"""RoPE tables of eager calls (model/forward.py ``rope_inputs``, ops/rope.py ``cached_position_tables``): cached
over positions while HF's ``inv_freq`` buffer is unchanged, equal to the per-token angles HF computes, rebuilt
when the buffer is edited in place, reassigned or replaced, and never cached while a call is captured into a CUDA
graph or within a training graph's warm-ups."""

from __future__ import annotations

import torch

import packed_encoders as pe
from packed_encoders.batch import unpad
from packed_encoders.model import forward as fwd
from packed_encoders.model.params import ModernBertParams
from packed_encoders.ops import rope
from tests.helpers import assert_close_real, padded_batch, stock_forward, tiny_model


def _batch(model, lengths=(7, 30, 19)):
    ids, mask = padded_batch(list(lengths))
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)
    return batch, ids, mask


def test_tables_match_per_token_angles_and_are_reused():
    model = tiny_model().eval()
    params = ModernBertParams.from_hf_config(model.config)
    batch, _, _ = _batch(model)
    rope._POSITION_TABLES.clear()
    with torch.inference_mode():
        first = fwd.rope_inputs(model, params, batch)
    again = fwd.rope_inputs(model, params, batch)
    for is_global, (cos, sin, rows) in first.items():
        assert torch.equal(rows, batch.position_ids)
        assert cos.shape[0] >= batch.max_position and cos.dtype is torch.float32
        assert not cos.is_inference()  # made under inference_mode, read later by training forwards' backwards
        inv, _ = fwd.live_inv_freq(model, is_global, params)
        angles = batch.position_ids.float()[:, None] * inv.float()[None]  # HF: position * inv_freq in fp32
        torch.testing.assert_close(cos[rows], angles.cos(), rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[rows], angles.sin(), rtol=0, atol=1e-6)
        assert again[is_global][0] is cos and again[is_global][1] is sin  # cached: no launch on the next call


def test_edited_reassigned_or_replaced_buffers_are_read_again():
    model = tiny_model().eval()
    batch, ids, mask = _batch(model)
    pe.pack(model, validate=False)
    rotary = model.rotary_emb
    names = [n for n in vars(rotary)["_buffers"] if n.endswith("inv_freq")]
    assert names, "transformers keeps inv_freq buffers on rotary_emb"

    def check():
        with torch.no_grad():
            got = model(input_ids=ids, attention_mask=mask).last_hidden_state
            ref = stock_forward(model, ids, mask)
        assert_close_real(got, ref, mask)
        return got

    before = check()
    getattr(rotary, names[0]).mul_(1.5)  # in place: the version counter moves
    edited = check()
    assert not torch.allclose(edited, before)
    getattr(rotary, names[0]).data = getattr(rotary, names[0]).data * 0.5  # a new storage, no version bump
    check()
    rotary.register_buffer(names[0], getattr(rotary, names[0]).clone() * 2, persistent=False)  # a new tensor
    check()


def test_no_table_is_cached_for_a_capture(monkeypatch):
    """A call captured into a CUDA graph gets per-token tables computed from the live buffer (a replay reads it)."""
    model = tiny_model().eval()
    params = ModernBertParams.from_hf_config(model.config)
    batch, _, _ = _batch(model)
    inv, _ = fwd.live_inv_freq(model, True, params)
    rope._POSITION_TABLES.clear()
    from packed_encoders.ops import weight_cast

    with weight_cast.off():  # a training graph's warm-ups: tensors made there belong to the graph's pool
        assert rope.cached_position_tables(inv, 1.0, torch.float32, 64, torch.device("cpu")) is None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert rope.cached_position_tables(inv, 1.0, torch.float32, 64, torch.device("cuda")) is None
    assert not rope._POSITION_TABLES
    real = rope.cached_position_tables
    monkeypatch.setattr(fwd, "cached_position_tables", lambda inv, scaling, compute, n, device:
                        real(inv, scaling, compute, n, torch.device("cuda")))  # this CPU batch, seen as captured
    tables = fwd.rope_inputs(model, params, batch)
    for cos, _, rows in tables.values():
        assert cos.shape[0] == batch.total_tokens and torch.equal(rows, torch.arange(batch.total_tokens))
