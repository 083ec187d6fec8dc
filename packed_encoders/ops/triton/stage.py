"""Staging a packed batch into a captured graph's static buffers, split around the call's host sync.

Under graphs the host waits at the call's one sync for the previous replay, and the GPU idles from the sync's
return until the next graph launch. Staging after the sync (one launch, ~60-100 us of host time on the H200
machine) therefore cost GPU time. It is split in two:

- :func:`fill_inbox`, launched *before* the sync: copies the batch into a fixed-address ``inbox`` shared by
  every graph of an encoder. It needs no host value of the batch (the token count is read on the device from
  ``cu_seqlens``), so it can run while the sizes are still unknown to the host.
- :func:`unbox`, captured as the first node of every graph: copies the inbox into the bucket's own buffers
  and writes the bucket's dummy ``cu_seqlens`` tail, again from device values.

After the sync only the graph launch is left. Both kernels touch the rows of real tokens only; a bucket's
padding rows keep what they held (valid ids and positions, see ``graphs.runner``).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._runtime import cdiv, device_guard, kernel, next_pow2

BLOCK = 1024


@kernel(do_not_specialize=("num", "limit"))
def _fill_kernel(IDS, POS, CU, KL, IN_IDS, IN_POS, IN_CU, IN_KL, IN_NUM, num, limit,
                 BLOCK: tl.constexpr, BLOCK_CU: tl.constexpr, HAS_KL: tl.constexpr):
    pid = tl.program_id(0)
    total = tl.minimum(tl.load(CU + num), limit)  # past the inbox the call is never replayed (admission)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    tl.store(IN_IDS + offs, tl.load(IDS + offs, mask=inside), mask=inside)
    tl.store(IN_POS + offs, tl.load(POS + offs, mask=inside), mask=inside)
    if pid == 0:
        j = tl.arange(0, BLOCK_CU)
        tl.store(IN_CU + j, tl.load(CU + j, mask=j <= num), mask=j <= num)
        if HAS_KL:
            tl.store(IN_KL + j, tl.load(KL + j, mask=j < num), mask=j < num)
        tl.store(IN_NUM, num)


@kernel()
def _unbox_kernel(IN_IDS, IN_POS, IN_CU, IN_KL, IN_NUM, OUT_IDS, OUT_POS, OUT_CU, OUT_KL, seqs, seqlen, tokens,
                  rows, BLOCK: tl.constexpr, BLOCK_CU: tl.constexpr, HAS_KL: tl.constexpr):
    pid = tl.program_id(0)
    # Clamped to the bucket so that this copy stays inside its buffers whatever the inbox holds. That does not
    # make any batch safe to run: the router replays a graph only on a batch that fits its bucket, and empties
    # the inbox before a warm-up or capture (Inbox.clear).
    num = tl.minimum(tl.load(IN_NUM), seqs)
    total = tl.minimum(tl.load(IN_CU + num), tokens)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < tl.minimum(total, rows)  # rows: what both buffers hold (admission keeps T below it)
    tl.store(OUT_IDS + offs, tl.load(IN_IDS + offs, mask=inside), mask=inside)
    tl.store(OUT_POS + offs, tl.load(IN_POS + offs, mask=inside), mask=inside)
    if pid == 0:
        j = tl.arange(0, BLOCK_CU)
        real = j <= num
        given = tl.minimum(tl.load(IN_CU + j, mask=real, other=0), tokens)
        # the bucket's dummy sequences of <= seqlen padding tokens, then empty ones (graphs.runner)
        dummy = tl.minimum(total + (j - num) * seqlen, tokens)
        tl.store(OUT_CU + j, tl.where(real, given, dummy).to(tl.int32), mask=j <= seqs)
        if HAS_KL:
            tl.store(OUT_KL + j, tl.load(IN_KL + j, mask=j < num), mask=j < num)


class Inbox:
    """Fixed-address buffers holding the packed batch the next replay serves: int64 ``ids`` / ``pos``
    ``[tokens]``, int32 ``cu`` ``[seqs + 1]``, ``kl`` ``[seqs]`` and ``num`` ``[1]`` (the batch's ``N``), on
    ``device``. Created empty (``N = 0``: a graph run on it sees only padding), and emptied again by
    :meth:`clear` before every warm-up and capture. ``owner`` is the token of the call that filled it last
    (the router compares it before a replay)."""

    def __init__(self, tokens: int, seqs: int, device: torch.device):
        self.tokens, self.seqs, self.device = int(tokens), int(seqs), device
        # normal tensors even when created under inference_mode: clear() writes them in place from any mode
        with torch.inference_mode(False):
            self.ids = torch.zeros(self.tokens, dtype=torch.long, device=device)
            self.pos = torch.zeros(self.tokens, dtype=torch.long, device=device)
            self.cu = torch.zeros(self.seqs + 1, dtype=torch.int32, device=device)
            self.kl = torch.zeros(self.seqs, dtype=torch.int32, device=device)
            self.num = torch.zeros(1, dtype=torch.int32, device=device)
        self.owner = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.pos, self.cu, self.kl, self.num))

    def clear(self) -> None:
        """Make the inbox hold an empty batch (two small writes on the current stream) and drop its owner."""
        with torch.inference_mode(False), torch.no_grad():
            self.num.zero_()
            self.cu[:1].zero_()
        self.owner = None


def fillable(ids: torch.Tensor | None, pos: torch.Tensor, cu: torch.Tensor, kl: torch.Tensor | None) -> bool:
    """The kernels' contract: integer ids / positions, int32 ``cu_seqlens`` / ``key_lens``, all contiguous."""
    def integer(t):
        return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)

    return (ids is not None and integer(ids) and integer(pos) and cu.dtype == torch.int32
            and ids.is_contiguous() and pos.is_contiguous() and cu.is_contiguous()
            and (kl is None or (kl.dtype == torch.int32 and kl.is_contiguous())))


def fill_inbox(inbox: Inbox, ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor,
               kl: torch.Tensor | None) -> None:
    """Copy a packed batch into ``inbox`` in one launch on the current stream, with no host sync.

    ``ids`` / ``pos`` hold at least ``T = cu[N]`` rows (extra rows are ignored: ``unpad``'s ``[B * S + 1]``
    buffers can be passed before ``T`` is known on the host); ``cu`` int32 ``[N + 1]`` with ``N <=
    inbox.seqs``; ``kl`` int32 ``[N]`` or ``None``. Rows past ``inbox.tokens`` are not copied (such a batch is
    never replayed). The caller checks :func:`fillable`.

    Raises:
        RuntimeError: more sequences than the inbox holds (a caller bug: admission bounds them).
    """
    num = cu.shape[0] - 1
    if num > inbox.seqs:
        raise RuntimeError(f"{num} sequences for an inbox of {inbox.seqs}")
    rows = min(ids.shape[0], inbox.tokens)
    has_kl = kl is not None
    with device_guard(ids):
        _fill_kernel.on(ids)[(max(1, cdiv(rows, BLOCK)),)](
            ids, pos, cu, kl if has_kl else cu, inbox.ids, inbox.pos, inbox.cu, inbox.kl, inbox.num, num,
            inbox.tokens, BLOCK=BLOCK, BLOCK_CU=next_pow2(num + 1), HAS_KL=has_kl, num_warps=4)


def unbox(inbox: Inbox, out_ids: torch.Tensor, out_pos: torch.Tensor, out_cu: torch.Tensor,
          out_kl: torch.Tensor | None, seqlen: int) -> None:
    """Write the inbox's batch into a bucket's buffers in one launch that reads no host value (capturable).

    ``out_ids`` / ``out_pos`` ``[:T]`` get the batch's rows (the rest untouched); ``out_cu[:N + 1]`` its
    ``cu_seqlens`` and ``out_cu[N + 1 + k] = min(T + (k + 1) * seqlen, tokens)`` for the bucket's dummy
    sequences (``tokens = len(out_ids)``); ``out_kl[:N]`` its ``key_lens`` when given. The batch must fit
    the bucket (``N < len(out_cu)``, ``T <= tokens``: the router's admission).
    """
    tokens, seqs = out_ids.shape[0], out_cu.shape[0] - 1
    has_kl = out_kl is not None
    with device_guard(out_ids):
        _unbox_kernel.on(out_ids)[(max(1, cdiv(tokens, BLOCK)),)](
            inbox.ids, inbox.pos, inbox.cu, inbox.kl, inbox.num, out_ids, out_pos, out_cu,
            out_kl if has_kl else out_cu, seqs, seqlen, tokens, min(tokens, inbox.tokens), BLOCK=BLOCK,
            BLOCK_CU=next_pow2(seqs + 1),
            HAS_KL=has_kl, num_warps=4)
