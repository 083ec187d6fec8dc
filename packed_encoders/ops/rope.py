"""Rotary position embedding (split-half / NeoX convention, as HF ModernBERT) on packed tokens.

Tables: ``cos, sin`` of shape ``[P, head_dim // 2]`` fp32 with ``freq[p, i] = p * theta ** (-2i / head_dim)``,
HF's ``compute_default_rope_parameters``. They are cached per (theta, head_dim, device), grown on demand to
a power of two, and never rebuilt per call.
"""

from __future__ import annotations

import threading

import torch

_TABLES: dict[tuple[float, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
_LOCK = threading.Lock()


def _build(theta: float, head_dim: int, length: int, device: torch.device):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(length, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # same fp32 products as HF's inv_freq @ position_ids
    return freqs.cos().to(device), freqs.sin().to(device)


def rope_tables(theta: float, head_dim: int, min_length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached fp32 ``(cos, sin)`` tables ``[P, head_dim // 2]`` with ``P >= min_length``.

    The first call for a length builds the table on the host and copies it over once; later calls
    with a length already covered return the cached tensors (safe under CUDA-graph capture).
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (float(theta), int(head_dim), str(device))
    entry = _TABLES.get(key)
    if entry is not None and entry[0].shape[0] >= min_length:
        return entry
    with _LOCK:
        entry = _TABLES.get(key)
        if entry is None or entry[0].shape[0] < min_length:
            length = max(1024, 1 << max(0, int(min_length) - 1).bit_length())
            entry = _build(theta, head_dim, length, device)
            _TABLES[key] = entry
    return entry


def rope_qkv_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor,
                 num_heads: int, head_dim: int):
    """fp32 specification. ``qkv``: ``[T, 3 * num_heads * head_dim]`` (HF's Wqkv output layout, q|k|v,
    each head-major). Returns fp32 ``q, k, v`` of shape ``[T, num_heads, head_dim]`` with q and k rotated
    at ``position_ids`` (``[T]`` int)."""
    t = qkv.shape[0]
    q, k, v = qkv.float().view(t, 3, num_heads, head_dim).unbind(1)
    c = cos[position_ids].float()[:, None, :]
    s = sin[position_ids].float()[:, None, :]

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    return rot(q), rot(k), v


def rope_qkv_torch(qkv, cos, sin, position_ids, num_heads: int, head_dim: int):
    """Plain PyTorch: fp32 rotation, q and k rounded once to the activation dtype; v is a strided view."""
    t = qkv.shape[0]
    q, k, v = qkv.view(t, 3, num_heads, head_dim).unbind(1)
    c = cos[position_ids][:, None, :]
    s = sin[position_ids][:, None, :]

    def rot(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)

    return rot(q), rot(k), v
