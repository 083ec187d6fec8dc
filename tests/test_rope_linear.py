"""RoPE applied on the way out of the q, k projection, in pair order (``ops.rope`` + ``OpSet.rope_linear``), on CPU.

The GEMM epilogue (``ops.cute.gemm.rope_linear``) runs on the GPU (``tests/gpu/test_quack_gemm.py``); here: the
fp32 specification against HF's rotation, the plain-PyTorch op against the specification, the claim the design
rests on (a common permutation of q's and k's head dims leaves attention unchanged), and the packed forward with
the op against stock HF.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from packed_encoders.ops import (TORCH_OPS, pair_freq_table, pair_order, rope_linear_ref, rope_linear_torch,
                                 rope_qkv_ref, rotate_pairs, to_pair_order)

from tests.helpers import assert_close_real, make_model, padded_batch, stock, stock_positions


def _inv_freq(theta=10000.0, head_dim=64):
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def test_pair_order_puts_each_rotation_pair_side_by_side():
    order = pair_order(8)
    assert order.tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert sorted(pair_order(64).tolist()) == list(range(64))
    y = torch.arange(2 * 64).float().view(1, -1)
    paired = to_pair_order(y, 64).view(2, 32, 2)
    torch.testing.assert_close(paired[..., 1] - paired[..., 0], torch.full((2, 32), 32.0))


def test_freq_table_is_a_float_float_split_of_turns():
    inv = _inv_freq(160000.0)
    table = pair_freq_table(inv, 3)
    assert table.shape == (3 * 64,) and table.dtype == torch.float32
    pairs = table.view(3, 32, 2).double()
    want = inv.double() / (2 * math.pi)
    err = (pairs.sum(-1) - want).abs() / want
    assert err.max() < 1e-14  # hi alone would leave ~3e-8
    assert (pairs[..., 1].abs() <= pairs[..., 0].abs() * 2.0 ** -23).all()
    torch.testing.assert_close(pairs[0], pairs[2])


@pytest.mark.parametrize("theta", [10000.0, 160000.0])
def test_reference_is_hf_rotation_in_pair_order(theta):
    g = torch.Generator().manual_seed(0)
    heads, hd, k = 2, 64, 48
    x = torch.randn(37, k, generator=g)
    w = torch.randn(3 * heads * hd, k, generator=g) * 0.2
    positions = torch.randint(0, 3000, (37,), generator=g)
    inv = _inv_freq(theta)
    freqs = torch.arange(4096).double()[:, None] * inv.double()[None, :]
    q, kk, v = rope_qkv_ref(x.double() @ w.double().t(), freqs.cos(), freqs.sin(), positions, heads, hd)
    got = rope_linear_ref(x, w[:2 * heads * hd], positions.float(), inv, hd).view(37, 2, heads, hd)
    order = pair_order(hd)
    torch.testing.assert_close(got[:, 0], q[..., order].float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[:, 1], kk[..., order].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_torch_op_matches_reference(dtype, tol):
    g = torch.Generator().manual_seed(1)
    heads, hd, k, t = 3, 64, 32, 50
    x = torch.randn(t, k, generator=g)
    w = torch.randn(3 * heads * hd, k, generator=g) * 0.2
    positions = torch.randint(0, 20000, (t,), generator=g).float()  # far positions: the angle stays exact
    inv = _inv_freq(160000.0)
    q, kk, v = rope_linear_torch(x.to(dtype), w.to(dtype), None, positions, pair_freq_table(inv, 2 * heads), heads,
                                 hd)
    assert q.dtype == kk.dtype == v.dtype == dtype and q.shape == (t, heads, hd)
    ref = rope_linear_ref(x.to(dtype).float(), w[:2 * heads * hd].to(dtype).float(), positions, inv, hd)
    scale = ref.abs().max()
    assert ((torch.cat((q, kk), 1).reshape(t, -1).float() - ref).abs().max() / scale) < tol
    torch.testing.assert_close(v.float(), (x.to(dtype) @ w[2 * heads * hd:].to(dtype).t()).view(t, heads, hd).float())


def test_rotate_pairs_keeps_position_zero_and_lengths():
    y = torch.randn(4, 128)
    freq = pair_freq_table(_inv_freq(), 2)
    torch.testing.assert_close(rotate_pairs(y, torch.zeros(4), freq), y)
    out = rotate_pairs(y, torch.tensor([1.0, 7.0, 300.0, 9000.0]), freq)
    torch.testing.assert_close(out.view(4, -1, 2).norm(dim=-1), y.view(4, -1, 2).norm(dim=-1))


def test_common_head_dim_permutation_leaves_attention_unchanged():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 17, 64, generator=g) for _ in range(3))
    order = pair_order(64)
    want = F.scaled_dot_product_attention(q, k, v)
    got = F.scaled_dot_product_attention(q[..., order], k[..., order], v)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def _rope_ops():
    calls = []

    def rope_linear(*args):
        calls.append(args[0].shape[0])
        return rope_linear_torch(*args)

    return replace(TORCH_OPS, rope_linear=rope_linear), calls


@pytest.mark.parametrize("name", ["base_like", "large_like", "odd"])
def test_packed_forward_with_pair_rope_matches_stock(name):
    from packed_encoders.batch import unpad
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    model = make_model(name)
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = padded_batch([9, 30, 4], side="mixed")
    with torch.no_grad():
        ref = stock(model, input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask)).last_hidden_state
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)
    ops, calls = _rope_ops()
    with torch.no_grad():
        got = encoder_forward(model, params, batch, ops=ops)
        plain = encoder_forward(model, params, batch, ops=TORCH_OPS)
    assert calls == [batch.total_tokens] * params.num_hidden_layers  # every layer took the op
    torch.testing.assert_close(got, plain, atol=2e-5, rtol=2e-5)
    assert_close_real(batch.pad(got), ref, mask, atol=1e-4, rtol=1e-4)
    with torch.enable_grad():
        encoder_forward(model, params, batch, ops=ops)
    assert len(calls) == params.num_hidden_layers  # with gradients the op is not called


def test_rope_scaling_keeps_the_separate_rotation(monkeypatch):
    """A RoPE that scales cos / sin (attention_scaling != 1) is not modelled by the pair rotation: not called."""
    from packed_encoders.batch import unpad
    from packed_encoders.model import forward as fwd
    from packed_encoders.model.params import ModernBertParams

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    real = fwd.live_inv_freq
    monkeypatch.setattr(fwd, "live_inv_freq", lambda m, g, p: (real(m, g, p)[0], 1.5))
    ids, mask = padded_batch([5, 8])
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)
    ops, calls = _rope_ops()
    with torch.no_grad():
        fwd.encoder_forward(model, params, batch, ops=ops)
    assert calls == []


def test_pair_table_cache_follows_the_live_buffer():
    from packed_encoders.ops.rope import cached_pair_freq_table

    inv = _inv_freq()
    first = cached_pair_freq_table(inv, 4, "cpu")
    assert cached_pair_freq_table(inv, 4, "cpu") is first  # a graph replay reads this table, rebuilt never
    torch.testing.assert_close(first, pair_freq_table(inv, 4))
    import gc
    import weakref

    old = weakref.ref(first)
    inv.mul_(0.5)  # an in-place edit bumps the version: rebuilt
    second = cached_pair_freq_table(inv, 4, "cpu")
    assert second is not first
    torch.testing.assert_close(second, pair_freq_table(inv, 4))
    del first
    gc.collect()
    assert old() is not None  # a graph captured with the old table may still read it: kept while inv lives
    inv.data = inv.data * 0.5  # a .data swap: a new address, no version bump (the graphs' fingerprint drops them)
    swapped = cached_pair_freq_table(inv, 4, "cpu")
    assert swapped is not second
    torch.testing.assert_close(swapped, pair_freq_table(inv, 4))
    second = swapped
    other = inv.clone()
    assert cached_pair_freq_table(other, 4, "cpu") is not second
    by_theta = cached_pair_freq_table(("theta", 10000.0, 64), 4, "cpu")
    assert cached_pair_freq_table(("theta", 10000.0, 64), 4, "cpu") is by_theta
    torch.testing.assert_close(by_theta, pair_freq_table(_inv_freq(), 4))


def test_a_forward_whose_projections_all_rotate_builds_no_cos_sin(monkeypatch):
    from packed_encoders.batch import unpad
    from packed_encoders.model import forward as fwd
    from packed_encoders.model.params import ModernBertParams

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = padded_batch([5, 8])
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                  vocab_size=model.config.vocab_size)

    def unused(*a, **k):
        raise AssertionError("cos / sin built although every layer rotates in its projection")

    monkeypatch.setattr(fwd, "rope_inputs", unused)
    ops, calls = _rope_ops()
    with torch.no_grad():
        fwd.encoder_forward(model, params, batch, ops=ops)
    assert len(calls) == params.num_hidden_layers


def test_inference_tensor_buffers_are_not_cached():
    """Inference tensors have no version counter: the table is built per call (and nothing raises)."""
    from packed_encoders.ops.rope import cached_pair_freq_table

    with torch.inference_mode():
        inv = _inv_freq()
    a = cached_pair_freq_table(inv, 2, "cpu")
    b = cached_pair_freq_table(inv, 2, "cpu")
    assert a is not b
    torch.testing.assert_close(a, b)


def test_forward_of_a_model_moved_under_inference_mode():
    from packed_encoders.batch import unpad
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    model = make_model("base_like")
    with torch.inference_mode():
        model.half().float()  # buffers become inference tensors
        params = ModernBertParams.from_hf_config(model.config)
        ids, mask = padded_batch([5, 8])
        batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                      token_type_ids=None, vocab_size=model.config.vocab_size)
        ops, calls = _rope_ops()
        got = encoder_forward(model, params, batch, ops=ops)
        want = encoder_forward(model, params, batch, ops=TORCH_OPS)
    assert len(calls) == params.num_hidden_layers
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
