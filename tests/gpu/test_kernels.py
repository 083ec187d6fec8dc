"""Fused kernels on CUDA: the issue's grid against the fp32 references, graph capture, no recompiles,
and the packed forward with the fused op sets against stock HF and the plain-torch op set.

Rule for every output: ``max|fast - ref32| <= 2 * max|torch_same_dtype - ref32| + eps``,
``eps = 32 * 2**-23 * max(1, max|ref32|)``. Before each fused call the CUDA caching allocator is filled
with NaN bit patterns, so an output element the kernel fails to write shows up as NaN.

Run: ``python -m pytest -q tests/gpu/test_kernels.py`` (skipped without CUDA; the cute tests are skipped
without cutlass/quack or below sm_90).
"""

from __future__ import annotations

import math

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from packed_encoders.ops import (TORCH_OPS, geglu_ref, geglu_torch, layer_norm_ref, layer_norm_torch,  # noqa: E402
                                 residual_layer_norm_ref, residual_layer_norm_torch, rope_qkv_ref, rope_qkv_torch,
                                 rope_tables)
from tests.helpers import cosine_stats, make_model, padded_batch  # noqa: E402

DEV = torch.device("cuda")
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TOKENS = [1, 7, 128, 4097, 65537]
HIDDEN = [256, 384, 768, 1024, 1792]
HALF = [BF16, FP16]


@pytest.fixture(scope="module")
def fused():
    from packed_encoders.ops import fused

    return fused


@pytest.fixture(autouse=True)
def _no_fallbacks(fused):
    fused.reset_fallbacks()
    yield
    assert fused.fallbacks() == {}, f"calls routed to plain torch: {fused.fallbacks()}"


def poison(nbytes: int) -> None:
    """Fill the caching allocator's free blocks with 0xFF bytes (NaN in fp32/bf16/fp16): one large block of
    at least ``2 * nbytes`` and a set of small-pool blocks, then free them for the next allocations."""
    big = torch.empty(max(2 * nbytes, 8 << 20), dtype=torch.uint8, device=DEV).fill_(255)
    small = [torch.empty(256 << 10, dtype=torch.uint8, device=DEV).fill_(255) for _ in range(16)]
    del big, small


def _rand(shape, dtype, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(shape, generator=g, device=DEV) * scale).to(dtype)


def _leaf(t, dtype=None):
    return t.detach().clone().to(dtype or t.dtype).requires_grad_(True)


def _grads(outputs, grads, inputs):
    got = torch.autograd.grad(outputs, inputs, grads, allow_unused=True)
    return [g if g is not None else torch.zeros_like(i) for g, i in zip(got, inputs)]


def assert_rule(fast, ref, same, what):
    assert fast.shape == ref.shape, (what, fast.shape, ref.shape)
    ref = ref.float()
    err = (fast.float() - ref).abs().max().item()
    base = (same.float() - ref).abs().max().item()
    eps = 32 * 2.0 ** -23 * max(1.0, ref.abs().max().item())
    if fast.dtype in (torch.bfloat16, torch.float16):
        # Rounding an fp32 result into the output dtype costs up to one ulp when it is rounded twice (e.g. a
        # reduction's partials): allow one ulp at the reference's magnitude, which plain torch may dodge by luck.
        eps = max(eps, torch.finfo(fast.dtype).eps * ref.abs().max().item())
    assert err <= 2 * base + eps, f"{what}: error {err:.3g} > 2 * torch error {base:.3g} + {eps:.3g}"


# ------------------------------------------------------------------------------------------------ the grid


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_grid(fused, residual, t, h, dtype):
    bias = h in (384, 1792)  # ModernBERT has no norm bias by default; cover the bias path on two widths
    x = _rand((t, h), dtype, 1, 2.0)
    d = _rand((t, h), dtype, 2)
    w = _rand((h,), dtype, 3) * 0.2 + 1
    b = _rand((h,), dtype, 4) * 0.1 if bias else None
    gy, gs = _rand((t, h), dtype, 5), _rand((t, h), dtype, 6)
    params = [w] + ([b] if bias else [])

    def run(fn, inputs, cast=None):
        xs = [_leaf(i, cast) for i in inputs]
        ps = [_leaf(p) for p in params]
        bb = ps[1] if bias else None
        if residual:
            s, y = fn(xs[0], xs[1], ps[0], bb, 1e-5)
            outs, grads = [s, y], [gs, gy]
        else:
            outs, grads = [fn(xs[0], ps[0], bb, 1e-5)], [gy]
        grads = [g.to(cast) if cast else g for g in grads]
        return outs, _grads(outs, grads, xs + ps)

    inputs = [x, d] if residual else [x]
    poison(4 * t * h * 4)
    fast = run(fused.residual_layer_norm if residual else fused.layer_norm, inputs)
    ref = run(residual_layer_norm_ref if residual else layer_norm_ref, inputs, FP32)
    same = run(residual_layer_norm_torch if residual else layer_norm_torch, inputs)
    names = (["s", "y"] if residual else ["y"]) + (["dx", "ddelta"] if residual else ["dx"]) + ["dw", "db"][:len(params)]
    for name, a, r, s in zip(names, fast[0] + fast[1], ref[0] + ref[1], same[0] + same[1]):
        assert a.dtype == s.dtype, name
        assert_rule(a, r, s, name)


ROPE_GEOMETRY = [(12, 64), (16, 64), (8, 32), (6, 96), (8, 128), (4, 256)]  # base, large, and the head_dim range


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("nh,hd", ROPE_GEOMETRY)
@pytest.mark.parametrize("t", TOKENS)
def test_rope_grid(fused, t, nh, hd, dtype):
    cos, sin = rope_tables(160000.0, hd, 8192, DEV)
    qkv = _rand((t, 3 * nh * hd), dtype, 7)
    pos = torch.randint(0, 8192, (t,), device=DEV)
    grads = [_rand((t, nh, hd), dtype, 8 + i) for i in range(3)]

    def run(fn, cast=None):
        leaf = _leaf(qkv, cast)
        outs = list(fn(leaf, cos, sin, pos, nh, hd))
        return outs, _grads(outs, [g.to(cast) if cast else g for g in grads], [leaf])

    poison(6 * t * nh * hd * 2)
    (q, k, v), (dqkv,) = run(fused.rope_qkv)
    (qr, kr, vr), (dr,) = run(rope_qkv_ref, FP32)
    (qs, ks, vs), (ds,) = run(rope_qkv_torch)
    assert_rule(q, qr, qs, "q")
    assert_rule(k, kr, ks, "k")
    assert torch.equal(v, vs) and v.stride() == vs.stride()
    assert_rule(dqkv, dr, ds, "dqkv")


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@pytest.mark.parametrize("inner", [1152, 2624, 1000])  # ModernBERT-base, -large, and an unaligned width
@pytest.mark.parametrize("t", TOKENS)
def test_glu_grid(fused, t, inner, activation, dtype):
    x = _rand((t, 2 * inner), dtype, 12, 2.0)
    dy = _rand((t, inner), dtype, 13)

    def run(fn, cast=None):
        leaf = _leaf(x, cast)
        y = fn(leaf, activation)
        return y, _grads([y], [dy.to(cast) if cast else dy], [leaf])[0]

    poison(5 * t * inner * 2)
    y, dx = run(fused.glu)
    yr, dxr = run(geglu_ref, FP32)
    ys, dxs = run(geglu_torch)
    assert_rule(y, yr, ys, "y")
    assert_rule(dx, dxr, dxs, "dx")


def test_autocast_residual_stream(fused):
    """Training under bf16 autocast: an fp32 residual stream plus a bf16 sub-block output, fp32 weights; the
    normed output is fp32 like F.layer_norm under CUDA autocast, and each input gets its own-dtype grad."""
    t, h = 4097, 768
    x, d = _rand((t, h), FP32, 20, 2.0), _rand((t, h), BF16, 21)
    w = _rand((h,), FP32, 22) * 0.2 + 1
    xs, ds, ws = _leaf(x), _leaf(d), _leaf(w)
    with torch.autocast("cuda", dtype=BF16):
        s, y = fused.residual_layer_norm(xs, ds, ws, None, 1e-5)
        s2, y2 = residual_layer_norm_torch(_leaf(x), _leaf(d), _leaf(w), None, 1e-5)
        e = fused.layer_norm(d, w, None, 1e-5)
        e2 = layer_norm_torch(d, w, None, 1e-5)
    assert (s.dtype, y.dtype, e.dtype) == (s2.dtype, y2.dtype, e2.dtype) == (FP32, FP32, FP32)
    gx, gd, gw = torch.autograd.grad([s, y], [xs, ds, ws], [torch.ones_like(s), _rand((t, h), FP32, 23)])
    assert (gx.dtype, gd.dtype, gw.dtype) == (FP32, BF16, FP32)
    torch.testing.assert_close(gd.float(), gx.to(BF16).float())


# ------------------------------------------------------------------------------------------------ runtime


def _cache_size(kernel) -> int:
    compiled = getattr(kernel, "_compiled", None)
    caches = getattr(compiled, "device_caches", None)
    return 0 if caches is None else sum(len(entry[0]) for entry in caches.values())


def _kernels(module):
    name = module.__name__.rsplit(".", 1)[-1]
    return getattr(module, f"_{name}_fwd_kernel"), getattr(module, f"_{name}_bwd_kernel")


def test_token_count_does_not_recompile(fused):
    from packed_encoders.ops.triton import glu, layer_norm, rope

    cos, sin = rope_tables(10000.0, 64, 8192, DEV)
    w = torch.ones(768, device=DEV, dtype=BF16)
    sizes = {}
    base = {k_.fn.__name__ + m.__name__: _cache_size(k_) for m in (layer_norm, rope, glu)
            for k_ in _kernels(m)}  # earlier tests compiled other shapes and dtypes
    for t in (1, 7, 16, 128, 1000, 4096, 4097, 65537):
        x = _rand((t, 768), BF16, t, 1.0).requires_grad_()
        d = _rand((t, 768), BF16, t + 1, 1.0)
        s, y = fused.residual_layer_norm(x, d, w, None, 1e-5)
        qkv = _rand((t, 3 * 768), BF16, t + 2).requires_grad_()
        q, k, v = fused.rope_qkv(qkv, cos, sin, torch.arange(t, device=DEV) % 8192, 12, 64)
        z = _rand((t, 2 * 1152), BF16, t + 3).requires_grad_()
        out = (y.float().sum() + q.float().sum() + k.float().sum() + v.float().sum()
               + fused.glu(z, "gelu").float().sum())
        out.backward()
        now = {k_.fn.__name__ + m.__name__: _cache_size(k_) for m in (layer_norm, rope, glu)
               for k_ in _kernels(m)}
        sizes.setdefault("first", now)
        assert now == sizes["first"], f"recompiled at T={t}: {now} vs {sizes['first']}"
    assert all(v - base[k] <= 1 for k, v in sizes["first"].items()), (base, sizes["first"])


def test_cuda_graph_capture(fused):
    t, h, nh, hd, inner = 4097, 768, 12, 64, 1152
    cos, sin = rope_tables(160000.0, hd, 8192, DEV)
    w = _rand((h,), BF16, 30) * 0.2 + 1
    x, d = _rand((t, h), BF16, 31), _rand((t, h), BF16, 32)
    qkv, z = _rand((t, 3 * h), BF16, 33), _rand((t, 2 * inner), BF16, 34)
    pos = torch.arange(t, device=DEV) % 2048

    def step():
        s, y = fused.residual_layer_norm(x, d, w, None, 1e-5)
        q, k, _ = fused.rope_qkv(qkv, cos, sin, pos, nh, hd)
        return s, y, q, k, fused.glu(z, "gelu"), fused.layer_norm(x, w, None, 1e-5)

    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # compile outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
        for seed in (1, 2):
            for buf, new in ((x, _rand((t, h), BF16, 40 + seed)), (d, _rand((t, h), BF16, 50 + seed)),
                             (qkv, _rand((t, 3 * h), BF16, 60 + seed)), (z, _rand((t, 2 * inner), BF16, 70 + seed))):
                buf.copy_(new)
            graph.replay()
            torch.cuda.synchronize()
            for a, b in zip(static, step()):
                assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------ model level


@pytest.mark.parametrize("kernels", ["triton", "cute"])
def test_packed_model_vs_stock_hf(fused, kernels):
    """ModernBERT-base geometry, random init, bf16: packed forward with the fused op set against stock HF
    (sdpa), per-token cosine on real tokens, no worse than the plain-torch op set against the same oracle."""
    import packed_encoders as pe

    if kernels == "cute":
        from packed_encoders.ops.cute import unavailable

        why = unavailable(DEV)
        if why:
            pytest.skip(why)
    model = make_model("base", dtype=BF16, device=DEV)
    ids, mask = padded_batch([8192, 2049, 1000, 200, 37], vocab_size=model.config.vocab_size, device=DEV)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        scores = {}
        for choice in ("torch", kernels):
            pe.pack(model, kernels=choice, validate=False)
            assert pe.describe(model)["encoders"][0]["kernels"] == choice
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
            scores[choice] = cosine_stats(out, ref, mask)
            pe.unpack(model)
    (t_min, t_mean), (f_min, f_mean) = scores["torch"], scores[kernels]
    assert f_min >= min(0.99, t_min - 0.005) and f_mean >= t_mean - 1e-3, scores


def test_packed_model_gradients_vs_torch_ops(fused):
    """Training case: fp32 master weights under bf16 autocast. Parameter gradients of the packed forward with
    the Triton op set vs the plain-torch op set, both against the fp32 (no autocast) plain-torch gradients."""
    from packed_encoders.batch import from_packed
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    model = make_model("base", dtype=FP32, device=DEV)
    params = ModernBertParams.from_hf_config(model.config)
    lengths = [1500, 512, 300, 77, 3]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, model.config.vocab_size, (sum(lengths),), generator=g).to(DEV)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    batch = from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=max(lengths),
                        position_ids=None, vocab_size=model.config.vocab_size)
    probe = torch.randn(sum(lengths), model.config.hidden_size, generator=g).to(DEV)

    def grads(ops, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=BF16, enabled=autocast):
            out = encoder_forward(model, params, batch, ops=ops)
        (out.float() * probe).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref = grads(TORCH_OPS, False)
    torch_bf16 = grads(TORCH_OPS, True)
    fused_bf16 = grads(fused.TRITON_OPS, True)
    err_t = ((torch_bf16 - ref).norm() / ref.norm()).item()
    err_f = ((fused_bf16 - ref).norm() / ref.norm()).item()
    assert math.isfinite(err_f) and err_f <= 2 * err_t + 1e-4, (err_f, err_t)


# ------------------------------------------------------------------------------------------------ cute


@pytest.fixture(scope="module")
def cute_ops():
    from packed_encoders.ops.cute import unavailable

    why = unavailable(DEV)
    if why:
        pytest.skip(why)
    from packed_encoders.ops.cute.opset import CUTE_OPS

    return CUTE_OPS


@pytest.fixture()
def cute_routes(cute_ops):
    from packed_encoders.ops.cute import opset

    opset.reset_fallbacks()
    yield opset
    opset.reset_fallbacks()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("h", [256, 768, 1024, 1792])
@pytest.mark.parametrize("t", [1, 4097, 65537])
@pytest.mark.parametrize("residual", [False, True])
def test_cute_layer_norm(cute_ops, cute_routes, residual, t, h, dtype):
    x, d = _rand((t, h), dtype, 80, 2.0), _rand((t, h), dtype, 81)
    w = _rand((h,), dtype, 82) * 0.2 + 1
    gy, gs = _rand((t, h), dtype, 83), _rand((t, h), dtype, 84)

    def run(fn, cast=None):
        xs = [_leaf(x, cast), _leaf(d, cast)]
        ws = _leaf(w)
        if residual:
            outs = list(fn(xs[0], xs[1], ws, None, 1e-5))
            grads = [gs, gy]
        else:
            outs = [fn(xs[0], ws, None, 1e-5)]
            grads = [gy]
            xs = xs[:1]
        return outs, _grads(outs, [g.to(cast) if cast else g for g in grads], xs + [ws])

    poison(4 * t * h * 4)
    fast = run(cute_ops.residual_layer_norm if residual else cute_ops.layer_norm)
    ref = run(residual_layer_norm_ref if residual else layer_norm_ref, FP32)
    same = run(residual_layer_norm_torch if residual else layer_norm_torch)
    assert cute_routes.fallbacks() == {}, cute_routes.fallbacks()
    for i, (a, r, s) in enumerate(zip(fast[0] + fast[1], ref[0] + ref[1], same[0] + same[1])):
        assert_rule(a, r, s, f"output {i}")


def test_cute_routes_unaligned_hidden_to_triton(cute_ops, cute_routes, fused):
    x = _rand((33, 300), BF16, 90)
    w = _rand((300,), BF16, 91)
    torch.testing.assert_close(cute_ops.layer_norm(x, w, None, 1e-5), fused.layer_norm(x, w, None, 1e-5))
    assert any("multiple of 8" in r for r in cute_routes.fallbacks().get("layer_norm", {}))


@pytest.mark.parametrize("n,k", [(2304, 768), (768, 768), (768, 1152), (3072, 1024), (1000, 333)])
@pytest.mark.parametrize("r,ab_dtype", [(16, FP32), (8, BF16), (64, FP32), (1, FP32)])
def test_lora_merge_grid(fused, n, k, r, ab_dtype):
    """The LoRA merge on ModernBERT-base / -large projection shapes (and an odd one), bf16 weight, peft's fp32 or
    bf16 factors: within one bf16 rounding of the fp32 formula, every element written, operands untouched; a second
    launch (the bound fast launch) gives the same bits."""
    g = torch.Generator(device=DEV).manual_seed(n + k + r)
    weight = torch.randn(n, k, device=DEV, generator=g).to(BF16)
    a = (torch.randn(r, k, device=DEV, generator=g) / r ** 0.5).to(ab_dtype)
    b = torch.randn(n, r, device=DEV, generator=g).to(ab_dtype)
    before = [t.clone() for t in (weight, a, b)]
    poison(2 * n * k)
    got = fused.lora_merge(weight, a, b, 2.0, BF16)
    ref = weight.double() + 2.0 * (b.double() @ a.double())
    assert got is not None and got.dtype is BF16 and bool(torch.isfinite(got).all())
    err = (got.double() - ref).abs()
    assert bool((err <= 0.5 * torch.finfo(BF16).eps * ref.abs() + 1e-5 * (1 + ref.abs())).all()), float(err.max())
    assert torch.equal(fused.lora_merge(weight, a, b, 2.0, BF16), got)
    assert all(torch.equal(t, u) for t, u in zip((weight, a, b), before))
