"""Registry of packed attention backends and their envelopes.

Every backend takes ``q, k, v`` ``[T, heads, head_dim]``, ``cu_seqlens`` int32 ``[N + 1]``, the host int
``max_seqlen``, ``window`` (half window or ``None`` for global) and ``scale``; it returns ``[T, heads, head_dim]``.
Backends with ``supports_key_lens`` also take ``key_lens`` int32 ``[N]``: only the first ``key_lens[s]`` tokens
of each sequence are keys (the rest are query-only, see ``PackedBatch.key_lens``; with ``key_lens_local`` False,
on global layers only). Backends with ``fuses_rope`` also take ``rope=(cos, sin, rows)`` with unrotated ``q, k``
and apply the rotary embedding themselves, forward only (:meth:`Backend.fuse_rope` says when the packed forward
hands it over).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..tuning import Tuning
from . import flash, sdpa

# The default of the fused-RoPE switch for direct callers of :meth:`Backend.fuse_rope`; a packed model passes its
# own (``PACKED_ENCODERS_FUSED_ROPE``, read at ``pack()`` into the plan's Rules; =0 keeps the separate RoPE op).
FUSED_ROPE = Tuning().fused_rope
# Calls of this many tokens or more rotate q, k of local layers in a separate pass even where the backend could
# fuse RoPE (a graph counts its bucket's tokens; global layers stay fused: not measured there). The
# fused kernel rotates each key tile again for every query tile that visits it (about 3 at ModernBERT's window),
# which costs more than one separate pass once launches no longer matter. H200, ModernBERT-base, bf16:
# indexing b128 (~120k tokens) ran 0.6-3.6 % faster unfused (3 alternating rounds), and the local-attention
# kernel alone at 169k tokens took 820 us fused against 523 us + the separate pass (~240 us). Documents b8
# (~7.4k tokens, graphs) ran the same either way (1,625 / 1,632 vs 1,630 / 1,634 seq/s), and short batches
# keep the launch it saves.
FUSED_ROPE_MAX_TOKENS = 16384


@dataclass(frozen=True)
class Workload:
    """Host-visible description of one attention call (no device values)."""

    num_seqs: int
    total_tokens: int
    max_seqlen: int
    heads: int
    head_dim: int
    window: int | None
    grad: bool
    dtype: torch.dtype
    device_type: str
    dropout: bool = False
    query_only: bool = False  # some tokens attend without being attended to (key_lens)
    graph: bool = False  # captured into a CUDA graph: only GPU time counts (the policy's graph tables)


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable
    has_backward: bool
    supports_dropout: bool
    availability: Callable[[], str | None]
    envelope: Callable[[Workload], str | None]
    supports_key_lens: bool = False
    # key_lens on local layers too (False: global layers only, and local ones whose window covers the call)
    key_lens_local: bool = True
    fuses_rope: bool = False  # fn takes rope=(cos, sin, rows) with unrotated q, k (forward only, no grad)
    # fn without its per-call argument checks, for forwards that produced q, k, v, cu_seqlens and the RoPE tables
    # themselves in the layouts fn checks for (model/plan.py's unchecked no-grad path); None: fn is cheap already
    direct: Callable | None = None
    # ``direct`` also records autograd (the op's own C++ backward node), so the per-block training forward
    # (model/blocks.py), which builds q, k, v itself, calls it too
    direct_grad: bool = False
    # fn for a v whose non-finite entries the caller zeroed (an op set's rope_finite_v), skipping fn's own cleaning
    # pass; None: fn cleans nothing
    finite_v: Callable | None = None

    def fuse_rope(self, grad: bool, total_tokens: int | None = None, *, enabled: bool | None = None,
                  max_tokens: int | None = None) -> bool:
        """Whether the packed forward should hand RoPE to ``fn`` rather than rotate ``q, k`` first: a backend
        that fuses it, no gradient wanted, the switch on (``enabled``; default :data:`FUSED_ROPE`), and fewer than
        ``max_tokens`` (default :data:`FUSED_ROPE_MAX_TOKENS`) tokens in the call. ``total_tokens``: the call's
        tokens (a graph's bucket size when captured); the forward passes it for local layers only, where the rule
        was measured. ``None``, or a call traced by ``torch.compile`` (sizes not checked, so that no recompile
        guard sits at the threshold): fused."""
        if not (self.fuses_rope and not grad and (FUSED_ROPE if enabled is None else enabled)):
            return False
        if total_tokens is None or torch.compiler.is_compiling():
            return True
        return total_tokens < (FUSED_ROPE_MAX_TOKENS if max_tokens is None else max_tokens)

    def why_not(self, w: Workload) -> str | None:
        """``None`` when this backend can run ``w``, else the reason it cannot."""
        reason = self.availability()
        if reason is None and w.grad and not self.has_backward:
            reason = f"{self.name} has no backward (gradients are enabled)"
        if reason is None and w.dropout and not self.supports_dropout:
            reason = f"{self.name} cannot apply attention dropout (attention_dropout > 0 in train mode)"
        if reason is None and w.query_only and not self.supports_key_lens:
            reason = f"{self.name} cannot mask query-only tokens out of the keys (ColBERT query expansion)"
        if reason is None and w.query_only and w.window is not None and not self.key_lens_local:
            reason = (f"{self.name} masks query-only tokens out of the keys on global layers only (with fewer keys "
                      "than queries it aligns a window to a sequence's last key)")
        return reason if reason is not None else self.envelope(w)


def _flash_envelope(w: Workload) -> str | None:
    if w.device_type != "cuda":
        return f"flash attention needs CUDA tensors (got {w.device_type})"
    if w.dtype not in (torch.float16, torch.bfloat16):
        return f"flash attention needs fp16/bf16 activations (got {w.dtype}); fp32 runs on sdpa"
    if w.head_dim % 8 or w.head_dim > 256:
        return f"flash attention needs head_dim a multiple of 8 and <= 256 (got {w.head_dim})"
    return None


def _fa4_envelope(w: Workload) -> str | None:
    reason = _flash_envelope(w)
    if reason is None and w.head_dim not in (64, 96, 128, 192, 256):
        return f"FlashAttention-4 compiles head_dim 64/96/128/192/256 (got {w.head_dim})"
    return reason


BACKENDS: dict[str, Backend] = {
    "sdpa": Backend("sdpa", sdpa.sdpa_varlen, True, True, lambda: None, lambda w: None, supports_key_lens=True),
    "varlen": Backend("varlen", flash.torch_varlen, True, False, flash.torch_varlen_status, _flash_envelope,
                      supports_key_lens=True, key_lens_local=False, direct=flash.torch_varlen_direct,
                      direct_grad=True),
    "fa4": Backend("fa4", flash.fa4_varlen, True, False, flash.fa4_status, _fa4_envelope,
                   finite_v=flash.fa4_varlen_finite_v),
}


def register(backend: Backend) -> None:
    """Add a backend (the in-tree Triton kernel registers itself this way)."""
    BACKENDS[backend.name] = backend
