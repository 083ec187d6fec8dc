"""Bucket arithmetic and admission: pure functions over host ints (no torch), testable on CPU.

A bucket fixes every shape a captured graph sees: ``tokens`` rows in the packed stream, ``seqs`` entries
of ``cu_seqlens`` minus one, and ``seqlen`` as the host ``max_seqlen``. A real batch of ``N`` sequences and
``T`` tokens is laid out as its own ``cu_seqlens``, then the ``tokens - T`` padding tokens split into dummy
sequences of at most ``seqlen`` tokens, then empty sequences up to ``seqs``. Attention only mixes tokens
within a sequence, and every other op is row-wise, so padding neither attends to nor is attended by real
tokens, and every sequence respects the bucket's ``max_seqlen``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: config imports this module (imports point down, no cycle)
    from .config import GraphConfig


def round_tokens(total: int, multiple: int, steps_per_octave: int) -> int:
    """Round ``total`` up on the geometric grid: ``steps_per_octave`` steps per power of two, never finer
    than ``multiple`` (both powers of two, so the grid is idempotent and monotone)."""
    if total <= multiple:
        return multiple
    step = token_step(total, multiple, steps_per_octave)
    return -(-total // step) * step


def token_step(total: int, multiple: int, steps_per_octave: int) -> int:
    """Grid step of the octave ``(2^k, 2^(k+1)]`` holding ``total``."""
    if total <= multiple:
        return multiple
    base = 1 << ((total - 1).bit_length() - 1)  # largest power of two < total
    return max(multiple, base // steps_per_octave)


def pad_bound(tokens: int, multiple: int, steps_per_octave: int) -> int:
    """The most padding a batch mapped to the token bucket ``tokens`` can need (``step - 1``)."""
    return token_step(tokens, multiple, steps_per_octave) - 1


def round_seqs(num_seqs: int, minimum: int) -> int:
    """Sequence count rounded up to a power of two, at least ``minimum``."""
    return max(minimum, 1 << max(0, num_seqs - 1).bit_length())


@dataclass(frozen=True)
class Bucket:
    """Shapes of one captured graph: ``tokens`` rows, ``seqs`` sequences (real + dummy + empty), ``seqlen``."""

    tokens: int
    seqs: int
    seqlen: int

    def dummy_tail(self, total_tokens: int, num_seqs: int) -> list[int]:
        """Host-side reference of the ``cu_seqlens`` entries after the real ones (the runner computes the
        same on the device): boundaries every ``seqlen`` tokens from ``total_tokens``, capped at ``tokens``."""
        return [min(total_tokens + i * self.seqlen, self.tokens) for i in range(1, self.seqs - num_seqs + 1)]


def bucket_for(config: GraphConfig, num_seqs: int, total_tokens: int, max_seqlen: int,
               steps: int | None = None) -> Bucket:
    """The bucket of an admitted batch (see :func:`admit`); ``steps``: the token grid's steps per octave
    (default ``config.token_steps_per_octave``; training graphs pass ``config.training_steps_per_octave``)."""
    steps = steps or config.token_steps_per_octave
    seqlen = next(s for s in config.seqlen_grid if s >= max_seqlen)
    tokens = round_tokens(max(total_tokens, 1), config.token_multiple, steps)
    slots = -(-pad_bound(tokens, config.token_multiple, steps) // seqlen)
    return Bucket(tokens, round_seqs(num_seqs, config.min_seq_bucket) + slots, seqlen)


def precapture_buckets(config: GraphConfig) -> list[Bucket]:
    """The distinct buckets named by ``config.precapture``, in order."""
    out: list[Bucket] = []
    for entry in config.precapture:
        n, t = entry[:2]
        s = entry[2] if len(entry) == 3 else config.seqlen_for(n, t)
        b = bucket_for(config, n, t, s)
        if b not in out:
            out.append(b)
    return out


# Fallback reasons (stable strings: counted in describe() and asserted by tests).
KILL_SWITCH = "PACKED_ENCODERS_GRAPH=0"
SUSPENDED = "no_cuda_graph() block"
GRAD = "grad enabled"
DROPOUT = "dropout in force (a dropout or attention module in train mode with a non-zero rate)"
HIDDEN_STATES = "output_hidden_states"
EMBEDS = "inputs_embeds"
NOT_CUDA = "model not on CUDA"
OTHER_DEVICE = "inputs on another device than the model"
TOO_MANY_SEQS = "more sequences than max_seqs"
TOO_MANY_TOKENS = "more tokens than max_tokens"
TOO_LONG = "a sequence longer than max_seqlen"
POSITIONS = "position_ids beyond the captured RoPE tables"
CAPTURE_FAILED = "capture failed for this bucket"
OVER_BUDGET = "the bucket's graph alone is over the graph memory budget"
# ... of calls with gradients, when GraphConfig.training is on
CHECKPOINTING = "gradient checkpointing"
INPUT_GRADS = "inputs that require gradients (inputs_embeds, enable_input_require_grads)"
FROZEN = "no trainable parameter in the encoder"


@dataclass
class CallFacts:
    """Host-visible facts about one call, gathered by the router (no device reads; built every call, so
    not frozen: a frozen dataclass pays ``object.__setattr__`` per field). Autocast is no refusal: a graph is
    captured under the call's autocast state (``packed_encoders.router.Facts.autocast``)."""

    kill_switch: bool = False
    suspended: bool = False
    grad: bool = False
    dropout: bool = False
    hidden_states: bool = False
    inputs_embeds: bool = False
    model_on_cuda: bool = True
    same_device: bool = True
    num_seqs: int = 1
    total_tokens: int = 1
    max_seqlen: int = 1


def _mode_checks(facts: CallFacts | RectFacts) -> tuple:
    """``(failed, reason)`` for the modes no captured forward honours, shared by both graph paths (after the
    switches, the device: a model off CUDA counts every call as such, whatever its mode)."""
    return ((facts.kill_switch, KILL_SWITCH), (facts.suspended, SUSPENDED), (not facts.model_on_cuda, NOT_CUDA),
            (facts.grad, GRAD),
            (facts.dropout, DROPOUT), (facts.hidden_states, HIDDEN_STATES),
            (facts.inputs_embeds, EMBEDS))


def _first_failed(checks) -> str | None:
    return next((reason for failed, reason in checks if failed), None)


def admit(config: GraphConfig, facts: CallFacts) -> Bucket | str:
    """The bucket serving this call, or the reason it runs eagerly (first failing check)."""
    reason = _first_failed(_mode_checks(facts))
    return reason or admit_sizes(config, facts.same_device, facts.num_seqs, facts.total_tokens, facts.max_seqlen)


def admit_sizes(config: GraphConfig, same_device: bool, num_seqs: int, total_tokens: int,
                max_seqlen: int, steps: int | None = None) -> Bucket | str:
    """The part of :func:`admit` after the mode checks (the router calls it directly when the modes were
    accepted before the call's sync, saving the host microseconds of a :class:`CallFacts`)."""
    if not same_device:
        return OTHER_DEVICE
    if num_seqs > config.max_seqs:
        return TOO_MANY_SEQS
    if total_tokens > config.token_limit:
        return TOO_MANY_TOKENS
    if max_seqlen > config.max_seqlen:
        return TOO_LONG
    return bucket_for(config, num_seqs, total_tokens, max_seqlen, steps)


# ----------------------------------------------------------------------- sync-free (rectangular) graphs


@dataclass(frozen=True)
class RectBucket:
    """Shapes of one rectangular (``sync_free``) graph: ``batch`` x ``width`` padded inputs, ids checked
    against ``vocab``. Its packed stream has ``tokens = batch * width`` rows in ``seqs = 2 * batch`` sequences
    (each row's real tokens, then a dummy sequence holding the row's padding; see :mod:`.rectangular`)."""

    batch: int
    width: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.batch * self.width

    @property
    def seqs(self) -> int:
        return 2 * self.batch

    @property
    def seqlen(self) -> int:
        return self.width


# Reasons a padded call takes the synced path instead of a sync_free graph (counted under describe()'s
# cuda_graph.sync_free.fallbacks; the synced path then counts its own graph fallbacks as before).
POSITION_IDS = "position_ids"
QUERY_ONLY = "query-only trailing positions (ColBERT query expansion)"
POSITION_ZERO = "a head reading position 0 (classifier_pooling='cls'): padding there is checked at the host sync"
INPUT_DTYPES = "input_ids or attention_mask not of an integer (or bool mask) dtype"
EMPTY = "an empty batch"
TOO_WIDE = "padded width longer than max_seqlen"
TOO_MANY_PADDED = "batch * padded width above the token limit or sync_free_max_tokens"


@dataclass
class RectFacts:
    """Host-visible facts about one padded call, for :func:`admit_rect` (shapes and flags only)."""

    kill_switch: bool = False
    suspended: bool = False
    grad: bool = False
    dropout: bool = False
    hidden_states: bool = False
    inputs_embeds: bool = False
    position_ids: bool = False
    query_only: bool = False
    position_zero: bool = False
    integer_inputs: bool = True
    model_on_cuda: bool = True
    same_device: bool = True
    batch: int = 1
    width: int = 1


def rect_bucket_for(config: GraphConfig, batch: int, width: int, vocab: int) -> RectBucket:
    """``B`` rounded up to a power of two (at least ``min_seq_bucket``), ``S`` to the sync-free width grid."""
    return RectBucket(round_seqs(batch, config.min_seq_bucket),
                      next(s for s in config.sync_free_seqlen_grid if s >= width), vocab)


def admit_rect(config: GraphConfig, facts: RectFacts, vocab: int) -> RectBucket | str:
    """The rectangular bucket serving this padded call, or the reason it takes the synced path. Reads only
    shapes and flags: never a device value."""
    reason = _first_failed(_mode_checks(facts) + (
        (facts.position_ids, POSITION_IDS),
        (facts.query_only, QUERY_ONLY),
        (facts.position_zero, POSITION_ZERO),
        (not facts.integer_inputs, INPUT_DTYPES),
        (not facts.same_device, OTHER_DEVICE),
        (facts.batch == 0 or facts.width == 0, EMPTY),
        (facts.batch > config.max_seqs, TOO_MANY_SEQS),
        (facts.width > config.max_seqlen, TOO_WIDE),
        (facts.batch * facts.width > config.token_limit, TOO_MANY_PADDED),
    ))
    if reason:
        return reason
    bucket = rect_bucket_for(config, facts.batch, facts.width, vocab)
    return TOO_MANY_PADDED if bucket.tokens > config.sync_free_max_tokens else bucket
