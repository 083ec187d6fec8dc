"""The lean call path on CUDA (model/plan.py, model/blocks.py, ops/weight_cast.py) against the per-op path
(``Rules(lean=False)``) and stock HF, ModernBERT-base geometry, random init: bf16 inference parity, unchecked Triton
launches taken with nothing recorded as a fallback, training gradients (fp32 masters under bf16 autocast) with
dropout and checkpointing, the cached weight casts never stale.

Run: ``python -m pytest -q tests/gpu/test_lean.py`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import packed_encoders as pe  # noqa: E402
from packed_encoders.batch import unpad  # noqa: E402
from packed_encoders.model import plan as plan_mod  # noqa: E402
from packed_encoders.model.forward import encoder_forward, plan_attention  # noqa: E402
from packed_encoders.model.params import ModernBertParams  # noqa: E402
from packed_encoders.ops.select import select_ops  # noqa: E402
from tests.helpers import measured_peak, set_checkpointing  # noqa: E402

DEV = torch.device("cuda")
LEAN, PER_OP = plan_mod.Rules(lean=True), plan_mod.Rules(lean=False)


def _model(dtype=torch.bfloat16, **overrides):
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    config = ModernBertConfig(**overrides)
    config._attn_implementation = "sdpa"
    m = ModernBertModel(config).to(DEV, dtype).eval()
    with torch.no_grad():  # LayerNorm weights of exactly 1 would hide weight bugs
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.add_(0.1 * torch.randn_like(mod.weight))
    return m


def _batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(5, 50000, (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for row, n in enumerate(lengths):
        if row % 2:
            mask[row, s - n:] = 1
        else:
            mask[row, :n] = 1
    return ids.to(DEV), mask.to(DEV)


def _packed(model, ids, mask):
    return unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                 vocab_size=model.config.vocab_size)


def _cos_rows(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


@pytest.mark.parametrize("lengths", [[12, 30, 7, 128, 64, 3, 90, 40], [925, 300, 1500, 2048, 640, 800, 1100, 77],
                                     [100] * 32, [12, 30, 7, 64, 3, 90, 40]])
def test_lean_inference_matches_per_op_and_stock(lengths):
    model = _model()
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = _batch(lengths)
    batch = _packed(model, ids, mask)
    ops, _ = select_ops("auto", DEV)
    from packed_encoders.ops import fused

    fused.reset_fallbacks()
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
        ref = ref.last_hidden_state[mask.bool()]
        attention = plan_attention(params, batch, "auto", grad=False, dtype=torch.bfloat16, dropout=False)
        lean = encoder_forward(model, params, batch, attention=attention, ops=ops, rules=LEAN)
        per_op = encoder_forward(model, params, batch, attention=attention, ops=ops, rules=PER_OP)
    plan = plan_mod.plan_for(params, ops, attention, tokens=batch.total_tokens, max_seqlen=batch.max_seqlen,
                             dtype=torch.bfloat16, device=batch.device, grad=False)
    assert plan.direct, plan.why_checked
    # eager calls of at most Rules.small_linear_max_tokens tokens run Triton GEMMs (host-bound), else cuBLAS; Wi + GLU
    # stays one Triton launch up to Rules.glu_eager_max_tokens
    rules = plan_mod.default_rules()
    small = batch.total_tokens <= rules.small_linear_max_tokens
    assert (plan.linear is fused.DIRECT_OPS.linear) == small
    assert (plan.glu == "small_gemm") == (batch.total_tokens <= rules.glu_eager_max_tokens), (plan.glu, lengths)
    assert fused.fallbacks() == {}
    cos = _cos_rows(lean, per_op)  # the per-op path may take quack's GLU epilogue eagerly (other rounding)
    assert cos.min() >= 0.995 and cos.mean() >= 0.9995, (float(cos.min()), float(cos.mean()))
    cos = _cos_rows(lean, ref)
    print(lengths[:3], {lp.backend for lp in plan.layers}, plan.glu, float(cos.min()), float(cos.mean()))
    assert cos.min() >= 0.995 and cos.mean() >= 0.999


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lean_training_gradients_vs_stock(checkpointing):
    """fp32 masters under bf16 autocast: the block path against stock HF (output-proximate parameters tightly,
    every parameter loosely) and against the per-op path."""
    model = _model(torch.float32).train()
    ids, mask = _batch([40, 300, 129, 7, 925])
    real = mask.bool()
    torch.manual_seed(1)
    target = torch.randn(*ids.shape, model.config.hidden_size, device=DEV)

    def grads(fn):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        ((out.float() - target)[real] ** 2).mean().backward()
        return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = grads(lambda: model(input_ids=ids, attention_mask=mask,
                              position_ids=(mask.cumsum(1) - 1).clamp(min=0)).last_hidden_state)
    if checkpointing:
        set_checkpointing(model, use_reentrant=False)
    pe.pack(model, validate=False)
    try:
        got = grads(lambda: model(input_ids=ids, attention_mask=mask).last_hidden_state)
    finally:
        pe.unpack(model)
        set_checkpointing(model, on=False)
    last = model.config.num_hidden_layers - 1
    worst = min((float(torch.nn.functional.cosine_similarity(got[n].flatten(), ref[n].flatten(), dim=0)), n)
                for n in ref)
    print("worst gradient cosine", worst)
    assert set(got) == set(ref)
    for name in [n for n in ref if n.startswith(f"layers.{last}.") or n.startswith("final_norm")]:
        cos = torch.nn.functional.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))
    assert worst[0] > 0.9, worst
    for n, g in got.items():
        assert g.dtype == torch.float32 and torch.isfinite(g).all(), n


def test_lean_training_matches_per_op_path_with_dropout():
    model = _model(torch.float32, embedding_dropout=0.1, mlp_dropout=0.1, attention_dropout=0.0).train()
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = _batch([64, 200, 31, 512])
    batch = _packed(model, ids, mask)
    ops, _ = select_ops("auto", DEV)

    def run(rules):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = encoder_forward(model, params, batch, ops=ops, rules=rules)
        out.float().square().mean().backward()
        return out.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    out_l, g_l = run(LEAN)
    out_p, g_p = run(PER_OP)
    assert _cos_rows(out_l, out_p).min() > 0.999
    for n in g_p:
        cos = torch.nn.functional.cosine_similarity(g_l[n].flatten(), g_p[n].flatten(), dim=0)
        assert cos > 0.99, (n, float(cos))


def test_autocast_inference_sees_weight_updates():
    """Cached bf16 casts of fp32 weights: an in-place change, a fused AdamW step and ``param.data = ...`` between
    two forwards all show in the second output."""
    model = _model(torch.float32)
    pe.pack(model, validate=False)
    ids, mask = _batch([50, 120, 9])

    def fwd():
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            return model(input_ids=ids, attention_mask=mask).last_hidden_state.float()

    a = fwd()
    torch.testing.assert_close(fwd(), a, atol=0, rtol=0)
    w = model.layers[5].mlp.Wi.weight
    with torch.no_grad():
        w.mul_(2.0)
    b = fwd()
    assert (b - a).abs().max() > 1e-2
    w.grad = torch.randn_like(w)
    torch.optim.AdamW([w], lr=1e-2, fused=True).step()
    c = fwd()
    assert (c - b).abs().max() > 1e-3
    model.layers[3].attn.Wqkv.weight.data = torch.randn_like(model.layers[3].attn.Wqkv.weight) * 0.02
    d = fwd()
    assert (d - c).abs().max() > 1e-2
    pe.unpack(model)


@pytest.mark.parametrize("window", [None, 64])
def test_varlen_direct_is_varlen_attn(window):
    """The plan's torch varlen entry calls the FlashAttention forward op itself (and, with gradients, aten's own
    autograd node): the same output as ``varlen_attn``, bit for bit, and the same q, k, v gradients up to the
    FlashAttention-2 backward's own run-to-run noise (it accumulates dq with atomic adds)."""
    from packed_encoders.attention import flash

    if flash.torch_varlen_status() is not None:
        pytest.skip(flash.torch_varlen_status())
    lengths = [925, 300, 1500, 77]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    qkv = torch.randn(sum(lengths), 3, 12, 64, generator=g, device=DEV, dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    with torch.no_grad():
        direct = flash.torch_varlen_direct(q, k, v, cu, max(lengths), window=window, scale=0.125)
        ref = flash.torch_varlen(q, k, v, cu, max(lengths), window=window, scale=0.125)
    assert torch.equal(direct, ref)
    dout = torch.randn_like(direct)
    grads = []
    for fn in (flash.torch_varlen_direct, flash.torch_varlen):
        leaf = qkv.clone().requires_grad_()
        out = fn(*leaf.unbind(1), cu, max(lengths), window=window, scale=0.125)
        out.backward(dout)
        grads.append((out.detach(), leaf.grad))
    (out_direct, g_direct), (_, g_ref) = grads
    assert torch.equal(out_direct, ref) and g_direct.abs().sum() > 0
    g_direct, g_ref = g_direct.float(), g_ref.float()
    for i in range(3):  # dq, dk, dv
        assert torch.nn.functional.cosine_similarity(g_direct[:, i].flatten(), g_ref[:, i].flatten(), dim=0) > 0.9999
    assert (g_direct - g_ref).abs().max() <= 1e-2 * g_ref.abs().max()


def _spy_pointer_runs(monkeypatch):
    """``(ran, tensor_path)``: the forward's raw-pointer runs recorded in ``ran`` (whether each ran, outside the
    first run's check, which runs the tensor path), and declined while ``tensor_path[0]`` is set."""
    from packed_encoders.model import forward as fwd
    from packed_encoders.model import pointers

    ran = []
    real = pointers.run
    tensor_path = [False]

    def spy(*args):
        if tensor_path[0]:
            return None
        checking = getattr(pointers._LOCAL, "declined", False)
        y = real(*args)
        if not checking:
            ran.append(y is not None)
        return y

    monkeypatch.setattr(fwd, "run_pointers", spy)
    return ran, tensor_path


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True, "mlp_bias": True, "norm_bias": True}])
def test_pointer_runs_are_the_tensor_path_bit_for_bit(overrides, monkeypatch):
    """Short calls whose plan is all Triton run as raw-pointer launches over a per-call workspace
    (model/pointers.py): the same kernels and launch shapes as the tensor path, so the same bits; the first call of a
    launch signature takes the tensor path (which binds it); a larger call, another stream and a weight changed in
    place are served correctly."""
    from packed_encoders.model import pointers

    model = _model(**overrides)
    params = ModernBertParams.from_hf_config(model.config)
    ops, _ = select_ops("auto", DEV)
    ran, tensor_path = _spy_pointer_runs(monkeypatch)
    from packed_encoders.attention import triton_short
    from packed_encoders.ops.triton import layer_norm, small_gemm

    for bound in (layer_norm._FWD_BOUND, small_gemm._BOUND, triton_short._BOUND):
        bound.clear()  # nothing bound yet: the first call takes the tensor path

    def both(lengths, seed=0):
        ids, mask = _batch(lengths, seed)
        batch = _packed(model, ids, mask)
        attention = plan_attention(params, batch, "triton", grad=False, dtype=torch.bfloat16, dropout=False)
        with torch.no_grad():
            got = encoder_forward(model, params, batch, attention=attention, ops=ops)
            tensor_path[0] = True
            ref = encoder_forward(model, params, batch, attention=attention, ops=ops)
            tensor_path[0] = False
        return got, ref

    # the last two twice each: the first call of a new launch shape binds it, the second runs on pointers
    for lengths, seed in (([12, 30, 7, 64], 0), ([12, 30, 7, 64], 1), ([3, 5], 2), ([100, 90, 60], 3),
                          ([300, 200, 150, 9], 6), ([300, 200, 150, 9], 7), ([1000, 900, 40], 8), ([1000, 900, 40], 9)):
        got, ref = both(lengths, seed)
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
    assert ran[0] is False and ran[1] is True and ran[5] is True and ran[7] is True, ran  # local layers too
    assert pointers.off_reason() is None  # every first run of a launch class matched the tensor path
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got, ref = both([12, 30, 7, 64], 4)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, ref, atol=0, rtol=0)
    before, _ = both([40, 20], 5)
    with torch.no_grad():
        model.layers[3].mlp.Wo.weight.mul_(1.5)
    after, ref = both([40, 20], 5)
    assert ran[-1] is True and not torch.equal(before, after)
    torch.testing.assert_close(after, ref, atol=0, rtol=0)


@pytest.mark.parametrize("backend,lengths,route,biases", [
    ("varlen", [600, 500, 40], "small_gemm", True),  # FlashAttention-2 on every layer (local ones windowed)
    ("auto", [600, 500, 40], "small_gemm", True),
    ("auto", [1500, 1200, 900, 800, 700, 33], "F.linear", True),  # past the Triton GEMM's size rule: cuBLAS
    ("auto", [1500, 1200, 900, 800, 700, 33], "F.linear", False),  # no biases: cuBLASLt on pointers
])
def test_pointer_runs_with_flash_attention_and_cublas_match_the_tensor_path(backend, lengths, route, biases,
                                                                           monkeypatch):
    """Documents-sized calls run on raw pointers too: the projections as cuBLAS calls on views of the workspace
    (with biases: the same bits as the tensor path) or, without biases, as cuBLASLt calls on pointers (its
    algorithm may sum in another order: every row's cosine >= 0.9999), global layers in FlashAttention-2 after the
    in-place RoPE kernel."""
    from packed_encoders.model import pointers
    from packed_encoders.ops import cublaslt

    model = _model(attention_bias=biases, mlp_bias=biases)
    params = ModernBertParams.from_hf_config(model.config)
    ops, _ = select_ops("auto", DEV)
    ran, tensor_path = _spy_pointer_runs(monkeypatch)
    lt_calls = []
    real_linear = cublaslt.linear
    monkeypatch.setattr(cublaslt, "linear", lambda *a: lt_calls.append(a) or real_linear(*a))
    ids, mask = _batch(lengths, 0)
    batch = _packed(model, ids, mask)
    attention = plan_attention(params, batch, backend, grad=False, dtype=torch.bfloat16, dropout=False)
    assert any(d.backend == "varlen" for d in attention.values())
    for seed in range(3):  # binds (tensor path), checked against the tensor path, then on pointers
        ids, mask = _batch(lengths, seed)
        batch = _packed(model, ids, mask)
        with torch.no_grad():
            got = encoder_forward(model, params, batch, attention=attention, ops=ops)
            plan = plan_mod.last_plan()
            tensor_path[0] = True
            ref = encoder_forward(model, params, batch, attention=attention, ops=ops)
            tensor_path[0] = False
        if biases or route != "F.linear":
            torch.testing.assert_close(got, ref, atol=0, rtol=0)
        else:
            cos = _cos_rows(got, ref)
            assert cos.min() >= 0.9999, float(cos.min())
    assert plan.pointers and plan.linear_route == route, plan
    assert ran[-1] is True, ran
    assert bool(lt_calls) == (not biases and route == "F.linear"), len(lt_calls)
    assert pointers.off_reason() is None


@pytest.mark.parametrize("backend", ["varlen", "fa4"])
def test_training_stack_matches_the_per_block_path(backend, monkeypatch):
    """One autograd node for every layer (model/stack.py and its raw-pointer form: torch varlen's and FA4's forward
    / backward kernels called directly) against one node per block: the same output, the same gradients, and no higher
    peak memory than the per-block path's plus the stack's call-wide backward transients (the stack frees each
    layer's activations as its backward passes; its raw-pointer buffers counted at their exact sizes, not
    model/workspace.py's size classes)."""
    from packed_encoders.attention import flash
    from packed_encoders.model import workspace
    from packed_encoders.ops import cublaslt

    monkeypatch.setattr(workspace, "size_class", lambda nbytes: nbytes)

    if backend == "fa4" and flash.fa4_status() is not None:
        pytest.skip(flash.fa4_status())
    model = _model(torch.float32).train()
    params = ModernBertParams.from_hf_config(model.config)
    ids, mask = _batch([40, 300, 129, 7, 925, 1500, 64, 512])
    batch = _packed(model, ids, mask)
    ops, _ = select_ops("auto", DEV)
    attention = plan_attention(params, batch, backend, grad=True, dtype=torch.bfloat16, dropout=False)

    def run(rules):
        model.zero_grad(set_to_none=True)
        with measured_peak(DEV) as peak:  # (beyond the other run's gradients, held by the test)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = encoder_forward(model, params, batch, attention=attention, ops=ops, rules=rules)
            plan = plan_mod.last_plan()
            out.float().square().mean().backward()
        return (out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, plan,
                peak())

    # once each first: a FlashAttention-4 class's first call records its kernels on synthetic inputs
    # (attention/fa4_direct.py), a one-time allocation that is not the path's own
    run(plan_mod.Rules(stack=False)), run(LEAN)
    out_b, g_b, plan_b, peak_b = run(plan_mod.Rules(stack=False))
    out_s, g_s, plan_s, peak_s = run(LEAN)
    assert plan_s.stack and not plan_b.stack and plan_s.kernels.name == "triton"
    assert torch.equal(out_s, out_b)
    assert set(g_s) == set(g_b) and len(g_s) == len(list(model.parameters()))
    worst = min((float(torch.nn.functional.cosine_similarity(g_s[n].flatten(), g_b[n].flatten(), dim=0)), n)
                for n in g_b)
    print(backend, "worst gradient cosine stack / blocks", worst, "peak MB", peak_s / 1e6, peak_b / 1e6)
    assert worst[0] > 0.99999, worst
    # steady state (both paths run once before): beyond the per-block path, the stack's backward holds its
    # call-wide transients from its start (model/stack_pointers.py): the scratch arena (the residual's gradient in
    # fp32 and the branch's in bf16, then the larger of the MLP's dg, dh, g and the attention's da, dqkv), the
    # attention's input gradients, the incoming branch gradient and cuBLASLt's workspace. On the H200: 61.1 MB
    # (FlashAttention-2) and 64.3 MB (FlashAttention-4) above the per-block path's 1,628 / 1,617 MB, against 73.6 MB
    # of transients for this batch
    h, inner = model.config.hidden_size, model.config.intermediate_size
    arena = 4 * h + 2 * h + 2 * max(max(inner, h) + 3 * inner, 4 * h)
    per_token = arena + 2 * 3 * h + 2 * h
    transients = batch.total_tokens * per_token + cublaslt.WORKSPACE_BYTES
    assert peak_s <= peak_b + transients + 2**20, (peak_s, peak_b, transients)
