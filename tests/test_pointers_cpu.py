"""The eager raw-pointer run's bookkeeping (model/pointers.py ``_enqueue``), on CPU with recording launchers that do
nothing: every launch gets integer pointers, each layer makes its launches once, the cuBLASLt projections read each
layer's own live weights (a module replaced after a call is read at the next), and the output is ``[T, H]``. The
maths is checked on the H200 against the tensor path (``tests/gpu/test_lean.py``)."""

from __future__ import annotations

import types
from collections import Counter

import torch
from torch import nn

import packed_encoders.model.pointers as pointers
from packed_encoders.model import workspace
from packed_encoders.model.params import ModernBertParams


def _aligned(t: torch.Tensor) -> nn.Parameter:
    """``t``'s values in a 256-byte aligned tensor (what the cuBLASLt route asks of its operands)."""
    buf = torch.empty(t.numel() + 256, dtype=t.dtype)
    at = (-buf.data_ptr() % 256) // t.element_size()
    return nn.Parameter(buf[at:at + t.numel()].view_as(t).copy_(t), requires_grad=False)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16)
    lin.weight = _aligned(lin.weight.data)
    return lin


def _model(layers: int):
    """A bf16 ModernBERT of ``layers`` layers (hidden 64, inner 96, 4 heads) whose projections are bias-free and
    256-byte aligned, and its params."""
    from transformers import ModernBertConfig, ModernBertModel

    cfg = ModernBertConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4,
                           vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                           sep_token_id=2)
    model = ModernBertModel(cfg).to(torch.bfloat16).eval()
    for layer in model.layers:
        for parent, name in ((layer.attn, "Wqkv"), (layer.attn, "Wo"), (layer.mlp, "Wi"), (layer.mlp, "Wo")):
            old = getattr(parent, name)
            setattr(parent, name, _linear(old.in_features, old.out_features))
    return model, ModernBertParams.from_hf_config(cfg)


def _record_launches(monkeypatch, calls: list) -> None:
    """Every launcher the run resolves (LayerNorms, ``Wi`` + GLU, Triton attention, RoPE, cuBLASLt) replaced by
    one that appends ``(name, args)`` to ``calls``, its arguments all integers or floats."""
    from packed_encoders.attention import triton_short
    from packed_encoders.ops import cublaslt
    from packed_encoders.ops.triton import layer_norm, small_gemm
    from packed_encoders.ops.triton import rope as rope_kernel

    def recorder(name):
        def launch(*args):
            assert all(type(a) in (int, float) for a in args), (name, args)
            calls.append((name, args))
        return launch

    monkeypatch.setattr(layer_norm, "forward_launcher",
                        lambda t, hidden, delta, *a: recorder("ln_res" if delta else "ln"))
    monkeypatch.setattr(small_gemm, "launcher", lambda *a: recorder("wi_glu"))
    monkeypatch.setattr(triton_short, "launcher", lambda *a: recorder("attention"))
    monkeypatch.setattr(rope_kernel, "forward_launcher", lambda *a: recorder("rope"))
    monkeypatch.setattr(cublaslt, "linear",
                        lambda t, n_out, k, dtype, device: types.SimpleNamespace(call=recorder(f"lt{n_out}x{k}")))


def _batch_and_tables(lengths=(10, 27)):
    """A CPU stand-in for a packed batch of ``lengths`` and its RoPE tables (both layer kinds)."""
    t = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    batch = types.SimpleNamespace(input_ids=torch.randint(3, 100, (t,)), total_tokens=t, num_seqs=len(lengths),
                                  cu_seqlens=cu, max_seqlen=max(lengths), device=torch.device("cpu"))
    table = {g: (torch.zeros(t, 8), torch.zeros(t, 8), torch.arange(t, dtype=torch.int32)) for g in (True, False)}
    return batch, table


def test_pointer_run_launches_read_each_layers_live_weights(monkeypatch):
    model, params = _model(4)
    h, inner, n = 64, 96, params.num_hidden_layers
    calls: list = []
    _record_launches(monkeypatch, calls)
    batch, table = _batch_and_tables()
    t = batch.total_tokens
    plan = types.SimpleNamespace(layers=tuple(types.SimpleNamespace(backend="triton", window=None if g else 64)
                                              for g in params.layer_is_global),
                                 linear_route="F.linear", glu="small_gemm")
    widths = pointers._widths(h, inner, False)

    def run():
        calls.clear()
        nbytes, offsets, lt_at = pointers._layout(t, widths, 2, True)
        ws, base = workspace.empty(nbytes, torch.device("cpu"))
        out = pointers._enqueue(model, params, batch, plan, lambda *a: table, ws, tuple(base + a for a in offsets),
                                widths, torch.bfloat16, 0, 0, base + lt_at)
        assert out is not None and out.shape == (t, h) and out.dtype is torch.bfloat16
        assert all(args[3] == base + lt_at for name, args in calls if name.startswith("lt"))  # its workspace
        assert all(base + a + t * w * 2 <= base + lt_at for a, w in zip(offsets, widths))  # past the buffers
        return [(name, args) for name, args in calls]

    made = run()
    counts = Counter(name for name, _ in made)
    assert counts == Counter({"ln": 1, "ln_res": 2 * n, "attention": n, "wi_glu": n, f"lt{3 * h}x{h}": n,
                              f"lt{h}x{h}": n, f"lt{h}x{inner}": n}), counts
    # each projection call's weight (its first argument) is that layer's, layer by layer
    qkv = [args[0] for name, args in made if name == f"lt{3 * h}x{h}"]
    assert qkv == [layer.attn.Wqkv.weight.data_ptr() for layer in model.layers]
    out_proj = [args[0] for name, args in made if name == f"lt{h}x{h}"]
    assert out_proj == [layer.attn.Wo.weight.data_ptr() for layer in model.layers]
    mlp_out = [args[0] for name, args in made if name == f"lt{h}x{inner}"]
    assert mlp_out == [layer.mlp.Wo.weight.data_ptr() for layer in model.layers]
    wi = [args[1] for name, args in made if name == "wi_glu"]
    assert wi == [layer.mlp.Wi.weight.data_ptr() for layer in model.layers]

    model.layers[2].attn.Wo = _linear(h, h)  # replaced after a call: the next call reads it
    again = [args[0] for name, args in run() if name == f"lt{h}x{h}"]
    assert again[2] == model.layers[2].attn.Wo.weight.data_ptr() != out_proj[2]


def test_flash_attention_layers_read_the_rotated_qkv_and_write_the_attention_buffer(monkeypatch):
    """Global layers on FlashAttention-4 (``fa4_direct`` writing into the workspace's attention buffer; where it does
    not serve, the backend's own function and its output tensor) and FlashAttention-2, after the in-place RoPE."""
    model, params = _model(9)
    h, inner = 64, 96
    calls: list = []
    _record_launches(monkeypatch, calls)
    served = iter([True, False])  # the two FlashAttention-4 layers: served directly, then not

    def fa4_forward(q, k, v, cu, max_seqlen, *, window, scale, out):
        calls.append(("fa4", (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), out.shape, out.stride())))
        return (out, None) if next(served) else None

    returned = []

    def own_attention(q, k, v, cu, max_seqlen, *, window, scale):
        calls.append(("own", (q.data_ptr(), k.data_ptr(), v.data_ptr())))
        returned.append(_aligned(torch.zeros(q.shape, dtype=q.dtype)).data)  # (aligned: the cuBLASLt route)
        return returned[-1]

    monkeypatch.setattr(pointers.fa4_direct, "forward", fa4_forward)
    batch, table = _batch_and_tables()
    t = batch.total_tokens
    backends = iter(["varlen", "fa4", "fa4"])  # the global layers 0, 3, 6
    layers = []
    for g in params.layer_is_global:
        backend = next(backends) if g else "triton"
        layers.append(types.SimpleNamespace(backend=backend, window=None if g else 64, attention=own_attention))
    plan = types.SimpleNamespace(layers=tuple(layers), linear_route="F.linear", glu="small_gemm")
    widths = pointers._widths(h, inner, False)
    nbytes, offsets, lt_at = pointers._layout(t, widths, 2, True)
    ws, base = workspace.empty(nbytes, torch.device("cpu"))
    at = tuple(base + a for a in offsets)
    out = pointers._enqueue(model, params, batch, plan, lambda *a: table, ws, at, widths, torch.bfloat16, 0, 0,
                            base + lt_at)
    assert out is not None and out.shape == (t, h)
    qkv, att = at[2], at[3]
    globals_ = [i for i, g in enumerate(params.layer_is_global) if g]
    assert [layers[i].backend for i in globals_] == ["varlen", "fa4", "fa4"]
    flash = [(name, args) for name, args in calls if name in ("fa4", "own")]
    # layer 0 (varlen): its own function; layer 3 (fa4): served into the attention buffer; layer 6 (fa4, not
    # served): the backend's own function
    assert [name for name, _ in flash] == ["own", "fa4", "fa4", "own"]
    for name, args in flash:
        assert args[:3] == (qkv, qkv + h * 2, qkv + 2 * h * 2)  # q, k, v: views of the rotated qkv buffer
    assert flash[1][1][3:] == (att, (t, 4, 16), (h, 16, 1))
    # the Wo projection reads what the attention wrote; one RoPE launch per global layer
    wo = [args[1] for name, args in calls if name == f"lt{h}x{h}"]
    assert [wo[i] for i in globals_] == [returned[0].data_ptr(), att, returned[1].data_ptr()]
    assert [name for name, _ in calls].count("rope") == len(globals_)


def test_launch_class_of_geometries_the_triton_attention_kernel_has_no_tiles_for():
    """The launch class names the Triton attention tiles only where that kernel exists for the head dim: head_dim 32
    (2 heads of 64) runs FlashAttention / varlen layers and used to raise ``ValueError`` from ``tile_config``."""
    from packed_encoders.attention import triton_short
    from transformers import ModernBertConfig

    batch, _ = _batch_and_tables()
    plan = types.SimpleNamespace(layers=(types.SimpleNamespace(backend="varlen"),) * 2, linear_route="F.linear",
                                 glu="small_gemm")
    keys = {}
    for heads in (2, 1):  # head_dim 32 (no tile table) and 64
        cfg = ModernBertConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=heads,
                               vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1,
                               sep_token_id=2)
        params = ModernBertParams.from_hf_config(cfg)
        keys[params.head_dim] = pointers._launch_class(params, batch, plan, torch.bfloat16, torch.device("cpu"))
    assert 32 not in triton_short.HEAD_DIMS and 64 in triton_short.HEAD_DIMS
    assert triton_short.tile_config(batch.max_seqlen, 64, False) in keys[64]
    assert keys[32] != keys[64] and hash(keys[32]) is not None
