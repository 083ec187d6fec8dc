"""The Triton LoRA merge (``ops/triton/lora_merge.py``) on CPU under the Triton interpreter: ``W + s * B @ A``
against the fp32 formula in every dtype mix peft meets, its op set's declines, and a packed peft model's no-grad
forward on the Triton op set merging through it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

from packed_encoders.model.calls import _merge  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def fused():
    from packed_encoders.ops import fused

    return fused


def _operands(n, k, r, w_dtype, ab_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(w_dtype)
    a = (torch.randn(r, k, generator=g) / r ** 0.5).to(ab_dtype)
    b = torch.randn(n, r, generator=g).to(ab_dtype)
    return weight, a, b


@pytest.mark.parametrize("shape", [(40, 130, 3), (7, 33, 1), (64, 256, 16), (20, 150, 17), (18, 140, 100)])
@pytest.mark.parametrize("w_dtype,ab_dtype,dtype", [(BF16, FP32, BF16), (BF16, BF16, BF16), (FP16, FP32, FP16),
                                                    (FP32, FP32, BF16), (FP32, BF16, FP16)])
def test_merge_is_the_fp32_formula_rounded_once(fused, shape, w_dtype, ab_dtype, dtype):
    """Within one rounding of the fp32 result (half an ulp, plus fp32 summation noise), and no farther from it
    than the torch ops (whose factors may be rounded to ``dtype`` first)."""
    n, k, r = shape
    weight, a, b = _operands(n, k, r, w_dtype, ab_dtype)
    before = [t.clone() for t in (weight, a, b)]
    scale = 0.75
    got = fused.lora_merge(weight, a, b, scale, dtype)
    ref = weight.double() + scale * (b.double() @ a.double())
    assert got is not None and got.dtype is dtype and got.shape == (n, k)
    err = (got.double() - ref).abs()
    ulp = torch.finfo(dtype).eps  # (the spacing at 1: half of it bounds one rounding relative to the value)
    assert bool((err <= 0.5 * ulp * ref.abs() + 1e-6 * (1 + ref.abs())).all()), float(err.max())
    torch_err = (_merge(weight, None, ((a, b, None, scale),), dtype)[0].double() - ref).abs()
    assert float(err.max()) <= float(torch_err.max()) + 1e-6
    assert all(torch.equal(t, u) for t, u in zip((weight, a, b), before))  # (operands untouched)


def test_merge_serves_the_merge_of_one_adapter_and_declines_the_rest(fused, monkeypatch):
    """``_merge`` takes the kernel for one adapter with a number for ``scaling``; the kernel declines fp32 results
    (plain torch keeps fp32 parity, as every op set op does), ranks beyond its cap and integer tensors."""
    from packed_encoders.ops.triton import lora_merge

    weight, a, b = _operands(24, 40, 4, BF16, FP32)
    assert fused.lora_merge(weight.float(), a, b, 1.0, FP32) is None
    big_a, big_b = torch.zeros(lora_merge.MAX_RANK + 1, 40), torch.zeros(24, lora_merge.MAX_RANK + 1)
    assert fused.lora_merge(weight, big_a, big_b, 1.0, BF16) is None
    assert fused.lora_merge(weight.to(torch.int8), a, b, 1.0, BF16) is None
    seen = []
    real = lora_merge.merge
    monkeypatch.setattr(lora_merge, "merge", lambda *args: seen.append(args[3]) or real(*args))
    bias, b_bias = torch.randn(24).to(BF16), torch.randn(24)
    w, bb = _merge(weight, bias, ((a, b, b_bias, 0.5),), BF16, fused.lora_merge)
    assert seen == [0.5]
    torch.testing.assert_close(w, lora_merge.merge(weight, a, b, 0.5, BF16), atol=0, rtol=0)
    torch.testing.assert_close(bb.float(), bias.float() + 0.5 * b_bias, atol=1e-2, rtol=1e-2)
    _merge(weight, None, ((a, b, None, torch.tensor(0.5)),), BF16, fused.lora_merge)  # (a tensor scaling)
    _merge(weight, None, ((a, b, None, 0.5), (a, b, None, 0.25)), BF16, fused.lora_merge)  # (two adapters)
    assert seen == [0.5, 0.5]  # (the assert_close's own call above; neither of the last two)


def test_packed_peft_model_merges_through_the_kernel(fused, monkeypatch):
    """A bf16 peft LoRA model's no-grad forward on the Triton op set merges every LoRA slot with the kernel and
    gives stock's output."""
    peft = pytest.importorskip("peft")
    from packed_encoders.batch import unpad
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams
    from packed_encoders.ops.triton import lora_merge
    from tests.helpers import make_model, padded_batch, stock_forward, token_cosines

    encoder = make_model("tiny").to(BF16)
    model = peft.get_peft_model(encoder, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["Wqkv", "Wo", "Wi"]))
    model.eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    assert encoder.layers[0].attn.Wqkv.lora_A["default"].weight.dtype is FP32  # (peft's fp32 adapters)
    seen = []
    real = lora_merge.merge
    monkeypatch.setattr(lora_merge, "merge", lambda *args: seen.append(1) or real(*args))
    ids, mask = padded_batch([5, 9, 2], side="right")
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=encoder.config.vocab_size)
    params = ModernBertParams.from_hf_config(encoder.config)
    with torch.no_grad():
        got = encoder_forward(encoder, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa")
        ref = stock_forward(encoder, ids, mask)
    assert len(seen) == 4 * len(encoder.layers)  # ("Wo" names attn.Wo and mlp.Wo)
    out = torch.zeros_like(ref)
    out[mask.bool()] = got.to(ref.dtype)
    assert float(token_cosines(out.float(), ref.float(), mask).min()) > 0.999
