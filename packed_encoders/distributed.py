"""Data-parallel training helpers: GradCache losses with one gradient all-reduce per step.

GradCache losses (sentence-transformers' ``Cached*`` losses, PyLate's ``CachedContrastive``, hand-written
loops) call ``backward`` once per mini-batch through the model. Through ``DistributedDataParallel`` every one of
those backwards all-reduces the whole gradient, so a step with ``k`` mini-batches pays ``k`` all-reduces where one
would do. :func:`grad_cache_sync` runs everything inside under ``no_sync()`` (gradients accumulate locally) and
all-reduces the accumulated gradients once on exit, which gives DDP's gradients (the mean over ranks) with one
communication round.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from .errors import PackedEncodersError

# DDP's default bucket size: large enough that a base model's gradients take a handful of collectives
BUCKET_BYTES = 25 * 1024 * 1024


def _ddp(model: nn.Module):
    from torch.nn.parallel import DistributedDataParallel

    return model if isinstance(model, DistributedDataParallel) else None


def _synced_parameters(ddp) -> list[nn.Parameter]:
    """The parameters DDP's reducer averages: trainable, not in ``parameters_to_ignore``, each once."""
    ignore = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    seen, out = set(), []
    for name, p in ddp.module.named_parameters():
        if p.requires_grad and name not in ignore and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def all_reduce_gradients(ddp, *, bucket_bytes: int = BUCKET_BYTES) -> int:
    """Average the local ``.grad`` of ``ddp``'s parameters over its process group, as DDP's reducer would.

    A parameter with a gradient on some ranks only gets zeros where it has none (DDP's rule for a parameter
    unused on some ranks); one unused on every rank keeps ``grad=None``. Gradients are flattened per device and
    dtype into buckets of at most ``bucket_bytes``.

    Returns:
        The number of all-reduce calls made (one for the presence mask plus one per bucket).

    Raises:
        PackedEncodersError: a sparse gradient (DDP handles those separately).
    """
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    group = ddp.process_group
    world = dist.get_world_size(group)
    params = _synced_parameters(ddp)
    if not params:
        return 0
    device = params[0].device
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(present, group=group)
    calls = 1
    grads = []
    for p, n in zip(params, present.tolist()):
        if n == 0:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.grad.is_sparse:
            raise PackedEncodersError("grad_cache_sync: sparse gradients are not supported (DDP reduces them on "
                                      "their own path); use a dense embedding")
        grads.append(p.grad)
    open_buckets: dict[tuple, tuple[list, int]] = {}  # (device, dtype) -> (gradients, bytes)
    buckets = []
    for g in grads:
        key, size = (g.device, g.dtype), g.numel() * g.element_size()
        bucket, nbytes = open_buckets.get(key, ([], 0))
        if bucket and nbytes + size > bucket_bytes:
            buckets.append(bucket)
            bucket, nbytes = [], 0
        bucket.append(g)
        open_buckets[key] = (bucket, nbytes + size)
    buckets.extend(bucket for bucket, _ in open_buckets.values())
    for bucket in buckets:
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        for g, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(synced)
        calls += 1
    return calls


@contextmanager
def grad_cache_sync(model: nn.Module) -> Iterator[None]:
    """Run the block's backwards without DDP communication, then all-reduce the gradients once.

    Wrap the backward of a GradCache loss (or a whole hand-written GradCache step)::

        loss = cached_loss(features, labels)          # its backward re-embeds mini-batch by mini-batch
        with pe.grad_cache_sync(ddp_model):
            loss.backward()                          # k mini-batch backwards, one all-reduce at the end

    The gradients equal those of per-mini-batch synchronisation (the mean over ranks of each rank's gradient).
    Inside an outer ``ddp_model.no_sync()`` (gradient accumulation) nothing is all-reduced: the step that
    synchronises later reduces the accumulated gradients, as DDP would. ``model`` that is not a
    ``DistributedDataParallel`` (a single-process run) makes this a no-op. No all-reduce runs when the block
    raises (the other ranks would wait for it).

    Args:
        model: the ``DistributedDataParallel`` the loss runs its forward through.

    Raises:
        PackedEncodersError: DDP built with ``static_graph=True`` (its reducer must see every iteration) or with a
            registered communication hook (the plain all-reduce here would bypass it).
    """
    ddp = _ddp(model)
    if ddp is None:
        yield
        return
    if getattr(ddp, "static_graph", False):
        raise PackedEncodersError("grad_cache_sync: DistributedDataParallel(static_graph=True) needs its reducer to "
                                  "run in every iteration; build it with static_graph=False")
    if getattr(ddp, "_comm_hooks", None) or getattr(ddp, "_comm_hook", None):
        raise PackedEncodersError("grad_cache_sync: a DDP communication hook is registered; the single all-reduce "
                                  "here would bypass it (remove the hook, or let each mini-batch synchronise)")
    sync = ddp.require_backward_grad_sync
    with ddp.no_sync():
        yield
    if sync:
        all_reduce_gradients(ddp)
