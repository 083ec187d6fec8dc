"""What a target contributes (a question-answering head's trailing positions, query expansion, label checks, cls
marks) is applied whenever ``pack()`` is called with that target, even when the encoder's own state is kept, and
is kept for the encoder when it is packed again alone, until ``unpack()`` of a target holding the head or wrapper
(``adapters/around.py``). Compared against stock HF in fp32."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import transformers

import packed_encoders as pe
from packed_encoders.adapters.state import get_state
from tests.helpers import make_model, padded_batch

SPANS = dict(start_positions=torch.tensor([0, 3, 5]), end_positions=torch.tensor([2, 5, 6]))


def _qa(seed: int = 0):
    return make_model("tiny", cls=transformers.ModernBertForQuestionAnswering, seed=seed, num_labels=2)


def _qa_loss(model, side: str = "right"):
    ids, mask = padded_batch([3, 12, 7], side=side)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, **SPANS).loss


def _padded_outputs(model) -> str:
    return pe.describe(model)["encoders"][0]["padded_outputs"]


def _stock_calls(model) -> int:
    return sum((pe.describe(model)["encoders"][0].get("stock_forward_calls") or {}).values())


def _instance_state(model) -> dict:
    return {name: (dict(m.__dict__), dict(m._forward_pre_hooks), dict(m._forward_hooks))
            for name, m in model.named_modules()}


class ColBERTLike(torch.nn.Module):
    """A late-interaction wrapper with PyLate's attribute names: queries padded to ``query_length`` with masked
    positions it scores."""

    def __init__(self, encoder, query_length: int = 16):
        super().__init__()
        self.enc = encoder
        self.do_query_expansion, self.attend_to_expansion_tokens, self.query_length = True, False, query_length

    def forward(self, ids, mask):
        return self.enc(input_ids=ids, attention_mask=mask).last_hidden_state


def _expansion_error(wrapper, stock) -> float:
    ids, mask = padded_batch([3, 12, 7], pad_to=16)
    with torch.no_grad():
        return (wrapper(ids, mask) - stock(ids, mask))[mask == 0].abs().max().item()


def test_packing_a_head_over_its_packed_encoder_computes_its_trailing_positions():
    """``pe.pack(qa.model); pe.pack(qa)``: the encoder's state is kept (same options) and the head's needs are
    applied to it; ``describe()`` says so."""
    qa = _qa()
    stock = copy.deepcopy(qa)
    pe.pack(qa.model)
    state = get_state(qa.model)
    assert _padded_outputs(qa) == "zeros"
    pe.pack(qa)
    assert get_state(qa.model) is state  # kept: nothing of the encoder changed
    assert _padded_outputs(qa) == "trailing masked positions computed"
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)


def test_a_second_head_on_a_shared_packed_encoder_is_applied():
    """A token head and a question-answering head on one encoder: ``pe.pack(tok); pe.pack(qa)``."""
    tok = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=5)
    qa = _qa(seed=1)
    qa.model = tok.model
    stock = copy.deepcopy(qa)
    pe.pack(tok)
    pe.pack(qa)
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_qa_loss(qa, "left"), _qa_loss(stock, "left"), atol=1e-5, rtol=1e-5)
    assert _stock_calls(qa) == 1  # the left-padded loss call: qa's label check is on


def test_query_expansion_of_a_wrapper_packed_over_its_packed_encoder_is_watched():
    wrapper = ColBERTLike(make_model("tiny"))
    stock = copy.deepcopy(wrapper)
    pe.pack(wrapper.enc)
    assert _expansion_error(wrapper, stock) > 0.1  # the encoder alone: zeros at the expansion positions
    pe.pack(wrapper)
    assert _expansion_error(wrapper, stock) < 1e-5
    assert _padded_outputs(wrapper) == "trailing masked positions computed for calls <= 16 wide"
    wrapper.do_query_expansion = stock.do_query_expansion = False  # still followed per call
    assert _padded_outputs(wrapper) == "zeros"


@pytest.mark.parametrize("options", [dict(cuda_graph=False), dict(kernels="torch", validate=False),
                                     dict(attention_backend="sdpa"), dict(validate=False)])
def test_packing_the_encoder_again_alone_keeps_its_heads_needs(options):
    """``pe.pack(qa); pe.pack(qa.model, <another option>)``: the head around the encoder still reads its trailing
    positions and still checks its span loss (left padding runs the stock forward); with the state new (another
    option) or kept (``validate=False`` alone)."""
    qa = _qa()
    stock = copy.deepcopy(qa)
    pe.pack(qa)
    before = get_state(qa.model)
    pe.pack(qa.model, **options)
    assert (get_state(qa.model) is before) == (options == dict(validate=False))
    assert _padded_outputs(qa) == "trailing masked positions computed"
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_qa_loss(qa, "left"), _qa_loss(stock, "left"), atol=1e-5, rtol=1e-5)
    assert _stock_calls(qa) == 1


def test_packing_a_wrapped_encoder_again_alone_keeps_the_wrappers_expansion():
    wrapper = ColBERTLike(make_model("tiny"))
    stock = copy.deepcopy(wrapper)
    pe.pack(wrapper)
    pe.pack(wrapper.enc, cuda_graph=False)
    assert _expansion_error(wrapper, stock) < 1e-5
    pe.unpack(wrapper.enc)
    pe.pack(wrapper.enc)
    assert _expansion_error(wrapper, stock) < 1e-5
    pe.unpack(wrapper)  # forgets the wrapper's expansion: the encoder packed alone computes zeros there
    pe.pack(wrapper.enc)
    assert _padded_outputs(wrapper) == "zeros"
    assert _expansion_error(wrapper, stock) > 0.1


def test_unpacking_the_head_forgets_what_it_reads():
    """Kept from ``pe.pack(qa)`` until ``pe.unpack(qa)`` (or a pack of it with other ``padded_outputs``)."""
    qa = _qa()
    stock = copy.deepcopy(qa)
    pe.pack(qa)
    pe.unpack(qa.model)
    pe.pack(qa.model)
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)
    pe.unpack(qa)
    pe.pack(qa.model)
    assert _padded_outputs(qa) == "zeros"
    assert not torch.allclose(_qa_loss(qa), _qa_loss(stock), atol=1e-3)  # the encoder alone: zeros read
    pe.unpack(qa)
    pe.pack(qa)
    pe.pack(qa, padded_outputs="zeros")
    pe.pack(qa.model)
    assert _padded_outputs(qa) == "zeros"


def test_unpacking_the_encoder_takes_the_label_check_off_its_head():
    """``pe.unpack(head.model)`` leaves the head holding no packed encoder: its check comes off (the head pickles
    without packed_encoders' classes); packing the encoder again puts it back, as the head still reads its labels."""
    head = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=4)
    stock = copy.deepcopy(head)
    before = _instance_state(head)
    pe.pack(head)
    assert type(head.__dict__["forward"]).__name__ == "CheckedForward"
    pe.unpack(head.model)
    assert _instance_state(head) == before
    buffer = io.BytesIO()
    torch.save(head, buffer)
    assert b"CheckedForward" not in buffer.getvalue() and b"packed_encoders" not in buffer.getvalue()
    pe.pack(head.model)
    assert type(head.__dict__["forward"]).__name__ == "CheckedForward"
    ids, mask = padded_batch([5, 12, 9], side="left")
    kw = dict(input_ids=ids, attention_mask=mask, labels=ids % 4)  # labels counted at padded positions
    with torch.no_grad():
        torch.testing.assert_close(head(**kw).loss, stock(**kw).loss, atol=1e-5, rtol=1e-5)
    assert _stock_calls(head) == 1
    pe.pack(head.model, padded_outputs="zeros")  # no check asked for: the head's own forward again
    assert "forward" not in head.__dict__
    pe.pack(head.model)
    assert "forward" in head.__dict__
    pe.unpack(head)
    assert _instance_state(head) == before


def test_unpack_restores_every_module_after_packing_encoder_then_head():
    qa = _qa()
    before = _instance_state(qa)
    pe.pack(qa.model)
    pe.pack(qa)
    pe.pack(qa.model, attention_backend="sdpa")
    pe.unpack(qa)
    assert _instance_state(qa) == before

def test_validation_lengths_on_a_packed_model_validate_again():
    model = make_model("tiny")
    pe.pack(model)
    pe.pack(model, validation_lengths=[3, 10])
    assert get_state(model).report.lengths == (3, 10)
    with pytest.raises(pe.PackedEncodersError, match="list of positive ints"):
        pe.pack(model, validation_lengths=[])
    assert get_state(model).report.lengths == (3, 10)  # refused: the model is as it was
    with pytest.warns(RuntimeWarning, match="validation_lengths"):
        pe.pack(model, validate=False, validation_lengths=[3, 10])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pe.pack(model, validate=False)


def test_a_cls_head_packed_over_its_packed_encoder_marks_it():
    """``pe.pack(head.model); pe.pack(head)``: the kept state reads position 0 for the head (left padding there runs
    the stock forward)."""
    head = make_model("tiny", cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls")
    stock = copy.deepcopy(head)
    pe.pack(head.model)
    state = get_state(head.model)
    pe.pack(head)
    assert get_state(head.model) is state and state.position_zero is not None
    ids, mask = padded_batch([5, 12, 9], side="left")
    with torch.no_grad():
        torch.testing.assert_close(head(input_ids=ids, attention_mask=mask).logits,
                                   stock(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)
    assert _stock_calls(head) == 1


def test_unpacking_one_head_of_a_shared_encoder_keeps_the_others_needs():
    """``pe.pack(tok); pe.pack(qa)`` on one encoder, then ``pe.unpack(tok)``: the encoder is unpacked, neither head
    keeps an attribute of ours; packing it alone again honours ``qa`` (still recorded), not ``tok`` (forgotten)."""
    tok = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=5)
    qa = _qa(seed=1)
    qa.model = tok.model
    stock = copy.deepcopy(qa)
    before_tok, before_qa = _instance_state(tok), _instance_state(qa)
    pe.pack(tok)
    pe.pack(qa)
    pe.unpack(tok)
    assert _instance_state(tok) == before_tok and _instance_state(qa) == before_qa
    pe.pack(qa.model)
    assert "forward" not in tok.__dict__ and type(qa.__dict__["forward"]).__name__ == "CheckedForward"
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)
    pe.unpack(qa)
    assert _instance_state(tok) == before_tok and _instance_state(qa) == before_qa


def test_a_question_answering_head_beside_an_encoder_is_not_recorded_for_it():
    """A wrapper holding a question-answering head and another encoder: only the head's own encoder computes its
    trailing padded positions, and the other one, packed again alone, keeps the zeros convention."""
    wrapper = torch.nn.ModuleDict({"qa": _qa(), "other": make_model("tiny", seed=1)})
    pe.pack(wrapper, validate=False)
    assert get_state(wrapper["qa"].model).trailing_max_len is not None
    assert get_state(wrapper["other"]).trailing_max_len is None
    pe.unpack(wrapper["other"])
    pe.pack(wrapper["other"], validate=False)
    assert _padded_outputs(wrapper["other"]) == "zeros"
    assert _padded_outputs(wrapper["qa"]) == "trailing masked positions computed"


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_checked_head_is_recorded_around_its_copied_encoder(how):
    """A copy of a packed QA head, its encoder unpacked and packed again alone: the copy's check comes off with the
    unpack (no attribute of ours left) and back with the pack, and its trailing positions are computed again."""
    qa = _qa()
    stock = copy.deepcopy(qa)
    pe.pack(qa)
    if how == "deepcopy":
        twin = copy.deepcopy(qa)
    else:
        buffer = io.BytesIO()
        torch.save(qa, buffer)
        buffer.seek(0)
        twin = torch.load(buffer, weights_only=False)
    pe.unpack(twin.model)
    assert "forward" not in twin.__dict__ and "_replicate_for_data_parallel" not in twin.__dict__
    pe.pack(twin.model)
    assert _padded_outputs(twin) == "trailing masked positions computed"
    torch.testing.assert_close(_qa_loss(twin), _qa_loss(stock), atol=1e-5, rtol=1e-5)
    pe.unpack(twin)
    assert "forward" not in twin.__dict__
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)  # the original unchanged


@pytest.mark.parametrize("how", ["packed", "unpickled"])
def test_packing_a_shallow_copy_of_a_packed_encoder_leaves_the_original_as_it_was(how):
    """``copy.copy`` of a packed encoder shares its ``__dict__`` values (the state, and the forward that runs the
    original): ``pe.pack(copy)`` gives the copy a state and forward of its own, and the original's state, which its
    question-answering head reads, stays as it was; ``pe.unpack(copy)`` leaves the original packed. The same for a
    packed head saved and loaded (whose state names no owner)."""
    qa = _qa()
    stock = copy.deepcopy(qa)
    pe.pack(qa)
    if how == "unpickled":
        buffer = io.BytesIO()
        torch.save(qa, buffer)
        buffer.seek(0)
        qa = torch.load(buffer, weights_only=False)
    state = get_state(qa.model)
    twin = copy.copy(qa.model)
    assert get_state(twin) is state  # (what copy.copy makes)
    pe.pack(twin)
    assert _padded_outputs(qa) == "trailing masked positions computed"
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)
    assert get_state(qa.model) is state and get_state(twin) is not state
    assert twin.__dict__["forward"].module is twin and qa.model.__dict__["forward"].module is qa.model
    pe.unpack(twin)
    assert pe.is_packed(qa) and get_state(qa.model) is state
    torch.testing.assert_close(_qa_loss(qa), _qa_loss(stock), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("head", ["ModernBertForTokenClassification", "ModernBertForSequenceClassification",
                                  "ModernBertForQuestionAnswering"])
def test_a_head_whose_encoder_was_replaced_keeps_nothing_of_ours_once_its_new_encoder_is_unpacked(head, keep):
    """``pe.pack(head)``, then ``head.model = <another encoder>``: a copy or a save of the head does not carry the
    replaced encoder along, and ``pe.unpack(head.model)`` takes off what ``pack(head)`` put on the head (its mark,
    its label check), which names the replaced encoder; that one, outside the head now, stays packed."""
    import gc

    model = make_model("tiny", cls=getattr(transformers, head), num_labels=2)
    pe.pack(model)
    old = model.model
    model.model = make_model("tiny", seed=1)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert [m for m in twin.modules() if type(m).__name__ == "ModernBertModel"] == [twin.model]
        assert getattr(twin.__dict__.get("forward"), "encoders", ()) == ()  # (a check's: the old one's copy)
    if not keep:
        del old
        gc.collect()
    pe.unpack(model.model)
    assert not {"forward", "_replicate_for_data_parallel", "_packed_encoders_reads"} & set(model.__dict__)
    if keep:
        assert pe.is_packed(old)
        pe.unpack(old)
        assert not {"forward", "_replicate_for_data_parallel", "_packed_encoders"} & set(old.__dict__)


def _pack_hooked(hooks, model, **options):
    """An accelerate hook added on ``model``, then ``pe.pack(model, **options)`` (its warning that it replaces the
    hook's forward while packed left out)."""
    hooks.add_hook_to_module(model, hooks.ModelHook())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pe.pack(model, **options)


def test_a_class_forward_set_back_on_the_instance_is_reported_and_repacked():
    """accelerate's ``remove_hook_from_module`` on a module hooked before ``pack()`` sets the forward it saved (the
    class forward, bound) over the packed one: calls run stock. ``is_packed`` / ``describe()`` say so, and
    ``pack()`` again re-installs the packed forward."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = make_model("tiny")
    _pack_hooked(hooks, model)
    assert pe.is_packed(model)
    hooks.remove_hook_from_module(model)
    entry = pe.describe(model)["encoders"][0]
    assert not pe.is_packed(model) and not entry["packed"] and "remove_hook_from_module" in entry["bypassed"]
    pe.pack(model)
    assert pe.is_packed(model) and type(model.__dict__["forward"]).__name__ == "PackedForward"
    assert "bypassed" not in pe.describe(model)["encoders"][0]
    pe.unpack(model)
    assert not pe.is_packed(model)


@pytest.mark.parametrize("copied", [False, True])
def test_a_label_check_taken_off_a_head_by_accelerate_is_put_back(copied):
    """A head hooked by accelerate before ``pack()``, its hook removed after (the class forward set back over the
    label check): the next encoder call puts the check back and runs stock (its labels went unread), counted; the
    calls after are checked again. Left-padded labels at padded positions: the loss equals stock's throughout."""
    hooks = pytest.importorskip("accelerate.hooks")
    head = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=4)
    stock = copy.deepcopy(head)
    hooks.add_hook_to_module(head, hooks.ModelHook())
    pe.pack(head)
    if copied:  # a copy's check is recorded around its copied encoder too
        head = copy.deepcopy(head)
    hooks.remove_hook_from_module(head)
    ids, mask = padded_batch([5, 12, 9], side="left")
    kw = {"input_ids": ids, "attention_mask": mask, "labels": ids % 4}  # labels counted at padded positions
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            torch.testing.assert_close(head(**kw).loss, stock(**kw).loss, atol=1e-5, rtol=1e-5)
    assert type(head.__dict__["forward"]).__name__ == "CheckedForward"
    counts = pe.describe(head)["encoders"][0]["stock_forward_calls"]
    assert sum(n for reason, n in counts.items() if "label check was taken off" in reason) == 1
    assert any("label check was taken off" in str(w.message) for w in caught)


def test_a_wrapper_inside_a_container_keeps_its_query_expansion():
    """A ColBERT-style wrapper held by a container (``nn.ModuleDict``): packing the container, fresh or after the
    wrapper, computes the wrapper's expansion positions as stock does."""
    for first in (False, True):
        wrapper = ColBERTLike(make_model("tiny"), query_length=16)
        stock = copy.deepcopy(wrapper)
        container = torch.nn.ModuleDict({"colbert": wrapper})
        if first:
            pe.pack(wrapper)
        pe.pack(container)
        assert _padded_outputs(container).startswith("trailing masked positions computed"), first
        assert _expansion_error(wrapper, stock) < 1e-5, first


def test_two_wrappers_in_one_container_each_keep_their_query_expansion():
    """Two ColBERT-style wrappers (16- and 32-wide queries, e.g. a teacher and a student) packed through one
    container: each encoder computes the masked positions of the widest query any of them pads to, so the 32-wide
    queries of the second get stock's values there, whichever wrapper the container lists first."""
    for widths in ((16, 32), (32, 16)):
        wrappers = [ColBERTLike(make_model("tiny", seed=i), query_length=n) for i, n in enumerate(widths)]
        stock = copy.deepcopy(wrappers)
        container = torch.nn.ModuleDict({"a": wrappers[0], "b": wrappers[1]})
        pe.pack(container)
        for i in range(2):
            assert pe.describe(container)["encoders"][i]["padded_outputs"] == (
                "trailing masked positions computed for calls <= 32 wide"), widths
        ids, mask = padded_batch([3, 12, 7], pad_to=32)
        for wrapper, ref in zip(wrappers, stock):
            with torch.no_grad():
                got, want = wrapper(ids, mask), ref(ids, mask)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{widths}: {m}")


def test_describe_shows_what_the_heads_around_an_encoder_read():
    """``describe()["encoders"][0]["read_around"]``: a cls head's position-0 mark and the label-checking heads, kept
    when the encoder is packed again alone, gone with ``unpack(head)``."""
    tagger = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=4)
    pe.pack(tagger)
    assert pe.describe(tagger)["encoders"][0]["read_around"] == {
        "position_zero": None, "label_checks": ["ModernBertForTokenClassification"]}
    classifier = make_model("tiny", cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls")
    pe.pack(classifier)
    pe.unpack(classifier.model)
    pe.pack(classifier.model)
    assert pe.describe(classifier)["encoders"][0]["read_around"] == {"position_zero": "column 0", "label_checks": []}
    pe.unpack(classifier)
    pe.pack(classifier.model)
    assert pe.describe(classifier)["encoders"][0]["read_around"]["position_zero"] is None


def _copy(model, how: str):
    if how == "deepcopy":
        return copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_cls_head_keeps_its_mark_when_its_encoder_is_packed_again(how):
    """A copy of a packed ``classifier_pooling="cls"`` head, its encoder packed again alone with other options: the
    copy's left-padded calls still run stock where position 0 is padded (the mark came with the copy)."""
    head = make_model("tiny", cls=transformers.ModernBertForSequenceClassification, classifier_pooling="cls")
    stock = copy.deepcopy(head)
    pe.pack(head)
    twin = _copy(head, how)
    pe.pack(twin.model, kernels="torch")
    assert pe.describe(twin)["encoders"][0]["read_around"]["position_zero"] == "column 0"
    ids, mask = padded_batch([3, 12, 7], side="left")
    with torch.no_grad():
        torch.testing.assert_close(twin(input_ids=ids, attention_mask=mask).logits,
                                   stock(input_ids=ids, attention_mask=mask).logits, atol=1e-5, rtol=1e-5)
    pe.unpack(twin)
    assert "_packed_encoders_reads" not in twin.__dict__ and "_packed_encoders_reads" in head.__dict__


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copied_wrapper_keeps_its_query_expansion_when_its_encoder_is_packed_again(how):
    wrapper = ColBERTLike(make_model("tiny"), query_length=16)
    stock = copy.deepcopy(wrapper)
    pe.pack(wrapper)
    twin = _copy(wrapper, how)
    pe.unpack(twin.enc)
    pe.pack(twin.enc)
    assert _padded_outputs(twin).startswith("trailing masked positions computed")
    assert _expansion_error(twin, stock) < 1e-5


def test_a_copied_container_listing_the_encoder_first_follows_the_copied_wrappers_expansion():
    """A container holding the encoder before the wrapper that holds it: the copy's encoder state is copied before
    the wrapper, and the copy still follows the copied wrapper's settings, changed after the copy."""
    wrapper = ColBERTLike(make_model("tiny"), query_length=8)
    stock = copy.deepcopy(wrapper)
    pe.pack(wrapper)
    twin = copy.deepcopy(torch.nn.ModuleDict({"encoder": wrapper.enc, "colbert": wrapper}))["colbert"]
    twin.query_length = stock.query_length = 16
    assert _expansion_error(twin, stock) < 1e-5
    assert _padded_outputs(twin) == "trailing masked positions computed for calls <= 16 wide"


class _QueryExpansion(torch.nn.Module):
    """A sentence-transformers v6 style expansion source: a module with a ``query_expansion`` dict."""

    def __init__(self, length: int):
        super().__init__()
        self.query_expansion = {"length": length, "attend": False}


def test_a_copy_follows_every_expansion_source_copied_after_its_encoder():
    """A container listing the encoder before two expansion sources (8 and 32 wide): the copy computes the masked
    positions of 16-wide queries as the original does (each copied source takes over its original in the watch)."""
    encoder = make_model("tiny")
    stock = copy.deepcopy(encoder)
    box = torch.nn.ModuleDict({"encoder": encoder, "a": _QueryExpansion(8), "b": _QueryExpansion(32)})
    pe.pack(box)
    twin = copy.deepcopy(box)
    assert _padded_outputs(twin) == "trailing masked positions computed for calls <= 32 wide"
    ids, mask = padded_batch([3, 12, 7], pad_to=16)
    with torch.no_grad():
        want = stock(input_ids=ids, attention_mask=mask).last_hidden_state
        got = twin["encoder"](input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    twin["b"].query_expansion = {"length": 8, "attend": False}  # the copy's settings, not the original's
    assert _padded_outputs(twin) == "trailing masked positions computed for calls <= 8 wide"
    assert _padded_outputs(box) == "trailing masked positions computed for calls <= 32 wide"


@pytest.mark.parametrize("cls", [transformers.ModernBertForTokenClassification,
                                 transformers.ModernBertForSequenceClassification])
def test_unpack_leaves_no_mark_on_a_head_whose_encoder_was_replaced(cls):
    """``head.model = <another encoder>`` after ``pack(head)`` (the packed one collected): ``pe.unpack(head)`` leaves
    nothing of ours on the head, so it pickles without this package."""
    import gc
    import pickle

    head = make_model("tiny", cls=cls, num_labels=4, classifier_pooling="cls")
    pe.pack(head)
    head.model = make_model("tiny")
    gc.collect()
    pe.unpack(head)
    assert b"packed_encoders" not in pickle.dumps(head)


def test_a_forward_bound_again_by_accelerate_unwrap_model_is_called_right():
    """accelerate's ``unwrap_model(keep_fp32_wrapper=False)`` after a native-amp ``prepare`` sets
    ``MethodType(<the instance forward>, model)`` back: our forwards then get the module as their first argument."""
    from types import MethodType

    for cls in (None, transformers.ModernBertForTokenClassification):
        model = make_model("tiny", cls=cls, num_labels=4) if cls else make_model("tiny")
        stock = copy.deepcopy(model)
        pe.pack(model)
        model.forward = MethodType(model.forward, model)
        ids, mask = padded_batch([5, 9])
        with torch.no_grad():
            got, want = model(input_ids=ids, attention_mask=mask), stock(input_ids=ids, attention_mask=mask)
        key = "logits" if cls else "last_hidden_state"
        real = mask.bool()
        torch.testing.assert_close(got[key][real], want[key][real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padded_outputs", ["zeros", "all"])
def test_a_label_check_taken_off_on_purpose_keeps_its_encoder_packed(padded_outputs):
    """``pe.pack(head)`` then ``pe.pack(head.model, padded_outputs=...)``: the head's check comes off by design, and
    the encoder's calls stay packed (none runs stock as if the check had been taken off behind our back)."""
    head = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=4)
    pe.pack(head)
    pe.pack(head.model, padded_outputs=padded_outputs)
    ids, mask = padded_batch([5, 12, 9])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            head(input_ids=ids, attention_mask=mask)
    assert _stock_calls(head) == 0


def test_a_forward_bound_again_pickles_and_unpacks_clean():
    """After accelerate's ``unwrap_model(keep_fp32_wrapper=False)`` (``MethodType(<our forward>, module)``) a packed
    model pickles before any call, and ``unpack`` leaves nothing of ours."""
    import pickle
    from types import MethodType

    for cls in (None, transformers.ModernBertForTokenClassification):
        model = make_model("tiny", cls=cls, num_labels=4) if cls else make_model("tiny")
        pe.pack(model)
        model.forward = MethodType(model.forward, model)
        pickle.loads(pickle.dumps(model))
        pe.unpack(model)
        assert b"packed_encoders" not in pickle.dumps(model)


def test_an_encoder_copied_alone_keeps_the_expansion_length_and_not_the_wrapper():
    """A deepcopy of a wrapped encoder alone: its state keeps the expansion length read so far (it does not follow
    the original wrapper's later settings), and its pickle does not carry the original wrapper."""
    wrapper = ColBERTLike(make_model("tiny"), query_length=16)
    pe.pack(wrapper)
    alone = copy.deepcopy(wrapper.enc)
    wrapper.query_length = 4
    assert _padded_outputs(alone) == "trailing masked positions computed for calls <= 16 wide"
    buffer = io.BytesIO()
    torch.save(alone, buffer)
    assert b"ColBERTLike" not in buffer.getvalue()


@pytest.mark.parametrize("cls", [transformers.ModernBertForTokenClassification,
                                 transformers.ModernBertForQuestionAnswering])
def test_a_replaced_encoder_is_not_kept_alive_by_its_heads_label_check(cls):
    """``head.model = <another encoder>`` after ``pack(head)``: the head's label check holds the packed encoder it
    checked for weakly, so the replaced encoder (and its weights) is collected; copies of the head still check."""
    import gc
    import pickle
    import weakref

    head = make_model("tiny", cls=cls, num_labels=4 if cls is transformers.ModernBertForTokenClassification else 2)
    pe.pack(head)
    twin = pickle.loads(pickle.dumps(head))
    assert twin.__dict__["forward"].encoders == (twin.model,)
    assert copy.deepcopy(head).__dict__["forward"].encoders[0] is not head.model
    old = weakref.ref(head.model)
    head.model = make_model("tiny", seed=1)
    gc.collect()
    assert old() is None
    assert head.__dict__["forward"].encoders == ()


def test_a_hook_removed_after_pack_is_not_restored_by_unpack():
    """A hook added by accelerate before ``pack()`` and removed after (the class forward set back on the instance),
    ``pack()`` again, then ``unpack()``: the model runs and pickles as stock, not the removed hook's forward (which
    calls the ``_hf_hook`` attribute the removal deleted)."""
    import pickle

    hooks = pytest.importorskip("accelerate.hooks")
    model = make_model("tiny")
    stock = copy.deepcopy(model)
    _pack_hooked(hooks, model)
    hooks.remove_hook_from_module(model)
    pe.pack(model)
    pe.unpack(model)
    ids, mask = padded_batch([3, 12, 7])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   stock(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert b"packed_encoders" not in pickle.dumps(model)


@pytest.mark.parametrize("copied", [False, True])
def test_a_hook_removed_while_packed_leaves_the_model_picklable(copied):
    """A hook added by accelerate before ``pack()`` and removed while packed (no ``pack()`` since): the model (or its
    deepcopy, hooked and unhooked alike) pickles and copies as stock does, and ``unpack()`` of the unpickled one
    leaves the stock model; the removed hook's wrapper (a local function) is not kept as the forward to restore."""
    import pickle

    hooks = pytest.importorskip("accelerate.hooks")
    model = make_model("tiny")
    stock = copy.deepcopy(model)
    _pack_hooked(hooks, model, validate=False)
    if copied:
        model = copy.deepcopy(model)
    hooks.remove_hook_from_module(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    again = copy.deepcopy(model)
    ids, mask = padded_batch([3, 12, 7])
    for m in (model, loaded, again):
        pe.pack(m, validate=False)
        pe.unpack(m)
        assert b"packed_encoders" not in pickle.dumps(m)
        with torch.no_grad():
            torch.testing.assert_close(m(input_ids=ids, attention_mask=mask).last_hidden_state,
                                       stock(input_ids=ids, attention_mask=mask).last_hidden_state)


def test_unpack_again_takes_off_a_packed_forward_a_removed_hook_put_back():
    """``pack()``, a hook added, ``unpack()`` (the hook keeps the packed forward it wraps), the hook removed
    (accelerate sets that packed forward back on the instance): ``unpack()`` again leaves nothing of ours."""
    import pickle

    hooks = pytest.importorskip("accelerate.hooks")
    model = make_model("tiny")
    pe.pack(model)
    hooks.add_hook_to_module(model, hooks.ModelHook())
    pe.unpack(model)
    hooks.remove_hook_from_module(model)
    pe.unpack(model)
    assert "forward" not in model.__dict__
    assert b"packed_encoders" not in pickle.dumps(model)


class _CountingHook:
    """An accelerate ``ModelHook`` that counts the calls it wraps."""

    def __new__(cls):
        hooks = pytest.importorskip("accelerate.hooks")

        class Counting(hooks.ModelHook):
            calls = 0

            def pre_forward(self, module, *args, **kwargs):
                self.calls += 1
                return args, kwargs

        return Counting()


def _hidden(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def test_packing_again_under_a_hook_added_after_an_earlier_pack_keeps_the_hook():
    """``pack()``, a hook added (it wraps the packed forward), ``unpack()`` (the hook stays, its packed forward runs
    stock), ``pack()`` again: the hook keeps running, over the packed forward; the hook removed, ``unpack()`` leaves
    the class forward (not the removed hook's forward, which calls the ``_hf_hook`` the removal deleted and does not
    pickle)."""
    import pickle

    hooks = pytest.importorskip("accelerate.hooks")
    model = make_model("tiny")
    stock = copy.deepcopy(model)
    ids, mask = padded_batch([3, 12, 7])
    pad = mask == 0
    pe.pack(model)
    hook = _CountingHook()
    hooks.add_hook_to_module(model, hook)
    pe.unpack(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing of the user's is replaced: no warning
        pe.pack(model)
    assert pe.is_packed(model)
    got = _hidden(model, ids, mask)
    assert hook.calls == 1 and got[pad].abs().max() == 0  # through the hook, packed (zeros at padded positions)
    torch.testing.assert_close(got[~pad], _hidden(stock, ids, mask)[~pad], atol=1e-5, rtol=1e-5)
    hooks.remove_hook_from_module(model)
    pe.unpack(model)
    assert "forward" not in model.__dict__
    torch.testing.assert_close(_hidden(model, ids, mask), _hidden(stock, ids, mask))
    assert b"packed_encoders" not in pickle.dumps(model)


def test_a_hook_added_again_after_repacks_runs_stock_after_unpack():
    """As above, then the hook removed, ``pack()`` again with other options (a new packed forward), a hook added again
    and ``unpack()``: calls run stock (the packed forward under the hook had recorded the first hook's forward as the
    one to restore, which calls the packed forward again through ``_old_forward``: a RecursionError)."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = make_model("tiny")
    stock = copy.deepcopy(model)
    ids, mask = padded_batch([3, 12, 7])
    pe.pack(model)
    hooks.add_hook_to_module(model, hooks.ModelHook())
    pe.unpack(model)
    pe.pack(model)
    hooks.remove_hook_from_module(model)
    pe.pack(model, padded_outputs="zeros")
    hook = _CountingHook()
    hooks.add_hook_to_module(model, hook)
    pe.unpack(model)
    torch.testing.assert_close(_hidden(model, ids, mask), _hidden(stock, ids, mask))
    assert hook.calls == 1
    hooks.remove_hook_from_module(model)
    pe.unpack(model)
    assert "forward" not in model.__dict__


def test_a_heads_label_check_under_a_hook_follows_its_new_encoder():
    """A hook added over a packed head's label check, the head's encoder replaced and the head packed again: the
    check under the hook is brought up to date (not a second one stacked over the hook), so once the hook is removed
    (accelerate puts that check back on the instance) the new encoder's calls are checked: right-padded labels
    counted at padded positions give stock's loss."""
    import gc

    hooks = pytest.importorskip("accelerate.hooks")
    cls = transformers.ModernBertForTokenClassification
    head, stock = make_model("tiny", cls=cls, num_labels=4), make_model("tiny", cls=cls, num_labels=4)
    ids, mask = padded_batch([5, 12, 9])
    kw = {"input_ids": ids, "attention_mask": mask, "labels": ids % 4}  # labels counted at padded positions
    pe.pack(head)
    hooks.add_hook_to_module(head, hooks.ModelHook())
    head.model, stock.model = make_model("tiny", seed=1), make_model("tiny", seed=1)
    gc.collect()  # (the replaced packed encoder, which the old check held weakly)
    pe.pack(head)
    hooks.remove_hook_from_module(head)
    with torch.no_grad():
        torch.testing.assert_close(head(**kw).loss, stock(**kw).loss, atol=1e-5, rtol=1e-5)
    assert head.__dict__["forward"].encoders == (head.model,)


def test_packing_a_head_again_under_a_hook_keeps_one_label_check():
    """``pack(head)``, a hook added over its label check, ``unpack(head)``, ``pack(head)``: the hook wraps the one
    check, which checks again (not a second check stacked over the hook); the hook removed, ``unpack()`` leaves
    nothing of ours."""
    import pickle

    hooks = pytest.importorskip("accelerate.hooks")
    head = make_model("tiny", cls=transformers.ModernBertForTokenClassification, num_labels=4)
    stock = copy.deepcopy(head)
    ids, mask = padded_batch([5, 12, 9])
    kw = {"input_ids": ids, "attention_mask": mask, "labels": ids % 4}
    pe.pack(head)
    hooks.add_hook_to_module(head, hooks.ModelHook())
    pe.unpack(head)
    pe.pack(head)
    assert head._old_forward.encoders == (head.model,)  # the hook calls the check, brought up to date
    assert "CheckedForward" not in type(head.__dict__["forward"]).__name__
    with torch.no_grad():
        torch.testing.assert_close(head(**kw).loss, stock(**kw).loss, atol=1e-5, rtol=1e-5)
    hooks.remove_hook_from_module(head)
    pe.unpack(head)
    assert "forward" not in head.__dict__
    assert b"packed_encoders" not in pickle.dumps(head)


def test_a_wrappers_mark_stays_while_another_packed_encoder_reads_its_expansion():
    """A ColBERT-style wrapper and a head packed through one container: the head's encoder reads the wrapper's
    expansion settings too (every encoder inside the target does), so ``unpack(wrapper.enc)`` keeps the wrapper's
    mark, with which a copy of the container (the head listed first: its encoder copied before the wrapper) follows
    the copied wrapper's settings; unpacking the head as well takes the mark off."""
    import pickle

    from packed_encoders.adapters.around import MARK_ATTR

    wrapper = ColBERTLike(make_model("tiny"), query_length=16)
    head = make_model("tiny", cls=transformers.ModernBertForTokenClassification, seed=1, num_labels=4)
    box = torch.nn.ModuleDict({"head": head, "colbert": wrapper})
    pe.pack(box)
    pe.unpack(wrapper.enc)
    assert MARK_ATTR in wrapper.__dict__
    twin = copy.deepcopy(box)
    twin["colbert"].query_length = 8
    assert _padded_outputs(twin["head"]) == "trailing masked positions computed for calls <= 8 wide"
    assert _padded_outputs(head) == "trailing masked positions computed for calls <= 16 wide"
    pe.unpack(head)
    assert MARK_ATTR not in wrapper.__dict__ and b"packed_encoders" not in pickle.dumps(wrapper)


def test_a_heads_pickle_leaves_out_a_container_mates_wrapper_whose_expansion_its_encoder_reads():
    """A head and a ColBERT-style wrapper packed through one container: the head's encoder reads the wrapper's
    expansion settings, but pickling the head alone does not carry the wrapper (another model, whose accelerate
    hook would make the pickle fail); the unpickled head keeps the expansion length it read."""
    import io
    import pickle

    from accelerate.hooks import ModelHook, add_hook_to_module

    wrapper = ColBERTLike(make_model("tiny"), query_length=16)
    head = make_model("tiny", cls=transformers.ModernBertForTokenClassification, seed=1, num_labels=4)
    pe.pack(torch.nn.ModuleDict({"head": head, "colbert": wrapper}), validate=False)
    assert b"ColBERTLike" not in pickle.dumps(head)
    add_hook_to_module(wrapper, ModelHook())
    buf = io.BytesIO()
    torch.save(head, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)
    assert _padded_outputs(back) == "trailing masked positions computed for calls <= 16 wide"
