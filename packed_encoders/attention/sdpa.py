"""Dependency-free attention backend on ``F.scaled_dot_product_attention``.

Packed tokens are gathered into a per-sequence layout on the device (no host sync):
global layers use ``[N, Smax]`` with a key-padding mask (``N x Smax`` booleans, never ``S x S``);
local layers are blocked: each block of ``window`` queries attends the three neighbouring key blocks
through one constant ``[window, 3 * window]`` band, so memory grows with tokens x window.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Calls of at most this many padded query rows (``[B, H, S, D]``: B x S) run torch's memory-efficient kernel
# directly. Left to choose, torch takes cuDNN's attention for masked bf16 / fp16 calls on Hopper: it builds a graph
# for each new shape (85 ms to 1.7 s per first forward + backward of a 16-row batch of a new width, H100, against
# 2-5 ms here) and its steady host cost is higher too (2.1 ms against 1.6 ms per forward + backward of 16 x 32,
# gather and scatter included). PyLate's training query chunks (query expansion, ``key_lens``: 16-64 queries of
# <= 32) meet a new width every few steps. Past ~4k rows of global attention cuDNN's kernel is the faster one
# (8 x 512: 388 against 543 us of GPU; 8 x 2048: 2.3 against 4.7 ms).
EFFICIENT_MAX_ROWS = 2048
_EFFICIENT_ALIGN = 8  # the kernel reads bias rows at 16-byte aligned strides (torch's sdpa pads them alike)


def token_coords(cu_seqlens: torch.Tensor, total: int):
    """For each packed token: (sequence index, position within its sequence), int64 on device."""
    cu = cu_seqlens.long()
    t = torch.arange(total, device=cu.device)
    seq = torch.searchsorted(cu[1:], t, right=True)
    return seq, t - cu[seq]


def _gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def _gather_keys(x: torch.Tensor, idx: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """Keys / values at ``idx``, zero where ``inside`` is False. Those slots are filled from token 0 (another
    sequence's token) and get probability 0, but 0 * NaN is NaN: a non-finite value in one sequence must not
    reach the others (stock HF keeps rows independent)."""
    return _gather(x, idx).masked_fill(~inside.view(*inside.shape, 1, 1), 0)


def _efficient_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's own choice could take its memory-efficient kernel here: the user has not switched it off
    (``torch.backends.cuda.enable_mem_efficient_sdp``, ``sdpa_kernel``), a CUDA (not ROCm) build, and for bf16 an
    sm_80+ card (torch has no bf16 kernel below)."""
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or torch.version.hip is not None:
        return False
    return dtype is not torch.bfloat16 or _capability(device.index if device.index is not None else
                                                      torch.cuda.current_device()) >= (8, 0)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _attend(q, k, v, allowed: torch.Tensor, dropout_p: float, scale: float) -> torch.Tensor:
    """Attention of ``q`` ``[B, H, Sq, D]`` over ``k`` / ``v`` ``[B, H, Sk, D]`` where the boolean ``allowed``
    (broadcast to ``[B, H, Sq, Sk]``) is True; every query row must allow at least one key."""
    b, heads, sq, _ = q.shape
    sk = k.shape[2]
    if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and b * sq <= EFFICIENT_MAX_ROWS
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256 and not torch.compiler.is_compiling()
            and _efficient_kernel(q.device, q.dtype)):  # (traced: inductor picks the kernel)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=scale)
    width = -(-sk // _EFFICIENT_ALIGN) * _EFFICIENT_ALIGN
    bias = q.new_zeros((*allowed.shape[:-1], width))[..., :sk]
    bias.masked_fill_(~allowed, float("-inf"))
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias.expand(b, heads, sq, sk), grad, dropout_p, False, scale=scale)[0]


def sdpa_varlen(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
                dropout_p: float = 0.0, key_lens: torch.Tensor | None = None) -> torch.Tensor:
    """``q, k, v``: ``[T, heads, head_dim]`` -> ``[T, heads, head_dim]`` (dtype of q).

    ``key_lens`` (int ``[N]``, optional): only the first ``key_lens[s]`` tokens of sequence ``s`` are keys.
    """
    total, heads, dim = q.shape
    n = cu_seqlens.numel() - 1
    if total == 0 or n == 0:
        return q.new_zeros(q.shape)
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    klens = lens if key_lens is None else key_lens.long()
    seq, pos = token_coords(cu_seqlens, total)
    if window is None or window >= max_seqlen - 1:
        s = max(int(max_seqlen), 1)
        p = torch.arange(s, device=q.device)
        valid = p[None, :] < lens[:, None]                              # [N, S]
        idx = torch.where(valid, cu[:-1, None] + p[None, :], 0)
        qp = _gather(q, idx).transpose(1, 2)                               # [N, heads, S, D]
        kp, vp = (_gather_keys(t, idx, valid).transpose(1, 2) for t in (k, v))
        key_ok = p[None, :] < klens[:, None]
        has_key = key_ok.any(-1)                                            # [N]
        key_ok = key_ok | ~has_key[:, None]                                 # keep empty rows NaN-free
        out = _attend(qp, kp, vp, key_ok[:, None, None, :], dropout_p, scale)
        out = out * has_key[:, None, None, None].to(out.dtype)             # no key: zeros, as torch SDPA
        out = out.transpose(1, 2).reshape(n * s, heads, dim)
        return out.index_select(0, seq * s + pos)

    w = int(window)
    blk = max(w, 1)  # block size; a window of 0 (each token sees itself) still needs blocks of one
    nb = -(-int(max_seqlen) // blk)
    sp = nb * blk
    qpos = torch.arange(sp, device=q.device).view(nb, blk)                             # [nb, blk]
    kpos = (torch.arange(nb, device=q.device)[:, None] - 1) * blk + torch.arange(3 * blk, device=q.device)
    q_ok = qpos[None] < lens[:, None, None]                                             # [N, nb, w]
    k_in = (kpos[None] >= 0) & (kpos[None] < lens[:, None, None])                      # [N, nb, 3w]
    k_ok = k_in & (kpos[None] < klens[:, None, None])
    q_idx = torch.where(q_ok, cu[:-1, None, None] + qpos[None], 0)
    k_idx = torch.where(k_in, cu[:-1, None, None] + kpos.clamp(min=0)[None], 0)
    r = torch.arange(blk, device=q.device)[:, None]
    c = torch.arange(3 * blk, device=q.device)[None, :]
    band = (blk + r - c).abs() <= w                                                    # [blk, 3blk], constant
    mask = band[None, None] & k_ok[:, :, None, :]                                       # [N, nb, w, 3w]
    has_key = mask.any(-1)                                                              # [N, nb, w]
    mask = mask | ~has_key[..., None]                                                   # keep NaN-free
    qb = _gather(q, q_idx).view(n * nb, blk, heads, dim).transpose(1, 2)
    kb = _gather_keys(k, k_idx, k_in).view(n * nb, 3 * blk, heads, dim).transpose(1, 2)
    vb = _gather_keys(v, k_idx, k_in).view(n * nb, 3 * blk, heads, dim).transpose(1, 2)
    out = _attend(qb, kb, vb, mask.view(n * nb, 1, blk, 3 * blk), dropout_p, scale)
    # A query with no key in its window (query-only tokens past the window) gets zeros, as torch SDPA gives HF.
    out = out * has_key.view(n * nb, 1, blk, 1).to(out.dtype)
    out = out.transpose(1, 2).reshape(n * sp, heads, dim)
    return out.index_select(0, seq * sp + pos)
