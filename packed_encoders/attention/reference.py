"""fp32 specification of packed bidirectional attention.

Each sequence ``s`` owns rows ``cu_seqlens[s]:cu_seqlens[s+1]`` of ``q, k, v`` (``[T, heads, head_dim]``).
A query at position ``i`` attends keys ``j`` of its own sequence with ``|i - j| <= window``
(``window=None``: every key of the sequence). Softmax scale ``scale`` (default ``head_dim ** -0.5``).
With ``key_lens``, only the first ``key_lens[s]`` rows of sequence ``s`` are keys; a query with no key in
reach gets zeros (torch SDPA's behaviour for a fully masked row, which HF returns at masked positions).
"""

from __future__ import annotations

import torch


def _band(length: int, window: int | None, key_len: int | None, device) -> torch.Tensor | None:
    """``[L, L]`` True where a key is out of reach, or None when every key is in reach."""
    pos = torch.arange(length, device=device)
    far = torch.zeros(length, length, dtype=torch.bool, device=device)
    if window is not None:
        far |= (pos[:, None] - pos[None, :]).abs() > window
    if key_len is not None:
        far |= pos[None, :] >= key_len
    return far if bool(far.any()) else None


def _softmax_v(scores: torch.Tensor, far: torch.Tensor | None, vs: torch.Tensor) -> torch.Tensor:
    if far is None:
        return scores.softmax(-1) @ vs
    scores = scores.masked_fill(far, float("-inf"))
    none = far.all(-1)  # rows with no key: zeros instead of NaN
    probs = scores.masked_fill(none[:, None], 0.0).softmax(-1).masked_fill(none[:, None], 0.0)
    return probs @ vs


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  window: int | None = None, scale: float | None = None,
                  key_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sequence loop in fp32 (host syncs on ``cu_seqlens``; a test oracle, not a fast path).

    Returns fp32 ``[T, heads, head_dim]``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    bounds = cu_seqlens.tolist()
    klens = None if key_lens is None else key_lens.tolist()
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].float().transpose(0, 1) for t in (q, k, v))  # [heads, L, D]
        far = _band(end - start, window, None if klens is None else klens[s], q.device)
        out[start:end] = _softmax_v((qs @ ks.transpose(-1, -2)) * scale, far, vs).transpose(0, 1)
    return out


def attention_same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         window: int | None = None, scale: float | None = None,
                         key_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch in the inputs' dtype (scores, softmax and product all rounded to it), per sequence.

    The rounding yardstick of the tolerance rule: a kernel passes when
    ``max|kernel - attention_ref| <= 2 * max|attention_same_dtype - attention_ref| + eps``.
    Returns ``[T, heads, head_dim]`` in the dtype of ``q``.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    klens = None if key_lens is None else key_lens.tolist()
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if end == start:
            continue
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        far = _band(end - start, window, None if klens is None else klens[s], q.device)
        out[start:end] = _softmax_v((qs @ ks.transpose(-1, -2)) * scale, far, vs).transpose(0, 1)
    return out


def parity(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           window: int | None = None, scale: float | None = None, eps: float = 1e-3,
           key_lens: torch.Tensor | None = None) -> tuple[float, float]:
    """``(max|out - attention_ref|, allowed)`` under the tolerance rule above (``allowed`` includes ``eps``)."""
    ref = attention_ref(q, k, v, cu_seqlens, window, scale, key_lens)
    same = attention_same_dtype(q, k, v, cu_seqlens, window, scale, key_lens)
    err = (out.float() - ref).abs().max().item() if out.numel() else 0.0
    yard = (same.float() - ref).abs().max().item() if out.numel() else 0.0
    return err, 2 * yard + eps
