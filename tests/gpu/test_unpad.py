"""``batch.unpad``'s two-launch Triton path on CUDA against its PyTorch path, at query, document and indexing
shapes, and its one host sync."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from packed_encoders import batch as B  # noqa: E402

DEV = torch.device("cuda")


def _inputs(lengths, width, seed):
    g = torch.Generator().manual_seed(seed)
    b = len(lengths)
    ids = torch.randint(3, 50000, (b, width), generator=g)
    mask = torch.zeros(b, width, dtype=torch.long)
    for row, n in enumerate(lengths):
        if row % 3 == 1:
            mask[row, width - n:] = 1
        else:
            mask[row, :n] = 1
    return ids.to(DEV), mask.to(DEV)


@pytest.mark.parametrize("lengths, width", [([12, 9, 20, 3, 16, 7, 11, 24], 24), ([926, 1884, 700, 1035] * 2, 1884),
                                            (list(range(1350, 1350 - 128 * 7, -7)), 1350), ([0, 5, 0], 8)])
@pytest.mark.parametrize("trailing", [False, True])
def test_fused_matches_torch(lengths, width, trailing, monkeypatch):
    ids, mask = _inputs(lengths, width, len(lengths))
    kw = dict(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
              vocab_size=50368, trailing_query_only=trailing)
    assert B._fused_unpad(ids, None, mask, None, None, len(lengths))
    fused = B.unpad(**kw)
    ref = B.unpad(**kw, fused=False)  # PACKED_ENCODERS_FUSED_UNPAD=0 at pack()
    assert (fused.total_tokens, fused.max_seqlen, fused.max_position) == (ref.total_tokens, ref.max_seqlen,
                                                                          ref.max_position)
    for name in ("cu_seqlens", "input_ids", "position_ids", "indices") + (("key_lens",) if trailing else ()):
        torch.testing.assert_close(getattr(fused, name), getattr(ref, name), msg=name)


def test_fused_unpad_syncs_once():
    ids, mask = _inputs([30, 12, 7], 32, 0)
    B.unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
            vocab_size=50368)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with pytest.warns(UserWarning) as record:
            B.unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None, token_type_ids=None,
                    vocab_size=50368)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [r for r in record if "synchroniz" in str(r.message)]
    assert len(syncs) == 1
