"""Triton kernels of the sync-free rectangular graphs (``packed_encoders.graphs.rectangular``): unpad a padded
``[B, S]`` batch on the device, and scatter the packed output back to ``[B, S, H]``.

Each replaces a chain of ~45 small PyTorch kernels (sums, argmax, flips, comparisons, a gather, a cat, a
where) with one launch; at batch 8 of short queries those launches cost ~90 us of a ~0.87 ms replay on the
H200 (launch-bound). The layout and the checks are exactly those of ``rectangular.device_unpad``, the
PyTorch reference they are tested against: row ``b`` owns stream rows ``[b*S, (b+1)*S)``, holding padded
position ``(first[b] + k) mod S`` at row ``b*S + k``.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._runtime import device_guard, kernel, next_pow2


@kernel(do_not_specialize=("S", "vocab"))
def _unpad_kernel(MASK, IDS, TT, OUT_IDS, CU, FIRST, FLAGS, KL, S, vocab, B, BLOCK_S: tl.constexpr,
                  HAS_KL: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_S)
    inside = cols < S
    base = b.to(tl.int64) * S
    m = tl.load(MASK + base + cols, mask=inside, other=0)
    real = m != 0
    lens = tl.sum(real.to(tl.int32), axis=0)
    first = tl.min(tl.where(real, cols, BLOCK_S), axis=0)
    first = tl.where(lens > 0, first, 0)
    last = tl.max(tl.where(real, cols, -1), axis=0)
    ids = tl.load(IDS + base + cols, mask=inside, other=0)
    tt = tl.load(TT + base + cols, mask=inside, other=0)
    bad_mask = tl.sum((real & (m != 1)).to(tl.int64), axis=0)
    holes = ((lens > 0) & (last - first + 1 != lens)).to(tl.int64)
    bad_ids = tl.sum((real & ((ids < 0) | (ids >= vocab))).to(tl.int64), axis=0)
    bad_tt = tl.sum((real & (tt != 0)).to(tl.int64), axis=0)
    tl.store(FLAGS + b * 4 + 0, bad_mask)
    tl.store(FLAGS + b * 4 + 1, holes)
    tl.store(FLAGS + b * 4 + 2, bad_ids)
    tl.store(FLAGS + b * 4 + 3, bad_tt)
    # the rotation: stream row b*S + k holds padded position (first + k) mod S
    src = cols + first
    src = tl.where(src >= S, src - S, src)
    rotated = tl.load(IDS + base + src, mask=inside, other=0)
    rotated = tl.minimum(tl.maximum(rotated, 0), vocab - 1)
    tl.store(OUT_IDS + base + cols, rotated, mask=inside)
    tl.store(CU + 2 * b, base.to(tl.int32))
    tl.store(CU + 2 * b + 1, (base + lens).to(tl.int32))
    if b == 0:
        tl.store(CU + 2 * B, (B * S).to(tl.int32))
    tl.store(FIRST + b, first.to(tl.int64))
    if HAS_KL:  # the row's real tokens are all keys; its padding sequence has none
        tl.store(KL + 2 * b, lens.to(tl.int32))
        tl.store(KL + 2 * b + 1, (lens * 0).to(tl.int32))


@kernel(do_not_specialize=("S",))
def _scatter_kernel(HIDDEN, MASK, FIRST, FLAGS, FLAGS_SUM, OUT, S, H, B, BLOCK_ROWS: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_B: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    rows = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_ok = rows < S
    col_ok = cols < H
    fb = tl.arange(0, BLOCK_B)
    fc = tl.arange(0, 4)
    per_check = tl.sum(tl.load(FLAGS + fb[:, None] * 4 + fc[None, :], mask=(fb < B)[:, None], other=0), axis=0)
    bad = tl.sum(per_check, axis=0) > 0
    if (b == 0) & (tile == 0):
        tl.store(FLAGS_SUM + fc, per_check)
    first = tl.load(FIRST + b)
    base = b.to(tl.int64) * S
    real = tl.load(MASK + base + rows, mask=row_ok, other=0) != 0
    k = rows - first
    k = tl.where(k < 0, k + S, k)
    src = (base + k)[:, None] * H + cols[None, :]
    keep = (row_ok & real)[:, None] & col_ok[None, :]
    x = tl.load(HIDDEN + src, mask=keep, other=0.0)
    x = tl.where(bad, float("nan"), x.to(tl.float32))
    dst = (base + rows)[:, None] * H + cols[None, :]
    tl.store(OUT + dst, x.to(OUT.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def unpad(mask: torch.Tensor, ids: torch.Tensor, tt: torch.Tensor, vocab: int, key_lens: bool = False):
    """The rectangular layout of padded ``[B, S]`` int64 ``mask`` / ``ids`` / ``token_type_ids``.

    Returns ``(stream_ids int64 [B*S] clamped into [0, vocab), cu_seqlens int32 [2B+1], first int64 [B],
    flags int64 [B, 4], kl)``; ``flags`` holds per row the counts of ``rectangular.device_unpad``'s checks;
    ``kl`` (with ``key_lens``, else ``None``) is int32 ``[2B]``: each real sequence's length, 0 for each
    padding sequence (see ``rectangular.device_unpad``).
    """
    b, s = mask.shape
    dev = mask.device
    out_ids = torch.empty(b * s, dtype=torch.long, device=dev)
    cu = torch.empty(2 * b + 1, dtype=torch.int32, device=dev)
    first = torch.empty(b, dtype=torch.long, device=dev)
    flags = torch.empty(b, 4, dtype=torch.long, device=dev)
    kl = torch.empty(2 * b, dtype=torch.int32, device=dev) if key_lens else None
    with device_guard(mask):
        _unpad_kernel.on(mask)[(b,)](mask, ids, tt, out_ids, cu, first, flags, kl if key_lens else cu, s, vocab, b,
                                     BLOCK_S=next_pow2(s), HAS_KL=key_lens, num_warps=4 if s > 256 else 1)
    return out_ids, cu, first, flags, kl


def scatter(hidden: torch.Tensor, mask: torch.Tensor, first: torch.Tensor, flags: torch.Tensor):
    """``([B, S, H], flags_sum int64 [4])`` from the packed ``hidden`` ``[B*S, H]``: real positions get their
    stream row, padding zeros, and every value is NaN when any of ``flags`` ``[B, 4]`` is non-zero;
    ``flags_sum`` is ``flags.sum(0)`` (what the host reads one call late)."""
    b, s = mask.shape
    h = hidden.shape[1]
    hidden = hidden.contiguous()
    out = torch.empty(b, s, h, dtype=hidden.dtype, device=hidden.device)
    flags_sum = torch.empty(4, dtype=torch.long, device=hidden.device)
    block_h = next_pow2(h)
    block_rows = max(1, min(next_pow2(s), 4096 // block_h))
    with device_guard(hidden):
        _scatter_kernel.on(hidden)[(b, (s + block_rows - 1) // block_rows)](
            hidden, mask, first, flags, flags_sum, out, s, h, b, BLOCK_ROWS=block_rows, BLOCK_H=block_h,
            BLOCK_B=next_pow2(b), num_warps=4)
    return out, flags_sum
