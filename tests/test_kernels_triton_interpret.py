"""The Triton kernels on CPU under the Triton interpreter: numerics, gradients, custom-op plumbing, routing.

Interpretation is chosen per launch (``packed_encoders/ops/triton/_runtime.py``) whatever mode Triton was
imported in, so this module turns ``TRITON_INTERPRET=1`` on for its own tests only, and compiled kernels
in the same process (GPU tests, the sm_90 compile test) are unaffected; a test checks that an interpreted
launch leaves Triton's modules exactly as it found them.
Rule for every kernel output: ``max|fast - ref32| <= 2 * max|torch_same_dtype - ref32| + eps`` with
``eps = 32 * 2**-23 * max(1, max|ref32|)`` (fp32-level noise: erf/exp implementations, reduction order).
"""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("triton_interpret")

from packed_encoders.errors import PackedEncodersError  # noqa: E402
from packed_encoders.ops import TORCH_OPS, geglu_ref, geglu_torch, layer_norm_ref, layer_norm_torch  # noqa: E402
from packed_encoders.ops import residual_layer_norm_ref, residual_layer_norm_torch, rope_qkv_ref  # noqa: E402
from packed_encoders.ops import rope_qkv_torch, rope_tables  # noqa: E402
from packed_encoders.ops.select import select_ops  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [FP32, BF16, FP16]


@pytest.fixture(scope="module")
def fused():
    from packed_encoders.ops import fused

    return fused


@pytest.fixture(autouse=True)
def _clean_fallbacks(fused):
    fused.reset_fallbacks()
    yield
    # every kernel test must have run the kernels, not quietly the torch op
    assert fused.fallbacks() == {}, fused.fallbacks()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(shape, dtype, seed, scale=1.0):
    return (torch.randn(shape, generator=_gen(seed)) * scale).to(dtype)


def assert_rule(fast, ref, same, what):
    """``fast`` and ``same`` (plain torch, same dtype) against the fp32 ``ref``; empty tensors pass."""
    assert fast.shape == ref.shape, (what, fast.shape, ref.shape)
    if ref.numel() == 0:
        return
    ref = ref.float()
    err = (fast.float() - ref).abs().max().item()
    base = (same.float() - ref).abs().max().item()
    eps = 32 * 2.0 ** -23 * max(1.0, ref.abs().max().item())
    assert err <= 2 * base + eps, f"{what}: error {err:.3g} > 2 * torch error {base:.3g} + {eps:.3g}"


def _leaf(t, dtype=None):
    return t.detach().clone().to(dtype or t.dtype).requires_grad_(True)


def _grads(outputs, grads, inputs):
    got = torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)
    return [g if g is not None else torch.zeros_like(i) for g, i in zip(got, inputs)]


# ------------------------------------------------------------------------------------------------ LayerNorm

LN_CASES = [(0, 37), (1, 96), (7, 37), (33, 96), (5, 300)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", LN_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_layer_norm(fused, dtype, t, h, bias):
    x = _rand((t, h), dtype, 1, 2.0) + 0.5
    w = _rand((h,), FP32, 2) * 0.2 + 1
    b = _rand((h,), FP32, 3) * 0.1 if bias else None
    dy = _rand((t, h), dtype, 4)
    ins = [_leaf(x), _leaf(w)] + ([_leaf(b)] if bias else [])
    y = fused.layer_norm(ins[0], ins[1], ins[2] if bias else None, 1e-5)
    assert y.dtype == dtype
    g_fast = _grads([y], [dy], ins)
    # second backward over the retained graph must give the same result (saved tensors untouched)
    g_again = _grads([y], [dy], ins)
    for a, c in zip(g_fast, g_again):
        assert torch.equal(a, c)

    ref_in = [_leaf(x, FP32)] + [_leaf(p) for p in ins[1:]]
    y_ref = layer_norm_ref(ref_in[0], ref_in[1], ref_in[2] if bias else None, 1e-5)
    g_ref = _grads([y_ref], [dy.float()], ref_in)
    same_in = [_leaf(x)] + [_leaf(p) for p in ins[1:]]
    y_same = layer_norm_torch(same_in[0], same_in[1], same_in[2] if bias else None, 1e-5)
    g_same = _grads([y_same], [dy], same_in)

    assert_rule(y, y_ref, y_same, "y")
    for name, a, r, s in zip(("dx", "dw", "db"), g_fast, g_ref, g_same):
        assert_rule(a, r, s, name)


@pytest.mark.parametrize("dtypes", [(FP32, FP32), (BF16, BF16), (FP16, FP16), (FP32, BF16)])
@pytest.mark.parametrize("t,h", [(0, 96), (1, 37), (7, 96), (33, 37)])
def test_residual_layer_norm(fused, dtypes, t, h):
    xd, dd = dtypes  # (FP32, BF16): the fp32 residual stream plus a bf16 sub-block output, as under autocast
    x = _rand((t, h), xd, 5, 2.0)
    d = _rand((t, h), dd, 6)
    w = _rand((h,), FP32, 7) * 0.2 + 1
    b = _rand((h,), FP32, 8) * 0.1
    sd = torch.promote_types(xd, dd)
    gs, gy = _rand((t, h), sd, 9), _rand((t, h), sd, 10)

    ins = [_leaf(x), _leaf(d), _leaf(w), _leaf(b)]
    s, y = fused.residual_layer_norm(*ins, 1e-5)
    assert s.dtype == sd and y.dtype == sd
    g_fast = _grads([s, y], [gs, gy], ins)
    g_again = _grads([s, y], [gs, gy], ins)
    for a, c in zip(g_fast, g_again):
        assert torch.equal(a, c)
    assert [g.dtype for g in g_fast] == [xd, dd, FP32, FP32]

    ref_in = [_leaf(x, FP32), _leaf(d, FP32), _leaf(w), _leaf(b)]
    s_ref, y_ref = residual_layer_norm_ref(*ref_in, 1e-5)
    g_ref = _grads([s_ref, y_ref], [gs.float(), gy.float()], ref_in)
    same_in = [_leaf(p) for p in ins]
    s_same, y_same = residual_layer_norm_torch(*same_in, 1e-5)
    g_same = _grads([s_same, y_same], [gs, gy], same_in)

    # the residual sum follows the policy exactly: fp32 add, one rounding to the stream dtype
    assert torch.equal(s, s_same)
    assert_rule(y, y_ref, y_same, "y")
    for name, a, r, q in zip(("dx", "ddelta", "dw", "db"), g_fast, g_ref, g_same):
        assert_rule(a, r, q, name)


# ------------------------------------------------------------------------------------------------ RoPE

ROPE_CASES = [(0, 2, 32), (1, 3, 32), (7, 2, 96), (33, 1, 256), (7, 12, 64), (5, 1, 48)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,nh,hd", ROPE_CASES)
def test_rope_qkv(fused, dtype, t, nh, hd):
    cos, sin = rope_tables(160000.0, hd, 64, "cpu")
    qkv = _rand((t, 3 * nh * hd), dtype, 11)
    pos = torch.randint(0, 64, (t,), generator=_gen(12))
    grads = [_rand((t, nh, hd), dtype, 13 + i) for i in range(3)]

    leaf = _leaf(qkv)
    q, k, v = fused.rope_qkv(leaf, cos, sin, pos, nh, hd)
    assert q.is_contiguous() and k.is_contiguous() and q.dtype == dtype
    assert v._base is leaf and v.stride() == (3 * nh * hd, hd, 1) and v.shape == (t, nh, hd)  # a view, no copy
    (g_fast,) = _grads([q, k, v], grads, [leaf])
    (g_again,) = _grads([q, k, v], grads, [leaf])
    assert torch.equal(g_fast, g_again)

    ref_leaf = _leaf(qkv, FP32)
    q_r, k_r, v_r = rope_qkv_ref(ref_leaf, cos, sin, pos, nh, hd)
    (g_ref,) = _grads([q_r, k_r, v_r], [g.float() for g in grads], [ref_leaf])
    same_leaf = _leaf(qkv)
    q_s, k_s, v_s = rope_qkv_torch(same_leaf, cos, sin, pos, nh, hd)
    (g_same,) = _grads([q_s, k_s, v_s], grads, [same_leaf])

    assert_rule(q, q_r, q_s, "q")
    assert_rule(k, k_r, k_s, "k")
    assert torch.equal(v, v_s)
    assert_rule(g_fast, g_ref, g_same, "dqkv")


@pytest.mark.parametrize("t,nh,hd", [(1, 3, 32), (7, 2, 96), (33, 12, 64)])
def test_rope_in_place(fused, t, nh, hd):
    """``inplace``: q, k rotated inside qkv (views of it, row stride 3 * nh * hd), equal to the out-of-place
    rotation; v's third untouched where finite, its NaN and +-inf entries zeroed."""
    from packed_encoders.ops.triton import rope as R

    cos, sin = rope_tables(10000.0, hd, 64, "cpu")
    qkv = _rand((t, 3 * nh * hd), torch.bfloat16, 30)
    pos = torch.randint(0, 64, (t,), generator=_gen(31))
    q_new, k_new = R.forward(qkv, cos, sin, pos, nh, hd)
    buf = qkv.clone()
    q, k = R.forward(buf, cos, sin, pos, nh, hd, inplace=True)
    for got, new, part in ((q, q_new, 0), (k, k_new, 1)):
        assert got.data_ptr() == buf.data_ptr() + part * nh * hd * buf.element_size()
        assert got.stride() == (3 * nh * hd, hd, 1) and got.shape == (t, nh, hd)
        assert torch.equal(got, new)
    assert torch.equal(buf[:, 2 * nh * hd:], qkv[:, 2 * nh * hd:])
    bad = qkv.clone()
    v = bad[:, 2 * nh * hd:]
    v[0, 0], v[t - 1, -1], v[t // 2, hd // 2] = float("nan"), float("inf"), -float("inf")
    want_v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    q_bad, k_bad = R.forward(bad, cos, sin, pos, nh, hd, inplace=True)
    assert torch.equal(v, want_v) and torch.equal(q_bad, q_new) and torch.equal(k_bad, k_new)
    src = qkv.clone()
    src[0, 2 * nh * hd] = float("nan")
    R.forward(src, cos, sin, pos, nh, hd)  # out of place: qkv is the caller's, never written
    assert torch.isnan(src[0, 2 * nh * hd])
    with pytest.raises(ValueError, match="contiguous"):
        R.forward(torch.cat([qkv, qkv], 1)[:, ::2], cos, sin, pos, nh, hd, inplace=True)


def test_rope_backward_strided_and_missing_dv(fused):
    """dq/dk/dv with arbitrary (non-contiguous) strides, and no dv at all, through the backward op."""
    from packed_encoders.ops.fused import _rope_bwd

    t, nh, hd = 7, 3, 32
    cos, sin = rope_tables(10000.0, hd, 16, "cpu")
    pos = torch.arange(t)
    dq = _rand((nh, t, hd), FP32, 20).transpose(0, 1)
    dk = _rand((t, hd, nh), FP32, 21).transpose(1, 2).contiguous()
    dv = _rand((t, 2 * nh, hd), FP32, 22)[:, ::2]
    got = _rope_bwd(dq, dk, dv, cos, sin, pos, nh, hd, FP32)
    leaf = torch.zeros(t, 3 * nh * hd, requires_grad=True)
    q, k, v = rope_qkv_ref(leaf, cos, sin, pos, nh, hd)
    (want,) = torch.autograd.grad([q, k, v], [leaf], [dq, dk, dv])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    got = _rope_bwd(dq, dk, None, cos, sin, pos, nh, hd, FP32)
    assert got[:, 2 * nh * hd:].abs().max() == 0
    torch.testing.assert_close(got[:, : 2 * nh * hd], want[:, : 2 * nh * hd], atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------ GLU

# every activation x dtype on small shapes; the wide case (I = 1100: two column blocks, a masked tail)
# once per GELU form in bf16 to keep CPU time low
GLU_CASES = [(t, inner, act, dt) for t, inner in [(0, 5), (1, 37), (7, 96)]
             for act in ("gelu", "gelu_tanh", "silu", "relu") for dt in DTYPES]
GLU_CASES += [(33, 1100, "gelu", BF16), (33, 1100, "gelu_tanh", BF16), (33, 1100, "gelu", FP16)]


@pytest.mark.parametrize("t,inner,activation,dtype", GLU_CASES)
def test_glu(fused, t, inner, activation, dtype):
    x = _rand((t, 2 * inner), dtype, 30, 2.0)
    dy = _rand((t, inner), dtype, 31)
    leaf = _leaf(x)
    y = fused.glu(leaf, activation)
    assert y.dtype == dtype and y.shape == (t, inner)
    (g_fast,) = _grads([y], [dy], [leaf])
    (g_again,) = _grads([y], [dy], [leaf])
    assert torch.equal(g_fast, g_again)

    ref_leaf = _leaf(x, FP32)
    y_r = geglu_ref(ref_leaf, activation)
    (g_ref,) = _grads([y_r], [dy.float()], [ref_leaf])
    same_leaf = _leaf(x)
    y_s = geglu_torch(same_leaf, activation)
    (g_same,) = _grads([y_s], [dy], [same_leaf])
    assert_rule(y, y_r, y_s, "y")
    assert_rule(g_fast, g_ref, g_same, "dx")

    # the backward that also recomputes the forward's output: the same dx, and y bit for bit
    from packed_encoders.ops.triton import glu as G

    dx, y_again = G.backward(dy, x, activation, forward_out=True)
    assert torch.equal(dx, G.backward(dy, x, activation))
    assert torch.equal(y_again, G.forward(x, activation))


# ------------------------------------------------------------------------------------------------ plumbing


def _op_args():
    cos, sin = rope_tables(10000.0, 32, 16, "cpu")
    x, d, w = torch.randn(5, 40), torch.randn(5, 40), torch.randn(40)
    qkv = torch.randn(5, 3 * 2 * 32)
    pos = torch.arange(5)
    ops = torch.ops.packed_encoders
    return [
        (ops.triton_layer_norm_fwd.default, (x, w, None, 1e-5, FP32)),
        (ops.triton_residual_layer_norm_fwd.default, (x, d.to(BF16), w, torch.randn(40), 1e-5, FP32, FP32)),
        (ops.triton_layer_norm_bwd.default, (torch.randn(5, 40), x, w, x.mean(1), torch.rand(5) + 1, d, True,
                                             FP32, BF16, True)),
        (ops.triton_rope_qk_fwd.default, (qkv, cos, sin, pos, 2, 32)),
        (ops.triton_rope_qkv_bwd.default, (torch.randn(5, 2, 32), torch.randn(5, 2, 32), None, cos, sin, pos, 2, 32,
                                           BF16)),
        (ops.triton_glu_fwd.default, (torch.randn(5, 24), "gelu")),
        (ops.triton_glu_bwd.default, (torch.randn(5, 12), torch.randn(5, 24), "gelu_tanh")),
    ]


def test_fake_tensor_outputs_match_real(fused):
    """Each op's fake implementation gives the shapes and dtypes the real kernel returns."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    for op, args in _op_args():
        real = op(*args)
        mode = FakeTensorMode()
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        with mode:
            fake = op(*fake_args)
        real = real if isinstance(real, tuple) else (real,)
        fake = fake if isinstance(fake, tuple) else (fake,)
        assert [(r.shape, r.dtype) for r in real] == [(f.shape, f.dtype) for f in fake], op


@pytest.mark.parametrize("index", range(7))
def test_opcheck(fused, index):
    op, args = _op_args()[index]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_compile_sees_opaque_ops_without_recompiling(fused):
    """torch.compile(fullgraph) traces the op set without graph breaks, forward and backward, and a new
    token count reuses the graph (dynamic shapes)."""
    import torch._dynamo

    cos, sin = rope_tables(10000.0, 16, 64, "cpu")
    w = torch.randn(32)

    def block(x, delta):
        s, h = fused.residual_layer_norm(x, delta, w, None, 1e-5)
        q, k, v = fused.rope_qkv(torch.cat([h, h, h[:, :32]], 1)[:, :96], cos, sin,
                                 torch.arange(x.shape[0]) % 64, 2, 16)
        g = fused.glu(torch.cat([q.flatten(1), k.flatten(1)], 1), "gelu")
        return fused.layer_norm(s + g + v.flatten(1), w, None, 1e-5)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=True)
    for t in (9, 13):
        x = torch.randn(t, 32, requires_grad=True)
        d = torch.randn(t, 32, requires_grad=True)
        out = compiled(x, d)
        out.square().sum().backward()
        x2, d2 = _leaf(x), _leaf(d)
        ref = block(x2, d2)
        ref.square().sum().backward()
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(x.grad, x2.grad)
        torch.testing.assert_close(d.grad, d2.grad)
        if t == 9:
            torch._dynamo.config.error_on_recompile = True
    torch._dynamo.config.error_on_recompile = False


def _tiny_modernbert(hidden=64, heads=2, inner=96, layers=3, vocab=101):
    """The module tree the packed forward reads (HF ModernBertModel's attribute names), without importing
    transformers: embeddings, layers (layer 0's attn_norm is Identity), final_norm."""
    nn = torch.nn

    def ln():
        m = nn.LayerNorm(hidden, eps=1e-5, bias=True)
        with torch.no_grad():
            m.weight.add_(0.2 * torch.randn(hidden))
            m.bias.add_(0.1 * torch.randn(hidden))
        return m

    def layer(i):
        return nn.ModuleDict(dict(
            attn_norm=nn.Identity() if i == 0 else ln(),
            attn=nn.ModuleDict(dict(Wqkv=nn.Linear(hidden, 3 * hidden, bias=False), Wo=nn.Linear(hidden, hidden),
                                    out_drop=nn.Identity())),
            mlp_norm=ln(),
            mlp=nn.ModuleDict(dict(Wi=nn.Linear(hidden, 2 * inner), Wo=nn.Linear(inner, hidden, bias=False),
                                   drop=nn.Dropout(0.0)))))

    torch.manual_seed(0)
    model = nn.Module()
    model.embeddings = nn.Module()
    model.embeddings.tok_embeddings = nn.Embedding(vocab, hidden)
    model.embeddings.norm = ln()
    model.embeddings.drop = nn.Dropout(0.0)
    model.layers = nn.ModuleList([layer(i) for i in range(layers)])
    model.final_norm = ln()
    config = dict(model_type="modernbert", hidden_size=hidden, num_attention_heads=heads, intermediate_size=inner,
                  num_hidden_layers=layers, vocab_size=vocab, norm_eps=1e-5, norm_bias=True, local_attention=8,
                  global_attn_every_n_layers=2, hidden_activation="gelu", global_rope_theta=160000.0,
                  local_rope_theta=10000.0)
    return model.eval(), config


def _tiny_packed_batch(lengths, seed, vocab=101):
    """A packed batch of random ids (``3 .. vocab - 1``) for :func:`_tiny_modernbert`, sequences of ``lengths``."""
    from packed_encoders.batch import from_packed

    ids = torch.randint(3, vocab, (sum(lengths),), generator=_gen(seed))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=max(lengths),
                       position_ids=None, vocab_size=vocab)


def test_packed_forward_matches_torch_ops(fused):
    """A tiny random ModernBERT-shaped model, packed forward with the Triton op set vs the plain-torch op set
    (fp32): outputs and every parameter gradient."""
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    model, config = _tiny_modernbert()
    params = ModernBertParams.from_hf_config(config)
    batch = _tiny_packed_batch([3, 11, 1, 20], seed=40)
    results = []
    for ops in (TORCH_OPS, fused.TRITON_OPS):
        model.zero_grad()
        out = encoder_forward(model, params, batch, ops=ops, attention_backend="sdpa")
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (ref, ref_g), (got, got_g) = results
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], atol=2e-5, rtol=1e-4, msg=name)


def test_second_derivatives_name_the_way_out(fused):
    """Differentiating twice through the Triton path (the layers' stack node, and the embedding / final norms'
    custom ops, whose backward ops are recorded under ``create_graph=True``) raises the library's message naming
    ``pe.unpack``, not torch's "no autograd formula"."""
    from packed_encoders.errors import SECOND_DERIVATIVE
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    model, config = _tiny_modernbert()
    params = ModernBertParams.from_hf_config(config)
    batch = _tiny_packed_batch([4, 7], seed=42)
    out = encoder_forward(model, params, batch, ops=fused.TRITON_OPS, attention_backend="sdpa")
    for p in (model.final_norm.weight, model.layers[0].attn.Wqkv.weight):
        (g,) = torch.autograd.grad(out.square().mean(), p, create_graph=True, retain_graph=True)
        with pytest.raises(RuntimeError, match="second derivatives through the packed encoder"):
            g.square().sum().backward(retain_graph=True)
    assert "pe.unpack(model)" in SECOND_DERIVATIVE


# ------------------------------------------------------------------------------------------------ routing


def test_routes_to_torch_visibly(fused, monkeypatch):
    x = torch.randn(4, 8, dtype=torch.float64)
    torch.testing.assert_close(fused.layer_norm(x, None, None, 1e-5), layer_norm_torch(x, None, None, 1e-5))
    y = torch.randn(3, 8)
    torch.testing.assert_close(fused.glu(y, "gelu"), geglu_torch(y, "gelu"))  # interpreted: runs fused
    with pytest.raises(ValueError):
        fused.glu(y, "swiglu_unknown")  # routed to the torch op, which names the bad activation
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fused.glu(y, "gelu")  # CPU tensors outside interpret mode: torch
    report = fused.TRITON_OPS.fallbacks()
    assert set(report) == {"layer_norm", "glu"}
    assert any("float64" in r for r in report["layer_norm"])
    assert any("unknown" in r for r in report["glu"])
    assert any("CPU tensors" in r for r in report["glu"])
    fused.reset_fallbacks()


def test_select_ops(fused, monkeypatch):
    ops, why = select_ops("triton", torch.device("cpu"))
    assert ops is fused.TRITON_OPS and "interpret" in why
    assert select_ops("auto", torch.device("cpu"))[0] is TORCH_OPS
    assert select_ops("torch", torch.device("cpu"))[0] is TORCH_OPS
    with pytest.raises(PackedEncodersError, match="cute"):
        select_ops("cute", torch.device("cpu"))
    with pytest.raises(PackedEncodersError, match="not one of"):
        select_ops("fast", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(PackedEncodersError, match="CUDA"):
        select_ops("triton", torch.device("cpu"))
    # a machine whose Triton does not import: an explicit request names why, auto would use torch
    monkeypatch.setitem(sys.modules, "packed_encoders.ops.fused", None)
    with pytest.raises(PackedEncodersError, match="not importable"):
        select_ops("triton", torch.device("cuda"))


def _triton_state():
    import triton.language as tl
    import triton.runtime.interpreter as interp

    owners = [tl, tl.core, tl.standard, tl.math, tl.tensor, tl.core.tensor, tl.dtype, interp,
              interp.InterpreterBuilder]
    return {(repr(o), name): id(value) for o in owners for name, value in list(vars(o).items())}


def test_interpreted_launch_leaves_triton_untouched(fused):
    """After interpreted launches (with standard-library reductions inside) Triton's language modules,
    tensor class and interpreter are exactly as before, so compiled kernels in the process still work."""
    before = _triton_state()
    x = torch.randn(9, 40)
    fused.residual_layer_norm(x, x, torch.ones(40), None, 1e-5)
    fused.glu(torch.randn(3, 8), "gelu_tanh")
    assert _triton_state() == before


def test_smoke_runs_interpreted(fused, monkeypatch):
    fused.smoke("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="cannot run"):
        fused.smoke("cpu")


@pytest.mark.parametrize("residual", [False, True])
def test_direct_norm_writes_into_out(fused, residual):
    """The unchecked LayerNorm launches write the normed output into ``out`` when it fits (a graph's shared static
    output) and allocate their own when its dtype or shape does not (``out`` untouched)."""
    g = _gen(5)
    x, d = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g)
    w, b = torch.randn(96, generator=g), torch.randn(96, generator=g)

    def run(out=None):
        if residual:
            return fused.DIRECT_OPS.residual_layer_norm(x, d, w, b, 1e-5, out=out)[1]
        return fused.DIRECT_OPS.layer_norm(x, w, b, 1e-5, out=out)

    want = run()
    buf = torch.full((64, 96), float("nan"))
    got = run(out=buf[:37])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
    assert fused.DIRECT_OPS.norm_out
    for wrong in (torch.zeros(37, 96, dtype=torch.float64), torch.zeros(36, 96)):
        got = run(out=wrong)
        assert got.data_ptr() != wrong.data_ptr() and torch.equal(got, want) and not wrong.any()


def test_residual_norm_in_place_writes_the_sum_over_x(fused):
    """The forward's residual norm writes ``x + delta`` over ``x`` (which the forward owns), with the outputs of the
    allocating launch; a non-contiguous ``x`` or a wider ``delta`` gets the allocating launch instead."""
    g = _gen(6)
    x, d = torch.randn(37, 96, generator=g), torch.randn(37, 96, generator=g)
    w, b = torch.randn(96, generator=g), torch.randn(96, generator=g)
    s_want, y_want = fused.DIRECT_OPS.residual_layer_norm(x, d, w, b, 1e-5)
    own = x.clone()
    s, y = fused.DIRECT_OPS.residual_in_place(own, d, w, b, 1e-5)
    assert s.data_ptr() == own.data_ptr() and torch.equal(own, s_want) and torch.equal(y, y_want)
    strided = torch.randn(96, 37, generator=g).t()
    before = strided.clone()
    s, _ = fused.DIRECT_OPS.residual_in_place(strided, d, w, b, 1e-5)
    assert s.data_ptr() != strided.data_ptr() and torch.equal(strided, before)
    half = x.to(torch.bfloat16)
    s, _ = fused.DIRECT_OPS.residual_in_place(half, d, w, b, 1e-5)  # the sum is fp32: not in the bf16 x
    assert s.dtype == torch.float32 and s.data_ptr() != half.data_ptr()


@pytest.mark.parametrize("out_dtype", [BF16, FP16])
def test_norm_out_dtype_is_one_rounding_of_the_default_output(fused, out_dtype):
    """``out_dtype`` (what the packed forward asks for under autocast, where the normed output only feeds a
    projection) gives exactly the default output cast to it, in every op set and launch path; the residual sum
    keeps its own dtype."""
    g = _gen(7)
    x, d = torch.randn(37, 96, generator=g) * 3, torch.randn(37, 96, generator=g)
    w, b = torch.randn(96, generator=g), torch.randn(96, generator=g)
    for ops in (TORCH_OPS, fused.TRITON_OPS, fused.DIRECT_OPS):
        want = ops.layer_norm(x, w, b, 1e-5)
        got = ops.layer_norm(x, w, b, 1e-5, out_dtype=out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, want.to(out_dtype)), ops.name
        s_want, y_want = ops.residual_layer_norm(x, d, w, b, 1e-5)
        s, y = ops.residual_layer_norm(x, d, w, b, 1e-5, out_dtype=out_dtype)
        assert s.dtype == FP32 and torch.equal(s, s_want), ops.name
        assert y.dtype == out_dtype and torch.equal(y, y_want.to(out_dtype)), ops.name
    own = x.clone()
    s, y = fused.DIRECT_OPS.residual_in_place(own, d, w, b, 1e-5, out_dtype=out_dtype)
    assert s.data_ptr() == own.data_ptr() and torch.equal(s, s_want) and torch.equal(y, y_want.to(out_dtype))


def test_autocast_forward_norms_write_the_projection_dtype(fused):
    """Under autocast without gradient the packed forward asks its attention and MLP norms for their output in the
    autocast dtype (no separate cast per norm), and the result is bitwise that of norms whose output is cast
    afterwards (an op set that ignores ``out_dtype``); the embedding and final norms keep their default."""
    from dataclasses import replace

    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    model, config = _tiny_modernbert()
    params = ModernBertParams.from_hf_config(config)
    batch = _tiny_packed_batch([3, 11, 1, 20], seed=43)
    asked = []

    def ln(x, w, b, eps, out_dtype=None, **kw):
        asked.append(out_dtype)
        return fused.layer_norm(x, w, b, eps, out_dtype, **kw)

    def res_ln(x, d, w, b, eps, out_dtype=None, **kw):
        asked.append(out_dtype)
        return fused.residual_layer_norm(x, d, w, b, eps, out_dtype, **kw)

    def ln_default(x, w, b, eps, out_dtype=None):
        return fused.layer_norm(x, w, b, eps)

    def res_ln_default(x, d, w, b, eps, out_dtype=None):
        return fused.residual_layer_norm(x, d, w, b, eps)

    spying = replace(fused.TRITON_OPS, name="spy", layer_norm=ln, residual_layer_norm=res_ln, direct=None)
    cast_after = replace(spying, name="cast after", layer_norm=ln_default, residual_layer_norm=res_ln_default)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        got = encoder_forward(model, params, batch, ops=spying, attention_backend="sdpa")
        want = encoder_forward(model, params, batch, ops=cast_after, attention_backend="sdpa")
    assert torch.equal(got, want)
    layers = params.num_hidden_layers
    # embedding norm, then per layer attn_norm (an Identity on layer 0) and mlp_norm, then final_norm
    assert asked == [None] + [BF16] * (2 * layers - 1) + [None], asked
