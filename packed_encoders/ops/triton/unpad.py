"""Two Triton launches that unpad a padded ``[B, S]`` call into the packed stream (``batch.unpad``'s fast path).

``batch.unpad`` lays the packed stream out before its one host sync: per-row lengths and first real positions,
the input checks, ``cu_seqlens`` and a scatter of ids / positions / source indices. In PyTorch ops that is ~40
small kernels, and under CUDA graphs they run on the GPU between two replays (they are queued behind the
previous replay, and the sync waits for them), so their launch-bound time is GPU idle time. Here the same work
is two kernels: one program per row for the statistics, then one grid over the rows for ``cu_seqlens``, the
summed checks and the scatter. Results and errors are those of the PyTorch path (``tests/test_unpad_triton.py``
compares them); only the scatter's unused positions are left unwritten instead of all landing on the spare row.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._runtime import cdiv, device_guard, kernel, next_pow2

# per-row statistics written by the first kernel (offsets 0-8 of a row, as its stores and the second kernel's loads
# spell them): segment start, first real column, real length, bad mask values, holes, out-of-vocabulary ids,
# non-zero token types, negative positions, largest position
ROW_FIELDS = 9
BLOCK = 1024       # columns per step of a row (256 for rows up to 256 wide: two compiled variants in all)
MAX_ROWS = 1024    # every program of the second kernel sums the row lengths before its row (O(B) lanes each):
                   # larger batches take the PyTorch path, whose ops are no longer launch-bound there


@kernel(do_not_specialize=("S", "vocab", "sm_b", "sm_s", "si_b", "si_s", "st_b", "st_s", "sp_b", "sp_s"))
def _rows_kernel(MASK, IDS, TT_IDS, POS, ROWS, S, vocab, sm_b, sm_s, si_b, si_s, st_b, st_s, sp_b, sp_s,
                 BLOCK: tl.constexpr, HAS_MASK: tl.constexpr, HAS_IDS: tl.constexpr, HAS_TT: tl.constexpr,
                 HAS_POS: tl.constexpr, TRAILING: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    lens = tl.zeros((), tl.int64)
    first = tl.full((), 1 << 62, tl.int64)
    last = tl.full((), -1, tl.int64)
    bad = tl.zeros((), tl.int64)
    for start in range(0, S, BLOCK):
        cols = start + lanes.to(tl.int64)
        inside = cols < S
        if HAS_MASK:
            m = tl.load(MASK + b * sm_b + cols * sm_s, mask=inside, other=0)
            real = (m != 0) & inside
            bad += tl.sum((real & (m != 1)).to(tl.int64), axis=0)
        else:
            real = inside
        lens += tl.sum(real.to(tl.int64), axis=0)
        first = tl.minimum(first, tl.min(tl.where(real, cols, 1 << 62), axis=0))
        last = tl.maximum(last, tl.max(tl.where(real, cols, -1), axis=0))
    first = tl.where(lens > 0, first, 0)
    holes = ((lens > 0) & (last - first + 1 != lens)).to(tl.int64)
    if TRAILING:
        seg = tl.where(lens > 0, S - first, 0)
    else:
        seg = lens
    oov = tl.zeros((), tl.int64)
    tt = tl.zeros((), tl.int64)
    negpos = tl.zeros((), tl.int64)
    maxpos = tl.zeros((), tl.int64)
    for start in range(0, S, BLOCK):
        cols = start + lanes.to(tl.int64)
        inside = cols < S
        if HAS_MASK:
            real = (tl.load(MASK + b * sm_b + cols * sm_s, mask=inside, other=0) != 0) & inside
        else:
            real = inside
        if TRAILING:
            used = (cols >= first) & (lens > 0) & inside
        else:
            used = real
        if HAS_IDS:
            ids = tl.load(IDS + b * si_b + cols * si_s, mask=inside, other=0).to(tl.int64)
            oov += tl.sum((used & ((ids < 0) | (ids >= vocab))).to(tl.int64), axis=0)
        if HAS_TT:
            t = tl.load(TT_IDS + b * st_b + cols * st_s, mask=inside, other=0)
            tt += tl.sum((real & (t != 0)).to(tl.int64), axis=0)
        if HAS_POS:
            p = tl.load(POS + b * sp_b + cols * sp_s, mask=inside, other=0).to(tl.int64)
            negpos += tl.sum((used & (p < 0)).to(tl.int64), axis=0)
            maxpos = tl.maximum(maxpos, tl.max(tl.where(used, p, 0), axis=0))
    row = ROWS + b * 9
    tl.store(row + 0, seg)
    tl.store(row + 1, first)
    tl.store(row + 2, lens)
    tl.store(row + 3, bad)
    tl.store(row + 4, holes)
    tl.store(row + 5, oov)
    tl.store(row + 6, tt)
    tl.store(row + 7, negpos)
    tl.store(row + 8, maxpos)


@kernel(do_not_specialize=("S", "B", "si_b", "si_s", "sp_b", "sp_s"))
def _pack_kernel(ROWS, IDS, POS, MASK, CU, STATS, KL, OUT_IDS, OUT_POS, OUT_IDX, S, B, sm_b, sm_s, si_b, si_s,
                 sp_b, sp_s, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, HAS_MASK: tl.constexpr,
                 HAS_IDS: tl.constexpr, HAS_POS: tl.constexpr, TRAILING: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    r = tl.arange(0, BLOCK_B)
    segs = tl.load(ROWS + r * 9, mask=r < B, other=0)
    cu_b = tl.sum(tl.where(r < b, segs, 0), axis=0)  # this row's first packed row
    seg = tl.load(ROWS + b * 9 + 0)
    first = tl.load(ROWS + b * 9 + 1)
    lens = tl.load(ROWS + b * 9 + 2)
    if tile == 0:
        tl.store(CU + b + 1, (cu_b + seg).to(tl.int32))
        tl.store(STATS + b, seg)
        if TRAILING:
            tl.store(KL + b, lens.to(tl.int32))
        if b == 0:
            tl.store(CU, 0)
            valid = r < B
            for f in tl.static_range(3, 8):  # bad values, holes, ids out of vocabulary, token types, negatives
                tl.store(STATS + B + (f - 3), tl.sum(tl.load(ROWS + r * 9 + f, mask=valid, other=0), axis=0))
            tl.store(STATS + B + 5, tl.max(tl.load(ROWS + r * 9 + 8, mask=valid, other=0), axis=0))
            # rows whose position 0 is padding: no real token, or the first one later (a cls head reads column 0)
            firsts = tl.load(ROWS + r * 9 + 1, mask=valid, other=0)
            lengths = tl.load(ROWS + r * 9 + 2, mask=valid, other=1)
            tl.store(STATS + B + 6, tl.sum((valid & ((lengths == 0) | (firsts != 0))).to(tl.int64), axis=0))
    cols = tile.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < S
    if TRAILING:
        used = (cols >= first) & (lens > 0) & inside
    elif HAS_MASK:
        used = (tl.load(MASK + b * sm_b + cols * sm_s, mask=inside, other=0) != 0) & inside
    else:
        used = inside
    offset = cols - first
    dest = cu_b + offset
    if HAS_IDS:
        tl.store(OUT_IDS + dest, tl.load(IDS + b * si_b + cols * si_s, mask=used, other=0), mask=used)
    if HAS_POS:
        pos = tl.load(POS + b * sp_b + cols * sp_s, mask=used, other=0)
    else:
        pos = offset
    tl.store(OUT_POS + dest, pos.to(OUT_POS.dtype.element_ty), mask=used)
    tl.store(OUT_IDX + dest, b * S + cols, mask=used)


def supported(mask: torch.Tensor | None, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None,
              position_ids: torch.Tensor | None, b: int) -> bool:
    """Whether :func:`unpad` takes these inputs (integer or bool tensors on one device, ``B <= MAX_ROWS``)."""
    if input_ids is None or b > MAX_ROWS:
        return False
    device = input_ids.device
    for t in (mask, token_type_ids, position_ids):
        if t is not None and (t.device != device or t.is_floating_point() or t.is_complex()):
            return False
    return True


def unpad(mask: torch.Tensor | None, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None,
          position_ids: torch.Tensor | None, vocab_size: int, trailing_query_only: bool = False):
    """The packed layout of a padded call, in two launches on ``input_ids``' device and current stream.

    Args: ``[B, S]`` tensors (any strides; ``position_ids`` already expanded to ``[B, S]``), ``mask`` integer or
    bool (``None``: every position real), ids integer.

    Returns ``(stats int64 [B + 7], cu_seqlens int32 [B + 1], ids [B*S + 1] (the ids' dtype), positions
    [B*S + 1] (``position_ids``' dtype, else int64), indices int64 [B*S + 1], key_lens int32 [B] or None)``:
    ``stats`` holds each row's packed length, then the counts of mask values other than 0/1 at real tokens,
    sequences with holes, ids outside ``[0, vocab_size)``, non-zero token types, negative positions, the largest
    position (0 without ``position_ids``), and the count of rows whose position 0 is padding; the first
    ``sum(lengths)`` rows of the three streams are the packed batch (``batch.unpad``'s layout), the rest is
    unwritten.
    """
    b, s = input_ids.shape
    device = input_ids.device
    rows = torch.empty(b, ROW_FIELDS, dtype=torch.long, device=device)
    stats = torch.empty(b + 7, dtype=torch.long, device=device)
    cu = torch.empty(b + 1, dtype=torch.int32, device=device)
    slots = b * s + 1
    out_ids = torch.empty(slots, dtype=input_ids.dtype, device=device)
    out_pos = torch.empty(slots, dtype=torch.long if position_ids is None else position_ids.dtype, device=device)
    out_idx = torch.empty(slots, dtype=torch.long, device=device)
    kl = torch.empty(b, dtype=torch.int32, device=device) if trailing_query_only else None
    dummy = input_ids
    m, tt, pos = (mask if mask is not None else dummy), (token_type_ids if token_type_ids is not None else dummy), \
        (position_ids if position_ids is not None else dummy)
    if m.dtype == torch.bool:
        m = m.view(torch.uint8)
    block = 256 if s <= 256 else BLOCK
    flags = dict(HAS_MASK=mask is not None, TRAILING=trailing_query_only)
    with device_guard(input_ids):
        _rows_kernel.on(input_ids)[(b,)](
            m, input_ids, tt, pos, rows, s, vocab_size, m.stride(0), m.stride(1), input_ids.stride(0),
            input_ids.stride(1), tt.stride(0), tt.stride(1), pos.stride(0), pos.stride(1), BLOCK=block,
            HAS_IDS=True, HAS_TT=token_type_ids is not None, HAS_POS=position_ids is not None, num_warps=4,
            **flags)
        _pack_kernel.on(input_ids)[(b, cdiv(s, block))](
            rows, input_ids, pos, m, cu, stats, kl if kl is not None else cu, out_ids, out_pos, out_idx, s, b,
            m.stride(0), m.stride(1), input_ids.stride(0), input_ids.stride(1), pos.stride(0), pos.stride(1),
            BLOCK=block, BLOCK_B=max(16, next_pow2(b)), HAS_IDS=True, HAS_POS=position_ids is not None, num_warps=4,
            **flags)
    return stats, cu, out_ids, out_pos, out_idx, kl
