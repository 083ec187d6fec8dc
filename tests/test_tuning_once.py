"""Switches are read once, at ``pack()``, into the encoder's frozen ``Tuning``; nothing below the router reads the
environment on the call path, and ``describe()`` shows what the eager plan decided."""

from __future__ import annotations

import os
import re
from collections.abc import MutableMapping
from pathlib import Path

import pytest
import torch

import packed_encoders as pe
from packed_encoders.adapters.state import get_state
from packed_encoders.graphs.buckets import RectBucket, bucket_for
from packed_encoders.graphs.config import GraphConfig
from packed_encoders.model.plan import Rules, last_plan, rules_for
from packed_encoders.tuning import Tuning, read_tuning
from tests.test_router import VOCAB, padded, tiny_model

ROOT = Path(pe.__file__).parent
SWITCHES = ("PACKED_ENCODERS_LEAN", "PACKED_ENCODERS_FUSED_ROPE", "PACKED_ENCODERS_FUSED_GLU_GEMM",
            "PACKED_ENCODERS_QUACK_GEMM", "PACKED_ENCODERS_QUACK_ROPE", "PACKED_ENCODERS_TRITON_FAST_LAUNCH",
            "PACKED_ENCODERS_FUSED_UNPAD", "PACKED_ENCODERS_POLICY", "PACKED_ENCODERS_CACHE")
LEAN_OFF = "PACKED_ENCODERS_LEAN is off"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in SWITCHES:
        monkeypatch.delenv(name, raising=False)


def _plan_facts(model):
    return pe.describe(model)["encoders"][0]["eager_plan"]


def test_every_kernel_switch_lands_in_the_tuning_and_the_rules(monkeypatch):
    assert rules_for(read_tuning()) == Rules()  # nothing set: the defaults, as direct users of the ops get them
    for name in SWITCHES[:-2]:
        monkeypatch.setenv(name, "0")
    t = read_tuning()
    assert not (t.lean or t.fused_rope or t.fused_glu_gemm or t.quack_gemm or t.quack_rope or t.triton_fast_launch
                or t.fused_unpad)
    rules = rules_for(t)
    assert (rules.lean, rules.fused_rope, rules.glu_gemm_max_tokens, rules.small_linear_max_tokens) == (False, False,
                                                                                                      0, 0)
    assert "ops_reads" not in t.describe() and t.describe()["lean"] is False


def test_a_switch_set_after_pack_waits_for_the_next_pack(monkeypatch):
    model = pe.pack(tiny_model(), validate=False)
    assert _plan_facts(model) is None  # no eager call yet
    ids, mask = padded([3, 7])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    facts = _plan_facts(model)
    assert facts["direct"] is False and facts["why_checked"] == "the 'torch' op set has no unchecked launches"
    assert facts["linear"] == "F.linear"
    monkeypatch.setenv("PACKED_ENCODERS_LEAN", "0")
    monkeypatch.setenv("PACKED_ENCODERS_FUSED_ROPE", "0")
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert _plan_facts(model)["why_checked"] == facts["why_checked"], "read at pack(): no effect yet"
    state = get_state(model)
    assert state.tuning.lean and rules_for(state.tuning).fused_rope
    pe.pack(model, validate=False)  # re-read
    state = get_state(model)
    assert not state.tuning.lean and not rules_for(state.tuning).fused_rope
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    assert _plan_facts(model)["why_checked"].startswith(LEAN_OFF)
    monkeypatch.delenv("PACKED_ENCODERS_LEAN")
    pe.pack(model, validate=False)
    model.train()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    assert _plan_facts(model)["why_checked"].startswith("gradients wanted")


def test_graph_runners_plan_with_the_encoders_tuning(monkeypatch):
    """A graph capture runs the plan of the tuning read at ``pack()`` (here: lean off), whatever the environment
    says when it captures."""
    from packed_encoders.graphs.rectangular import RectRunner
    from packed_encoders.graphs.runner import GraphRunner

    monkeypatch.setenv("PACKED_ENCODERS_LEAN", "0")
    model = pe.pack(tiny_model(), validate=False)
    state = get_state(model)
    monkeypatch.delenv("PACKED_ENCODERS_LEAN")
    with torch.no_grad():  # capture=False: the runners run their forward once at construction
        GraphRunner(model, state, bucket_for(GraphConfig(), 2, 29, 20), "sdpa", capture=False)
        assert last_plan().why_checked.startswith(LEAN_OFF)
        RectRunner(model, state, RectBucket(2, 32, VOCAB), "sdpa", capture=False)
        assert last_plan().why_checked.startswith(LEAN_OFF)


class _NoSwitchReads(MutableMapping):
    """``os.environ`` that fails any read of a ``PACKED_ENCODERS_*`` variable."""

    def __init__(self, env):
        self.env = env

    @staticmethod
    def _check(key):
        if isinstance(key, str) and key.startswith("PACKED_ENCODERS_"):
            raise AssertionError(f"{key} read from the environment during a call")

    def __getitem__(self, key):
        self._check(key)
        return self.env[key]

    def __contains__(self, key):
        self._check(key)
        return key in self.env

    def __setitem__(self, key, value):
        self.env[key] = value

    def __delitem__(self, key):
        del self.env[key]

    def __iter__(self):
        return iter(self.env)

    def __len__(self):
        return len(self.env)


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_calls_read_no_switch_from_the_environment(monkeypatch, kernels, request):
    if kernels == "triton":
        pytest.importorskip("triton")
        request.getfixturevalue("triton_interpret")
    model = pe.pack(tiny_model(), validate=False, kernels=kernels)
    ids, mask = padded([5, 12, 3])
    monkeypatch.setattr(os, "environ", _NoSwitchReads(os.environ))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    model.train()
    model(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    flat = pe.packed_forward(model, None, ids[mask.bool()], torch.tensor([0, 5, 17, 20], dtype=torch.int32), 12)
    assert flat.shape == (20, model.config.hidden_size)


def test_no_switch_reads_in_the_layers_below_the_router():
    """``switched_off(`` and ``os.environ`` / ``getenv`` stay out of the kernel layer, the model, the batch and the
    call path. Allowed: ``TRITON_INTERPRET`` (Triton's own interpret switch, asked for CPU tensors),
    ``TRITON_DEFAULT_FP_FUSION`` (Triton's own default, which a launch through Triton reads anyway; asked on that
    path only, never on a cached or bound launch) and ``attention.dispatch.cache_dir`` (calibration's writer, never
    called on the call path)."""
    files = [*(ROOT / "ops").rglob("*.py"), *(ROOT / "attention").rglob("*.py"), *(ROOT / "model").rglob("*.py"),
             *(ROOT / "graphs").rglob("*.py"), ROOT / "batch.py", ROOT / "call.py", ROOT / "router.py"]
    found = []
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "switched_off(" in line or re.search(r"os\.environ|getenv", line):
                if "TRITON_INTERPRET" in line or "TRITON_DEFAULT_FP_FUSION" in line or (
                        path.name == "dispatch.py" and ("CACHE_ENV" in line or "XDG_CACHE_HOME" in line)):
                    continue
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_describe_names_the_cute_substitution():
    from packed_encoders.ops import TORCH_OPS

    pytest.importorskip("triton")
    from packed_encoders.ops.cute.opset import CUTE_OPS
    from packed_encoders.ops.quack_gemm import with_quack_gemms

    assert getattr(TORCH_OPS, "substitutions", ()) == ()
    (sub,) = CUTE_OPS.substitutions
    assert "Triton" in sub and "quack" in sub
    assert with_quack_gemms(CUTE_OPS).substitutions == CUTE_OPS.substitutions  # kept with quack's GEMMs
    model = pe.pack(tiny_model(), validate=False)
    assert pe.describe(model)["encoders"][0]["kernel_substitutions"] == []


def test_default_tuning_is_what_direct_users_get():
    from packed_encoders.attention import backends
    from packed_encoders.model.plan import default_rules

    assert default_rules() == rules_for(Tuning())
    assert backends.FUSED_ROPE is Tuning().fused_rope


def test_the_last_pack_sets_the_fast_launcher_a_kept_state_included(monkeypatch):
    """PACKED_ENCODERS_TRITON_FAST_LAUNCH is process-wide and the last pack() sets it, also one that keeps the
    encoder's state (same options and switches as when it was packed)."""
    import packed_encoders.ops.triton as T

    monkeypatch.setattr(T, "FAST_LAUNCH", T.FAST_LAUNCH)  # restored after the test
    monkeypatch.setenv("PACKED_ENCODERS_TRITON_FAST_LAUNCH", "0")
    a = pe.pack(tiny_model(), validate=False)
    assert T.FAST_LAUNCH is False
    monkeypatch.delenv("PACKED_ENCODERS_TRITON_FAST_LAUNCH")
    pe.pack(tiny_model(), validate=False)
    assert T.FAST_LAUNCH is True
    monkeypatch.setenv("PACKED_ENCODERS_TRITON_FAST_LAUNCH", "0")
    state = get_state(a)
    pe.pack(a, validate=False)
    assert get_state(a) is state  # kept
    assert T.FAST_LAUNCH is False
