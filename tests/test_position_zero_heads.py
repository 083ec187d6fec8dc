"""Heads that read position 0 (``classifier_pooling="cls"``: sequence classification, multiple choice) with a row
padded there (left padding, a row without real tokens): the encoder call runs the stock forward, so the head reads
what stock computes at that padded position; right-padded calls, mean pooling and a bare encoder stay packed
(adapters/token_labels.py ``position_zero_reader``, batch.unpad's position-0 count at the call's one sync). The
multiple-choice head reads each row's first real token, so only its rows without real tokens run the stock forward."""

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


@pytest.mark.parametrize("padded_outputs", ["auto", "all", 64])
@pytest.mark.parametrize("head", ["ModernBertForSequenceClassification", "ModernBertForMultipleChoice"])
def test_cls_heads_read_stocks_output_at_a_padded_position_zero(head, padded_outputs):
    """(``"all"`` / an int compute more trailing positions and keep this check: they gave zeros there, silently)"""
    model = make_model("base_like", cls=getattr(transformers, head), classifier_pooling="cls")
    stock = copy.deepcopy(model)
    pe.pack(model, padded_outputs=padded_outputs)
    with torch.no_grad():
        for side, lengths, to_stock in (("right", (5, 12, 9), False), ("left", (5, 12, 9), True),
                                        ("right", (5, 0, 9), True), ("left", (12, 12, 12), False)):
            inputs = _inputs(head, side, lengths)
            # the multiple-choice head reads each row's first real token: only a row without one reads padding
            to_stock = to_stock and (head != "ModernBertForMultipleChoice" or 0 in lengths)
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


@pytest.mark.parametrize("head", ["ModernBertForSequenceClassification", "ModernBertForMultipleChoice"])
def test_a_direct_head_forward_call_gets_stocks_logits(head):
    """``head.forward(...)`` runs no module hook (sentence-transformers v6's ``CrossEncoder`` calls the head so): the
    encoder itself knows the head around it, so a left-padded call still reads what stock computes at position 0."""
    model = make_model("base_like", cls=getattr(transformers, head), classifier_pooling="cls")
    stock = copy.deepcopy(model)
    pe.pack(model)
    inputs = _inputs(head, "left", (5, 0, 9) if head == "ModernBertForMultipleChoice" else (5, 12, 9))
    with torch.no_grad():
        got, want = model.forward(**inputs).logits, stock(**inputs).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert _zero_reasons(model) == 1


def test_multiple_choice_left_padding_stays_packed():
    """Stock's multiple-choice head reads ``attention_mask.argmax(-1)``, each row's first real token, which the packed
    path computes: left- and mixed-padded choices stay packed; a choice without real tokens runs stock."""
    model = make_model("base_like", cls=transformers.ModernBertForMultipleChoice, classifier_pooling="cls")
    stock = copy.deepcopy(model)
    pe.pack(model)
    ids, mask = padded_batch([5, 3, 9, 12], side="mixed")
    inputs = dict(input_ids=torch.stack((ids, ids.flip(0))), attention_mask=torch.stack((mask, mask.flip(0))))
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, stock(**inputs).logits, atol=1e-4, rtol=1e-4)
        assert not _stock_calls(model)
        inputs["attention_mask"][1, 2] = 0  # a choice without real tokens: its position 0 is read
        torch.testing.assert_close(model(**inputs).logits, stock(**inputs).logits, atol=1e-6, rtol=1e-6)
    assert _zero_reasons(model) == 1


def test_cross_encoder_with_left_padding_gets_stocks_scores(tmp_path):
    """sentence-transformers' ``CrossEncoder`` (v6 calls ``head.forward`` directly) with a left-padding tokenizer."""
    pytest.importorskip("sentence_transformers")
    from sentence_transformers import CrossEncoder

    from tests.tiny_tokenizer import TEXTS, build_tokenizer

    tokenizer = build_tokenizer()
    model = make_model("tiny", cls=transformers.ModernBertForSequenceClassification, vocab_size=len(tokenizer),
                       classifier_pooling="cls", num_labels=1)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    packed, stock = CrossEncoder(str(tmp_path), device="cpu"), CrossEncoder(str(tmp_path), device="cpu")
    for encoder in (packed, stock):
        encoder.tokenizer.padding_side = "left"
    pe.pack(packed)
    pairs = [(TEXTS[0], text) for text in TEXTS]
    torch.testing.assert_close(torch.as_tensor(packed.predict(pairs, batch_size=4)),
                               torch.as_tensor(stock.predict(pairs, batch_size=4)), atol=1e-6, rtol=1e-6)
    assert _zero_reasons(packed) >= 1


def test_repacking_the_encoder_alone_keeps_its_heads_reading():
    """``pe.pack(head)``, then ``pe.pack(head.model, ...)`` with other options, or after ``pe.unpack(head.model)``:
    the head around the encoder still reads position 0 until ``pe.unpack(head)`` (``padded_outputs="zeros"`` drops
    it, as documented)."""
    model = make_model("base_like", cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls")
    stock = copy.deepcopy(model)
    pe.pack(model)
    pe.pack(model.model, attention_backend="sdpa")
    inputs = _inputs("ModernBertForSequenceClassification", "left")
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, stock(**inputs).logits, atol=1e-6, rtol=1e-6)
    assert _zero_reasons(model) == 1
    # unpacked alone and packed alone again: the head still reads position 0; unpacking the head forgets it
    pe.unpack(model.model)
    pe.pack(model.model)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, stock(**inputs).logits, atol=1e-6, rtol=1e-6)
    assert _zero_reasons(model) == 1  # (a new state: its own count)
    pe.unpack(model)
    pe.pack(model.model)
    with torch.no_grad():
        model(**inputs)
    assert _zero_reasons(model) == 0


@pytest.mark.parametrize("mc_first", [False, True])
def test_an_encoder_shared_by_both_cls_heads_reads_column_zero(mc_first):
    """A multi-task model: a sequence-classification and a multiple-choice head on one encoder. Whichever is
    registered first, the sequence-classification head's left-padded calls run the stock forward (its position-0
    check covers the multiple-choice head's)."""
    seq = make_model("base_like", cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls")
    mc = make_model("base_like", cls=transformers.ModernBertForMultipleChoice, seed=1, classifier_pooling="cls")
    mc.model = seq.model
    heads = [("mc", mc), ("seq", seq)] if mc_first else [("seq", seq), ("mc", mc)]
    multi = torch.nn.ModuleDict(dict(heads))
    stock = copy.deepcopy(multi)
    pe.pack(multi)
    with torch.no_grad():
        for name, head in (("seq", "ModernBertForSequenceClassification"), ("mc", "ModernBertForMultipleChoice")):
            inputs = _inputs(head, "left")
            before = _zero_reasons(multi)
            got, want = multi[name](**inputs).logits, stock[name](**inputs).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert _zero_reasons(multi) == before + 1  # (the multiple-choice call too: the conservative check)


def test_the_fallback_warning_names_the_users_call_through_a_head():
    """The stock-forward warning points at the line calling the head, not at the head's own ``self.model(...)``."""
    import warnings

    head = make_model("base_like", cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls")
    pe.pack(head)
    inputs = _inputs("ModernBertForSequenceClassification", "left")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        head(**inputs)
    (w,) = [w for w in caught if "stock forward" in str(w.message)]
    assert w.filename == __file__, (w.filename, w.lineno)
