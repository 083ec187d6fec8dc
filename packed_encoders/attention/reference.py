"""fp32 specification of packed bidirectional attention.

Each sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]`` of ``q, k, v`` (``[T, heads, head_dim]``).
A query at position ``i`` attends keys ``j`` of its own sequence with ``|i - j| <= window``
(``window=None``: every key of the sequence). Softmax scale ``scale`` (default ``head_dim ** -0.5``).
"""

from __future__ import annotations

import torch


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Per-sequence loop in fp32 (host syncs on ``cu_seqlens``; a test oracle, not a fast path).

    Returns fp32 ``[T, heads, head_dim]``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
        scores = (qs @ ks.transpose(-1, -2)) * scale
        if window is not None:
            pos = torch.arange(end - start, device=q.device)
            far = (pos[:, None] - pos[None, :]).abs() > window
            scores = scores.masked_fill(far, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def attention_same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """Plain torch in the inputs' dtype (scores, softmax and product all rounded to it), per sequence.

    The rounding yardstick of the tolerance rule: a kernel passes when
    ``max|kernel - attention_ref| <= 2 * max|attention_same_dtype - attention_ref| + eps``.
    Returns ``[T, heads, head_dim]`` in the dtype of ``q``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        scores = (qs @ ks.transpose(-1, -2)) * scale
        if window is not None:
            pos = torch.arange(end - start, device=q.device)
            scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() > window, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


def parity(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           window: int | None = None, scale: float | None = None, eps: float = 1e-3) -> tuple[float, float]:
    """``(max|out - attention_ref|, allowed)`` under the tolerance rule above (``allowed`` includes ``eps``)."""
    ref = attention_ref(q, k, v, cu_seqlens, window, scale)
    same = attention_same_dtype(q, k, v, cu_seqlens, window, scale)
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    yard = (same.float() - ref).abs().max().item() if out.numel() else 0.0
    return err, 2 * yard + eps
