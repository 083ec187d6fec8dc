"""Late-interaction (ColBERT) wrappers whose queries use HF's outputs at masked positions.

Classic ColBERT query expansion pads each query to a fixed length with ``[MASK]`` tokens that keep
``attention_mask == 0``: the encoder does not attend to them, yet their outputs are scored (they "soak up"
query context through the asymmetric mask). PyLate's ``ColBERT`` (``do_query_expansion`` without
``attend_to_expansion_tokens``) and sentence-transformers v6's ``Transformer.query_expansion`` with
``attend=False`` both rely on it. For such targets the packed path computes the trailing masked positions
of short calls as query-only tokens instead of returning zeros there.
"""

from __future__ import annotations

import weakref

from torch import nn

ALWAYS = 1 << 30


def expansion_sources(target: nn.Module | None) -> list:
    """The modules of ``target`` (itself included) whose attributes set masked query expansion: PyLate ``ColBERT``
    models (``do_query_expansion``; the target, or one inside a container), then every module with a
    ``query_expansion`` attribute (sentence-transformers v6)."""
    if target is None:
        return []
    modules = list(target.modules())
    return ([m for m in modules if hasattr(m, "do_query_expansion")]
            + [m for m in modules if hasattr(m, "query_expansion")])


def expansion_length(sources) -> int | None:
    """Longest padded width (``S``) of a query call, read from ``sources`` (:func:`expansion_sources`), or ``None``
    when they set no masked expansion. Calls at most this wide get trailing masked positions computed; wider calls
    (documents) keep the zeros convention, which their callers ignore anyway. Every source counts (two ColBERTs
    in one container, each with its own query length, both read the encoders inside it)."""
    found = None
    for src in sources:
        if getattr(src, "do_query_expansion", False) and not getattr(src, "attend_to_expansion_tokens", False):
            length = getattr(src, "query_length", None)
            found = max(found or 0, int(length) if length else ALWAYS)
            continue
        expansion = getattr(src, "query_expansion", None)
        if isinstance(expansion, dict) and not expansion.get("attend", False):
            # "min" pads short queries up to its length inside calls as wide as the longest query, capped by a
            # max_length that need not reach the encoder (per call, or the trainer's through its collator), not by
            # query_length: every width may be a query call
            length = ALWAYS if expansion.get("strategy") == "min" else expansion.get("length") or 0
            found = max(found or 0, int(length) or ALWAYS)
    return found


def _settings(sources) -> tuple:
    return tuple((getattr(s, "do_query_expansion", None), getattr(s, "attend_to_expansion_tokens", None),
                  getattr(s, "query_length", None), _copy(getattr(s, "query_expansion", None))) for s in sources)


def _copy(value):
    return dict(value) if isinstance(value, dict) else value


def _GONE():  # a source that was gone when its watch was pickled
    return None


class ExpansionWatch:
    """The query-expansion settings of the modules around a packed encoder as they are now (``sources``:
    :func:`expansion_sources` of the targets it was packed from, :mod:`.around`): a call reads :meth:`length`, which
    reads the sources' attributes (a few ``getattr``) and recomputes only when they changed since the last call, so
    expansion switched on, off or resized after ``pack()`` is honoured. Sources are held weakly (the target owns
    the encoder)."""

    def __init__(self, sources, encoder: nn.Module | None = None):
        sources = list(sources)
        self._refs = tuple(weakref.ref(s) for s in sources)
        # a source beside the encoder (a container-mate when packed through a container) is not pickled along: it
        # is another model, which a pickle of this encoder's head would carry whole (and fail on its accelerate hook)
        self._inside = tuple(encoder is None or any(m is encoder for m in s.modules()) for s in sources)
        self._waiting = (None,) * len(sources)
        self._seen = _settings(sources)
        self._length = expansion_length(sources)

    def __bool__(self) -> bool:
        return bool(self._refs)

    def copied(self, memo: dict) -> "ExpansionWatch":
        """This watch for a copy made by the ``copy.deepcopy`` that ``memo`` belongs to: on the copies of its sources
        made so far (a whole target copied: its modules enter the memo before the encoder's state). A source not
        copied yet reads as gone (the copy keeps the length read so far) until a copy of it made later by the same
        deepcopy takes its place (:meth:`follow`); one never copied (the encoder copied alone) stays gone."""
        new = object.__new__(ExpansionWatch)
        copies = [None if s is None else memo.get(id(s)) for s in (r() for r in self._refs)]
        new._refs = tuple(_GONE if c is None else weakref.ref(c) for c in copies)
        new._waiting = tuple(r if c is None else None for r, c in zip(self._refs, copies))
        new._inside = self._inside
        new._seen, new._length = self._seen, self._length
        return new

    def follow(self, source, copy) -> None:
        """Read ``copy``'s settings where this copied watch waits for ``source``'s copy (a source copied after the
        encoder: :meth:`copied`)."""
        pairs = [(weakref.ref(copy), None) if w is not None and w() is source else (r, w)
                 for r, w in zip(self._refs, self._waiting)]
        self._refs, self._waiting = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)

    def __getstate__(self) -> dict:
        # pickled with the sources themselves: a pickled target (torch.save, a multi-process pool's workers) holds
        # them already, so the unpickled watch follows the unpickled target's settings (a source a copy never got
        # pickles as gone)
        return {"sources": [r() if keep else None for r, keep in zip(self._refs, self._inside)], "seen": self._seen,
                "length": self._length}

    def __setstate__(self, state: dict) -> None:
        self._refs = tuple(_GONE if s is None else weakref.ref(s) for s in state["sources"])
        self._waiting = (None,) * len(self._refs)
        self._inside = (True,) * len(self._refs)
        self._seen, self._length = state["seen"], state["length"]

    def length(self) -> int | None:
        sources = [r() for r in self._refs]
        if any(s is None for s in sources):  # gone (an encoder unpickled without its target): the last length holds
            return self._length
        now = _settings(sources)
        if now != self._seen:
            self._seen, self._length = now, expansion_length(sources)
        return self._length
