"""Attention backend resolution from host-visible shapes only (so it also holds under CUDA-graph capture).

User-facing names: ``"auto"`` (the policy), ``"flash"`` (the policy restricted to FlashAttention
implementations), ``"sdpa"``, and the concrete ``"varlen"`` (torch), ``"fa4"``, ``"triton"``.
An explicit concrete name that cannot run raises; ``auto`` falls back and reports why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import PackedEncodersError
from .backends import BACKENDS, Workload

CHOICES = ("auto", "flash", "sdpa", "varlen", "fa4", "triton")
FLASH_FAMILY = ("fa4", "varlen")


@dataclass(frozen=True)
class Policy:
    """Ordered preference rules. The first rule whose bounds hold gives the backend order to try.

    Each rule is ``(max_seqlen_at_least, total_tokens_at_least, order)``; rules are scanned in
    sequence and the last one should be a catch-all ``(0, 0, ...)``.
    """

    name: str
    rules: tuple[tuple[int, int, tuple[str, ...]], ...]

    def order(self, w: Workload) -> tuple[str, ...]:
        for min_s, min_t, order in self.rules:
            if w.max_seqlen >= min_s and w.total_tokens >= min_t:
                return order
        return ("sdpa",)


# Uncalibrated default from the H200 measurements in DESIGN.md: torch varlen_attn wins short batches
# (0.057 vs 0.100 ms at Smax 64), FA4 wins long documents (1.13 vs 1.64 ms at 128 x 2048 global).
DEFAULT_POLICY = Policy("default", ((1024, 0, ("fa4", "varlen", "sdpa")), (0, 0, ("varlen", "fa4", "sdpa"))))


@dataclass
class Decision:
    backend: str
    reasons: list[str] = field(default_factory=list)


def resolve(requested: str, w: Workload, policy: Policy | None = None) -> Decision:
    """Pick the backend for one attention call.

    Raises:
        PackedEncodersError: an unknown name, or an explicit backend that cannot run ``w``.
    """
    if requested not in CHOICES:
        raise PackedEncodersError(f"attention_backend={requested!r} is not one of {CHOICES}")
    if requested not in ("auto", "flash"):
        backend = BACKENDS.get(requested)
        if backend is None:
            raise PackedEncodersError(f"attention backend {requested!r} is not available in this build")
        reason = backend.why_not(w)
        if reason is not None:
            raise PackedEncodersError(f"attention_backend={requested!r} cannot run this batch: {reason}")
        return Decision(requested)
    order = (policy or DEFAULT_POLICY).order(w)
    if requested == "flash":
        order = tuple(n for n in order if n in FLASH_FAMILY) + tuple(n for n in FLASH_FAMILY if n not in order)
    reasons = []
    for name in order:
        backend = BACKENDS.get(name)
        reason = "not registered" if backend is None else backend.why_not(w)
        if reason is None:
            return Decision(name, reasons)
        reasons.append(f"{name}: {reason}")
    if requested == "flash":
        raise PackedEncodersError("attention_backend='flash' cannot run this batch: " + "; ".join(reasons))
    return Decision("sdpa", reasons)
