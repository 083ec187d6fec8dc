"""The router: one pure function from a call's host-visible facts to the route that serves it.

The patched HF forward and ``packed_forward`` gather a :class:`Facts` (shapes, grad / autocast / training
modes, the options and switches of the encoder, devices, what the caller asked for) and call :func:`choose`
once per call; :mod:`packed_encoders.call` then runs the route. ``choose`` reads nothing but its argument
(no torch state, no environment, no device value), so every route is testable from synthetic facts.

Routes:

- :class:`Stock`: HF's own forward (the packed forward would skip something in the live modules, or the call
  is one only stock serves: :mod:`packed_encoders.adapters.stock_calls`).
- :class:`Eager`: the eager packed forward; ``reason`` says why no graph serves the call (``None``: graphs are
  off for the encoder, ``cuda_graph=False``; a Linear slot whose module the forward calls, e.g. a peft LoRA layer,
  turns every graph off: a graph would replay the weights it captured, not the module's forward).
- :class:`PackedGraph`: a captured packed graph of ``bucket``. A padded call only learns its sizes at its one
  host sync (``unpad``), so its bucket is ``None`` here and is admitted from the sizes after the sync
  (:func:`packed_encoders.graphs.buckets.admit_sizes`: a call too large runs eagerly, the reason counted).
- :class:`RectangularGraph`: the opt-in ``GraphConfig(sync_free=True)`` graph of a padded call, no host sync.
- :class:`TrainingGraph`: with ``GraphConfig.training``, a call with gradients replays a captured forward (and
  its backward replays the captured backward, :mod:`packed_encoders.graphs.training`); as for
  :class:`PackedGraph`, a padded call's ``bucket`` is admitted after its sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

from .graphs import buckets as B
from .graphs.buckets import Bucket, RectBucket


@dataclass(frozen=True)
class Stock:
    """Run HF's stock forward; ``reason`` is warned once and shown in ``describe()``."""

    reason: str


@dataclass(frozen=True)
class Eager:
    """Run the eager packed forward. ``reason``: why no graph serves this call (``None``: graphs off);
    ``sync_free_refusal``: why the sync-free path did not take it (``None``: not asked)."""

    reason: str | None = None
    sync_free_refusal: str | None = None


@dataclass(frozen=True)
class PackedGraph:
    """Replay the packed graph of ``bucket`` (``None``: chosen from the sizes after the call's sync), captured
    under ``autocast`` (the call's CUDA autocast dtype, or ``None``); ``adapters``: :attr:`Facts.adapters`, for the
    graphs' fingerprint."""

    bucket: Bucket | None = None
    autocast: Any = None
    sync_free_refusal: str | None = None
    adapters: Any = None


@dataclass(frozen=True)
class RectangularGraph:
    """Replay the rectangular (sync-free) graph of ``bucket`` for a padded call, captured under ``autocast``;
    ``adapters`` as :class:`PackedGraph`'s."""

    bucket: RectBucket
    autocast: Any = None
    adapters: Any = None


@dataclass(frozen=True)
class TrainingGraph:
    """Replay the training graphs of ``bucket`` (``None``: admitted from the sizes after the call's sync, on the
    training token grid), captured under ``autocast``."""

    bucket: Bucket | None = None
    autocast: Any = None


Route = Union[Stock, Eager, PackedGraph, RectangularGraph, TrainingGraph]


@dataclass(slots=True)
class Facts:
    """Host-visible facts of one call (built every call: slotted, not frozen, for a cheap ``__init__``).

    Attributes:
        structure: what the packed forward would skip in the live module tree (a hook, a swapped module), or why
            only stock serves the call (``output_attentions=True``, ...), or ``None``.
        module_calls: why no graph may serve this call because a Linear slot holds a module the forward calls
            whose forward a replay would not follow (:func:`packed_encoders.model.calls.graph_refusal`), or
            ``None``.
        adapters: what a graph's replay depends on in those called slots (peft LoRA state,
            :func:`packed_encoders.model.calls.replay_state`), read once per call with ``module_calls``; the graph
            routes carry it to the graphs' fingerprint. ``None``: no called slot (or not asked).
        graphs: the encoder's :class:`~packed_encoders.GraphConfig`, or ``None`` (``cuda_graph=False``).
        kill_switch: ``PACKED_ENCODERS_GRAPH=0`` when the encoder was packed (its tuning).
        suspended: inside ``pe.no_cuda_graph(model)``.
        grad, dropout: gradients enabled; some module applies dropout in this call (its own train mode and a
            non-zero rate, read live: Monte-Carlo dropout in an eval model counts).
        checkpointing, input_grads: (gathered for calls with gradients under ``GraphConfig.training`` only) HF
            gradient checkpointing is on for some layer; the embedding output must require gradients
            (``enable_input_require_grads``).
        autocast: the CUDA autocast dtype in force, or ``None``. Graphs are captured under it.
        hidden_states, inputs_embeds, position_ids, query_only, position_zero: what the caller passed or asked
            for (``query_only``: ColBERT query expansion computes trailing masked positions; ``position_zero``: a
            head reads position 0, which the call's sync checks for padding).
        model_on_cuda, same_device: the weights' device; the inputs on it.
        padded: a padded ``[B, S]`` call (sizes known after its host sync); else a packed one with
            ``num_seqs``, ``total_tokens``, ``max_seqlen`` known.
        integer_inputs, batch, width, vocab: the padded call's dtypes and shape, for the sync-free path;
            ``well_formed``: its tensors' shapes agree (else the synced path's ``unpad`` raises for them).
    """

    structure: str | None = None
    module_calls: str | None = None
    adapters: Any = None
    graphs: Any = None
    kill_switch: bool = False
    suspended: bool = False
    grad: bool = False
    dropout: bool = False
    checkpointing: bool = False
    input_grads: bool = False
    autocast: Any = None
    hidden_states: bool = False
    inputs_embeds: bool = False
    position_ids: bool = False
    query_only: bool = False
    position_zero: bool = False
    model_on_cuda: bool = True
    same_device: bool = True
    padded: bool = False
    num_seqs: int = 1
    total_tokens: int = 1
    max_seqlen: int = 1
    integer_inputs: bool = True
    well_formed: bool = True
    batch: int = 1
    width: int = 1
    vocab: int = 1


_GRAPHS_OFF = Eager()
_PADDED_GRAPH = PackedGraph()
_EAGER: dict = {}  # reason -> Eager(reason): the hot path builds no route object


def _eager(reason: str, refusal: str | None) -> Eager:
    if refusal is not None:
        return Eager(reason, refusal)
    route = _EAGER.get(reason)
    if route is None:
        route = _EAGER[reason] = Eager(reason)
    return route


def _mode_refusal(f: Facts, training: bool = False) -> str | None:
    """The mode refusals of :func:`~packed_encoders.graphs.buckets.admit`, in its order, after the switches and the
    device (a model off CUDA counts every call as such, whatever its mode), as one chain of tests (this runs on
    every call: no tuple of checks built per call). ``training``: the refusals of a training graph for a call with
    gradients instead (gradients are served; checkpointing and inputs that require gradients are not)."""
    if f.kill_switch:
        return B.KILL_SWITCH
    if f.suspended:
        return B.SUSPENDED
    if not f.model_on_cuda:
        return B.NOT_CUDA
    if f.grad and not training:
        return B.GRAD
    if f.dropout:
        return B.DROPOUT
    if training and f.checkpointing:
        return B.CHECKPOINTING
    if f.hidden_states:
        return B.HIDDEN_STATES
    if f.inputs_embeds:
        return B.EMBEDS
    if training and f.input_grads:
        return B.INPUT_GRADS
    return None


def _training(facts: Facts, config) -> Route:
    reason = _mode_refusal(facts, training=True)
    if reason is not None:
        return _eager(reason, None)
    if facts.padded:
        return TrainingGraph(None, facts.autocast)
    bucket = B.admit_sizes(config, facts.same_device, facts.num_seqs, facts.total_tokens, facts.max_seqlen,
                           config.training_steps_per_octave)
    if isinstance(bucket, str):
        return _eager(bucket, None)
    return TrainingGraph(bucket, facts.autocast)


def choose(facts: Facts) -> Route:
    """The route serving a call with these facts (pure: reads ``facts`` only).

    Order: a structure problem -> :class:`Stock`; graphs off, or a called slot graphs refuse (``module_calls``) ->
    :class:`Eager` (with the reason for the latter); a call with gradients under
    ``GraphConfig.training`` -> :class:`TrainingGraph` or, refused, :class:`Eager` with the reason; a padded call under
    ``sync_free`` that the rectangular graphs admit -> :class:`RectangularGraph`; a mode no graph serves (kill
    switch, ``no_cuda_graph``, grad, dropout, hidden states, ``inputs_embeds``, a model off CUDA) or a packed call
    outside the bounds -> :class:`Eager` with the reason; else :class:`PackedGraph`.
    """
    if facts.structure is not None:
        return Stock(facts.structure)
    config = facts.graphs
    if config is None:
        return _GRAPHS_OFF
    if facts.module_calls is not None:  # every graph route: packed, rectangular and training graphs alike
        return _eager(facts.module_calls, None)
    if facts.grad and config.training:
        return _training(facts, config)
    refusal = None
    if facts.padded and config.sync_free and facts.well_formed:
        rect = B.admit_rect(config, facts, facts.vocab)
        if not isinstance(rect, str):
            return RectangularGraph(rect, facts.autocast, facts.adapters)
        refusal = rect
    reason = _mode_refusal(facts)
    if reason is not None:
        return _eager(reason, refusal)
    if facts.padded:
        if facts.autocast is None and refusal is None and facts.adapters is None:
            return _PADDED_GRAPH
        return PackedGraph(None, facts.autocast, refusal, facts.adapters)
    bucket = B.admit_sizes(config, facts.same_device, facts.num_seqs, facts.total_tokens, facts.max_seqlen)
    if isinstance(bucket, str):
        return _eager(bucket, None)
    return PackedGraph(bucket, facts.autocast, adapters=facts.adapters)
