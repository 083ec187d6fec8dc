"""Module attributes stock HF reads on every call are read on every call by the packed forward too (a value set
after pack() is honoured, not the one read at pack())."""

from __future__ import annotations

import pytest
import torch

import packed_encoders as pe
from packed_encoders.batch import unpad
from packed_encoders.model.forward import encoder_forward
from packed_encoders.model.params import ModernBertParams
from packed_encoders.model.plan import Rules
from tests.helpers import make_model, padded_batch


def test_attention_dropout_rate_set_after_pack_is_applied():
    model = pe.pack(make_model("base_like"))  # attention_dropout 0 at pack()
    model.train()
    ids, mask = padded_batch([9, 14])
    real = mask.bool()

    def run():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state[real]

    base = run()
    torch.testing.assert_close(run(), base, atol=0, rtol=0)  # no dropout anywhere yet
    for layer in model.layers:
        layer.attn.attention_dropout = 0.5  # what stock's attention reads per call
    a, b = run(), run()
    assert (a - b).abs().max() > 1e-3 and (a - base).abs().max() > 1e-3
    assert set(pe.describe(model)["encoders"][0]["last_attention"].values()) == {"sdpa"}  # the dropout backend
    for layer in model.layers:
        layer.attn.attention_dropout = 0.0
    torch.testing.assert_close(run(), base, atol=0, rtol=0)


def test_attention_dropout_follows_each_layer():
    model = pe.pack(make_model("base_like", attention_dropout=0.5))
    model.train()
    ids, mask = padded_batch([9, 14])
    for layer in model.layers:
        layer.attn.attention_dropout = 0.0  # set to 0 after pack: stock applies none
        layer.attn.out_drop.p = 0.0  # (the output dropout module HF built from the same config value)
    real = mask.bool()
    a = model(input_ids=ids, attention_mask=mask).last_hidden_state[real]
    b = model(input_ids=ids, attention_mask=mask).last_hidden_state[real]
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("blocks", [True, False])
def test_attention_dropout_rate_read_per_call_by_the_training_forward(blocks):
    """The per-block training forward (model/blocks.py) and the per-op one both read ``attn.attention_dropout``."""
    model = make_model("base_like")  # attention_dropout 0 in the config
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = padded_batch([9, 14])
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)
    rules = Rules(lean=True, blocks=True) if blocks else Rules(lean=False)
    model.train()

    def run():
        return encoder_forward(model, params, batch, attention_backend="sdpa", rules=rules)

    base = run()
    model.layers[1].attn.attention_dropout = 0.5  # one layer only
    a, b = run(), run()
    assert (a - b).abs().max() > 1e-3 and (a - base).abs().max() > 1e-3
    a.float().square().mean().backward()  # the dropout's backward runs
    model.layers[1].attn.attention_dropout = 0.0
    torch.testing.assert_close(run(), base, atol=0, rtol=0)
    model.layers[1].attn.attention_dropout = 0.5
    model.layers[1].attn.eval()  # the module's own mode decides, as in stock
    torch.testing.assert_close(run(), base, atol=0, rtol=0)
