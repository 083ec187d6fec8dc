"""Triton LoRA merge: ``W + s * B @ A`` ``[N, K]`` in one pass, for the merged adapter weights of calls without
gradients (:func:`packed_encoders.model.calls.merged_weights`).

The rank-``r`` product is summed in fp32 (one dot per tile) from the stored factors (fp32 in peft on a bf16
model, or the weight's dtype) and added to ``W`` in fp32; the result is rounded once. One launch reads ``W`` once
and writes the result once: the torch ops it replaces cast the factors, copy ``W`` and run an ``addmm`` (four
launches per slot, three passes over ``W``-sized memory), which dominated a short call's GPU time with adapters on
every slot.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._runtime import I32_END, cdiv, kernel, launch_cached, or_all

_BOUND: dict = {}  # launch signature -> _runtime.Bound
BLOCK_N, BLOCK_K, WARPS = 16, 128, 4
MAX_RANK = 128  # the rank is a compile-time constant (a compile each); beyond this the torch ops serve


@kernel()
def _merge_kernel(W, A, B, Y, scale, N, K, R: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ranks = tl.arange(0, R_PAD)
    row_ok, col_ok, rank_ok = rows < N, cols < K, ranks < R
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    w = tl.load(W + offsets, mask=mask, other=0.0)  # (first: in flight while the product is summed)
    b = tl.load(B + rows[:, None] * R + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
    a = tl.load(A + ranks[:, None] * K + cols[None, :], mask=rank_ok[:, None] & col_ok[None, :], other=0.0)
    # the [BLOCK_N, r] x [r, BLOCK_K] product as one dot in fp32 FMAs ("ieee": no TF32 rounding of the factors;
    # the padded ranks are zeros); on the H100 ~40% less time than a loop of r outer products (r = 16, base shapes)
    acc = tl.dot(b.to(tl.float32), a.to(tl.float32), input_precision="ieee")
    tl.store(Y + offsets, (w.to(tl.float32) + scale * acc).to(Y.dtype.element_ty), mask=mask)


def takes(weight: torch.Tensor, a: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`merge` runs a merge of these sizes into ``dtype``: a floating result, rank at most
    :data:`MAX_RANK`, fewer than 2**31 elements. The operands' dtypes and devices are the op set's check
    (``ops.fused._unsupported``, as for every Triton op)."""
    return (dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 < a.shape[0] <= MAX_RANK
            and weight.numel() < I32_END)


def merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``weight + scale * b @ a`` in ``dtype``: ``weight`` ``[N, K]``, ``a`` ``[r, K]`` (peft's ``lora_A``), ``b``
    ``[N, r]`` (``lora_B``), any of fp32 / bf16 / fp16 each, on one device (:func:`takes` first); a new tensor, the
    operands untouched. CUDA tensors, or CPU tensors under ``TRITON_INTERPRET=1``."""
    n, k = weight.shape
    r = a.shape[0]
    weight, a, b = weight.contiguous(), a.contiguous(), b.contiguous()
    y = torch.empty((n, k), dtype=dtype, device=weight.device)
    if n == 0 or k == 0:
        return y
    r_pad = max(16, 1 << (r - 1).bit_length())  # a dot's inner size: a power of two, at least 16
    block_k = BLOCK_K if r_pad <= 64 else BLOCK_K // 2  # (the [r, BLOCK_K] fp32 tile of A within shared memory)
    grid = (cdiv(n, BLOCK_N), cdiv(k, block_k))
    args = (weight, a, b, y, float(scale), n, k)
    fast = sig = None
    if weight.is_cuda:
        ptrs = (weight.data_ptr(), a.data_ptr(), b.data_ptr(), y.data_ptr())
        fast = (*ptrs, float(scale), n, k)
        # Triton specialises ints on value 1 and divisibility by 16: N and K are keyed as they are
        sig = (weight.dtype, a.dtype, b.dtype, dtype, r, n, k, not or_all(ptrs) & 15)
    launch_cached(_BOUND, sig, _merge_kernel, weight, grid, args,
                  dict(R=r, R_PAD=r_pad, BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=WARPS), fast)
    return y


__all__ = ["MAX_RANK", "merge", "takes"]
