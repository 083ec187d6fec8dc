"""The packed forward on CUDA in bf16 against stock HF at ModernBERT-base and -large geometry (random init),
lengths up to 8192, for every attention backend and op set; one host sync per padded call; gradients.

Run: ``python -m pytest -q tests/gpu/test_model_parity.py`` (skipped without CUDA).
"""

from __future__ import annotations

import warnings

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import packed_encoders as pe  # noqa: E402
from packed_encoders.attention import BACKENDS  # noqa: E402
from tests.helpers import make_model, padded_batch, stock_positions, token_cosines  # noqa: E402

DEV = torch.device("cuda")
GEOMETRY = ("base", "large")  # tests.helpers.CONFIGS
LENGTHS = (1, 65, 130, 513, 2049, 8192)


@pytest.fixture(scope="module", params=GEOMETRY)
def model(request):
    return make_model(request.param, dtype=torch.bfloat16, device=DEV)


def _batch(lengths, seed=0):
    return padded_batch(lengths, "mixed", seed=seed, vocab_size=50000, device=DEV)


@pytest.fixture(scope="module")
def stock_out(model):
    ids, mask = _batch(LENGTHS)
    pe.unpack(model)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask))
    return ids, mask, out.last_hidden_state.float()


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "fa4", "auto"])
@pytest.mark.parametrize("kernels", ["torch", "auto"])
def test_bf16_parity_long(model, stock_out, backend, kernels):
    why = None if backend == "auto" else BACKENDS[backend].availability()
    if why:
        pytest.skip(why)
    ids, mask, ref = stock_out
    pe.pack(model, attention_backend=backend, kernels=kernels)
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).last_hidden_state
        cos = token_cosines(out, ref, mask)
        info = pe.describe(model)["encoders"][0]
        print(backend, kernels, info["kernels"], info["last_attention"], float(cos.min()), float(cos.mean()))
        assert cos.min() >= 0.995 and cos.mean() >= 0.999, (float(cos.min()), float(cos.mean()), info)
        assert out[~mask.bool()].abs().max() == 0
    finally:
        pe.unpack(model)


def test_triton_attention_short_batch(model):
    if BACKENDS["triton"].availability():
        pytest.skip(BACKENDS["triton"].availability())
    ids, mask = _batch([5, 64, 65, 128, 30, 1, 77, 100])
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, position_ids=stock_positions(mask))
        pe.pack(model, attention_backend="triton")
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    pe.unpack(model)
    cos = token_cosines(out, ref.last_hidden_state, mask)
    assert cos.min() >= 0.995 and cos.mean() >= 0.999


def test_one_host_sync_per_padded_call(model):
    ids, mask = _batch([17, 300, 45, 2])
    pe.pack(model)
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask)  # warm: tables, kernel compiles
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model(input_ids=ids, attention_mask=mask)
            torch.cuda.set_sync_debug_mode(0)
        syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
        assert len(syncs) == 1, [str(w.message)[:120] for w in syncs]
    finally:
        torch.cuda.set_sync_debug_mode(0)
        pe.unpack(model)


def test_no_host_sync_in_a_gradcache_forward_with_gradients():
    """GradCache's second forward of a chunk (with gradients, over the views a no-grad forward unpadded) reuses
    that forward's lengths: neither it nor its backward syncs (the sync would wait for the previous chunk's
    backward)."""
    master = make_model("base", dtype=torch.float32, device=DEV).train()
    ids, mask = _batch([17, 300, 45, 2, 130, 9])
    pe.pack(master)
    try:
        for measured in (False, True):  # the first round compiles and binds the kernels of both passes
            for a, b in ((0, 3), (3, 6)):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    with torch.no_grad():
                        ref = master(input_ids=ids[a:b], attention_mask=mask[a:b]).last_hidden_state
                    torch.cuda.synchronize()
                    if measured:
                        torch.cuda.set_sync_debug_mode("warn")
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        out = master(input_ids=ids[a:b], attention_mask=mask[a:b]).last_hidden_state
                        out.float().sum().backward()
                    torch.cuda.set_sync_debug_mode(0)
                syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
                assert not measured or not syncs, [str(w.message)[:120] for w in syncs]
                cos = token_cosines(out, ref, mask[a:b])
                assert cos.min() >= 0.999, float(cos.min())
    finally:
        torch.cuda.set_sync_debug_mode(0)
        pe.unpack(master)


def test_gradients_bf16_autocast_vs_stock(model):
    """fp32 master weights under bf16 autocast (the training setup): packed vs stock gradients."""
    master = model.float()
    ids, mask = _batch([40, 300, 129, 7])
    real = mask.bool()
    torch.manual_seed(1)
    target = torch.randn(*ids.shape, model.config.hidden_size, device=DEV)

    def grads(fn):
        master.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        ((out.float() - target)[real] ** 2).mean().backward()
        return {n: p.grad.float().clone() for n, p in master.named_parameters() if p.grad is not None}

    master.train()
    try:
        ref = grads(lambda: master(input_ids=ids, attention_mask=mask,
                                   position_ids=stock_positions(mask)).last_hidden_state)
        pe.pack(master)
        got = grads(lambda: master(input_ids=ids, attention_mask=mask).last_hidden_state)
        info = pe.describe(master)["encoders"][0]
        # Output-proximate parameters agree tightly; deep layers drift in bf16 even between two correct paths.
        last = master.config.num_hidden_layers - 1
        for name in [n for n in ref if n.startswith(f"layers.{last}.") or n.startswith("final_norm")]:
            cos = torch.nn.functional.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0)
            assert cos > 0.99, (name, float(cos), info)
    finally:
        pe.unpack(master)
        master.to(torch.bfloat16).eval()


def test_query_expansion_training_call_vs_stock(model):
    """ColBERT query expansion in training (``padded_outputs=32``: trailing masked positions computed as
    query-only tokens, as PyLate's CachedContrastive re-forwards its query chunks): under bf16 autocast with
    gradients, every position's output (trailing ones included) and the last layer's gradients match stock, and
    the call's attention is FlashAttention-2 with the tails' keys gathered, not sdpa, inside the training stack."""
    master = model.float()
    ids, mask = padded_batch([12, 30, 5, 32, 17, 9], "right", vocab_size=50000, device=DEV)
    torch.manual_seed(2)
    target = torch.randn(*ids.shape, model.config.hidden_size, device=DEV)

    def run(fn):
        master.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        ((out.float() - target) ** 2).mean().backward()  # every position counts, trailing ones too
        return out.detach().float(), {n: p.grad.float().clone() for n, p in master.named_parameters()
                                      if p.grad is not None}

    master.train()
    try:
        # right padding: stock's default positions (0, 1, ... on every row) are the packed ones, trailing
        # positions included (stock_positions would hold them at the last real token's)
        ref_out, ref = run(lambda: master(input_ids=ids, attention_mask=mask).last_hidden_state)
        pe.pack(master, padded_outputs=32)
        got_out, got = run(lambda: master(input_ids=ids, attention_mask=mask).last_hidden_state)
        info = pe.describe(master)["encoders"][0]
        assert set(info["last_attention"].values()) == {"varlen"}, info["last_attention"]
        assert info["eager_plan"]["stack"], info["eager_plan"]  # every layer in one node, the tails included
        cos = torch.nn.functional.cosine_similarity(got_out.flatten(0, 1), ref_out.flatten(0, 1), dim=-1)
        assert cos.min() >= 0.999, float(cos.min())
        last = master.config.num_hidden_layers - 1
        for name in [n for n in ref if n.startswith(f"layers.{last}.") or n.startswith("final_norm")]:
            c = torch.nn.functional.cosine_similarity(got[name].flatten(), ref[name].flatten(), dim=0)
            assert c > 0.99, (name, float(c))
    finally:
        pe.unpack(master)
        master.to(torch.bfloat16).eval()


def test_cpu_labels_of_a_cuda_call_get_the_stock_loss():
    """Labels on the CPU with a CUDA mask (stock's heads move them to the logits' device): the label check reads
    them all the same, so labels at trailing padded positions get the computed positions, and stock's loss."""
    import copy

    import transformers

    stock = make_model("tiny", cls=transformers.ModernBertForMaskedLM, device=DEV)
    packed = copy.deepcopy(stock)
    pe.pack(packed)
    ids, mask = padded_batch([5, 3, 7], "right", vocab_size=stock.config.vocab_size, device=DEV)
    labels = ids.clone().cpu()  # every position counted, trailing padding included
    with torch.no_grad():
        torch.testing.assert_close(packed(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   stock(input_ids=ids, attention_mask=mask, labels=labels).loss,
                                   atol=1e-4, rtol=1e-4)


def test_cls_head_checks_position_zero_at_its_one_sync():
    """A ``classifier_pooling="cls"`` head on CUDA (default graphs): a right-padded call stays packed with one host
    sync (the mask's first column is read with unpad's stats), a left-padded one runs the stock forward."""
    import copy

    import transformers

    stock = make_model("tiny", cls=transformers.ModernBertForSequenceClassification, device=DEV,
                       classifier_pooling="cls").eval()
    packed = copy.deepcopy(stock)
    pe.pack(packed)
    vocab = stock.config.vocab_size
    right = padded_batch([5, 30, 17], "right", vocab_size=vocab, device=DEV)
    left = padded_batch([5, 30, 17], "left", vocab_size=vocab, device=DEV)
    with torch.no_grad():
        for ids, mask in (right, left, right):  # (the second right-padded call: warm)
            torch.testing.assert_close(packed(input_ids=ids, attention_mask=mask).logits,
                                       stock(input_ids=ids, attention_mask=mask).logits, atol=2e-4, rtol=2e-4)
        calls = pe.describe(packed)["encoders"][0]["stock_forward_calls"]
        assert sum(n for reason, n in calls.items() if "position 0" in reason) == 1, calls
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                packed(input_ids=right[0], attention_mask=right[1])
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message)[:120] for w in syncs]
