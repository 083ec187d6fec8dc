"""``ops.triton.small_gemm`` (``linear``, ``glu_linear``) on CPU under the Triton interpreter.

``TRITON_INTERPRET=1`` is on for this module only (see ``tests/test_kernels_triton_interpret.py``). Rule for
every output: ``max|fast - ref| <= 2 * max|torch_same_dtype - ref| + eps`` with ``ref`` the float64 reference
(fp32 inputs would otherwise be judged against themselves) and ``eps = 32 * 2**-23 * max(1, max|ref|)``.
``torch_same_dtype`` is ``F.linear`` in the input dtype, followed for the GLU by ``act(a) * g`` in that dtype.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

from packed_encoders.ops.triton import small_gemm
from packed_encoders.ops.triton.small_gemm import CONFIGS, Config, default_config, glu_linear, linear

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
ACTS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def _rand(shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


def _inputs(m, k, n, dtype, bias, seed=0):
    x = _rand((m, k), dtype, seed)
    w = _rand((n, k), dtype, seed + 1, k ** -0.5)  # outputs of order 1
    b = _rand((n,), dtype, seed + 2) if bias else None
    return x, w, b


def assert_rule(fast, ref, same, what):
    assert fast.shape == ref.shape and fast.dtype == same.dtype, (what, fast.shape, ref.shape, fast.dtype)
    err = (fast.double() - ref).abs().max().item()
    base = (same.double() - ref).abs().max().item()
    eps = 32 * 2.0 ** -23 * max(1.0, ref.abs().max().item())
    assert err <= 2 * base + eps, f"{what}: error {err:.3g} > 2 * torch error {base:.3g} + {eps:.3g}"


def _f64(t):
    return None if t is None else t.double()


def check_linear(x, w, b, config=None, what=""):
    fast = linear(x, w, b, config)
    assert_rule(fast, F.linear(x.double(), w.double(), _f64(b)), F.linear(x, w, b), f"linear {what}")


def check_glu(x, w, b, activation="gelu", config=None, what=""):
    fast = glu_linear(x, w, b, activation, config)
    act = ACTS[activation]
    a, g = F.linear(x.double(), w.double(), _f64(b)).chunk(2, dim=-1)
    sa, sg = F.linear(x, w, b).chunk(2, dim=-1)
    assert_rule(fast, act(a) * g, act(sa) * sg, f"glu {activation} {what}")


@pytest.mark.parametrize("m", [1, 7, 33, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_linear(dtype, bias, m):
    x, w, b = _inputs(m, 64, 96, dtype, bias)
    check_linear(x, w, b, what=f"{dtype} m={m} bias={bias}")


@pytest.mark.parametrize("bias", [False, True])
def test_unchecked_launches_equal_the_checked_ones(bias):
    """The no-grad plan's entries (no argument checks, default config) launch the same kernels."""
    x, w, b = _inputs(33, 64, 96, BF16, bias, seed=5)
    assert torch.equal(small_gemm.linear_unchecked(x, w, b), small_gemm.linear(x, w, b))
    assert torch.equal(small_gemm.glu_linear_unchecked(x, w, b, "gelu"), small_gemm.glu_linear(x, w, b, "gelu"))


@pytest.mark.parametrize("m", [1, 7, 33, 130])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32])
def test_glu_linear(dtype, bias, m):
    x, w, b = _inputs(m, 64, 2 * 48, dtype, bias, seed=10)
    check_glu(x, w, b, what=f"{dtype} m={m} bias={bias}")


@pytest.mark.parametrize("activation", sorted(ACTS))
def test_glu_activations(activation):
    x, w, b = _inputs(33, 64, 2 * 48, BF16, True, seed=20)
    check_glu(x, w, b, activation)


@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_ragged_shape(dtype):
    """K, N and I multiples of no block size: masked K tail, wrapped M/N tiles."""
    x, w, b = _inputs(19, 72, 50, dtype, True, seed=30)
    cfg = Config(16, 32, 32, 4, 2)
    check_linear(x, w, b, cfg, "ragged")
    check_glu(x, w, b, "gelu_tanh", cfg, "ragged")  # I = 25


def test_weight_views_read_in_place():
    """Row slices (an offset base), column slices (row stride > K) and a column-major weight: strides are used."""
    x, w, b = _inputs(21, 64, 96, BF16, True, seed=40)
    big = _rand((140, 80), BF16, 41, 64 ** -0.5)
    rows = big[7:103, :64]
    assert not rows.is_contiguous()
    column_major = w.t().contiguous().t()
    bias_view = _rand((2 * 96,), BF16, 42)[::2]  # a strided bias
    for name, weight in (("rows", rows), ("column-major", column_major)):
        snapshot = weight.clone()
        check_linear(x, weight, b, what=name)
        check_glu(x, weight, bias_view, "silu", what=name)
        assert torch.equal(weight, snapshot)


def test_transposed_x():
    """An ``x`` with strides (1, M) is read through its strides."""
    x, w, b = _inputs(33, 64, 96, FP16, True, seed=50)
    xt = x.t().contiguous().t()
    assert xt.stride() == (1, 33)
    assert torch.equal(linear(xt, w, b), linear(x, w, b))
    assert torch.equal(glu_linear(xt, w, b, "gelu"), glu_linear(x, w, b, "gelu"))


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "x".join(map(str, c)))
def test_every_config(config):
    """Each swept config once: two K steps (one full, one masked for BLOCK_K 128), N wrapping its block."""
    x, w, b = _inputs(20, 160, 140, BF16, True, seed=60)
    check_linear(x, w, b, config)
    check_glu(x, w, b, "gelu", config)


def test_empty():
    w, b = _rand((96, 64), BF16, 70), _rand((96,), BF16, 71)
    assert linear(torch.empty((0, 64), dtype=BF16), w, b).shape == (0, 96)
    assert glu_linear(torch.empty((0, 64), dtype=BF16), w, b, "gelu").shape == (0, 48)
    x0 = torch.empty((5, 0), dtype=BF16)
    assert torch.equal(linear(x0, torch.empty((96, 0), dtype=BF16), b), F.linear(x0, torch.empty((96, 0), dtype=BF16), b))


def test_errors():
    x, w, b = _inputs(4, 64, 96, BF16, True)
    with pytest.raises(ValueError, match="x must be"):
        linear(x.to(torch.float64), w.double())
    with pytest.raises(ValueError, match="x must be 2-D"):
        linear(x[None], w)
    with pytest.raises(ValueError, match="weight must be"):
        linear(x, w[:, :32])
    with pytest.raises(ValueError, match="weight dtype"):
        linear(x, w.half())
    with pytest.raises(ValueError, match="bias must be"):
        linear(x, w, b[:10])
    with pytest.raises(ValueError, match="bias must be"):
        linear(x, w, b.half())
    with pytest.raises(ValueError, match="activation"):
        glu_linear(x, w, b, "tanh")
    with pytest.raises(ValueError, match="even number of rows"):
        glu_linear(x, w[:95], None, "gelu")
    with pytest.raises(ValueError, match="config.block_k"):
        linear(x, w, b, Config(16, 32, 24))
    with pytest.raises(ValueError, match="config.num_warps"):
        linear(x, w, b, Config(16, 32, 32, 3))


def test_default_config(monkeypatch):
    # the measured table: the entry of the smallest measured M >= M, the largest beyond them
    assert default_config(256, 2304, 768, glu=True) == small_gemm.TUNED[("glu", 2304, 768, 256)]
    assert default_config(300, 768, 1152) == small_gemm.TUNED[("linear", 768, 1152, 512)]
    assert default_config(10**6, 768, 768) == small_gemm.TUNED[("linear", 768, 768, 4096)]
    assert all(isinstance(c, Config) and c.check() is None for c in small_gemm.TUNED.values())
    # unmeasured: the widest 64-row tile giving >= TARGET_PROGRAMS programs, else the narrowest
    monkeypatch.setattr(small_gemm, "TUNED", {})
    cfg = default_config(256, 2304, 768)
    assert cfg.block_m == 64 and 4 * (2304 // cfg.block_n) >= small_gemm.TARGET_PROGRAMS
    assert default_config(4096, 2304, 768).block_n == 128
    assert default_config(4096, 2304, 768, glu=True) == Config(64, 128, 64, 8, 3)
    assert default_config(1, 96, 64) == default_config(1, 192, 64, glu=True) == Config(64, 32, 64, 4, 4)
    assert default_config(512, 2304, 768, glu=True) == Config(64, 64, 64, 4, 4)  # glu tiles I = N / 2


def test_compiles_for_sm90():
    """The compiled path (no GPU needed): the heuristic's configs at ModernBERT-base's Wqkv/Wi shape compile for
    sm_90 with Triton's ptxas, both ops, with unit K strides as a launch specialises them, and do not spill."""
    import os
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from packed_encoders.ops.triton._runtime import compile_options

    fn = JITFunction(small_gemm._gemm_kernel.fn, do_not_specialize=small_gemm._gemm_kernel.do_not_specialize)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    for glu, configs in ((False, small_gemm._HEURISTIC), (True, small_gemm._HEURISTIC_GLU)):
        for cfg in configs:
            cx = {"sx_k": 1, "sw_k": 1, "s_b": 1, "N": 1152 if glu else 2304, "K": 768, "GLU": glu, "ACT": 0,
                  "HAS_BIAS": True, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "DOT_F32": False}
            types = {"X": "*bf16", "W": "*bf16", "B": "*bf16", "Y": "*bf16", "M": "i32", "sx_m": "i32", "sw_n": "i32"}
            sig = {n: "constexpr" if n in cx else types[n] for n in fn.arg_names}
            # what a launch specialises: 16-byte aligned tensors, row strides divisible by 16
            aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                       if n in ("X", "W", "B", "Y", "sx_m", "sw_n")}
            k = triton.compile(ASTSource(fn, sig, constexprs=cx, attrs=aligned), target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                        **compile_options()})
            assert "wgmma" in k.asm["ptx"], (cfg, glu)
            if os.path.exists(tool):
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(k.asm["cubin"])
                    f.flush()
                    out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                         check=True).stdout
                assert re.search(r"STACK:0\b", out), (cfg, glu, out)


# ---------------------------------------------------------------------------------- op set and forward wiring


@pytest.fixture
def counted(monkeypatch):
    """Count launches of the GLU-fused GEMM behind the op set."""
    from packed_encoders.ops import fused

    calls = []
    for name in ("glu_linear", "glu_linear_unchecked"):  # the checked op's launch and the no-grad plan's
        real = getattr(small_gemm, name)
        monkeypatch.setattr(fused._small_gemm, name,
                            lambda *a, _real=real, **k: calls.append(a[0].shape) or _real(*a, **k))
    fused.reset_fallbacks()
    return fused, calls


def test_op_set_glu_linear_routes_by_size_grad_and_dtype(counted, monkeypatch):
    from packed_encoders.ops import geglu_torch

    fused, calls = counted
    x, w, b = _inputs(9, 64, 96, torch.bfloat16, True, seed=3)
    got = fused.glu_linear(x, w, b, "gelu")
    assert len(calls) == 1 and got.shape == (9, 48)
    ref32 = geglu_torch(F.linear(x.double(), w.double(), b.double()), "gelu")
    same = geglu_torch(F.linear(x, w, b), "gelu")
    assert_rule(got, ref32, same, "op set glu_linear")
    monkeypatch.setattr(fused, "GLU_LINEAR_MAX_TOKENS", 8)        # above the bound: cuBLAS + GLU
    assert torch.equal(fused.glu_linear(x, w, b, "gelu"), fused.glu(F.linear(x, w, b), "gelu"))
    monkeypatch.setattr(fused, "GLU_LINEAR_MAX_TOKENS", 256)
    xg = x.float().requires_grad_()
    out = fused.glu_linear(xg, w.float(), None, "gelu")           # gradient wanted: the differentiable ops
    assert out.requires_grad and len(calls) == 1
    fused.glu_linear(x.double(), w.double(), None, "gelu")         # a dtype the kernel lacks: visible fallback
    assert len(calls) == 1 and "glu_linear" in fused.fallbacks()
    fused.reset_fallbacks()


def test_forward_uses_glu_linear_without_grad_only(counted, monkeypatch):
    from packed_encoders.batch import from_packed
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    from .test_kernels_triton_interpret import _tiny_modernbert

    fused, calls = counted
    model, config = _tiny_modernbert()
    params = ModernBertParams.from_hf_config(config)
    lengths = [3, 11, 1, 20]
    ids = torch.randint(3, 101, (sum(lengths),), generator=torch.Generator().manual_seed(4))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    batch = from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=max(lengths),
                        position_ids=None, vocab_size=101)
    from packed_encoders.model.plan import Rules

    with torch.no_grad():
        got = encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa")
        assert len(calls) == len(model.layers)
        # the plan sizes the direct path's GEMMs (PACKED_ENCODERS_FUSED_GLU_GEMM=0 at pack(): every rule 0)
        ref = encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa",
                              rules=Rules(glu_gemm_max_tokens=0, small_linear_max_tokens=0, glu_eager_max_tokens=0))
    assert len(calls) == len(model.layers)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa").sum().backward()
    assert len(calls) == len(model.layers), "a forward with gradient never takes the fused GEMM"
    assert fused.fallbacks() == {}
