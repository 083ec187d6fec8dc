"""The raw-pointer training stack's bookkeeping (model/stack_pointers.py), on CPU with recording launchers that do
nothing: every launch gets integer pointers, each layer makes the launches of its forward and backward once (the
first layer without ``attn_norm``), every parameter of the layers gets a gradient of its shape, and the node's
outputs have the dtypes of the residual stream and the compute dtype. The maths is checked on the H200
(``tests/gpu/test_stack_pointers.py``)."""

from __future__ import annotations

import types
from collections import Counter

import pytest
import torch

import packed_encoders.model.stack_pointers as sp
from packed_encoders.model.blocks import PROJECTION_SLOTS, SLOTS_PER_LAYER, layer_args
from packed_encoders.model.params import ModernBertParams


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_pointer_stack_launches_and_gradients(monkeypatch, x_dtype):
    from transformers import ModernBertConfig, ModernBertModel

    cfg = ModernBertConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                           vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                           sep_token_id=2)
    model = ModernBertModel(cfg).train()
    params = ModernBertParams.from_hf_config(cfg)
    t, h = 37, 64
    calls, last_args = [], {}

    def recorder(name):
        def launch(*args):
            assert all(type(a) in (int, float) for a in args), (name, args)
            calls.append(name)
            last_args[name] = args
        return launch

    two = x_dtype is torch.float32
    launch = types.SimpleNamespace(
        ln0=recorder("ln0"), ln_res=recorder("ln_res"), rope=recorder("rope"), glu=recorder("glu"),
        glu_bwd=recorder("glu_bwd"), rope_bwd=recorder("rope_bwd"), ln_bwd=recorder("ln_bwd"), programs=5,
        fwd=tuple(recorder(f"fwd{i}") for i in range(4)), dx=tuple(recorder(f"dx{i}") for i in range(4)),
        weight_grad=lambda n, k, dtype: recorder("dw"), two=two, stream=0, device=0)

    served = []

    def attention_forward(name, serve=lambda window: True):
        def forward(q, k, v, cu, max_seqlen, *, window, scale, **buffers):
            # q, k, v: views of the qkv buffer the projection wrote (Wqkv's launch: call(w, y, qkv, workspace, stream))
            qkv_p = last_args["fwd0"][2]
            assert [u.data_ptr() for u in (q, k, v)] == [qkv_p + j * h * q.element_size() for j in range(3)]
            assert q.stride() == (3 * h, h // 4, 1) and q.shape == (t, 4, h // 4)
            # FlashAttention-4 writes its output and log-sum-exp into the layer's buffer, after qkv
            assert sorted(buffers) == (["lse", "out"] if name == "fa4" else [])
            if not serve(window):
                return None
            served.append((name, window))
            if name == "fa2":
                return torch.zeros(q.shape, dtype=q.dtype), (name, q)
            out, lse = buffers["out"], buffers["lse"]
            assert out.shape == q.shape and out.is_contiguous() and out.dtype == q.dtype
            assert lse.shape == (4, t) and lse.is_contiguous() and lse.dtype == torch.float32
            assert out.data_ptr() >= qkv_p + 3 * h * t * q.element_size() and lse.data_ptr() >= out.data_ptr() + out.nbytes
            assert out.untyped_storage().data_ptr() == q.untyped_storage().data_ptr()  # (one buffer per layer)
            out.zero_()
            return out, (name, q)
        return forward

    fa4_buffers = []

    def attention_backward(name):
        def backward(da, saved, *buffers):
            assert saved[0] == name  # each layer's backward is its forward's backend's
            calls.append(name + "_bwd")
            if name == "fa2":
                assert not buffers
                return tuple(torch.zeros(saved[1].shape, dtype=saved[1].dtype) for _ in range(3))
            grads, scratch = buffers  # FlashAttention-4's: one set of gradients and scratch for every layer
            assert isinstance(scratch, dict) and all(g.shape == saved[1].shape and g.is_contiguous() for g in grads)
            fa4_buffers.append((tuple(g.data_ptr() for g in grads), id(scratch)))
            for g in grads:
                g.zero_()
            return grads
        return backward

    # FlashAttention-4 on the local layers, its direct calls serving window 64 only: the global fa4 layer (index
    # 3) falls back to FlashAttention-2
    monkeypatch.setattr(sp, "torch_varlen_forward_saving", attention_forward("fa2"))
    monkeypatch.setattr(sp, "torch_varlen_backward", attention_backward("fa2"))
    monkeypatch.setattr(sp, "fa4_forward_saving", attention_forward("fa4", serve=lambda window: window is not None))
    monkeypatch.setattr(sp, "fa4_backward", attention_backward("fa4"))
    monkeypatch.setattr(sp, "_launchers_here", lambda call: call.launch)
    layers = [types.SimpleNamespace(window=None if i % 3 == 0 else 64, backend="fa4" if i else "varlen")
              for i in range(4)]
    plan = types.SimpleNamespace(layers=layers, kernels=types.SimpleNamespace(name="triton"))
    cdt = torch.bfloat16
    args = tuple(layer_args(layer, params, plan.kernels, cdt) for layer in model.layers)
    slots = [w for a, _, b, _ in args for w in (*a, *b)]
    present = tuple(i for i, w in enumerate(slots) if w is not None)
    compute = [slots[i].detach().to(cdt) if slots[i] is not None and i % SLOTS_PER_LAYER in PROJECTION_SLOTS
               else None for i in range(len(slots))]
    call = sp.PointerCall()
    call.params, call.plan, call.args, call.has_b, call.tensor_tables = params, plan, args, False, {}
    call.batch = types.SimpleNamespace(cu_seqlens=torch.tensor([0, 10, t], dtype=torch.int32), max_seqlen=27)
    call.tables = {True: (1, 2, 3), False: (4, 5, 6)}
    call.present, call.compute, call.cdt, call.res_dt, call.launch, call.launch_args = (
        present, compute, cdt, x_dtype, launch, ())
    x = torch.randn(t, h, dtype=x_dtype, requires_grad=True)
    out, pending = sp.PointerStack.apply(x, call, *(slots[i] for i in present))
    assert (out.dtype, pending.dtype, out.shape, pending.shape) == (x_dtype, cdt, (t, h), (t, h))
    forward = Counter(calls)
    n = params.num_hidden_layers
    assert forward == Counter({"ln_res": 2 * n - 1, "rope": n, "glu": n, **{f"fwd{i}": n for i in range(4)}})
    assert served == [("fa2", None), ("fa4", 64), ("fa4", 64), ("fa2", None)]
    calls.clear()
    (out.float().sum() + pending.float().sum()).backward()
    assert Counter(calls) == Counter({"ln_bwd": 2 * n - 1, "glu_bwd": n, "rope_bwd": n, "dw": 4 * n,
                                      "fa4_bwd": 2, "fa2_bwd": 2, **{f"dx{i}": n for i in range(4)}})
    assert x.grad is not None and x.grad.shape == x.shape
    for name, p in model.layers.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
    assert len(fa4_buffers) == 2 and fa4_buffers[0] == fa4_buffers[1]
    # each layer's four projection gradients (fp32 masters): views of one buffer, 256 bytes apart at least (CUDA's
    # allocator aligns the buffer itself)
    storages = []
    for layer in model.layers:
        grads = [m.weight.grad for m in (layer.attn.Wqkv, layer.attn.Wo, layer.mlp.Wi, layer.mlp.Wo)]
        assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
        assert all(g.is_contiguous() and not (g.data_ptr() - g.untyped_storage().data_ptr()) % 256 for g in grads)
        assert len({g.data_ptr() for g in grads}) == 4
        storages.append(grads[0].untyped_storage().data_ptr())
    assert len(set(storages)) == len(storages)


def test_weight_gradients_share_a_buffer_only_within_one_dtype():
    shapes = ((8, 12), (24, 8), (8, 8), (24, 8))
    f32 = [torch.zeros(s) for s in shapes]
    got = sp._weight_grads(f32, (True, False, True, True), shapes, "cpu")
    assert got[1] is None and [g.shape for g in (got[0], got[2], got[3])] == [shapes[0], shapes[2], shapes[3]]
    base = got[0].untyped_storage().data_ptr()
    assert {g.untyped_storage().data_ptr() for g in (got[0], got[2], got[3])} == {base}
    ends = sorted((g.data_ptr(), g.data_ptr() + g.nbytes) for g in (got[0], got[2], got[3]))
    assert all(a[1] <= b[0] and not (b[0] - base) % 256 for a, b in zip(ends, ends[1:]))  # apart, aligned
    mixed = [f32[0], f32[1].to(torch.bfloat16), f32[2], f32[3].to(torch.float64)]
    got = sp._weight_grads(mixed, (True, True, True, True), shapes, "cpu")
    assert [g.dtype for g in got] == [torch.float32, torch.bfloat16, torch.float32, torch.float32]  # fp64: fp32
    assert len({g.untyped_storage().data_ptr() for g in got}) == 4  # one tensor each
    assert sp._weight_grads(f32, (False,) * 4, shapes, "cpu") == [None] * 4
