"""`PackedBatch`: a padding-free batch, and the exact index work between padded and packed layouts.

Conventions (flash-attn names): ``cu_seqlens`` int32 ``[N + 1]``, ``max_seqlen`` a host int,
``position_ids`` int64 ``[T]`` restarting at 0 for every sequence whatever the padding side.
Building a batch from padded inputs costs one device-to-host transfer (lengths plus the input checks), or none
when the caller lets :func:`unpad` reuse the host facts of an earlier call on the very same input tensors
(:class:`LengthsMemo`); nothing else reads device values.
"""

from __future__ import annotations

import functools
import itertools
import numbers
import threading
import weakref
from dataclasses import dataclass

import torch

from .attention.sdpa import token_coords
from .errors import TOKEN_TYPES, PackedEncodersError, StockOnlyInput


@dataclass
class PackedBatch:
    """A batch of ``N`` sequences flattened into ``T`` real tokens.

    Attributes:
        input_ids: int64 ``[T]`` or ``None`` when ``inputs_embeds`` is given.
        inputs_embeds: ``[T, hidden_size]`` or ``None``.
        cu_seqlens: int32 ``[N + 1]``; sequence ``s`` owns tokens ``cu_seqlens[s]:cu_seqlens[s+1]``.
        max_seqlen: host int, the longest sequence.
        position_ids: int64 ``[T]``.
        max_position: host int, an upper bound (exclusive) on ``position_ids`` (sizes the RoPE tables).
        indices: int64 ``[T]`` flat positions of the tokens in the padded ``[B * S]`` layout, or ``None``.
        padded_shape: ``(B, S)`` of the padded call, or ``None``.
        key_lens: int32 ``[N]`` or ``None``. When set, only the first ``key_lens[s]`` tokens of sequence ``s``
            are keys; the tokens after them are query-only (they attend, nobody attends to them): HF's
            semantics for trailing positions with ``attention_mask == 0``, which ColBERT query expansion uses.
        lengths_reused: :func:`unpad` took the host facts from :data:`LENGTHS` (no sync).
    """

    input_ids: torch.Tensor | None
    inputs_embeds: torch.Tensor | None
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    max_position: int
    indices: torch.Tensor | None = None
    padded_shape: tuple[int, int] | None = None
    key_lens: torch.Tensor | None = None
    lengths_reused: bool = False

    @property
    def total_tokens(self) -> int:
        src = self.input_ids if self.input_ids is not None else self.inputs_embeds
        return int(src.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens.device

    def pad(self, packed: torch.Tensor) -> torch.Tensor:
        """Scatter ``[T, ...]`` back to ``[B, S, ...]`` with zeros at padded positions (differentiable)."""
        if self.indices is None or self.padded_shape is None:
            raise PackedEncodersError("this batch was built packed; it has no padded layout to scatter to")
        b, s = self.padded_shape
        out = packed.new_zeros((b, s, *packed.shape[1:]))
        # Written through a view, returned as the base: a returned view would make an in-place op on the output
        # drop the backward hooks FSDP2 puts on it (it then skips the all-gather; backward fails), which stock's
        # output, not a view, allows.
        out.view(b * s, *packed.shape[1:]).index_copy_(0, self.indices, packed)
        return out


class LengthsMemo:
    """The host facts (each row's length, the largest position) of recent :func:`unpad` calls that passed every
    check, keyed by their input tensors, so one later call over the same, unchanged tensors skips the sync.

    GradCache (sentence-transformers' cached losses, PyLate's ``CachedContrastive``) runs every chunk twice: a
    no-grad forward, then a forward with gradients over the same tensors (views sliced from the batch's features
    at the same offsets). The second sync waits for the GPU to finish the previous chunk's backward, and the host
    work after it (the training stack's preparation, the weight casts) leaves the GPU idle.

    A tensor is the same and unchanged while its data address, shape, strides, dtype, device and version counter
    (``Tensor._version``: bumped by every in-place op on it or on a view of it, ``copy_`` and ``out=`` included)
    are, and the tensor owning its storage (``_base``, or itself) is the same live object, held by a weak reference
    (so the address cannot have been freed and reused). Not seen: writes that bump no version counter (through
    ``.data``, ``untyped_storage()``, a raw pointer, or an alias the tensor shares with NumPy or DLPack, e.g.
    ``torch.from_numpy`` buffers refilled in place). Hence the narrow use (``call.serve_padded``): only a no-grad
    call of an encoder in train mode is remembered, only a call with gradients reads an entry, and reading it
    removes it. Inference tensors and tensor subclasses are never keyed. Should such a write happen anyway, a call on
    the CPU (where reading the device facts costs no sync) compares them with the entry and raises
    :data:`STALE_LENGTHS`; on CUDA the call's layout is made to agree with the entry (``_in_bounds``): wrong values,
    never an index past a buffer or a table.
    """

    MAX_ENTRIES = 4096  # chunks x columns of a large GradCache step (e.g. 6,144 texts x 3 columns in chunks of 8)

    def __init__(self):
        self._entries: dict = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(tensors: tuple, flags: tuple):
        """``(key, owners)`` of a call over ``tensors`` (``None`` entries allowed) with ``flags`` (everything else
        the checks depend on), or ``None`` when one of them is an inference tensor or has no storage or version
        counter to read (traced, functorch-wrapped or other tensor subclasses)."""
        if torch.compiler.is_compiling():
            return None
        sig, owners = [], []
        try:
            for t in tensors:
                if t is None:
                    sig.append(None)
                    continue
                if type(t) is not torch.Tensor or t.is_inference():
                    return None
                owner = t._base if t._base is not None else t
                sig.append((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version))
                owners.append(owner)
        except RuntimeError:
            return None
        return (tuple(sig), flags), tuple(owners)

    def take(self, key, owners) -> list | None:
        """The facts stored under ``key`` for these ``owners`` (removed: an entry serves one call), or ``None``."""
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is None or len(entry[0]) != len(owners) or any(r() is not o for r, o in zip(entry[0], owners)):
            return None
        return list(entry[1])

    def put(self, key, owners, stats: list) -> None:
        refs = tuple(weakref.ref(o) for o in owners)
        with self._lock:
            self._entries.pop(key, None)  # (re-inserted last: the oldest entries go first)
            while self._entries and len(self._entries) >= self.MAX_ENTRIES:
                self._entries.pop(next(iter(self._entries)))
            if self.MAX_ENTRIES > 0:
                self._entries[key] = (refs, tuple(stats))

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


LENGTHS = LengthsMemo()


def _raise_if(count: int, message: str, error: type = PackedEncodersError) -> None:
    if count:
        if error is StockOnlyInput:  # its reason must not vary with the count: one warning, one describe() entry
            raise error(message.format(count=count), reason=message.format(count="some"))
        raise error(message.format(count=count))


def _integer_ids(input_ids: torch.Tensor | None) -> torch.Tensor | None:
    """``input_ids`` as int32/int64: narrower integer dtypes are widened (their comparisons with a vocabulary
    size past their range would wrap, and the embedding takes int32/int64 only).

    Raises:
        PackedEncodersError: floating, complex or bool ids.
    """
    if input_ids is None:
        return None
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise PackedEncodersError(f"input_ids must be an integer tensor (got {input_ids.dtype})")
    return input_ids if input_ids.dtype in (torch.int32, torch.int64) else input_ids.long()


def check_embeds_dtype(inputs_embeds: torch.Tensor, weight_dtype: torch.dtype) -> None:
    """Refuse ``inputs_embeds`` of another dtype than the model's weights outside autocast (stock HF fails in its
    first GEMM there; under autocast both run), and float64 ones of a model in another dtype under autocast too
    (autocast never casts float64: stock fails in its first LayerNorm).

    Raises:
        PackedEncodersError: naming both dtypes."""
    if inputs_embeds.dtype == weight_dtype:
        return
    if not torch.is_autocast_enabled(inputs_embeds.device.type):
        raise PackedEncodersError(f"inputs_embeds is {inputs_embeds.dtype} but the model's weights are {weight_dtype} "
                                  "(outside autocast); cast one to the other")
    if inputs_embeds.dtype == torch.float64:
        raise PackedEncodersError(f"inputs_embeds is {inputs_embeds.dtype} but the model's weights are {weight_dtype}; "
                                  "autocast does not cast float64: cast one to the other")


def unpad(*, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
          attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
          token_type_ids: torch.Tensor | None, vocab_size: int,
          trailing_query_only: bool = False, leading_stock: bool = False, column_zero_stock: bool = False,
          empty_rows_stock: bool = False, far_padding_stock: int | None = None, before_sync=None,
          fused: bool = True, remember: bool = False, reuse: bool = False) -> PackedBatch:
    """Turn a padded ``[B, S]`` call into a :class:`PackedBatch` with one device-to-host transfer (none on a
    ``reuse`` hit).

    The attention mask may pad on either side; positions restart at 0 at each sequence's first real
    token unless ``position_ids`` ``[B, S]`` (or ``[1, S]`` or ``[S]``, broadcast) is given, which is then read
    at the real tokens. With ``trailing_query_only``, the padded positions after each non-empty row's last
    real token join its sequence as query-only tokens (see ``PackedBatch.key_lens``), positions continuing;
    padding before a row's real tokens stays zeros, or with ``leading_stock`` raises ``StockOnlyInput`` (ColBERT
    query expansion scores the leading expansion positions of left-padded queries, which stock computes).
    ``column_zero_stock`` raises it for a row whose position 0 is padding (a head reads position 0:
    ``classifier_pooling="cls"``), the mask's first column read at the same sync; ``empty_rows_stock`` for a row
    without real tokens (a multiple-choice head reads its position 0).
    ``before_sync(ids, positions, cu_seqlens, key_lens)``, when given, is called just before the sync with the
    device buffers the batch will be sliced from (``ids`` / ``positions`` hold ``B * S + 1`` rows, the first
    ``cu_seqlens[-1]`` of them the batch's; ``ids`` is ``None`` for ``inputs_embeds``); it must not sync.
    ``fused``: unpad with the Triton kernels where they can take the call (a packed encoder passes its tuning's
    ``fused_unpad``: ``PACKED_ENCODERS_FUSED_UNPAD`` as read at ``pack()``).
    ``remember``: keep this call's host facts in :data:`LENGTHS` once its checks pass; ``reuse``: take them from
    there (once), without the sync, when the same unchanged tensors were unpadded with the same options before (see
    :class:`LengthsMemo` for what "unchanged" can and cannot see). The device work is the same either way.

    Raises:
        StockOnlyInput: a mask with holes inside a sequence, padding before a sequence's real tokens with
            ``trailing_query_only`` and ``leading_stock``, padding at a row's position 0 with ``column_zero_stock``,
            a row without real tokens with ``empty_rows_stock``, or with ``trailing_query_only`` and
            ``far_padding_stock`` (a half window) a row with real tokens whose padding reaches more than that many
            positions past them (the patched forward runs stock HF for it).
        PackedEncodersError: shape mismatch, a mask that is not 2-D or holds values other than 0/1,
            ids outside ``[0, vocab_size)`` at real tokens, non-zero ``token_type_ids`` at real tokens, or
            negative ``position_ids``.
    """
    src = input_ids if input_ids is not None else inputs_embeds
    memo = None
    if remember or reuse:  # the caller's tensors, before any conversion below makes new ones
        memo = LengthsMemo.key(
            (input_ids, attention_mask, position_ids, token_type_ids),
            (None if inputs_embeds is None else tuple(inputs_embeds.shape), vocab_size, trailing_query_only,
             leading_stock, column_zero_stock, empty_rows_stock, far_padding_stock))
    known = LENGTHS.take(*memo) if reuse and memo is not None else None
    if input_ids is not None and input_ids.dim() != 2:
        raise PackedEncodersError(f"input_ids must be [batch, seq_len]; got shape {tuple(input_ids.shape)}")
    if inputs_embeds is not None and inputs_embeds.dim() != 3:
        raise PackedEncodersError(
            f"inputs_embeds must be [batch, seq_len, hidden]; got shape {tuple(inputs_embeds.shape)}")
    input_ids = _integer_ids(input_ids)
    b, s = int(src.shape[0]), int(src.shape[1])
    device = src.device
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if t is not None and tuple(t.shape) != (b, s):
            raise PackedEncodersError(f"{name} has shape {tuple(t.shape)}; expected {(b, s)} to match the inputs")
    if position_ids is not None:
        if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
            raise PackedEncodersError(f"position_ids must be an integer tensor (got {position_ids.dtype})")
        given = tuple(position_ids.shape)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.dim() != 2 or position_ids.shape[1] != s or position_ids.shape[0] not in (1, b):
            raise PackedEncodersError(f"position_ids has shape {given}; expected {(b, s)}, {(1, s)} or {(s,)}")
        position_ids = position_ids.expand(b, s)

    if b == 0 or s == 0:  # nothing to encode (and argmax has no empty-dimension form)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return PackedBatch(
            input_ids=None if input_ids is None else empty,
            inputs_embeds=None if inputs_embeds is None else inputs_embeds.reshape(0, inputs_embeds.shape[-1]),
            cu_seqlens=torch.zeros(b + 1, dtype=torch.int32, device=device), max_seqlen=0, position_ids=empty,
            max_position=1, indices=empty, padded_shape=(b, s),
            key_lens=torch.zeros(b, dtype=torch.int32, device=device) if trailing_query_only else None)
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
    position_zero = column_zero_stock and attention_mask is not None  # the rows padded at position 0 are counted
    if fused and _fused_unpad(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids, b):
        stats_t, cu, ids_all, pos_all, indices_all, key_lens = _triton_unpad().unpad(
            attention_mask, input_ids, token_type_ids, position_ids, vocab_size, trailing_query_only)
        embeds_all = None
    else:
        stats_t, cu, ids_all, embeds_all, pos_all, indices_all, key_lens = _torch_unpad(
            input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids, vocab_size, trailing_query_only,
            b, s, device, position_zero)
    if before_sync is not None:
        before_sync(ids_all, pos_all, cu, key_lens)
    far = trailing_query_only and far_padding_stock is not None and key_lens is not None
    if far and known is None:  # rows with real tokens padded more than far_padding_stock past them
        real = key_lens.to(stats_t.dtype)  # (segments: first real token to end)
        stats_t = torch.cat((stats_t, ((real > 0) & (stats_t[:b] - real > far_padding_stock)).sum().reshape(1)))
    if known is not None and device.type == "cpu" and stats_t[:b + 6].numpy().tolist() != known[:b + 6]:
        raise PackedEncodersError(STALE_LENGTHS)  # (no GPU to wait for: the remembered facts are checked)
    stats = stats_t.tolist() if known is None else known  # the one sync, unless the facts are known
    remembered = list(stats) if remember and memo is not None and known is None else None  # kept once checked
    n_far = stats.pop() if far else 0
    n_zero = stats[b + 6] if position_zero else 0  # (the Triton layout counts them always, the PyTorch one if asked)
    host_lens, (n_bad, n_holes, n_oov, n_tt, n_negpos, max_pos) = stats[:b], stats[b:b + 6]
    _raise_if(n_bad, "attention_mask must hold only 0 and 1 ({count} entries that are neither)")
    _raise_if(n_holes, "attention_mask has holes inside {count} sequence(s): the packed path needs contiguous real "
                       "tokens (padding on the left and/or right only)", StockOnlyInput)
    if trailing_query_only and leading_stock:  # each row's segment runs from its first real token to the end
        _raise_if(sum(0 < n < s for n in host_lens),
                  "attention_mask has padding before the real tokens of {count} sequence(s): the packed path "
                  "computes masked positions as stock does (ColBERT query expansion) only after a row's real "
                  "tokens (right padding)", StockOnlyInput)
    _raise_if(n_zero, "attention_mask pads position 0 of {count} row(s), which the head reads "
                      "(classifier_pooling='cls'): the packed path leaves padded positions at zero", StockOnlyInput)
    _raise_if(sum(n == 0 for n in host_lens) if empty_rows_stock and attention_mask is not None else 0,
              "attention_mask has no real tokens in {count} row(s), whose position 0 the head reads "
              "(classifier_pooling='cls'): the packed path leaves padded positions at zero", StockOnlyInput)
    _raise_if(n_far, f"{{count}} row(s) have padded positions more than the local half window ({far_padding_stock}) "
              "past their real tokens, computed for this call (padded_outputs, a head's loss or query expansion), "
              "and the model's attn_implementation is 'eager': its local layers average every value for a padded "
              "query with no key in its window, where the packed attention gives SDPA's zeros", StockOnlyInput)
    _raise_if(n_oov, f"{{count}} input_ids are outside the vocabulary [0, {vocab_size})")
    _raise_if(n_tt, TOKEN_TYPES)
    _raise_if(n_negpos, "position_ids has {count} negative entries")

    if remembered is not None:
        LENGTHS.put(*memo, remembered)
    total = sum(host_lens)
    max_seqlen = max(host_lens, default=0)
    max_position = int(max_pos) + 1 if position_ids is not None else max_seqlen
    if known is not None:
        cu, ids_all, pos_all, indices_all, key_lens = _in_bounds(
            host_lens, max(int(max_position), 1), vocab_size, b * s, device, ids_all, pos_all, indices_all, key_lens)
    return PackedBatch(
        input_ids=None if ids_all is None else ids_all[:total],
        inputs_embeds=None if embeds_all is None else embeds_all[:total],
        cu_seqlens=cu,
        max_seqlen=int(max_seqlen),
        position_ids=pos_all[:total],
        max_position=max(int(max_position), 1),
        indices=indices_all[:total],
        padded_shape=(b, s),
        key_lens=key_lens,
        lengths_reused=known is not None,
    )


# A reused entry whose tensors were written without a version bump (LengthsMemo: .data, NumPy or DLPack aliases)
STALE_LENGTHS = ("the inputs of this call with gradients changed since the no-grad call whose lengths it reuses, by "
                 "writes that bump no version counter (through .data, a raw pointer or a NumPy / DLPack alias): edit "
                 "the tensors themselves (under torch.no_grad()), pass new ones, or set PACKED_ENCODERS_UNPAD_REUSE=0 "
                 "and call pe.pack(model) again (switches are read at pack())")


def _in_bounds(host_lens: list, max_position: int, vocab_size: int, slots: int, device, ids, positions, indices,
               key_lens):
    """The device layout of a call that reused remembered lengths, made to agree with them without a sync:
    ``cu_seqlens`` from the remembered lengths (a copy from pinned memory that does not wait), ids in the
    vocabulary, positions below ``max_position``, indices within the padded call, ``key_lens`` within each
    sequence. Unchanged inputs are unchanged by it; inputs written since without a version bump (what
    :class:`LengthsMemo` cannot see) get wrong values, never an index past a buffer or a table. Returns
    ``(cu_seqlens, ids, positions, indices, key_lens)`` (``ids``, ``positions``, ``indices``: ``sum(host_lens)``
    rows, new tensors)."""
    total = sum(host_lens)
    bounds = torch.tensor(list(itertools.accumulate(host_lens, initial=0)), dtype=torch.int32,
                          pin_memory=device.type == "cuda")
    cu = bounds.to(device, non_blocking=True)
    if key_lens is not None:
        key_lens = torch.minimum(key_lens, cu[1:] - cu[:-1])
    return (cu, None if ids is None else ids[:total].clamp(0, vocab_size - 1),
            positions[:total].clamp(0, max_position - 1), indices[:total].clamp(0, slots - 1), key_lens)


@functools.cache
def _triton_unpad():
    """``ops.triton.unpad``, or ``None`` without a working Triton (imported once, on the first CUDA call)."""
    try:
        from .ops.triton import unpad as triton_unpad
    except Exception:  # noqa: BLE001 - no (working) Triton: the PyTorch ops do the same work
        return None
    return triton_unpad


def _fused_unpad(input_ids, inputs_embeds, attention_mask, token_type_ids, position_ids, b: int) -> bool:
    """Whether this call unpads with the two Triton launches of ``ops.triton.unpad`` (CUDA ids, Triton importable,
    integer inputs) instead of ~40 PyTorch ops."""
    if input_ids is None or inputs_embeds is not None or input_ids.device.type != "cuda":
        return False
    kernels = _triton_unpad()
    return kernels is not None and kernels.supported(attention_mask, input_ids, token_type_ids, position_ids, b)


def _torch_unpad(input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids, vocab_size: int,
                 trailing_query_only: bool, b: int, s: int, device, position_zero: bool = False):
    """The PyTorch layout of :func:`unpad` (and its reference): ``(stats, cu, ids, embeds, positions, indices,
    key_lens)``; ``stats`` is an int64 device tensor (the caller's one sync reads it), laid out as
    ``ops.triton.unpad``'s, the count of rows padded at position 0 only when ``position_zero``."""
    if attention_mask is None:
        real = torch.ones(b, s, dtype=torch.bool, device=device)
        bad_values = torch.zeros((), dtype=torch.long, device=device)
    else:
        real = attention_mask != 0
        bad_values = (real & (attention_mask != 1)).sum()
    lens = real.sum(1)
    ri = real.to(torch.int8)
    first = ri.argmax(1)
    last = s - 1 - ri.flip(1).argmax(1)
    holes = ((lens > 0) & (last - first + 1 != lens)).sum()
    checks = [bad_values, holes]
    if trailing_query_only:
        seg = torch.where(lens > 0, s - first, 0)  # real tokens plus the trailing pads after them
        used = (torch.arange(s, device=device)[None, :] >= first[:, None]) & (lens > 0)[:, None]
    else:
        seg, used = lens, real
    if input_ids is not None:
        checks.append((used & ((input_ids < 0) | (input_ids >= vocab_size))).sum())
    else:
        checks.append(torch.zeros((), dtype=torch.long, device=device))
    if token_type_ids is not None:
        checks.append((real & (token_type_ids != 0)).sum())
    else:
        checks.append(torch.zeros((), dtype=torch.long, device=device))
    if position_ids is not None:
        big = torch.where(used, position_ids, 0)
        checks += [(used & (position_ids < 0)).sum(), big.max() if big.numel() else big.sum()]
    else:
        checks += [torch.zeros((), dtype=torch.long, device=device)] * 2
    if position_zero:
        checks.append(((lens == 0) | (first != 0)).sum())

    # Everything shaped by device values is laid out before the sync, at the padded size B * S: each used
    # position's packed row is known on the device (cu[b] + offset in its sequence), so the packed stream is
    # one scatter into a [B * S + 1] buffer (the last row takes every unused position) and the sync leaves
    # only slicing to do. In graph replay the host waits at the sync for the previous batch; work queued
    # before it overlaps that wait, work after it does not.
    cu = torch.zeros(b + 1, dtype=torch.int32, device=device)
    torch.cumsum(seg, 0, out=cu[1:])
    flat = b * s
    offset = torch.arange(s, device=device)[None, :] - first[:, None]
    dest = torch.where(used, cu[:-1, None].long() + offset, flat).reshape(-1)
    slots = flat + 1

    def scatter(values: torch.Tensor) -> torch.Tensor:
        out = values.new_empty((slots, *values.shape[1:]))
        return out.index_copy_(0, dest, values)

    indices_all = scatter(torch.arange(flat, device=device))
    pos_all = scatter((position_ids if position_ids is not None else offset.expand(b, s)).reshape(-1))
    ids_all = None if input_ids is None else scatter(input_ids.reshape(-1))
    embeds_all = None if inputs_embeds is None else scatter(inputs_embeds.reshape(flat, -1))

    stats = torch.cat([seg.long(), torch.stack([c.long() for c in checks])])
    key_lens = lens.to(torch.int32) if trailing_query_only else None
    return stats, cu, ids_all, embeds_all, pos_all, indices_all, key_lens


def is_int_like(value) -> bool:
    """A Python/NumPy int or a 0-d integer tensor; not a bool, float or string."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def from_packed(*, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
                position_ids: torch.Tensor | None, vocab_size: int,
                token_type_ids: torch.Tensor | None = None) -> PackedBatch:
    """Validate an already packed batch (one device-to-host transfer) and return it.

    ``input_ids`` ``[T]`` (or ``inputs_embeds`` ``[T, H]``). Either ``cu_seqlens`` is given, or it is derived
    from ``position_ids``: token 0 and every later 0 start a sequence. ``position_ids`` default to
    ``arange`` within each sequence. ``max_seqlen`` is checked against ``cu_seqlens`` when given.

    Raises:
        PackedEncodersError: inconsistent shapes, ``cu_seqlens`` not a 1-D int32 / int64 tensor, not starting at
            0 / not non-decreasing / not ending at ``T``, a wrong ``max_seqlen``, ids outside the vocabulary, non-zero
            ``token_type_ids``, negative positions.
    """
    if max_seqlen is not None and not is_int_like(max_seqlen):
        raise PackedEncodersError(f"max_seqlen must be an int (or a 0-d integer tensor); got {max_seqlen!r}")
    input_ids = _integer_ids(input_ids)
    src = input_ids if input_ids is not None else inputs_embeds
    total = int(src.shape[0])
    device = src.device
    zero = torch.zeros((), dtype=torch.long, device=device)
    for name, t in (("position_ids", position_ids), ("token_type_ids", token_type_ids)):
        if t is not None and t.numel() != total:
            raise PackedEncodersError(f"{name} has {t.numel()} entries for {total} tokens")
    if position_ids is not None:
        if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
            raise PackedEncodersError(f"position_ids must be an integer tensor (got {position_ids.dtype})")
        position_ids = position_ids.reshape(-1).to(device).long()
    checks = [
        zero if input_ids is None else ((input_ids < 0) | (input_ids >= vocab_size)).sum(),
        zero if token_type_ids is None else (token_type_ids != 0).sum(),
        zero if position_ids is None else (position_ids < 0).sum(),
        zero if position_ids is None or total == 0 else position_ids.max(),
    ]
    checks = torch.stack([c.long() for c in checks])
    if cu_seqlens is None:
        if position_ids is None:
            raise PackedEncodersError("a packed call needs cu_seqlens (cu_seq_lens_q) or restarting position_ids")
        host = torch.cat([(position_ids == 0).long(), checks]).tolist()  # the one sync
        starts = [t for t, f in enumerate(host[:total]) if f or t == 0]
        host_cu = starts + [total] if total else [0, 0]
        cu = torch.tensor(host_cu, dtype=torch.int32, device=device)
    else:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (
                torch.int32, torch.int64):
            what = (f"a {cu_seqlens.dtype} tensor of shape {tuple(cu_seqlens.shape)}"
                    if isinstance(cu_seqlens, torch.Tensor) else type(cu_seqlens).__name__)
            raise PackedEncodersError(f"cu_seqlens must be a 1-D int32 or int64 tensor [N + 1]; got {what}")
        if cu_seqlens.numel() < 2:
            raise PackedEncodersError("cu_seqlens needs at least 2 entries ([0, T]; an empty call is [0, 0])")
        # checked as given: narrowing int64 first would wrap values past int32 into a valid-looking cu_seqlens
        host = torch.cat([cu_seqlens.to(device=device, dtype=torch.int64), checks]).tolist()  # the one sync
        host_cu = host[:-4]
        cu = cu_seqlens.to(device=device, dtype=torch.int32)  # in [0, T] once checked below
    n_oov, n_tt, n_neg, max_pos = host[-4:]
    host_lens = [b - a for a, b in zip(host_cu[:-1], host_cu[1:])]
    if host_cu[0] != 0 or host_cu[-1] != total or min(host_lens) < 0:
        raise PackedEncodersError(
            f"cu_seqlens must start at 0, be non-decreasing and end at the token count {total}; got "
            f"{host_cu[:8]}{'...' if len(host_cu) > 8 else ''}")
    true_max = max(host_lens, default=0)
    if max_seqlen is not None and int(max_seqlen) != true_max:
        raise PackedEncodersError(f"max_seqlen={int(max_seqlen)} but the longest sequence in cu_seqlens has {true_max}")
    _raise_if(n_oov, f"{{count}} input_ids are outside the vocabulary [0, {vocab_size})")
    _raise_if(n_tt, TOKEN_TYPES)
    _raise_if(n_neg, "position_ids has {count} negative entries")
    if position_ids is None:
        _, position_ids = token_coords(cu, total)
        max_position = true_max
    else:
        max_position = int(max_pos) + 1
    return PackedBatch(input_ids=input_ids, inputs_embeds=inputs_embeds, cu_seqlens=cu, max_seqlen=true_max,
                       position_ids=position_ids, max_position=max(max_position, 1))
