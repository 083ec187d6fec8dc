"""Heads that read position 0 (``classifier_pooling="cls"``: sequence classification, multiple choice) with a row
padded there (left padding, a row without real tokens): the encoder call runs the stock forward, so the head reads
what stock computes at that padded position; right-padded calls, mean pooling and a bare encoder stay packed
(adapters/token_labels.py ``LEADING``, batch.unpad's position-0 count at the call's one sync)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import packed_encoders as pe
from tests.helpers import make_model, padded_batch

REASON_PART = "position 0"


def _stock_calls(model) -> dict:
    return dict(pe.describe(model)["encoders"][0].get("stock_forward_calls") or {})


def _zero_reasons(model) -> int:
    return sum(n for reason, n in _stock_calls(model).items() if REASON_PART in reason)


def _inputs(head: str, side: str, lengths=(5, 12, 9)):
    ids, mask = padded_batch(list(lengths), side=side)
    if head == "ModernBertForMultipleChoice":
        return dict(input_ids=ids[None].expand(2, -1, -1).contiguous(),
                    attention_mask=mask[None].expand(2, -1, -1).contiguous())
    return dict(input_ids=ids, attention_mask=mask)


@pytest.mark.parametrize("head", ["ModernBertForSequenceClassification", "ModernBertForMultipleChoice"])
def test_cls_heads_read_stocks_output_at_a_padded_position_zero(head):
    model = make_model("base_like", cls=getattr(transformers, head), classifier_pooling="cls")
    stock = copy.deepcopy(model)
    pe.pack(model)
    with torch.no_grad():
        for side, lengths, to_stock in (("right", (5, 12, 9), False), ("left", (5, 12, 9), True),
                                        ("right", (5, 0, 9), True), ("left", (12, 12, 12), False)):
            inputs = _inputs(head, side, lengths)
            before = _zero_reasons(model)
            got, want = model(**inputs).logits, stock(**inputs).logits
            assert _zero_reasons(model) == before + to_stock, (side, lengths)
            if to_stock:  # the stock forward: the same numbers
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
            else:
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_mean_pooling_and_the_bare_encoder_stay_packed_with_left_padding():
    head = make_model("base_like", cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls")
    stock = copy.deepcopy(head)
    pe.pack(head)
    inputs = _inputs("ModernBertForSequenceClassification", "left")
    head.config.classifier_pooling = stock.config.classifier_pooling = "mean"  # after pack(): read at each call
    with torch.no_grad():
        got, want = head(**inputs).logits, stock(**inputs).logits
    assert not _stock_calls(head)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    head.config.classifier_pooling = "cls"
    with torch.no_grad():
        head(**inputs)
    assert _zero_reasons(head) == 1

    encoder = pe.pack(make_model("base_like"))  # its config's classifier_pooling is "cls" too: no head reads it
    with torch.no_grad():
        encoder(**inputs)
    assert not _stock_calls(encoder)


def test_left_padded_cls_training_gets_stocks_loss_and_gradients():
    model = make_model("base_like", cls=transformers.ModernBertForSequenceClassification, num_labels=3,
                       classifier_pooling="cls").train()
    stock = copy.deepcopy(model)
    pe.pack(model)
    inputs = _inputs("ModernBertForSequenceClassification", "left")
    labels = torch.tensor([0, 2, 1])
    losses = []
    for m in (model, stock):
        torch.manual_seed(0)
        out = m(**inputs, labels=labels)
        out.loss.backward()
        losses.append(out.loss.detach())
    torch.testing.assert_close(losses[0], losses[1])
    for (name, p), q in zip(model.named_parameters(), stock.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert _zero_reasons(model) == 1
