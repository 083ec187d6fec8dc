"""Every ModernBertFor* head runs the packed backbone and matches stock."""

from __future__ import annotations

import pytest
import torch
import transformers

import packed_encoders as pe
from tests.helpers import make_model, padded_batch

HEADS = ["ModernBertForMaskedLM", "ModernBertForSequenceClassification", "ModernBertForTokenClassification",
         "ModernBertForQuestionAnswering", "ModernBertForMultipleChoice"]


def _inputs(head, right_padded=True):
    ids, mask = padded_batch([5, 12, 9], side="right" if right_padded else "mixed")
    if head == "ModernBertForMultipleChoice":
        return dict(input_ids=ids[None].expand(2, -1, -1).contiguous(), attention_mask=mask[None].expand(2, -1, -1).contiguous()), mask
    return dict(input_ids=ids, attention_mask=mask), mask


CASES = [(h, "cls") for h in HEADS] + [("ModernBertForSequenceClassification", "mean"),
                                         ("ModernBertForMultipleChoice", "mean")]


@pytest.mark.parametrize("head, pooling", CASES)
def test_head_parity(head, pooling):
    cls = getattr(transformers, head)
    model = make_model("base_like", cls=cls, classifier_pooling=pooling)
    inputs, mask = _inputs(head)
    with torch.no_grad():
        ref = model(**inputs)
        pe.pack(model)
        assert pe.is_packed(model) and pe.describe(model)["encoders"][0]["path"] == "model"
        out = model(**inputs)
    key = "logits" if hasattr(ref, "logits") and ref.logits is not None else "start_logits"
    a, b = getattr(out, key), getattr(ref, key)
    if a.dim() == 3 and head != "ModernBertForMultipleChoice":  # per-token heads: compare real tokens only
        a, b = a[mask.bool()], b[mask.bool()]
    elif head == "ModernBertForQuestionAnswering":
        a, b = a[mask.bool()], b[mask.bool()]
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_masked_lm_loss_and_gradients():
    model = make_model("odd", cls=transformers.ModernBertForMaskedLM)
    ids, mask = padded_batch([6, 11])
    labels = torch.where(mask.bool(), ids, -100)
    model.train()
    ref_loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    pe.pack(model)
    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], atol=2e-5, rtol=1e-3, msg=n)


@pytest.mark.parametrize("head", ["ModernBertForTokenClassification", "ModernBertForMaskedLM"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_token_head_labels_at_padding_get_the_stock_loss(head, side):
    """Labels that count at padded positions (built by hand, not -100 there): the loss and the gradients are
    stock's. Right padding: the encoder computes those trailing positions; left padding: the call runs the stock
    forward, counted by ``describe()``. Labels of -100 at padding keep the packed path's zeros there."""
    import copy

    cls = getattr(transformers, head)
    stock = make_model("base_like", cls=cls, num_labels=4).train()
    packed = copy.deepcopy(stock)
    pe.pack(packed)
    ids, mask = padded_batch([5, 12, 9], side=side)
    g = torch.Generator().manual_seed(3)
    labels = ids.clone() if head.endswith("MaskedLM") else torch.randint(0, 4, ids.shape, generator=g)
    for model in (stock, packed):
        model.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels).loss
    got = packed(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    sp, pp = dict(stock.named_parameters()), dict(packed.named_parameters())
    for name, p in sp.items():
        if p.grad is not None:
            torch.testing.assert_close(pp[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    calls = pe.describe(packed)["encoders"][0].get("stock_forward_calls") or {}
    assert bool(calls) == (side == "left"), calls
    # labels ignored at padding (HF's collators): the packed path as usual, its zeros never read by the loss
    ignored = labels.masked_fill(mask == 0, -100)
    before = dict(calls)
    got = packed(input_ids=ids, attention_mask=mask, labels=ignored).loss
    torch.testing.assert_close(got, stock(input_ids=ids, attention_mask=mask, labels=ignored).loss, atol=1e-5,
                               rtol=1e-5)
    assert (pe.describe(packed)["encoders"][0].get("stock_forward_calls") or {}) == before
    twin = copy.deepcopy(packed)  # the checked forward copied with the head; each unpack removes its own
    pe.unpack(packed)
    assert "forward" not in packed.__dict__ and not packed._forward_pre_hooks and not packed._forward_hooks
    assert twin.__dict__["forward"].module is twin
    pe.unpack(twin)
    assert "forward" not in twin.__dict__ and not twin._forward_pre_hooks and not twin._forward_hooks


@pytest.mark.parametrize("head", ["ModernBertForTokenClassification", "ModernBertForMaskedLM"])
def test_labels_in_a_row_without_real_tokens_or_flattened_get_the_stock_loss(head):
    """Two label layouts HF's heads accept: labels counted in a row that is all padding (stock's output there attends
    over the padding: the call runs the stock forward, counted), and labels of ``B * S`` entries in another shape
    (``[B * S]``, ``[B, S, 1]``: HF flattens them, so they reach padded positions as ``[B, S]`` ones do)."""
    import copy

    cls = getattr(transformers, head)
    stock = make_model("base_like", cls=cls, num_labels=4).eval()
    packed = copy.deepcopy(stock)
    pe.pack(packed)
    ids, mask = padded_batch([5, 12, 9])
    g = torch.Generator().manual_seed(5)
    labels = ids.clone() if head.endswith("MaskedLM") else torch.randint(0, 4, ids.shape, generator=g)
    empty_ids, empty_mask = ids.clone(), mask.clone()
    empty_mask[1] = 0  # the second row: padding only
    for i, m, lab in ((empty_ids, empty_mask, labels), (ids, mask, labels.flatten()), (ids, mask, labels[..., None])):
        before = sum((pe.describe(packed)["encoders"][0].get("stock_forward_calls") or {}).values())
        with torch.no_grad():
            got = packed(input_ids=i, attention_mask=m, labels=lab).loss
            ref = stock(input_ids=i, attention_mask=m, labels=lab).loss
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        after = sum((pe.describe(packed)["encoders"][0].get("stock_forward_calls") or {}).values())
        assert after == before + (m is empty_mask)  # (trailing padding elsewhere: the packed path computes it)


@pytest.mark.parametrize("head", ["ModernBertForTokenClassification", "ModernBertForMaskedLM",
                                  "ModernBertForQuestionAnswering"])
def test_loss_arguments_passed_positionally_get_the_stock_loss(head):
    """``head(ids, mask, labels=...)`` / ``head(ids, mask, None, None, labels)``: the mask and the labels (span
    positions) are read by position too, so a loss reading padded positions is stock's as with keywords."""
    import copy

    cls = getattr(transformers, head)
    stock = make_model("tiny", cls=cls, num_labels=2 if head.endswith("QuestionAnswering") else 4)
    packed = copy.deepcopy(stock)
    pe.pack(packed)
    side = "mixed" if head.endswith("QuestionAnswering") else "right"
    ids, mask = padded_batch([5, 3, 7], side=side)
    if head.endswith("QuestionAnswering"):
        span = (torch.tensor([0, 1, 2]), torch.tensor([6, 6, 6]))
        calls = [lambda m: m(ids, mask, None, *span), lambda m: m(ids, mask, start_positions=span[0],
                                                                   end_positions=span[1])]
    else:
        labels = ids.clone() if head.endswith("MaskedLM") else ids % 4
        calls = [lambda m: m(ids, mask, labels=labels), lambda m: m(ids, mask, None, None, labels)]
    with torch.no_grad():
        for call in calls:
            torch.testing.assert_close(call(packed).loss, call(stock).loss, atol=1e-5, rtol=1e-5)
