"""Gradients vs stock HF (fp32), gradient checkpointing, dropout in train mode."""

from __future__ import annotations

import warnings

import pytest
import torch

import packed_encoders as pe
from tests.helpers import make_model, padded_batch, set_checkpointing, stock, stock_positions


def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["base_like", "odd"])
def test_gradients_match_stock(name):
    model = make_model(name)
    model.train()
    ids, mask = padded_batch([3, 17, 26], side="mixed")
    real = mask.bool()
    target = torch.randn(*ids.shape, model.config.hidden_size)

    def loss(out):
        return ((out - target)[real] ** 2).mean()

    ref = _grads(model, lambda: loss(stock(model, input_ids=ids, attention_mask=mask,
                                           position_ids=stock_positions(mask)).last_hidden_state))
    pe.pack(model)
    got = _grads(model, lambda: loss(model(input_ids=ids, attention_mask=mask).last_hidden_state))
    assert set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-3, msg=n)


def test_gradient_checkpointing_is_honoured():
    model = make_model("base_like")
    set_checkpointing(model, use_reentrant=False)
    model.train()
    pe.pack(model)
    calls = []
    for layer in model.layers:  # the function HF set per layer, which the packed forward calls as stock does
        real = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = lambda *a, real=real, **k: calls.append(1) or real(*a, **k)
    ids, mask = padded_batch([8, 20])
    with_ckpt = _grads(model, lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).mean())
    assert len(calls) == model.config.num_hidden_layers
    set_checkpointing(model, on=False)
    calls.clear()
    plain = _grads(model, lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).mean())
    assert not calls
    for n in plain:
        torch.testing.assert_close(with_ckpt[n], plain[n], atol=1e-6, rtol=1e-5)
    model.eval()
    with torch.no_grad():
        set_checkpointing(model)
        model(input_ids=ids, attention_mask=mask)
    assert not calls  # eval / no grad: nothing to recompute


def test_packed_calls_under_checkpointing_raise_no_deprecation_warning():
    """pack() and the packed forward read HF's checkpointing flags per call (``gradient_checkpointing`` and
    ``_gradient_checkpointing_func`` on each layer): transformers 5.24+ deprecates the ``gradient_checkpointing_*``
    methods and ``is_gradient_checkpointing`` (FutureWarning) but not these attributes. A user's packed training
    step must print no FutureWarning / DeprecationWarning of ours (pyproject hides DeprecationWarning, hence the
    explicit filter)."""
    model = make_model("base_like")
    set_checkpointing(model, use_reentrant=False)
    model.train()
    ids, mask = padded_batch([8, 20])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        pe.pack(model)
        model(input_ids=ids, attention_mask=mask).last_hidden_state.pow(2).mean().backward()
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    assert pe.describe(model)["encoders"][0]["packed"]


def test_dropout_applied_in_train_mode_only():
    model = make_model("base_like", embedding_dropout=0.1, mlp_dropout=0.1, attention_dropout=0.1)
    pe.pack(model)
    ids, mask = padded_batch([10, 15])
    model.train()
    a = model(input_ids=ids, attention_mask=mask).last_hidden_state
    b = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (a - b).abs().max() > 1e-3
    assert pe.describe(model)["encoders"][0]["last_attention"] == {"global": "sdpa", "window 8": "sdpa"}
    model.eval()
    with torch.no_grad():
        c = model(input_ids=ids, attention_mask=mask).last_hidden_state
        d = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(c[mask.bool()], d[mask.bool()], atol=1e-4, rtol=1e-4)


def test_packed_forward_gradients():
    model = make_model("large_like")
    model.train()
    lengths = [4, 19, 2]
    ids = torch.randint(3, 200, (sum(lengths),))
    cu = torch.tensor([0, 4, 23, 25], dtype=torch.int32)
    padded = torch.zeros(3, 19, dtype=torch.long)
    mask = torch.zeros(3, 19, dtype=torch.long)
    for i, (s, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        padded[i, :n], mask[i, :n] = ids[s:s + n], 1
    ref = _grads(model, lambda: stock(model, input_ids=padded, attention_mask=mask).last_hidden_state[mask.bool()].sum())
    got = _grads(model, lambda: pe.packed_forward(model, None, ids, cu, 19).sum())
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-3, msg=n)
