"""quack CuteDSL GEMMs (``ops.cute.gemm``) and their route (``ops.quack_gemm``) on an sm_90 GPU with quack.

Kernel outputs against fp32 references (every GLU activation, bf16 and fp16, ragged M, base and large
shapes); the packed ModernBERT-base forward with the route forced on everywhere against stock HF and against
the route switched off; a CUDA-graph capture that bakes quack kernels in.

Run: ``python -m pytest -q tests/gpu/test_quack_gemm.py`` (skipped without CUDA / sm_90 / quack).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from packed_encoders.ops import quack_gemm  # noqa: E402
from packed_encoders.ops.geglu import geglu_ref  # noqa: E402
from packed_encoders.tuning import QUACK_ROPE_ENV  # noqa: E402

DEV = torch.device("cuda")
WHY = quack_gemm.unavailable(DEV)
if WHY:
    pytest.skip(WHY, allow_module_level=True)

from packed_encoders.ops.cute import gemm as qg  # noqa: E402

from tests.helpers import make_model  # noqa: E402

from .test_model_parity import _batch  # noqa: E402  (rows padded right and left alternately)


def _rel(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "silu", "relu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m, k, inter", [(1, 768, 1152), (333, 768, 1152), (5000, 768, 1152), (1500, 1024, 2624)])
def test_glu_linear_matches_fp32(activation, dtype, m, k, inter):
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(2 * inter, k, generator=g, device=DEV) * k ** -0.5).to(dtype)
    out = qg.glu_linear(x, w, activation)
    assert out.shape == (m, inter) and out.dtype == dtype and out.is_contiguous()
    ref = geglu_ref(F.linear(x.float(), w.float()), activation)
    assert _rel(out, ref) < 1e-2


def test_glu_linear_uses_the_exact_erf_gelu():
    # values where erf and tanh GELU differ by ~1e-3 relative: the erf epilogue must track the erf reference
    x = torch.linspace(-4, 4, 64 * 64, device=DEV).reshape(64, 64).to(torch.bfloat16)
    w = torch.zeros(64, 64, device=DEV, dtype=torch.bfloat16)
    w[:32, :32] = torch.eye(32, device=DEV)
    w[32:, :32] = torch.eye(32, device=DEV)  # a = g = x[:, :32]
    out = qg.glu_linear(x, w, "gelu").float()
    a = x[:, :32].float()
    erf, tanh = F.gelu(a) * a, F.gelu(a, approximate="tanh") * a
    assert (out - erf).abs().max() < (out - tanh).abs().max()


@pytest.mark.parametrize("m, n, k", [(7, 2304, 768), (4100, 768, 768), (2000, 768, 1152), (999, 3072, 1024)])
def test_linear_matches_fp32(m, n, k):
    g = torch.Generator(device=DEV).manual_seed(n + m)
    x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g, device=DEV) * k ** -0.5).to(torch.bfloat16)
    out = qg.linear(x, w)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _rel(out, F.linear(x.float(), w.float())) < 1e-2


def test_empty_inputs():
    w = torch.randn(256, 64, device=DEV, dtype=torch.bfloat16)
    x = torch.empty(0, 64, device=DEV, dtype=torch.bfloat16)
    assert qg.glu_linear(x, w, "gelu").shape == (0, 128)
    assert qg.linear(x, w).shape == (0, 256)


@pytest.mark.parametrize("theta", [10000.0, 160000.0])
@pytest.mark.parametrize("m, heads, k", [(1, 24, 768), (333, 24, 768), (5000, 24, 768), (20000, 24, 768),
                                         (1500, 32, 1024), (700, 4, 256)])
def test_rope_linear_matches_fp32(theta, m, heads, k):
    from packed_encoders.ops.rope import pair_freq_table, rope_linear_ref

    g = torch.Generator(device=DEV).manual_seed(m + heads)
    x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(heads * 64, k, device=DEV, generator=g) * k ** -0.5).to(torch.bfloat16)
    positions = torch.randint(0, 8192, (m,), device=DEV, generator=g).float()
    inv = 1.0 / (theta ** (torch.arange(0, 64, 2, device=DEV).float() / 64))
    out = qg.rope_linear(x, w, positions, pair_freq_table(inv, heads), 64)
    ref = rope_linear_ref(x.float(), w.float(), positions, inv, 64)
    assert out.shape == (m, heads * 64) and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2


def test_rope_linear_leaves_the_glu_gemm_alone():
    """The pair layout is active only inside rope_linear: the GLU GEMM (same concat key) still pairs halves."""
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(300, 768, device=DEV, generator=g).to(torch.bfloat16)
    w = (torch.randn(2304, 768, device=DEV, generator=g) * 0.03).to(torch.bfloat16)
    assert _rel(qg.glu_linear(x, w, "gelu"), geglu_ref(F.linear(x.float(), w.float()), "gelu")) < 2e-2


@pytest.fixture(scope="module")
def base():
    return make_model("base", dtype=torch.bfloat16, device=DEV, num_hidden_layers=6)


def _counting(monkeypatch):
    calls = {"linear": 0, "glu_linear": 0, "rope_linear": 0}
    real = qg

    class Counting:
        @staticmethod
        def linear(x, w):
            calls["linear"] += 1
            return real.linear(x, w)

        @staticmethod
        def glu_linear(x, w, act):
            calls["glu_linear"] += 1
            return real.glu_linear(x, w, act)

        @staticmethod
        def rope_linear(x, w, positions, freq, head_dim):
            calls["rope_linear"] += 1
            return real.rope_linear(x, w, positions, freq, head_dim)

    monkeypatch.setattr(quack_gemm, "_kernels", lambda: Counting)
    return calls


def test_packed_forward_with_quack_everywhere_matches_stock(base, monkeypatch):
    import packed_encoders as pe

    ids, mask = _batch([900, 40, 1500, 700])
    pe.unpack(base)
    with torch.no_grad():
        ref = base(input_ids=ids, attention_mask=mask,
                   position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state.float()
    pe.pack(base, cuda_graph=False)
    assert pe.describe(base)["encoders"][0]["gemm"] == "quack"
    calls = _counting(monkeypatch)
    try:
        with torch.no_grad(), quack_gemm.forced():
            out = base(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        layers = base.config.num_hidden_layers
        # v through linear, q / k through the RoPE epilogue
        assert calls == {"linear": 3 * layers, "glu_linear": layers, "rope_linear": layers}
        monkeypatch.setenv(QUACK_ROPE_ENV, "0")
        with torch.no_grad(), quack_gemm.forced():  # read at pack(): no effect until re-packed
            base(input_ids=ids, attention_mask=mask)
        assert calls == {"linear": 6 * layers, "glu_linear": 2 * layers, "rope_linear": 2 * layers}
        pe.pack(base, cuda_graph=False, validate=False)
        assert pe.describe(base)["encoders"][0]["tuning"]["quack_rope"] is False
        with torch.no_grad(), quack_gemm.forced():
            no_rope = base(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        assert calls == {"linear": 9 * layers, "glu_linear": 3 * layers, "rope_linear": 2 * layers}
        monkeypatch.setenv(quack_gemm.ENV, "0")
        pe.pack(base, cuda_graph=False, validate=False)
        assert pe.describe(base)["encoders"][0]["gemm"] == "torch"
        with torch.no_grad():
            off = base(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        assert calls == {"linear": 9 * layers, "glu_linear": 3 * layers, "rope_linear": 2 * layers}  # switched off
    finally:
        pe.unpack(base)
    real = mask.bool()
    cos = F.cosine_similarity(out[real], ref[real], dim=-1)
    cos_off = F.cosine_similarity(off[real], ref[real], dim=-1)
    cos_no_rope = F.cosine_similarity(no_rope[real], ref[real], dim=-1)
    assert cos.min() > 0.995 and cos.mean() > 0.999
    assert abs(cos.mean().item() - cos_no_rope.mean().item()) < 1e-3  # the RoPE epilogue no worse
    assert abs(cos.mean().item() - cos_off.mean().item()) < 1e-3  # quack no worse than cuBLAS on average


def test_graph_capture_bakes_quack_kernels(base, monkeypatch):
    import packed_encoders as pe

    ids, mask = _batch([1000, 1200, 800, 1100])  # 4,100 tokens: GLU and base projections take quack in graphs
    pe.pack(base, cuda_graph=True)
    calls = _counting(monkeypatch)
    try:
        with torch.no_grad():
            first = base(input_ids=ids, attention_mask=mask).last_hidden_state.clone()
            captured = dict(calls)
            second = base(input_ids=ids, attention_mask=mask).last_hidden_state
            replayed = dict(calls)
            with pe.no_cuda_graph(base):
                eager = base(input_ids=ids, attention_mask=mask).last_hidden_state
        graphs = pe.describe(base)["encoders"][0]["cuda_graph"]
    finally:
        pe.unpack(base)
    assert graphs["graphs"] >= 1 and graphs["hits"] >= 1
    assert captured["glu_linear"] >= base.config.num_hidden_layers  # warm-up + capture called quack
    assert captured["linear"] >= 3 * base.config.num_hidden_layers  # 4,100 tokens >= the in-graph rule
    assert captured["rope_linear"] >= base.config.num_hidden_layers
    assert replayed == captured  # the replay runs the baked kernels: no Python call
    torch.testing.assert_close(first, second, atol=0, rtol=0)
    real = mask.bool()
    cos = F.cosine_similarity(second[real].float(), eager[real].float(), dim=-1)
    assert cos.min() > 0.999
