"""Calls stock HF serves and the packed path does not reproduce run the stock forward (warned once, the reason in
describe()) instead of raising: masks with holes, output_attentions=True, layer-selecting output_hidden_states,
HF's dict of per-layer-type masks, a 4-D mask, torch.export. The patched forward keeps the stock forward's signature."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import packed_encoders as pe
from tests.helpers import make_model, padded_batch, stock


def _mask_mapping(model, ids, mask):
    from transformers.masking_utils import create_bidirectional_mask, create_bidirectional_sliding_window_mask

    embeds = model.embeddings(input_ids=ids)
    kw = dict(config=model.config, inputs_embeds=embeds, attention_mask=mask)
    return {"full_attention": create_bidirectional_mask(**kw),
            "sliding_attention": create_bidirectional_sliding_window_mask(**kw)}


CALLS = {
    "holes": lambda model, ids, mask: dict(attention_mask=mask.index_fill(1, torch.tensor([2]), 0)),
    "holes_positional": lambda model, ids, mask: dict(args=(ids, mask.index_fill(1, torch.tensor([2]), 0))),
    "output_attentions": lambda model, ids, mask: dict(attention_mask=mask, output_attentions=True),
    "hidden_states_list": lambda model, ids, mask: dict(attention_mask=mask, output_hidden_states=[1, 2]),
    "dict_mask": lambda model, ids, mask: dict(attention_mask=_mask_mapping(model, ids, mask)),
    "mask_4d": lambda model, ids, mask: dict(attention_mask=mask[:, None, None, :].expand(
        mask.shape[0], 1, mask.shape[1], mask.shape[1]).bool()),
}
REASONS = {"holes": "holes inside", "holes_positional": "holes inside", "output_attentions": "output_attentions",
           "hidden_states_list": "output_hidden_states=", "dict_mask": "dict of per-layer-type masks", "mask_4d": "4-D tensor"}


@pytest.mark.parametrize("case", list(CALLS))
def test_calls_stock_serves_run_the_stock_forward(case):
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12, 9])
    kw = CALLS[case](model, ids, mask)
    args = kw.pop("args", ())
    if not args:
        kw["input_ids"] = ids
    with torch.no_grad():
        ref = stock(model, **dict(zip(("input_ids", "attention_mask"), args)), **kw)
        with pytest.warns(RuntimeWarning, match=REASONS[case]):
            out = model(*args, **kw)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="packed_encoders")  # said once
            model(*args, **kw)
    for name in ("last_hidden_state", "hidden_states", "attentions"):
        a, r = getattr(out, name, None), getattr(ref, name, None)
        if isinstance(r, torch.Tensor):
            torch.testing.assert_close(a, r, atol=0, rtol=0)
        elif r is not None:
            assert len(a) == len(r)
            for x, y in zip(a, r):
                torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert REASONS[case] in pe.describe(model)["encoders"][0]["attention_fallbacks"][0]
    with warnings.catch_warnings():  # the next ordinary call is packed again, silently
        warnings.simplefilter("error")
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)
    assert "stock forward" not in str(pe.describe(model)["encoders"][0]["attention_fallbacks"])


def _stock_takes_transformers_kwargs() -> bool:
    """Whether stock ``ModernBertModel.forward`` takes HF v5's ``TransformersKwargs`` (``is_causal``,
    ``output_router_logits``, ...) as ``**kwargs``; v4's named its arguments and raises a TypeError for these."""
    from transformers import ModernBertModel

    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(ModernBertModel.forward).parameters.values())


def test_is_causal_true_runs_the_stock_forward_and_no_op_kwargs_are_ignored():
    """``is_causal`` and ``output_router_logits`` are keys of HF's ``TransformersKwargs``, which stock's forward
    takes: a false ``is_causal`` and any ``output_router_logits`` (ModernBERT has no router) cannot change stock's
    output and are ignored; ``is_causal=True`` asks for causal attention, which the packed path does not run, so the
    call runs the stock forward, warned and counted (both were refused as unsupported keyword arguments)."""
    if not _stock_takes_transformers_kwargs():
        pytest.skip("this transformers' ModernBertModel.forward takes no **kwargs (stock refuses these too)")
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12, 9])
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # packed, silently
            for kw in (dict(is_causal=False), dict(output_router_logits=False), dict(output_router_logits=True),
                       dict(is_causal=None)):
                got = model(input_ids=ids, attention_mask=mask, **kw).last_hidden_state
                torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert pe.describe(model)["encoders"][0]["stock_forward_calls"] == {}
        with pytest.warns(RuntimeWarning, match="running the stock forward: is_causal=True"):
            for kw in (dict(is_causal=True), dict(is_causal=True, attention_mask=mask)):  # no mask: stock is causal
                ref = stock(model, input_ids=ids, **kw).last_hidden_state
                torch.testing.assert_close(model(input_ids=ids, **kw).last_hidden_state, ref, atol=0, rtol=0)
    calls = pe.describe(model)["encoders"][0]["stock_forward_calls"]
    assert sum(n for reason, n in calls.items() if reason.startswith("is_causal=True")) == 2, calls


def test_mask_values_other_than_0_and_1_still_raise():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12])
    with pytest.raises(pe.PackedEncodersError, match="only 0 and 1"):
        model(input_ids=ids, attention_mask=mask * 2)


def test_patched_forward_keeps_the_stock_signature():
    model = make_model("base_like")
    before = inspect.signature(model.forward)
    pe.pack(model)
    assert inspect.signature(model.forward) == before
    assert "attention_mask" in inspect.signature(model.forward).parameters


def test_torch_export_of_a_packed_model_exports_the_stock_graph():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12, 9])
    with pytest.warns(RuntimeWarning, match="torch.export traces the stock forward"):
        program = torch.export.export(model, (), dict(input_ids=ids, attention_mask=mask))
    ids2, mask2 = padded_batch([7, 12, 3], seed=1)  # same shapes, other values
    with torch.no_grad():
        out = program.module()(input_ids=ids2, attention_mask=mask2).last_hidden_state
        ref = stock(model, input_ids=ids2, attention_mask=mask2).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_torch_jit_trace_of_a_packed_model_traces_the_stock_graph():
    """``torch.jit.trace`` would record the packed path's host reads (the batch's lengths) as constants: a trace
    replayed on a batch of the same shape with another token count failed inside it ("index out of range in self").
    The trace is the stock graph, as an exported one is, the reason warned and counted."""
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12, 9])
    with pytest.warns(RuntimeWarning, match="torch.jit.trace traces the stock forward"), torch.no_grad():
        traced = torch.jit.trace(model, example_kwarg_inputs=dict(input_ids=ids, attention_mask=mask), strict=False)
    ids2, mask2 = padded_batch([7, 12, 3], seed=1)  # same shape, 22 tokens instead of 26
    with torch.no_grad():
        out = traced(input_ids=ids2, attention_mask=mask2)["last_hidden_state"]
        ref = stock(model, input_ids=ids2, attention_mask=mask2).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert any("torch.jit.trace" in reason for reason in pe.describe(model)["encoders"][0]["stock_forward_calls"])


def test_strict_torch_export_of_a_packed_model_says_to_export_non_strict():
    """A strict export traces through dynamo, where torch.compile and export look alike (the packed forward runs
    outside dynamo's graph for both): the error names ``strict=False``, and the model still runs afterwards."""
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12, 9])
    with pytest.raises(Exception, match="strict=False"):
        torch.export.export(model, (), dict(input_ids=ids, attention_mask=mask), strict=True)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], atol=1e-5, rtol=1e-5)


def test_torch_func_grad_of_a_packed_model_runs_the_stock_forward():
    """Inside a ``torch.func`` transform the packed path steps aside (its training path's autograd functions do not
    support functorch): ``torch.func.grad`` over ``functional_call`` gives stock's gradients, the reason counted."""
    model = pe.pack(make_model("base_like")).train()
    ids, mask = padded_batch([5, 12, 9])
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(params):
        out = torch.func.functional_call(model, params, (), dict(input_ids=ids, attention_mask=mask))
        return out.last_hidden_state[mask.bool()].square().mean()

    with pytest.warns(RuntimeWarning, match="torch.func transform"):
        got = torch.func.grad(loss)(params)
    pe.unpack(model)
    ref = torch.func.grad(loss)(params)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-6, rtol=1e-5, msg=name)
    pe.pack(model)
    with torch.no_grad():  # outside a transform: the packed path again
        model(input_ids=ids, attention_mask=mask)
    calls = pe.describe(model)["encoders"][0]["stock_forward_calls"] or {}
    assert not calls, calls


def test_torch_compile_of_a_packed_model_runs_the_packed_forward_outside_the_graph():
    """``torch.compile`` of a packed model (or of a head around it) runs the packed forward as it is, outside the
    compiled graph (it reads the batch's lengths on the host): stock's outputs and gradients, no stock fallback.
    ``torch.export`` still traces the stock forward (``test_torch_export_of_a_packed_model_...`` above)."""
    import copy

    from transformers import ModernBertForSequenceClassification

    model = make_model("base_like")
    ref = copy.deepcopy(model)
    pe.pack(model)
    ids, mask = padded_batch([5, 12, 9], side="mixed")
    with torch.no_grad():
        got = torch.compile(model, backend="eager")(input_ids=ids, attention_mask=mask).last_hidden_state
        want = ref(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    real = mask.bool()
    torch.testing.assert_close(got[real], want.last_hidden_state[real], atol=1e-5, rtol=1e-5)
    assert not pe.describe(model)["encoders"][0]["stock_forward_calls"]

    head = make_model("base_like", cls=ModernBertForSequenceClassification, num_labels=3).train()
    head.config.classifier_pooling = "mean"
    stock_head = copy.deepcopy(head)
    pe.pack(head)
    labels = torch.tensor([0, 2, 1])
    for m, compiled in ((head, True), (stock_head, False)):
        torch.manual_seed(0)
        run = torch.compile(m, backend="eager") if compiled else m
        run(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert not pe.describe(head)["encoders"][0]["stock_forward_calls"]
    for (name, p), q in zip(head.named_parameters(), stock_head.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_mask_holes_in_another_number_of_rows_are_one_reason():
    """The fallback's reason does not carry the call's count of rows with holes: calls with holes in one row and
    in two rows warn once and share one ``stock_forward_calls`` entry."""
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12, 9])
    one, two = mask.clone(), mask.clone()
    one[1, 2] = 0
    two[1:, 2] = 0
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="holes inside some sequence"):
            model(input_ids=ids, attention_mask=one)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="packed_encoders")
            model(input_ids=ids, attention_mask=two)
    calls = pe.describe(model)["encoders"][0]["stock_forward_calls"]
    assert len(calls) == 1 and list(calls.values()) == [2], calls


def test_a_4d_mask_reason_does_not_vary_with_the_batch_shape():
    """A service passing 4-D masks of many shapes: one warning and one describe() entry counting every call, not one
    per shape (the per-model counts and the warnings registry would grow with every new width)."""
    model = pe.pack(make_model("tiny"))
    widths = (3, 5, 8, 13)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for s in widths:
            ids, mask = padded_batch([s, 2])
            model(input_ids=ids, attention_mask=mask[:, None, None, :].expand(2, 1, s, s).bool())
    said = [w for w in caught if "packed_encoders" in str(w.message)]
    assert len(said) == 1 and "4-D tensor" in str(said[0].message)
    assert list(pe.describe(model)["encoders"][0]["stock_forward_calls"].values()) == [len(widths)]


@pytest.mark.parametrize("positional", [False, True])
def test_ids_not_batch_by_width_with_a_per_query_mask_are_named(positional):
    """3-D ids with a 3-D mask (a stray batch dimension on both): stock fails inside with an IndexError, and the
    mask alone read as one per query and key ran stock, warned; the ids' shape is named instead, as without a mask,
    and nothing is counted as a stock call."""
    model = pe.pack(make_model("tiny"))
    ids, mask = padded_batch([5, 3])
    args, kw = (ids[None], mask[None]), {}
    if not positional:
        args, kw = (), dict(zip(("input_ids", "attention_mask"), args))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("error", message="packed_encoders")
        with pytest.raises(pe.PackedEncodersError, match=r"input_ids must be \[batch, seq_len\]; got shape \(1, 2, 5"):
            model(*args, **kw)
    assert not pe.describe(model)["encoders"][0].get("stock_forward_calls")


@pytest.mark.parametrize("ask", ["config", "torch"])
def test_a_deterministic_request_with_gradients_on_cuda_runs_the_stock_forward(monkeypatch, ask):
    """``config.deterministic_flash_attn`` (which HF passes to FlashAttention-2's backward) and torch's deterministic
    mode ask for a deterministic attention backward, which the packed training path does not give: a call with
    gradients on CUDA runs the stock forward, the reason counted and warned once; without gradients, or on CPU
    (plain PyTorch ops), the call stays packed; ``packed_forward`` with gradients raises. (The weights' device is
    faked: this machine has no GPU.)"""
    from packed_encoders.adapters import stock_calls

    model = pe.pack(make_model("base_like")).train()
    ids, mask = padded_batch([5, 12, 9])
    if ask == "config":
        model.config.deterministic_flash_attn = True
    else:
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)

    def stock_calls_seen():
        return sum((pe.describe(model)["encoders"][0].get("stock_forward_calls") or {}).values())

    model(input_ids=ids, attention_mask=mask)  # CPU: packed
    assert stock_calls_seen() == 0
    monkeypatch.setattr(stock_calls, "_on_cuda", lambda model: True)
    with pytest.warns(RuntimeWarning, match="deterministic attention"):
        out = model(input_ids=ids, attention_mask=mask)
    assert stock_calls_seen() == 1
    out.last_hidden_state[mask.bool()].square().mean().backward()  # stock's autograd graph
    ref = stock(model, input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, atol=0, rtol=0)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # no gradients: packed
    assert stock_calls_seen() == 1
    flat, cu = torch.ones(17, dtype=torch.long), torch.tensor([0, 5, 17], dtype=torch.int32)
    with pytest.raises(pe.PackedEncodersError, match="deterministic attention"):
        pe.packed_forward(model, None, flat, cu, 12)
    with torch.no_grad():
        pe.packed_forward(model, None, flat, cu, 12)


def test_a_flattened_call_run_by_the_stock_forward_says_its_sequences_attend_to_each_other():
    """A flattening collator's call (``cu_seq_lens_q``, batch 1) keeps its sequences apart on the packed path;
    sent to the stock forward (here by ``output_attentions=True``), SDPA reads no ``cu_seq_lens``, so they attend
    to each other: the warning and describe() say so, and the output is stock's."""
    model = pe.pack(make_model("tiny"))
    ids = torch.randint(5, 100, (1, 12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    kw = dict(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    with torch.no_grad():
        apart = torch.cat([model(input_ids=ids[:, a:b]).last_hidden_state for a, b in ((0, 5), (5, 12))], 1)
        torch.testing.assert_close(model(**kw).last_hidden_state, apart, atol=1e-5, rtol=1e-5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model(**kw, output_attentions=True).last_hidden_state
        ref = stock(model, **kw, output_attentions=True).last_hidden_state
    torch.testing.assert_close(out, ref)
    (said,) = [str(w.message) for w in caught if "packed_encoders" in str(w.message)]
    assert "output_attentions" in said and "sequences attend to each other" in said
    (reason,) = pe.describe(model)["encoders"][0]["stock_forward_calls"]
    assert "does not read cu_seq_lens_q" in reason
