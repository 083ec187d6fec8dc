"""GPU tests of every attention backend against the fp32 per-sequence reference (skipped without CUDA).

Tolerance rule (DESIGN.md): ``max|backend - ref_fp32| <= 2 * max|torch_same_dtype - ref_fp32| + eps``, for the
forward output and, where a backend has a backward, for dq, dk, dv.
"""

from __future__ import annotations

import pytest
import torch

from packed_encoders import calibrate
from packed_encoders.attention import BACKENDS, Workload, resolve
from packed_encoders.attention import dispatch, triton_short
from packed_encoders.attention.reference import attention_ref, attention_same_dtype, parity
from packed_encoders.attention.triton_short import TileConfig, triton_short_attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")

# 1..2049 with the window edges of ModernBERT (half window 64): 64, 65, 128, 129
LENGTHS = [1, 2, 17, 63, 64, 65, 127, 128, 129, 130, 300, 511, 512, 513, 1000, 2049, 3, 1]
GEOMETRIES = [(12, 64), (16, 64), (8, 128)]
DTYPES = [torch.bfloat16, torch.float16]
WINDOWS = [None, 64]


def lengths_for(backend: str, window=None) -> list[int]:
    if backend == "triton" and window is not None:  # local layers: any max_seqlen, plus a many-short tail
        return LENGTHS + [5, 9, 31, 33] * 8 + [3000]
    if backend == "triton":  # its envelope, plus a many-short tail
        return [n for n in LENGTHS if n <= triton_short.MAX_SEQLEN] + [5, 9, 31, 33] * 8 + [triton_short.MAX_SEQLEN]
    return LENGTHS


def available(name: str) -> bool:
    b = BACKENDS.get(name)
    return b is not None and b.availability() is None


def inputs(lengths, heads, head_dim, dtype, grad=False, seed=0):
    qkv, q, k, v, cu, smax = calibrate.make_inputs(lengths, heads, head_dim, dtype, "cuda", grad=grad, seed=seed)
    return qkv, q, k, v, cu, smax


@pytest.mark.parametrize("name", ["sdpa", "varlen", "fa4", "triton"])
@pytest.mark.parametrize("heads,head_dim", GEOMETRIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", WINDOWS)
def test_forward_matches_reference(name, heads, head_dim, dtype, window):
    if not available(name):
        pytest.skip(f"{name}: {BACKENDS[name].availability() if name in BACKENDS else 'not registered'}")
    _, q, k, v, cu, smax = inputs(lengths_for(name, window), heads, head_dim, dtype)
    w = Workload(cu.numel() - 1, q.shape[0], smax, heads, head_dim, window, False, dtype, "cuda")
    if BACKENDS[name].envelope(w) is not None:
        pytest.skip(BACKENDS[name].envelope(w))
    out = BACKENDS[name].fn(q, k, v, cu, smax, window=window, scale=head_dim ** -0.5)
    assert out.shape == q.shape and out.dtype == dtype
    err, allowed = parity(out, q, k, v, cu, window)
    assert err <= allowed, f"{name}: max err {err:.4g} > {allowed:.4g}"


def _grads(fn, qkv, dout):
    qkv.grad = None
    out = fn()
    (g,) = torch.autograd.grad(out.float(), qkv, dout)
    return g.float()


def _grad_parity(fn, qkv, q, k, v, cu, window, scale, key_lens=None):
    """``(err, allowed)`` per q / k / v under the tolerance rule: ``fn()``'s gradients against the fp32 reference,
    allowed twice plain torch's own error in the inputs' dtype plus 1e-3."""
    dout = torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    got = _grads(fn, qkv, dout)
    leaf32 = qkv.detach().float().requires_grad_(True)
    q32, k32, v32 = leaf32.unbind(1)
    ref = _grads(lambda: attention_ref(q32, k32, v32, cu, window, scale, key_lens), leaf32, dout)
    same = _grads(lambda: attention_same_dtype(q, k, v, cu, window, scale, key_lens), qkv, dout)
    return (got - ref).abs().amax(dim=(0, 2, 3)), 2 * (same - ref).abs().amax(dim=(0, 2, 3)) + 1e-3


@pytest.mark.parametrize("name", ["sdpa", "varlen", "fa4"])
@pytest.mark.parametrize("heads,head_dim", GEOMETRIES)
@pytest.mark.parametrize("window", WINDOWS)
def test_backward_matches_reference(name, heads, head_dim, window):
    if not available(name):
        pytest.skip(f"{name} unavailable")
    dtype = torch.bfloat16
    lengths = [1, 64, 65, 128, 129, 300, 2049, 7]
    qkv, q, k, v, cu, smax = inputs(lengths, heads, head_dim, dtype, grad=True)
    scale = head_dim ** -0.5
    err, allowed = _grad_parity(lambda: BACKENDS[name].fn(q, k, v, cu, smax, window=window, scale=scale),
                                qkv, q, k, v, cu, window, scale)
    assert bool((err <= allowed).all()), f"{name}: dq/dk/dv err {err.tolist()} > {allowed.tolist()}"


@pytest.mark.parametrize("window", [None, 64, 3])
@pytest.mark.parametrize("efficient", [True, False])
def test_sdpa_small_calls_either_kernel_with_key_lens(monkeypatch, window, efficient):
    """Small sdpa calls (ColBERT query chunks in training: query-only tails, ``key_lens``) take torch's
    memory-efficient kernel directly; larger ones torch's own choice. Both within the parity rule, forward and
    dq / dk / dv, with rows whose tails have no key in their window (zeros, as stock)."""
    from packed_encoders.attention import sdpa

    monkeypatch.setattr(sdpa, "EFFICIENT_MAX_ROWS", 1 << 30 if efficient else 0)
    lengths, key_lens = [32, 17, 32, 9, 1, 30, 25, 32], [12, 17, 3, 9, 1, 20, 2, 31]
    qkv, q, k, v, cu, smax = inputs(lengths, 12, 64, torch.bfloat16, grad=True)
    kl = torch.tensor(key_lens, dtype=torch.int32, device="cuda")
    scale = 64 ** -0.5
    out = sdpa.sdpa_varlen(q, k, v, cu, smax, window=window, scale=scale, key_lens=kl)
    err, allowed = parity(out, q, k, v, cu, window, key_lens=kl)
    assert err <= allowed, f"forward: max err {err:.4g} > {allowed:.4g}"
    err, allowed = _grad_parity(lambda: sdpa.sdpa_varlen(q, k, v, cu, smax, window=window, scale=scale, key_lens=kl),
                                qkv, q, k, v, cu, window, scale, kl)
    assert bool((err <= allowed).all()), f"dq/dk/dv err {err.tolist()} > {allowed.tolist()}"


@pytest.mark.parametrize("direct", [False, True])
def test_varlen_key_lens_on_global_layers(direct):
    """torch's FlashAttention-2 with query-only tails (ColBERT query expansion in training): each sequence's keys
    gathered into their own key sequence. Forward and dq / dk / dv within the parity rule, a sequence whose
    queries have no key included (zeros, as stock); a local window is refused."""
    from packed_encoders.attention import flash

    if not available("varlen"):
        pytest.skip("varlen unavailable")
    fn = flash.torch_varlen_direct if direct else flash.torch_varlen
    lengths, key_lens = [32, 17, 32, 9, 1, 30, 25, 32, 5], [12, 17, 3, 9, 1, 20, 2, 31, 0]
    qkv, q, k, v, cu, smax = inputs(lengths, 12, 64, torch.bfloat16, grad=True)
    kl = torch.tensor(key_lens, dtype=torch.int32, device="cuda")
    scale = 64 ** -0.5
    out = fn(q, k, v, cu, smax, window=None, scale=scale, key_lens=kl)
    err, allowed = parity(out, q, k, v, cu, None, key_lens=kl)
    assert err <= allowed, f"forward: max err {err:.4g} > {allowed:.4g}"
    err, allowed = _grad_parity(lambda: fn(q, k, v, cu, smax, window=None, scale=scale, key_lens=kl),
                                qkv, q, k, v, cu, None, scale, kl)
    assert bool((err <= allowed).all()), f"dq/dk/dv err {err.tolist()} > {allowed.tolist()}"
    with pytest.raises(ValueError, match="window"):
        fn(q, k, v, cu, smax, window=8, scale=scale, key_lens=kl)
    # the training stack's pair (forward outside autograd, its own backward): aten's autograd node's results
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    out_s, saved = flash.torch_varlen_forward_saving(q0, k0, v0, cu, smax, window=None, scale=scale, key_lens=kl)
    torch.testing.assert_close(out_s, out.detach(), atol=0, rtol=0)
    dout = torch.randn_like(out_s)
    qa, ka, va = (t.detach().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(fn(qa, ka, va, cu, smax, window=None, scale=scale, key_lens=kl), (qa, ka, va), dout)
    for name, got, ref in zip("qkv", flash.torch_varlen_backward(dout, saved), want):
        torch.testing.assert_close(got, ref, msg=name)  # (bf16 tolerances: FlashAttention-2 sums dq atomically)


def test_triton_isolation_determinism_and_tiles():
    lengths = [7, 12, 9, 64, 65, 1, 128, 129, 40]
    _, q, k, v, cu, smax = inputs(lengths, 12, 64, torch.bfloat16)
    for cfg in [None, TileConfig(16, 16), TileConfig(64, 32, heads_per_program=5, grid="seq")] + [
            make(smax, 64, True) for make in triton_short.VARIANTS.values()]:
        for window in (None, 64, 3):
            a = triton_short_attention(q, k, v, cu, smax, window=window, scale=0.125, config=cfg)
            err, allowed = parity(a, q, k, v, cu, window)
            assert err <= allowed, (cfg, window, err, allowed)
            assert torch.equal(a, triton_short_attention(q, k, v, cu, smax, window=window, scale=0.125, config=cfg))
    base = triton_short_attention(q, k, v, cu, smax, window=None, scale=0.125)
    b = slice(7, 19)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for t in (q2, k2, v2):
        t[b].normal_()
    other = triton_short_attention(q2, k2, v2, cu, smax, window=None, scale=0.125)
    assert torch.equal(base[:7], other[:7]) and torch.equal(base[19:], other[19:])


def test_triton_compiled_variants_stay_few():
    kernel = triton_short._kernel()
    dev = torch.cuda.current_device()
    if dev in kernel.device_caches:
        kernel.device_caches[dev][0].clear()  # count this test's compilations only (triton internals)
    before = 0
    used = set()
    for smax in [1, 2, 5, 16, 33, 64, 65, 100, 128, 129, 200, 511, 700, 1024]:
        lengths = calibrate.lengths_for(max(smax * 3, 50), smax, seed=smax)
        _, q, k, v, cu, s = inputs(lengths, 12, 64, torch.bfloat16)
        for window in (None, 64):
            triton_short_attention(q, k, v, cu, s, window=window, scale=0.125)
            local = window is not None and window < s - 1
            used.add((triton_short.tile_config(s, 64, local), local))
    compiled = len(kernel.device_caches[dev][0]) - before
    assert compiled <= len(used) <= 6, (compiled, used)


def test_dispatch_on_this_card():
    policy = dispatch.load_policy(torch.device("cuda"))
    w = Workload(8, 250, 64, 12, 64, None, False, torch.bfloat16, "cuda")
    decision = resolve("auto", w, policy)
    assert decision.backend in BACKENDS and BACKENDS[decision.backend].why_not(w) is None
    trained = resolve("auto", Workload(8, 250, 64, 12, 64, None, True, torch.bfloat16, "cuda"), policy)
    assert BACKENDS[trained.backend].has_backward
    if available("triton"):
        assert resolve("triton", w).backend == "triton"


@pytest.mark.parametrize("kind", ["per_token", "theta"])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("total", [256, 4097])
def test_triton_fused_rope_matches_unfused(total, window, kind):
    """RoPE fused into the Triton kernel (rope=(cos, sin, rows), unrotated q/k views of qkv) against the unfused
    path (ops.rope_qkv, then the kernel) and the fp32 reference, 12 x 64 bf16, default launch shapes and launcher."""
    from packed_encoders.ops import rope_qkv_ref, rope_qkv_torch, rope_tables
    from packed_encoders.ops.fused import rope_qkv as rope_qkv_triton

    heads, head_dim, dtype = 12, 64, torch.bfloat16
    smax = 64 if total == 256 else 1024  # short queries (<= 64 tokens); a ragged mix at the global envelope edge
    lengths = calibrate.lengths_for(total, smax, seed=total)
    lengths = lengths[:2] + [0] + lengths[2:]  # an empty sequence inside cu_seqlens
    g = torch.Generator().manual_seed(total)
    qkv = torch.randn(total, 3 * heads * head_dim, generator=g).to("cuda", dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    pos = torch.cat([torch.arange(n) for n in lengths]).cuda()
    if kind == "per_token":  # a captured forward's tables from HF's inv_freq: [T, hd/2], rows = arange(T)
        # (eager calls read cached tables over positions, rows = position ids: the "theta" layout below)
        inv = 1.0 / (160000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = pos.float()[:, None] * inv.cuda()[None, :]
        rope = (freqs.cos(), freqs.sin(), torch.arange(total, device="cuda"))
    else:  # cached theta tables indexed by position ids
        cos, sin = rope_tables(10000.0, head_dim, smax, "cuda")
        rope = (cos, sin, pos)
    q, k, v = qkv.view(total, 3, heads, head_dim).unbind(1)
    fused = triton_short_attention(q, k, v, cu, smax, window=window, scale=0.125, rope=rope)
    results = {}
    for name, rope_op in (("torch", rope_qkv_torch), ("triton", rope_qkv_triton)):
        rq, rk, rv = rope_op(qkv, *rope, heads, head_dim)
        results[name] = triton_short_attention(rq, rk, rv, cu, smax, window=window, scale=0.125)
    q32, k32, v32 = rope_qkv_ref(qkv, *rope, heads, head_dim)
    ref = attention_ref(q32, k32, v32, cu, window, 0.125)
    rq, rk, rv = rope_qkv_torch(qkv, *rope, heads, head_dim)
    yard = (attention_same_dtype(rq, rk, rv, cu, window, 0.125).float() - ref).abs().max().item()
    err = (fused.float() - ref).abs().max().item()
    assert err <= 2 * yard + 1e-3, f"fused vs fp32 reference: {err:.4g} > 2 * {yard:.4g} + 1e-3"
    for name, unfused in results.items():
        # same fp32 maths and one rounding: only FMA contraction can move a rare q/k element by one bf16 ulp
        diff = (fused.float() - unfused.float()).abs().max().item()
        assert diff <= yard + 1e-3, f"fused vs unfused ({name} rope op): {diff:.4g} > {yard:.4g} + 1e-3"
    assert torch.equal(fused, triton_short_attention(q, k, v, cu, smax, window=window, scale=0.125, rope=rope))
