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
