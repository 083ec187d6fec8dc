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


def _count_checkpoints(model):
    calls = []
    for index, layer in enumerate(model.layers):
        real = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, real=real, index=index, **k: calls.append(index) or real(*a, **k)
    return calls


def test_gradient_checkpointing_follows_hf_per_layer_choice_and_options():
    """gradient_checkpointing_enable(every_n_layers=2) checkpoints layers 0, 2, ...; the checkpoint function HF
    built (its kwargs: use_reentrant, CPU offload) is the one called; gradients match stock's."""
    from tests.helpers import stock, stock_positions

    model = make_model("base_like", num_hidden_layers=5)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True}, every_n_layers=2)
    model.train()
    ids, mask = padded_batch([8, 20])

    def grads(fn):
        model.zero_grad(set_to_none=True)
        fn()[mask.bool()].pow(2).mean().backward()  # real tokens (stock computes padded positions too)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(lambda: stock(model, input_ids=ids, attention_mask=mask,
                              position_ids=stock_positions(mask)).last_hidden_state)
    pe.pack(model)
    calls = _count_checkpoints(model)
    got = grads(lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert calls == [0, 2, 4]
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-3, msg=n)
    model.layers[2].gradient_checkpointing = False  # a per-layer flag changed by hand: read per call
    calls.clear()
    grads(lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert calls == [0, 4]


@pytest.mark.parametrize("reentrant", [True, False])
def test_per_block_training_forward_calls_hf_checkpoint_functions(reentrant):
    """The per-block training forward (model/blocks.py) checkpoints the layers HF flags with HF's function; the
    dropout masks replay in the recomputation (same output and gradients as without checkpointing)."""
    from packed_encoders.call import _gradient_checkpointing

    model = make_model("base_like", num_hidden_layers=4, attention_dropout=0.2, mlp_dropout=0.2,
                       embedding_dropout=0.2)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant},
                                          every_n_layers=2)
    model.train()
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = padded_batch([8, 20])
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)
    calls = _count_checkpoints(model)

    def grads(ckpt):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = encoder_forward(model, params, batch, attention_backend="sdpa", rules=Rules(lean=True, blocks=True),
                              gradient_checkpointing=ckpt)
        out.pow(2).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out_c, g_c = grads(_gradient_checkpointing(model))
    assert calls == [0, 2]
    out_p, g_p = grads(False)
    torch.testing.assert_close(out_c, out_p, atol=0, rtol=0)
    assert set(g_c) == set(g_p)
    for n in g_p:
        torch.testing.assert_close(g_c[n], g_p[n], atol=1e-6, rtol=1e-5, msg=n)
