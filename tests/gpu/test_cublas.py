"""Direct cuBLAS GEMMs (ops/cublas.py) on CUDA: the call torch.mm makes, bit for bit, for the shapes and dtypes the
training blocks use; the cases it leaves to torch; and a training step with the direct calls on and off: the same output
bits, the same gradients up to the attention backward's run-to-run noise.

Run: ``python -m pytest -q tests/gpu/test_cublas.py`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from packed_encoders.ops import cublas  # noqa: E402

DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _on():
    cublas.set_enabled(True)
    yield
    cublas.set_enabled(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 64, 1000, 7400])
def test_direct_calls_equal_torch_mm_bit_for_bit(dtype, tokens):
    g = torch.Generator(device=DEV).manual_seed(tokens)
    x = torch.randn(tokens, 768, device=DEV, dtype=dtype, generator=g)
    w = torch.randn(2304, 768, device=DEV, dtype=dtype, generator=g)
    dy = torch.randn(tokens, 2304, device=DEV, dtype=dtype, generator=g)
    got = cublas.mm(x, w, trans_b=True)
    assert got is not None and cublas.off_reason() is None
    assert torch.equal(got, torch.mm(x, w.t()))
    assert torch.equal(cublas.mm(dy, w), torch.mm(dy, w))
    dw = cublas.mm(dy, x, trans_a=True, out_dtype=torch.float32)
    assert dw.dtype == torch.float32 and dw.shape == (2304, 768)
    assert torch.equal(dw, torch.mm(dy.t(), x, out_dtype=torch.float32))
    assert torch.equal(cublas.mm(dy, x, trans_a=True), torch.mm(dy.t(), x))


def test_what_it_leaves_to_torch():
    x = torch.randn(8, 16, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(32, 16, device=DEV, dtype=torch.bfloat16)
    assert cublas.mm(x.float(), w.float(), trans_b=True) is None  # fp32: TF32 modes are torch's
    assert cublas.mm(x, w.float(), trans_b=True) is None  # mixed dtypes
    assert cublas.mm(x.t(), w, trans_a=True, trans_b=True) is None  # not contiguous
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        cublas.mm(x, w)
    cublas.set_enabled(False)
    assert cublas.mm(x, w, trans_b=True) is None
    cublas.set_enabled(True)
    old = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        assert cublas.mm(x, w, trans_b=True) is None  # torch would set another math mode
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = old
    empty = cublas.mm(x[:0], w, trans_b=True)
    assert empty is not None and empty.shape == (0, 32)


def test_a_stream_is_followed():
    x = torch.randn(300, 768, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(768, 768, device=DEV, dtype=torch.bfloat16)
    ref = torch.mm(x, w.t())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = cublas.mm(x, w, trans_b=True)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, ref)


def test_training_gradients_equal_with_direct_calls_on_and_off():
    import packed_encoders as pe
    from tests.gpu.test_lean import _batch, _model

    model = _model(torch.float32).train()
    pe.pack(model, validate=False, cuda_graph=False)
    ids, mask = _batch([40, 300, 129, 7, 925])

    def run(direct):
        cublas.set_enabled(direct)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out.float().square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    out_t, g_t = run(False)
    out_d, g_d = run(True)
    assert cublas.off_reason() is None
    assert torch.equal(out_d, out_t)  # the forward has no atomics: the same GEMMs give the same bits
    # FlashAttention's backward accumulates dq with atomics (run-to-run noise), so gradients are compared by cosine
    worst = min(float(torch.nn.functional.cosine_similarity(g_d[n].flatten(), g_t[n].flatten(), dim=0)) for n in g_t)
    assert worst > 0.99999, worst
