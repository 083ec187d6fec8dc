"""FSDP2 (``torch.distributed.fsdp.fully_shard``) inside a ModernBERT encoder.

``fully_shard(module)`` all-gathers the module's weights in a forward pre-hook and reduce-scatters their gradients
after its backward. The packed forward reads weights off the modules without calling them, so those hooks would
not run for a module *inside* the encoder (a layer, the embeddings): the forward would see shards. Sharding the
encoder itself, or a module above it (a SentenceTransformer, a task head), keeps the packed path: the hooks of
that module gather every encoder weight before the packed forward runs and reduce-scatter after the backward. A
projection slot's module that the packed forward calls (a peft LoRA layer, :mod:`packed_encoders.model.calls`) is
inside the encoder too: sharded on its own it is refused like any other (its hooks would run, on packed rows; the
structure check refuses hooks there), while its parameters are gathered with the unit above the encoder.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn

from ..errors import PackedEncodersError


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
                    "leave this encoder unpacked (stock's forward calls the hooks)")
    return None


def sharded(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a ``DTensor`` (a shard: FSDP2 outside its forward, or tensor
    parallelism)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed support
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


@contextmanager
def gathered(target: nn.Module, path: str, model: nn.Module) -> Iterator[None]:
    """Hold the weights of ``model`` (the encoder at ``path`` inside ``target``) unsharded for the block.

    Validation calls the encoder's stock and packed forwards directly, outside the FSDP2 hooks that gather its
    weights in a call through ``target``: after ``fully_shard``, they would see shards (torch's error mixes
    ``Tensor`` and ``DTensor`` without saying why). The FSDP2 unit holding the encoder's weights (the encoder
    itself or the nearest module above it inside ``target``) is unsharded around the block, then resharded; every
    rank calls ``pack`` (the all-gather is collective), as every rank calls the model.

    Raises:
        PackedEncodersError: sharded weights whose FSDP2 unit is not inside ``target`` (or sharded by something
            else, such as tensor parallelism).
    """
    if not sharded(model):
        yield
        return
    fsdp = _fsdp_module_type()
    # named_modules lists a module before those inside it: the last match is the nearest unit above the encoder
    owner = None
    for name, module in target.named_modules():
        if isinstance(module, fsdp) and (not name or path == name or path.startswith(name + ".")):
            owner = module
    if owner is None:
        raise PackedEncodersError(f"cannot validate {path or type(model).__name__}: its weights are sharded "
                                  "(DTensor) by something outside the pack() target; pack the module that "
                                  "fully_shard was applied to, pack before sharding, or pack with validate=False")
    owner.unshard()
    try:
        yield
    finally:
        owner.reshard()
