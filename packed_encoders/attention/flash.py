"""FlashAttention backends: torch's ``varlen_attn`` (FlashAttention-2 inside torch >= 2.10) and
FlashAttention-4 (its compiled kernels through :mod:`.fa4_direct` where that serves a call, else
``flash_attn.cute.flash_attn_varlen_func``). Both prune key tiles outside ``window_size=(w, w)`` on local layers;
both have a backward.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.autograd.function import once_differentiable

from . import fa4_direct


@functools.lru_cache(maxsize=None)
def torch_varlen_status() -> str | None:
    """``None`` when torch's varlen_attn with ``window_size`` is usable, else the reason it is not."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:  # pragma: no cover - depends on the torch build
        return f"torch.nn.attention.varlen is unavailable ({exc.__class__.__name__}: {exc})"
    if "window_size" not in inspect.signature(varlen_attn).parameters:
        return f"torch {torch.__version__} varlen_attn has no window_size (needs torch >= 2.10)"
    if not torch.cuda.is_available():
        return "torch varlen_attn needs CUDA"
    return None


@functools.lru_cache(maxsize=None)
def fa4_status() -> str | None:
    """``None`` when FlashAttention-4 imports and the current GPU is sm_90 or newer, else why not."""
    if not torch.cuda.is_available():
        return "FlashAttention-4 needs CUDA"
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return f"FlashAttention-4 needs sm_90 or newer (this GPU is sm_{major}x)"
    try:
        from flash_attn.cute import flash_attn_varlen_func  # noqa: F401
    except Exception as exc:
        return f"flash_attn.cute does not import ({exc.__class__.__name__}: {exc})"
    return None


def key_layout(cu_seqlens: torch.Tensor, key_lens: torch.Tensor, total: int):
    """Query-only tails (``key_lens``, ColBERT query expansion) as FlashAttention's own key sequences, made on the
    device (no sync): ``(cu_seqlens_k int32 [N + 1], src int64 [total], real bool [total])``. Row ``j`` of
    ``k.index_select(0, src)`` is token ``src[j]``: the first ``key_lens[s]`` tokens of sequence ``s`` become rows
    ``cu_seqlens_k[s]:cu_seqlens_k[s + 1]``; rows past the last key (``real`` False) repeat token 0 and are never
    read. A ``key_lens`` entry past its sequence's end counts that sequence's tokens only (a CUDA graph's static
    ``key_lens`` keeps the bucket's length for its dummy sequences)."""
    n = key_lens.numel()
    cu_k = torch.zeros(n + 1, dtype=torch.int32, device=key_lens.device)
    cu_k[1:] = torch.minimum(key_lens.long(), (cu_seqlens[1:] - cu_seqlens[:-1]).long()).cumsum(0)
    ends = cu_k[1:].long()
    j = torch.arange(total, device=key_lens.device)
    seq = torch.searchsorted(ends, j, right=True).clamp_(max=max(n - 1, 0))
    real = j < ends[-1]
    src = torch.where(real, cu_seqlens.long()[seq] + j - cu_k.long()[seq], 0)
    return cu_k, src, real


def _gather_keys(k, v, cu_seqlens, key_lens, window):
    """``(cu_seqlens_k, k, v, src, keep)``: the keys only (:func:`key_layout`) and what scatters their gradients
    back (:func:`_scatter_keys`); global attention only: with fewer keys than queries FlashAttention aligns a window
    to a sequence's last key, not its first."""
    if window is not None:
        raise ValueError("key_lens with a local window: FlashAttention aligns the window to the last key")
    cu_k, src, real = key_layout(cu_seqlens, key_lens, k.shape[0])
    keep = real.view(-1, 1, 1)
    # torch.where, not a product: the backward zeroes the rows past the last key, whose key / value gradients
    # the kernel leaves unwritten, before they are added into token 0's
    return cu_k, torch.where(keep, k.index_select(0, src), 0), torch.where(keep, v.index_select(0, src), 0), src, keep


def _keys_only(k, v, cu_seqlens, key_lens, window):
    """``(cu_seqlens_k, k, v)`` of :func:`_gather_keys`, differentiated by autograd."""
    return _gather_keys(k, v, cu_seqlens, key_lens, window)[:3]


def _scatter_keys(d: torch.Tensor, src: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The gradient of the tokens from ``d``, that of :func:`_gather_keys`'s gathered keys or values (the backward
    of its ``index_select`` and ``torch.where``; no sync)."""
    return torch.zeros_like(d).index_add_(0, src, torch.where(keep, d, 0))


def torch_varlen(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
                 dropout_p: float = 0.0, key_lens: torch.Tensor | None = None) -> torch.Tensor:
    """torch ``varlen_attn``; ``q, k, v`` ``[T, heads, head_dim]`` bf16/fp16 CUDA, ``cu_seqlens`` int32;
    ``key_lens`` (int32 ``[N]``, global layers only): only the first ``key_lens[s]`` tokens of sequence ``s`` are
    keys (a query with none gets zeros)."""
    from torch.nn.attention.varlen import varlen_attn

    if dropout_p:
        raise ValueError("torch varlen_attn has no attention dropout")
    cu_k = cu_seqlens
    if key_lens is not None:
        cu_k, k, v = _keys_only(k, v, cu_seqlens, key_lens, window)
    ws = (-1, -1) if window is None else (int(window), int(window))
    return varlen_attn(q, k, v, cu_seqlens, cu_k, int(max_seqlen), int(max_seqlen),
                       scale=scale, window_size=ws)


def torch_varlen_direct(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
                        dropout_p: float = 0.0, key_lens: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`torch_varlen` without ``varlen_attn``'s Python custom ops, for the packed forward's unchecked no-grad
    path and its per-block training path: the FlashAttention-2 forward op that ``varlen_attn`` runs
    (``aten::_flash_attention_forward``), called directly. With gradients it records aten's own C++ autograd node,
    whose backward is the ``aten::_flash_attention_backward`` that ``varlen_attn``'s backward op calls. Same kernels,
    same outputs and gradients; the custom ops' dispatch, Python autograd wrapper and per-call ``rng_state``
    allocation cost ~40 us of host time per forward on the H200 machine, and a ModernBERT-base forward makes 22
    calls. ``torch.compile`` traces ``varlen_attn`` (its fake kernels). No dropout."""
    if dropout_p:
        raise ValueError("torch varlen_attn has no attention dropout")
    if torch.compiler.is_compiling():
        return torch_varlen(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale, key_lens=key_lens)
    cu_k = cu_seqlens
    if key_lens is not None:
        cu_k, k, v = _keys_only(k, v, cu_seqlens, key_lens, window)
    ws = -1 if window is None else int(window)
    return _FLASH_FORWARD(q, k, v, cu_seqlens, cu_k, max_seqlen, max_seqlen, 0.0, False, False, scale=scale,
                          window_size_left=ws, window_size_right=ws)[0]


_FLASH_FORWARD = torch.ops.aten._flash_attention_forward.default
_FLASH_BACKWARD = torch.ops.aten._flash_attention_backward.default


def torch_varlen_forward_saving(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
                                key_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple]:
    """:func:`torch_varlen_direct` outside autograd, for a caller that runs the backward itself (the training stack,
    ``model/stack.py``): ``(out [T, heads, head_dim], saved)``, ``saved`` what :func:`torch_varlen_backward` reads
    (``q, k, v``, the output, its log-sum-exp, the RNG state) — the pair of ops aten's own autograd node runs;
    with ``key_lens`` (global attention only) the gathered keys and what scatters their gradients back."""
    ws = -1 if window is None else int(window)
    cu_k, gather = cu_seqlens, None
    if key_lens is not None:
        cu_k, k, v, *gather = _gather_keys(k, v, cu_seqlens, key_lens, window)
    out, lse, seed, offset, _ = _FLASH_FORWARD(q, k, v, cu_seqlens, cu_k, max_seqlen, max_seqlen, 0.0, False,
                                               False, scale=scale, window_size_left=ws, window_size_right=ws)
    return out, (q, k, v, out, lse, seed, offset, cu_seqlens, cu_k, max_seqlen, scale, ws, gather)


def torch_varlen_backward(dout: torch.Tensor, saved: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`torch_varlen_forward_saving` for the output gradient ``dout``."""
    q, k, v, out, lse, seed, offset, cu_seqlens, cu_k, max_seqlen, scale, ws, gather = saved
    dq, dk, dv = _FLASH_BACKWARD(dout, q, k, v, out, lse, cu_seqlens, cu_k, max_seqlen, max_seqlen, 0.0, False,
                                 seed, offset, scale=scale, window_size_left=ws, window_size_right=ws)
    if gather is not None:
        dk, dv = _scatter_keys(dk, *gather), _scatter_keys(dv, *gather)
    return dq, dk, dv


def fa4_varlen(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
               dropout_p: float = 0.0) -> torch.Tensor:
    """FlashAttention-4 varlen; same contract as :func:`torch_varlen`."""
    # FA4's key / value tiles run past a sequence's end into the next sequence's rows; those keys get probability 0,
    # but 0 * NaN is NaN, so one non-finite value would reach every sequence sharing its tile. A token with a
    # non-finite v has non-finite q and k too (everything after a LayerNorm of it is NaN), so its own sequence
    # still gets NaN through its scores, as stock does; only the cross-sequence products are cleaned.
    v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
    return fa4_varlen_finite_v(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale, dropout_p=dropout_p)


def fa4_varlen_finite_v(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
                        dropout_p: float = 0.0) -> torch.Tensor:
    """:func:`fa4_varlen` for a ``v`` whose non-finite entries the caller has zeroed already (the in-place Triton
    RoPE does, :func:`packed_encoders.ops.triton.rope.forward`): no cleaning pass, and no cleaned copy of ``v``
    for a backward to keep. The compiled kernels are called directly where :mod:`.fa4_direct` serves the call
    (the same kernels as the public entry point, without its per-call planning), else through
    ``flash_attn_varlen_func``."""
    if dropout_p:
        raise ValueError("FlashAttention-4 has no attention dropout")
    if not torch.compiler.is_compiling():
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            got = fa4_direct.forward(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale)
            if got is not None:
                return got[0]
        elif all(fa4_direct.aligned(t) for t in (q, k, v)) and \
                fa4_direct.kernels(q, window, scale, max_seqlen, cu_seqlens.shape[0] - 1, True) is not None:
            return _FA4Direct.apply(q, k, v, cu_seqlens, max_seqlen, window, scale)
    from flash_attn.cute import flash_attn_varlen_func

    ws = (None, None) if window is None else (int(window), int(window))
    with fa4_direct.quiet_compile():  # (its backward compiles under autograd, outside: the warning may show there)
        out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                                     max_seqlen_q=int(max_seqlen), max_seqlen_k=int(max_seqlen),
                                     softmax_scale=scale, causal=False, window_size=ws)
    return out[0] if isinstance(out, tuple) else out


def fa4_forward_saving(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
                       out: torch.Tensor | None = None,
                       lse: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple] | None:
    """:func:`fa4_varlen_finite_v` outside autograd, for a caller that runs the backward itself (the training
    stack): ``(out [T, heads, head_dim], saved)`` for :func:`fa4_backward`, or ``None`` where :mod:`.fa4_direct`
    does not serve the call (the caller takes another backend). ``out`` / ``lse``: buffers to write into
    (:func:`.fa4_direct.forward`)."""
    got = fa4_direct.forward(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale, backward=True, out=out,
                             lse=lse)
    if got is None:
        return None
    return got[0], (q, k, v, got[0], got[1], cu_seqlens, max_seqlen, window, scale)


def fa4_backward(dout: torch.Tensor, saved: tuple, grads: tuple | None = None,
                 scratch: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`fa4_forward_saving` for the output gradient ``dout`` (``grads``, ``scratch``: as
    :func:`.fa4_direct.backward` takes them)."""
    q, k, v, out, lse, cu_seqlens, max_seqlen, window, scale = saved
    return fa4_direct.backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, window=window, scale=scale,
                               grads=grads, scratch=scratch)


class _FA4Direct(torch.autograd.Function):
    """FlashAttention-4 forward and backward through :mod:`.fa4_direct` (the caller checked it serves the call)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, window, scale):
        out, saved = fa4_forward_saving(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale)
        ctx.save_for_backward(q, k, v, out, saved[4], cu_seqlens)
        ctx.args = (max_seqlen, window, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = fa4_backward(dout, (q, k, v, out, lse, cu_seqlens, *ctx.args))
        return dq, dk, dv, None, None, None, None
