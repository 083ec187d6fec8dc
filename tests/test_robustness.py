"""What the packed forward cannot reproduce is refused or falls back to stock, never skipped silently."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import transformers
from torch import nn

import packed_encoders as pe
from tests.helpers import make_model, padded_batch, stock, stock_positions


class Wrapped(nn.Linear):
    """A Linear subclass with its own forward (LoRA-like wrappers and quantised layers look like this)."""

    def forward(self, x):
        return super().forward(x) * 1.5


class WrappedNorm(nn.LayerNorm):
    """A LayerNorm subclass with its own forward: the packed path would skip it."""

    def forward(self, x):
        return super().forward(x) * 1.5


def _out(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def test_pack_calls_a_wrapped_linear_and_refuses_a_wrapped_norm_and_hooks():
    model = make_model("base_like")
    old = model.layers[1].attn.Wqkv
    model.layers[1].attn.Wqkv = new = Wrapped(old.in_features, old.out_features, bias=False)
    new.weight = old.weight
    pe.pack(model)  # a projection slot's module is called: its forward runs (validated against stock)
    assert pe.describe(model)["encoders"][0]["module_calls"] == [f"layers.1.attn.Wqkv ({__name__}.Wrapped)"]
    ids, mask = padded_batch([5, 12])
    ref = stock(model, input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask)).last_hidden_state
    torch.testing.assert_close(_out(model, ids, mask)[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)
    model = make_model("base_like")
    old = model.layers[1].mlp_norm
    model.layers[1].mlp_norm = WrappedNorm(old.normalized_shape, eps=old.eps, bias=old.bias is not None)
    with pytest.raises(pe.UnsupportedTargetError, match=r"layers\.1\.mlp_norm is a .*WrappedNorm"):
        pe.pack(model)
    model = make_model("base_like")
    model.layers[0].mlp.register_forward_hook(lambda m, i, o: o * 0)
    with pytest.raises(pe.UnsupportedTargetError, match="forward hooks"):
        pe.pack(model)


@pytest.mark.parametrize("change", ["hook", "swap", "prune", "causal"])
def test_changes_after_pack_run_the_stock_forward(change):
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12])
    if change == "hook":
        model.layers[2].mlp.register_forward_hook(lambda m, i, o: o * 0)
    elif change == "causal":  # transformers' sdpa reads it per call
        model.layers[1].attn.is_causal = True
    elif change == "swap":
        old = model.layers[0].mlp_norm
        new = WrappedNorm(old.normalized_shape, eps=old.eps, bias=old.bias is not None)
        new.load_state_dict(old.state_dict())
        model.layers[0].mlp_norm = new
    else:
        model.layers = model.layers[:2]
        model.config.num_hidden_layers = 2
    with pytest.warns(RuntimeWarning, match="stock forward"):
        out = _out(model, ids, mask)
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert "stock forward" in pe.describe(model)["encoders"][0]["attention_fallbacks"][0]
    with pytest.raises(pe.PackedEncodersError, match="cannot run this model"):
        pe.packed_forward(model, None, ids[0], torch.tensor([0, ids.shape[1]], dtype=torch.int32), ids.shape[1])


def test_causal_attention_is_refused_and_packs_again_when_set_back():
    model = make_model("base_like")
    model.layers[3].attn.is_causal = True
    with pytest.raises(pe.UnsupportedTargetError, match=r"layers\.3\.attn\.is_causal is True"):
        pe.pack(model)
    model.layers[3].attn.is_causal = False
    pe.pack(model)
    ids, mask = padded_batch([5, 12])
    model.layers[3].attn.is_causal = True
    with pytest.warns(RuntimeWarning, match="is_causal"):
        _out(model, ids, mask)
    model.layers[3].attn.is_causal = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _out(model, ids, mask)
    assert pe.is_packed(model)


@pytest.fixture
def custom_attention():
    """A function registered in transformers' AttentionInterface (as a user or a hub kernel registers one): it
    computes sdpa's attention scaled by 2 in its output, so skipping it shows; unregistered after the test."""
    registry = pytest.importorskip("transformers.modeling_utils").AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def doubled(module, *args, **kwargs):
        out, weights = sdpa_attention_forward(module, *args, **kwargs)
        return 2 * out, weights

    registry.register("doubled_test", doubled)
    yield "doubled_test"
    registry._global_mapping.pop("doubled_test", None)


def test_an_attention_function_of_ones_own_is_refused_and_runs_stock_after_pack(custom_attention):
    """transformers resolves config._attn_implementation on every call: a registered function other than its own
    sdpa / flash / flex / eager is what stock runs, so pack() refuses it and a call after pack() runs stock."""
    model = make_model("base_like")
    if not hasattr(sys.modules[type(model).__module__], "ALL_ATTENTION_FUNCTIONS"):
        pytest.skip("this transformers' ModernBERT has no attention registry")
    model.config._attn_implementation = custom_attention
    with pytest.raises(pe.UnsupportedTargetError, match=r"_attn_implementation is 'doubled_test', a registered .*"
                                                        r"doubled.*set_attn_implementation\('sdpa'\)"):
        pe.pack(model)
    model.config._attn_implementation = "sdpa"
    pe.pack(model)
    ids, mask = padded_batch([5, 12])
    packed = _out(model, ids, mask)
    model.config._attn_implementation = custom_attention
    with pytest.warns(RuntimeWarning, match="doubled_test"):
        out = _out(model, ids, mask)
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert (out - packed)[mask.bool()].abs().max() > 1e-2  # (the custom function changes the result)
    model.config._attn_implementation = "not_registered"  # stock fails on its next call: so does the packed model
    with pytest.raises(KeyError):
        stock(model, input_ids=ids, attention_mask=mask)
    with pytest.raises(KeyError), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _out(model, ids, mask)
    for name in ("flash_attention_2", "flex_attention", "eager", "sdpa"):  # transformers' own: the packed forward
        model.config._attn_implementation = name
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            torch.testing.assert_close(_out(model, ids, mask), packed, atol=0, rtol=0)


def test_transformers_4s_fixed_attention_table_is_checked_by_function():
    """transformers 4's ModernBERT calls MODERNBERT_ATTENTION_FUNCTION[name]: a name outside it fails in stock and
    an entry replaced by another function is what stock runs (a stand-in module with that table)."""
    from types import ModuleType

    from packed_encoders.adapters.structure import attention_problem

    def eager_attention_forward(*args):
        pass

    def sdpa_attention_forward(*args):
        pass

    def flash_attention_forward(*args):
        pass

    table = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward,
             "flash_attention_2": flash_attention_forward}
    hf = ModuleType("modeling_modernbert_v4")
    hf.MODERNBERT_ATTENTION_FUNCTION, hf.eager_attention_forward = table, eager_attention_forward
    hf.sdpa_attention_forward, hf.flash_attention_forward = sdpa_attention_forward, flash_attention_forward
    assert attention_problem(hf, "sdpa") is None and attention_problem(hf, "eager") is None
    assert attention_problem(hf, None) is None
    assert "does not have" in attention_problem(hf, "flex_attention")
    assert attention_problem(hf, "flash_attention_2") is None
    table["sdpa"] = lambda *args: None
    assert "another function" in attention_problem(hf, "sdpa")


@pytest.mark.parametrize("name", [None, "paged|sdpa", "paged|flex_attention", "sdpa"])
def test_an_attention_name_stock_builds_no_mask_for_or_a_registered_mask_function_runs_stock(name):
    """transformers builds the attention masks per call through its AttentionMaskInterface: for a name outside its
    global mapping (None, a 'paged|' name) stock builds none (it attends to padding and past the window), and a mask
    function registered there (under 'sdpa' too) is what stock runs: the packed model runs stock, warned."""
    mu = pytest.importorskip("transformers.masking_utils")
    model = make_model("base_like")
    if not hasattr(sys.modules[type(model).__module__], "ALL_ATTENTION_FUNCTIONS"):
        pytest.skip("this transformers' ModernBERT has no attention registry")
    pe.pack(model)
    ids, mask = padded_batch([5, 40])
    packed = _out(model, ids, mask)
    before = dict(mu.AttentionMaskInterface._global_mapping)
    try:
        if name == "sdpa":  # a mask function of one's own for sdpa, registered globally
            mu.AttentionMaskInterface.register("sdpa", lambda *args, **kwargs: None)
        model.config._attn_implementation = name
        with pytest.warns(RuntimeWarning, match="_attn_implementation is"):
            out = _out(model, ids, mask)
        assert not pe.is_packed(model)
        with torch.no_grad():
            ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(out, ref, atol=0, rtol=0)
        assert (out - packed)[mask.bool()].abs().max() > 1e-3  # (stock's unmasked attention differs)
    finally:
        mu.AttentionMaskInterface._global_mapping.clear()
        mu.AttentionMaskInterface._global_mapping.update(before)
    model.config._attn_implementation = "sdpa"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(_out(model, ids, mask), packed, atol=0, rtol=0)
    assert pe.is_packed(model)


@pytest.mark.parametrize("keep, refusal, advice", [
    ((1, 0, 3, 2), "reordered", "config.layer_types = [layer.attention_type for layer in model.layers]"),
    ((1, 2), "model.layers has 2 layers",
     "config.num_hidden_layers = 2 and config.layer_types = [layer.attention_type"),
])
def test_reordered_or_pruned_layers_get_advice_that_packs_them(keep, refusal, advice):
    """The refusal says what to set; doing just that packs the model, which then matches stock."""
    model = make_model("base_like")
    model.layers = torch.nn.ModuleList([model.layers[i] for i in keep])
    with pytest.raises(pe.UnsupportedTargetError, match=refusal) as info:
        pe.pack(model)
    assert advice in str(info.value)
    model.config.num_hidden_layers = len(keep)
    model.config.layer_types = [layer.attention_type for layer in model.layers]
    pe.pack(model)
    ids, mask = padded_batch([5, 12])
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(_out(model, ids, mask)[mask.bool()], ref[mask.bool()], atol=2e-5, rtol=1e-4)


def test_sliding_window_changed_after_pack_is_not_skipped():
    """transformers builds the sliding-window mask from the config on every call; a window set after pack() runs
    the stock forward (warned, in describe()) until the model is re-packed, and packed_forward refuses."""
    model = pe.pack(make_model("base_like"))
    packed_with = model.config.local_attention
    ids, mask = padded_batch([5, 12, 16])
    model.config.local_attention = 4  # transformers v5: config.sliding_window = 2
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    with pytest.warns(RuntimeWarning, match=r"config\.local_attention is 4 \(sliding_window 2\)"):
        out = _out(model, ids, mask)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert "sliding_window" in pe.describe(model)["encoders"][0]["attention_fallbacks"][0]
    with pytest.raises(pe.PackedEncodersError, match="sliding_window"):
        pe.packed_forward(model, None, ids[1, :12], torch.tensor([0, 12], dtype=torch.int32), 12)

    pe.pack(model)  # packing again (same options) re-reads the config: the new window
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        real = mask.bool()
        torch.testing.assert_close(_out(model, ids, mask)[real], ref[real], atol=1e-5, rtol=1e-5)
    assert not pe.describe(model)["encoders"][0]["stock_forward_calls"]  # the packed path, not stock again
    model.config.local_attention = packed_with  # back to a window the packed state does not hold
    with pytest.warns(RuntimeWarning, match="stock forward"):
        _out(model, ids, mask)


@pytest.mark.parametrize("edit", ["in_place", "one_type", "new_config"])
def test_layer_types_changed_after_pack_are_not_skipped(edit):
    """transformers v5 reads config.layer_types on every call (the rotary tables of the types it lists, while each
    layer keeps the attention_type it was built with): an edit after pack() runs the stock forward, whatever stock
    then does (same output, or its own error), warned and in describe(); packed_forward refuses; set back, the
    packed path runs again."""
    model = pe.pack(make_model("base_like"))  # full, sliding, sliding, full
    ids, mask = padded_batch([5, 12, 16])
    _out(model, ids, mask)  # the per-call snapshot (and its copy of the config's values) exists
    packed_with = list(model.config.layer_types)
    if edit == "in_place":  # the same list object: a comparison of values, not of identity
        model.config.layer_types[0], model.config.layer_types[1] = packed_with[1], packed_with[0]
    elif edit == "one_type":
        model.config.layer_types = ["full_attention"] * len(packed_with)
    else:
        config = copy.deepcopy(model.config)
        config.layer_types = packed_with[::-1][1:] + packed_with[:1]
        model.config = config
    now = model.config.layer_types
    first = next(i for i, (a, b) in enumerate(zip(now, packed_with)) if a != b)
    try:
        ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    except Exception as e:  # (transformers 5.24: a KeyError for the type no longer listed)
        ref = e
    with pytest.warns(RuntimeWarning, match=rf"config\.layer_types\[{first}\] is '{now[first]}'"):
        if isinstance(ref, Exception):
            with pytest.raises(type(ref)):
                _out(model, ids, mask)
        else:
            torch.testing.assert_close(_out(model, ids, mask), ref, atol=0, rtol=0)
    assert "config.layer_types" in pe.describe(model)["encoders"][0]["attention_fallbacks"][0]
    with pytest.raises(pe.PackedEncodersError, match=r"config\.layer_types"):
        pe.packed_forward(model, None, ids[1, :12], torch.tensor([0, 12], dtype=torch.int32), 12)

    model.config.layer_types = list(packed_with)
    calls = pe.describe(model)["encoders"][0]["stock_forward_calls"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        real = mask.bool()
        ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(_out(model, ids, mask)[real], ref[real], atol=1e-5, rtol=1e-5)
    assert pe.describe(model)["encoders"][0]["stock_forward_calls"] == calls  # the packed path, not stock again


def test_packed_forward_checks_the_modules_before_a_graph_could_run():
    """packed_forward reads the live module tree on every call, also where a captured graph would serve it."""
    model = pe.pack(make_model("base_like"))
    model.layers[0].mlp.register_forward_hook(lambda m, i, o: o * 0)
    with pytest.raises(pe.PackedEncodersError, match="forward hooks"):
        pe.packed_forward(model, None, torch.tensor([5, 6, 7]), torch.tensor([0, 3], dtype=torch.int32), 3)


@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_hook_registered_into_a_new_hook_dict_is_seen(kind):
    """Code that clears hooks by assigning a fresh dict, then registers one: the per-call check reads the live
    dicts, so the stock forward runs (the hook is not skipped)."""
    import collections

    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 12])
    _out(model, ids, mask)  # the structure snapshot exists
    mod = model.layers[0].mlp.Wi
    if kind == "forward":
        mod._forward_hooks = collections.OrderedDict()
        mod.register_forward_hook(lambda m, i, o: o * 0)
    else:
        mod._forward_pre_hooks = collections.OrderedDict()
        mod.register_forward_pre_hook(lambda m, i: (i[0] * 0,))
    with pytest.warns(RuntimeWarning, match="stock forward"):
        out = _out(model, ids, mask)
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_mc_dropout_modules_are_honoured():
    model = pe.pack(make_model("base_like", embedding_dropout=0.2, mlp_dropout=0.2))
    ids, mask = padded_batch([9, 14])
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.train()  # Monte-Carlo dropout: the model stays in eval mode
    a, b = _out(model, ids, mask), _out(model, ids, mask)
    assert (a - b).abs().max() > 1e-3
    model.eval()
    torch.testing.assert_close(_out(model, ids, mask), _out(model, ids, mask), atol=0, rtol=0)


def test_padding_row_gets_no_gradient():
    model = make_model("base_like")
    ids = torch.randint(3, 200, (1, 9))
    ids[0, 2] = model.config.pad_token_id  # the pad id at a real position (a call without a mask)
    pe.pack(model).train()
    model(input_ids=ids).last_hidden_state.pow(2).sum().backward()
    grad = model.embeddings.tok_embeddings.weight.grad
    assert grad[model.config.pad_token_id].abs().sum() == 0 and grad.abs().sum() > 0


def test_resized_embeddings_after_pack():
    model = pe.pack(make_model("base_like"))
    model.resize_token_embeddings(260)
    ids = torch.tensor([[250, 7, 9]])
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
        ref = stock(model, input_ids=ids).last_hidden_state
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("local_attention", [0, 1, 2, 5])
def test_tiny_windows_match_stock(local_attention):
    model = make_model("base_like", local_attention=local_attention)
    ids, mask = padded_batch([7, 13, 1])
    with torch.no_grad():
        ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
        out = _out(pe.pack(model), ids, mask)
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)


def test_float_position_ids_are_refused():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([4, 6])
    with pytest.raises(pe.PackedEncodersError, match="integer"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.zeros(2, 6))


def test_data_parallel_replicas_run_their_own_weights():
    model = pe.pack(make_model("base_like"))
    replica = model._replicate_for_data_parallel()
    assert replica.forward.module is replica and replica._packed_encoders is not model._packed_encoders
    ids, mask = padded_batch([5, 8])
    import copy

    # replicate() also replicates every submodule and rewires them; emulate that, then give the replica
    # other weights: it must run its own.
    replica._modules = {k: copy.deepcopy(v) for k, v in model._modules.items()}
    with torch.no_grad():
        for p in replica.parameters():
            p.mul_(2)
        assert (_out(replica, ids, mask) - _out(model, ids, mask)).abs().max() > 1e-3
        ref = stock(replica, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(_out(replica, ids, mask)[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)
    pe.unpack(model)
    assert "_replicate_for_data_parallel" not in model.__dict__


@pytest.mark.parametrize("side", ["right", "left"])
def test_question_answering_loss_matches_stock(side):
    """The span loss's softmax reads every position: right padding is computed as stock computes it (trailing
    positions), a loss call with left padding runs the stock forward (warned, counted by ``describe()``); the
    logits of a call without labels stay packed, equal to stock's on real tokens."""
    model = make_model("base_like", cls=transformers.ModernBertForQuestionAnswering)
    ids, mask = padded_batch([5, 9, 3], side=side)
    kw = dict(input_ids=ids, attention_mask=mask, start_positions=torch.tensor([0, 1, 2]),
              end_positions=torch.tensor([2, 3, 2]))
    with torch.no_grad():
        ref = model(**kw)
        pe.pack(model)
        assert "computed" in pe.describe(model)["encoders"][0]["padded_outputs"]
        if side == "left":
            with pytest.warns(RuntimeWarning, match="question-answering loss"):
                out = model(**kw)
        else:
            out = model(**kw)
        calls = pe.describe(model)["encoders"][0].get("stock_forward_calls") or {}
        assert bool(calls) == (side == "left"), calls
        torch.testing.assert_close(out.loss, ref.loss, atol=1e-5, rtol=1e-5)
        logits = model(input_ids=ids, attention_mask=mask).start_logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], ref.start_logits[real], atol=1e-5, rtol=1e-5)
    assert (pe.describe(model)["encoders"][0].get("stock_forward_calls") or {}) == calls


def test_clean_calls_do_not_warn():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([5, 8])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _out(model, ids, mask)
    assert stock_positions is not None


def test_swapped_activation_after_pack_runs_stock():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([6, 3])
    model.layers[1].mlp.act = nn.ReLU()
    with pytest.warns(RuntimeWarning, match=r"mlp\.act"):
        out = _out(model, ids, mask)
    torch.testing.assert_close(out, stock(model, input_ids=ids, attention_mask=mask).last_hidden_state, atol=0, rtol=0)


def test_replaced_linear_of_the_same_type_is_read_live():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([6, 3])
    old = model.layers[1].attn.Wo
    model.layers[1].attn.Wo = nn.Linear(old.in_features, old.out_features, bias=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _out(model, ids, mask)
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-4, rtol=1e-4)


def test_bad_packed_and_scalar_inputs_get_named_errors():
    """Inputs that used to reach raw torch errors (or pass silently) are refused by name, before any work."""
    model = pe.pack(make_model("base_like"), validate=False)
    h = model.config.hidden_size
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    ids = torch.randint(3, 50, (7,))
    with torch.no_grad():
        for embeds, what in ((torch.randn(7, h + 1), "hidden_size"), (torch.randn(1, 7, h), "hidden_size"),
                             (torch.randn(7, h, dtype=torch.float64), "float64")):
            with pytest.raises(pe.PackedEncodersError, match=what):
                pe.packed_forward(model, None, None, cu, 4, inputs_embeds=embeds)
        for bad in (4.0, "4", True, torch.tensor(4.0), torch.tensor([4])):
            with pytest.raises(pe.PackedEncodersError, match="max_seqlen"):
                pe.packed_forward(model, None, ids, cu, bad)
            with pytest.raises(pe.PackedEncodersError, match="max_length_q"):
                model(input_ids=ids[None], position_ids=None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=bad, max_length_k=bad)
        # cu_seq_lens_* that are not tensors (lists, or NumPy arrays from a collator run with return_tensors="np")
        for bad_cu in (cu.tolist(), cu.numpy()):
            with pytest.raises(pe.PackedEncodersError, match="cu_seq_lens_q must be"):
                model(input_ids=ids[None], cu_seq_lens_q=bad_cu, cu_seq_lens_k=list(cu.tolist()), max_length_q=4)
            with pytest.raises(pe.PackedEncodersError, match="cu_seq_lens_k must be"):
                model(input_ids=ids[None], cu_seq_lens_q=cu, cu_seq_lens_k=bad_cu, max_length_q=4)
        good = pe.packed_forward(model, None, ids, cu, 4)  # ints and 0-d integer tensors are accepted
        assert torch.equal(pe.packed_forward(model, None, ids, cu, torch.tensor(4)), good)
        with pytest.raises(pe.PackedEncodersError, match="0-d"):
            model(input_ids=torch.tensor(5))
        mask = torch.ones(1, 7, dtype=torch.long)
        for dtype in (torch.float64, torch.bfloat16):  # outside autocast (stock fails in its first GEMM too)
            with pytest.raises(pe.PackedEncodersError, match=f"inputs_embeds is {dtype}"):
                model(inputs_embeds=torch.randn(1, 7, h, dtype=dtype), attention_mask=mask)
        with torch.autocast("cpu", dtype=torch.bfloat16):  # served under autocast, as stock serves it
            model(inputs_embeds=torch.randn(1, 7, h, dtype=torch.bfloat16), attention_mask=mask)
            with pytest.raises(pe.PackedEncodersError, match="inputs_embeds is torch.float64.*autocast does not"):
                model(inputs_embeds=torch.randn(1, 7, h, dtype=torch.float64), attention_mask=mask)  # stock fails too


@pytest.mark.parametrize("lengths,what", [(5, "list of positive ints"), ("12", "list of positive ints"),
                                          ([True, 3], "list of positive ints"), ([], "list of positive ints"),
                                          ([3, 10 ** 6], "max_position_embeddings")])
def test_bad_validation_lengths_are_refused_before_validation(lengths, what):
    model = make_model("base_like")
    with pytest.raises(pe.PackedEncodersError, match=what):
        pe.pack(model, validation_lengths=lengths)
    assert not pe.is_packed(model)


def test_validation_draws_ids_within_the_embedding_when_the_config_says_more():
    """config.vocab_size above the embedding's rows (a config edited, e.g. to a tokenizer's size, without resizing):
    stock runs any id within the rows, and so must pack()'s validation batch, which drew up to config.vocab_size and
    failed inside stock's own lookup with an IndexError."""
    model = make_model("tiny")
    reference = copy.deepcopy(model)
    model.config.vocab_size = reference.config.vocab_size = model.embeddings.tok_embeddings.num_embeddings + 200
    pe.pack(model)
    assert pe.describe(model)["encoders"][0]["validated"]
    ids, mask = padded_batch([5, 30, 12], "right")
    torch.testing.assert_close(_out(model, ids, mask)[mask.bool()], _out(reference, ids, mask)[mask.bool()],
                               atol=1e-4, rtol=1e-4)
