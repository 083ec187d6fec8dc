"""FlashAttention-4's compiled kernels called directly (``attention/fa4_direct.py``) against its public entry point
and the fp32 reference: the same forward bit for bit, gradients within the kernels' atomic-order noise, every
``max_seqlen`` span ModernBERT reaches, windows, both dtypes, inside a CUDA graph; calls it does not serve take the
public entry point."""

from __future__ import annotations

import pytest
import torch

from packed_encoders.attention import fa4_direct, flash
from packed_encoders.attention.reference import attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or flash.fa4_status() is not None
                                or fa4_direct.version_status() is not None,
                                reason="requires CUDA, FlashAttention-4 and a release fa4_direct reads")

BATCHES = [[1, 5, 17, 63], [64, 65, 100, 128], [129, 150, 192], [200, 256, 3], [300, 511, 7], [925, 1100, 700, 980],
           [2049, 30], [5000, 12]]


def _inputs(lengths, heads=12, head_dim=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return q, k, v, cu, max(lengths)


def _public(q, k, v, cu, max_seqlen, window, scale, dout=None):
    from flash_attn.cute import flash_attn_varlen_func

    q, k, v = (t.detach().requires_grad_(dout is not None) for t in (q, k, v))
    ws = (None, None) if window is None else (window, window)
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                 max_seqlen_k=max_seqlen, softmax_scale=scale, causal=False, window_size=ws)
    out = out[0] if isinstance(out, tuple) else out
    if dout is None:
        return out, None
    return out.detach(), torch.autograd.grad(out, (q, k, v), dout)


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.float().flatten(1), b.float().flatten(1), dim=-1).min().item()


@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("lengths", BATCHES, ids=[str(max(b)) for b in BATCHES])
def test_direct_matches_the_public_entry_point(lengths, window):
    q, k, v, cu, max_seqlen = _inputs(lengths)
    scale = 0.125
    got = fa4_direct.forward(q, k, v, cu, max_seqlen, window=window, scale=scale, backward=True)
    assert got is not None, fa4_direct.class_status(q, window, scale, max_seqlen, len(lengths))
    out, lse = got
    dout = torch.randn_like(out)
    ref_out, ref_grads = _public(q, k, v, cu, max_seqlen, window, scale, dout)
    assert torch.equal(out, ref_out)  # the same compiled kernel on the same operands
    grads = fa4_direct.backward(dout, q, k, v, out, lse, cu, max_seqlen, window=window, scale=scale)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert _cos(g, r) > 0.9999, name  # dq sums in fp32 atomics: order differs run to run
        assert (g.float() - r.float()).abs().max().item() <= 2e-2 * r.float().abs().max().item() + 1e-3, name
    # and against the fp32 reference
    ref = attention_ref(q.float(), k.float(), v.float(), cu, window=window, scale=scale)
    assert (out.float() - ref).abs().max().item() < 2e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_autograd_path_serves_grad_calls_directly(dtype):
    q, k, v, cu, max_seqlen = _inputs([300, 40, 700], dtype=dtype, seed=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash.fa4_varlen_finite_v(*leaves, cu, max_seqlen, window=64, scale=0.125)
    assert out.grad_fn is not None and "FA4Direct" in type(out.grad_fn).__name__
    dout = torch.randn_like(out)
    out.backward(dout)
    ref_out, ref_grads = _public(q, k, v, cu, max_seqlen, 64, 0.125, dout)
    assert torch.equal(out.detach(), ref_out)
    for leaf, r in zip(leaves, ref_grads):
        assert _cos(leaf.grad, r) > 0.9999


def test_a_captured_graph_replays_the_direct_calls():
    q, k, v, cu, max_seqlen = _inputs([400, 90, 700], seed=2)
    out = torch.empty_like(q)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up records the class outside the capture
        assert fa4_direct.forward(q, k, v, cu, max_seqlen, window=None, scale=0.125, out=out) is not None
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fa4_direct.forward(q, k, v, cu, max_seqlen, window=None, scale=0.125, out=out)
    q2, k2, v2, _, _ = _inputs([400, 90, 700], seed=3)
    for dst, src in ((q, q2), (k, k2), (v, v2)):
        dst.copy_(src)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, _public(q2, k2, v2, cu, max_seqlen, None, 0.125)[0])


def test_calls_it_does_not_serve_take_the_public_entry_point():
    q, k, v, cu, max_seqlen = _inputs([3] * (fa4_direct.MAX_BATCH + 1), seed=4)
    assert fa4_direct.forward(q, k, v, cu, max_seqlen, window=None, scale=0.125) is None
    assert "sequences" in fa4_direct.class_status(q, None, 0.125, max_seqlen, fa4_direct.MAX_BATCH + 1)
    out = flash.fa4_varlen_finite_v(q, k, v, cu, max_seqlen, window=None, scale=0.125)  # the public entry point
    assert torch.equal(out, _public(q, k, v, cu, max_seqlen, None, 0.125)[0])
    # operands the kernels would need copied: a view with a misaligned row stride
    wide = torch.randn(q.shape[0], 12, 65, device="cuda", dtype=q.dtype)[..., :64]
    assert not fa4_direct.aligned(wide)
    assert fa4_direct.forward(wide, k, v, cu, max_seqlen, window=None, scale=0.125) is None
