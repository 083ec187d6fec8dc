"""What the heads and wrappers around an encoder read of its output at padded positions, recorded per encoder.

Some of what the packed forward does depends on the module around the encoder rather than on the encoder: a
question-answering head's loss reads every padded position (trailing ones are computed), a token-classification,
masked-LM or question-answering head gets its labels checked per call (:mod:`.token_labels`), a
``classifier_pooling="cls"`` head reads position 0 of each row, and a ColBERT wrapper's masked query expansion
scores trailing masked positions (:mod:`.late_interaction`).

``pack(target)`` with ``padded_outputs="auto"`` records, for each encoder inside ``target``, the modules of
``target`` that read it so (:func:`remember`); every packed state is built from the encoder's record and the
target's readers (:func:`around`), whatever ``pack()``'s target: ``pe.pack(head.model, ...)`` after
``pe.pack(head)``, with other options or after ``pe.unpack(head.model)``, keeps what the head reads, and
``pe.pack(head)`` after ``pe.pack(head.model)`` adds it. ``unpack(target)``, or ``pack(target)`` with other
``padded_outputs``, drops the readers inside ``target`` from every record (:func:`forget`). The record holds
encoders and readers weakly: it keeps nothing alive. A copy of a model (deepcopy, unpickling) keeps the state its
encoder was packed with; of the record, only the label-checking heads come along (:func:`record_check`, called as a
head's ``CheckedForward`` is copied).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from torch import nn

from .late_interaction import expansion_sources

CHECK_SUFFIXES = ("ForTokenClassification", "ForMaskedLM", "ForQuestionAnswering")  # labels read per call
SPAN_SUFFIX = "ForQuestionAnswering"
POSITION_ZERO_SUFFIXES = ("ForSequenceClassification", "ForMultipleChoice")  # with classifier_pooling="cls"


def head_suffix(module: nn.Module) -> str | None:
    """Which of the heads above ``module`` is (``"ForQuestionAnswering"``, ... as HF names them), or ``None``: the
    suffix of the first class in its MRO that has one, so a subclass of an HF head (``class MyTagger(
    ModernBertForTokenClassification)``) counts as that head."""
    for cls in type(module).__mro__:
        for suffix in (*CHECK_SUFFIXES, *POSITION_ZERO_SUFFIXES):
            if cls.__name__.endswith(suffix):
                return suffix
    return None


SPAN = "span"  # a question-answering head's loss reads every padded position: trailing ones computed
CHECK = "labels"  # a head whose forward checks its call's labels (token_labels.CheckedForward)
COLUMN_ZERO = "column 0"  # a sequence-classification head reads position 0 of each row
FIRST_REAL = "first real token"  # a multiple-choice head reads each row's first real token (position 0 if none)
EXPANSION = "query expansion"  # a module holding ColBERT query-expansion settings

# encoder -> {reader module -> frozenset of kinds}, both weak
_RECORD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Readers(NamedTuple):
    span: bool  # a question-answering head: every trailing padded position is computed
    position_zero: str | None  # COLUMN_ZERO, FIRST_REAL or None
    expansion: list  # the modules holding query-expansion settings (late_interaction.expansion_sources)


def readers_in(target: nn.Module, encoder: nn.Module) -> dict:
    """``{module: kinds}``: the modules of ``target`` that read ``encoder``'s output at padded positions. A
    query-expansion setting anywhere in ``target`` counts for every encoder inside it (the target's scores read
    them); a head (span loss, label checks, position-0 reads) counts for the encoders inside it only: the record
    outlives this ``pack()``, and an encoder beside a question-answering head would compute its trailing padded
    positions for no reader."""
    found: dict = {}

    def add(module, kind):
        found[module] = found.get(module, frozenset()) | {kind}

    for source in expansion_sources(target):
        add(source, EXPANSION)
    for module in target.modules():
        suffix = head_suffix(module)
        if suffix is None or not any(m is encoder for m in module.modules()):
            continue
        if suffix == SPAN_SUFFIX:
            add(module, SPAN)
        if suffix in CHECK_SUFFIXES:
            add(module, CHECK)
        else:
            add(module, FIRST_REAL if suffix == "ForMultipleChoice" else COLUMN_ZERO)
    return found


def remember(target: nn.Module, encoders) -> None:
    """Record ``target``'s readers of each of ``encoders`` (packed from ``target``), replacing what their records
    held of ``target``'s modules."""
    forget(target, encoders)
    for encoder in encoders:
        found = readers_in(target, encoder)
        if found:
            _RECORD.setdefault(encoder, weakref.WeakKeyDictionary()).update(found)


def record_check(head: nn.Module, encoders, span: bool) -> None:
    """Record ``head`` as checking the labels of ``encoders`` (and, ``span``, reading their trailing padded
    positions): a copy of a checked head (deepcopy, unpickling) recorded around its copied encoders, as ``pack()``
    recorded the original."""
    kinds = frozenset({CHECK, SPAN} if span else {CHECK})
    for encoder in encoders:
        record = _RECORD.setdefault(encoder, weakref.WeakKeyDictionary())
        record[head] = record.get(head, frozenset()) | kinds


def forget(target: nn.Module, encoders=None) -> None:
    """Drop the readers inside ``target`` (``target`` included) from the records of ``encoders`` (default: every
    encoder's)."""
    inside = set(target.modules())
    records = list(_RECORD.values()) if encoders is None else [_RECORD[e] for e in encoders if e in _RECORD]
    for record in records:
        for module in [m for m in record if m in inside]:
            del record[module]


def around(encoder: nn.Module, target: nn.Module | None = None) -> Readers:
    """What reads ``encoder``'s output: its record, with ``target``'s readers (as :func:`remember` would record
    them) in place of what was recorded of ``target``'s modules."""
    found = dict(_RECORD.get(encoder, {}).items())
    if target is not None:
        inside = set(target.modules())
        found = {m: kinds for m, kinds in found.items() if m not in inside}
        found.update(readers_in(target, encoder))
    kinds = set().union(*found.values()) if found else set()
    # an encoder read by both cls heads is checked as the sequence-classification head's: a row without real tokens
    # is padded at position 0 too
    zero = COLUMN_ZERO if COLUMN_ZERO in kinds else FIRST_REAL if FIRST_REAL in kinds else None
    return Readers(span=SPAN in kinds, position_zero=zero,
                   expansion=[m for m, k in found.items() if EXPANSION in k])


def checked_heads(encoders) -> list:
    """The heads recorded as checking the labels of any of ``encoders``, each once."""
    heads: dict = {}
    for encoder in encoders:
        for module, kinds in _RECORD.get(encoder, {}).items():
            if CHECK in kinds:
                heads[id(module)] = module
    return list(heads.values())


def is_checked(head: nn.Module) -> bool:
    """``head`` is recorded as checking the labels of some encoder."""
    return any(CHECK in record.get(head, ()) for record in list(_RECORD.values()))
