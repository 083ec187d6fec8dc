"""The training stack on raw pointers (model/stack_pointers.py, ops/cublaslt.py) against its tensor form
(model/stack.py's EncoderStack) and stock HF, ModernBERT-base geometry, random init: cuBLASLt's three products
against ``torch.mm`` at many token counts (algorithms reused across a power-of-two class), outputs and every
parameter's gradient against the tensor form (fp32 masters under bf16 autocast, and a bf16 model), no higher peak
memory, ``retain_graph``, and in-place weight changes between forward and backward refused.

Run: ``python -m pytest -q tests/gpu/test_stack_pointers.py`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from packed_encoders.batch import unpad  # noqa: E402
from packed_encoders.model import plan as plan_mod  # noqa: E402
from packed_encoders.model import stack as stack_mod  # noqa: E402
from packed_encoders.model.forward import encoder_forward, plan_attention  # noqa: E402
from packed_encoders.model.params import ModernBertParams  # noqa: E402
from packed_encoders.ops import cublaslt  # noqa: E402
from packed_encoders.ops.select import select_ops  # noqa: E402
from tests.helpers import measured_peak  # noqa: E402

DEV = torch.device("cuda")


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.float16, torch.float32)])
def test_cublaslt_products_match_torch_mm(dtype, out_dtype):
    assert cublaslt.status() is None, cublaslt.status()
    torch.manual_seed(0)
    ws = torch.empty(cublaslt.WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    for n, k in ((2304, 768), (768, 1152), (2304, 1024)):
        w = torch.randn(n, k, device=DEV, dtype=dtype) * 0.05
        for t in (1, 7, 96, 200, 255, 256, 257, 1000, 4095, 7424, 15001):  # several per power-of-two class
            x = torch.randn(t, k, device=DEV, dtype=dtype)
            dy = torch.randn(t, n, device=DEV, dtype=dtype)
            y = torch.empty(t, n, device=DEV, dtype=dtype)
            dx = torch.empty(t, k, device=DEV, dtype=dtype)
            dw = torch.empty(n, k, device=DEV, dtype=out_dtype)
            cublaslt.linear(t, n, k, dtype, 0).call(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), stream)
            cublaslt.input_grad(t, n, k, dtype, 0).call(w.data_ptr(), dy.data_ptr(), dx.data_ptr(), ws.data_ptr(),
                                                        stream)
            cublaslt.weight_grad(t, n, k, dtype, out_dtype, 0).call(x.data_ptr(), dy.data_ptr(), dw.data_ptr(),
                                                                    ws.data_ptr(), stream)
            ref_w = dy.t().float() @ x.float()
            for got, ref, what in ((y, x.float() @ w.float().t(), "y"), (dx, dy.float() @ w.float(), "dx"),
                                   (dw, ref_w, "dw")):
                err = float((got.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))
                assert err < (2e-2 if got.dtype != torch.float32 else 1e-4), (n, k, t, what, err)


def test_cublaslt_calls_outlive_the_shape_cache_and_interleave_token_counts():
    """Calls of one token-count class share their descriptors (ops/cublaslt.py): two calls made for different
    counts, called alternately, each compute their own product; a call keeps its descriptors after the shape cache
    drops them (it is cleared past 1,024 shapes), and the cache rebuilds them."""
    import gc

    assert cublaslt.status() is None, cublaslt.status()
    torch.manual_seed(0)
    ws = torch.empty(cublaslt.WORKSPACE_BYTES, dtype=torch.uint8, device=DEV)
    stream = torch.cuda.current_stream().cuda_stream
    n, k = 768, 1152
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16) * 0.05
    counts = (300, 511, 257, 300)  # one class (257..512), the first count again last
    calls = [cublaslt.linear(t, n, k, torch.bfloat16, 0).call for t in counts]
    xs = [torch.randn(t, k, device=DEV, dtype=torch.bfloat16) for t in counts]
    cublaslt._SHAPES.clear()
    gc.collect()
    outs = [torch.full((t, n), float("nan"), device=DEV, dtype=torch.bfloat16) for t in counts]
    for _ in range(2):
        for call, x, y in zip(calls, xs, outs):
            call(w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), stream)
    again = torch.empty_like(outs[0])
    cublaslt.linear(counts[0], n, k, torch.bfloat16, 0).call(w.data_ptr(), xs[0].data_ptr(), again.data_ptr(),
                                                             ws.data_ptr(), stream)
    for got, x in zip(outs + [again], xs + [xs[0]]):
        ref = x.float() @ w.float().t()
        assert float((got.float() - ref).abs().max() / ref.abs().max()) < 2e-2


def _model(dtype):
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    config = ModernBertConfig()
    config._attn_implementation = "sdpa"
    m = ModernBertModel(config).to(DEV, dtype).train()
    with torch.no_grad():  # LayerNorm weights of exactly 1 would hide weight bugs
        for mod in m.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.add_(0.1 * torch.randn_like(mod.weight))
    return m


def _packed(model, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(5, 50000, (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return unpad(input_ids=ids.to(DEV), inputs_embeds=None, attention_mask=mask.to(DEV), position_ids=None,
                 token_type_ids=None, vocab_size=model.config.vocab_size)


def _run(model, batch, autocast: bool, tensor_form: bool, monkeypatch, retain=False):
    params = ModernBertParams.from_hf_config(model.config)
    ops, _ = select_ops("auto", DEV)
    attention = plan_attention(params, batch, "varlen", grad=True, dtype=torch.bfloat16, dropout=False)
    with monkeypatch.context() as m:
        if tensor_form:
            m.setattr(stack_mod, "prepare", lambda *a: "the test asks for the tensor form")
        model.zero_grad(set_to_none=True)
        with measured_peak(DEV) as peak:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = encoder_forward(model, params, batch, attention=attention, ops=ops, rules=plan_mod.Rules())
            off = stack_mod.last_pointers_off()
            loss = out.float().square().mean()
            loss.backward(retain_graph=retain)
            if retain:
                loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, off, peak()


def _worst(ref, got):
    assert set(ref) == set(got)
    return min((float(torch.nn.functional.cosine_similarity(got[n].float().flatten(), ref[n].float().flatten(),
                                                             dim=0)), n) for n in ref)


@pytest.mark.parametrize("dtype,autocast", [(torch.float32, True), (torch.bfloat16, False)])
@pytest.mark.parametrize("lengths", [[12, 30, 7, 64, 3, 90, 40, 20, 9, 17, 25, 33, 11, 5, 60, 14],
                                     [40, 300, 129, 7, 925, 1500, 64, 512]])
def test_pointer_stack_matches_the_tensor_form(dtype, autocast, lengths, monkeypatch):
    from packed_encoders.model import workspace

    # peak memory is compared as the buffers' exact sizes: their size classes (up to 25 % more, so that steps of
    # varying token counts reuse cached blocks) are checked in tests/test_plan.py
    monkeypatch.setattr(workspace, "size_class", lambda nbytes: nbytes)
    model = _model(dtype)
    batch = _packed(model, lengths)
    out_t, g_t, off_t, peak_t = _run(model, batch, autocast, True, monkeypatch)  # (binds the kernels' signatures)
    out_p, g_p, off_p, peak_p = _run(model, batch, autocast, False, monkeypatch)
    assert off_t == "the test asks for the tensor form" and off_p is None, off_p
    cos = torch.nn.functional.cosine_similarity(out_p.float(), out_t.float(), dim=-1)
    assert float(cos.min()) > 0.9999, float(cos.min())
    assert len(g_p) == len(list(model.parameters()))
    worst = _worst(g_t, g_p)
    print(dtype, autocast, len(lengths), "worst gradient cosine pointers / tensor form", worst, "peak MB",
          peak_p / 2**20, peak_t / 2**20)
    assert worst[0] > 0.9999, worst
    assert peak_p <= peak_t * 1.03 + 2 * cublaslt.WORKSPACE_BYTES, (peak_p, peak_t)


def test_pointer_stack_retain_graph_and_in_place_weights(monkeypatch):
    model = _model(torch.float32)
    batch = _packed(model, [50, 200, 17, 333])
    _run(model, batch, True, True, monkeypatch)  # binds
    _, g_once, off, _ = _run(model, batch, True, False, monkeypatch)
    assert off is None
    _, g_twice, off, _ = _run(model, batch, True, False, monkeypatch, retain=True)
    assert off is None
    worst = min(float(torch.nn.functional.cosine_similarity(g_twice[n].flatten(), 2 * g_once[n].flatten(), dim=0))
                for n in g_once)
    assert worst > 0.9999, worst
    params = ModernBertParams.from_hf_config(model.config)
    ops, _ = select_ops("auto", DEV)
    attention = plan_attention(params, batch, "varlen", grad=True, dtype=torch.bfloat16, dropout=False)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = encoder_forward(model, params, batch, attention=attention, ops=ops, rules=plan_mod.Rules())
    assert stack_mod.last_pointers_off() is None
    with torch.no_grad():
        model.layers[3].mlp_norm.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.float().sum().backward()
