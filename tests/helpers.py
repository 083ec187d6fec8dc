"""Tiny ModernBERT models and padded batches for the tests (CPU and GPU), in one place.

Models: :func:`make_config` / :func:`make_model` build a random ``ModernBertModel`` (or a task head) from one of
:data:`CONFIGS` with non-trivial LayerNorm weights and biases; :func:`tiny_model` is the smallest of them.
Batches: :func:`padded_batch` gives random ids and a 0/1 mask ``[B, S]`` padded right, left or both ways.
Oracle: :func:`stock` / :func:`stock_forward` run the class (stock HF) forward even on a packed instance, with
:func:`stock_positions` (positions restart at each row's first real token, the packed convention).
Comparison on real tokens only: :func:`assert_close_real`, :func:`token_cosines`, :func:`cosine_stats`.
"""

from __future__ import annotations

import contextlib
import gc

import torch

VOCAB = 211  # vocab_size of the tiny configs; ids are drawn from [3, VOCAB) (0..2: pad, cls/bos, sep/eos)
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)

# The tiny configs are small enough for CPU fp32 parity runs, and together they cover head_dim 64, many heads,
# Ettin / mmBERT widths, every bias flag, another global period, a tiny window and the tanh GELU. "base" and
# "large" are ModernBERT-base / -large geometry (HF's own vocab, positions and special ids), for the GPU tests.
CONFIGS = {
    "tiny": dict(hidden_size=64, num_attention_heads=2, intermediate_size=96, num_hidden_layers=3,
                 local_attention=16),
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
    "base": dict(),  # ModernBertConfig() defaults: 22 layers, hidden 768, 12 heads of 64, intermediate 1152
    "large": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624),
}
FULL_SIZE = ("base", "large")  # keep HF's vocab, max_position_embeddings and special token ids
PARITY_CONFIGS = [name for name in CONFIGS if name not in FULL_SIZE and name != "tiny"]  # the CPU parity grid


def make_config(name: str = "base_like", vocab_size: int | None = None, **overrides):
    """``ModernBertConfig`` for ``CONFIGS[name]``; tiny configs get ``vocab_size`` (default :data:`VOCAB`),
    4096 positions and :data:`SPECIAL` ids. ``overrides`` are config fields and win over everything."""
    from transformers import ModernBertConfig

    kw = dict(CONFIGS[name])
    if name not in FULL_SIZE:
        kw.update(vocab_size=vocab_size or VOCAB, max_position_embeddings=4096, **SPECIAL)
    elif vocab_size is not None:
        kw.update(vocab_size=vocab_size)
    kw.update(overrides)
    return ModernBertConfig(**kw)


def make_model(name: str = "base_like", cls=None, seed: int = 0, attn_implementation: str = "sdpa",
               dtype: torch.dtype | None = None, device=None, **overrides):
    """A random ``cls`` (default ``ModernBertModel``) in eval mode from :func:`make_config`, seeded by ``seed``,
    with perturbed LayerNorm weights/biases and Linear biases (HF's 1 / 0 init would hide weight and bias
    bugs), moved to ``device`` / ``dtype`` when given."""
    from transformers import ModernBertModel

    torch.manual_seed(seed)
    config = make_config(name, **overrides)
    config._attn_implementation = attn_implementation
    model = (cls or ModernBertModel)(config)
    _randomise_norms(model)
    if device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    return model.eval()


def tiny_model(seed: int = 0, layers: int = 3, local_attention: int = 16, **kw):
    """The smallest model (``CONFIGS["tiny"]``: hidden 64, 2 heads of 32), for logic rather than numerics."""
    return make_model("tiny", seed=seed, num_hidden_layers=layers, local_attention=local_attention, **kw)


def _randomise_norms(model):
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.add_(0.2 * torch.randn(m.weight.shape, generator=g))
                if m.bias is not None:
                    m.bias.add_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.add_(0.05 * torch.randn(m.bias.shape, generator=g))


DROPOUT_AFTER_PACK = ("mc_dropout", "attention_rate_after_pack", "replaced_module")


def enable_dropout(model, where: str) -> None:
    """Turn dropout on after ``pack()`` without ``model.train()``: ``"mc_dropout"`` (every ``nn.Dropout`` at
    p=0.3 in train mode, Monte-Carlo style), ``"attention_rate_after_pack"`` (layer 1's attention rate set to 0.3
    and that module in train mode), ``"replaced_module"`` (a new ``nn.Dropout(0.3)`` in layer 0's MLP)."""
    if where == "mc_dropout":
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.3
                m.train()
    elif where == "attention_rate_after_pack":
        model.layers[1].attn.attention_dropout = 0.3
        model.layers[1].attn.train()
    elif where == "replaced_module":
        model.layers[0].mlp.drop = torch.nn.Dropout(0.3)  # a new module, in train mode
    else:
        raise ValueError(f"where must be one of {DROPOUT_AFTER_PACK}, not {where!r}")


def set_checkpointing(model, on: bool = True, **kwargs) -> None:
    """Turn HF's gradient checkpointing on (``kwargs``: the checkpoint function's, e.g. ``use_reentrant``) or off
    through ``activation_checkpointing_enable`` / ``_disable`` where transformers has them (5.24 and 5.25 make the
    old ``gradient_checkpointing_*`` names deprecated aliases that warn: FutureWarning, "removed in v6")."""
    if hasattr(model, "activation_checkpointing_enable"):
        if on:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None)
        else:
            model.activation_checkpointing_disable()
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    else:
        model.gradient_checkpointing_disable()


def is_checkpointing(model) -> bool:
    """HF's ``is_activation_checkpointing``, or ``is_gradient_checkpointing`` (a deprecated alias where both exist)."""
    new = hasattr(type(model), "is_activation_checkpointing")
    return bool(getattr(model, "is_activation_checkpointing" if new else "is_gradient_checkpointing"))


def padded_batch(lengths, side: str = "right", *, seed: int = 0, pad_to: int | None = None,
                 vocab_size: int = VOCAB, device=None):
    """Random ids ``[B, S]`` (int64, from ``[3, vocab_size)``) and a 0/1 int64 mask ``[B, S]`` with
    ``lengths[b]`` real tokens in row ``b`` (0 allowed); ``S = max(pad_to, max(lengths), 1)``.
    ``side``: "right", "left", or "mixed" (even rows right-padded, odd rows left-padded)."""
    if side not in ("right", "left", "mixed"):
        raise ValueError(f"side must be 'right', 'left' or 'mixed', not {side!r}")
    g = torch.Generator().manual_seed(seed)
    b, s = len(lengths), max(pad_to or 0, max(lengths, default=0), 1)
    ids = torch.randint(3, vocab_size, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.long)
    for row, n in enumerate(lengths):
        left = side == "left" or (side == "mixed" and row % 2 == 1)
        if left:
            mask[row, s - n:] = 1
        else:
            mask[row, :n] = 1
    return (ids, mask) if device is None else (ids.to(device), mask.to(device))


def packed_inputs(ids, mask):
    """``(input_ids [T], cu_seqlens int32 [B + 1], max_seqlen)`` of a padded batch, for ``pe.packed_forward``."""
    lengths = mask.sum(1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return ids[mask.bool()], cu, int(lengths.max())


def stock_positions(mask):
    """position_ids that make stock HF restart at each row's first real token (the packed convention)."""
    return (mask.cumsum(1) - 1).clamp(min=0)


def stock(model, **kwargs):
    """Run the class (stock HF) forward even when the instance is packed."""
    return type(model).forward(model, **kwargs)


def stock_forward(model, ids, mask, **kwargs):
    """Stock HF ``last_hidden_state`` ``[B, S, H]`` of a padded batch, with :func:`stock_positions`."""
    return stock(model, input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask),
                 **kwargs).last_hidden_state


def assert_close_real(a, b, mask, atol=1e-4, rtol=1e-4):
    """``a`` and ``b`` ``[B, S, ...]`` agree on the real tokens of ``mask`` (padding rows are ignored)."""
    real = mask.bool()
    torch.testing.assert_close(a[real], b[real], atol=atol, rtol=rtol)


def token_cosines(a, b, mask):
    """Per-token cosine ``[real tokens]`` (fp32) of ``a`` and ``b`` ``[B, S, H]`` on the real tokens of ``mask``."""
    real = mask.bool()
    return torch.nn.functional.cosine_similarity(a[real].float(), b[real].float(), dim=-1)


def cosine_stats(a, b, mask) -> tuple[float, float]:
    """``(min, mean)`` of :func:`token_cosines` (report both: one flattened cosine hides a bad token)."""
    cos = token_cosines(a, b, mask)
    return float(cos.min()), float(cos.mean())


@contextlib.contextmanager
def measured_peak(device):
    """``with measured_peak(device) as peak: ...``; then ``peak()``: the most bytes allocated on ``device`` within
    the block beyond what was allocated at its start. Earlier tests' garbage is collected first and the collector
    is off within the block: a collection mid-block would free memory counted in the base and lower the peak."""
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    gc.disable()
    try:
        yield lambda: torch.cuda.max_memory_allocated(device) - base
    finally:
        gc.enable()
    torch.cuda.synchronize(device)
