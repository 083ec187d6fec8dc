"""Cross-sequence isolation with non-finite values: a NaN or Inf in one text's activations leaves every other text's
output as it was (stock HF keeps rows independent). Attention backends directly (sdpa; the Triton kernel under
TRITON_INTERPRET=1 on CPU) and the packed model on CPU; tests/gpu/test_isolation.py covers every GPU backend and
CUDA graphs."""

from __future__ import annotations

import pytest
import torch

import packed_encoders as pe
from packed_encoders.attention import BACKENDS
from packed_encoders.attention.triton_short import triton_short_attention
from tests.helpers import make_model, padded_batch

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}

# CPU: the Triton kernel runs interpreted, in NumPy, which warns on the NaN / Inf these tests put in padding on purpose
pytestmark = [pytest.mark.usefixtures("interpret_on_cpu"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def _qkv(lengths, heads=2, head_dim=64, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, head_dim, generator=g).to(DEV, dtype) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return q, k, v, cu, max(lengths)


def _attention(backend, q, k, v, cu, smax, window, key_lens=None):
    extra = {} if key_lens is None else {"key_lens": key_lens}
    if backend == "triton":
        return triton_short_attention(q, k, v, cu, smax, window=window, scale=q.shape[-1] ** -0.5, **extra)
    return BACKENDS[backend].fn(q, k, v, cu, smax, window=window, scale=q.shape[-1] ** -0.5, **extra)


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("poisoned", [0, 1, 2])  # the first sequence fills the padded slots of the others
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_attention_keeps_sequences_apart(backend, poisoned, window, bad, request):
    if backend == "triton":
        request.getfixturevalue("supported_interpreter")  # the kernel launches (interpreted on CPU)
    lengths = [7, 19, 5]
    dtype = torch.bfloat16 if backend == "triton" else torch.float32
    q, k, v, cu, smax = _qkv(lengths, dtype=dtype)
    clean = _attention(backend, q, k, v, cu, smax, window)
    start, end = int(cu[poisoned]), int(cu[poisoned + 1])
    for t in (q, k, v):
        t[start + 1, 0, 3] = BAD[bad]  # one value of one token, in one head
    out = _attention(backend, q, k, v, cu, smax, window)
    others = torch.ones(q.shape[0], dtype=torch.bool, device=DEV)
    others[start:end] = False
    assert torch.isfinite(out[others]).all(), "a non-finite value reached another sequence"
    torch.testing.assert_close(out[others], clean[others], atol=0, rtol=0)


def test_sdpa_keeps_sequences_apart_with_query_only_tokens():
    q, k, v, cu, smax = _qkv([6, 11, 4])
    key_lens = torch.tensor([4, 11, 2], dtype=torch.int32, device=DEV)
    clean = _attention("sdpa", q, k, v, cu, smax, None, key_lens)
    k[0, 1, 0] = v[0, 1, 0] = float("nan")
    out = _attention("sdpa", q, k, v, cu, smax, None, key_lens)
    torch.testing.assert_close(out[6:], clean[6:], atol=0, rtol=0)


def _poisoned_model(bad):
    model = pe.pack(make_model("base_like"))  # validated clean; then one embedding row is corrupted
    with torch.no_grad():
        model.embeddings.tok_embeddings.weight[7, :5] = BAD[bad]  # one corrupted embedding row
    return model


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("side", ["right", "left"])
def test_packed_model_keeps_rows_apart(bad, side):
    """Lengths past the window (16): local layers' blocks span the neighbouring sequence's slots."""
    model = _poisoned_model(bad)
    ids, mask = padded_batch([40, 9, 33, 20], side=side)
    ids[ids == 7] = 8
    poisoned = ids.clone()
    row, col = 1, (2 if side == "right" else ids.shape[1] - 3)
    poisoned[row, col] = 7
    ref = type(model).forward(model, input_ids=poisoned, attention_mask=mask).last_hidden_state
    assert torch.isfinite(ref[torch.arange(4) != row][mask[torch.arange(4) != row].bool()]).all()  # stock
    with torch.no_grad():
        clean = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = model(input_ids=poisoned, attention_mask=mask).last_hidden_state
    assert not torch.isfinite(out[row][mask[row].bool()]).all()  # the poisoned row is poisoned, as in stock
    for r in range(4):
        if r != row:
            real = mask[r].bool()
            assert torch.isfinite(out[r][real]).all(), f"row {r} took the non-finite value of row {row}"
            torch.testing.assert_close(out[r][real], clean[r][real], atol=1e-5, rtol=1e-5)


def test_packed_call_and_inputs_embeds_keep_sequences_apart():
    model = pe.pack(make_model("base_like"))
    lengths = [30, 12, 25]
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(sum(lengths), model.config.hidden_size, generator=g)
    cu = torch.tensor([0, 30, 42, 67], dtype=torch.int32)
    clean = pe.packed_forward(model, None, None, cu, 30, inputs_embeds=embeds)
    embeds[3, 0] = float("nan")
    out = pe.packed_forward(model, None, None, cu, 30, inputs_embeds=embeds)
    assert torch.isfinite(out[30:]).all()
    torch.testing.assert_close(out[30:], clean[30:], atol=1e-5, rtol=1e-5)
