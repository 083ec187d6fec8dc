"""peft LoRA layers, and any other module but an ``nn.Linear``, in the projection slots (``attn.Wqkv``, ``attn.Wo``,
``mlp.Wi``, ``mlp.Wo``): the packed forward calls them on its packed rows, so peft's own forward decides (active
adapters, ``disable_adapter()``, merged state, ``lora_dropout``, DoRA, rslora) and gradients reach their parameters.
Packed against stock HF on the same model (stock runs the same LoRA layers on padded rows), per real token."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings

import pytest
import torch
from torch import nn

import packed_encoders as pe
from tests.helpers import make_model, padded_batch, set_checkpointing, stock, stock_forward, token_cosines

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

LORA = "peft.tuners.lora.layer.Linear"
ALL = ["Wqkv", "Wo", "Wi"]  # "Wo" is attn.Wo and mlp.Wo: every projection slot
LENGTHS = [5, 40, 17]  # past the tiny configs' local window (half window 8)


def _config(targets=ALL, **kw):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=kw.pop("lora_dropout", 0.0), **kw)


def _randomise(model, seed: int = 1, scale: float = 0.3) -> None:
    """Non-zero ``lora_B`` (peft initialises it to zero: the adapters would change nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def _peft_model(targets=ALL, name="tiny", seed=0, **kw):
    """``(peft_model, encoder)``: a random tiny ModernBertModel under ``peft.get_peft_model``, ``lora_B`` random."""
    encoder = make_model(name, seed=seed)
    model = peft.get_peft_model(encoder, _config(targets, **kw))
    _randomise(model)
    return model.eval(), encoder  # (get_peft_model leaves the model in train mode)


def _batch():
    return padded_batch(LENGTHS, side="mixed")


def _out(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).last_hidden_state


def _assert_parity(out, ref, mask, *, cos_min=0.99999, atol=2e-5):
    cos = token_cosines(out.detach(), ref.detach(), mask)
    assert float(cos.min()) > cos_min, float(cos.min())
    if atol is not None:
        real = mask.bool()
        torch.testing.assert_close(out[real].detach().float(), ref[real].detach().float(), atol=atol, rtol=1e-4)


def _differs(a, b, mask, by: float = 1e-2) -> bool:
    real = mask.bool()
    return float((a[real] - b[real]).abs().max()) > by


# ------------------------------------------------------------------------------------------------ forward parity


@pytest.mark.parametrize("targets, per_layer", [(ALL, 4), (["Wqkv", "mlp.Wo"], 2), (["attn.Wo", "Wi"], 2)],
                         ids=["all", "qkv_mlp_wo", "wo_wi"])
@pytest.mark.parametrize("variant", ["lora", "dora", "rslora"])
def test_lora_parity_fp32(targets, per_layer, variant):
    kw = {"dora": dict(use_dora=True), "rslora": dict(use_rslora=True)}.get(variant, {})
    model, encoder = _peft_model(targets, **kw)
    ids, mask = _batch()
    with torch.no_grad():
        ref = stock_forward(encoder, ids, mask)
        base = _adapters_off(model, lambda: stock_forward(encoder, ids, mask))
    pe.pack(model)
    assert pe.is_packed(model)
    with torch.no_grad():
        out = _out(model, ids, mask)
    _assert_parity(out, ref, mask)
    assert _differs(ref, base, mask)  # the adapters change the output: parity is not the base model's
    slots = pe.describe(model)["encoders"][0]["module_calls"]
    assert len(slots) == per_layer * encoder.config.num_hidden_layers and all(LORA in s for s in slots), slots


def _adapters_off(model, fn):
    with model.disable_adapter():
        return fn()


def test_lora_parity_under_cpu_bf16_autocast():
    model, encoder = _peft_model(ALL)
    ids, mask = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = stock_forward(encoder, ids, mask)
    pe.pack(model)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            out = _out(model, ids, mask)
        # bf16: the residual stream is fp32 in both, the projections round to bf16 in both (peft's layers run
        # under the same autocast); what differs is the order of sums
        _assert_parity(out.float(), ref.float(), mask, cos_min=0.999, atol=None)
        assert float(token_cosines(out.float(), ref.float(), mask).mean()) > 0.9999


class _Fp32Out(nn.Module):
    """A called slot returning fp32 under autocast (as a module adding fp32 terms does)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x).float()


def test_a_called_slot_returning_fp32_under_autocast_feeds_the_kernels_their_dtype(monkeypatch):
    """The attention after ``Wqkv`` and the GLU after ``Wi`` get the activations' dtype (autocast's), as stock's
    attention does under autocast, whatever the module returns."""
    from packed_encoders.model import forward as fwd

    encoder = make_model("tiny")
    layer = encoder.layers[1]
    layer.attn.Wqkv, layer.mlp.Wi = _Fp32Out(layer.attn.Wqkv), _Fp32Out(layer.mlp.Wi)
    ids, mask = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        ref = stock_forward(encoder, ids, mask)
    pe.pack(encoder)
    seen = []
    real_call = fwd.call_module

    def spy(module, x, width, index, slot, dtype=None):
        y = real_call(module, x, width, index, slot, dtype)
        seen.append((index, slot, y.dtype))
        return y

    monkeypatch.setattr(fwd, "call_module", spy)
    for grad in (False, True):
        seen.clear()
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            out = _out(encoder, ids, mask)
        assert seen == [(1, "attn.Wqkv", torch.bfloat16), (1, "mlp.Wi", torch.bfloat16)], seen
        _assert_parity(out.float(), ref.float(), mask, cos_min=0.999, atol=None)


def test_lora_hidden_states_and_packed_calls_match_stock():
    """The per-layer outputs (output_hidden_states) and an already packed call (packed_forward) run the called
    layers as the padded call does."""
    from tests.helpers import packed_inputs

    model, encoder = _peft_model(["Wqkv", "Wi"])
    ids, mask = _batch()
    with torch.no_grad():
        ref = stock(encoder, input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    output_hidden_states=True)
        pe.pack(model)
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        flat = pe.packed_forward(model, None, *packed_inputs(ids, mask))
    assert len(out.hidden_states) == len(ref.hidden_states) == encoder.config.num_hidden_layers + 1
    for got, want in zip(out.hidden_states, ref.hidden_states):
        _assert_parity(got, want, mask)
    torch.testing.assert_close(flat, ref.last_hidden_state[mask.bool()], atol=2e-5, rtol=1e-4)


def test_two_adapters_set_adapter_disable_and_merge_follow_peft():
    model, encoder = _peft_model(ALL)
    model.add_adapter("other", _config(["Wqkv", "Wi"]))
    _randomise(model, seed=2, scale=0.5)  # (both adapters' B again, with other values)
    ids, mask = _batch()
    pe.pack(model)

    def both():
        with torch.no_grad():
            return _out(model, ids, mask), stock_forward(encoder, ids, mask)

    out_default, ref = both()
    _assert_parity(out_default, ref, mask)
    model.set_adapter("other")
    out_other, ref = both()
    _assert_parity(out_other, ref, mask)
    assert _differs(out_default, out_other, mask)
    with model.disable_adapter():
        out_off, ref = both()
    _assert_parity(out_off, ref, mask)
    assert _differs(out_off, out_other, mask)
    model.set_adapter("default")
    model.merge_adapter()  # the base weights now hold the adapter (through .data): the layers are still called
    out_merged, ref = both()
    _assert_parity(out_merged, ref, mask)
    _assert_parity(out_merged, out_default, mask)  # the same function, merged
    model.unmerge_adapter()
    out_unmerged, ref = both()
    _assert_parity(out_unmerged, ref, mask)
    _assert_parity(out_unmerged, out_default, mask)
    assert pe.is_packed(model) and not pe.describe(model)["encoders"][0]["stock_forward_calls"]


def test_any_token_wise_module_is_called_and_a_wrong_width_is_named():
    """Not only peft: a module without Linear's attributes is called too, and the widths it declares or returns are
    checked (at pack() when it declares in / out features, at the call otherwise)."""
    encoder = make_model("tiny")
    h = encoder.config.hidden_size
    layer = encoder.layers[1]
    layer.mlp.Wo = nn.Sequential(layer.mlp.Wo, nn.Tanh())  # a token-wise map with no in_features / out_features
    ids, mask = _batch()
    with torch.no_grad():
        ref = stock_forward(encoder, ids, mask)
        pe.pack(encoder)
        _assert_parity(_out(encoder, ids, mask), ref, mask)
    assert pe.describe(encoder)["encoders"][0]["module_calls"] == ["layers.1.mlp.Wo (torch.nn.modules.container."
                                                                  "Sequential)"]
    pe.unpack(encoder)
    layer.mlp.Wo = nn.Sequential(nn.Linear(encoder.config.intermediate_size, h // 2))  # the wrong width, undeclared
    pe.pack(encoder, validate=False)
    with pytest.raises(pe.PackedEncodersError, match=r"layers.1.mlp.Wo \(torch.nn.modules.container.Sequential\) "
                                                     r"returned shape \(\d+, 32\).*\[tokens, 64\]"):
        with torch.no_grad():
            _out(encoder, ids, mask)
    pe.unpack(encoder)

    class Declared(nn.Module):  # declares the wrong widths (as a pruned Linear would)
        def __init__(self):
            super().__init__()
            self.in_features, self.out_features = h, h // 2
            self.inner = nn.Linear(h, h)

        def forward(self, x):
            return self.inner(x)

    layer.mlp.Wo = nn.Linear(encoder.config.intermediate_size, h)
    layer.attn.Wo = Declared()
    with pytest.raises(pe.UnsupportedTargetError, match=r"layers.1.attn.Wo \(.*Declared\) maps 64 -> 32 features, "
                                                        r"not 64 -> 64"):
        pe.pack(encoder, validate=False)


# ------------------------------------------------------------------------------------------------ merged weights


def _count_lora_forwards(monkeypatch) -> list:
    from peft.tuners.lora import layer as lora_layer

    seen, real = [], lora_layer.Linear.forward
    monkeypatch.setattr(lora_layer.Linear, "forward", lambda self, *a, **k: seen.append(1) or real(self, *a, **k))
    return seen


def _count_merges(monkeypatch) -> list:
    from packed_encoders.model import calls

    seen, real = [], calls._merge
    monkeypatch.setattr(calls, "_merge", lambda *a: seen.append(1) or real(*a))
    return seen


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_no_grad_calls_run_lora_layers_as_weights_merged_from_the_live_adapters(monkeypatch, autocast):
    """Without gradients a LoRA layer runs as one Linear on ``W + s B A`` (peft's forward is not called), merged from
    the weights as they are at each call: an in-place update and an edit through ``.data`` (no version bump: peft's
    merge and hot-swap write so) are read by the next call, whose output is stock's (peft's own forward on padded
    rows). With gradients peft's forward runs."""
    model, encoder = _peft_model(ALL)
    ids, mask = _batch()
    pe.pack(model, validate=False)
    forwards, merges = _count_lora_forwards(monkeypatch), _count_merges(monkeypatch)
    slots = 4 * encoder.config.num_hidden_layers
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if autocast else contextlib.nullcontext
    tol = dict(cos_min=0.999, atol=None) if autocast else {}

    def check():
        with torch.no_grad(), ctx():
            out = _out(model, ids, mask)
            n = len(forwards)
            ref = stock_forward(encoder, ids, mask)
            del forwards[n:]  # (stock's calls)
        _assert_parity(out.float(), ref.float(), mask, **tol)
        return out

    first = check()
    assert forwards == [] and len(merges) == slots, (len(forwards), len(merges))
    assert pe.describe(model)["encoders"][0]["eager_plan"]["merged_lora_slots"] == slots
    with torch.no_grad():
        encoder.layers[1].mlp.Wi.lora_B["default"].weight.mul_(-1.0)
    changed = check()
    assert _differs(changed, first, mask, by=1e-3)
    encoder.layers[0].attn.Wqkv.lora_A["default"].weight.data.mul_(2.0)  # (its version counter stays)
    edited = check()
    assert _differs(edited, changed, mask, by=1e-3) and len(merges) == 3 * slots
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = _out(model, ids, mask)  # with gradients: peft's forward, as stock
    assert len(forwards) == slots
    _assert_parity(out.float().detach(), edited.float(), mask, **tol)


def test_merged_weights_follow_peft_state_and_leave_the_rest_called(monkeypatch):
    """disable_adapter(), set_scale, merge_adapter / unmerge_adapter (through .data) and a second adapter are
    followed; DoRA, train-mode lora_dropout and other modules stay called (peft's / their own forward)."""
    model, encoder = _peft_model(ALL)
    model.add_adapter("other", _config(["Wqkv", "Wi"]))
    _randomise(model, seed=2, scale=0.5)
    ids, mask = _batch()
    pe.pack(model, validate=False)

    def both():
        with torch.no_grad():
            out, ref = _out(model, ids, mask), stock_forward(encoder, ids, mask)
        _assert_parity(out, ref, mask)
        return out

    first = both()
    with model.disable_adapter():
        assert _differs(both(), first, mask)
    for module in model.modules():
        if hasattr(module, "set_scale") and hasattr(module, "lora_A"):
            module.set_scale("default", 0.25)
    assert _differs(both(), first, mask)
    model.set_adapter("other")
    both()
    model.merge_adapter()
    merged = both()
    model.unmerge_adapter()
    _assert_parity(both(), merged, mask)
    assert pe.describe(model)["encoders"][0]["eager_plan"]["merged_lora_slots"] == 4 * len(encoder.layers)

    forwards = _count_lora_forwards(monkeypatch)
    dora, dora_encoder = _peft_model(["Wqkv"], use_dora=True)
    pe.pack(dora, validate=False)
    with torch.no_grad():
        out = _out(dora, ids, mask)
        calls = len(forwards)
        _assert_parity(out, stock_forward(dora_encoder, ids, mask), mask)
    plan = pe.describe(dora)["encoders"][0]["eager_plan"]
    assert calls == len(dora_encoder.layers) and plan["merged_lora_slots"] == 0, plan
    assert plan["why_checked"].startswith(f"module call at layers.0.attn.Wqkv ({LORA})"), plan


@pytest.mark.parametrize("case", ["fp32", "bf16", "fp32_to_bf16", "bf16_weight_fp32_adapters", "two_adapters",
                                  "tensor_scaling", "lora_bias"])
def test_merge_is_the_linear_map_peft_computes(case):
    """``W + sum s B A`` (and ``b + sum s b_B``) against the fp32 formula, in every dtype mix the merge meets."""
    from packed_encoders.model.calls import _merge

    g = torch.Generator().manual_seed(0)
    low = torch.bfloat16 if case == "bf16" else torch.float32

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(low)

    weight, bias = rand(12, 8), rand(12)
    if case == "bf16_weight_fp32_adapters":  # (peft's adapters on a bf16 model)
        weight, bias, low = weight.bfloat16(), bias.bfloat16(), torch.float32
    n = 2 if case == "two_adapters" else 1
    terms = tuple((rand(4, 8), rand(12, 4), rand(12) if case == "lora_bias" else None,
                   torch.tensor(0.5) if case == "tensor_scaling" else 0.5 + i) for i in range(n))
    dtype = torch.bfloat16 if case in ("bf16", "fp32_to_bf16", "bf16_weight_fp32_adapters") else torch.float32
    before = weight.clone()
    w, b = _merge(weight, bias, terms, dtype)
    want_w = weight.float() + sum(float(s) * (b_w.float() @ a_w.float()) for a_w, b_w, _, s in terms)
    want_b = bias.float() + sum(float(s) * b_b.float() for _, _, b_b, s in terms if b_b is not None)
    assert w.dtype is dtype and b.dtype is dtype
    tol = dict(atol=2e-2, rtol=1e-2) if dtype is torch.bfloat16 else dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.float(), want_w, **tol)
    torch.testing.assert_close(b.float(), want_b, **tol)
    assert w.data_ptr() != weight.data_ptr() and torch.equal(weight, before)  # (the parameter untouched)


@pytest.mark.parametrize("unmerge", ["unmerge_adapter", "disabled_call"])
def test_no_copy_of_a_merged_weight_serves_after_the_unmerge_under_autocast(unmerge):
    """A no-grad autocast call while the adapters are merged reads the merged base weight (peft merged it through
    .data); once unmerged (``unmerge_adapter()``, or peft's own forward in a disabled call) a disabled call reads
    the base weight again, not a bf16 copy of the merged one kept from that call."""
    model, encoder = _peft_model(ALL)
    ids, mask = _batch()
    pe.pack(model, validate=False)
    bf16 = dict(device_type="cpu", dtype=torch.bfloat16)
    tol = dict(cos_min=0.999, atol=None)

    def both():
        with torch.no_grad(), torch.autocast(**bf16):
            out, ref = _out(model, ids, mask), stock_forward(encoder, ids, mask)
        _assert_parity(out.float(), ref.float(), mask, **tol)
        return out

    model.merge_adapter()
    merged = both()
    if unmerge == "unmerge_adapter":
        model.unmerge_adapter()
    with model.disable_adapter():
        both()  # (disabled_call: peft's forward unmerges here)
        assert _differs(both(), merged, mask)


# ------------------------------------------------------------------------------------------------ training


def _mean_pooled_loss(out, mask):
    m = mask[..., None].to(out.dtype)
    emb = torch.nn.functional.normalize((out * m).sum(1) / m.sum(1), dim=-1)
    return (emb @ emb.T).logsumexp(-1).mean() + out[mask.bool()].square().mean()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("trainable", ["lora", "all"])
def test_gradients_reach_every_trainable_parameter_as_in_stock(checkpointing, trainable):
    model, encoder = _peft_model(ALL, lora_dropout=0.0)
    if trainable == "all":  # base weights unfrozen too
        for p in model.parameters():
            p.requires_grad_(True)
    model.train()
    if checkpointing:
        set_checkpointing(encoder, True, use_reentrant=False)
    ids, mask = _batch()
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n, _ in params) and (trainable == "all") == any("base_layer" in n for n, _ in params)
    ref = stock_forward(encoder, ids, mask)
    ref_grads = torch.autograd.grad(_mean_pooled_loss(ref, mask), [p for _, p in params])
    pe.pack(model)
    out = _out(model, ids, mask)
    grads = torch.autograd.grad(_mean_pooled_loss(out, mask), [p for _, p in params])
    _assert_parity(out, ref, mask)
    for (name, _), g, r in zip(params, grads, ref_grads):
        assert float(r.abs().max()) > 0 or "lora_B" not in name, name  # (a frozen base: every lora_B gets one)
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-3, msg=name)
    plan = pe.describe(model)["encoders"][0]["eager_plan"]
    assert not plan["stack"] and plan["stack_off"].startswith("one autograd node per op: module call at")
    assert ("gradient checkpointing" in plan["stack_off"]) == checkpointing


def test_adamw_steps_give_stock_losses():
    model, encoder = _peft_model(ALL)
    ref_model = copy.deepcopy(model)
    ref_encoder = ref_model.base_model.model
    pe.pack(model)

    def train(m, forward):
        m.train()
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(3):
            ids, mask = padded_batch([7 + step, 33, 12], side="mixed", seed=step)
            loss = _mean_pooled_loss(forward(ids, mask), mask)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses

    ref = train(ref_model, lambda ids, mask: stock_forward(ref_encoder, ids, mask))
    got = train(model, lambda ids, mask: _out(model, ids, mask))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), atol=1e-5, rtol=1e-5)
    assert abs(ref[2] - ref[0]) > 1e-4  # the adapters trained


def test_lora_dropout_is_peft_s_own():
    """``lora_dropout`` is applied by peft's module, in its own mode: in train mode two calls differ, in eval they
    equal stock; at p = 1 the adapters' contribution is dropped entirely (the base model's output)."""
    model, encoder = _peft_model(ALL, lora_dropout=0.5)
    ids, mask = _batch()
    pe.pack(model)
    model.train()  # (ModernBERT's own dropout rates are 0 in these configs)
    with torch.no_grad():
        a, b = _out(model, ids, mask), _out(model, ids, mask)
    assert _differs(a, b, mask, by=1e-4)
    model.eval()
    with torch.no_grad():
        _assert_parity(_out(model, ids, mask), stock_forward(encoder, ids, mask), mask)
    model.train()
    for m in model.modules():
        if isinstance(m, nn.Dropout) and m.p == 0.5:
            m.p = 1.0
    with torch.no_grad():
        dropped = _out(model, ids, mask)
        base = _adapters_off(model, lambda: stock_forward(encoder, ids, mask))
    _assert_parity(dropped, base, mask)


# ------------------------------------------------------------------------------------------------ sentence-transformers


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_tokenizer import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_modernbert_lora"))


def _st_lora(model_dir):
    """A SentenceTransformer (mean pooling) over a saved tiny ModernBERT, with a LoRA adapter injected into its
    encoder as ``SentenceTransformer.add_adapter`` injects it (transformers' ``add_adapter`` calls
    ``peft.inject_adapter_in_model`` on the encoder; transformers 5.24 asks for peft >= 0.22 there, which
    :func:`test_transformers_and_sentence_transformers_add_adapter` needs)."""
    pytest.importorskip("sentence_transformers")
    from tests.test_training_loops import _st_model

    model = _st_model(model_dir)
    torch.manual_seed(0)  # lora_A's initial values
    peft.inject_adapter_in_model(_config(ALL), model[0].auto_model, "default")
    _randomise(model)
    return model


def _peft_accepted() -> str | None:
    """Why transformers' ``add_adapter`` refuses the installed peft (its minimum version), or ``None``."""
    from transformers.integrations import peft as hf_peft

    try:
        hf_peft.check_peft_version(min_version=hf_peft.MIN_PEFT_VERSION)
    except ValueError as e:
        return f"transformers {__import__('transformers').__version__}: {e} (peft {peft.__version__} installed)"
    return None


def test_transformers_and_sentence_transformers_add_adapter(model_dir):
    why = _peft_accepted()
    if why:
        pytest.skip(why)
    from tests.test_training_loops import _st_model
    from tests.tiny_tokenizer import TEXTS

    encoder = make_model("tiny")
    encoder.add_adapter(_config(ALL))
    _randomise(encoder)
    ids, mask = _batch()
    with torch.no_grad():
        ref = stock_forward(encoder, ids, mask)
        pe.pack(encoder)
        _assert_parity(_out(encoder, ids, mask), ref, mask)
    model = _st_model(model_dir)
    model.add_adapter(_config(ALL))
    _randomise(model)
    ref = model.encode(TEXTS, batch_size=3, convert_to_tensor=True)
    pe.pack(model)
    assert pe.describe(model)["encoders"][0]["module_calls"]
    torch.testing.assert_close(model.encode(TEXTS, batch_size=3, convert_to_tensor=True), ref, atol=1e-5, rtol=1e-4)


def test_sentence_transformers_lora_encode_parity(model_dir):
    from tests.tiny_tokenizer import TEXTS

    model = _st_lora(model_dir)
    ref = model.encode(TEXTS, batch_size=3, convert_to_tensor=True)
    pe.pack(model)
    entry = pe.describe(model)["encoders"][0]
    assert entry["packed"] and entry["module_calls"], entry
    out = model.encode(TEXTS, batch_size=3, convert_to_tensor=True)
    assert float(torch.nn.functional.cosine_similarity(out, ref, dim=-1).min()) > 0.99999
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)


def test_sentence_transformer_trainer_mnrl_with_an_adapter_matches_stock(model_dir, tmp_path):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.sentence_transformer import losses

    from tests.training_compare import LR, OPTIM, Recorder, compare, texts

    def train(packed: bool):
        model = _st_lora(model_dir)
        if packed:
            pe.pack(model)
        loss = losses.MultipleNegativesRankingLoss(model)
        rec = Recorder(loss)
        args = SentenceTransformerTrainingArguments(
            output_dir=str(tmp_path / f"out-{packed}"), per_device_train_batch_size=4, max_steps=2, learning_rate=LR,
            optim=OPTIM, warmup_steps=0, lr_scheduler_type="constant", seed=0, data_seed=0, max_grad_norm=0.0,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, dataloader_num_workers=0,
            disable_tqdm=True)
        SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_dict(texts(8)), loss=loss,
                                   callbacks=[rec.callback]).train()
        if packed:
            entry = pe.describe(model)["encoders"][0]
            assert entry["packed"] and entry["last_attention"] and entry["module_calls"], entry
        return rec, {n: p.detach().clone() for n, p in model.named_parameters()}

    ref, ref_w = train(False)
    got, got_w = train(True)
    initial = {n: p.detach().clone() for n, p in _st_lora(model_dir).named_parameters() if "lora_" in n}
    assert all(n in ref.grads[0] for n in initial) and len(ref.grads[0]) == len(initial)  # only the adapters train
    compare(ref, got, ref_w, got_w, initial, 2)


# ------------------------------------------------------------------------------------------------ live changes


def test_adapters_added_after_pack_are_followed_and_removing_them_too():
    encoder = make_model("tiny")
    ids, mask = _batch()
    pe.pack(encoder)
    with torch.no_grad():
        plain = _out(encoder, ids, mask)  # the structure snapshot exists: the change must be seen per call
    model = peft.get_peft_model(encoder, _config(ALL))
    _randomise(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # packed, no stock fallback
        with torch.no_grad():
            out = _out(model, ids, mask)
    with torch.no_grad():
        _assert_parity(out, stock_forward(encoder, ids, mask), mask)
    assert _differs(out, plain, mask)  # not the stale plain path
    entry = pe.describe(model)["encoders"][0]
    assert entry["packed"] and len(entry["module_calls"]) == 4 * encoder.config.num_hidden_layers
    unloaded = model.unload()  # the base Linears back in their slots: the plain routes again
    assert unloaded is encoder and type(encoder.layers[0].attn.Wqkv) is nn.Linear
    with torch.no_grad():
        assert torch.equal(_out(encoder, ids, mask), plain)
    entry = pe.describe(encoder)["encoders"][0]
    assert entry["packed"] and entry["module_calls"] == [], entry
    assert "module call" not in (entry["eager_plan"]["why_checked"] or "")


def test_merge_and_unload_under_autocast_reads_the_merged_weights():
    """Cast copies of the base weights made before the adapters came are not reused after peft's merge_and_unload,
    which adds the adapters into the weights through ``.data`` (no version bump) and puts the base Linears back: a
    call with the adapters in place saw them come, the next one sees them go (module swaps expire the copies)."""
    encoder = make_model("tiny")
    ids, mask = _batch()
    pe.pack(encoder)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = _out(encoder, ids, mask).float()  # bf16 copies of every projection weight cached
    model = peft.get_peft_model(encoder, _config(ALL)).eval()
    _randomise(model, scale=0.5)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _assert_parity(_out(model, ids, mask).float(), stock_forward(encoder, ids, mask).float(), mask,
                       cos_min=0.999, atol=None)  # (e.g. an evaluation before merging)
    merged = model.merge_and_unload()
    _assert_merged_weights_read(merged, encoder, ids, mask, before)


def _assert_merged_weights_read(merged, encoder, ids, mask, before):
    """After a merge the base Linears are back and an autocast call matches stock on the merged weights."""
    assert merged is encoder and type(encoder.layers[0].mlp.Wi) is nn.Linear
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = _out(encoder, ids, mask).float()
        ref = stock_forward(encoder, ids, mask).float()
    _assert_parity(out, ref, mask, cos_min=0.999, atol=None)
    assert _differs(out, before, mask, by=0.1)


@pytest.mark.parametrize("how", ["merge_and_unload", "merge_adapter_then_unload"])
def test_adapters_merged_with_no_call_between_under_autocast_are_read(how, tmp_path):
    """peft's one-liner ``PeftModel.from_pretrained(base, dir).merge_and_unload()`` on a packed encoder whose bf16
    copies were cached (an autocast call before): no call sees the adapters in place, so the module tree looks the
    same at the next call, while the base weights changed through ``.data``. Putting a module back into a tree
    expires the copies of its weights (a module registration hook), so the merged weights are read."""
    trained = peft.get_peft_model(make_model("tiny", seed=3), _config(ALL))
    _randomise(trained, scale=0.5)
    trained.save_pretrained(tmp_path)
    encoder = make_model("tiny")
    ids, mask = _batch()
    pe.pack(encoder)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        before = _out(encoder, ids, mask).float()  # bf16 copies of every projection weight cached
    model = peft.PeftModel.from_pretrained(encoder, tmp_path)
    if how == "merge_and_unload":
        merged = model.merge_and_unload()  # safe_merge=False: through .data
    else:
        model.merge_adapter()
        merged = model.unload()
    _assert_merged_weights_read(merged, encoder, ids, mask, before)


def test_module_registrations_elsewhere_keep_the_cast_copies():
    """The hook expires copies only when a module holding a weight they were made from is put into a tree: calls,
    and modules built elsewhere, keep them (one cast per weight change, not per call)."""
    from packed_encoders.ops import weight_cast

    weight_cast.clear()  # (ids of tensors earlier tests' copies were made from may be reused by the ones below)
    encoder = make_model("tiny")
    ids, mask = _batch()
    pe.pack(encoder)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _out(encoder, ids, mask)
        generation = weight_cast._STATE["generation"]
        _out(encoder, ids, mask)
        nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))  # registrations of modules of no cached weight
        encoder.layers[0].attn.extra = nn.Linear(2, 2)
        _out(encoder, ids, mask)
        assert weight_cast._STATE["generation"] == generation
        encoder.layers[0].mlp.Wi = encoder.layers[0].mlp.Wi  # the same Linear put back: its weight may have changed
        assert weight_cast._STATE["generation"] == generation + 1


def test_unpack_restores_stock_and_pack_again_reads_the_slots_again():
    model, encoder = _peft_model(["Wqkv"])
    ids, mask = _batch()
    pe.pack(model)
    pe.unpack(model)
    assert "forward" not in vars(encoder) and not pe.is_packed(encoder)
    with torch.no_grad():
        torch.testing.assert_close(_out(model, ids, mask), stock(encoder, input_ids=ids,
                                                                 attention_mask=mask).last_hidden_state,
                                   atol=0, rtol=0)
    model.base_model.model.layers[0].mlp.Wi = nn.Sequential(encoder.layers[0].mlp.Wi)  # a change while unpacked
    pe.pack(model)
    slots = pe.describe(model)["encoders"][0]["module_calls"]
    assert "layers.0.mlp.Wi (torch.nn.modules.container.Sequential)" in slots and len(slots) == 4
    with torch.no_grad():
        _assert_parity(_out(model, ids, mask), stock_forward(encoder, ids, mask), mask)


# ------------------------------------------------------------------------------------------------ still refused


def test_hooks_on_a_called_module_run_stock_and_are_refused_at_pack():
    model, encoder = _peft_model(ALL)
    ids, mask = _batch()
    pe.pack(model)
    seen = []
    handle = encoder.layers[0].attn.Wqkv.register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    with pytest.warns(RuntimeWarning, match=r"layers.0.attn.Wqkv has forward hooks \(the packed path calls it on "
                                            r"packed \[tokens, features\] rows"):
        with torch.no_grad():
            out = _out(model, ids, mask)
    assert seen == [tuple(ids.shape) + (encoder.config.hidden_size,)]  # stock's [B, S, H]: the stock forward ran
    with torch.no_grad():
        torch.testing.assert_close(out, stock(encoder, input_ids=ids, attention_mask=mask).last_hidden_state)
    assert not pe.is_packed(model)
    handle.remove()
    assert pe.is_packed(model)
    pe.unpack(model)
    encoder.layers[1].mlp.Wi.register_forward_pre_hook(lambda m, i: None)
    with pytest.raises(pe.UnsupportedTargetError, match=r"layers.1.mlp.Wi has forward hooks"):
        pe.pack(model)


@pytest.mark.parametrize("inner", ["lora_A.default", "lora_B.default", "lora_dropout.default", "base_layer"])
def test_hooks_inside_a_called_module_run_stock_and_are_refused_at_pack(inner):
    """The called module's forward calls its submodules on the packed rows too (a trial's hook on lora_A saw
    [tokens, in] where stock gives [B, S, in]): a hook in there, forward or backward, set after pack() (here on an
    adapter added after it) runs the call stock, warned, until removed; set before, pack() refuses it by name."""
    model, encoder = _peft_model(ALL)
    ids, mask = _batch()
    pe.pack(model)
    model.add_adapter("late", _config(["Wo"]))
    model.set_adapter("late")
    with torch.no_grad():
        _out(model, ids, mask)  # (packed, the new adapter called)
    assert not pe.describe(model)["encoders"][0]["stock_forward_calls"]
    seen = []
    sub = encoder.layers[0].attn.Wo.get_submodule(inner.replace("default", "late"))
    handle = sub.register_forward_hook(lambda m, i, o: seen.append(i[0].dim()))
    with pytest.warns(RuntimeWarning, match=rf"layers.0.attn.Wo.{inner.replace('default', 'late')} has forward hooks "
                                            r"\(the packed path calls it on packed \[tokens, features\] rows"):
        with torch.no_grad():
            out = _out(model, ids, mask)
    assert seen and set(seen) == {3}  # stock's [B, S, in]: the stock forward ran
    with torch.no_grad():
        torch.testing.assert_close(out, stock(encoder, input_ids=ids, attention_mask=mask).last_hidden_state)
    handle.remove()
    assert pe.is_packed(model)
    pe.unpack(model)
    handle = encoder.layers[1].mlp.Wi.get_submodule(inner).register_full_backward_hook(lambda *a: None)
    with pytest.raises(pe.UnsupportedTargetError, match=rf"layers.1.mlp.Wi.{inner} has backward hooks"):
        pe.pack(model)
    handle.remove()
    pe.pack(model)


def test_peft_mixed_adapter_batch_runs_stock():
    """peft's ``adapter_names=`` (an adapter per batch row) puts a forward pre-hook on each LoRA layer for the call:
    the packed rows have no batch layout, so that call runs the stock forward, warned, and gives stock's output."""
    model, encoder = _peft_model(ALL)
    model.add_adapter("other", _config(["Wqkv"]))
    _randomise(model, seed=3)
    model.eval()  # (peft takes adapter_names in eval mode only)
    ids, mask = _batch()
    names = ["default", "other", "__base__"]
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, adapter_names=names).last_hidden_state
    pe.pack(model)
    with pytest.warns(RuntimeWarning, match="running the stock forward: layers.0.attn.Wqkv has forward hooks"):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, adapter_names=names).last_hidden_state
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    assert pe.is_packed(model)  # the hooks went with the call


def test_lora_on_the_token_embedding_is_refused_by_name():
    encoder = make_model("tiny")
    model = peft.get_peft_model(encoder, _config(["tok_embeddings", "Wqkv"]))
    with pytest.raises(pe.UnsupportedTargetError,
                       match=r"embeddings.tok_embeddings is a peft.tuners.lora.layer.Embedding, not Embedding"):
        pe.pack(model)


def test_lora_over_pruned_heads_is_refused_by_its_widths():
    """peft's layer declares its base Linear's widths: a LoRA over a Wqkv of fewer heads (pruned) is named at
    pack(), as a plain pruned Wqkv is, and runs stock when made after pack()."""
    from tests.test_structure_changes import _prune_heads

    encoder = make_model("tiny")
    _prune_heads(encoder, 1, 1)
    peft.inject_adapter_in_model(_config(["Wqkv"]), encoder)
    with pytest.raises(pe.UnsupportedTargetError, match=rf"layers.1.attn.Wqkv \({LORA}\) maps 64 -> 96 features, not "
                                                        r"64 -> 192: .*attention heads pruned"):
        pe.pack(encoder, validate=False)
    pruned = encoder
    encoder = make_model("tiny")
    peft.inject_adapter_in_model(_config(["Wqkv"]), encoder)
    pe.pack(encoder)
    ids, mask = _batch()
    with torch.no_grad():
        _out(encoder, ids, mask)
    encoder.layers[1].attn.Wqkv, encoder.layers[1].attn.Wo = pruned.layers[1].attn.Wqkv, pruned.layers[1].attn.Wo
    with pytest.warns(RuntimeWarning, match=r"running the stock forward: layers.1.attn.Wqkv \(.*\) maps 64 -> 96"):
        with torch.no_grad():
            out = _out(encoder, ids, mask)
    with torch.no_grad():
        torch.testing.assert_close(out, stock(encoder, input_ids=ids, attention_mask=mask).last_hidden_state)


# ------------------------------------------------------------------------------------------------ graphs and describe


def _fake_cuda_graphs(monkeypatch):
    """Graph routes open on CPU: CUDA pretended, runners that run the forward instead of capturing it."""
    from packed_encoders import call
    from packed_encoders.graphs import route
    from packed_encoders.graphs.runner import GraphRunner

    real_mode = call.mode_facts
    monkeypatch.setattr(call, "mode_facts", lambda *a, **k: {**real_mode(*a, **k), "model_on_cuda": True})
    monkeypatch.setattr(route, "_build", lambda model, state, mgr, bucket, requested, query_only=False, autocast=None:
                        GraphRunner(model, state, bucket, requested, capture=False, query_only=query_only))


def test_lora_graphs_follow_the_adapter_state(monkeypatch):
    """Graphs serve an encoder under peft LoRA (CUDA pretended, capture-free runners): a call replays while the
    adapters' state is unchanged; putting adapters in, ``disable_adapter()``, ``set_scale`` and unloading them each
    change the graph fingerprint, so the next call captures again (a graph launched peft's kernels for the active
    adapters and their scaling). Outputs are stock's throughout."""
    encoder = make_model("tiny")
    ids, mask = _batch()
    pe.pack(encoder, validate=False)
    _fake_cuda_graphs(monkeypatch)

    def graphs():
        return pe.describe(encoder)["encoders"][0]["cuda_graph"]

    def run(ref_model=encoder):
        with torch.no_grad():
            out = _out(encoder, ids, mask)
            _assert_parity(out, stock_forward(ref_model, ids, mask), mask)
        return out

    plain = run()
    assert graphs()["graphs"] == 1 and graphs()["fallbacks"] == {}
    model = peft.get_peft_model(encoder, _config(["Wqkv", "Wi"])).eval()
    _randomise(model)
    seen = graphs()["invalidations"]

    def captured_again(expected: bool):
        nonlocal seen
        info = graphs()
        assert info["fallbacks"] == {} and info["graphs"] == 1, info
        assert (info["invalidations"] > seen) is expected, (info["invalidations"], seen)
        seen = info["invalidations"]

    adapted = run()
    assert _differs(adapted, plain, mask)
    captured_again(True)
    hits = graphs()["hits"]
    from packed_encoders.graphs import route
    from packed_encoders.model import calls

    reads, real = [], calls.replay_state
    for module in (calls, route):
        monkeypatch.setattr(module, "replay_state", lambda *a: reads.append(1) or real(*a))
    run()
    assert len(reads) == 1  # the router's read, carried to the fingerprint (once per call: ~2-3 us a slot)
    captured_again(False)
    assert graphs()["hits"] == hits + 1
    with model.disable_adapter():
        torch.testing.assert_close(run(), plain, atol=0, rtol=0)
    captured_again(True)
    run()
    captured_again(True)  # (enabled again)
    for module in model.modules():
        if type(module).__name__ == "Linear" and hasattr(module, "set_scale"):
            module.set_scale("default", 0.5)
    halved = run()
    assert _differs(halved, adapted, mask)
    captured_again(True)
    entry = pe.describe(model)["encoders"][0]
    assert entry["module_calls"][:2] == [f"layers.0.attn.Wqkv ({LORA})", f"layers.0.mlp.Wi ({LORA})"]
    assert entry["cuda_graph"]["idle_reason"].startswith("the model is on cpu")  # (pretended CUDA for the calls)
    model.unload()
    torch.testing.assert_close(run(), plain, atol=0, rtol=0)
    captured_again(True)
    assert pe.describe(encoder)["encoders"][0]["module_calls"] == []


@pytest.mark.parametrize("change", ["delete_and_add_adapter", "module_swapped_into_lora_A", "added_then_assigned",
                                    "written_into_modules"])
def test_lora_graphs_drop_when_modules_inside_a_slot_change(monkeypatch, change):
    """Modules come and go inside a LoRA layer with no change to the slot (a trial found each of these replaying
    graphs captured with the old adapter's tensors): an adapter deleted and added again under its name, a Linear put
    into ``lora_A``, ``load_state_dict(assign=True)`` into an adapter added after the first capture, a Linear written
    into ``lora_B._modules`` (no module registration). Each drops the graphs; outputs are stock's."""
    model, encoder = _peft_model(ALL)
    if change != "added_then_assigned":
        model.add_adapter("b", _config(ALL))
        _randomise(model, seed=2)
        model.set_adapter("b")
    ids, mask = _batch()
    pe.pack(model, validate=False)
    _fake_cuda_graphs(monkeypatch)

    def run():
        with torch.no_grad():
            out = _out(model, ids, mask)
            _assert_parity(out, stock_forward(encoder, ids, mask), mask)
        return pe.describe(encoder)["encoders"][0]["cuda_graph"]

    if change == "added_then_assigned":
        run()
        model.add_adapter("late", _config(ALL))
        model.set_adapter("late")
        _randomise(model, seed=3)
    run()
    before = run()
    assert before["hits"] >= 1
    if change == "delete_and_add_adapter":
        model.delete_adapter("b")
        model.add_adapter("b", _config(ALL))
        _randomise(model, seed=9)
        model.set_adapter("b")
    elif change == "module_swapped_into_lora_A":
        old = encoder.layers[0].attn.Wqkv.lora_A["b"]
        new = nn.Linear(old.in_features, old.out_features, bias=False)
        encoder.layers[0].attn.Wqkv.lora_A["b"] = new
    elif change == "written_into_modules":
        old = encoder.layers[0].attn.Wqkv.lora_B["b"]
        encoder.layers[0].attn.Wqkv.lora_B._modules["b"] = nn.Linear(old.in_features, old.out_features, bias=False)
    else:
        state = {k: 0.1 * torch.randn_like(v) for k, v in model.state_dict().items() if ".late." in k}
        assert state
        model.load_state_dict(state, strict=False, assign=True)
    after = run()
    assert after["invalidations"] > before["invalidations"], (before, after)


def test_a_hooked_module_put_inside_a_lora_layer_runs_stock():
    """Putting an already hooked module into a LoRA layer registers no hook (no handle is made): the per-call check
    of what the slot holds sees it come, and the call runs stock, warned."""
    model, encoder = _peft_model(ALL)
    ids, mask = _batch()
    old = encoder.layers[0].attn.Wqkv.lora_A["default"]
    hooked = nn.Linear(old.in_features, old.out_features, bias=False)
    hooked.load_state_dict(old.state_dict())
    seen = []
    hooked.register_forward_hook(lambda m, i, o: seen.append(i[0].dim()))  # (before pack(): no handle made after)
    pe.pack(model)
    with torch.no_grad():
        _out(model, ids, mask)
    encoder.layers[0].attn.Wqkv.lora_A["default"] = hooked
    with pytest.warns(RuntimeWarning, match=r"layers.0.attn.Wqkv.lora_A.default has forward hooks"):
        with torch.no_grad():
            _out(model, ids, mask)
    assert seen == [3]  # stock's [B, S, in]


@pytest.mark.parametrize("case", ["dora", "train_dropout", "other_module", "training_graphs"])
def test_graphs_refuse_called_slots_they_cannot_follow_with_the_reason(monkeypatch, case):
    """What a replay would not follow runs eagerly, the reason in describe(): a LoRA variant (DoRA), train-mode
    lora_dropout, a module type whose state is unknown; and a call with gradients under training graphs (they
    capture the packed layers' own backward). Outputs are stock's."""
    kw = {"dora": dict(use_dora=True), "train_dropout": dict(lora_dropout=0.1)}.get(case, {})
    model, encoder = _peft_model(["Wqkv"], **kw)
    if case == "train_dropout":
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.train()  # (MC dropout on the adapters only)
    if case == "other_module":
        model = encoder = make_model("tiny")
        encoder.layers[1].attn.Wqkv = _Fp32Out(encoder.layers[1].attn.Wqkv)
    pe.pack(model, validate=False, cuda_graph=pe.GraphConfig(training=case == "training_graphs"))
    _fake_cuda_graphs(monkeypatch)
    ids, mask = _batch()
    grad = case == "training_graphs"
    with torch.set_grad_enabled(grad), torch.random.fork_rng():
        out = _out(model, ids, mask)
    if case != "train_dropout":
        with torch.set_grad_enabled(grad):
            _assert_parity(out, stock_forward(encoder, ids, mask), mask)
    info = pe.describe(model)["encoders"][0]["cuda_graph"]
    why = {"dora": "a LoRA variant (DoraLinearVariant", "train_dropout": "lora_dropout applies (train mode, p=0.1)",
           "other_module": "CUDA graphs off (a graph would replay the module's forward",
           "training_graphs": "training graphs off"}[case]
    (reason, count), = info["fallbacks"].items()
    assert info["graphs"] == 0 and count == 1 and reason.startswith("module call at layers.") and why in reason, info


def test_pack_time_graph_check_skips_a_model_with_called_slots(monkeypatch):
    """pack(cuda_graph=...)'s graph check would capture without asking the router: it steps aside for a model whose
    called projection slots a graph would not follow (here DoRA), and says so in the validation report."""
    from packed_encoders import graph_check

    model, encoder = _peft_model(["Wqkv"], use_dora=True)
    monkeypatch.setattr(graph_check, "_eligible", lambda *a: True)  # as on CUDA
    monkeypatch.setattr(graph_check, "_check", lambda *a, **k: pytest.fail("the graph check ran"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ("the model is on cpu")
        pe.pack(model, cuda_graph=True)
    state = encoder._packed_encoders
    assert state.report.passed
    assert any(c.startswith(f"cuda_graph: not checked: module call at layers.0.attn.Wqkv ({LORA})")
               for c in state.report.checks), state.report.checks


def test_inside_a_called_sequential_insert_and_instance_forward_run_stock():
    """A hooked module put in by ``Sequential.insert`` (which registers nothing) and an instance ``forward`` set on a
    module inside a called slot (as accelerate's hooks do) each run the call stock, warned: they would see packed
    rows."""
    encoder = make_model("tiny")
    layer = encoder.layers[0]
    layer.mlp.Wo = nn.Sequential(layer.mlp.Wo)
    ids, mask = _batch()
    seen = []
    hooked = nn.Identity()
    hooked.register_forward_hook(lambda m, i, o: seen.append(i[0].dim()))
    pe.pack(encoder, validate=False)
    layer.mlp.Wo.insert(0, hooked)
    with pytest.warns(RuntimeWarning, match=r"layers.0.mlp.Wo.0 has forward hooks"):
        with torch.no_grad():
            _out(encoder, ids, mask)
    assert seen == [3]
    del layer.mlp.Wo[0]
    with torch.no_grad():
        _out(encoder, ids, mask)
    assert pe.is_packed(encoder)
    inner = layer.mlp.Wo[0]
    inner.forward = functools.partial(nn.Linear.forward, inner)
    with pytest.warns(RuntimeWarning, match=r"layers.0.mlp.Wo.0 has its own instance forward, which the packed path "
                                            r"would call on packed \[tokens, features\] rows"):
        with torch.no_grad():
            out = _out(encoder, ids, mask)
    with torch.no_grad():
        torch.testing.assert_close(out, stock(encoder, input_ids=ids, attention_mask=mask).last_hidden_state)
    inner._hf_hook = object()  # (accelerate's add_hook_to_module sets both)
    with pytest.warns(RuntimeWarning, match=r"layers.0.mlp.Wo.0 has an accelerate hook on its forward .*load the "
                                            r"model on one device"):
        with torch.no_grad():
            _out(encoder, ids, mask)


@pytest.mark.parametrize("declared", [dict(in_features=32), dict(out_features=65),
                                      dict(in_features=32, out_features=64)])
def test_a_called_module_declaring_any_width_not_the_slots_is_refused(declared):
    """README: a called module must declare the slot's widths if it declares any: each one it declares is checked,
    one declared alone included."""

    class Declares(nn.Module):
        def __init__(self):
            super().__init__()
            self.__dict__.update(declared)

        def forward(self, x):
            return x

    encoder = make_model("tiny")
    encoder.layers[0].attn.Wo = Declares()
    with pytest.raises(pe.UnsupportedTargetError, match=r"layers.0.attn.Wo .* features, not 64 -> 64"):
        pe.pack(encoder, validate=False)
    encoder.layers[0].attn.Wo = type("Right", (Declares,), {})()
    encoder.layers[0].attn.Wo.__dict__.update(in_features=64, out_features=64)
    pe.pack(encoder, validate=False)  # the slot's widths: accepted
