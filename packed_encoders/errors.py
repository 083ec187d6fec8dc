"""Exception hierarchy of packed_encoders, and the messages more than one module raises."""

from __future__ import annotations

SECOND_DERIVATIVE = ("packed_encoders: second derivatives through the packed encoder are not supported (its training "
                     "path runs kernels with hand-written first-order backwards); run that model unpacked "
                     "(pe.unpack(model)) to differentiate twice")

TOKEN_TYPES = ("token_type_ids has {count} non-zero entries; ModernBERT has no token type embeddings (stock HF ignores "
               "them): leave them out of the call (a tokenizer that makes them for text pairs: "
               "tokenizer.model_input_names = ['input_ids', 'attention_mask'])")


class PackedEncodersError(RuntimeError):
    """Base class: a request the packed path cannot honour, or bad input to it."""


class StockOnlyInput(PackedEncodersError):
    """A call stock Hugging Face serves and the packed path does not (a mask with holes inside a row): the patched
    ``forward`` runs the stock forward for it; ``packed_forward`` and other direct entry points raise it.

    ``reason``: the message without the call's counts, for the fallback's one warning and ``describe()`` entry."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


class UnsupportedTargetError(PackedEncodersError, TypeError):
    """`pack()` cannot pack the object it was given: no ModernBERT encoder inside it, a config the packed path
    cannot run (e.g. ``rope_scaling``), or a module the packed forward would skip (a hook, a wrapped or swapped
    submodule, FSDP2 sharding inside the encoder; see the README's "Module changes")."""


class ValidationError(PackedEncodersError):
    """`validate()` found the selected fast path out of tolerance against stock Hugging Face.

    The message carries the measured numbers; `.report` holds the full :class:`ValidationReport`.
    """

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report
