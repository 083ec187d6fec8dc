"""What the heads and wrappers around an encoder read of its output at padded positions, recorded per encoder.

Some of what the packed forward does depends on the module around the encoder rather than on the encoder: a
question-answering head's loss reads every padded position (trailing ones are computed), a token-classification,
masked-LM or question-answering head gets its labels checked per call (:mod:`.token_labels`), a
``classifier_pooling="cls"`` head reads position 0 of each row, and a ColBERT wrapper's masked query expansion
scores trailing masked positions (:mod:`.late_interaction`).

``pack(target)`` with any ``padded_outputs`` but ``"zeros"`` records, for each encoder inside ``target``, the
modules of ``target`` that read it so (:func:`remember`); every packed state is built from the encoder's record and
the target's readers (:func:`around`), whatever ``pack()``'s target: ``pe.pack(head.model, ...)`` after
``pe.pack(head)``, with other options or after ``pe.unpack(head.model)``, keeps what the head reads, and
``pe.pack(head)`` after ``pe.pack(head.model)`` adds it. ``unpack(target)``, or ``pack(target)`` with
``padded_outputs="zeros"``, drops the readers inside ``target`` from every record (:func:`forget`). The record holds
encoders and readers weakly: it keeps nothing alive.

A copy of a model (deepcopy, unpickling) keeps the state its encoder was packed with, and the record comes along
with the readers: while a reader reads a packed encoder, it carries a :class:`ReaderMark` in its instance
``__dict__`` (:func:`mark_readers`), whose copy records the reader's copy around the copies of the encoders it
reads. Packing a copy's encoder again alone then treats the copy's heads as the original's. A deepcopy links the
encoders it copied before the mark: those inside the reader (a module's submodules come first in its ``__dict__``)
or listed before it in a container; unpickling, the encoders inside the reader. A copy taken while the encoders are
unpacked carries no record (the reader holds nothing of ours then): pack the copy's head, not its encoder alone.

A head reads the encoder inside it: after ``head.model = other`` its entries around the replaced encoder are stale,
and ``unpack()`` of the new encoder, which no record leads to the head, finds the head among the marked readers
(:func:`replaced_reads`), drops them and takes off what ``pack(head)`` put on the head.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

from torch import nn

from .late_interaction import expansion_sources
from .state import STATE_ATTR

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
MARK_ATTR = "_packed_encoders_reads"
# every module given a ReaderMark, weakly: the record leads from an encoder to its readers only, and a head whose
# encoder was replaced since pack(head) (head.model = other) is found from the new one here (replaced_reads)
_MARKED: weakref.WeakSet = weakref.WeakSet()
_HEAD_KINDS = frozenset({SPAN, CHECK, COLUMN_ZERO, FIRST_REAL})  # recorded around an encoder inside the reader


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
        for reader, kinds in readers_in(target, encoder).items():
            _record(encoder, reader, kinds)


def _record(encoder: nn.Module, reader: nn.Module, kinds: frozenset) -> None:
    record = _RECORD.setdefault(encoder, weakref.WeakKeyDictionary())
    record[reader] = record.get(reader, frozenset()) | kinds


def mark_readers(encoders, inside: nn.Module | None = None) -> None:
    """Give each reader recorded around ``encoders`` (and each module of ``inside``) its :class:`ReaderMark` while
    an encoder it reads is packed, and take any other value of that attribute off: after ``unpack()`` of every
    encoder a reader reads, it holds nothing of ours (it pickles without this package), as a head's label check
    comes off then (``token_labels.sync``)."""
    readers = {id(r): r for encoder in encoders for r in list(_RECORD.get(encoder, ()))}
    if inside is not None:
        readers.update((id(m), m) for m in inside.modules())
    for reader in readers.values():
        _mark(reader)


def _mark(reader: nn.Module) -> None:
    packed = any(STATE_ATTR in encoder.__dict__ for encoder, _ in _reads(reader))
    current = reader.__dict__.get(MARK_ATTR)
    if packed and not (isinstance(current, ReaderMark) and current.names(reader)):
        reader.__dict__[MARK_ATTR] = ReaderMark(reader)
    elif not packed and MARK_ATTR in reader.__dict__:  # (also a copy's mark that linked nothing, or a shallow copy's)
        del reader.__dict__[MARK_ATTR]


def replaced_reads(encoders) -> list:
    """The marked readers holding one of ``encoders``, each marked again (:func:`_mark`) once the record no longer
    holds it as a head around an encoder it does not hold now: a head reads the encoder inside it, and after
    ``head.model = other`` its mark and label check still name the replaced encoder, which ``unpack()`` of the new
    one would otherwise leave on the head (the replaced encoder, outside it, stays packed)."""
    wanted = {id(e) for e in encoders}
    found = []
    for reader in list(_MARKED):
        inside = {id(m) for m in reader.modules()}
        if not wanted & inside:
            continue
        for encoder, record in list(_RECORD.items()):
            kinds = record.get(reader)
            if kinds and kinds & _HEAD_KINDS and id(encoder) not in inside:
                if kinds - _HEAD_KINDS:
                    record[reader] = kinds - _HEAD_KINDS
                else:
                    del record[reader]
        _mark(reader)
        found.append(reader)
    return found


def forget(target: nn.Module, encoders=None) -> None:
    """Drop the readers inside ``target`` (``target`` included) from the records of ``encoders`` (default: every
    encoder's), and their marks where they read no packed encoder now."""
    inside = set(target.modules())
    records = list(_RECORD.values()) if encoders is None else [_RECORD[e] for e in encoders if e in _RECORD]
    dropped = set()
    for record in records:
        for module in [m for m in record if m in inside]:
            del record[module]
            dropped.add(module)
    for module in dropped:
        _mark(module)


def _reads(reader: nn.Module) -> list:
    """``[(encoder, kinds)]``: what the record holds of ``reader``."""
    return [(encoder, record[reader]) for encoder, record in list(_RECORD.items()) if reader in record]


class ReaderMark:
    """Carries a recorded reader's place in the record to its copies (see the module docstring). A deepcopy records
    the reader's copy around the copies of the encoders it reads made earlier by the same deepcopy, and points their
    query-expansion watch at the copy (:meth:`.late_interaction.ExpansionWatch.follow`); unpickling records it
    around the unpickled encoders inside it, pickled along. A copy that links no encoder is ``None``."""

    def __init__(self, reader: nn.Module):
        self._reader = weakref.ref(reader)
        _MARKED.add(reader)

    def names(self, reader: nn.Module) -> bool:
        """This mark is ``reader``'s own (a shallow copy of a module shares its original's)."""
        return self._reader() is reader

    def __deepcopy__(self, memo: dict) -> ReaderMark | None:
        reader = self._reader()
        copy = None if reader is None else memo.get(id(reader))
        if copy is None:  # (the mark copied without its reader)
            return None
        linked = False
        for encoder, kinds in _reads(reader):
            twin = memo.get(id(encoder))
            if twin is None:
                continue
            _record(twin, copy, kinds)
            linked = True
            watch = getattr(twin.__dict__.get(STATE_ATTR), "runtime", {}).get("expansion")
            if watch is not None and EXPANSION in kinds:
                watch.follow(reader, copy)
        return ReaderMark(copy) if linked else None

    def __reduce__(self):
        reader = self._reader()
        inside = [] if reader is None else [(e, kinds) for e, kinds in _reads(reader)
                                            if any(m is e for m in reader.modules())]
        return (_unpickled_mark, (reader, inside)) if inside else (_no_mark, ())


def _unpickled_mark(reader: nn.Module, reads: list) -> ReaderMark:
    for encoder, kinds in reads:
        _record(encoder, reader, kinds)
    return ReaderMark(reader)


def _no_mark():
    return None


def label_heads(encoder: nn.Module) -> list:
    """The heads recorded as checking ``encoder``'s labels."""
    record = _RECORD.get(encoder)
    return [m for m, kinds in record.items() if CHECK in kinds] if record else []


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
    return list({id(head): head for encoder in encoders for head in label_heads(encoder)}.values())


def is_checked(head: nn.Module) -> bool:
    """``head`` is recorded as checking the labels of some encoder."""
    return any(CHECK in record.get(head, ()) for record in list(_RECORD.values()))
