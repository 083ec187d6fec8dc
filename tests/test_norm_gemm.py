"""(Residual +) LayerNorm fused into a small-M GEMM (``ops/triton/norm_gemm.py``) on CPU under the Triton interpreter:
numerics against the fp32 reference and the separate ops, errors, routing (``PACKED_ENCODERS_NORM_GEMM``), and a
packed forward with the fusion on against the same forward with it off. The sm_90 build (no register spills at
ModernBERT-base geometry) is compiled ahead of time like the other kernels.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

from packed_encoders.ops import geglu_ref, layer_norm_ref  # noqa: E402
from packed_encoders.ops.triton import norm_gemm  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ENV = "PACKED_ENCODERS_NORM_GEMM"


def _rand(shape, dtype, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale + shift).to(dtype)


def _inputs(m, k, n, dtype, seed, *, residual=True, ln_weight=True, ln_bias=True, bias=True):
    x = _rand((m, k), dtype, seed, 2.0, 0.5)
    d = _rand((m, k), dtype, seed + 1) if residual else None
    lw = _rand((k,), dtype, seed + 2, 0.3, 1.0) if ln_weight else None
    lb = _rand((k,), dtype, seed + 3, 0.1) if ln_bias else None
    w = _rand((n, k), dtype, seed + 4, k ** -0.5)
    b = _rand((n,), dtype, seed + 5, 0.1) if bias else None
    return x, d, lw, lb, w, b


def _reference(x, d, lw, lb, w, b, activation, eps, dtype):
    """fp32 maths from the rounded residual sum, and the same ops in ``dtype`` (the rounding yardstick)."""
    s = (x.float() + d.float()).to(dtype) if d is not None else x
    out = {}
    for name, cast in (("ref", torch.float32), ("same", dtype)):
        normed = layer_norm_ref(s, lw, lb, eps)
        if name == "same":
            normed = normed.to(dtype)  # what the separate LayerNorm writes
        z = torch.nn.functional.linear(normed.to(cast), w.to(cast), None if b is None else b.to(cast)).float()
        out[name] = geglu_ref(z, activation) if activation else z
    return s, out["ref"], out["same"]


CASES = [
    # (m, k, n, activation, residual, ln_weight, ln_bias, bias)
    (1, 64, 48, None, True, True, True, True),
    (7, 96, 80, None, True, True, False, False),   # K = 96: KP 128, a masked last K step
    (33, 64, 64, "gelu", True, True, True, True),  # two row blocks, GLU I = 32
    (16, 96, 96, "gelu_tanh", False, True, True, False),  # no residual: a plain LayerNorm prologue
    (5, 64, 80, "silu", True, False, False, True),  # LayerNorm without affine; I = 40 (a partial column tile)
    (3, 64, 64, "relu", True, True, True, False),
]


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_and_separate_ops(case, dtype):
    m, k, n, activation, residual, lnw, lnb, bias = case
    x, d, lw, lb, w, b = _inputs(m, k, n, dtype, seed=m + k, residual=residual, ln_weight=lnw, ln_bias=lnb,
                                 bias=bias)
    s, y = norm_gemm.norm_linear(x, d, lw, lb, 1e-5, w, b, activation)
    s_ref, ref, same = _reference(x, d, lw, lb, w, b, activation, 1e-5, dtype)
    assert y.dtype == dtype and y.shape == ref.shape and y.is_contiguous()
    if residual:
        assert torch.equal(s, s_ref)  # the residual sum is rounded once, as the separate op does
    else:
        assert s is x
    err = (y.float() - ref).abs().max().item()
    yard = (same - ref).abs().max().item()
    eps = 64 * 2.0 ** -23 * max(1.0, ref.abs().max().item())
    assert err <= 2 * yard + eps, f"error {err:.3g} > 2 * {yard:.3g} + {eps:.3g}"


def test_large_mean_rows_keep_their_statistics():
    """Rows far from zero (mean 300, std 1): the centred variance from registers, not E[x^2] - mean^2."""
    x, d, lw, lb, w, b = _inputs(9, 64, 48, FP32, seed=3)
    x = x + 300.0
    _, y = norm_gemm.norm_linear(x, d, lw, lb, 1e-5, w, b)
    _, ref, _ = _reference(x, d, lw, lb, w, b, None, 1e-5, FP32)
    assert (y - ref).abs().max().item() < 1e-4


def test_empty_batch_and_strided_inputs():
    x, d, lw, lb, w, b = _inputs(0, 64, 48, BF16, seed=4)
    s, y = norm_gemm.norm_linear(x, d, lw, lb, 1e-5, w, b)
    assert s.shape == (0, 64) and y.shape == (0, 48)
    x, d, lw, lb, w, b = _inputs(3, 64, 48, BF16, seed=4)
    s, y = norm_gemm.norm_linear(x, d, lw, lb, 1e-5, w[:0], None)  # no output columns: the residual sum is still owed
    assert y.shape == (3, 0) and torch.equal(s, (x.float() + d.float()).to(BF16))
    wide = _rand((6, 128), BF16, 5)
    x = wide[:, :64]  # a row stride of 128
    _, d, lw, lb, w, b = _inputs(6, 64, 48, BF16, seed=6)
    _, y = norm_gemm.norm_linear(x, d, lw, lb, 1e-5, w, b)
    _, y2 = norm_gemm.norm_linear(x.contiguous(), d, lw, lb, 1e-5, w, b)
    assert torch.equal(y, y2)
    wt = _rand((64, 48), BF16, 7).t()  # a transposed weight view, read in place
    _, y = norm_gemm.norm_linear(x, d, lw, lb, 1e-5, wt, None)
    _, y2 = norm_gemm.norm_linear(x, d, lw, lb, 1e-5, wt.contiguous(), None)
    assert torch.equal(y, y2)


def test_errors_name_the_argument():
    x, d, lw, lb, w, b = _inputs(4, 64, 48, BF16, seed=8)
    bad = [
        (dict(x=_rand((4, 2048), BF16, 1), d=None, lw=None, lb=None, w=_rand((48, 2048), BF16, 2)), "hidden size"),
        (dict(d=d.float()), "delta is torch.float32"),
        (dict(lw=lw[:10]), "norm weight of shape"),
        (dict(w=w[:, :32]), "weight of shape"),
        (dict(b=b[:5]), "bias of shape"),
        (dict(act="tanh"), "activation 'tanh'"),
        (dict(w=_rand((47, 64), BF16, 3), b=None, act="gelu"), "47 Wi rows"),
        (dict(x=x.t().contiguous().t()), "unit column stride"),
        (dict(lw=_rand((128,), BF16, 4)[::2]), "norm weight needs unit stride"),
    ]
    for change, match in bad:
        args = dict(x=x, d=d, lw=lw, lb=lb, w=w, b=b, act=None) | change
        with pytest.raises(ValueError, match=match):
            norm_gemm.norm_linear(args["x"], args["d"], args["lw"], args["lb"], 1e-5, args["w"], args["b"],
                                  args["act"])


# ------------------------------------------------------------------------------------------------ routing


def test_op_routing_follows_the_switch(monkeypatch):
    from packed_encoders.ops import fused

    fused.reset_fallbacks()
    x, d, lw, lb, w, b = _inputs(5, 64, 64, BF16, seed=9)
    call = lambda act="gelu", **kw: fused.norm_linear(kw.get("x", x), d, lw, lb, 1e-5, w, b, act)  # noqa: E731
    monkeypatch.delenv(ENV, raising=False)
    assert fused.norm_linear.targets() == ()  # off by default (not measured on a GPU yet)
    for value, targets in (("glu", ("glu",)), ("ALL ", ("glu", "linear")), ("0", ()), ("", ()), ("off", ()),
                           ("False", ())):
        monkeypatch.setenv(ENV, value)
        assert fused.norm_linear.targets() == targets, value
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        fused.norm_linear.targets()
    s, y = call()
    torch.testing.assert_close(y, norm_gemm.norm_linear(x, d, lw, lb, 1e-5, w, b, "gelu")[1], atol=0, rtol=0)
    assert call(None) is not None
    big = _rand((norm_gemm.MAX_TOKENS + 1, 64), BF16, 10)
    assert fused.norm_linear(big, None, lw, lb, 1e-5, w, b, "gelu") is None  # larger batches: separate ops
    with torch.enable_grad():
        leaf = x.clone().requires_grad_(True)
        assert call(x=leaf) is None  # no backward: gradient mode keeps the separate ops
    with torch.autocast("cpu", dtype=BF16):
        assert call() is None  # autocast casts inside the separate ops: they keep the call
    assert fused.fallbacks() == {}
    assert fused.norm_linear(x, d.float(), lw, lb, 1e-5, w, b, "gelu") is None  # mixed dtypes: recorded
    assert "norm_linear" in fused.fallbacks()
    fused.reset_fallbacks()


def test_quack_validation_keeps_its_kernels(monkeypatch):
    """While quack is forced (pack's validation of its GEMMs) the fused op steps aside."""
    from packed_encoders.ops import fused, quack_gemm

    monkeypatch.setenv(ENV, "all")
    x, d, lw, lb, w, b = _inputs(5, 64, 64, BF16, seed=11)
    with quack_gemm.forced():
        assert fused.norm_linear(x, d, lw, lb, 1e-5, w, b, "gelu") is None
    assert fused.norm_linear(x, d, lw, lb, 1e-5, w, b, "gelu") is not None


@pytest.mark.parametrize("mode", ["glu", "all"])
def test_packed_forward_with_the_fusion_matches_without(mode, monkeypatch):
    """A tiny ModernBERT (HF modules, bf16) run by the packed forward with the Triton op set, fusion on vs off:
    the fused launches ran (counted) and the outputs agree to bf16 rounding; both within the rule of stock HF."""
    from transformers import ModernBertConfig, ModernBertModel

    from packed_encoders.batch import from_packed
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams
    from packed_encoders.ops import fused

    torch.manual_seed(0)
    config = ModernBertConfig(hidden_size=64, num_attention_heads=2, intermediate_size=96, num_hidden_layers=3,
                              local_attention=8, global_attn_every_n_layers=2, vocab_size=101, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, norm_bias=True,
                              mlp_bias=True, attention_bias=True)
    config._attn_implementation = "sdpa"
    model = ModernBertModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model = model.to(BF16)
    params = ModernBertParams.from_hf_config(config.to_dict())
    lengths = [3, 11, 1, 9]
    ids = torch.randint(3, 101, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    batch = from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=max(lengths),
                        position_ids=None, vocab_size=101)
    calls = []
    real = norm_gemm.norm_linear
    monkeypatch.setattr(norm_gemm, "norm_linear", lambda *a, **k: calls.append(a[-1]) or real(*a, **k))
    outs = {}
    with torch.no_grad():
        for setting in ("0", mode):
            monkeypatch.setenv(ENV, setting)
            outs[setting] = encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa")
    # layer 0's attn_norm is Identity: 3 mlp_norm fusions, and 2 attn_norm ones under "all"
    assert calls.count("gelu") == 3 and calls.count(None) == (2 if mode == "all" else 0)
    got, base = outs[mode].float(), outs["0"].float()
    cos = torch.nn.functional.cosine_similarity(got, base, dim=-1)
    assert cos.min().item() > 0.9999, cos.min().item()
    assert (got - base).abs().max().item() <= 0.05 * base.abs().max().item()
    assert fused.fallbacks().get("norm_linear") is None


def test_describe_reports_the_fused_pairs(monkeypatch):
    import packed_encoders as pe
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(hidden_size=64, num_attention_heads=2, intermediate_size=96, num_hidden_layers=2,
                              vocab_size=101, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                              sep_token_id=2)
    model = ModernBertModel(config).eval()
    pe.pack(model, kernels="triton", validate=False)
    monkeypatch.delenv(ENV, raising=False)
    assert pe.describe(model)["encoders"][0]["norm_gemm"] == []
    monkeypatch.setenv(ENV, "all")
    assert pe.describe(model)["encoders"][0]["norm_gemm"] == ["glu", "linear"]
    monkeypatch.setenv(ENV, "maybe")
    assert pe.describe(model)["encoders"][0]["norm_gemm"].startswith("error: PACKED_ENCODERS_NORM_GEMM='maybe'")
    pe.unpack(model)
    pe.pack(model, kernels="torch", validate=False)
    assert pe.describe(model)["encoders"][0]["norm_gemm"] == []  # plain torch ops have no fused pair
