"""`DeferredChecks`: input-check results of sync-free graph calls, read by the host one call late.

A sync-free graph writes its input checks (counts, see :data:`CHECKS`) into a small static device tensor.
After each replay the router copies them into a slot of a pinned host buffer (``non_blocking``) and records an
event; :meth:`DeferredChecks.poll`, run at the start of the next call on the encoder and by
``pe.check_errors``, reads every slot whose event has completed (``event.query()``: never a wait) and raises
:class:`~packed_encoders.errors.PackedEncodersError` for the calls that failed. Slots whose event has not
completed stay pending.

``SLOTS`` slots per encoder: when all are pending (the host is that many calls ahead of the GPU, where it would
soon block on the launch queue anyway) the oldest is waited for; its error, if any, is raised by the next poll.
Off CUDA (the capture-free runner of the CPU tests) the copy is synchronous and :func:`make_event` returns a
stand-in that is always complete; tests replace :func:`make_event` to hold events pending.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from itertools import islice

import torch

from ..errors import TOKEN_TYPES, PackedEncodersError

SLOTS = 64
# The checks, in the order of the device flags tensor (the same checks `unpad` raises for, same wording).
CHECKS = ("bad_mask_values", "holes", "oov_ids", "token_types")


def describe_flags(counts, vocab: int) -> list[str]:
    """The problems named by one call's check counts (empty when the call was valid)."""
    bad, holes, oov, tt = (int(c) for c in counts)
    out = []
    if bad:
        out.append(f"attention_mask must hold only 0 and 1 ({bad} entries that are neither)")
    if holes:
        out.append(f"attention_mask has holes inside {holes} sequence(s): real tokens must be contiguous "
                   "(padding on the left and/or right only)")
    if oov:
        out.append(f"{oov} input_ids are outside the vocabulary [0, {vocab})")
    if tt:
        out.append(TOKEN_TYPES.format(count=tt))
    return out


class _DoneEvent:
    """Stand-in for ``torch.cuda.Event`` off CUDA: the flags copy was synchronous, so it is always complete."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


def make_event(device: torch.device):
    """A reusable completion event for ``device`` (a CUDA event; an always-complete stand-in elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.Event()
    return _DoneEvent()


@dataclass
class _Pending:
    slot: int
    call: int
    shape: tuple[int, int]
    vocab: int


class DeferredChecks:
    """Pending input checks of one encoder's sync-free calls (thread-safe; lives in ``PackState.runtime``)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = 0                 # sync-free calls recorded
        self.errors_raised = 0         # failed calls reported
        self._host: torch.Tensor | None = None
        self._device: torch.device | None = None
        self._events: list = []
        self._free: list[int] = []
        self._pending: deque[_Pending] = deque()
        self._failed: list[str] = []   # harvested, not raised yet

    @property
    def pending(self) -> int:
        """Calls whose checks the host has not read yet (their GPU work may still run)."""
        return len(self._pending)

    @property
    def unreported(self) -> int:
        """Failed calls read but not raised yet (the next call or ``check_errors`` raises them)."""
        return len(self._failed)

    def refresh(self) -> None:
        """Read every completed slot without raising (``describe()``); never waits."""
        with self.lock:
            self._harvest()

    def _slots_for(self, device: torch.device) -> None:
        if self._host is not None and self._device == device:
            return
        if self._pending:  # the model moved device: wait for what is still in flight on the old one
            self._harvest(wait=True)
        pinned = device.type == "cuda"
        with torch.inference_mode(False):  # a normal tensor: written by calls in and out of inference mode
            self._host = torch.zeros(SLOTS, len(CHECKS), dtype=torch.long, pin_memory=pinned)
        self._device = device
        self._events = [make_event(device) for _ in range(SLOTS)]
        self._free = list(range(SLOTS - 1, -1, -1))

    def record(self, flags: torch.Tensor, shape: tuple[int, int], vocab: int) -> int:
        """Queue the copy of ``flags`` (int64 ``[len(CHECKS)]`` on the device, written by the replay just
        launched on the current stream) and its event; returns the call number used in error messages."""
        with self.lock:
            self._slots_for(flags.device)
            if not self._free:
                self._harvest(wait=True, oldest_only=True)
            slot = self._free.pop()
            self._host[slot].copy_(flags, non_blocking=True)
            # on the stream the copy was queued on (the flags' device), whatever the current device
            self._events[slot].record(torch.cuda.current_stream(flags.device) if flags.is_cuda else None)
            self.calls += 1
            self._pending.append(_Pending(slot, self.calls, shape, vocab))
            return self.calls

    def _harvest(self, *, wait: bool = False, oldest_only: bool = False) -> None:
        """Read every completed slot (with ``wait``: wait for them; ``oldest_only``: just the oldest)."""
        keep: deque[_Pending] = deque()
        for index, p in enumerate(self._pending):
            event = self._events[p.slot]
            if wait and (not oldest_only or index == 0):
                event.synchronize()
            if not event.query():
                if not wait:
                    # Calls complete in issue order on one stream: stop at the first one still running, so
                    # a host running far ahead queries one event per call, not the whole queue.
                    keep.extend(islice(self._pending, index, None))
                    break
                keep.append(p)
                continue
            problems = describe_flags(self._host[p.slot].tolist(), p.vocab)  # pinned host memory: no device read
            self._free.append(p.slot)
            if problems:
                self._failed.append(f"call #{p.call} (input [{p.shape[0]}, {p.shape[1]}]): " + "; ".join(problems))
        self._pending = keep

    def poll(self, *, wait: bool = False) -> None:
        """Raise for every completed call that failed its checks (each reported once).

        Raises:
            PackedEncodersError: naming each failed call and its problems.
        """
        if not self._pending and not self._failed:
            return
        with self.lock:
            self._harvest(wait=wait)
            failed, self._failed = self._failed, []
            if not failed:
                return
            self.errors_raised += len(failed)
        raise PackedEncodersError(
            "invalid input in a previous call served by a sync-free CUDA graph (GraphConfig(sync_free=True) "
            "reports input errors one call late; the output of that call was filled with NaN): "
            + " | ".join(failed))
