"""Every change to the module tree that stock HF's forward would honour and the packed forward would skip runs the
stock forward (a one-time RuntimeWarning, the reason in describe()) when made after pack(), and makes pack() refuse
when made before it, whatever ``validate`` is: layers reordered or of the other attention type, containers replaced
by subclasses with their own forward, instance forwards, class swaps, hooks of every kind on every module the packed
forward skips (the rotary embedding included) and global module hooks."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from transformers.models.modernbert import modeling_modernbert as hf

import packed_encoders as pe
from tests.helpers import make_model, padded_batch, stock

# layer 0 global, layer 1 local: every slot kind on a tiny model
TINY = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=48)
SKIPPED = ["embeddings", "embeddings.tok_embeddings", "embeddings.norm", "embeddings.drop", "final_norm",
           "rotary_emb", "layers.1", "layers.1.attn_norm", "layers.1.attn", "layers.1.attn.Wqkv", "layers.1.attn.Wo",
           "layers.1.attn.out_drop", "layers.1.mlp_norm", "layers.1.mlp", "layers.1.mlp.Wi", "layers.1.mlp.Wo",
           "layers.1.mlp.act", "layers.1.mlp.drop"]


def _model(**overrides):
    return make_model("base_like", **{**TINY, **overrides})


def _call(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


def _assert_runs_stock(model, reason, *, grad=False):
    """The call warns once naming ``reason``, equals stock exactly (outputs and, with ``grad``, gradients) and
    describe() says why."""
    ids, mask = padded_batch([5, 9])
    with torch.set_grad_enabled(grad), pytest.warns(RuntimeWarning, match=reason) as caught:
        out = _call(model, ids, mask)
    assert {w.filename for w in caught if "stock forward" in str(w.message)} == {__file__}  # the user's call
    with torch.set_grad_enabled(grad):
        ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert "stock forward" in pe.describe(model)["encoders"][0]["attention_fallbacks"][0]
    if grad:
        w = model.embeddings.tok_embeddings.weight  # reached through every module's input
        (g_out,) = torch.autograd.grad(out.square().sum(), w)
        (g_ref,) = torch.autograd.grad(ref.square().sum(), w)
        torch.testing.assert_close(g_out, g_ref, atol=0, rtol=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="packed_encoders")  # said once
        with torch.set_grad_enabled(grad):
            _call(model, ids, mask)
    entry = pe.describe(model)["encoders"][0]
    calls = entry["stock_forward_calls"]  # kept after other calls, per reason
    assert [n for r, n in calls.items() if re.search(reason, r)] == [2], calls
    assert not pe.is_packed(model) and not entry["packed"] and re.search(reason, entry["runs_stock"]), entry


def _assert_stays_packed(model):
    """The call runs the packed path silently (no warning) and equals stock on the real tokens."""
    ids, mask = padded_batch([5, 9])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = _call(model, ids, mask)
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)
    entry = pe.describe(model)["encoders"][0]
    assert pe.is_packed(model) and entry["packed"] and "runs_stock" not in entry, entry


def _packed_and_called(**overrides):
    model = pe.pack(_model(**overrides), validate=False)
    ids, mask = padded_batch([5, 9])
    with torch.no_grad():
        _call(model, ids, mask)  # the per-call snapshot exists: the change must be seen by the per-call check
    return model


class MyLayer(hf.ModernBertEncoderLayer):
    def forward(self, hidden_states, *args, **kwargs):
        return super().forward(hidden_states, *args, **kwargs) * 0.5


class MyAttention(hf.ModernBertAttention):
    def forward(self, hidden_states, **kwargs):
        out, w = super().forward(hidden_states, **kwargs)
        return out * 2.0, w


class MyMLP(hf.ModernBertMLP):
    def forward(self, hidden_states):
        return super().forward(hidden_states) * 2.0


class MyEmbeddings(hf.ModernBertEmbeddings):
    def forward(self, input_ids=None, inputs_embeds=None):
        return super().forward(input_ids, inputs_embeds) + 0.25


class MyRotary(hf.ModernBertRotaryEmbedding):
    def forward(self, x, position_ids, layer_type):
        cos, sin = super().forward(x, position_ids, layer_type)
        return cos, -sin


class QuietMLP(hf.ModernBertMLP):
    """A subclass without a forward of its own: the packed path reproduces it."""


def _subclassed(model, slot):
    """Replace ``slot`` by an instance of a subclass with its own forward, carrying the same weights."""
    cls, parent, name, make = {
        "layer": (MyLayer, model.layers, "1", lambda: MyLayer(model.config, 1)),
        "attn": (MyAttention, model.layers[1], "attn", lambda: MyAttention(model.config, 1)),
        "mlp": (MyMLP, model.layers[1], "mlp", lambda: MyMLP(model.config)),
        "embeddings": (MyEmbeddings, model, "embeddings", lambda: MyEmbeddings(model.config)),
        "rotary_emb": (MyRotary, model, "rotary_emb", lambda: MyRotary(model.config)),
    }[slot]
    new = make()
    new.load_state_dict(parent._modules[name].state_dict())
    parent._modules[name] = new
    return cls


@pytest.mark.parametrize("slot", ["layer", "attn", "mlp", "embeddings", "rotary_emb"])
def test_container_subclass_with_its_own_forward_runs_stock(slot):
    model = _packed_and_called()
    cls = _subclassed(model, slot)
    _assert_runs_stock(model, f"{cls.__qualname__}, whose forward is not HF's")


class Scaled(nn.Module):
    """A plain wrapper (an ablation or adapter experiment): none of HF's attribute names, its own forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        return (out[0] * 0.5, *out[1:]) if isinstance(out, tuple) else out * 0.5


WRAPPED = ["layers.1", "layers.1.attn", "layers.1.mlp", "embeddings", "embeddings.tok_embeddings"]


def _wrap(model, path):
    parent, _, name = path.rpartition(".")
    parent = model.get_submodule(parent) if parent else model
    parent._modules[name] = Scaled(parent._modules[name])


@pytest.mark.parametrize("path", WRAPPED)
def test_pack_refuses_a_plain_wrapper_in_a_slot_naming_it(path):
    model = _model()
    _wrap(model, path)
    with pytest.raises(pe.UnsupportedTargetError, match=rf"cannot pack .*: {re.escape(path)} is a .*Scaled"):
        pe.pack(model)
    assert not pe.is_packed(model)


@pytest.mark.parametrize("path", [p for p in WRAPPED if p != "layers.1"])  # (stock cannot run a wrapped layer)
def test_a_plain_wrapper_put_in_after_pack_runs_stock(path):
    model = _packed_and_called()
    _wrap(model, path)
    _assert_runs_stock(model, rf"{re.escape(path)} is a .*Scaled")


def test_pack_refuses_a_missing_module_naming_it():
    model = _model()
    del model.layers[1].mlp.drop
    with pytest.raises(pe.UnsupportedTargetError, match="layers.1.mlp.drop is missing"):
        pe.pack(model)


def test_subclass_without_its_own_forward_stays_packed():
    model = _packed_and_called()
    new = QuietMLP(model.config)
    new.load_state_dict(model.layers[1].mlp.state_dict())
    model.layers[1].mlp = new
    _assert_stays_packed(model)


def test_dropout_removed_with_identity_stays_packed_in_train_mode():
    """``nn.Identity`` in a dropout slot (how code removes dropout) is no dropout, as stock's forward makes it: the
    packed path keeps serving the call, and with the other slots' rates at 0 it equals stock in train mode too."""
    model = _packed_and_called(embedding_dropout=0.0, mlp_dropout=0.0, attention_dropout=0.0)
    model.embeddings.drop = nn.Identity()
    for layer in model.layers:
        layer.mlp.drop = nn.Identity()
    _assert_stays_packed(model)
    model.train()
    ids, mask = padded_batch([5, 9])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _call(model, ids, mask)
    ref = stock(model, input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], atol=1e-5, rtol=1e-5)
    assert not pe.describe(model)["encoders"][0]["stock_forward_calls"]


@pytest.mark.parametrize("change", ["swap", "other_type"])
def test_layers_of_another_attention_type_run_stock(change):
    model = _packed_and_called(num_hidden_layers=3)  # layer 0 global, 1 and 2 local
    if change == "swap":
        model.layers[0], model.layers[1] = model.layers[1], model.layers[0]
    else:
        model.layers[2] = hf.ModernBertEncoderLayer(model.config, 0)  # a global layer at a local index
    _assert_runs_stock(model, "attention_type is .* but the packed model runs layer")


def test_two_layers_of_the_same_type_swapped_stay_packed():
    model = _packed_and_called(num_hidden_layers=3)
    model.layers[1], model.layers[2] = model.layers[2], model.layers[1]  # both local: weights are read live
    _assert_stays_packed(model)


def test_attention_type_attribute_changed_runs_stock():
    model = _packed_and_called()
    model.layers[1].attention_type = "full_attention"  # read by stock on every call
    _assert_runs_stock(model, "layers.1.attention_type")


@pytest.mark.parametrize("path", ["layers.1.mlp", "layers.1.attn.Wqkv", "rotary_emb", "embeddings.norm"])
def test_instance_forward_runs_stock(path):
    model = _packed_and_called()
    m = model.get_submodule(path)
    original = m.forward
    m.forward = lambda *a, **k: (lambda r: (r[0] * 2, r[1]) if isinstance(r, tuple) else r * 2)(original(*a, **k))
    _assert_runs_stock(model, f"{path} has its own instance forward")


def test_class_swapped_in_place_runs_stock():
    model = _packed_and_called()
    model.layers[1].mlp.__class__ = MyMLP
    _assert_runs_stock(model, "MyMLP, whose forward is not HF's")


def _register(module, kind):
    if kind == "forward":
        return module.register_forward_hook(lambda m, i, o: None)
    if kind == "forward_pre":
        return module.register_forward_pre_hook(lambda m, i: None)
    if kind == "backward":
        return module.register_full_backward_hook(lambda m, gi, go: None)
    return module.register_full_backward_pre_hook(lambda m, go: None)


@pytest.mark.parametrize("path", SKIPPED)
def test_hook_of_every_kind_on_every_skipped_module_runs_stock(path):
    model = _packed_and_called(attention_dropout=0.1)  # out_drop is an nn.Dropout
    for kind in ("forward", "forward_pre", "backward", "backward_pre"):
        handle = _register(model.get_submodule(path), kind)
        # these hooks leave values alone, so what is checked is that the stock forward runs (warned, described);
        # test_backward_hooks_fire_and_rewrite_gradients_as_in_stock checks hooks that change values
        backward = kind.startswith("backward")
        _assert_runs_stock(model, "backward hooks" if backward else "forward hooks", grad=backward)
        handle.remove()
        assert pe.is_packed(model)  # the hook gone, calls run packed again
        model._packed_encoders.runtime.pop("stock_forward_calls")  # the next kind warns again
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with torch.no_grad():
                _call(model, *padded_batch([5, 9]))  # packed again, silently


def test_backward_hooks_fire_and_rewrite_gradients_as_in_stock():
    model = _packed_and_called()
    fired = []

    def halve(m, grad_input, grad_output):
        fired.append(type(m).__name__)
        return tuple(None if g is None else g * 0.5 for g in grad_input)

    model.layers[1].mlp.register_full_backward_hook(halve)
    model.layers[1].mlp.Wo.register_full_backward_pre_hook(lambda m, go: (go[0] * 3.0,))
    _assert_runs_stock(model, "backward hooks", grad=True)
    assert fired  # stock fired it; the gradient check in _assert_runs_stock compares against stock's


@pytest.mark.parametrize("kind", ["forward", "forward_pre", "backward", "backward_pre"])
def test_global_module_hooks_run_stock(kind):
    from torch.nn.modules import module as mm

    register = {"forward": lambda: mm.register_module_forward_hook(lambda m, i, o: None),
                "forward_pre": lambda: mm.register_module_forward_pre_hook(lambda m, i: None),
                "backward": lambda: mm.register_module_full_backward_hook(lambda m, gi, go: None),
                "backward_pre": lambda: mm.register_module_full_backward_pre_hook(lambda m, go: None)}[kind]
    model = _packed_and_called()
    handle = register()
    try:
        _assert_runs_stock(model, "global module (forward|backward) hooks", grad=kind.startswith("backward"))
    finally:
        handle.remove()


@pytest.mark.parametrize("option, value, grad", [("max_norm", 1.0, False), ("scale_grad_by_freq", True, True),
                                                ("sparse", True, True)])
@pytest.mark.parametrize("how", ["attribute", "new_module"])
def test_token_embedding_options_the_lookup_skips_run_stock(option, value, grad, how):
    # the packed lookup is F.embedding(ids, weight, padding_idx): it ignored these silently (scale_grad_by_freq gave
    # other gradients, sparse a dense one, max_norm did not renormalise the rows)
    model = _packed_and_called()
    old = model.embeddings.tok_embeddings
    if how == "attribute":
        setattr(old, option, value)
    else:
        new = nn.Embedding(old.num_embeddings, old.embedding_dim, padding_idx=old.padding_idx, **{option: value})
        new.load_state_dict(old.state_dict())
        model.embeddings.tok_embeddings = new
    _assert_runs_stock(model, f"embeddings.tok_embeddings has {option}=", grad=grad)
    setattr(model.embeddings.tok_embeddings, option, {"max_norm": None}.get(option, False))
    _assert_stays_packed(model)  # the option switched off again: packed again


def _prune_heads(model, layer: int, keep: int) -> None:
    """Replace a layer's Wqkv / Wo by Linears of its first ``keep`` heads (stock HF runs fewer heads then)."""
    attn, h = model.layers[layer].attn, model.config.hidden_size
    rows = torch.arange(keep * attn.head_dim)
    wqkv, wo = nn.Linear(h, 3 * len(rows), bias=False), nn.Linear(len(rows), h, bias=False)
    with torch.no_grad():
        wqkv.weight.copy_(torch.cat([attn.Wqkv.weight[j * h + rows] for j in range(3)]))
        wo.weight.copy_(attn.Wo.weight[:, rows])
    attn.Wqkv, attn.Wo = wqkv, wo


def test_pruned_attention_heads_run_stock():
    # the packed attention split Wqkv's output into config.num_attention_heads: a call failed with "shape '[T, 3,
    # 2, 16]' is invalid for input of size ..." after pack(), and with validate=False pack() accepted the model
    model = _packed_and_called()
    _prune_heads(model, 1, 1)
    _assert_runs_stock(model, r"layers.1.attn.Wqkv.weight has shape \(48, 32\), not \(96, 32\)", grad=True)
    model = _model()
    _prune_heads(model, 0, 1)
    with pytest.raises(pe.UnsupportedTargetError, match="attention heads pruned"):
        pe.pack(model, validate=False)


class _Halve(nn.Module):
    def forward(self, w):
        return 0.5 * w


def test_pruned_and_parametrized_weights_are_named_with_the_way_out():
    """``torch.nn.utils.prune`` (a forward pre-hook recomputing ``weight``) and ``parametrize`` (a generated
    subclass computing it on access) outside a projection slot: refused at ``pack()`` naming what makes the weight
    plain again; after ``pack()`` the stock forward, with the same reason. A parametrized projection is not an
    ``nn.Linear`` but a subclass: the packed forward calls it (its weight computed as stock computes it)."""
    from torch.nn.utils import parametrize, prune

    model = _model()
    prune.l1_unstructured(model.layers[0].attn.Wqkv, "weight", 0.3)
    with pytest.raises(pe.UnsupportedTargetError, match=r"layers.0.attn.Wqkv is pruned .*prune.remove"):
        pe.pack(model)
    model = _model()
    parametrize.register_parametrization(model.layers[1].mlp_norm, "weight", nn.Identity())
    with pytest.raises(pe.UnsupportedTargetError, match=r"layers.1.mlp_norm is parametrized .*remove_parametrizations"):
        pe.pack(model)
    model = _packed_and_called()
    prune.random_unstructured(model.layers[1].mlp.Wo, "weight", 0.5)
    _assert_runs_stock(model, r"layers.1.mlp.Wo is pruned", grad=True)
    model = _packed_and_called()
    parametrize.register_parametrization(model.layers[1].mlp.Wi, "weight", _Halve())
    _assert_stays_packed(model)  # (against stock, which halves the weight too)
    assert pe.describe(model)["encoders"][0]["module_calls"] == ["layers.1.mlp.Wi (torch.nn.utils.parametrize."
                                                                "ParametrizedLinear)"]


@pytest.mark.parametrize("change", ["swap_layers", "subclass", "activation", "backward_hook", "rotary_hook",
                                    "instance_forward", "embedding_option"])
@pytest.mark.parametrize("validate", [False, True])
def test_pack_refuses_what_it_would_skip_whatever_validate_is(change, validate):
    model = _model(num_hidden_layers=3)
    if change == "swap_layers":
        model.layers[0], model.layers[1] = model.layers[1], model.layers[0]
    elif change == "subclass":
        _subclassed(model, "mlp")
    elif change == "activation":
        model.layers[1].mlp.act = nn.ReLU()
    elif change == "backward_hook":
        model.layers[1].attn.register_full_backward_hook(lambda m, gi, go: None)
    elif change == "rotary_hook":
        model.rotary_emb.register_forward_hook(lambda m, i, o: None)
    elif change == "embedding_option":
        model.embeddings.tok_embeddings.scale_grad_by_freq = True
    else:
        model.layers[1].mlp.forward = model.layers[1].mlp.forward
    with pytest.raises(pe.UnsupportedTargetError, match="cannot pack"):
        pe.pack(model, validate=validate)
    assert not pe.is_packed(model)


def test_fsdp_wrapped_layer_is_named():
    """FSDP (fully_shard) swaps a module's class for an FSDP subclass and hooks it: named, stock forward."""
    dist = pytest.importorskip("torch.distributed")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    if not dist.is_available() or not hasattr(fsdp, "fully_shard"):
        pytest.skip("torch.distributed.fsdp.fully_shard unavailable")
    model = _packed_and_called()
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        fsdp.fully_shard(model.layers[1])
        assert "FSDP" in type(model.layers[1]).__name__
        _assert_runs_stock(model, "layers.1 is sharded by FSDP2")
    finally:
        dist.destroy_process_group()


def test_deepcopy_of_a_changed_model_still_runs_stock():
    model = _packed_and_called()
    model.layers[1].mlp.register_full_backward_hook(lambda m, gi, go: None)
    _assert_runs_stock(copy.deepcopy(model), "backward hooks")


def test_an_accelerate_hook_inside_the_encoder_is_named():
    """accelerate's offloading hooks (``device_map`` with CPU or disk offload) sit on submodules' forwards: refused
    at ``pack()`` naming accelerate and the way out."""
    hooks = pytest.importorskip("accelerate.hooks")
    model = _model()
    hooks.add_hook_to_module(model.embeddings, hooks.ModelHook())
    with pytest.raises(pe.UnsupportedTargetError, match="accelerate hook.*load the model on one device"):
        pe.pack(model)
