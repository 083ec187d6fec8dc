"""pytest plugin for HF's own ModernBERT model tests (loaded by ``run.sh`` with ``-p pack_plugin``).

``PE_HF_SUITE_PACK=1``: every ``ModernBertModel`` is packed (``pe.pack(model, validate=False)``; the structure
checks still run) as soon as it is built, so each test exercises the patched forward wherever it runs the encoder.
Each test's junit entry gets two properties: ``packed_forwards`` (calls the packed path ran) and
``stock_forwards`` (calls the patched forward handed to the stock forward, e.g. for a mask with holes), so a test
that passes packed without the packed path running is visible (``compare.py`` lists them).

``PE_HF_SUITE_MASKS=contiguous`` (stock and packed alike): HF's ``random_attention_mask`` keeps each row's count of
real tokens but puts them first (right padding). HF's random masks have holes inside rows, which the patched
forward serves with the stock forward; contiguous masks make those tests run the packed path.
"""

from __future__ import annotations

import os

import pytest

_counts = {"packed_forwards": 0, "stock_forwards": 0}


def _contiguous_masks():
    import torch

    from tests import test_modeling_common as common  # run.sh's copy of HF's tests/ (the working directory)

    original = common.random_attention_mask

    def random_attention_mask(shape, rng=None, name=None):
        mask = original(shape, rng=rng, name=name)  # same draws, so every other random input stays the same
        real = mask.sum(-1, keepdim=True)
        return (torch.arange(mask.shape[-1], device=mask.device) < real).to(mask.dtype)

    common.random_attention_mask = random_attention_mask


def _pack_every_model():
    import importlib.util

    from transformers.models.modernbert import modeling_modernbert

    import packed_encoders as pe
    from packed_encoders.adapters import hf_call

    cls = modeling_modernbert.ModernBertModel
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        pe.pack(self, validate=False)

    cls.__init__ = __init__

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            _counts[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    # run_packed: the eager packed forward, a global of the module that calls it (hf_call, or call with the router)
    owners = [m for m in (hf_call, importlib.util.find_spec("packed_encoders.call") and
                          importlib.import_module("packed_encoders.call")) if m and "run_packed" in vars(m)]
    if not owners or "_stock_fallback" not in vars(hf_call):
        raise RuntimeError("pack_plugin: packed_encoders has no run_packed / hf_call._stock_fallback to count calls")
    for owner in owners:
        owner.run_packed = counted(owner.run_packed, "packed_forwards")
    hf_call._stock_fallback = counted(hf_call._stock_fallback, "stock_forwards")


def pytest_configure(config):
    if os.environ.get("PE_HF_SUITE_MASKS") == "contiguous":
        _contiguous_masks()
    if os.environ.get("PE_HF_SUITE_PACK") == "1":
        _pack_every_model()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    for key in _counts:
        _counts[key] = 0
    try:
        return (yield)
    finally:
        if os.environ.get("PE_HF_SUITE_PACK") == "1":
            item.user_properties.extend(_counts.items())
