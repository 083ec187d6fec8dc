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


@pytest.mark.parametrize("padded_outputs", ["auto", "all", 64])
@pytest.mark.parametrize("head", ["ModernBertForTokenClassification", "ModernBertForMaskedLM"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_token_head_labels_at_padding_get_the_stock_loss(head, side, padded_outputs):
    """Labels that count at padded positions (built by hand, not -100 there): the loss and the gradients are
    stock's. Right padding: the encoder computes those trailing positions; left padding: the call runs the stock
    forward, counted by ``describe()``. Labels of -100 at padding keep the packed path's zeros there. ``"all"`` / an
    int (more trailing positions computed) keep the check (left padding gave a loss off stock's, silently)."""
    import copy

    cls = getattr(transformers, head)
    stock = make_model("base_like", cls=cls, num_labels=4).train()
    packed = copy.deepcopy(stock)
    pe.pack(packed, padded_outputs=padded_outputs)
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


@pytest.mark.parametrize("side", ["right", "left"])
def test_sparse_masked_lm_labels_at_its_ignore_index_do_not_count(side):
    """A masked-LM head with ``sparse_prediction`` drops every position whose label is ``sparse_pred_ignore_index``
    before its decoder and loss, so labels padded with that value (here 7, not -100) read nothing at padding: the
    call stays packed (no stock forward on left padding, no trailing positions on right padding), with stock's
    loss and gradients. Labels counted at padding (other values) still get stock's loss, as any head's."""
    import copy

    from packed_encoders.adapters import token_labels

    stock = make_model("base_like", cls=transformers.ModernBertForMaskedLM, sparse_prediction=True,
                       sparse_pred_ignore_index=7).train()
    packed = copy.deepcopy(stock)
    pe.pack(packed)
    ids, mask = padded_batch([5, 12, 9], side=side)
    labels = ids.masked_fill(mask == 0, 7)
    labels[:, ::3] = 7  # unmasked real positions: the sparse head skips them too
    requests = []
    real_request_for = token_labels.request_for

    def spy(*args, **kwargs):
        requests.append(real_request_for(*args, **kwargs))
        return requests[-1]

    for model in (stock, packed):
        model.zero_grad()
    token_labels.request_for = spy
    try:
        got = packed(input_ids=ids, attention_mask=mask, labels=labels).loss
    finally:
        token_labels.request_for = real_request_for
    ref = stock(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    got.backward()
    ref.backward()
    sp, pp = dict(stock.named_parameters()), dict(packed.named_parameters())
    for name, p in sp.items():
        if p.grad is not None:
            torch.testing.assert_close(pp[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert requests == [None]
    assert not pe.describe(packed)["encoders"][0].get("stock_forward_calls")
    # -100 is no ignore index of this head's sparse filter, but its loss ignores it: still not counted
    assert token_labels.request_for(ids.masked_fill(mask == 0, -100), mask, also_ignored=7) is None
    # labels of another value at padding count (the sparse head keeps those positions): stock's loss, as before
    counted = ids.clone()
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids, attention_mask=mask, labels=counted).loss,
                                   stock(input_ids=ids, attention_mask=mask, labels=counted).loss, atol=1e-5,
                                   rtol=1e-5)
    assert bool(pe.describe(packed)["encoders"][0].get("stock_forward_calls")) == (side == "left")


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


DIRECT_HEADS = ["ModernBertForTokenClassification", "ModernBertForMaskedLM", "ModernBertForQuestionAnswering"]


def _loss_arguments(head, ids):
    """Labels that count at padded positions: the ids themselves (masked LM), a class id everywhere (token
    classification), spans ending at the widest row's last positions (question answering: its softmax reads every
    position, and these positions are padding in the shorter rows)."""
    if head.endswith("QuestionAnswering"):
        width = ids.shape[1]
        return dict(start_positions=torch.tensor([0, width - 2, width - 3]),
                    end_positions=torch.tensor([2, width - 1, width - 1]))
    if head.endswith("MaskedLM"):
        return dict(labels=ids.clone())
    return dict(labels=ids % 4)


def _stock_calls(model) -> int:
    return sum((pe.describe(model)["encoders"][0].get("stock_forward_calls") or {}).values())


@pytest.mark.parametrize("head", DIRECT_HEADS)
@pytest.mark.parametrize("side", ["right", "left"])
def test_direct_forward_with_labels_at_padding_gets_the_stock_loss(head, side):
    """``head.forward(...)`` runs no module hook (PEFT's wrappers and sentence-transformers call heads so): its labels
    (span positions) are checked all the same, so the loss and the logits are stock's, padded positions included
    (right padding: trailing positions computed; left padding: the stock forward, counted)."""
    import copy

    cls = getattr(transformers, head)
    stock = make_model("tiny", cls=cls, num_labels=2 if head.endswith("QuestionAnswering") else 4)
    packed = pe.pack(copy.deepcopy(stock))
    ids, mask = padded_batch([5, 12, 9], side=side)
    kw = dict(input_ids=ids, attention_mask=mask, **_loss_arguments(head, ids))
    with torch.no_grad():
        ref = type(stock).forward(stock, **kw)
        got = packed.forward(**kw)
        positional = packed.forward(ids, mask, **{k: v for k, v in kw.items() if k not in ("input_ids",
                                                                                         "attention_mask")})
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(positional.loss, ref.loss, atol=1e-5, rtol=1e-5)
    for key in ("start_logits", "end_logits") if head.endswith("QuestionAnswering") else ("logits",):
        torch.testing.assert_close(getattr(got, key), getattr(ref, key), atol=1e-5, rtol=1e-5, msg=key)
    assert _stock_calls(packed) == (2 if side == "left" else 0)
    # the same call through __call__ is checked once (no second check, no second stock call)
    with torch.no_grad():
        torch.testing.assert_close(packed(**kw).loss, ref.loss, atol=1e-5, rtol=1e-5)
    assert _stock_calls(packed) == (3 if side == "left" else 0)


@pytest.mark.parametrize("head", ["ModernBertForTokenClassification", "ModernBertForQuestionAnswering"])
def test_direct_forward_of_a_copied_or_unpickled_packed_head_is_checked(head):
    """A deepcopy or a pickle round trip of a packed head: the copy's checked forward runs the copy's weights and
    still reads the labels of a direct ``forward`` call."""
    import copy
    import io

    cls = getattr(transformers, head)
    stock = make_model("tiny", cls=cls, num_labels=2 if head.endswith("QuestionAnswering") else 4)
    packed = pe.pack(copy.deepcopy(stock))
    buffer = io.BytesIO()
    torch.save(packed, buffer)
    buffer.seek(0)
    ids, mask = padded_batch([5, 12, 9], side="left")
    kw = dict(input_ids=ids, attention_mask=mask, **_loss_arguments(head, ids))
    for twin in (copy.deepcopy(packed), torch.load(buffer, weights_only=False)):
        assert twin.__dict__["forward"].module is twin and twin.__dict__["forward"].encoders == (twin.model,)
        with torch.no_grad():
            torch.testing.assert_close(twin.forward(**kw).loss, stock(**kw).loss, atol=1e-5, rtol=1e-5)
        assert _stock_calls(twin) == 1


@pytest.mark.parametrize("repack", [False, True])
def test_a_shallow_copy_of_a_packed_head_keeps_nothing_of_ours_once_unpacked(repack):
    """``copy.copy`` of a packed head shares its encoder and its ``__dict__`` values (the label check, which runs the
    original's forward): ``pe.pack(copy)`` gives the copy a check of its own, and ``pe.unpack(copy)`` unpacks the
    encoder they share, leaving nothing of ours on either head."""
    import copy

    cls = transformers.ModernBertForTokenClassification
    model = make_model("tiny", cls=cls, num_labels=4)
    stock = copy.deepcopy(model)
    before = _instance_state(model)
    pe.pack(model)
    twin = copy.copy(model)
    ids, mask = padded_batch([5, 12, 9], side="left")
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids % 4)
    if repack:
        pe.pack(twin)
        assert twin.__dict__["forward"].module is twin and twin.__dict__["forward"].previous == model.forward.previous
        assert model.__dict__["forward"].module is model
    with torch.no_grad():
        torch.testing.assert_close(twin.forward(**kw).loss, stock(**kw).loss, atol=1e-5, rtol=1e-5)
    pe.unpack(twin)
    assert _instance_state(model) == before
    assert not {"forward", "_replicate_for_data_parallel", "_packed_encoders_reads"} & set(twin.__dict__)


def _instance_state(model) -> dict:
    """Every module's instance attributes and hooks, to compare before ``pack()`` and after ``unpack()``."""
    return {name: (dict(m.__dict__), dict(m._forward_pre_hooks), dict(m._forward_hooks))
            for name, m in model.named_modules()}


@pytest.mark.parametrize("head", DIRECT_HEADS)
def test_unpack_leaves_no_trace_of_the_label_check(head):
    """``pe.unpack`` restores every module exactly: no instance attribute or hook left on the head or the encoder
    (an instance forward set before ``pack()`` comes back as it was); re-packing does not stack checks; a reference
    to the checked forward kept past ``unpack()`` runs the head's forward unchecked."""
    cls = getattr(transformers, head)
    model = make_model("tiny", cls=cls, num_labels=2 if head.endswith("QuestionAnswering") else 4)
    before = _instance_state(model)
    pe.pack(model)
    checked = model.__dict__["forward"]
    assert type(checked).__name__ == "CheckedForward" and isinstance(checked.previous, str)
    import inspect

    assert inspect.signature(model.forward) == inspect.signature(type(model).forward.__get__(model))
    pe.pack(model, attention_backend="sdpa")  # re-packed: the same check, not a second one around it
    assert model.__dict__["forward"] is checked
    pe.unpack(model)
    assert _instance_state(model) == before
    ids, mask = padded_batch([5, 12, 9], side="left")
    kw = dict(input_ids=ids, attention_mask=mask, **_loss_arguments(head, ids))
    with torch.no_grad():
        torch.testing.assert_close(checked(**kw).loss, type(model).forward(model, **kw).loss, atol=0, rtol=0)

    # an instance forward set before pack(): it runs under the check, and unpack() puts it back
    seen = []

    def own_forward(*args, **kwargs):
        seen.append(1)
        return type(model).forward(model, *args, **kwargs)

    model.forward = own_forward
    with torch.no_grad():
        ref = type(model).forward(model, **kw).loss  # unpacked: stock
    before = _instance_state(model)
    pe.pack(model)
    assert model.__dict__["forward"].previous is own_forward
    with torch.no_grad():
        torch.testing.assert_close(model.forward(**kw).loss, ref, atol=1e-5, rtol=1e-5)
    assert seen and _stock_calls(model) == 1
    pe.pack(model, padded_outputs="zeros")  # no check asked for: the head's forward is its own again
    assert model.__dict__["forward"] is own_forward
    pe.unpack(model)
    assert _instance_state(model) == before


def test_data_parallel_replicas_of_a_checked_head_run_their_own_weights():
    """``nn.DataParallel`` copies a replica's ``__dict__`` shallowly: each replica of a packed token head gets its own
    checked forward, which runs the replica's weights and still reads the labels."""
    import copy

    model = pe.pack(make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=4))
    replica = model._replicate_for_data_parallel()
    assert replica.forward.module is replica and model.forward.module is model
    replica._modules = {k: copy.deepcopy(v) for k, v in model._modules.items()}  # replicate() rewires children
    with torch.no_grad():
        for p in replica.parameters():
            p.mul_(2)
    stock = pe.unpack(copy.deepcopy(replica))
    ids, mask = padded_batch([5, 12, 9], side="left")
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids % 4)
    with torch.no_grad():
        torch.testing.assert_close(replica.forward(**kw).loss, stock(**kw).loss, atol=1e-5, rtol=1e-5)
    assert _stock_calls(replica) == 1 and _stock_calls(model) == 0
    pe.unpack(model)
    assert "_replicate_for_data_parallel" not in model.__dict__ and "forward" not in model.__dict__


def test_compiled_and_exported_heads_with_labels_at_padding_get_the_stock_loss():
    """``torch.compile`` of a packed head (or of its ``forward``): the label check runs outside the graph and the
    loss is stock's; a non-strict ``torch.export`` of a loss call traces the stock forward (no check: nothing to
    read on the host in a traced program) and gives stock's loss."""
    import copy
    import warnings

    cls = transformers.ModernBertForTokenClassification
    stock = make_model("tiny", cls=cls, num_labels=4)
    packed = pe.pack(copy.deepcopy(stock))
    ids, mask = padded_batch([5, 12, 9], side="left")
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids % 4)
    with torch.no_grad():
        ref = stock(**kw).loss
        for run in (torch.compile(packed, backend="eager"), torch.compile(packed.forward, backend="eager")):
            torch.testing.assert_close(run(**kw).loss, ref, atol=1e-5, rtol=1e-5)
    assert _stock_calls(packed) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the export's stock forward, warned once
        program = torch.export.export(packed, (), kw)
    torch.testing.assert_close(program.module()(**kw).loss, ref, atol=1e-5, rtol=1e-5)


def test_question_answering_with_eager_attention_gets_stocks_loss():
    """``attn_implementation="eager"``: a padded query with no key in its local window (farther than the half window
    from its row's last real token) averages every value in stock's eager attention, which the packed attention
    (as SDPA) does not: a question-answering loss call with such padding runs the stock forward, counted; a call
    whose padding stays within the half window of each row's real tokens, or without padding, stays packed."""
    import copy

    cls = transformers.ModernBertForQuestionAnswering
    stock = make_model("base_like", cls=cls, attn_implementation="eager", num_labels=2, local_attention=8)
    packed = copy.deepcopy(stock)
    pe.pack(packed)
    # half window 4: rows of 4 in 12 and of 7 in 12 are padded 8 and 5 past their real tokens; of 9, 3 past
    for lengths, to_stock in (((9, 4, 12), True), ((9, 7, 12), True), ((9, 12, 10), False), ((12, 12, 12), False)):
        ids, mask = padded_batch(list(lengths), side="right")
        spans = dict(start_positions=torch.tensor([1, 2, 3]), end_positions=torch.tensor([2, 2, 3]))
        before = sum((pe.describe(packed)["encoders"][0].get("stock_forward_calls") or {}).values())
        with torch.no_grad():
            got = packed(input_ids=ids, attention_mask=mask, **spans)
            want = stock(input_ids=ids, attention_mask=mask, **spans)
        after = sum((pe.describe(packed)["encoders"][0].get("stock_forward_calls") or {}).values())
        assert after == before + to_stock, lengths
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.start_logits, want.start_logits, atol=1e-4, rtol=1e-4)


def test_a_subclassed_head_is_checked_as_its_hf_head():
    """A user's subclass of an HF head (another class name) reads padded positions as its base class does: labels at
    padding get stock's loss, a QA subclass's trailing positions are computed, a cls subclass's left padding runs
    stock."""
    import copy

    class MyTagger(transformers.ModernBertForTokenClassification):
        pass

    class MyReader(transformers.ModernBertForQuestionAnswering):
        pass

    class MyClassifier(transformers.ModernBertForSequenceClassification):
        pass

    ids, mask = padded_batch([5, 12, 9], side="right")
    left_ids, left_mask = padded_batch([5, 12, 9], side="left")
    g = torch.Generator().manual_seed(3)
    cases = [(MyTagger, dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 4, ids.shape, generator=g))),
             (MyReader, dict(input_ids=ids, attention_mask=mask, start_positions=torch.tensor([1, 2, 3]),
                             end_positions=torch.tensor([2, 5, 3]))),
             (MyClassifier, dict(input_ids=left_ids, attention_mask=left_mask))]
    for cls, inputs in cases:
        stock = make_model("base_like", cls=cls, num_labels=2 if cls is MyReader else 4, classifier_pooling="cls")
        stock.loss_type = cls.__mro__[1].__name__.removeprefix("ModernBert")  # (HF picks a loss by class name)
        packed = pe.pack(copy.deepcopy(stock))
        with torch.no_grad():
            got, want = packed(**inputs), stock(**inputs)
        for key in ("loss", "logits", "start_logits"):
            if getattr(want, key, None) is not None:
                torch.testing.assert_close(getattr(got, key), getattr(want, key), atol=1e-5, rtol=1e-5,
                                           msg=f"{cls.__name__}.{key}")


def test_padded_outputs_all_with_eager_attention_gets_stocks_far_padding():
    """``padded_outputs="all"`` on an eager model: a row padded more than the half window past its real tokens runs
    the stock forward (warned with the option as the reason), so every trailing padded position is stock's."""
    stock = make_model("base_like", attn_implementation="eager", local_attention=8)
    packed = pe.pack(__import__("copy").deepcopy(stock), padded_outputs="all")
    ids, mask = padded_batch([9, 4, 12], side="right")  # the row of 4 is padded 8 past its real tokens (half window 4)
    with pytest.warns(RuntimeWarning, match=r"computed for this call \(padded_outputs"), torch.no_grad():
        got = packed(input_ids=ids, attention_mask=mask).last_hidden_state
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_question_answering_loss_with_a_row_without_real_tokens_gets_stocks_loss():
    """A span loss over a batch with a row without real tokens: its softmax reads stock's output there (attention
    over the row's padding), so the call runs the stock forward, counted."""
    import copy

    stock = make_model("base_like", cls=transformers.ModernBertForQuestionAnswering, num_labels=2)
    packed = pe.pack(copy.deepcopy(stock))
    ids, mask = padded_batch([9, 0, 12], side="right")
    spans = dict(start_positions=torch.tensor([1, 0, 3]), end_positions=torch.tensor([2, 0, 5]))
    with torch.no_grad():
        got, want = packed(input_ids=ids, attention_mask=mask, **spans), stock(input_ids=ids, attention_mask=mask,
                                                                                  **spans)
    torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
    calls = pe.describe(packed)["encoders"][0].get("stock_forward_calls") or {}
    assert any("without real tokens" in reason for reason in calls), calls


def test_a_head_calling_its_encoder_twice_gets_its_label_check_on_both_calls():
    """A user's head whose forward runs its encoder twice (two views averaged): labels at padded positions get
    stock's loss, the request holding for both encoder calls (right padding: trailing positions computed; left:
    the stock forward)."""
    import copy

    import torch.nn.functional as F

    class TwoPass(transformers.ModernBertForTokenClassification):
        def forward(self, input_ids, attention_mask, labels=None):
            h1 = self.model(input_ids=input_ids.flip(0), attention_mask=attention_mask.flip(0)).last_hidden_state
            h2 = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            logits = self.classifier(self.head((h1.flip(0) + h2) / 2))
            loss = F.cross_entropy(logits.view(-1, self.num_labels), labels.view(-1))
            return transformers.modeling_outputs.TokenClassifierOutput(loss=loss, logits=logits)

    stock = make_model("base_like", cls=TwoPass, num_labels=2)
    packed = pe.pack(copy.deepcopy(stock))
    for side in ("right", "left"):
        ids, mask = padded_batch([5, 12, 9], side=side)
        with torch.no_grad():
            got, want = packed(ids, mask, ids % 2), stock(ids, mask, ids % 2)  # labels count at padded positions
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5, msg=side)
