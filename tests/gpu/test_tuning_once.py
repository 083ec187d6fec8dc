"""Switches read once at ``pack()`` on CUDA: the eager plan's facts in ``describe()`` (unchecked launches on the
default path), the cute family's LayerNorm substitution named there, and a kernel switch set after ``pack()`` that
waits for the next ``pack()`` (eager and graph calls).

Run: ``python -m pytest -q tests/gpu/test_tuning_once.py`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import packed_encoders as pe  # noqa: E402
from packed_encoders.ops import triton as triton_ops  # noqa: E402

DEV = torch.device("cuda")


def _model():
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    config = ModernBertConfig(num_hidden_layers=4)
    config._attn_implementation = "sdpa"
    return ModernBertModel(config).to(DEV, torch.bfloat16).eval()


def _batch(lengths, vocab=50368):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    return ids.to(DEV), mask.to(DEV)


def _entry(model):
    return pe.describe(model)["encoders"][0]


def test_default_eager_plan_is_direct_and_shown(monkeypatch):
    for name in ("PACKED_ENCODERS_LEAN", "PACKED_ENCODERS_TRITON_FAST_LAUNCH"):
        monkeypatch.delenv(name, raising=False)
    model = pe.pack(_model(), cuda_graph=False)
    ids, mask = _batch([40, 300, 7])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    facts = _entry(model)["eager_plan"]
    assert facts["direct"] is True and facts["why_checked"] is None, facts
    monkeypatch.setenv("PACKED_ENCODERS_LEAN", "0")
    monkeypatch.setenv("PACKED_ENCODERS_TRITON_FAST_LAUNCH", "0")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert _entry(model)["eager_plan"]["direct"] is True, "read at pack(): no effect before re-packing"
    assert triton_ops.FAST_LAUNCH is True
    pe.pack(model, cuda_graph=False)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    facts = _entry(model)["eager_plan"]
    assert facts["direct"] is False and facts["why_checked"].startswith("PACKED_ENCODERS_LEAN is off"), facts
    assert triton_ops.FAST_LAUNCH is False and _entry(model)["tuning"]["triton_fast_launch"] is False
    monkeypatch.delenv("PACKED_ENCODERS_LEAN")
    monkeypatch.delenv("PACKED_ENCODERS_TRITON_FAST_LAUNCH")
    pe.pack(model, cuda_graph=False)  # leaves the process-wide launcher switch on again for the other tests
    assert triton_ops.FAST_LAUNCH is True
    pe.unpack(model)


def test_cute_names_its_layer_norm_substitution():
    try:
        model = pe.pack(_model(), kernels="cute", cuda_graph=False)
    except pe.PackedEncodersError as exc:
        pytest.skip(f"kernels='cute' not available here: {exc}")
    entry = _entry(model)
    assert entry["kernels"] == "cute"
    (sub,) = entry["kernel_substitutions"]
    assert "Triton" in sub and "quack" in sub
    assert _entry(pe.pack(model, kernels="triton", cuda_graph=False))["kernel_substitutions"] == []
    pe.unpack(model)


def test_quack_switch_after_pack_waits_for_repack_under_graphs(monkeypatch):
    monkeypatch.delenv("PACKED_ENCODERS_QUACK_GEMM", raising=False)
    model = pe.pack(_model())  # default: graphs on
    gemm = _entry(model)["gemm"]
    ids, mask = _batch([64, 200, 31])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    monkeypatch.setenv("PACKED_ENCODERS_QUACK_GEMM", "0")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert _entry(model)["gemm"] == gemm, "read at pack()"
    pe.pack(model)
    entry = _entry(model)
    assert entry["gemm"] == "torch" and entry["tuning"]["quack_gemm"] is False
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.isfinite(out[mask.bool()]).all()
    pe.unpack(model)
