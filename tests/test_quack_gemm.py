"""The quack GEMM route (``ops.quack_gemm``) on CPU, with the quack kernels replaced by exact torch maths.

What is checked here is the routing: which calls go to quack (size rule, graph capture, grad, switches,
forced mode), which are refused and recorded, and that the packed forward sends every projection through
the op set. The kernels themselves run on the GPU (``tests/gpu/test_quack_gemm.py``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from packed_encoders.ops import TORCH_OPS, quack_gemm
from packed_encoders.ops.geglu import geglu_torch
from packed_encoders.ops.rope import pair_freq_table, rope_linear_torch, rotate_pairs, to_pair_order

from tests.helpers import make_model, padded_batch


@pytest.fixture
def fake(monkeypatch):
    calls = {"linear": 0, "glu_linear": 0, "rope_linear": 0}

    def linear(x, w):
        calls["linear"] += 1
        return F.linear(x, w)

    def rope_linear(x, w, positions, freq, head_dim):
        calls["rope_linear"] += 1
        return rotate_pairs(to_pair_order(F.linear(x, w).float(), head_dim), positions, freq).to(x.dtype)

    def glu_linear(x, w, activation):
        calls["glu_linear"] += 1
        return geglu_torch(F.linear(x, w), activation)

    monkeypatch.setattr(quack_gemm, "_kernels", lambda: SimpleNamespace(linear=linear, glu_linear=glu_linear,
                                                                          rope_linear=rope_linear))
    monkeypatch.setattr(quack_gemm, "_on_one_cuda_device", lambda x, w: x.device == w.device)
    quack_gemm.reset_fallbacks()
    yield calls
    quack_gemm.reset_fallbacks()


def _glu_inputs(m, k=64, n=256, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, k, generator=g).to(dtype), (torch.randn(n, k, generator=g) * 0.1).to(dtype)


def test_glu_linear_takes_quack_from_the_threshold(fake):
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    assert ops.gemm == "quack" and TORCH_OPS.gemm == "torch"
    big = quack_gemm.GLU_MIN_TOKENS
    x, w = _glu_inputs(big)
    out = ops.glu_linear(x, w, None, "gelu")
    assert fake["glu_linear"] == 1
    torch.testing.assert_close(out, geglu_torch(F.linear(x, w), "gelu"))
    x, w = _glu_inputs(big - 1)
    out = ops.glu_linear(x, w, None, "silu")
    assert fake["glu_linear"] == 1  # below the threshold: the base op set's path
    torch.testing.assert_close(out, geglu_torch(F.linear(x, w), "silu"))
    assert quack_gemm.fallbacks() == {}  # the size rule is a choice, not a fallback


def test_glu_linear_modes_quack_does_not_serve(fake, monkeypatch):
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    x, w = _glu_inputs(quack_gemm.GLU_MIN_TOKENS)
    with torch.enable_grad():
        wg = w.clone().requires_grad_()
        out = ops.glu_linear(x, wg, None, "gelu")
        assert out.requires_grad  # F.linear + GLU, differentiable
    monkeypatch.setenv(quack_gemm.ENV, "off")  # read at pack() only: an op set built before keeps routing
    ops.glu_linear(x, w, None, "gelu")
    assert fake["glu_linear"] == 1 and quack_gemm.fallbacks() == {}


@pytest.mark.parametrize("case, reason", [
    ("bias", "bias"), ("fp32", "dtype torch.float32"), ("activation", "activation 'gelu_new'"),
    ("rows", "Wi rows"), ("stride", "strides"),
])
def test_glu_linear_refusals_are_recorded_and_correct(fake, case, reason):
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    m = quack_gemm.GLU_MIN_TOKENS
    x, w = _glu_inputs(m, dtype=torch.float32 if case == "fp32" else torch.bfloat16)
    bias, act = None, "gelu"
    if case == "bias":
        bias = torch.randn(w.shape[0]).to(w.dtype)
    if case == "activation":
        act = "gelu_new"
    if case == "rows":
        x, w = _glu_inputs(m, n=48)
    if case == "stride":
        x = torch.randn(m, 130).to(torch.bfloat16)[:, :64]  # rows 260 bytes apart
    if act == "gelu_new":
        with pytest.raises(Exception):  # the plain op does not know it either: nothing silently computed
            ops.glu_linear(x, w, bias, act)
    else:
        out = ops.glu_linear(x, w, bias, act)
        torch.testing.assert_close(out, geglu_torch(F.linear(x, w, bias), act))
    assert fake["glu_linear"] == 0
    recorded = quack_gemm.fallbacks()["glu_linear"]
    assert any(reason in why and why.startswith("cublas: ") for why in recorded), recorded


def test_linear_rule_per_shape_and_capture(fake, monkeypatch):
    monkeypatch.setitem(quack_gemm.LINEAR_MIN_TOKENS, (256, 64), (8, 16))
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    x, w = _glu_inputs(12)
    torch.testing.assert_close(ops.linear(x, w, None), F.linear(x, w))
    assert fake["linear"] == 0  # eager: 16 tokens needed
    monkeypatch.setattr(quack_gemm, "for_graph", lambda on_cuda: True)
    ops.linear(x, w, None)
    assert fake["linear"] == 1  # capturing a graph: only GPU time counts, 8 tokens suffice
    x2, w2 = _glu_inputs(4096, n=128)
    ops.linear(x2, w2, None)
    assert fake["linear"] == 1  # a shape not measured stays on cuBLAS
    with quack_gemm.forced():
        ops.linear(x2[:3], w[:, :64], None)
    assert fake["linear"] == 2  # forced: any size of a routed shape


def test_forward_routes_every_projection_and_matches(fake, monkeypatch):
    from packed_encoders.batch import unpad
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    model = make_model("base_like").to(torch.bfloat16)
    params = ModernBertParams.from_hf_config(model.config)
    h, i = params.hidden_size, params.intermediate_size
    for shape in ((3 * h, h), (h, h), (h, i)):
        monkeypatch.setitem(quack_gemm.LINEAR_MIN_TOKENS, shape, (1, 1))
    ids, mask = padded_batch([7, 3, 11])
    batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                  token_type_ids=None, vocab_size=model.config.vocab_size)
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    with torch.no_grad():
        want = encoder_forward(model, params, batch, ops=TORCH_OPS)
        with quack_gemm.forced():
            got = encoder_forward(model, params, batch, ops=ops)
    layers = params.num_hidden_layers
    # Wqkv: q, k through the RoPE epilogue, v through linear; then attn.Wo and mlp.Wo
    assert fake == {"linear": 3 * layers, "glu_linear": layers, "rope_linear": layers}
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.05)  # q, k rounded after rotating
    cos = F.cosine_similarity(got.float(), want.float(), dim=-1)
    assert cos.min() > 0.999
    with torch.enable_grad():
        encoder_forward(model, params, batch, ops=ops)
    assert fake == {"linear": 3 * layers, "glu_linear": layers, "rope_linear": layers}  # with grad: F.linear


def test_validation_checks_the_quack_route(fake, monkeypatch):
    import packed_encoders as pe
    from packed_encoders import configure

    model = make_model("base_like").to(torch.bfloat16)
    monkeypatch.setattr(configure, "select_ops",
                        lambda kernels, device, tuning: (quack_gemm.with_quack_gemms(TORCH_OPS), "test"))
    pe.pack(model)  # validate=True: the check batch is far below GLU_MIN_TOKENS, yet quack is what is checked
    assert fake["glu_linear"] >= model.config.num_hidden_layers
    entry = pe.describe(model)["encoders"][0]
    assert entry["gemm"] == "quack" and entry["validated"] is True
    seen = fake["glu_linear"]
    ids, mask = padded_batch([5, 9])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert fake["glu_linear"] == seen  # outside validation the size rule holds again
    pe.unpack(model)


def test_select_reports_the_gemm_route_on_cpu():
    from packed_encoders.ops.select import select_ops

    ops, reason = select_ops("torch", torch.device("cpu"))
    assert ops.gemm == "torch"
    assert quack_gemm.unavailable(torch.device("cpu")).startswith("quack GEMMs run on CUDA")


def test_switch_off_at_pack_skips_the_route_without_importing_quack(monkeypatch):
    def no_import():
        raise AssertionError("quack imported although the switch is off")

    monkeypatch.setattr(quack_gemm, "_kernels", no_import)
    assert quack_gemm.unavailable(torch.device("cuda"), enabled=False) == f"{quack_gemm.ENV} is off"
    from packed_encoders.ops.select import _with_gemms
    from packed_encoders.tuning import Tuning

    ops, reason = _with_gemms(TORCH_OPS, "base", torch.device("cuda"), Tuning(quack_gemm=False))
    assert ops is TORCH_OPS and reason == f"base; GEMMs: F.linear ({quack_gemm.ENV} is off)"


def test_quack_op_set_pickles_and_deep_copies(fake):
    import copy
    import pickle

    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    for clone in (pickle.loads(pickle.dumps(ops)), copy.deepcopy(ops)):
        assert clone.gemm == "quack"
        x, w = _glu_inputs(quack_gemm.GLU_MIN_TOKENS)
        torch.testing.assert_close(clone.glu_linear(x, w, None, "gelu"), geglu_torch(F.linear(x, w), "gelu"))
    assert fake["glu_linear"] == 2


def test_packed_model_with_the_quack_route_pickles(fake, monkeypatch):
    import pickle

    import packed_encoders as pe
    from packed_encoders import configure

    model = make_model("base_like").to(torch.bfloat16)
    monkeypatch.setattr(configure, "select_ops",
                        lambda kernels, device, tuning: (quack_gemm.with_quack_gemms(TORCH_OPS), "test"))
    pe.pack(model, validate=False)
    clone = pickle.loads(pickle.dumps(model))
    ids, mask = padded_batch([5, 9])
    with torch.no_grad():
        torch.testing.assert_close(clone(input_ids=ids, attention_mask=mask).last_hidden_state,
                                   model(input_ids=ids, attention_mask=mask).last_hidden_state)
    assert pe.describe(clone)["encoders"][0]["gemm"] == "quack"


def test_nothing_is_routed_or_guarded_under_torch_compile(fake, monkeypatch):
    """Tracing must not see the size rules (each threshold would be a guard, i.e. a recompile)."""
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    x, w = _glu_inputs(quack_gemm.GLU_MIN_TOKENS)
    monkeypatch.setitem(quack_gemm.LINEAR_MIN_TOKENS, (256, 64), (1, 1))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)

    def untouchable(*a, **k):
        raise AssertionError("size rule read while compiling")

    monkeypatch.setattr(quack_gemm, "_linear_min_tokens", untouchable)
    monkeypatch.setattr(quack_gemm, "_modes_ok", untouchable)
    torch.testing.assert_close(ops.linear(x, w, None), F.linear(x, w))
    torch.testing.assert_close(ops.glu_linear(x, w, None, "gelu"), geglu_torch(F.linear(x, w), "gelu"))
    assert fake == {"linear": 0, "glu_linear": 0, "rope_linear": 0}


def test_forced_is_per_thread(fake):
    import threading

    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    x, w = _glu_inputs(8)
    inside, leave = threading.Event(), threading.Event()

    def validating_thread():
        with quack_gemm.forced():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=validating_thread)
    t.start()
    inside.wait(10)
    try:
        ops.glu_linear(x, w, None, "gelu")  # another thread is inside forced(): this one keeps its size rule
    finally:
        leave.set()
        t.join()
    assert fake["glu_linear"] == 0
    with quack_gemm.forced():
        ops.glu_linear(x, w, None, "gelu")
    assert fake["glu_linear"] == 1


def test_forced_calls_do_not_record_refusals(fake):
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    x, w = _glu_inputs(8, dtype=torch.float32)
    with quack_gemm.forced():
        ops.glu_linear(x, w, None, "gelu")  # fp32: refused, but it never met the size rule
    assert quack_gemm.fallbacks() == {}


def _rope_inputs(m, heads=2, head_dim=64, k=64, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(3 * heads * head_dim, k, generator=g) * 0.1).to(dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = (torch.arange(m) % 37).float()
    return x, w, positions, pair_freq_table(inv, 2 * heads)


def test_rope_linear_size_rule_capture_and_result(fake, monkeypatch):
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    graph_min, eager_min = quack_gemm.ROPE_MIN_TOKENS
    x, w, pos, freq = _rope_inputs(graph_min)
    assert ops.rope_linear(x, w, None, pos, freq, 2, 64) is None  # eager: below the eager rule
    monkeypatch.setattr(quack_gemm, "for_graph", lambda on_cuda: True)
    q, k, v = ops.rope_linear(x, w, None, pos, freq, 2, 64)
    assert fake["rope_linear"] == 1
    want = rope_linear_torch(x, w, None, pos, freq, 2, 64)
    for got, ref in zip((q, k, v), want):
        torch.testing.assert_close(got, ref)
    with quack_gemm.forced():
        assert ops.rope_linear(x[:5], w, None, pos[:5], freq, 2, 64) is not None
    assert fake["rope_linear"] == 2
    with torch.enable_grad():
        wg = w.clone().requires_grad_()
        assert ops.rope_linear(x, wg, None, pos, freq, 2, 64) is None  # gradients: the separate path
    assert quack_gemm.fallbacks() == {}


@pytest.mark.parametrize("case, reason", [("bias", "bias"), ("head_dim", "head_dim 32"), ("fp32", "dtype"),
                                          ("rows", "Wqkv rows")])
def test_rope_linear_refusals_are_recorded(fake, monkeypatch, case, reason):
    ops = quack_gemm.with_quack_gemms(TORCH_OPS)
    monkeypatch.setattr(quack_gemm, "for_graph", lambda on_cuda: True)
    m = quack_gemm.ROPE_MIN_TOKENS[0]
    heads, hd = (4, 32) if case == "head_dim" else (2, 64)
    x, w, pos, freq = _rope_inputs(m, heads=heads, head_dim=hd, dtype=torch.float32 if case == "fp32" else
                                   torch.bfloat16)
    bias = torch.zeros(w.shape[0], dtype=w.dtype) if case == "bias" else None
    if case == "rows":
        w = w[:-64]
    assert ops.rope_linear(x, w, bias, pos, freq, heads, hd) is None
    assert fake["rope_linear"] == 0
    (why, count), = quack_gemm.fallbacks()["rope_linear"].items()
    assert reason in why and count == 1


def test_rope_and_small_glu_switches_are_build_arguments():
    """``PACKED_ENCODERS_QUACK_ROPE=0`` / ``_FUSED_GLU_GEMM=0`` (read at ``pack()``) build an op set without the
    RoPE epilogue / whose GLU route below quack's rule skips the base's small GEMM; nothing reads them per call."""
    from dataclasses import replace

    def no_small_gemm(*a):
        raise AssertionError("the small GLU GEMM ran although switched off")

    base = replace(TORCH_OPS, glu_linear=no_small_gemm)
    assert quack_gemm.with_quack_gemms(base).rope_linear is not None
    ops = quack_gemm.with_quack_gemms(base, rope=False, small_glu=False)
    assert ops.rope_linear is None and ops.gemm == "quack"
    x, w = _glu_inputs(8)
    torch.testing.assert_close(ops.glu_linear(x, w, None, "gelu"), geglu_torch(F.linear(x, w), "gelu"))
    with pytest.raises(AssertionError, match="small GLU GEMM"):
        quack_gemm.with_quack_gemms(base).glu_linear(x, w, None, "gelu")
