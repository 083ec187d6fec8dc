"""The Triton program behind :mod:`packed_encoders.attention.triton_short` (imported lazily: it imports triton).

One program owns ``BLOCK_M`` query rows and ``HEADS_PER_PROGRAM`` heads. Two grid shapes:

- ``PER_SEQ=False`` ("stream"): query tiles are consecutive rows of the packed stream, so a tile may hold the
  tail of one sequence and the head of the next. Every program is dense (no tile is mostly padding, no
  program exits empty) and the grid is ``cdiv(T, BLOCK_M)`` whatever the length mix: the shape for many
  tiny sequences. Each row finds its sequence by a binary search over ``cu_seqlens``.
- ``PER_SEQ=True`` ("seq"): ``TILES_PER_SEQ`` tiles per sequence aligned to its start; tiles past the
  sequence's end do no work.

Either way each query row ``t`` gets a key interval ``[lo, hi)``: its own sequence clipped to
``|t - j| <= WINDOW`` on local layers. Positions within a sequence differ exactly as packed rows do, so the
window needs no position ids. The key loop runs over the union of the tile's intervals only: it stops at the
last sequence's end and never visits key tiles outside the window. With ``HAS_KL`` the key interval also ends
at ``cu[s] + KL[s]`` (query-only tail rows, ColBERT query expansion); a row left with no key writes zeros.
Masked scores are ``-inf``; the running max starts finite so a row whose first key tiles are all masked stays
NaN-free, and its masked keys add exact zeros (a sequence's output does not depend on its neighbours' values,
bit for bit). A non-finite value would not add zero (0 * NaN is NaN): a head whose rows come out non-finite is
recomputed with non-finite values masked, and the rows that attend one are set to NaN.

Two entry points share that body: ``packed_attn_fwd`` takes rotated ``q, k``; ``packed_attn_rope_fwd``
(``ROPE``, inference only) takes the unrotated projections and rotates each loaded q tile and k tile in registers
before its dot, as ``ops.rope_qkv`` would have in a launch of its own: split-half (NeoX) rotation with the fp32
tables ``COS, SIN`` ``[R, HEAD_DIM // 2]`` at row ``ROWS[t]``. Both entry points load q and k tiles as their halves
``x1, x2`` ``[rows, HEAD_DIM // 2]`` and form the scores as two chained dots over the halves; with RoPE the halves
become ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` in fp32, rounded once to the q/k dtype, so the dots see
the values the unfused op writes (bit for bit where both round the same fp32 results). Key tiles are rotated again
by every query tile that visits them (about 3 at window 64): cheap next to the launch it saves when sequences are
short; on long documents the fused kernel costs about what the separate RoPE pass it saves costs (H200, window 64:
44 vs 28 + ~14 us per layer on 8 documents, T=7.7k). Forming the scores from the half tiles instead of rejoining
them into one tile saved 1-3 % there.
"""

import re

import triton
import triton.language as tl

# Finite start for the running max: exp2(-inf - M0) == 0 and exp2(M0 - M0) == 1 for fully masked tiles.
_M0 = tl.constexpr(-1.0e30)


def _release(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


# Pipelining depth of the fused RoPE entry's rerun loop (the rare second pass with non-finite values masked); None:
# the launch's num_stages, as the first pass. Triton up to 3.6 (the GPU's; the kernel measured there) keeps that.
# Under newer Triton (3.9 checked) the pipelined rerun's peeled first iteration shares the first pass's prologue
# (the first key tile's table-row pointers and masks), held live through the first pass: sm_90 code spilled 24 B at
# (head_dim 64, max_seqlen 64), 72 B at (64, 1024 local), 184 B at (128, 1024). One stage peels nothing: 0 / 0 /
# 56 B. One stage under 3.6 spills instead (16 B at (64, 1024 local)), hence per release. The plain entry keeps its
# loops under every release. Stages only reorder loads: the same bits come out.
_RERUN_STAGES = tl.constexpr(None if _release(triton.__version__) <= (3, 6) else 1)


@triton.jit
def _rope_rows(COS, SIN, ROWS, rows64, ok, scs_r, offs_h):
    """``cos, sin`` ``[rows, HEAD_DIM // 2]`` fp32 for the tokens ``rows64`` (their table rows read from ``ROWS``)."""
    at = tl.load(ROWS + rows64, mask=ok, other=0).to(tl.int64)[:, None] * scs_r + offs_h[None, :]
    return tl.load(COS + at, mask=ok[:, None], other=0.0), tl.load(SIN + at, mask=ok[:, None], other=0.0)


@triton.jit
def _halves(X, offs, ok, cos, sin, HALF: tl.constexpr, ROPE: tl.constexpr):
    """A ``[rows, HEAD_DIM]`` q or k tile as its two halves ``[rows, HALF]`` loaded at ``X + offs`` and ``+ HALF``;
    with ``ROPE`` rotated by ops.rope_qkv's expressions in fp32 and rounded once to ``X``'s dtype."""
    x1 = tl.load(X + offs, mask=ok, other=0.0)
    x2 = tl.load(X + offs + HALF, mask=ok, other=0.0)
    if ROPE:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        x1 = (a * cos - b * sin).to(X.dtype.element_ty)
        x2 = (b * cos + a * sin).to(X.dtype.element_ty)
    return x1, x2


@triton.jit
def _scores(q1, q2, k1, k2, DOT_F32: tl.constexpr):
    """``q @ k^T`` as two chained half-width dots (no join of the rotated halves back into one tile)."""
    if DOT_F32:  # the CPU interpreter multiplies bf16 bit patterns as integers; same maths in fp32
        return tl.dot(q2.to(tl.float32), tl.trans(k2).to(tl.float32),
                      tl.dot(q1.to(tl.float32), tl.trans(k1).to(tl.float32)))
    return tl.dot(q2, tl.trans(k2), tl.dot(q1, tl.trans(k1)))


@triton.jit
def _key_loop(q1, q2, K, V, COS, SIN, ROWS, qk_scale, k_begin, k_end, k_lo, k_hi, h, h_ok,
              sk_t, sk_h, sv_t, sv_h, scs_r, offs_n, offs_d, offs_h,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
              ROPE: tl.constexpr, MASK_NONFINITE: tl.constexpr):
    """Online softmax over the key tiles ``[k_begin, k_end)`` for one head: ``(acc, l_i, poison)``.
    ``MASK_NONFINITE``: non-finite values are zeroed before ``p @ v`` and ``poison`` ``[BLOCK_M]`` counts the row's
    own keys holding one (else ``poison`` is zeros)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _M0
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    poison = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in tl.range(k_begin, k_end, BLOCK_N, num_stages=_RERUN_STAGES if MASK_NONFINITE and ROPE else None):
        kt = start + offs_n
        kt_ok = kt < k_end
        kt64 = kt.to(tl.int64)
        if ROPE:  # as q; rows past k_end read nothing (masked loads) and rotate to zeros
            k_cos, k_sin = _rope_rows(COS, SIN, ROWS, kt64, kt_ok, scs_r, offs_h)
        else:
            k_cos = 0.0
            k_sin = 0.0
        k1, k2 = _halves(K, kt64[:, None] * sk_t + h * sk_h + offs_h[None, :], kt_ok[:, None] & h_ok, k_cos,
                         k_sin, HALF, ROPE)
        s = _scores(q1, q2, k1, k2, DOT_F32)
        allowed = (kt[None, :] >= k_lo[:, None]) & (kt[None, :] < k_hi[:, None])
        s = tl.where(allowed, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(V + kt64[:, None] * sv_t + h * sv_h + offs_d[None, :], mask=kt_ok[:, None] & h_ok,
                    other=0.0)
        if MASK_NONFINITE:
            # x * 0 is 0 for finite x, NaN for NaN / +-Inf: reduced per key row with no [BLOCK_N, HEAD_DIM] mask held
            bad_key = tl.sum(v.to(tl.float32) * 0.0, axis=1) != 0.0
            poison += tl.sum(tl.where(allowed & bad_key[None, :], 1.0, 0.0), axis=1)
            v = tl.where(bad_key[:, None], 0.0, v)
        p = p.to(v.dtype)  # bf16/fp16 probabilities into the MMA, fp32 accumulation (as FlashAttention)
        if DOT_F32:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    return acc, l_i, poison


# The one program body, inlined into the two entry points below, which fix ROPE: ROPE=False compiles to the code
# of a kernel without the flag, and the plain entry keeps the argument list it had before RoPE was fused.
@triton.jit
def _packed_attn(
    Q, K, V, O, CU, KL,
    COS, SIN, ROWS,  # read only with ROPE
    qk_scale,
    T, N, LOG_N, WINDOW, TILES_PER_SEQ, H,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, scs_r,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
    LOCAL: tl.constexpr, PER_SEQ: tl.constexpr, DOT_F32: tl.constexpr, HAS_KL: tl.constexpr,
    ROPE: tl.constexpr,
):
    pid = tl.program_id(0)
    head_group = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)

    if PER_SEQ:
        seq = pid // TILES_PER_SEQ
        tile = pid % TILES_PER_SEQ
        first = tl.load(CU + seq)
        seq_end = tl.load(CU + seq + 1)
        t = first + tile * BLOCK_M + offs_m
        q_ok = t < seq_end
        seq_start = tl.zeros([BLOCK_M], dtype=tl.int32) + first
        seq_stop = tl.zeros([BLOCK_M], dtype=tl.int32) + seq_end
        seq_idx = tl.zeros([BLOCK_M], dtype=tl.int32) + seq
    else:
        t = pid * BLOCK_M + offs_m
        q_ok = t < T
        # Largest s in [0, N-1] with cu[s] <= t: the sequence holding row t (empty sequences, whose
        # cu[s] == cu[s+1], are skipped because the search keeps the last of equal bounds).
        lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        hi = lo + (N - 1)
        step = 0
        while step < LOG_N:  # a while loop: the interpreter cannot range() over a scalar argument
            mid = (lo + hi + 1) // 2
            go = tl.load(CU + mid) <= t
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid - 1)
            step += 1
        seq_start = tl.load(CU + lo)
        seq_stop = tl.load(CU + lo + 1)
        seq_idx = lo

    if HAS_KL:  # only the first KL[s] rows of sequence s are keys; the rest attend but are not attended
        seq_stop = tl.minimum(seq_stop, seq_start + tl.load(KL + seq_idx))

    if LOCAL:
        k_lo = tl.maximum(seq_start, t - WINDOW)
        k_hi = tl.minimum(seq_stop, t + WINDOW + 1)
    else:
        k_lo = seq_start
        k_hi = seq_stop
    # rows past the end, and rows with no key (query-only rows past a window, the padding sequences of the
    # rectangular graphs' dead-padding layout), take no keys and do not widen the loop
    has_keys = q_ok & (k_hi > k_lo)
    k_lo = tl.where(has_keys, k_lo, T)
    k_hi = tl.where(has_keys, k_hi, 0)
    k_begin = tl.min(k_lo, axis=0)
    k_end = tl.max(k_hi, axis=0)

    # int64 row offsets: T * stride of the fused qkv (3 * hidden) passes 2**31 near 700k tokens.
    t64 = t.to(tl.int64)
    # q and k as half-width tiles: each element is loaded once (no partner gather), RoPE rotates the halves in
    # registers, and the scores are two chained dots over the halves.
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, HALF)
    if ROPE:
        # the query rows' table entries serve every head: read once per program
        q_cos, q_sin = _rope_rows(COS, SIN, ROWS, t64, q_ok, scs_r, offs_h)
    else:
        q_cos = 0.0
        q_sin = 0.0
    for hh in tl.static_range(HEADS_PER_PROGRAM):
        h = head_group * HEADS_PER_PROGRAM + hh
        h_ok = h < H
        q1, q2 = _halves(Q, t64[:, None] * sq_t + h * sq_h + offs_h[None, :], q_ok[:, None] & h_ok, q_cos, q_sin,
                         HALF, ROPE)
        acc, l_i, poison = _key_loop(q1, q2, K, V, COS, SIN, ROWS, qk_scale, k_begin, k_end, k_lo, k_hi, h, h_ok,
                                     sk_t, sk_h, sv_t, sv_h, scs_r, offs_n, offs_d, offs_h,
                                     HEAD_DIM, BLOCK_M, BLOCK_N, DOT_F32, ROPE, False)
        # 0 * NaN is NaN: a non-finite value of another sequence's key tile row reaches this row through its zero
        # probability. Rare, so checked once per head here and the loop rerun with the values masked (stock HF
        # keeps rows independent; a row attending a non-finite value itself gets NaN)
        row_sum = tl.sum(acc, axis=1)  # non-finite when one of the row's values is
        if tl.max(((row_sum - row_sum) != 0).to(tl.int32), axis=0) > 0:
            acc, l_i, poison = _key_loop(q1, q2, K, V, COS, SIN, ROWS, qk_scale, k_begin, k_end, k_lo, k_hi, h, h_ok,
                                         sk_t, sk_h, sv_t, sv_h, scs_r, offs_n, offs_d, offs_h,
                                         HEAD_DIM, BLOCK_M, BLOCK_N, DOT_F32, ROPE, True)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        out = tl.where(poison[:, None] > 0.0, float("nan"), out)  # the row attends a non-finite value
        tl.store(O + t64[:, None] * so_t + h * so_h + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=q_ok[:, None] & h_ok)


_DO_NOT_SPECIALIZE = ["T", "N", "LOG_N", "WINDOW", "TILES_PER_SEQ", "H"]


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)
def packed_attn_fwd(
    Q, K, V, O, CU, KL,
    qk_scale,  # softmax scale * log2(e): exp2 on pre-scaled scores
    T, N, LOG_N, WINDOW, TILES_PER_SEQ, H,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
    LOCAL: tl.constexpr, PER_SEQ: tl.constexpr, DOT_F32: tl.constexpr, HAS_KL: tl.constexpr,
):
    """``q, k`` already rotated (or no RoPE at all)."""
    _packed_attn(Q, K, V, O, CU, KL, Q, Q, CU, qk_scale, T, N, LOG_N, WINDOW, TILES_PER_SEQ, H,
                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, 0,
                 HEAD_DIM, BLOCK_M, BLOCK_N, HEADS_PER_PROGRAM, LOCAL, PER_SEQ, DOT_F32, HAS_KL, False)


@triton.jit(do_not_specialize=_DO_NOT_SPECIALIZE)
def packed_attn_rope_fwd(
    Q, K, V, O, CU, KL,
    COS, SIN, ROWS,  # fp32 [R, HEAD_DIM // 2] tables (row stride scs_r, unit column stride); int [T] rows
    qk_scale,
    T, N, LOG_N, WINDOW, TILES_PER_SEQ, H,
    sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, scs_r,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
    LOCAL: tl.constexpr, PER_SEQ: tl.constexpr, DOT_F32: tl.constexpr, HAS_KL: tl.constexpr,
):
    """``q, k`` unrotated: RoPE fused (inference only)."""
    _packed_attn(Q, K, V, O, CU, KL, COS, SIN, ROWS, qk_scale, T, N, LOG_N, WINDOW, TILES_PER_SEQ, H,
                 sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, scs_r,
                 HEAD_DIM, BLOCK_M, BLOCK_N, HEADS_PER_PROGRAM, LOCAL, PER_SEQ, DOT_F32, HAS_KL, True)
