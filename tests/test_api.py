"""pack / unpack / describe / validate behaviour and every refusal."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
from torch import nn

import packed_encoders as pe
from packed_encoders.adapters.state import STATE_ATTR
from tests.helpers import make_model, padded_batch, stock


def _out(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


def test_pack_patches_instance_only_and_unpack_restores():
    model = make_model("base_like")
    other = make_model("base_like")
    cls_forward = type(model).forward
    ids, mask = padded_batch([5, 9])
    before = _out(model, ids, mask)
    assert pe.pack(model) is model
    assert "forward" in model.__dict__ and STATE_ATTR in model.__dict__
    assert type(model).forward is cls_forward and "forward" not in other.__dict__
    pe.unpack(model)
    assert "forward" not in model.__dict__ and not hasattr(model, STATE_ATTR)
    assert not [k for k in model.__dict__ if "packed" in k]
    torch.testing.assert_close(_out(model, ids, mask), before, atol=0, rtol=0)


def test_pack_is_idempotent_and_reconfigures():
    model = make_model("base_like")
    pe.pack(model)
    state = model.__dict__[STATE_ATTR]
    pe.pack(model)
    assert model.__dict__[STATE_ATTR] is state
    pe.pack(model, attention_backend="sdpa", kernels="torch")
    new = model.__dict__[STATE_ATTR]
    assert new is not state and new.options.attention_backend == "sdpa"
    pe.unpack(model)
    assert "forward" not in model.__dict__


def test_previous_instance_forward_is_restored():
    model = make_model("base_like")
    sentinel = lambda *a, **k: "hooked"  # noqa: E731 - e.g. an accelerate hook
    model.forward = sentinel
    with pytest.warns(RuntimeWarning, match="forward is set on the instance.*does not run"):  # not silently
        pe.pack(model)
    pe.unpack(model)
    assert model.forward is sentinel


def test_the_replaced_forward_is_named_not_printed():
    # accelerate's hooks set functools.partial(new_forward, model): its repr holds the whole module tree
    import functools

    model = make_model("base_like")

    def new_forward(module, *args, **kwargs):
        return module.__class__.forward(module, *args, **kwargs)

    model.forward = functools.partial(new_forward, model)
    with pytest.warns(RuntimeWarning) as record:
        pe.pack(model)
    message = str(record[0].message)
    assert "functools.partial of tests.test_api.test_the_replaced_forward_is_named_not_printed.<locals>.new_forward" \
        in message
    assert "\n" not in message and "Embedding" not in message
    pe.unpack(model)


def test_a_forward_wrapped_after_pack_survives_unpack_and_repack():
    # e.g. accelerate's add_hook_to_module after pack(): it sets model.forward to a wrapper of the packed forward.
    # unpack() used to pop that wrapper (the hook silently gone) and leave the wrapped PackedForward, kept by the
    # wrapper (accelerate's _old_forward), failing with "no attribute '_packed_encoders'" once called
    model = make_model("base_like")
    ids, mask = padded_batch([5, 9])
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state.detach()
    pe.pack(model)
    packed = model.forward
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return packed(*args, **kwargs)

    model.forward = wrapper
    pe.pack(model, attention_backend="sdpa")  # reconfigured: the wrapper stays, its packed forward reads the new state
    assert model.forward is wrapper
    pe.unpack(model)
    assert model.forward is wrapper and not pe.is_packed(model)
    torch.testing.assert_close(_out(model, ids, mask), ref, atol=0, rtol=0)  # the wrapper, then the stock forward
    torch.testing.assert_close(packed(input_ids=ids, attention_mask=mask).last_hidden_state.detach(), ref,
                               atol=0, rtol=0)
    assert len(calls) == 1
    with pytest.warns(RuntimeWarning, match="forward is set on the instance"):
        pe.pack(model)  # packing again: the instance forward is replaced and restored by unpack, as before pack()
    out = _out(model, ids, mask)
    assert pe.describe(model)["encoders"][0]["last_attention"]
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)
    pe.unpack(model)
    assert model.forward is wrapper
    model.forward = packed  # the wrapper taken off (as accelerate's remove_hook_from_module does): stock again
    torch.testing.assert_close(_out(model, ids, mask), ref, atol=0, rtol=0)
    pe.pack(model)
    assert pe.is_packed(model) and model.forward is not packed
    pe.unpack(model)
    assert "forward" not in model.__dict__  # the stale packed forward is not taken for a forward of the user's


def test_state_dict_and_weights_untouched():
    model = make_model("base_like")
    before = {k: (v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}
    pe.pack(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in after.items():
        assert v.data_ptr() == before[k][0] and torch.equal(v, before[k][1])


def test_deepcopy_runs_its_own_weights():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([7, 3])
    twin = copy.deepcopy(model)
    assert twin.forward.module is twin
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    assert (_out(twin, ids, mask) - _out(model, ids, mask)).abs().max() > 1e-3
    expected = stock(twin, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(_out(twin, ids, mask)[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)


def test_pickle_roundtrip_keeps_packed_forward():
    model = pe.pack(make_model("odd"))
    ids, mask = padded_batch([4, 8])
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.forward.module is loaded and pe.is_packed(loaded)
    torch.testing.assert_close(_out(loaded, ids, mask), _out(model, ids, mask), atol=0, rtol=0)


def test_save_and_from_pretrained(tmp_path):
    from transformers import ModernBertModel

    model = pe.pack(make_model("base_like"))
    model.save_pretrained(tmp_path)
    loaded = ModernBertModel.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch([6, 2])
    pe.pack(loaded)
    torch.testing.assert_close(_out(loaded, ids, mask), _out(model, ids, mask), atol=1e-6, rtol=1e-6)


def test_optimizer_step_changes_packed_output():
    model = pe.pack(make_model("base_like"))
    model.train()
    ids, mask = padded_batch([6, 11])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    out[mask.bool()].pow(2).mean().backward()
    opt.step()
    model.eval()
    after = _out(model, ids, mask)
    expected = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(after[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)


def test_unsupported_targets():
    with pytest.raises(pe.UnsupportedTargetError, match="nn.Module"):
        pe.pack(object())
    with pytest.raises(pe.UnsupportedTargetError, match="no ModernBertModel.*Linear"):
        pe.pack(nn.Sequential(nn.Linear(2, 2)))
    model = make_model("base_like")
    model.config.rope_parameters["sliding_attention"]["rope_type"] = "yarn"
    with pytest.raises(pe.UnsupportedTargetError, match="rope_type"):
        pe.pack(model)
    assert isinstance(pe.UnsupportedTargetError("x"), pe.PackedEncodersError)


class _Delegating(nn.Module):
    """A wrapper that forwards attribute lookups to the model it holds, as peft's PeftModel / LoraModel do."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)

    def forward(self, **kwargs):
        return self.model(**kwargs)


@pytest.mark.parametrize("wrap", ["delegating", "torch.compile"])
def test_a_wrapper_that_delegates_attributes_is_not_an_encoder(wrap):
    # such a wrapper has the encoder's config, embeddings, layers and final_norm as attributes: it was taken for
    # an encoder itself (pack() of torch.compile(model) failed in validation with "_forward_unimplemented() got an
    # unexpected keyword argument", and unpack() of a PeftModel left the model inside it packed)
    model = make_model("base_like")
    wrapper = _Delegating(model) if wrap == "delegating" else torch.compile(model)
    ids, mask = padded_batch([5, 9])
    before = _out(model, ids, mask)
    assert [e["path"] for e in pe.describe(wrapper)["encoders"]] == ["model" if wrap == "delegating" else "_orig_mod"]
    pe.pack(wrapper)
    assert pe.is_packed(model) and "forward" in model.__dict__ and STATE_ATTR not in wrapper.__dict__
    if wrap == "delegating":
        torch.testing.assert_close(_out(wrapper, ids, mask)[mask.bool()], before[mask.bool()], atol=1e-5, rtol=1e-5)
    pe.unpack(wrapper)
    assert not pe.is_packed(model) and "forward" not in model.__dict__


def test_bad_options():
    model = make_model("base_like")
    with pytest.raises(pe.PackedEncodersError, match="attention_backend"):
        pe.pack(model, attention_backend="magic")
    with pytest.raises(pe.PackedEncodersError, match="kernels"):
        pe.pack(model, kernels="magic")
    with pytest.raises(pe.PackedEncodersError, match="varlen.*CUDA"):
        pe.pack(model, attention_backend="varlen")  # explicit backend that cannot run here
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("kwargs, match", [
    (dict(foo=1), "foo"),
    (dict(sliding_window_mask=torch.zeros(1)), "sliding_window_mask: a custom sliding-window mask"),
    (dict(indices=torch.zeros(1)), "v4"),
])
def test_refused_kwargs(kwargs, match):
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([4, 4])
    with pytest.raises(pe.PackedEncodersError, match=match):
        model(input_ids=ids, attention_mask=mask, **kwargs)


def test_ignored_kwargs_are_the_documented_ones():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([4, 4])
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, num_items_in_batch=3, use_cache=False).last_hidden_state
        # a tokenizer's optional outputs, which model(**batch) passes along (stock ignores them)
        extra = {"special_tokens_mask": torch.zeros_like(ids), "length": mask.sum(1),
                 "offset_mapping": torch.zeros(*ids.shape, 2, dtype=torch.long),
                 "overflow_to_sample_mapping": torch.arange(ids.shape[0])}
        b = model(input_ids=ids, attention_mask=mask, **extra).last_hidden_state
        ref = stock(model, input_ids=ids, attention_mask=mask, **extra).last_hidden_state
    torch.testing.assert_close(a, _out(model, ids, mask), atol=0, rtol=0)
    torch.testing.assert_close(b, a, atol=0, rtol=0)
    torch.testing.assert_close(b[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)


def test_validating_a_meta_model_is_refused_by_name():
    with torch.device("meta"):
        model = make_model("base_like")
    with pytest.raises(pe.PackedEncodersError, match="meta device"):
        pe.pack(model)
    assert "forward" not in model.__dict__
    pe.pack(model, validate=False)


def test_keywords_given_as_none_are_not_given():
    """HF reads a keyword passed as ``None`` as not passed: so does the packed forward (a value is refused)."""
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([4, 4])
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=mask, labels=None, head_mask=None).last_hidden_state
    torch.testing.assert_close(a, _out(model, ids, mask), atol=0, rtol=0)
    with pytest.raises(pe.PackedEncodersError, match="head_mask"):
        model(input_ids=ids, attention_mask=mask, head_mask=torch.ones(2))


@pytest.mark.parametrize("embeds", [False, True])
def test_a_batch_without_real_tokens_backpropagates_zeros(embeds):
    """Stock runs its layers over padding, so a loss over an all-padding batch backpropagates zero gradients to
    every parameter; the packed output (zeros, no token to run) is tied to them the same way, not detached."""
    model = pe.pack(make_model("base_like").train())
    ids, _ = padded_batch([4, 4])
    mask = torch.zeros_like(ids)
    if embeds:
        x = model.embeddings.tok_embeddings(ids).detach().requires_grad_()
        out = model(inputs_embeds=x, attention_mask=mask).last_hidden_state
    else:
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert out.requires_grad and not out.any()
    (out * 2).sum().backward()
    params = list(model.parameters())
    assert all(p.grad is not None and not p.grad.any() for p in params)
    if embeds:
        assert x.grad is not None and not x.grad.any()
    flat = pe.packed_forward(model, None, ids.new_zeros(0), torch.zeros(2, dtype=torch.int32), 0)
    assert flat.shape == (0, model.config.hidden_size) and flat.requires_grad
    with torch.no_grad():
        assert not model(input_ids=ids, attention_mask=mask).last_hidden_state.requires_grad


def test_input_errors_through_the_model():
    model = pe.pack(make_model("base_like"))
    ids, mask = padded_batch([4, 6])
    with pytest.raises(pe.PackedEncodersError, match="exactly one"):
        model(attention_mask=mask)
    with pytest.raises(pe.PackedEncodersError, match="vocabulary"):
        model(input_ids=ids + 1000, attention_mask=mask)
    with pytest.raises(pe.PackedEncodersError, match="token_type_ids"):
        model(input_ids=ids, attention_mask=mask, token_type_ids=torch.ones_like(ids))
    with pytest.raises(pe.PackedEncodersError, match="positional"):
        model(ids, mask, None, None, None, None)
    with pytest.raises(pe.PackedEncodersError, match=r"a padded batch is \[batch, seq_len\]"):
        model(input_ids=ids[0], attention_mask=mask[0])   # 1-D by mistake
    with pytest.raises(pe.PackedEncodersError, match=r"a padded batch is \[batch, seq_len\]"):
        model(input_ids=ids[0])
    h = model.config.hidden_size
    with pytest.raises(pe.PackedEncodersError, match=f"hidden_size {h}"):
        model(inputs_embeds=torch.randn(2, 6, h - 1), attention_mask=mask)
    with pytest.raises(pe.PackedEncodersError, match="inputs_embeds must be a floating tensor"):
        model(inputs_embeds=torch.zeros(2, 6, h, dtype=torch.long), attention_mask=mask)
    with pytest.raises(pe.PackedEncodersError, match="sliding_window_mask: a custom sliding-window mask"):
        model(input_ids=ids, attention_mask=mask, sliding_window_mask=torch.zeros(2, 1, 6, 6))
    bad = mask.float().masked_fill(mask == 0, float("nan"))
    with pytest.raises(pe.PackedEncodersError, match=r"must hold only 0 and 1 \(2 entries that are neither\)"):
        model(input_ids=ids, attention_mask=bad)
    with pytest.raises(pe.PackedEncodersError, match="validate='no' must be True or False"):
        pe.pack(model, validate="no")
    ok = model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
    assert ok.last_hidden_state.shape == (2, 6, model.config.hidden_size)


def test_describe_and_validate_report():
    model = make_model("base_like")
    d = pe.describe(model)["encoders"][0]
    assert d["packed"] is False
    pe.pack(model)
    d = pe.describe(model)["encoders"][0]
    assert d["packed"] and d["attention_backend"] == "auto" and d["kernels"] == "torch" and d["validated"]
    assert d["validated_as"] == f"{d['dtype']} on {d['device']}"
    assert set(d["last_attention"].values()) == {"sdpa"}
    assert any("CUDA" in r for r in d["attention_fallbacks"])
    report = pe.validate(model)
    assert report.passed and report.encoders[0].max_rel_err <= 1e-4
    assert "cosine" in report.summary()


def test_validation_failure_leaves_model_unchanged(monkeypatch):
    from packed_encoders import ops
    from packed_encoders.ops import select

    broken = ops.OpSet("broken", ops.layer_norm_torch, ops.residual_layer_norm_torch, ops.rope_qkv_torch,
                       lambda x, act: ops.geglu_torch(x.roll(1, -1), act))  # a plausible indexing bug
    monkeypatch.setattr(select, "KERNEL_CHOICES", select.KERNEL_CHOICES + ("broken",))
    original = select.select_ops

    def fake_select(kernels, device, tuning):
        return (broken, "test") if kernels == "broken" else original(kernels, device, tuning)

    monkeypatch.setattr("packed_encoders.configure.select_ops", fake_select)
    model = make_model("base_like")
    with pytest.raises(pe.ValidationError, match="relative error") as info:
        pe.pack(model, kernels="broken")
    assert not info.value.report.passed
    assert "forward" not in model.__dict__
    pe.pack(model)
    with pytest.raises(pe.ValidationError):
        pe.pack(model, kernels="broken")
    assert model.__dict__[STATE_ATTR].ops.name == "torch"  # the earlier, valid packing is kept


@pytest.mark.parametrize("validate", [True, False])
def test_a_backend_that_cannot_run_here_is_refused_at_pack(validate):
    """An explicitly named backend that no call of this model could run (here: a CUDA backend for a CPU model) is
    refused by pack(), validated or not, naming the reason; the model stays unpacked."""
    model = make_model("base_like")
    for backend, why in (("varlen", "varlen_attn needs CUDA"), ("fa4", "FlashAttention-4 needs CUDA"),
                         ("triton", "Triton attention kernel needs CUDA"),
                         ("flash", "no FlashAttention backend can .*varlen: .*needs CUDA")):
        with pytest.raises(pe.PackedEncodersError, match=f"attention_backend='{backend}' cannot run this model "
                                                         f"\\(on cpu\\): .*{why}"):
            pe.pack(model, attention_backend=backend, validate=validate)
        assert "forward" not in model.__dict__
    pe.pack(model, attention_backend="sdpa", validate=validate)  # runs anywhere


def test_a_model_whose_stock_output_is_not_finite_is_named_as_the_cause():
    """A NaN weight makes stock HF's output NaN too: validation says the model, not the packed path, is the cause,
    and the model stays unpacked."""
    model = make_model("base_like")
    with torch.no_grad():
        model.layers[0].mlp.Wi.weight[0, 0] = float("nan")
    with pytest.raises(pe.ValidationError, match="and in stock HF's too") as info:
        pe.pack(model)
    assert not info.value.report.passed and "forward" not in model.__dict__


def test_a_stock_output_that_is_not_finite_where_packed_is_is_named():
    """Stock's eager attention in float64 gives NaN at real tokens of some batches (its masks); the packed output is
    finite there. Validation says stock's numerics are what failed (not a bare "cosine min nan") and how to pack
    anyway; the packed model then matches stock wherever stock is finite."""
    model = make_model("base_like", dtype=torch.float64, attn_implementation="eager")
    ids, mask = padded_batch([1, 9, 18, 33])
    with torch.no_grad():
        want = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    if bool(torch.isfinite(want[real]).all()):
        pytest.skip("stock's eager attention is finite on this transformers release")
    with pytest.raises(pe.ValidationError, match="stock HF's output holds NaN / inf at real tokens where the packed "
                                                 "output is finite") as info:
        pe.pack(model)
    assert "cosine" not in str(info.value) and "forward" not in model.__dict__
    pe.pack(model, validate=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    ok = torch.isfinite(want).all(-1) & real
    assert bool(torch.isfinite(out[real]).all()) and ok.any()
    torch.testing.assert_close(out[ok], want[ok], atol=1e-7, rtol=1e-6)


def test_structure_mismatch_is_refused_before_validation():
    model = make_model("base_like")
    model.layers[1].attention_type = "full_attention"  # disagrees with config.layer_types
    with pytest.raises(pe.UnsupportedTargetError, match="attention_type"):
        pe.pack(model)
    assert not pe.validate(model).passed  # validate() alone reports it too


def test_fp32_fp64_yardstick_path(monkeypatch):
    """Past 1e-4 against stock, fp32 is judged against an fp64 run (as close as stock fp32 itself, x2)."""
    from packed_encoders import validation

    model = make_model("base_like")
    monkeypatch.setattr(validation, "FP32_MAX_REL", 0.0)  # force the fp64 branch on a correct path
    report = pe.validate(model).encoders[0]
    assert report.passed and any("fp64" in c for c in report.checks), report
    assert not hasattr(model, "_packed_encoders") and "forward" not in model.__dict__


def test_cuda_graph_on_a_cpu_model_warns_at_pack():
    import warnings as _w

    import packed_encoders as pe

    from tests.helpers import make_model

    model = make_model("base_like")
    with pytest.warns(UserWarning, match="CUDA graphs start once it is on a CUDA device"):
        pe.pack(model, cuda_graph=True, validate=False)
    pe.unpack(model)
    with _w.catch_warnings():
        _w.simplefilter("error")
        pe.pack(model, validate=False)  # no graphs asked: nothing to say
    with pytest.warns(UserWarning, match=r"set_cuda_graph\(\.\.\.\): the model is on cpu; CUDA graphs start") as seen:
        pe.set_cuda_graph(model, True)
    assert seen[0].filename == __file__  # pointed at the caller
    with _w.catch_warnings():
        _w.simplefilter("error")
        pe.set_cuda_graph(model, False)
    pe.unpack(model)


def test_packed_forward_names_a_non_tensor_argument():
    import packed_encoders as pe

    from tests.helpers import make_model

    model = make_model("base_like")
    ids = torch.randint(3, 200, (29,))
    with pytest.raises(pe.PackedEncodersError, match="cu_seqlens must be a torch.Tensor"):
        pe.packed_forward(model, None, ids, [0, 5, 8, 28, 29], 20)
    cu = torch.tensor([0, 5, 8, 28, 29], dtype=torch.int32)
    for name, args in (("cu_seqlens", (ids, cu.to("meta"), 20)), ("packed_ids", (ids.to("meta"), cu, 20))):
        with pytest.raises(pe.PackedEncodersError, match=f"{name} is a meta tensor"):  # (was torch's copy error)
            pe.packed_forward(model, None, *args)


def test_packed_forward_runs_outside_torch_compile_and_refuses_export():
    """``packed_forward`` reads ``cu_seqlens`` on the host, as the patched forward reads the lengths: under
    ``torch.compile`` it runs as it is, outside the graph (traced, it broke the graph at each host read into a graph
    per fragment and token count, on which inductor failed with "name 's25' is not defined"), ``fullgraph=True``
    names why, and ``torch.export`` raises a named error (it raised a data-dependent guard error from inside)."""
    import itertools

    import torch._dynamo
    from torch._dynamo.utils import counters

    model = pe.pack(make_model("base_like"))

    def encode(ids, cu_seqlens, max_seqlen):
        return pe.packed_forward(model, None, ids, cu_seqlens, max_seqlen)

    class Encode(nn.Module):
        def forward(self, ids, cu_seqlens):
            return encode(ids, cu_seqlens, 17)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(encode, backend="eager")
    with torch.no_grad():
        for lengths in ((5, 12, 9), (3, 17)):
            ids = torch.randint(3, 200, (sum(lengths),))
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            torch.testing.assert_close(compiled(ids, cu, max(lengths)), encode(ids, cu, max(lengths)))
        assert not counters["stats"]["unique_graphs"]  # nothing of the packed forward was traced
        torch._dynamo.reset()
        with pytest.raises(Exception, match="packed_forward reads cu_seqlens on the host"):
            torch.compile(encode, backend="eager", fullgraph=True)(ids, cu, 17)
        with pytest.raises(pe.PackedEncodersError, match="packed_forward reads cu_seqlens on the host"):
            torch.export.export(Encode(), (ids, cu))
    torch._dynamo.reset()


def test_describe_says_whether_the_last_eager_call_applied_dropout():
    model = pe.pack(make_model("base_like", mlp_dropout=0.1))
    ids, mask = padded_batch([5, 12, 9])
    with torch.no_grad():
        model.eval()(input_ids=ids, attention_mask=mask)
    assert pe.describe(model)["encoders"][0]["eager_plan"]["dropout"] is False
    plan = pe.describe(model)["encoders"][0]["eager_plan"]
    assert plan["stack_pointers"] is False and plan["stack_pointers_off"] is None  # (no gradient: no stack)
    model.train()(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    plan = pe.describe(model)["encoders"][0]["eager_plan"]
    assert plan["dropout"] is True
    if plan["stack"]:  # the raw-pointer stack is CUDA only, and says why not
        assert plan["stack_pointers"] is False and plan["stack_pointers_off"], plan


@pytest.mark.parametrize("setup", ["mc_dropout", "frozen_part_in_eval"])
def test_pack_and_validate_keep_every_module_mode(setup):
    # validation runs the model in eval mode; putting it back with model.train(was_training) would reset every
    # submodule: Monte-Carlo dropout (an eval model with its dropout modules in train mode) silently switched off,
    # a part kept in eval inside a training model (no dropout there) silently switched to train
    model = make_model("tiny", mlp_dropout=1.0)  # p = 1: the MLP output is dropped whole, a deterministic check
    twin = copy.deepcopy(model)
    for m in (model, twin):
        if setup == "mc_dropout":
            m.eval()
            for layer in m.layers:
                layer.mlp.drop.train()
        else:
            m.train()
            for layer in m.layers:
                layer.mlp.eval()
    modes = {name: m.training for name, m in model.named_modules()}
    pe.validate(model)
    assert {name: m.training for name, m in model.named_modules()} == modes
    pe.pack(model)
    assert {name: m.training for name, m in model.named_modules()} == modes
    ids, mask = padded_batch([9, 4, 20])
    expected = stock(twin, input_ids=ids, attention_mask=mask,
                     position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state
    torch.testing.assert_close(_out(model, ids, mask)[mask.bool()], expected[mask.bool()], atol=1e-4, rtol=1e-4)


def test_describe_validated_only_for_the_dtype_it_was_checked_in():
    """A check in one dtype says nothing of another's kernels: after ``.to(dtype)`` ``validated`` is ``None``, and
    ``validated_as`` names what was checked; back in the checked dtype it reads the check's result again."""
    model = pe.pack(make_model("base_like"))
    assert pe.describe(model)["encoders"][0]["validated"] is True
    model.to(torch.float64)
    d = pe.describe(model)["encoders"][0]
    assert d["dtype"] == "float64" and d["validated"] is None and d["validated_as"] == "float32 on cpu"
    model.to(torch.float32)
    assert pe.describe(model)["encoders"][0]["validated"] is True


def test_pack_again_after_a_dtype_change_validates_in_the_new_dtype():
    """``pe.pack(model)`` with the same options keeps the state, validation included; after ``.to(dtype)`` that
    validation is for another dtype's kernels, so ``pack()`` (``validate=True``) checks the model again in its
    dtype now."""
    model = pe.pack(make_model("base_like"))
    model.to(torch.float64)
    pe.pack(model)
    d = pe.describe(model)["encoders"][0]
    assert d["validated"] is True and d["validated_as"] == "float64 on cpu"


def _rope(q, k, cos, sin, unsqueeze_dim=1, scale=1.0):
    """Stock's RoPE (``apply_rotary_pos_emb``), times ``scale``."""
    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return tuple((scale * (t.float() * cos + rotate(t.float()) * sin)).to(t.dtype) for t in (q, k))


class _KernelFunc(nn.Module):
    """transformers' ``_kernel_funcs`` entry where the ``kernels`` package is not installed (then nothing routes a
    call to it): a module wrapping a function, whose ``forward`` ``kernelize`` sets on the instance."""

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _rope(q, k, cos, sin, unsqueeze_dim)


def test_hub_kernels_are_named_in_describe_and_in_a_failed_validation():
    """A hub RoPE kernel bound to the attention modules (``use_kernels=True``: ``kernelize`` sets the forward of
    each attention's ``_kernel_funcs["rotary_pos_emb"]``) is not what the packed path runs: describe() names it,
    and where stock's output with it disagrees (a kernel computing another function), pack()'s validation error
    names it too (with the ``kernels`` package, which routes stock's RoPE to it)."""
    import types

    model = make_model("tiny")
    routed = "_kernel_funcs" in vars(model.layers[0].attn)  # (transformers with the kernels package)
    assert pe.describe(pe.pack(model, validate=False))["encoders"][0]["hub_kernels"] == []
    pe.unpack(model)

    def kernelize(fn):
        for layer in model.layers:
            funcs = vars(layer.attn).setdefault("_kernel_funcs", {"rotary_pos_emb": _KernelFunc()})
            func = funcs["rotary_pos_emb"]
            func.forward = types.MethodType(fn, func)

    kernelize(lambda self, *args, **kwargs: _rope(*args, **kwargs))
    kernels = pe.describe(pe.pack(model))["encoders"][0]["hub_kernels"]  # (the same function: validation passes)
    n = len(model.layers)
    assert kernels == [f"rotary_pos_emb on {n} of {n} layers: not called (the packed path applies its own RoPE)"]
    pe.unpack(model)
    if not routed:
        return
    kernelize(lambda self, *args, **kwargs: _rope(*args, **kwargs, scale=2.0))
    with pytest.raises(pe.ValidationError, match="stock ran transformers hub kernels the packed path replaces: "
                                                 "rotary_pos_emb on"):
        pe.pack(model)


def test_pack_again_with_validate_false_keeps_the_state():
    """``validate`` chooses a check, not the packed path: ``pe.pack(model, validate=False)`` after ``pe.pack(model)``
    keeps the state (its validation, graphs and counters), and ``pe.pack(model)`` after ``validate=False`` validates
    it (a new state, as for any pack that validates)."""
    model = pe.pack(make_model("base_like"))
    state = model.__dict__[STATE_ATTR]
    pe.pack(model, validate=False)
    assert model.__dict__[STATE_ATTR] is state
    assert pe.describe(model)["encoders"][0]["validated"] is True
    pe.pack(model, attention_backend="sdpa", validate=False)  # another option: a new state, not validated
    assert model.__dict__[STATE_ATTR] is not state
    assert pe.describe(model)["encoders"][0]["validated"] is None
    pe.pack(model, attention_backend="sdpa")
    assert pe.describe(model)["encoders"][0]["validated"] is True
