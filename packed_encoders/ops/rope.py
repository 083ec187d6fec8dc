"""Rotary position embedding (split-half / NeoX convention, as HF ModernBERT) on packed tokens.

Tables: ``cos, sin`` of shape ``[P, head_dim // 2]`` fp32 with ``freq[p, i] = p * theta ** (-2i / head_dim)``,
HF's ``compute_default_rope_parameters``. They are cached per (theta, head_dim, device), grown on demand to
a power of two, and never rebuilt per call. Tables of a model's live ``inv_freq`` buffers
(:func:`cached_position_tables`) and its pair-rate tables (:func:`cached_pair_freq_table`) are cached per buffer.
"""

from __future__ import annotations

import math
import threading
import weakref

import torch

from .weight_cast import may_cache

_TABLES: dict[tuple[float, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
_LOCK = threading.Lock()


def _build(theta: float, head_dim: int, length: int, device: torch.device):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(length, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)  # same fp32 products as HF's inv_freq @ position_ids
    return freqs.cos().to(device), freqs.sin().to(device)


def _table_length(min_length: int) -> int:
    """Rows of a cached table covering ``min_length`` positions: a power of two (at least 1,024), so a table grows
    a few times in a model's life, not per call."""
    return max(1024, 1 << max(0, int(min_length) - 1).bit_length())


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
            length = _table_length(min_length)
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
    """Plain PyTorch: the rotation in fp32 (fp64 for an fp64 ``qkv``, with fp64 tables), q and k rounded once to
    the activation dtype; v is a strided view."""
    t = qkv.shape[0]
    q, k, v = qkv.view(t, 3, num_heads, head_dim).unbind(1)
    compute = torch.promote_types(qkv.dtype, torch.float32)
    c = cos[position_ids][:, None, :].to(compute)
    s = sin[position_ids][:, None, :].to(compute)

    def rot(x):
        x1, x2 = x.to(compute).chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(qkv.dtype)

    return rot(q), rot(k), v


def rope_qkv_bwd_torch(dq, dk, dv, cos, sin, position_ids, num_heads: int, head_dim: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """Gradient of :func:`rope_qkv_torch` with respect to ``qkv``: ``[T, 3 * nh * hd]`` in ``dtype`` from ``dq, dk,
    dv`` ``[T, nh, hd]`` (``dv`` may be ``None``: zero); the transposed rotation in fp32 (fp64 for fp64)."""
    compute = torch.promote_types(dtype, torch.float32)
    c = cos[position_ids][:, None, :].to(compute)
    s = sin[position_ids][:, None, :].to(compute)

    def unrot(d):
        d1, d2 = d.to(compute).chunk(2, dim=-1)
        return torch.cat((d1 * c + d2 * s, d2 * c - d1 * s), dim=-1).to(dtype)

    v = torch.zeros_like(dq, dtype=dtype) if dv is None else dv.to(dtype)
    return torch.stack((unrot(dq), unrot(dk), v), dim=1).reshape(dq.shape[0], 3 * num_heads * head_dim)


# ---- RoPE on the q, k projection's output in "pair order" --------------------------------------------------------
# A GEMM epilogue sees adjacent accumulator columns together, so a rotation fused into the q, k projection rotates
# column pairs (2j, 2j + 1). Reading each head's rows d and d + head_dim / 2 into adjacent columns makes that the
# NeoX rotation; the result keeps that column order ("pair order"). q and k share it, so q . k is unchanged.


def pair_order(head_dim: int) -> torch.Tensor:
    """``[head_dim]`` int64: column ``c`` of a head in pair order holds HF dim ``pair_order(head_dim)[c]``
    (``2 d + p -> p * head_dim // 2 + d``)."""
    half = head_dim // 2
    return torch.arange(head_dim).view(2, half).t().reshape(-1)


def pair_freq_table(inv_freq: torch.Tensor, heads: int) -> torch.Tensor:
    """Per-column rotation rates for pair order: ``[heads * head_dim]`` fp32; column ``2 j`` holds the high and
    ``2 j + 1`` the low part of ``inv_freq[j] / (2 pi)`` (turns per position) as a float-float pair, repeated for
    each head. ``inv_freq``: ``[head_dim // 2]`` (HF's buffer). This is quack's ``make_interleaved_inv_freq``
    format (``quack.epilogue.rotary``), built with device ops only, so it can be captured in a CUDA graph."""
    f64 = inv_freq.detach().to(torch.float64) / (2 * math.pi)
    hi = f64.to(torch.float32)
    lo = (f64 - hi.to(torch.float64)).to(torch.float32)
    return torch.stack((hi, lo), dim=-1).reshape(-1).repeat(heads)


_PAIR_TABLES: dict = {}


def cached_pair_freq_table(source, heads: int, device) -> torch.Tensor:
    """:func:`pair_freq_table` on ``device``, cached per source.

    ``source``: HF's live ``inv_freq`` buffer (keyed by identity, ``_version`` and address: an in-place edit through
    the tensor, a ``.data =`` swap or a new buffer rebuilds; the entry goes when the buffer does), or a hashable
    ``("theta", theta, head_dim)`` for HF's default formula. Not cached (built on each call, a few small device
    ops): while a CUDA graph is being captured (the table would live in the graph's pool), and for inference
    tensors (they have no version counter to notice edits by).

    Captured graphs read the table they were captured with: an in-place edit of ``inv_freq`` after a capture is
    not seen by them (as for a swapped submodule: call ``pe.set_cuda_graph(model, True)``); a ``.data =`` swap
    moves the buffer's address, which drops the graphs (``graphs.route.fingerprint``), and the recapture reads a
    rebuilt table. A replaced table is kept while its buffer lives, so such a graph never reads freed memory."""
    device = torch.device(device)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if isinstance(source, torch.Tensor):
        if source.is_inference():
            return pair_freq_table(source.to(device=device, dtype=torch.float32), heads)
        key = (id(source), heads, str(device))
        stamp = (source._version, source.data_ptr())  # (a .data swap moves the address, not the version)
        hit = _PAIR_TABLES.get(key)
        if hit is not None and hit[0]() is source and hit[1] == stamp:
            return hit[2]
        table = pair_freq_table(source.to(device=device, dtype=torch.float32), heads)
        if capturing:
            return table
        retired = (hit[3] + [hit[2]]) if hit is not None and hit[0]() is source else []
        ref = weakref.ref(source, lambda _, k=key: _PAIR_TABLES.pop(k, None))
        _PAIR_TABLES[key] = (ref, stamp, table, retired)
        return table
    key = (source, heads, str(device))
    hit = _PAIR_TABLES.get(key)
    if hit is not None:
        return hit[2]
    _, theta, head_dim = source
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    table = pair_freq_table(1.0 / (theta ** exponent), heads)  # device ops only: capturable
    if not capturing:
        _PAIR_TABLES[key] = (None, None, table, [])
    return table


_POSITION_TABLES: dict = {}
POSITION_TABLE_MAX_ROWS = 1 << 16  # 8x ModernBERT's 8,192 positions; past it (or a graph bucket's "no bound"
# max_position) callers compute per-token tables


def cached_position_tables(inv: torch.Tensor, scaling: float, dtype: torch.dtype, min_length: int, device):
    """``(cos, sin)`` ``[P, head_dim // 2]`` in ``dtype`` for the positions ``0 .. P - 1`` (``P >= min_length``),
    from HF's live ``inv_freq`` buffer as HF computes them per token (``position * inv_freq``, then ``cos`` / ``sin``
    times ``scaling``), cached per buffer: keyed by identity, ``_version`` and address (an in-place edit, a
    ``.data =`` swap or a new buffer rebuilds; the entry goes when the buffer does; the last few replaced tables
    are kept while their buffer lives, so a launch still queued on another stream never reads freed memory). Made
    as normal tensors even under ``inference_mode`` (a later training forward's backward reads them).

    ``None`` (the caller computes per-token tables): while a CUDA graph is being captured (a replay must read the
    live buffer), while ``torch.compile`` traces the call, within a training graph's warm-ups
    (:func:`.weight_cast.may_cache`: tensors made there belong to the graph's pool), for an inference-tensor buffer
    (no version counter to notice edits by), and past :data:`POSITION_TABLE_MAX_ROWS` positions."""
    device = torch.device(device)
    if (min_length > POSITION_TABLE_MAX_ROWS or torch.compiler.is_compiling() or inv.is_inference()
            or not may_cache(device)):
        return None
    key = (id(inv), str(device), dtype, float(scaling))
    state = (inv._version, inv.data_ptr())
    hit = _POSITION_TABLES.get(key)
    if hit is not None and hit[0]() is inv and hit[1] == state and hit[2].shape[0] >= min_length:
        return hit[2], hit[3]
    length = _table_length(min_length)
    with torch.inference_mode(False), torch.no_grad():
        angles = torch.arange(length, device=device, dtype=dtype)[:, None] * inv.to(device=device, dtype=dtype)[None]
        cos, sin = angles.cos(), angles.sin()
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
    # (the last few: a buffer edited on every call must not grow this without bound)
    retired = (hit[4] + [hit[2:4]])[-4:] if hit is not None and hit[0]() is inv else []
    ref = weakref.ref(inv, lambda _, k=key: _POSITION_TABLES.pop(k, None))
    _POSITION_TABLES[key] = (ref, state, cos, sin, retired)
    return cos, sin


def rope_linear_ref(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                    head_dim: int) -> torch.Tensor:
    """fp32 specification of the rotated projection in pair order: ``x [M, K] @ weight [heads * head_dim, K].T``,
    each head rotated NeoX-style at ``positions [M]`` with angle ``position * inv_freq`` (float64), then its
    columns put in pair order. Returns fp32 ``[M, heads * head_dim]``."""
    y = x.double() @ weight.double().t()
    m = y.shape[0]
    y = y.view(m, -1, head_dim)
    ang = positions.double()[:, None] * inv_freq.double()[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    y1, y2 = y.chunk(2, dim=-1)
    rot = torch.cat((y1 * c - y2 * s, y2 * c + y1 * s), dim=-1)
    return rot[..., pair_order(head_dim).to(rot.device)].reshape(m, -1).float()


def rotate_pairs(y: torch.Tensor, positions: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``y [T, N]`` (heads in pair order) column pair ``(2 j, 2 j + 1)`` by ``positions [T] * rate_j``, rates
    from ``freq [N]`` (:func:`pair_freq_table`); fp32 maths, result in ``y.dtype``. The angle is reduced in turns
    (float64 here; the GEMM epilogue uses float-float), so large positions keep their precision."""
    t = y.shape[0]
    rates = freq.view(-1, 2).double().sum(-1)  # hi + lo, one rate per pair
    turns = positions.double()[:, None] * rates[None, :]
    ang = ((turns - turns.round()) * (2 * math.pi)).float()
    c, s = ang.cos(), ang.sin()
    pairs = y.float().view(t, -1, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).reshape(y.shape).to(y.dtype)


def to_pair_order(y: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``y [T, heads * head_dim]`` with each head's columns put in pair order (a copy)."""
    t = y.shape[0]
    return y.view(t, -1, head_dim)[..., pair_order(head_dim).to(y.device)].reshape(t, -1)


def rope_linear_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor,
                      freq: torch.Tensor, num_heads: int, head_dim: int):
    """Plain PyTorch ``rope_linear`` op: ``(q, k, v)`` of ``x @ weight.T + bias`` (``weight``: HF ``Wqkv``,
    ``[3 * num_heads * head_dim, K]``), each ``[T, num_heads, head_dim]``; q and k rotated at ``positions``
    (``[T]`` fp32) with the rates of ``freq`` (:func:`pair_freq_table` of ``2 * num_heads`` heads) and returned
    in pair order, v in HF order. The projection is rounded to ``x.dtype`` (as ``F.linear`` returns it), rotated
    in fp32 and rounded again; the GEMM epilogue rotates the fp32 accumulator and rounds once."""
    t, n = x.shape[0], num_heads * head_dim
    qkv = torch.nn.functional.linear(x, weight, bias)
    qk = rotate_pairs(to_pair_order(qkv[:, :2 * n].float(), head_dim), positions, freq).to(x.dtype)
    q, k = qk.view(t, 2, num_heads, head_dim).unbind(1)
    return q, k, qkv[:, 2 * n:].view(t, num_heads, head_dim)
