"""Tiny random ModernBERT configs and helpers shared by the CPU tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)

# Each config is small enough for CPU fp32 parity runs, and together they cover head_dim 64, many heads,
# Ettin / mmBERT widths, every bias flag, another global period, a tiny window and the tanh GELU.
CONFIGS = {
    "base_like": dict(hidden_size=128, num_attention_heads=2, intermediate_size=192, num_hidden_layers=4,
                      local_attention=16),
    "large_like": dict(hidden_size=128, num_attention_heads=8, intermediate_size=160, num_hidden_layers=5,
                       local_attention=16),
    "ettin_like": dict(hidden_size=256, num_attention_heads=4, intermediate_size=384, num_hidden_layers=3,
                       local_attention=16),
    "mmbert_like": dict(hidden_size=384, num_attention_heads=6, intermediate_size=384, num_hidden_layers=3,
                        local_attention=16, global_attn_every_n_layers=3),
    "odd": dict(hidden_size=96, num_attention_heads=3, intermediate_size=80, num_hidden_layers=4,
                local_attention=6, global_attn_every_n_layers=2, attention_bias=True, mlp_bias=True,
                norm_bias=True, hidden_activation="gelu_pytorch_tanh", norm_eps=1e-6),
}


def make_config(name: str = "base_like", vocab_size: int = 211, **overrides):
    from transformers import ModernBertConfig

    kw = dict(CONFIGS[name], vocab_size=vocab_size, max_position_embeddings=4096, **SPECIAL)
    kw.update(overrides)
    return ModernBertConfig(**kw)


def make_model(name: str = "base_like", cls=None, seed: int = 0, attn_implementation: str = "sdpa", **overrides):
    from transformers import ModernBertModel

    torch.manual_seed(seed)
    config = make_config(name, **overrides)
    cls = cls or ModernBertModel
    config._attn_implementation = attn_implementation
    model = cls(config)
    _randomise_norms(model)
    return model.eval()


def _randomise_norms(model):
    """HF inits LayerNorm to weight 1 / bias 0, which would hide weight/bias bugs: perturb them."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.add_(0.2 * torch.randn(m.weight.shape, generator=g))
                if m.bias is not None:
                    m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.add_(0.05 * torch.randn(m.bias.shape, generator=g))


def padded_batch(lengths, vocab_size: int = 211, side="right", seed: int = 0, pad_to: int | None = None):
    """Random ids [B, S] and a 0/1 mask; ``side`` is "right", "left" or "mixed" (alternating rows)."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(pad_to or 0, max(lengths))
    ids = torch.randint(3, vocab_size, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.long)
    for row, n in enumerate(lengths):
        left = side == "left" or (side == "mixed" and row % 2 == 1)
        if left:
            mask[row, s - n:] = 1
        else:
            mask[row, :n] = 1
    return ids, mask


def stock_positions(mask):
    """position_ids that make stock HF restart at each row's first real token (the packed convention)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def stock(model, **kwargs):
    """Run the class (stock HF) forward even when the instance is packed."""
    return type(model).forward(model, **kwargs)


def assert_close_real(a, b, mask, atol=1e-4, rtol=1e-4):
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=atol, rtol=rtol)


@pytest.fixture(params=list(CONFIGS))
def config_name(request):
    return request.param


@pytest.fixture
def interpreter_fixes():
    """For modules that launch a ``@triton.jit`` kernel directly (``pytestmark =
    pytest.mark.usefixtures("interpreter_fixes")``): on CPU each test runs with ``TRITON_INTERPRET=1`` inside
    ``ops.triton._runtime._interpreter_fixes()``, so Triton's standard library is in its interpreted form whatever
    mode Triton was imported in, fp32 -> bf16 casts round as on the GPU, and every interpreter patch is undone
    afterwards (the module passes in any order with the other interpreter modules). On CUDA it does nothing."""
    if torch.cuda.is_available():
        yield
        return
    from packed_encoders.ops.triton._runtime import _interpreter_fixes

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # read per call by the wrapper; another module may have reset it
        with _interpreter_fixes():
            yield


@pytest.fixture(scope="module")
def triton_interpret():
    """``TRITON_INTERPRET=1`` for one test module (``pytestmark = pytest.mark.usefixtures("triton_interpret")``):
    its Triton kernels run interpreted on CPU; compiled kernels elsewhere in the process are unaffected, since
    interpretation is chosen per launch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
