"""FSDP2 (``torch.distributed.fsdp.fully_shard``) inside a ModernBERT encoder.

``fully_shard(module)`` all-gathers the module's weights in a forward pre-hook and reduce-scatters their gradients
after its backward. The packed forward reads weights off the modules without calling them, so those hooks would
not run for a module *inside* the encoder (a layer, the embeddings): the forward would see shards. Sharding the
encoder itself, or a module above it (a SentenceTransformer, a task head), keeps the packed path: the hooks of
that module gather every encoder weight before the packed forward runs and reduce-scatter after the backward.
"""

from __future__ import annotations

from torch import nn


def _fsdp_module_type():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed support
        return None
    return FSDPModule


def fsdp_problem(model: nn.Module) -> str | None:
    """Why the packed forward cannot run ``model`` (a ModernBertModel) under FSDP2, or ``None``.

    A module strictly inside ``model`` managed by ``fully_shard`` is a problem; ``model`` itself or an ancestor is
    not."""
    fsdp = _fsdp_module_type()
    if fsdp is None:
        return None
    for path, module in model.named_modules():
        if path and isinstance(module, fsdp):
            return (f"{path} is sharded by FSDP2 (fully_shard), whose all-gather runs in that module's forward "
                    "hooks, which the packed forward does not call (it reads the weights directly); shard the "
                    "encoder as one unit instead (fully_shard on the ModernBertModel or a module above it), or "
                    "pe.unpack the model")
    return None
