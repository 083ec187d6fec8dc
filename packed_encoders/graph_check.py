"""Pack-time gate of an explicitly requested graph path: one ragged batch within the bounds, replayed and run
eagerly. (Automatic graphs, ``cuda_graph=None``, skip it: each capture is checked against its eager warm-up
instead, when it happens; see :class:`~packed_encoders.graphs.runner.GraphRunner`.)

``validate()`` checks the eager packed path against stock HF; this adds the graph replay against that eager
path, so ``pack(validate=True, cuda_graph=...)`` never installs graphs that were not run once. With
``GraphConfig(sync_free=True)`` the same batch also runs through a rectangular graph (unpadded on the device),
compared per real token, with zeros required at padded positions. The graphs captured for the check batches are
dropped afterwards, their memory given back (precaptured buckets stay): the workload captures its own buckets.
"""

from __future__ import annotations

import torch

from .attention.backends import BACKENDS, Workload
from .batch import unpad
from .call import run_packed
from .errors import PackedEncodersError
from .graphs.buckets import CallFacts, admit, admit_rect, round_seqs
from .graphs.route import (deferred_checks, graph_forward, graph_keys, module_call_refusal, note_eager, prepare,
                           release_check_graphs, sync_free_forward)
from .router import Facts
from .validation import BF16_COS_MIN, FP32_MAX_REL, check_batch, eval_mode, parity


def check_lengths(config, window: int, top: int | None = None) -> list[int]:
    """Lengths past the local window and up to ``top`` (default ``max_seqlen``; at most ``max_seqs`` of them)."""
    top = config.max_seqlen if top is None else top
    lengths = sorted({1, min(top, window + 1), min(top, 2 * window + 2), max(1, top // 3), top})
    return lengths[: config.max_seqs]


def rect_check_lengths(config, lengths: list[int]) -> list[int]:
    """``lengths`` clipped to the widest padded width the sync-free path serves for that many rows (its
    ``B_b * S_b <= sync_free_max_tokens``), so the pack-time check exercises a rectangular graph."""
    rows = round_seqs(len(lengths), config.min_seq_bucket)
    fits = [w for w in config.sync_free_seqlen_grid if rows * w <= config.sync_free_max_tokens]
    top = fits[-1] if fits else config.sync_free_seqlen_grid[0]
    return sorted({min(n, top) for n in lengths})


def backend_top(config, state, dtype: torch.dtype) -> int:
    """The longest seqlen bucket whose global layers an explicitly requested attention backend runs (the Triton
    kernel stops at 1,024 tokens): the check batch stays inside it, since a graph bucket past it is refused at
    capture and runs eagerly (``describe()`` says why), which is not the path this check is for."""
    backend = BACKENDS.get(state.options.attention_backend)  # None for "auto" / "flash": every bucket
    if backend is None:
        return config.max_seqlen
    params = state.params
    for seqlen in reversed(config.seqlen_grid):
        w = Workload(num_seqs=1, total_tokens=seqlen, max_seqlen=seqlen, heads=params.num_attention_heads,
                     head_dim=params.head_dim, window=None, grad=False, dtype=dtype, device_type="cuda", graph=True)
        if backend.why_not(w) is None:
            return seqlen
    return config.seqlen_grid[0]


def _eligible(config, weight, tuning) -> bool:
    return config is not None and weight.device.type == "cuda" and tuning.graphs


def check_graph_path(model, state, report, seed: int = 0) -> None:
    """Replay a graph for a ragged left/right padded batch and compare it with the eager packed forward per
    real token; appends to ``report.checks`` / ``report.failures`` (an ``EncoderReport``). Thresholds are
    ``validate()``'s: bf16/fp16 per-token cosine min; fp32 max relative error. No-op off CUDA or when off.
    """
    config = state.options.cuda_graph
    weight = model.embeddings.tok_embeddings.weight
    if not _eligible(config, weight, state.tuning):
        return
    refusal = module_call_refusal(model)  # (graph_forward below would capture without asking the router)
    if refusal is not None:
        report.checks.append(f"cuda_graph: not checked: {refusal}")
        return
    lengths = check_lengths(config, state.params.window, backend_top(config, state, weight.dtype))
    vocab_size = model.embeddings.tok_embeddings.num_embeddings  # the rows calls are checked against
    ids, mask = check_batch(lengths, vocab_size, weight.device, seed)
    before = graph_keys(state)
    try:
        _check(model, state, config, vocab_size, weight, lengths, ids, mask, report, seed)
    finally:
        release_check_graphs(state, before)


def _check(model, state, config, vocab_size: int, weight, lengths, ids, mask, report, seed: int) -> None:
    with eval_mode(model), torch.no_grad():
        batch = unpad(input_ids=ids, inputs_embeds=None, attention_mask=mask, position_ids=None,
                      token_type_ids=None, vocab_size=vocab_size, fused=state.tuning.fused_unpad)
        eager = run_packed(model, state, batch)
        graph = graph_forward(model, state, batch, torch.clone, prepared=prepare(model, state))
        rect = None
        if config.sync_free:
            rect_lengths = rect_check_lengths(config, lengths)
            r_ids, r_mask = check_batch(rect_lengths, vocab_size, weight.device, seed)
            r_batch = unpad(input_ids=r_ids, inputs_embeds=None, attention_mask=r_mask, position_ids=None,
                            token_type_ids=None, vocab_size=vocab_size, fused=state.tuning.fused_unpad)
            r_eager = run_packed(model, state, r_batch)
            rect = _sync_free(model, state, config, r_ids, r_mask)

    def why():
        facts = CallFacts(num_seqs=batch.num_seqs, total_tokens=batch.total_tokens, max_seqlen=batch.max_seqlen)
        mgr = state.runtime.get("graphs")
        return admit(config, facts) if mgr is None else (dict(mgr.fallbacks) or mgr.failures())

    _compare(report, "cuda_graph", lengths, graph, eager, weight.dtype, why)
    if config.sync_free:
        mgr = state.runtime["graphs"]
        real = r_mask.bool()
        _compare(report, "cuda_graph (sync_free)", rect_lengths, None if rect is None else rect[real], r_eager,
                 weight.dtype, lambda: dict(mgr.sync_free_fallbacks) or mgr.failures(),
                 padded=None if rect is None else rect[~real])
        if rect is not None:
            try:  # the device-side input checks must pass a valid batch (one wait, at pack time only)
                deferred_checks(state).poll(wait=True)
            except PackedEncodersError as exc:
                report.failures.append(f"cuda_graph (sync_free): a valid batch failed the device checks: {exc}")


def _sync_free(model, state, config, ids, mask):
    """The rectangular graph's output for a check batch, or ``None`` when no rectangular bucket takes it."""
    vocab = model.embeddings.tok_embeddings.num_embeddings
    bucket = admit_rect(config, Facts(batch=int(ids.shape[0]), width=int(ids.shape[1])), vocab)
    if isinstance(bucket, str):
        note_eager(model, state, None, bucket)
        return None
    return sync_free_forward(model, state, bucket, input_ids=ids, attention_mask=mask, token_type_ids=None)


def _compare(report, name: str, lengths, graph, eager, dtype, why, padded=None) -> None:
    """Append the per-real-token comparison of ``graph`` with ``eager`` (``[T, H]`` each) to ``report``."""
    if graph is None:
        report.failures.append(f"{name}: the check batch (lengths {lengths}) was not served by a graph: {why()}")
        return
    cos_min, _, rel, finite = parity(graph.float(), eager.float())
    report.checks.append(f"{name}: replay vs eager on lengths {lengths}: per-token cosine min {cos_min:.6f}, "
                         f"max rel err {rel:.2e}")
    if not finite:
        report.failures.append(f"{name}: non-finite values in the replayed output")
    elif padded is not None and bool(padded.any()):
        report.failures.append(f"{name}: non-zero values at padded positions")
    elif dtype == torch.float32:
        if not rel <= FP32_MAX_REL:
            report.failures.append(f"{name}: fp32 max relative error {rel:.3e} > {FP32_MAX_REL:.0e} vs eager")
    elif not cos_min >= BF16_COS_MIN:
        report.failures.append(f"{name}: per-token cosine min {cos_min:.6f} < {BF16_COS_MIN} vs eager")
