"""An fp64 model gets fp64 RoPE: the packed forward and backward agree with an fp64 oracle far past fp32 accuracy.

Stock HF computes its rotary angles in fp32 whatever the model's dtype (``position * inv_freq`` in fp32: an error
~1e-7 * position radians) and rotates q, k in fp32, so the oracle is the stock forward with both done in fp64 from
the same ``inv_freq`` buffers. The q, k projections are scaled up so attention is sharp enough for angle errors to
show in the output. The unpatched stock model's distance to that oracle is the fp32-level error the test must beat
by orders of magnitude (so it fails if the packed path rounds angles or rotations through fp32).
"""

from __future__ import annotations

import contextlib
import copy

import torch
from transformers.models.modernbert import modeling_modernbert as hf

import packed_encoders as pe
from tests.helpers import padded_batch, stock_forward, tiny_model

LENGTHS = [3000, 1700]  # long rows: fp32 angle error grows with the position


def _fp64_rotary(rotary):
    def forward(x, position_ids, layer_type):
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq").to(device=x.device, dtype=torch.float64)
        scaling = getattr(rotary, f"{layer_type}_attention_scaling")
        freqs = position_ids[..., None].to(torch.float64) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)

    rotary.forward = forward


def _rotate_fp64(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + hf.rotate_half(q) * sin, k * cos + hf.rotate_half(k) * sin


@contextlib.contextmanager
def _oracle(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(hf, "apply_rotary_pos_emb", _rotate_fp64)
        yield


def _models():
    model = tiny_model(layers=2, local_attention=64).double()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.Wqkv.weight[:2 * model.config.hidden_size].mul_(10.0)
    oracle = copy.deepcopy(model)
    _fp64_rotary(oracle.rotary_emb)
    assert oracle.rotary_emb.full_attention_inv_freq.dtype == torch.float64
    return model, oracle


def _max_err(a, b, mask):
    real = mask.bool()
    return (a[real] - b[real]).abs().max().item()


def test_fp64_forward_beats_fp32_angles(monkeypatch):
    model, oracle = _models()
    ids, mask = padded_batch(LENGTHS, side="mixed", seed=3)
    with torch.no_grad():
        with _oracle(monkeypatch):
            want = stock_forward(oracle, ids, mask)
        fp32_angles = _max_err(stock_forward(model, ids, mask), want, mask)
        pe.pack(model, cuda_graph=False)
        got = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert got.dtype == torch.float64
    err = _max_err(got, want, mask)
    assert fp32_angles > 1e-7, fp32_angles  # the gap the test guards is there
    assert err < 1e-12 and err < fp32_angles * 1e-4, (err, fp32_angles)


def test_fp64_training_gradients_match_fp64_oracle(monkeypatch):
    model, oracle = _models()
    model.train()
    oracle.train()
    ids, mask = padded_batch(LENGTHS, side="right", seed=4)
    probe = torch.randn(*ids.shape, model.config.hidden_size, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(5))
    with _oracle(monkeypatch):
        (stock_forward(oracle, ids, mask) * probe * mask[..., None]).sum().backward()
    pe.pack(model, cuda_graph=False)
    (model(input_ids=ids, attention_mask=mask).last_hidden_state * probe * mask[..., None]).sum().backward()
    for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
        scale = q.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= 1e-11 * max(scale, 1.0), name
