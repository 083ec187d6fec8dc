"""ModernBertParams reads both config layouts and refuses what the packed path cannot run."""

from __future__ import annotations

import pytest

from packed_encoders.model.params import ModernBertParams
from tests.helpers import make_config


def test_v5_layout():
    p = ModernBertParams.from_hf_config(make_config("odd"))
    assert p.layer_is_global == (True, False, True, False)
    assert p.window == 3 and p.head_dim == 32
    assert p.activation == "gelu_tanh" and p.norm_bias and p.attention_bias and p.mlp_bias
    assert (p.rope_theta_global, p.rope_theta_local) == (160_000.0, 10_000.0)
    assert p.layer_window(0) is None and p.layer_window(1) == 3


def test_v4_kwargs_are_converted_by_hf_and_read():
    cfg = make_config("base_like", global_attn_every_n_layers=2, global_rope_theta=50_000.0, local_rope_theta=777.0)
    p = ModernBertParams.from_hf_config(cfg)
    assert p.layer_is_global == (True, False, True, False)
    assert (p.rope_theta_global, p.rope_theta_local) == (50_000.0, 777.0)


def test_v4_dict_layout():
    v4 = dict(model_type="modernbert", hidden_size=64, num_attention_heads=4, num_hidden_layers=5,
              intermediate_size=96, vocab_size=100, global_attn_every_n_layers=2, global_rope_theta=1234.0,
              local_rope_theta=None, local_attention=32, hidden_activation="gelu")
    p = ModernBertParams.from_hf_config(v4)
    assert p.layer_is_global == (True, False, True, False, True)
    assert p.rope_theta_local == 1234.0  # v4: None means the global theta
    v4.pop("local_rope_theta")
    assert ModernBertParams.from_hf_config(v4).rope_theta_local == 10_000.0


@pytest.mark.parametrize("change, match", [
    (dict(model_type="bert"), "not a ModernBERT"),
    (dict(hidden_size=65), "not divisible"),
    (dict(num_attention_heads=64), "head_dim 1 .* odd"),
    (dict(hidden_size=60, num_attention_heads=4), "head_dim 15 .* odd"),
    (dict(hidden_activation="mish"), "not implemented"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope"),
])
def test_refusals(change, match):
    cfg = dict(model_type="modernbert", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
               intermediate_size=96, vocab_size=100)
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        ModernBertParams.from_hf_config(cfg)


def test_non_default_rope_type_in_v5_is_refused():
    cfg = make_config("base_like")
    cfg.rope_parameters["full_attention"]["rope_type"] = "dynamic"
    with pytest.raises(ValueError, match="rope_type"):
        ModernBertParams.from_hf_config(cfg)
