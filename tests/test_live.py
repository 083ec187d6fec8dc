"""model/live.py: the hot path's submodule and parameter reads return what ``getattr`` returns, read live."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from packed_encoders.model.live import param, sub


class _Double(nn.Module):
    def forward(self, w):
        return 2 * w


def test_reads_match_getattr_for_registered_replaced_and_parametrized_names():
    outer = nn.Module()
    outer.lin = nn.Linear(3, 4, bias=False)
    assert sub(outer, "lin") is outer.lin
    assert param(outer.lin, "weight") is outer.lin.weight
    assert param(outer.lin, "bias", None) is None  # registered as None
    assert param(nn.Identity(), "bias", None) is None  # not registered at all
    replacement = nn.Linear(3, 4)
    outer.lin = replacement  # replaced after a first read: the next read sees it
    assert sub(outer, "lin") is replacement and param(replacement, "bias") is replacement.bias
    replacement.weight = nn.Parameter(torch.ones(4, 3))
    assert param(replacement, "weight") is replacement.weight
    parametrize.register_parametrization(replacement, "weight", _Double())  # a property, not a registry entry
    torch.testing.assert_close(param(replacement, "weight"), torch.full((4, 3), 2.0))
    outer.extra = torch.zeros(2)  # a plain attribute: getattr's answer
    assert sub(outer, "extra") is outer.extra


def test_layer_args_read_a_parametrized_projection_live():
    from packed_encoders.model.blocks import layer_args
    from packed_encoders.model.params import ModernBertParams
    from tests.helpers import make_model

    model = make_model("base_like")
    params = ModernBertParams.from_hf_config(model.config)
    layer = model.layers[1]
    before = layer_args(layer, params, None, None)
    assert before[0][2] is layer.attn.Wqkv.weight and before[2][4] is layer.mlp.Wi.weight
    parametrize.register_parametrization(layer.attn.Wqkv, "weight", _Double())
    after = layer_args(layer, params, None, None)
    torch.testing.assert_close(after[0][2], 2 * layer.attn.Wqkv.parametrizations.weight.original)
