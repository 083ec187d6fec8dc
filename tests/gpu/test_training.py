"""Training on CUDA (fp32 master weights, bf16 autocast) at ModernBERT-base geometry: the packed steps against stock.

Single-vector InfoNCE (``pe.pack``-ed padded calls, and fully packed: ``packed_forward`` + ``pooling.mean_pool``)
and ColBERT GradCache (``pooling.maxsim``, chunked re-forward) give stock HF's first loss to 3 decimals and its
parameter gradients (cosine per parameter); the pooling helpers match their padded references in bf16.

Run: ``python -m pytest -q tests/gpu/test_training.py`` (skipped without CUDA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import packed_encoders as pe  # noqa: E402
from packed_encoders.pooling import maxsim, maxsim_reference, mean_pool, mean_pool_reference  # noqa: E402

DEV = torch.device("cuda")


def _lengths(n, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def _inputs(lengths, seed):
    """Padded ids / mask [B, S], the packed ids [T], cu_seqlens int32 and the flat index of the real tokens."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.randint(5, 50000, (len(lengths), s), generator=g)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    real = mask.flatten().nonzero().squeeze(1)
    return {"ids": ids.to(DEV), "mask": mask.to(DEV), "packed": ids.flatten()[real].to(DEV), "cu": cu.to(DEV),
            "max": s, "real": real.to(DEV)}


def _model():
    from transformers import ModernBertConfig, ModernBertModel

    torch.manual_seed(0)
    config = ModernBertConfig()
    config._attn_implementation = "sdpa"
    return ModernBertModel(config).to(DEV).train()  # fp32 master weights


def _encode(model, b, mode):
    if mode == "packed":
        return pe.packed_forward(model, None, b["packed"], b["cu"], b["max"])
    h = model(input_ids=b["ids"], attention_mask=b["mask"]).last_hidden_state
    return h.flatten(0, 1)[b["real"]]


def _grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _worst(ref, got):
    """The lowest per-parameter gradient cosine of ``got`` against ``ref`` and the parameter's name."""
    assert set(ref) == set(got)
    return min((F.cosine_similarity(ref[n].flatten(), got[n].flatten(), dim=0).item(), n) for n in ref
               if ref[n].abs().max() > 0)


def _compare(ref, got, min_cos=0.999):
    worst = _worst(ref, got)
    assert worst[0] > min_cos, worst


def test_pooling_bf16_matches_padded():
    q_len, d_len = _lengths(32, 5, 30, 0), _lengths(128, 50, 1800, 1)
    q = F.normalize(torch.randn(sum(q_len), 128, device=DEV), dim=-1).bfloat16()
    d = F.normalize(torch.randn(sum(d_len), 128, device=DEV), dim=-1).bfloat16()
    qb, db = _inputs(q_len, 0), _inputs(d_len, 1)

    def pad(x, b):
        out = x.new_zeros(b["mask"].numel(), x.shape[1])
        out[b["real"]] = x
        return out.view(*b["mask"].shape, -1)

    got = maxsim(q, qb["cu"], d, db["cu"])
    ref = maxsim_reference(pad(q, qb), qb["mask"], pad(d, db), db["mask"])
    torch.testing.assert_close(got, ref, atol=0.05, rtol=2e-2)
    torch.testing.assert_close(mean_pool(d, db["cu"]).float(), mean_pool_reference(pad(d, db), db["mask"]),
                               atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("mode", ["pack", "pack_varlen", "packed"])
def test_single_vector_step_matches_stock(mode):
    model = _model()
    q, d = _inputs(_lengths(16, 8, 30, 2), 2), _inputs(_lengths(16, 300, 2000, 3), 3)

    def step(m):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            eq, ed = mean_pool(_encode(model, q, m), q["cu"]), mean_pool(_encode(model, d, m), d["cu"])
        eq, ed = F.normalize(eq.float(), dim=-1), F.normalize(ed.float(), dim=-1)
        loss = F.cross_entropy(20 * eq @ ed.t(), torch.arange(16, device=DEV))
        model.zero_grad(set_to_none=True)
        loss.backward()
        return loss.item(), _grads(model)

    ref_loss, ref = step("stock")
    # a named flash backend cannot validate an fp32 model outside autocast: checked against stock below instead
    pe.pack(model, **({"attention_backend": "varlen", "validate": False} if mode == "pack_varlen" else {}))
    loss, got = step("packed" if mode == "packed" else "stock")
    assert round(loss, 3) == round(ref_loss, 3) or abs(loss - ref_loss) < 5e-4, (loss, ref_loss)
    _compare(ref, got)


def test_colbert_gradcache_step_matches_stock():
    model = _model()
    proj = torch.nn.Linear(768, 128, bias=False).to(DEV)
    q, d = _inputs(_lengths(8, 8, 30, 4), 4), _inputs(_lengths(32, 100, 1500, 5), 5)
    chunks = lambda b, n: [_inputs_slice(b, i, n) for i in range(0, b["cu"].numel() - 1, n)]  # noqa: E731

    def step(m):
        parts = chunks(q, 4) + chunks(d, 8)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            reps = [F.normalize(proj(_encode(model, c, m)).float(), dim=-1).requires_grad_() for c in parts]
        scores = maxsim(torch.cat(reps[:2]), q["cu"], torch.cat(reps[2:]), d["cu"])
        loss = F.cross_entropy(scores, torch.arange(8, device=DEV) * 4)
        model.zero_grad(set_to_none=True)
        proj.zero_grad(set_to_none=True)
        loss.backward()
        for c, r in zip(parts, reps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                x = F.normalize(proj(_encode(model, c, m)).float(), dim=-1)
            x.backward(r.grad)
        return loss.item(), {**_grads(model), "proj": proj.weight.grad.clone()}

    ref_loss, ref = step("stock")
    # The bf16 noise floor of this step: HF's own eager attention against its sdpa attention (measured on the H200:
    # worst per-parameter cosine ~0.979, on LayerNorm weights summed over ~30k tokens of a random model). The
    # packed step must be as close to stock sdpa as stock's two attention implementations are to each other.
    model.config._attn_implementation = "eager"
    _, noise = step("stock")
    model.config._attn_implementation = "sdpa"
    floor = _worst(ref, noise)
    pe.pack(model)
    loss, got = step("packed")
    assert abs(loss - ref_loss) < 5e-4, (loss, ref_loss)
    worst = _worst(ref, got)
    assert worst[0] > min(0.999, floor[0] - 0.005), (worst, floor)


def _inputs_slice(b, start, n):
    """Sequences ``start:start + n`` of a batch from :func:`_inputs`, as their own batch."""
    cu = b["cu"].cpu()
    stop = min(start + n, cu.numel() - 1)
    lengths = (cu[start + 1:stop + 1] - cu[start:stop]).tolist()
    s = max(lengths)
    ids = b["ids"][start:stop, :s]
    mask = b["mask"][start:stop, :s]
    real = mask.flatten().nonzero().squeeze(1)
    sub_cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    sub_cu[1:] = torch.tensor(lengths).cumsum(0)
    return {"ids": ids, "mask": mask, "packed": ids.flatten()[real], "cu": sub_cu.to(DEV), "max": s, "real": real}
