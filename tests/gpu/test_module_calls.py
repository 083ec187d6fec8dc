"""peft LoRA / DoRA layers in the projection slots on CUDA (ModernBERT-base geometry, random init): the packed
forward calls them (checked per-op path) and matches stock in bf16 with and without autocast, gradients included;
CUDA graphs replay LoRA layers and follow their adapters' state and in-place weight updates; DoRA runs eagerly;
merging the adapters gives the fused paths back.

Run: ``python -m pytest -q tests/gpu/test_module_calls.py`` (skipped without CUDA or peft).
"""

from __future__ import annotations

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
peft = pytest.importorskip("peft")

import packed_encoders as pe  # noqa: E402
from tests.helpers import make_model, padded_batch, stock_forward, token_cosines  # noqa: E402

DEV = torch.device("cuda")
LENGTHS = (1, 65, 130, 513, 2049)


def _lora(dtype=None, **kw):
    """``(peft_model, encoder)``: base geometry under LoRA on every projection slot, ``lora_B`` random."""
    encoder = make_model("base", dtype=dtype, device=DEV)
    model = peft.get_peft_model(encoder, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["Wqkv", "Wo", "Wi"],
                                                         **kw))
    g = torch.Generator(device=DEV).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g, device=DEV, dtype=p.dtype))
    return model.eval(), encoder


def _batch(seed=0, lengths=LENGTHS):
    return padded_batch(lengths, "mixed", seed=seed, vocab_size=50000, device=DEV)


def _assert_bf16_parity(out, ref, mask):
    cos = token_cosines(out.float(), ref.float(), mask)
    assert cos.min() >= 0.995 and cos.mean() >= 0.999, (float(cos.min()), float(cos.mean()))
    assert out[~mask.bool()].abs().max() == 0


@pytest.mark.parametrize("variant", ["lora", "dora"])
@pytest.mark.parametrize("precision", ["autocast", "bf16"])
def test_lora_inference_parity_graphs_for_lora_eager_for_dora(variant, precision):
    model, encoder = _lora(dtype=torch.bfloat16 if precision == "bf16" else None, use_dora=variant == "dora")
    ids, mask = _batch(lengths=(1, 65, 130, 513, 2000))  # within the default graphs' max_seqlen (2048)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast")
    with torch.no_grad(), autocast:
        ref = stock_forward(encoder, ids, mask)
    pe.pack(model)  # the default: graphs on, validated against stock
    try:
        with torch.no_grad(), autocast, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):  # captured, then replayed
                out = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            with pe.no_cuda_graph(model):
                eager = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        _assert_bf16_parity(out, ref, mask)
        _assert_bf16_parity(eager, ref, mask)
        info = pe.describe(model)["encoders"][0]
        slots = 4 * encoder.config.num_hidden_layers
        assert info["eager_plan"]["merged_lora_slots"] == (slots if variant == "lora" else 0), info["eager_plan"]
        assert len(info["module_calls"]) == slots, info["module_calls"][:2]
        graphs = info["cuda_graph"]
        if variant == "lora":
            assert graphs["idle_reason"] is None and graphs["graphs"] >= 1 and graphs["hits"] >= 2, graphs
        else:
            assert graphs["idle_reason"].startswith("module call at layers.0.attn.Wqkv"), graphs
            assert "LoRA variant" in graphs["idle_reason"] and graphs["graphs"] == 0, graphs
        assert info["packed"] and info.get("runs_stock") is None, info.get("runs_stock")
    finally:
        pe.unpack(model)


def test_lora_graphs_follow_weight_updates_and_adapter_state():
    """A replay reads the adapters' weights by address (an in-place update, as an optimizer step makes, is seen)
    and is keyed on their state (``disable_adapter()``, ``set_scale``): each output is stock's for the model as it
    is at that call."""
    model, encoder = _lora()
    ids, mask = _batch(seed=3, lengths=(7, 65, 300, 1000))
    pe.pack(model, validate=False)

    def both():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            out = [encoder(input_ids=ids, attention_mask=mask).last_hidden_state for _ in range(2)]
            ref = stock_forward(encoder, ids, mask)
        for o in out:
            _assert_bf16_parity(o, ref, mask)
        return out[-1]

    try:
        first = both()
        hits = pe.describe(model)["encoders"][0]["cuda_graph"]["hits"]
        assert hits >= 1
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.mul_(-1.0)  # in place: the graph's addresses, new values
        flipped = both()
        assert (flipped - first)[mask.bool()].abs().max() > 1e-2
        with model.disable_adapter():
            base = both()
        for module in model.modules():
            if hasattr(module, "set_scale") and hasattr(module, "lora_A"):
                module.set_scale("default", 0.5)
        halved = both()
        assert (halved - flipped)[mask.bool()].abs().max() > 1e-2 and (halved - base)[mask.bool()].abs().max() > 1e-3
        info = pe.describe(model)["encoders"][0]["cuda_graph"]
        assert info["hits"] >= hits + 4 and info["invalidations"] >= 2 and info["fallbacks"] == {}, info
    finally:
        pe.unpack(model)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_match_stock_under_autocast(checkpointing):
    model, encoder = _lora()
    if checkpointing:
        encoder.gradient_checkpointing_enable()
    model.train()
    ids, mask = _batch(seed=1)
    real = mask.bool()

    def grads(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        (out.float()[real].pow(2).mean()).backward()
        return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}

    ref = grads(lambda: stock_forward(encoder, ids, mask))
    pe.pack(model, validate=False)
    try:
        got = grads(lambda: encoder(input_ids=ids, attention_mask=mask).last_hidden_state)
    finally:
        pe.unpack(model)
    assert ref.keys() == got.keys() and any("lora_A" in n for n in ref)
    for name, r in ref.items():
        cos = torch.nn.functional.cosine_similarity(got[name].flatten(), r.flatten(), dim=0)
        assert cos >= 0.99, (name, float(cos))


def test_merging_the_adapters_brings_the_graphs_back():
    model, encoder = _lora()
    ids, mask = _batch(seed=2, lengths=(1, 65, 130, 513, 2000))  # within the default graphs' max_seqlen (2048)
    pe.pack(model, validate=False)
    try:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            before = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            merged = model.merge_and_unload()  # the base Linears back in the slots, the adapters added in
            assert merged is encoder
            assert pe.describe(encoder)["encoders"][0]["module_calls"] == []
            for _ in range(3):
                after = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
            ref = stock_forward(encoder, ids, mask)
        info = pe.describe(encoder)["encoders"][0]["cuda_graph"]
        assert info["idle_reason"] is None and info["graphs"] >= 1 and info["hits"] >= 1, info
        _assert_bf16_parity(after, ref, mask)
        _assert_bf16_parity(after, before, mask)  # merged: the same function
    finally:
        pe.unpack(encoder)
