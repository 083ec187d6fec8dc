"""Late-interaction (ColBERT) wrappers whose queries use HF's outputs at masked positions.

Classic ColBERT query expansion pads each query to a fixed length with ``[MASK]`` tokens that keep
``attention_mask == 0``: the encoder does not attend to them, yet their outputs are scored (they "soak up"
query context through the asymmetric mask). PyLate's ``ColBERT`` (``do_query_expansion`` without
``attend_to_expansion_tokens``) and sentence-transformers v6's ``Transformer.query_expansion`` with
``attend=False`` both rely on it. For such targets the packed path computes the trailing masked positions
of short calls as query-only tokens instead of returning zeros there.
"""

from __future__ import annotations

from torch import nn

ALWAYS = 1 << 30


def query_expansion_length(target: nn.Module) -> int | None:
    """Longest padded width (``S``) of a query call, or ``None`` when ``target`` uses no masked expansion.

    Calls at most this wide get trailing masked positions computed; wider calls (documents) keep the
    zeros convention, which their callers ignore anyway.
    """
    if getattr(target, "do_query_expansion", False) and not getattr(target, "attend_to_expansion_tokens", False):
        length = getattr(target, "query_length", None)
        return int(length) if length else ALWAYS
    found = None
    for module in target.modules():
        expansion = getattr(module, "query_expansion", None)
        if isinstance(expansion, dict) and not expansion.get("attend", False):
            length = expansion.get("length") or 0
            if expansion.get("strategy") == "min":
                ceiling = getattr(module, "query_length", None)
                length = max(length, int(ceiling)) if ceiling else ALWAYS
            found = max(found or 0, int(length) or ALWAYS)
    return found
