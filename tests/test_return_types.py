"""The packed forward returns what stock returns for every ``return_dict`` / ``output_hidden_states`` passed or
set in the config: the same type (``ModelOutput`` or tuple), keys, length and values, or the same error (stock heads
hand the backbone no ``return_dict``, so ``config.return_dict=False`` breaks them, and must break them packed too)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import transformers
from transformers.utils import ModelOutput

import packed_encoders as pe
from tests.helpers import make_model, padded_batch

UNSET = "unset"  # the argument is not passed
RETURN_DICT = [UNSET, None, True, False, 0, 1]
HIDDEN = [UNSET, None, True, False]
CASES = list(itertools.product([True, False], RETURN_DICT, HIDDEN, [False, True]))


def _call(model, inputs, case):
    config_return_dict, return_dict, hidden, config_hidden = case
    model.config.return_dict, model.config.output_hidden_states = config_return_dict, config_hidden
    kw = dict(inputs)
    if return_dict != UNSET:
        kw["return_dict"] = return_dict
    if hidden != UNSET:
        kw["output_hidden_states"] = hidden
    try:
        with torch.no_grad():
            return model(**kw)
    except Exception as error:  # noqa: BLE001 - a stock error is part of what stock does
        return error
    finally:
        model.config.return_dict, model.config.output_hidden_states = True, False


def _assert_like_stock(out, ref, case):
    where = f"(config.return_dict, return_dict, output_hidden_states, config.output_hidden_states) = {case}"
    assert type(out) is type(ref), f"{where}: {type(out).__name__} where stock returns {type(ref).__name__}"
    if isinstance(ref, Exception):
        assert str(out) == str(ref), where
    elif isinstance(ref, torch.Tensor):
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4, msg=lambda m: f"{where}: {m}")
    else:
        if not isinstance(ref, tuple):  # a ModelOutput
            assert list(out.keys()) == list(ref.keys()), where
            out, ref = out.to_tuple(), ref.to_tuple()
        assert len(out) == len(ref), where
        for a, b in zip(out, ref):
            _assert_like_stock(a, b, case)


def _check_grid(model, inputs, stock_inputs=None):
    reference = copy.deepcopy(model)  # stock's output recorders may leave hooks or forwards on the model they ran
    refs = [_call(reference, stock_inputs or inputs, case) for case in CASES]
    assert any(isinstance(r, tuple) for r in refs) and any(isinstance(r, ModelOutput) for r in refs)
    pe.pack(model)
    for case, ref in zip(CASES, refs):
        _assert_like_stock(_call(model, inputs, case), ref, case)
    assert not pe.describe(model)["encoders"][0]["stock_forward_calls"], "the packed path served every call"


@pytest.mark.parametrize("call", ["padded", "packed"])
def test_encoder_returns_what_stock_returns(call):
    model = make_model("tiny", num_hidden_layers=2)
    ids, mask = padded_batch([7, 7])  # no padding: every position compares with stock
    if call == "padded":
        _check_grid(model, dict(input_ids=ids, attention_mask=mask))
    else:
        n = ids.shape[1]
        _check_grid(model, dict(input_ids=ids[:1], cu_seq_lens_q=torch.tensor([0, n], dtype=torch.int32),
                                max_length_q=n), stock_inputs=dict(input_ids=ids[:1]))


@pytest.mark.parametrize("head", ["ModernBertForMaskedLM", "ModernBertForSequenceClassification"])
def test_head_returns_what_stock_returns(head):
    model = make_model("tiny", cls=getattr(transformers, head), num_hidden_layers=2)
    ids, mask = padded_batch([7, 7])
    _check_grid(model, dict(input_ids=ids, attention_mask=mask))
