"""`RectRunner`: a captured forward that takes padded ``[B_b, S_b]`` inputs and unpads on the device.

This is the ``GraphConfig(sync_free=True)`` path: the host stages the caller's ``input_ids`` /
``attention_mask`` (``[B, S]``, within the bucket) into the top-left block of static buffers and replays;
nothing reads a device value, so the host can enqueue the next call while the GPU runs this one.

Inside the graph, with static shapes only (no ``.item()``, ``nonzero``, boolean indexing or other syncing or
data-dependent op), for a bucket of ``B = B_b`` rows of width ``S = S_b`` and a packed stream of ``N = B * S``
rows:

- ``real = mask != 0``, ``lens``, ``first`` (left padding allowed, as ``unpad``), and the input checks of
  ``unpad`` as counts (mask values other than 0/1 at real tokens, rows with holes, ids outside the vocabulary,
  non-zero ``token_type_ids`` at real tokens) into a static int64 ``flags`` ``[4]``;
- **layout: each padded row owns ``S`` consecutive stream rows**, its real tokens first, then its padding:
  stream row ``b * S + k`` holds padded position ``(first[b] + k) mod S`` of row ``b`` (a rotation, so every
  padded position lands on exactly one stream row and no spare row is needed), ``cu_seqlens`` is
  ``[0, lens[0], S, S + lens[1], 2S, ..., N]``: row ``b``'s sequence, then a dummy sequence of its
  ``S - lens[b]`` padding rows (``2 * B`` sequences, each at most ``S`` long, so ``max_seqlen = S`` holds).
  Attention mixes tokens within a sequence only and everything else is row-wise, so padding (whatever it
  holds: stale ids outside the staged block, padding ids) never reaches a real token, exactly as in the
  packed buckets of :mod:`.buckets`. Positions are static, ``k`` for stream row ``b * S + k``: they restart
  at every sequence's first real token; padding rows get positions ``< S``;
- **dead padding** (when every layer's attention backend is the Triton kernel): the batch also carries
  ``key_lens`` ``[lens[0], 0, lens[1], 0, ...]``, so padding sequences have no keys and the kernel's programs
  over their rows skip the key loop and write zeros: attention costs the real tokens only (the GEMMs still run
  all ``N`` rows, their shapes being static);
- ids are clamped into ``[0, vocab)`` before the embedding lookup, so no input can trigger a device-side
  assert (an out-of-vocabulary id is reported by ``flags``);
- ``encoder_forward`` on that ``PackedBatch`` with the attention plan resolved at capture (``plan_attention``
  for ``2B`` sequences, ``N`` tokens, ``max_seqlen = S``);
- the inverse rotation gathers the output back to ``[B, S, hidden]``, zeros at padded positions; when any check
  fails, the whole output is NaN (the caller's ``[B, S]`` block of it is returned).

Stale content outside the staged block of ``ids`` is harmless (masked); the mask outside it is zeroed when the
previous call wrote there (tracked on the host, so a steady batch shape pays no extra launch).
"""

from __future__ import annotations

import contextlib

import torch

from ..attention.backends import BACKENDS
from ..batch import PackedBatch
from ..model.forward import encoder_forward
from ..model.plan import rules_for
from .buckets import RectBucket
from .deferred import CHECKS
from .runner import autocast_state, capture_or_run, resolve_plan, theta_tables, triton_kernels_available


def device_unpad(bufs: dict, width: int, vocab: int) -> dict:
    """The in-graph unpadding of the static ``[B, S]`` buffers (static shapes, no host read).

    Returns ``real`` bool ``[B, S]``, ``first`` / ``lens`` int64 ``[B]``, ``flags`` int64 ``[4]`` (the counts
    of :data:`.deferred.CHECKS`), the stream's ``ids`` int64 ``[N]`` (clamped into the vocabulary) and
    ``cu_seqlens`` int32 ``[2B + 1]``, ``back`` int64 ``[B * S]``: the stream row of each padded position, and
    ``kl`` int32 ``[2B]``: the key lengths of the dead-padding layout (``lens[b]`` for row ``b``'s sequence, 0 for
    its padding sequence).
    """
    s = width
    mask, ids, tt = bufs["mask"], bufs["ids"], bufs["tt"]
    real = mask != 0
    lens = real.sum(1)
    ri = real.to(torch.int8)
    first = ri.argmax(1)
    last = (s - 1) - ri.flip(1).argmax(1)
    flags = torch.stack([
        (real & (mask != 1)).sum(),
        ((lens > 0) & (last - first + 1 != lens)).sum(),
        (real & ((ids < 0) | (ids >= vocab))).sum(),
        (real & (tt != 0)).sum(),
    ])
    row0, cols = bufs["row0"], bufs["cols"]                       # [B, 1] (b * S) and [S]
    src = (row0 + torch.remainder(cols[None, :] + first[:, None], s)).reshape(-1)
    stream_ids = ids.reshape(-1).index_select(0, src).clamp_(0, vocab - 1)
    starts = row0[:, 0]
    cu = torch.cat([torch.stack([starts, starts + lens], 1).reshape(-1), bufs["end"]]).to(torch.int32)
    back = (row0 + torch.remainder(cols[None, :] - first[:, None], s)).reshape(-1)
    kl = torch.stack([lens, torch.zeros_like(lens)], 1).reshape(-1).to(torch.int32)
    return {"real": real, "first": first, "lens": lens, "flags": flags, "ids": stream_ids, "cu": cu, "back": back,
            "kl": kl}


def fused_unpad_available(device: torch.device) -> bool:
    """Whether the one-launch Triton unpad / scatter (:mod:`packed_encoders.ops.triton.rect_unpad`) can run
    on ``device`` (CUDA with Triton importable); elsewhere :func:`device_unpad` runs."""
    return triton_kernels_available(device, "rect_unpad")


def rect_forward_fn(model, params, ops, plan, bucket: RectBucket, bufs: dict, *, fused: bool = False,
                    dead_padding: bool = False, rules=None):
    """The forward captured for ``bucket``: static ``bufs`` in, ``(out [B, S, H], flags [4])`` out.

    ``fused``: unpad and scatter back with the two Triton kernels of ``ops.triton.rect_unpad`` (same layout
    and checks as :func:`device_unpad`, 2 launches instead of ~45).
    ``dead_padding``: the batch carries ``key_lens`` that give every padding sequence no key, so the attention
    backend (it must support ``key_lens``) writes zeros for its rows without computing them.
    ``rules``: the plan's switches (``model.plan.Rules``; the router passes the encoder's, read at ``pack()``)."""
    b, s = bucket.batch, bucket.width
    assert bufs["pos"].numel() == b * s

    if fused:
        from ..ops.triton import rect_unpad

        def forward_fused():
            ids, cu, first, row_flags, kl = rect_unpad.unpad(bufs["mask"], bufs["ids"], bufs["tt"], bucket.vocab,
                                                             key_lens=dead_padding)
            batch = PackedBatch(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=s,
                                position_ids=bufs["pos"], max_position=s, key_lens=kl)
            hidden = encoder_forward(model, params, batch, attention=plan, ops=ops, rules=rules)  # [N, H]
            return rect_unpad.scatter(hidden, bufs["mask"], first, row_flags)

        return forward_fused

    def forward():
        u = device_unpad(bufs, s, bucket.vocab)
        batch = PackedBatch(input_ids=u["ids"], inputs_embeds=None, cu_seqlens=u["cu"], max_seqlen=s,
                            position_ids=bufs["pos"], max_position=s, key_lens=u["kl"] if dead_padding else None)
        hidden = encoder_forward(model, params, batch, attention=plan, ops=ops, rules=rules)  # [N, H]
        gathered = hidden.index_select(0, u["back"]).view(b, s, -1)
        bad = u["flags"].sum() > 0
        fill = torch.where(bad, bufs["nan"], bufs["zero"])
        out = torch.where((u["real"] & ~bad)[..., None], gathered, fill)
        return out, u["flags"]

    return forward


class RectRunner:
    """Capture the rectangular forward of ``model`` for ``bucket`` with ``state``'s ops and the attention
    backend ``requested`` resolved for the bucket's packed shapes (and baked in).

    Args:
        pool, stream, warmup, autocast: as :class:`~packed_encoders.graphs.runner.GraphRunner`.
        capture: ``False`` runs the same forward on the same static buffers at every replay, without a CUDA
            graph, on any device (the CPU tests of the layout use it).
        fused: the Triton unpad / scatter kernels (``None``: on CUDA when Triton imports; ``True`` on CPU
            needs ``TRITON_INTERPRET=1``).
        dead_padding: give the padding sequences no keys (see :func:`rect_forward_fn`); ``None``: when every
            layer's backend is the Triton kernel, whose programs then skip those rows (padding is often more
            than half of a rectangular batch's rows).

    Raises:
        PackedEncodersError: the requested backend cannot run the bucket (as the eager path would).
        RuntimeError: the forward is not capturable.
    """

    layout = "rectangular"
    query_only = False

    def __init__(self, model, state, bucket: RectBucket, requested: str, *, pool=None, stream=None,
                 warmup: int = 1, capture: bool = True, fused: bool | None = None,
                 dead_padding: bool | None = None, autocast=None):
        params = state.params
        weight = model.embeddings.tok_embeddings.weight
        device = weight.device
        self.device = device
        self.bucket = bucket
        self.requested = requested
        b, s = bucket.batch, bucket.width
        n = b * s
        on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
        with on_device, autocast_state(device, autocast), torch.inference_mode(False), torch.no_grad():
            long = dict(dtype=torch.long, device=device)
            self.bufs = {
                "ids": torch.zeros(b, s, **long),
                "mask": torch.zeros(b, s, **long),       # all rows empty until staged
                "tt": torch.zeros(b, s, **long),
                "pos": torch.arange(s, **long).repeat(b),
                "row0": (torch.arange(b, **long) * s)[:, None],
                "cols": torch.arange(s, **long),
                "end": torch.full((1,), n, **long),
                "nan": torch.full((), float("nan"), dtype=autocast or weight.dtype, device=device),
                "zero": torch.zeros((), dtype=autocast or weight.dtype, device=device),
            }
            self.tables = theta_tables(model, params, s, device)   # positions are < S by layout
            probe = PackedBatch(input_ids=self.bufs["ids"].reshape(-1), inputs_embeds=None,
                                cu_seqlens=torch.zeros(2 * b + 1, dtype=torch.int32, device=device), max_seqlen=s,
                                position_ids=self.bufs["pos"], max_position=s)
            self.plan, self.plan_summary, self.plan_reasons = resolve_plan(params, probe, requested,
                                                                           autocast or weight.dtype, state.policy,
                                                                           graph=capture)
            self.fused = fused_unpad_available(device) if fused is None else fused
            if dead_padding is None:
                dead_padding = all(d.backend == "triton" for d in self.plan.values())
            elif dead_padding and not all(BACKENDS[d.backend].supports_key_lens
                                          and (w is None or BACKENDS[d.backend].key_lens_local)
                                          for w, d in self.plan.items()):
                raise ValueError(f"dead_padding needs key_lens support; the plan is {self.plan_summary}")
            self.dead_padding = dead_padding
            forward = rect_forward_fn(model, params, state.ops, self.plan, bucket, self.bufs, fused=self.fused,
                                      dead_padding=dead_padding, rules=rules_for(state.tuning))
            self.graph, self._forward, (self.out, self.flags), pool_bytes = capture_or_run(
                forward, device, capture, pool, stream, warmup)
        self._extent = (0, 0)      # the block of `mask` the last staging wrote
        self._tt_dirty = False     # `tt` holds a previous call's token_type_ids
        static = tuple(v for v in self.bufs.values()) + (self.out, self.flags)
        self.static_bytes = sum(x.numel() * x.element_size() for x in static)
        self.graph_bytes = self.static_bytes + pool_bytes
        assert self.flags.numel() == len(CHECKS)

    def stage(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              token_type_ids: torch.Tensor | None) -> None:
        """Copy the call's ``[B, S]`` tensors into the top-left block (device-to-device, no host read)."""
        bufs = self.bufs
        b, s = int(input_ids.shape[0]), int(input_ids.shape[1])
        bufs["ids"][:b, :s].copy_(input_ids)
        mask = bufs["mask"]
        if attention_mask is None:
            mask[:b, :s].fill_(1)
        else:
            mask[:b, :s].copy_(attention_mask)
        pb, ps = self._extent
        if pb > b:
            mask[b:pb, :ps].zero_()
        if ps > s:
            mask[:min(b, pb), s:ps].zero_()
        self._extent = (b, s)
        if token_type_ids is not None:
            bufs["tt"][:b, :s].copy_(token_type_ids)
            self._tt_dirty = True
        elif self._tt_dirty:
            bufs["tt"].zero_()
            self._tt_dirty = False

    def replay(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               token_type_ids: torch.Tensor | None = None):
        """Stage, replay, and return ``(output [B, S, hidden] owned by the caller, flags)``; ``flags`` is the
        static int64 ``[4]`` check tensor of this replay (read it before the next replay of this runner)."""
        self.stage(input_ids, attention_mask, token_type_ids)
        if self.graph is not None:
            self.graph.replay()
            out, flags = self.out, self.flags
        else:
            with torch.no_grad():
                out, flags = self._forward()
            self.out, self.flags = out, flags
        b, s = int(input_ids.shape[0]), int(input_ids.shape[1])
        return out[:b, :s].clone(), flags
