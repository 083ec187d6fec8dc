"""Triton RoPE straight from the fused ``Wqkv`` output, forward and backward.

Forward reads q and k from ``qkv`` ``[T, 3 * nh * hd]`` (q | k | v, head-major), rotates them
split-half in fp32 with the token's position, and writes ``q, k`` ``[T, nh, hd]`` rounded once: contiguous,
or back into ``qkv`` (``inplace``: each program loads a pair before it stores it, so the rotation reads no
value it already wrote); the caller hands out v as a strided view. In place, q, k and v are three views of one
buffer: nothing is allocated, and a training forward whose attention saves q, k, v for its backward keeps one
``[T, 3 * nh * hd]`` tensor instead of that tensor (held by v) plus a rotated q and k. In place, the kernel also
zeroes v's non-finite entries (NaN, +-inf; it reads v, and writes only those): FlashAttention-4's tiles run past a
sequence's end into the next one's rows, whose probability 0 times a NaN is NaN, so an attention fed this v needs
no cleaning pass of its own (:func:`packed_encoders.attention.flash.fa4_varlen_finite_v`). Out of place, v is
never touched.
Backward applies the inverse rotation to ``dq, dk`` and writes the whole ``dqkv`` ``[T, 3 * nh * hd]``,
copying ``dv`` into its third (zeros when v received no gradient), so no separate scatter or accumulation
pass is needed.

A program handles ``ROWS`` tokens and, per token, every (head, first-half lane) pair as one flat
axis ``j = head * HALF + lane`` padded to a power of two. ``nh`` and ``hd`` are compile-time constants;
the token count is a runtime argument that Triton does not specialise on.
"""

from __future__ import annotations

import functools

import torch
import triton.language as tl

from ._runtime import I32_END, cdiv, kernel, launch_cached, next_pow2, or_all


@functools.lru_cache(maxsize=None)
def config(num_heads: int, head_dim: int) -> tuple[int, int, int]:
    """``(BLOCK, ROWS, num_warps)``: about 2048 rotated pairs per program."""
    block = next_pow2(num_heads * (head_dim // 2))
    rows = max(1, min(16, 2048 // block))
    warps = min(8, max(2, block * rows // 256))
    return block, rows, warps


_FLT_MAX = tl.constexpr(3.4028234663852886e38)
# launch signature -> _runtime.Bound (launches that skip Triton's per-argument key; see _runtime.launch_cached)
_FWD_BOUND: dict = {}
_BWD_BOUND: dict = {}


@kernel(do_not_specialize=("n_rows",))
def _rope_fwd_kernel(QKV, COS, SIN, POS, Q, K, n_rows,
                     NH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     OUT_STRIDE: tl.constexpr, CLEAN_V: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (j < NH * HALF)[None, :]
    head = j // HALF
    lane = j % HALF
    pos = tl.load(POS + rows, mask=rmask, other=0).to(tl.int64)
    tab = pos[:, None] * HALF + lane[None, :]
    c = tl.load(COS + tab, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + tab, mask=mask, other=0.0).to(tl.float32)
    r64 = rows.to(tl.int64)[:, None]
    col = (head * HD + lane)[None, :]
    src = QKV + r64 * (3 * NH * HD) + col
    dst = r64 * OUT_STRIDE + col
    # q
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(Q + dst, (x1 * c - x2 * s).to(Q.dtype.element_ty), mask=mask)
    tl.store(Q + dst + HALF, (x2 * c + x1 * s).to(Q.dtype.element_ty), mask=mask)
    # k
    x1 = tl.load(src + NH * HD, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + NH * HD + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(K + dst, (x1 * c - x2 * s).to(K.dtype.element_ty), mask=mask)
    tl.store(K + dst + HALF, (x2 * c + x1 * s).to(K.dtype.element_ty), mask=mask)
    if CLEAN_V:  # v: non-finite entries (|x| <= max is false for NaN and inf) become 0; finite ones are not written
        zero = tl.zeros([ROWS, BLOCK], dtype=QKV.dtype.element_ty)
        v = src + 2 * NH * HD
        x1 = tl.load(v, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(v + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(v, zero, mask=mask & ~(tl.abs(x1) <= _FLT_MAX))
        tl.store(v + HALF, zero, mask=mask & ~(tl.abs(x2) <= _FLT_MAX))


@kernel(do_not_specialize=("n_rows",))
def _rope_bwd_kernel(DQ, DK, DV, COS, SIN, POS, DQKV, n_rows,
                     dq_st, dq_sh, dk_st, dk_sh, dv_st, dv_sh,
                     NH: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                     HAS_DV: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK)
    rmask = rows < n_rows
    mask = rmask[:, None] & (j < NH * HALF)[None, :]
    head = j // HALF
    lane = j % HALF
    pos = tl.load(POS + rows, mask=rmask, other=0).to(tl.int64)
    tab = pos[:, None] * HALF + lane[None, :]
    c = tl.load(COS + tab, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + tab, mask=mask, other=0.0).to(tl.float32)
    r64 = rows.to(tl.int64)[:, None]
    h64 = head.to(tl.int64)[None, :]
    lane2 = lane[None, :]
    out = DQKV + r64 * (3 * NH * HD) + (head * HD + lane)[None, :]
    # dq: the transpose of the rotation [[c, -s], [s, c]]
    g = DQ + r64 * dq_st + h64 * dq_sh + lane2
    d1 = tl.load(g, mask=mask, other=0.0).to(tl.float32)
    d2 = tl.load(g + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(out, (d1 * c + d2 * s).to(DQKV.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (d2 * c - d1 * s).to(DQKV.dtype.element_ty), mask=mask)
    # dk
    g = DK + r64 * dk_st + h64 * dk_sh + lane2
    d1 = tl.load(g, mask=mask, other=0.0).to(tl.float32)
    d2 = tl.load(g + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + NH * HD, (d1 * c + d2 * s).to(DQKV.dtype.element_ty), mask=mask)
    tl.store(out + NH * HD + HALF, (d2 * c - d1 * s).to(DQKV.dtype.element_ty), mask=mask)
    # dv passes through
    if HAS_DV:
        g = DV + r64 * dv_st + h64 * dv_sh + lane2
        v1 = tl.load(g, mask=mask, other=0.0)
        v2 = tl.load(g + HALF, mask=mask, other=0.0)
    else:
        v1 = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        v2 = v1
    tl.store(out + 2 * NH * HD, v1.to(DQKV.dtype.element_ty), mask=mask)
    tl.store(out + 2 * NH * HD + HALF, v2.to(DQKV.dtype.element_ty), mask=mask)


def _forward_signature(qkv_dtype, cos_dtype, sin_dtype, pos_dtype, num_heads: int, head_dim: int, inplace: bool,
                       t: int, pointers: int) -> tuple:
    # what the forward kernel's compiled specialisation depends on: dtypes, the constexprs (from the geometry and
    # ``inplace``), then t's 32-bit range (it is not specialised) and whether every pointer (or-ed together) is
    # 16-byte aligned
    block, rows, warps = config(num_heads, head_dim)
    stride = (3 if inplace else 1) * num_heads * head_dim
    return (qkv_dtype, cos_dtype, sin_dtype, pos_dtype, num_heads, head_dim, block, rows, warps, stride, inplace,
            t < I32_END, not pointers & 15)


def forward(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor,
            num_heads: int, head_dim: int, inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated ``q, k`` ``[T, nh, hd]`` (``qkv.dtype``) from ``qkv`` ``[T, 3 * nh * hd]``.

    ``cos, sin``: ``[P, hd // 2]`` (fp32 tables, read in fp32); ``position_ids``: ``[T]`` integers < P.
    ``inplace``: rotate q and k inside ``qkv`` (which must be contiguous) and return views of it (row stride
    ``3 * nh * hd``), and zero the non-finite entries of its v third; otherwise new contiguous tensors.
    """
    t = qkv.shape[0]
    width = num_heads * head_dim
    if inplace:
        if not qkv.is_contiguous():
            raise ValueError("in-place RoPE needs a contiguous qkv")
        parts = qkv.view(t, 3, num_heads, head_dim)
        q, k = parts[:, 0], parts[:, 1]
        out_q, out_k, stride = qkv, qkv[:, width:], 3 * width
    else:
        qkv = qkv.contiguous()
        q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        k = torch.empty_like(q)
        out_q, out_k, stride = q, k, width
    if t == 0:
        return q, k
    block, rows, warps = config(num_heads, head_dim)
    args = (qkv, cos.contiguous(), sin.contiguous(), position_ids.contiguous(), out_q, out_k, t)
    fast = sig = None
    if qkv.is_cuda:
        fast = tuple(a.data_ptr() for a in args[:6]) + (t,)
        sig = _forward_signature(qkv.dtype, args[1].dtype, args[2].dtype, args[3].dtype, num_heads, head_dim,
                                 inplace, t, or_all(fast[:6]))
    launch_cached(_FWD_BOUND, sig, _rope_fwd_kernel, qkv, (cdiv(t, rows),), args,
                  dict(NH=num_heads, HD=head_dim, HALF=head_dim // 2, BLOCK=block, ROWS=rows, OUT_STRIDE=stride,
                       CLEAN_V=inplace, num_warps=warps), fast)
    return q, k


def forward_launcher(t: int, num_heads: int, head_dim: int, position_dtype: torch.dtype, dtype: torch.dtype,
                     device: int, stream: int):
    """:func:`forward` in place for raw device pointers, all 16-byte aligned: ``launch(qkv, cos, sin,
    position_ids)`` with ``qkv`` contiguous ``[t, 3 * num_heads * head_dim]`` of ``dtype``, ``cos`` / ``sin``
    contiguous fp32 ``[P, head_dim // 2]``, ``position_ids`` ``[t]`` of ``position_dtype``; on ``stream`` of CUDA
    device ``device``. ``None`` when no tensor launch bound that signature yet (see ``_runtime.launch_cached``)."""
    rows = config(num_heads, head_dim)[1]
    width = num_heads * head_dim
    bound = _FWD_BOUND.get((device, _forward_signature(dtype, torch.float32, torch.float32, position_dtype, num_heads,
                                                       head_dim, True, t, 0)))
    if not bound:  # not bound yet (or unbindable: False)
        return None
    run = bound.at(cdiv(t, rows), 1, 1, stream)
    k_offset = width * dtype.itemsize

    def launch(qkv: int, cos: int, sin: int, position_ids: int) -> None:
        run(qkv, cos, sin, position_ids, qkv, qkv + k_offset, t)

    return launch


def backward_launcher(t: int, num_heads: int, head_dim: int, grad_dtype: torch.dtype, position_dtype: torch.dtype,
                      dtype: torch.dtype, device: int, stream: int):
    """:func:`backward` for raw device pointers, all 16-byte aligned: ``launch(dq, dk, dv, cos, sin, position_ids,
    dqkv)`` with ``dq, dk, dv`` contiguous ``[t, num_heads, head_dim]`` of ``grad_dtype``, ``cos`` / ``sin`` fp32
    tables, ``position_ids`` ``[t]`` of ``position_dtype`` and ``dqkv`` contiguous ``[t, 3 * num_heads * head_dim]``
    of ``dtype``. ``None`` when no tensor launch bound that signature yet (see ``_runtime.launch_cached``)."""
    block, rows, warps = config(num_heads, head_dim)
    strides = (num_heads * head_dim, head_dim) * 3
    f32 = torch.float32
    sig = ((grad_dtype, grad_dtype, grad_dtype, f32, f32, position_dtype, dtype), strides, num_heads, head_dim, block,
           rows, warps, True, t < I32_END, True)
    bound = _BWD_BOUND.get((device, sig))
    if not bound:
        return None
    run = bound.at(cdiv(t, rows), 1, 1, stream)

    def launch(dq: int, dk: int, dv: int, cos: int, sin: int, position_ids: int, dqkv: int) -> None:
        run(dq, dk, dv, cos, sin, position_ids, dqkv, t, *strides)

    return launch


def _last_dim_unit(g: torch.Tensor | None) -> torch.Tensor | None:
    return g if g is None or g.stride(-1) == 1 else g.contiguous()


def backward(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
             position_ids: torch.Tensor, num_heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``dqkv`` ``[T, 3 * nh * hd]`` in ``dtype`` from ``dq, dk, dv`` ``[T, nh, hd]`` (any strides; ``dv`` may be
    ``None``, meaning zero)."""
    t = dq.shape[0]
    dqkv = torch.empty((t, 3 * num_heads * head_dim), dtype=dtype, device=dq.device)
    if t == 0:
        return dqkv
    dq, dk, dv = _last_dim_unit(dq), _last_dim_unit(dk), _last_dim_unit(dv)
    block, rows, warps = config(num_heads, head_dim)
    dvs = (dv.stride(0), dv.stride(1)) if dv is not None else (0, 0)
    tensors = (dq, dk, dv if dv is not None else dq, cos.contiguous(), sin.contiguous(), position_ids.contiguous(),
               dqkv)
    ints = (t, dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), *dvs)
    fast = sig = None
    if dq.is_cuda:
        fast = tuple(a.data_ptr() for a in tensors) + ints
        # the strides are specialised ints: their values belong to the signature (t is not specialised)
        sig = (tuple(a.dtype for a in tensors), ints[1:], num_heads, head_dim, block, rows, warps, dv is not None,
               t < I32_END, not or_all(fast[:7]) & 15)
    launch_cached(_BWD_BOUND, sig, _rope_bwd_kernel, dq, (cdiv(t, rows),), tensors + ints,
                  dict(NH=num_heads, HD=head_dim, HALF=head_dim // 2, BLOCK=block, ROWS=rows, HAS_DV=dv is not None,
                       num_warps=warps), fast)
    return dqkv
