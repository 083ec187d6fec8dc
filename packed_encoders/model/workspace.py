"""Byte buffers of the raw-pointer paths (:mod:`.pointers`, :mod:`.stack_pointers`), sized in coarse classes.

Those paths take a call's activations and transients as a few large byte buffers from the caching allocator, each
sized by the call's token count, which varies from batch to batch. A cached block serves only requests no larger
than itself, so a batch larger than every one before it allocates new blocks, and the smaller ones stay cached: on
the H200, ModernBERT-base training on 16 documents of 14.6k-16.2k tokens per step held 13.6 GiB reserved for a peak
of 9.2 GiB allocated (the per-layer buffers in two sets of 22 segments, 204 and 214 MiB). Each request is rounded up
to one of four size classes per power of two (at most 25 % more bytes, ~11 % on average), so batches within a
class reuse one set of blocks, and a smaller class's requests are served from a larger class's blocks; eight classes
per power of two would have split that run's two sizes again (208 / 224 MiB).
"""

from __future__ import annotations

import torch

ALIGN = 256  # bytes: every buffer's start, as cuBLASLt's algorithms and the bound Triton signatures expect
_SMALL = 1 << 20  # below this the caching allocator's own rounding (512 bytes, 2 MiB blocks) is as good


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to ``2**k * (1 + j / 4)`` (``j`` in 0..3) above 1 MiB; smaller sizes as they are."""
    if nbytes <= _SMALL:
        return nbytes
    step = 1 << (nbytes.bit_length() - 3)  # a quarter of the power of two at or below nbytes
    return -(-nbytes // step) * step


def empty(nbytes: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(buffer, base)``: a uint8 buffer of at least ``nbytes`` bytes from ``base``, an :data:`ALIGN`-aligned
    address in it, its size rounded up by :func:`size_class`; from the caching allocator on the current stream."""
    buf = torch.empty(size_class(nbytes + ALIGN), dtype=torch.uint8, device=device)
    return buf, -(-buf.data_ptr() // ALIGN) * ALIGN


class Arena:
    """Offsets of :data:`ALIGN`-aligned buffers in one byte buffer: ``add(nbytes) -> offset``; ``size``: the bytes
    it needs."""

    __slots__ = ("size",)

    def __init__(self):
        self.size = 0

    def add(self, nbytes: int) -> int:
        at = self.size
        self.size += -(-nbytes // ALIGN) * ALIGN
        return at


def pointer(t: torch.Tensor | None, dtype: torch.dtype, numel: int, align: int = 16) -> int | None:
    """``t``'s data pointer if it is a contiguous, ``align``-byte aligned ``dtype`` tensor of ``numel`` elements;
    ``None`` for no tensor, ``-1`` otherwise (the caller then takes its tensor path)."""
    if t is None:
        return None
    if t.dtype is not dtype or t.numel() != numel or not t.is_contiguous():
        return -1
    p = t.data_ptr()
    return -1 if p & (align - 1) else p


__all__ = ["ALIGN", "Arena", "empty", "pointer", "size_class"]
