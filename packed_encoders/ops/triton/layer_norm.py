"""Triton LayerNorm and residual + LayerNorm over ``[T, H]``, forward and backward.

Rounding policy (as :mod:`packed_encoders.ops.layer_norm`): the residual sum is formed in fp32 from
the two inputs and rounded once to the residual stream's dtype; statistics, normalisation and all
gradients are computed in fp32 from that rounded sum; every output is rounded once.

Each program normalises a tile of ``ROWS`` rows held in registers (one read of the input). The
backward is persistent: a fixed number of programs stride over row tiles and each accumulates its
share of ``dw``/``db`` in fp32; the partial sums are added in fp32 afterwards. ``H`` is a compile-time
constant (a static fact of the model); the token count is a runtime argument that Triton does not
specialise on, so one compiled kernel serves every batch.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ._runtime import I32_END as _I32_END
from ._runtime import cdiv, kernel, launch_cached, next_pow2, or_all, persistent_programs, sm_count

MAX_HIDDEN = 16384  # one row lives in registers; beyond this the torch op is used
# Persistent backward: 16 warps per multiprocessor (4 programs of 4 warps, 2 of 8), all resident at once since
# config() keeps registers <= 128 per thread. A set value overrides it (benchmarks/kernels.py --sweep).
BWD_WARPS_PER_SM = 16
BWD_PROGRAMS_PER_SM: int | None = None
# Software-pipelining depth of the backward's tile loop (tl.range num_stages): the next tiles' loads are
# issued (cp.async) before the current tile is reduced, so each program keeps several rows in flight
# without holding them in registers. Measured on the H200 (residual LN backward, 64k x 768 bf16, graph
# device time, this config): 61 % of copy bandwidth with 1 stage, 82 % with 3 (the best of the sweep, 83 %,
# needs 8 resident programs per SM, which other hidden sizes' register counts do not allow); see
# docs/results/h200-kernels.md.
BWD_STAGES = 3
# Up to this many rows the forward runs 2-row tiles with 4 warps (rows x warps): a batch of queries is latency
# bound, and smaller tiles start more programs. H200, residual LayerNorm of 768 bf16 columns, graph-timed launches
# (session 10): 2.13 / 2.18 / 2.32 us at 96 / 128 / 256 rows, against 2.50 / 2.50 / 2.54 with config()'s 4 x 8.
SMALL_BATCH_ROWS = 256
SMALL_BATCH_TILE = (2, 4)
# launch signature -> _runtime.Bound (launches that skip Triton's per-argument key; see _runtime.launch_cached)
_FWD_BOUND: dict = {}
_BWD_BOUND: dict = {}


@functools.lru_cache(maxsize=None)
def config(hidden: int, elem_bytes: int = 2, backward: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_N, ROWS, num_warps)`` for a hidden size: tiles of about 8 KB per tensor in the forward and
    4 KB in the backward (which holds more live values per element), so registers stay at or below 128 per
    thread and 16 warps of the persistent backward fit on a multiprocessor (tests/test_kernels_compile_sm90.py
    checks this on the compiled sm_90 code)."""
    block_n = next_pow2(hidden)
    budget = (4096 if backward else 8192) // elem_bytes
    rows = max(1, min(4 if backward else 16, budget // block_n))  # pipelined stages multiply a tile's registers
    warps = min(16, max(4, block_n * rows // 512))
    return block_n, rows, warps


@kernel(do_not_specialize=("n_rows",))
def _layer_norm_fwd_kernel(X, D, W, B, S, Y, MEAN, RSTD, n_rows, eps,
                           N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                           HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STATS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        d = tl.load(D + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + d).to(S.dtype.element_ty)  # the policy: round the sum to the stream dtype first
        tl.store(S + offs, s, mask=mask)
        x = s.to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(xc * xc, axis=1) / N
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        y = y * w[None, :]
    if HAS_B:
        b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        y = y + b[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    if STATS:  # kept for a backward
        tl.store(MEAN + rows, mean, mask=rmask)
        tl.store(RSTD + rows, rstd, mask=rmask)


@kernel(do_not_specialize=("n_rows", "n_tiles", "n_programs"))
def _layer_norm_bwd_kernel(DY, X, W, MEAN, RSTD, DRES, DX, DX2, DW, DB, n_rows, n_tiles, n_programs,
                           N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                           HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_DRES: tl.constexpr, HAS_DX2: tl.constexpr,
                           STAGES: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for tile in tl.range(pid, n_tiles, n_programs, num_stages=STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=1) / N
        c2 = tl.sum(wdy, axis=1) / N
        dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if HAS_DRES:  # the gradient reaching the residual output joins here (s feeds both)
            dx += tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DX2:
            tl.store(DX2 + offs, dx.to(DX2.dtype.element_ty), mask=mask)
        if HAS_W:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_B:
            db_acc += tl.sum(dy, axis=0)
    if HAS_W:
        tl.store(DW + pid * N + cols, dw_acc, mask=cmask)
    if HAS_B:
        tl.store(DB + pid * N + cols, db_acc, mask=cmask)


def _forward_shape(t: int, n: int, elem_bytes: int) -> tuple[int, int, int]:
    block_n, rows, warps = config(n, elem_bytes)
    if t <= SMALL_BATCH_ROWS and block_n <= 1024:
        rows, warps = SMALL_BATCH_TILE
    return block_n, rows, warps


def _forward_signature(*facts_then_t_and_pointers) -> tuple:
    # what the compiled specialisation depends on: dtypes, sizes, flags, then n_rows' 32-bit range (it is not
    # specialised) and whether every pointer (or-ed together) is 16-byte aligned
    *facts, t, pointers = facts_then_t_and_pointers
    return (*facts, t < _I32_END, not pointers & 15)


def forward_launcher(t: int, n: int, delta: bool, weight: bool, bias: bool, dtype: torch.dtype, device: int,
                     stream: int, *, dtypes: tuple | None = None, stats: bool = False):
    """:func:`forward` for raw device pointers of contiguous ``[t, n]`` tensors, 16-byte aligned:
    ``launch(x, delta, weight, bias, s, y, eps)`` on ``stream`` of CUDA device ``device`` (``delta``, ``weight``,
    ``bias``: whether those are present; an absent one's pointer is ignored, pass ``x``'s; ``s``: where the residual
    sum goes, ``x`` itself works, ignored without ``delta``), or with ``stats``: ``launch(x, delta, weight, bias, s,
    y, mean, rstd, eps)``, ``mean`` / ``rstd`` fp32 ``[t]``. ``dtypes``: ``(x, delta, weight, bias, s, y)``'s
    dtypes (an absent input's is ``x``'s, an absent ``s``'s is ``y``'s); ``None``: every one ``dtype``. ``None``
    when no tensor launch bound that signature yet (see ``_runtime.launch_cached``)."""
    x_dt, d_dt, w_dt, b_dt, s_dt, y_dt = dtypes or (dtype,) * 6
    block_n, rows, warps = _forward_shape(t, n, max(x_dt.itemsize, y_dt.itemsize))
    sig = _forward_signature(x_dt, d_dt, w_dt, b_dt, s_dt, y_dt, torch.float32 if stats else y_dt, n, block_n, rows,
                             warps, delta, weight, bias, stats, t, 0)
    bound = _FWD_BOUND.get((device, sig))
    if not bound:  # not bound yet (or unbindable: False)
        return None
    run = bound.at(cdiv(t, rows), 1, 1, stream)
    if stats:
        def launch_stats(x: int, d: int, w: int, b: int, s: int, y: int, mean: int, rstd: int, eps: float) -> None:
            run(x, d, w, b, s, y, mean, rstd, t, eps)

        return launch_stats

    def launch(x: int, d: int, w: int, b: int, s: int, y: int, eps: float) -> None:
        run(x, d, w, b, s, y, y, y, t, eps)  # (mean, rstd: unused without statistics)

    return launch


def forward(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, bias: torch.Tensor | None,
            eps: float, out_dtype: torch.dtype, res_dtype: torch.dtype | None = None, stats: bool = True,
            out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None):
    """LayerNorm (``delta is None``) or residual + LayerNorm of ``x`` ``[T, H]``.

    Args:
        x, delta: ``[T, H]`` fp32/bf16/fp16 (may differ); weight, bias: ``[H]`` or ``None``.
        out_dtype: dtype of the normalised output.
        res_dtype: dtype of the residual sum ``s`` (required with ``delta``).

        stats: compute ``mean`` and ``rstd`` (for a backward); ``False`` returns ``None`` for both.
        out: a contiguous ``[T, H]`` tensor of ``out_dtype`` that ``y`` is written into (not checked), or ``None``.
        residual_out: a contiguous ``[T, H]`` tensor of ``res_dtype`` that ``s`` is written into (not checked; ``x``
            itself works: each program reads its rows before writing them), or ``None``.

    Returns:
        ``(s, y, mean, rstd)``: ``s`` ``[T, H]`` (``None`` without ``delta``), ``y`` ``[T, H]``,
        ``mean`` and ``rstd`` fp32 ``[T]``.
    """
    t, n = x.shape
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty((t, n), dtype=out_dtype, device=x.device) if out is None else out
    mean = rstd = None
    if stats:
        mean = torch.empty(t, dtype=torch.float32, device=x.device)
        rstd = torch.empty(t, dtype=torch.float32, device=x.device)
    s = None
    if delta is not None:
        if not delta.is_contiguous():
            delta = delta.contiguous()
        s = torch.empty((t, n), dtype=res_dtype, device=x.device) if residual_out is None else residual_out
    if t == 0:
        return s, y, mean, rstd
    block_n, rows, warps = _forward_shape(t, n, max(x.element_size(), y.element_size()))
    eps = float(eps)
    d, w, b, ss = (delta if delta is not None else x, weight if weight is not None else x,
                   bias if bias is not None else x, s if s is not None else y)
    m, r = (mean, rstd) if stats else (y, y)
    args = (x, d, w, b, ss, y, m, r, t, eps)
    fast = sig = None
    if x.is_cuda:
        fast = (x.data_ptr(), d.data_ptr(), w.data_ptr(), b.data_ptr(), ss.data_ptr(), y.data_ptr(), m.data_ptr(),
                r.data_ptr(), t, eps)
        sig = _forward_signature(x.dtype, d.dtype, w.dtype, b.dtype, ss.dtype, y.dtype, m.dtype, n, block_n, rows,
                                 warps, delta is not None, weight is not None, bias is not None, stats, t,
                                 or_all(fast[:8]))
    launch_cached(_FWD_BOUND, sig, _layer_norm_fwd_kernel, x, (cdiv(t, rows),), args,
                  dict(N=n, BLOCK_N=block_n, ROWS=rows, HAS_RES=delta is not None, HAS_W=weight is not None,
                       HAS_B=bias is not None, STATS=stats, num_warps=warps), fast)
    return s, y, mean, rstd


def backward_programs(t: int, n: int, elem_bytes: int, device: int) -> int:
    """How many programs :func:`backward` launches for ``t`` rows of ``n`` (the rows of its ``[P, n]`` partial
    sums); ``elem_bytes``: the larger of ``x``'s and ``dy``'s element sizes."""
    _, rows, warps = config(n, elem_bytes, backward=True)
    per_sm = BWD_PROGRAMS_PER_SM or max(1, BWD_WARPS_PER_SM // warps)
    return max(1, min(per_sm * sm_count(device), cdiv(t, rows)))


def backward_launcher(t: int, n: int, dtypes: tuple, weight: bool, bias: bool, dres: bool, dx2: bool, device: int,
                      stream: int):
    """:func:`backward` with ``reduce=False`` for raw device pointers of contiguous tensors, 16-byte aligned:
    ``launch(dy, x, weight, mean, rstd, dres, dx, dx2, dw, db)``, ``dw`` / ``db`` fp32 ``[P, n]`` with ``P =``
    :func:`backward_programs` (an absent one's pointer is ignored: pass ``mean``'s; an absent ``weight``: ``x``'s,
    ``dres``: ``dy``'s, ``dx2``: ``dx``'s). ``dtypes``: ``(dy, x, weight, dres, dx, dx2)``'s dtypes, an absent
    one's as the pointer passed for it. ``t > 0``. ``None`` when no tensor launch bound that signature yet."""
    dy_dt, x_dt, w_dt, dres_dt, dx_dt, dx2_dt = dtypes
    block_n, rows, warps = config(n, max(x_dt.itemsize, dy_dt.itemsize), backward=True)
    tiles = cdiv(t, rows)
    programs = backward_programs(t, n, max(x_dt.itemsize, dy_dt.itemsize), device)
    f32 = torch.float32
    sig = ((dy_dt, x_dt, w_dt, f32, f32, dres_dt, dx_dt, dx2_dt, f32, f32), n, block_n, rows, warps, weight, bias,
           dres, dx2, BWD_STAGES, programs < _I32_END, True)
    bound = _BWD_BOUND.get((device, sig))
    if not bound:
        return None
    run = bound.at(programs, 1, 1, stream)

    def launch(dy: int, x: int, w: int, mean: int, rstd: int, dr: int, dx: int, d2: int, dw: int, db: int) -> None:
        run(dy, x, w, mean, rstd, dr, dx, d2, dw, db, t, tiles, programs)

    return launch


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
             rstd: torch.Tensor, dres: torch.Tensor | None, has_bias: bool, dx_dtype: torch.dtype,
             dx2_dtype: torch.dtype | None, reduce: bool = True):
    """Backward of :func:`forward` given the normalised input ``x`` (for residual LN: the sum ``s``).

    ``dres`` (the incoming gradient of ``s``) is added into ``dx``. With ``dx2_dtype`` the same
    gradient is also written in a second dtype (the residual's two inputs may differ in dtype).

    Returns:
        ``(dx, dx2, dw, db)``: ``dx`` ``[T, H]`` in ``dx_dtype``; ``dx2`` or ``None``; ``dw``/``db`` fp32
        ``[H]`` (``None`` without weight / bias), reduced in fp32; ``reduce=False``: ``[P, H]``, the programs' partial
        sums (a caller with many of them sums them in one launch).
    """
    t, n = x.shape
    x, dy = x.contiguous(), dy.contiguous()
    if dres is not None:
        dres = dres.contiguous()
    dx = torch.empty((t, n), dtype=dx_dtype, device=x.device)
    dx2 = None if dx2_dtype is None else torch.empty((t, n), dtype=dx2_dtype, device=x.device)
    block_n, rows, warps = config(n, max(x.element_size(), dy.element_size()), backward=True)
    tiles = cdiv(t, rows)
    programs = persistent_programs(x, tiles, BWD_PROGRAMS_PER_SM or max(1, BWD_WARPS_PER_SM // warps))
    alloc = torch.empty if t > 0 else torch.zeros  # every program stores its partial row when t > 0
    dw_part = alloc((programs, n), dtype=torch.float32, device=x.device) if weight is not None else None
    db_part = alloc((programs, n), dtype=torch.float32, device=x.device) if has_bias else None
    if t > 0:
        args = (dy, x, weight if weight is not None else x, mean, rstd, dres if dres is not None else dy,
                dx, dx2 if dx2 is not None else dx, dw_part if dw_part is not None else mean,
                db_part if db_part is not None else mean, t, tiles, programs)
        fast = sig = None
        if x.is_cuda:
            fast = tuple(a.data_ptr() for a in args[:10]) + (t, tiles, programs)
            sig = (tuple(a.dtype for a in args[:10]), n, block_n, rows, warps, weight is not None, has_bias,
                   dres is not None, dx2 is not None, BWD_STAGES, programs < _I32_END, not or_all(fast[:10]) & 15)
        launch_cached(_BWD_BOUND, sig, _layer_norm_bwd_kernel, x, (programs,), args,
                      dict(N=n, BLOCK_N=block_n, ROWS=rows, HAS_W=weight is not None, HAS_B=has_bias,
                           HAS_DRES=dres is not None, HAS_DX2=dx2 is not None, STAGES=BWD_STAGES, num_warps=warps),
                      fast)
    if not reduce:
        return dx, dx2, dw_part, db_part
    dw = dw_part.sum(0) if dw_part is not None else None
    db = db_part.sum(0) if db_part is not None else None
    return dx, dx2, dw, db
