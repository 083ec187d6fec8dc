"""packed_encoders.pooling: mean pooling and MaxSim on packed tokens == the padded computation, gradients too."""

from __future__ import annotations

import pytest
import torch

from packed_encoders.errors import PackedEncodersError
from packed_encoders.pooling import maxsim, maxsim_reference, mean_pool, mean_pool_reference, sequence_ids


def _packed(lengths, dim, seed, dtype=torch.float64):
    """Random packed tokens [T, D] (a leaf), cu_seqlens int32, and the same tokens padded [B, S, D] + mask."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), dim, generator=g, dtype=dtype, requires_grad=True)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)
    return x, cu


def _pad(x, cu):
    lengths = (cu[1:] - cu[:-1]).tolist()
    padded = x.new_zeros(len(lengths), max(lengths), x.shape[1])
    mask = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for i, (s, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        padded[i, :n] = x[s:s + n]
        mask[i, :n] = 1
    return padded, mask


def test_sequence_ids():
    cu = torch.tensor([0, 2, 3, 7], dtype=torch.int32)
    assert sequence_ids(cu, 7).tolist() == [0, 0, 1, 2, 2, 2, 2]


def test_mean_pool_matches_padded_with_gradients():
    x, cu = _packed([3, 1, 17, 8], 12, seed=0)
    w = torch.randn(4, 12, dtype=x.dtype)
    got = mean_pool(x, cu)
    (gx,) = torch.autograd.grad((got * w).sum(), x)
    padded, mask = _pad(x, cu)
    ref = mean_pool_reference(padded, mask).to(x.dtype)
    (rx,) = torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)  # fp32 accumulation
    torch.testing.assert_close(gx, rx, atol=1e-7, rtol=1e-6)
    assert mean_pool(x.detach().bfloat16(), cu).dtype == torch.bfloat16


def test_mean_pool_keeps_float64_precision():
    """fp64 tokens are summed in fp64: gradcheck passes, and large values keep their digits (fp32 sums lost ~1e-4)."""
    x, cu = _packed([3, 1, 6], 5, seed=1)
    assert torch.autograd.gradcheck(lambda t: mean_pool(t, cu), (x,))
    big = (x.detach() * 1e3 + 1e3)
    want = torch.stack([big[s:e].mean(0) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(mean_pool(big, cu), want, atol=1e-10, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_maxsim_matches_padded_with_gradients(dtype):
    q, cu_q = _packed([5, 1, 9], 16, seed=1)
    d, cu_d = _packed([7, 30, 2, 11, 4], 16, seed=2)
    qn, dn = (torch.nn.functional.normalize(t, dim=-1).to(dtype) for t in (q, d))
    w = torch.randn(3, 5, dtype=torch.float64)
    got = maxsim(qn, cu_q, dn, cu_d)
    assert got.shape == (3, 5) and got.dtype == torch.float32
    gq, gd = torch.autograd.grad((got.double() * w).sum(), (q, d), retain_graph=True)
    qp, qm = _pad(qn, cu_q)
    dp, dm = _pad(dn, cu_d)
    ref = maxsim_reference(qp, qm, dp, dm)
    rq, rd = torch.autograd.grad((ref.double() * w).sum(), (q, d))
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gq, rq, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gd, rd, atol=1e-5, rtol=1e-4)
    else:  # the GEMM rounds to bf16; the reference computes in fp32 from the same bf16 inputs. Rounded
        # similarities tie or swap near-equal maxima, which moves gradients between tokens: values only here
        torch.testing.assert_close(got, ref, atol=3e-2, rtol=1e-2)


def test_maxsim_gradient_goes_to_the_max_token_only():
    q = torch.tensor([[1.0, 0.0]], requires_grad=True)
    d = torch.tensor([[0.5, 0.0], [2.0, 0.0], [0.0, 1.0]], requires_grad=True)
    cu_q, cu_d = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32)
    s = maxsim(q, cu_q, d, cu_d)
    assert s.tolist() == [[2.0, 0.0]]
    s.sum().backward()
    assert d.grad.tolist() == [[0.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
    assert q.grad.tolist() == [[2.0, 1.0]]


def test_maxsim_gradient_is_shared_among_tied_maxima():
    """Two document tokens tied for the maximum share its gradient equally (the subgradient ``amax`` takes)."""
    q = torch.tensor([[1.0, 0.0]], requires_grad=True)
    d = torch.tensor([[2.0, 0.0], [0.5, 0.0], [2.0, 1.0], [0.0, 1.0]], requires_grad=True)
    cu_q, cu_d = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 3, 4], dtype=torch.int32)
    s = maxsim(q, cu_q, d, cu_d)
    assert s.tolist() == [[2.0, 0.0]]
    s.sum().backward()
    assert d.grad.tolist() == [[0.5, 0.0], [0.0, 0.0], [0.5, 0.0], [1.0, 0.0]]
    assert q.grad.tolist() == [[2.0, 1.5]]  # 0.5 * d0 + 0.5 * d2 + d3


def test_errors():
    x, cu = _packed([2, 3], 4, seed=0)
    with pytest.raises(PackedEncodersError, match="end at T = 5"):
        mean_pool(x, torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(PackedEncodersError, match="increase strictly"):
        mean_pool(x, torch.tensor([0, 2, 2, 5], dtype=torch.int32))
    with pytest.raises(PackedEncodersError, match="2-D"):
        mean_pool(x[None], cu)
    with pytest.raises(PackedEncodersError, match="int32/int64"):
        mean_pool(x, cu.float())
    with pytest.raises(PackedEncodersError, match="same width"):
        maxsim(x, cu, x[:, :3], cu)
    with pytest.raises(PackedEncodersError, match="same dtype outside autocast"):
        maxsim(x.bfloat16(), cu, x, cu)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (autocast casts an fp32 operand)
        assert maxsim(x.bfloat16(), cu, x.float(), cu).shape == (2, 2)
        with pytest.raises(PackedEncodersError, match="autocast casts only"):  # (it leaves fp64 as it is)
            maxsim(x.float(), cu, x.double(), cu)


def test_fully_packed_contrastive_step_matches_stock():
    """packed_forward + mean_pool + InfoNCE: the loss and every parameter gradient equal stock HF's padded step."""
    import packed_encoders as pe
    from tests.helpers import make_model, padded_batch, stock

    model = make_model("base_like").train()
    lengths = [3, 9, 21, 5, 14, 2]
    ids, mask = padded_batch(lengths)
    real = mask.bool()
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths).cumsum(0)

    def info_nce(emb):
        q, d = torch.nn.functional.normalize(emb.float(), dim=-1).chunk(2)
        return torch.nn.functional.cross_entropy(20 * q @ d.t(), torch.arange(q.shape[0]))

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref = grads(info_nce(mean_pool_reference(stock(model, input_ids=ids, attention_mask=mask)
                                                       .last_hidden_state, mask)))
    got_loss, got = grads(info_nce(mean_pool(pe.packed_forward(model, None, ids[real], cu, max(lengths)), cu)))
    assert abs(got_loss - ref_loss) < 1e-5 and set(got) == set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-3, msg=n)
