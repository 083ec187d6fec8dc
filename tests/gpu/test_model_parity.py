"""The packed forward on CUDA in bf16 against stock HF at ModernBERT-base and -large geometry (random init),
lengths up to 8192, for every attention backend and op set; one host sync per padded call; gradients.

Run: ``python -m pytest -q tests/gpu/test_model_parity.py`` (skipped without CUDA).
"""

from __future__ import annotations

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import packed_encoders as pe  # noqa: E402
from packed_encoders.attention import BACKENDS  # noqa: E402

DEV = torch.device("cuda")
GEOMETRY = {
    "base": dict(),  # ModernBertConfig() defaults: 22 layers, 768 hidden, 12 x 64 heads, intermediate 1152
    "large": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624),
}
LENGTHS = (1, 65, 130, 513, 2049, 8192)


def random_model(**config):
    """A random-init bf16 ``ModernBertModel`` on the GPU (sdpa) from ``ModernBertConfig(**config)``."""
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    config = ModernBertConfig(**config)
    config._attn_implementation = "sdpa"
    m = ModernBertModel(config).to(DEV, torch.bfloat16).eval()
    with torch.no_grad():  # LayerNorm weights of exactly 1 would hide weight bugs
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.add_(0.1 * torch.randn_like(mod.weight))
    return m


@pytest.fixture(scope="module", params=list(GEOMETRY))
def model(request):
    return random_model(**GEOMETRY[request.param])


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(5, 50000, (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for row, n in enumerate(lengths):
        if row % 2:
            mask[row, s - n:] = 1
        else:
            mask[row, :n] = 1
    return ids.to(DEV), mask.to(DEV)


@pytest.fixture(scope="module")
def stock_out(model):
    ids, mask = _batch(LENGTHS)
    pe.unpack(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    return ids, mask, out.last_hidden_state.float()


def _cos(a, b, mask):
    real = mask.bool()
    return torch.nn.functional.cosine_similarity(a[real].float(), b[real].float(), dim=-1)


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "fa4", "auto"])
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_bf16_parity_long(model, stock_out, backend, kernels):
    why = None if backend == "auto" else BACKENDS[backend].availability()
    if why:
        pytest.skip(why)
    ids, mask, ref = stock_out
    pe.pack(model, attention_backend=backend, kernels=kernels)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        cos = _cos(out, ref, mask)
        info = pe.describe(model)["encoders"][0]
        print(backend, kernels, info["kernels"], info["last_attention"], float(cos.min()), float(cos.mean()))
        assert cos.min() >= 0.995 and cos.mean() >= 0.999, (float(cos.min()), float(cos.mean()), info)
        assert out[~mask.bool()].abs().max() == 0
    finally:
        pe.unpack(model)


def test_triton_attention_short_batch(model):
    if BACKENDS["triton"].availability():
        pytest.skip(BACKENDS["triton"].availability())
    ids, mask = _batch([5, 64, 65, 128, 30, 1, 77, 100])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        pe.pack(model, attention_backend="triton")
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    pe.unpack(model)
    cos = _cos(out, ref.last_hidden_state, mask)
    assert cos.min() >= 0.995 and cos.mean() >= 0.999


def test_one_host_sync_per_padded_call(model):
    ids, mask = _batch([17, 300, 45, 2])
    pe.pack(model)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)  # warm: tables, kernel compiles
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(input_ids=ids, attention_mask=mask)
            torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) == 1, [str(w.message)[:120] for w in syncs]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        pe.unpack(model)


def test_gradients_bf16_autocast_vs_stock(model):
    """fp32 master weights under bf16 autocast (the training setup): packed vs stock gradients."""
    master = model.float()
    ids, mask = _batch([40, 300, 129, 7])
    real = mask.bool()
    torch.manual_seed(1)
    target = torch.randn(*ids.shape, model.config.hidden_size, device=DEV)

    def grads(fn):
        master.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        ((out.float() - target)[real] ** 2).mean().backward()
        return {n: p.grad.float().clone() for n, p in master.named_parameters() if p.grad is not None}

    master.train()
    try:
        ref = grads(lambda: master(input_ids=ids, attention_mask=mask,
                                   position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state)
        pe.pack(master)
        got = grads(lambda: master(input_ids=ids, attention_mask=mask).last_hidden_state)
        info = pe.describe(master)["encoders"][0]
        # Output-proximate parameters agree tightly; deep layers drift in bf16 even between two correct paths.
        last = master.config.num_hidden_layers - 1
        for name in [n for n in ref if n.startswith(f"layers.{last}.") or n.startswith("final_norm")]:
            cos = torch.nn.functional.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0)
            assert cos > 0.99, (name, float(cos), info)
    finally:
        pe.unpack(master)
        master.to(torch.bfloat16).eval()
