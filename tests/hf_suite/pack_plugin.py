"""pytest plugin for HF's own ModernBERT model tests: with ``PE_HF_SUITE_PACK=1`` every ``ModernBertModel`` is
packed (``pe.pack(model, validate=False)``; the structure checks still run) as soon as it is built, so each test
of the file exercises the packed forward wherever it runs the encoder. Loaded by ``run.sh`` (``-p pack_plugin``)."""

from __future__ import annotations

import os


def pytest_configure(config):
    if os.environ.get("PE_HF_SUITE_PACK") != "1":
        return
    from transformers.models.modernbert import modeling_modernbert

    import packed_encoders as pe

    cls = modeling_modernbert.ModernBertModel
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        pe.pack(self, validate=False)

    cls.__init__ = __init__
