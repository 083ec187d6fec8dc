"""One launch that stages a packed batch into a captured graph's static buffers (``graphs.runner``).

A replay used to stage with five PyTorch ops (copy ids, copy positions, copy ``cu_seqlens``, write the dummy
tail of ``cu_seqlens``, clamp it; a sixth copies ColBERT's ``key_lens``), ~30 us of host time each on the H200 machine, all after the call's one
host sync while the GPU waits (timed there: 157 us of the ~470 us between the sync and the graph launch).
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._runtime import cdiv, device_guard, kernel, next_pow2

BLOCK = 1024


@kernel(do_not_specialize=("total", "num"))
def _stage_kernel(IDS, POS, CU, KL, OUT_IDS, OUT_POS, OUT_CU, OUT_KL, total, num, seqs, seqlen, tokens,
                  BLOCK: tl.constexpr, BLOCK_CU: tl.constexpr, HAS_KL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total
    tl.store(OUT_IDS + offs, tl.load(IDS + offs, mask=inside), mask=inside)
    tl.store(OUT_POS + offs, tl.load(POS + offs, mask=inside), mask=inside)
    if pid == 0:
        j = tl.arange(0, BLOCK_CU)
        real = j <= num
        given = tl.load(CU + j, mask=real, other=0)
        # the bucket's dummy sequences of <= seqlen padding tokens, then empty ones (runner.GraphRunner)
        dummy = tl.minimum(total + (j - num) * seqlen, tokens)
        tl.store(OUT_CU + j, tl.where(real, given, dummy).to(tl.int32), mask=j <= seqs)
        if HAS_KL:
            tl.store(OUT_KL + j, tl.load(KL + j, mask=j < num), mask=j < num)


def stage(ids: torch.Tensor, pos: torch.Tensor, cu: torch.Tensor, kl: torch.Tensor | None,
          out_ids: torch.Tensor, out_pos: torch.Tensor, out_cu: torch.Tensor, out_kl: torch.Tensor | None,
          seqlen: int) -> None:
    """Write a batch into a bucket's buffers in one launch, on the current stream (no host sync).

    ``ids`` / ``pos`` int64 ``[T]`` -> ``out_ids`` / ``out_pos`` ``[:T]`` (the rest untouched); ``cu`` int32
    ``[N + 1]`` -> ``out_cu[:N + 1]``, and ``out_cu[N + 1 + k] = min(T + (k + 1) * seqlen, tokens)`` for the
    bucket's ``len(out_cu) - N - 1`` dummy sequences (``tokens = len(out_ids)``); ``kl`` int32 ``[N]`` ->
    ``out_kl[:N]`` when given. All contiguous, on one device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    """
    total, num = ids.shape[0], cu.shape[0] - 1
    seqs = out_cu.shape[0] - 1
    has_kl = kl is not None
    with device_guard(ids):
        _stage_kernel.on(ids)[(max(1, cdiv(total, BLOCK)),)](
            ids, pos, cu, kl if has_kl else cu, out_ids, out_pos, out_cu, out_kl if has_kl else out_cu,
            total, num, seqs, seqlen, out_ids.shape[0], BLOCK=BLOCK, BLOCK_CU=next_pow2(seqs + 1),
            HAS_KL=has_kl, num_warps=4)
