"""Pooling and late-interaction scoring on packed token embeddings, for fully packed training.

``packed_forward`` returns one flat ``[T, D]`` stream for ``N`` sequences delimited by ``cu_seqlens``; a loss
wants one vector per text (mean pooling, sentence-transformers' default) or query-document MaxSim scores
(ColBERT). These functions compute both straight from the packed stream -- no padding, no host sync -- and are
differentiable with ordinary autograd. ``*_reference`` are the padded plain-PyTorch specs they are tested
against (the padded computation sentence-transformers and PyLate run).

    tokens = pe.packed_forward(model, None, ids, cu_seqlens, max_seqlen)       # [T, H]
    emb = mean_pool(tokens, cu_seqlens)                                       # [N, H]
    scores = maxsim(q_tokens, q_cu_seqlens, d_tokens, d_cu_seqlens)           # [Nq, Nd] fp32
    loss = torch.nn.functional.cross_entropy(scores / temperature, labels)

Index work follows ``packed_encoders.batch``: ``cu_seqlens`` int32 (or int64) ``[N + 1]`` starting at 0, ending at
``T``. Its values are read on the device only (no ``.item()``), so they are checked only when ``cu_seqlens`` is on
the CPU; on a GPU a ``cu_seqlens`` that does not end at ``T`` gives wrong results, as it would in flash-attn.
"""

from __future__ import annotations

import torch

from .errors import PackedEncodersError

_AUTOCAST_UNIFIES = frozenset((torch.float32, torch.float16, torch.bfloat16))  # what autocast casts for a GEMM


def _check(x: torch.Tensor, cu_seqlens: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise PackedEncodersError(f"{name} must be a 2-D [T, D] tensor; got "
                                  f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if not x.is_floating_point():
        raise PackedEncodersError(f"{name} must be floating point; got {x.dtype}")
    if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2
            or cu_seqlens.dtype not in (torch.int32, torch.int64)):
        raise PackedEncodersError(f"cu_seqlens of {name} must be an int32/int64 [N + 1] tensor with N >= 1")
    if cu_seqlens.device != x.device:
        raise PackedEncodersError(f"cu_seqlens of {name} is on {cu_seqlens.device} but {name} on {x.device}")
    if cu_seqlens.device.type == "cpu":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != x.shape[0] or bool((lengths <= 0).any()):
            raise PackedEncodersError(f"cu_seqlens of {name} must start at 0, increase strictly and end at "
                                      f"T = {x.shape[0]}; got {cu_seqlens.tolist()}")


def sequence_ids(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """int64 ``[T]``: the sequence each token belongs to (``0 .. N-1``), computed on the device without a sync."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seqs = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(seqs, lengths, output_size=total_tokens)


def mean_pool(x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Mean of each sequence's token vectors.

    Args:
        x: ``[T, D]`` floating point, the packed token embeddings.
        cu_seqlens: int32/int64 ``[N + 1]`` on ``x``'s device.

    Returns:
        ``[N, D]`` in ``x.dtype``, summed in fp32 (fp64 for fp64 ``x``) (sentence-transformers' mean pooling over
        the real tokens, ``[CLS]`` and ``[SEP]`` included).

    Raises:
        PackedEncodersError: ``x`` not 2-D floating point, ``cu_seqlens`` not 1-D integer with ``N >= 1`` or on
            another device; on the CPU also ``cu_seqlens`` not starting at 0, ending at ``T`` or strictly increasing.
    """
    _check(x, cu_seqlens, "x")
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(acc)
    sums = x.new_zeros((lengths.numel(), x.shape[1]), dtype=acc)
    sums = sums.index_add(0, sequence_ids(cu_seqlens, x.shape[0]), x.to(acc))
    return (sums / lengths[:, None]).to(x.dtype)


def maxsim(q: torch.Tensor, q_cu_seqlens: torch.Tensor, d: torch.Tensor, d_cu_seqlens: torch.Tensor) -> torch.Tensor:
    """ColBERT late-interaction scores between every query and every document of two packed batches.

    ``score[i, j] = sum over tokens t of query i of max over tokens u of document j of <q[t], d[u]>``.

    One ``[Tq, Td]`` similarity GEMM in the inputs' dtype (bf16 under autocast), then a per-document max
    (``segment_reduce`` over each document's columns, no atomics) and a per-query sum (``index_add``) in fp32.
    Memory: ``Tq * Td`` fp32 similarities
    (plus their inputs' dtype copy); chunk the documents for very large ``Tq * Td``. Vectors are used as given
    (normalise them first for ColBERT's cosine MaxSim). Gradients flow to ``q`` and ``d``; where a document has
    several tokens tied for a maximum, the gradient is shared among them (``torch.max`` on a padded tensor would
    give it to one).

    Args:
        q: ``[Tq, D]`` query token vectors, packed.
        q_cu_seqlens: int32/int64 ``[Nq + 1]`` on ``q``'s device.
        d: ``[Td, D]`` document token vectors, packed, same ``D`` and device as ``q``.
        d_cu_seqlens: int32/int64 ``[Nd + 1]``.

    Returns:
        fp32 ``[Nq, Nd]``.

    Raises:
        PackedEncodersError: as :func:`mean_pool` for each input, or ``q`` and ``d`` of different widths / devices
            (or dtypes, outside autocast; under autocast, two dtypes of which one is not fp32 / fp16 / bf16).
    """
    _check(q, q_cu_seqlens, "q")
    _check(d, d_cu_seqlens, "d")
    if q.shape[1] != d.shape[1] or q.device != d.device:
        raise PackedEncodersError(f"q [.., {q.shape[1]}] on {q.device} and d [.., {d.shape[1]}] on {d.device} must "
                                  "have the same width and device")
    if q.dtype != d.dtype:
        if not torch.is_autocast_enabled(q.device.type):
            raise PackedEncodersError(f"q ({q.dtype}) and d ({d.dtype}) must have the same dtype outside autocast")
        if not {q.dtype, d.dtype} <= _AUTOCAST_UNIFIES:  # autocast leaves fp64 (and integers) as they are
            raise PackedEncodersError(f"q ({q.dtype}) and d ({d.dtype}): autocast casts only fp32 / fp16 / bf16 "
                                      "operands to its dtype; give both one dtype")
    n_q, n_d = q_cu_seqlens.numel() - 1, d_cu_seqlens.numel() - 1
    sim = torch.matmul(q, d.t()).float()  # [Tq, Td]
    # unsafe: no check of the offsets, which would read them on the host (a sync); they are checked above on the
    # CPU, and clamped to d's columns so that a malformed cu_seqlens on CUDA reads nothing past them. The backward
    # shares a document's gradient among tied maxima, as scatter_reduce's amax does.
    offsets = d_cu_seqlens.long().clamp(0, d.shape[0]).expand(q.shape[0], -1)
    best = torch.segment_reduce(sim, "max", offsets=offsets, axis=1, unsafe=True)  # [Tq, Nd]
    return best.new_zeros((n_q, n_d)).index_add(0, sequence_ids(q_cu_seqlens, q.shape[0]), best)


# ------------------------------------------------------------------------------------- references

def mean_pool_reference(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Padded spec of :func:`mean_pool`: ``x [B, S, D]``, ``mask [B, S]`` (1 = real token) -> fp32 ``[B, D]``."""
    m = mask.to(torch.float32).unsqueeze(-1)
    return (x.float() * m).sum(1) / m.sum(1)


def maxsim_reference(q: torch.Tensor, q_mask: torch.Tensor, d: torch.Tensor, d_mask: torch.Tensor) -> torch.Tensor:
    """Padded spec of :func:`maxsim`, in fp32: ``q [Bq, Sq, D]``, ``d [Bd, Sd, D]``, masks ``[B, S]`` (1 = real).

    Returns fp32 ``[Bq, Bd]``: padded document tokens never win the max, padded query tokens add nothing
    (PyLate's ``colbert_scores`` with its masks)."""
    sim = torch.einsum("qsh,dth->qdst", q.float(), d.float())
    sim = sim.masked_fill(~d_mask.bool()[None, :, None, :], float("-inf"))
    best = sim.max(-1).values  # [Bq, Bd, Sq]
    return (best * q_mask.to(torch.float32)[:, None, :]).sum(-1)
