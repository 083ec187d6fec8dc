"""Installing the packed forward on a ModernBertModel instance and taking it off again (see :mod:`.state` for the
record it keeps)."""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from .dynamo import outside_dynamo
from .hf_call import hf_forward
from .state import (_NO_FORWARD, STATE_ATTR, PackState, forward_bypassed, get_state, instance_forward, own_forward,
                    rebound_args)
from .stock_calls import stock_signature


# Inside a dynamo trace torch.compiler.is_exporting() cannot tell torch.compile from a strict torch.export (torch 2.11
# folds it to True for both), so every dynamo trace runs the packed forward outside the graph (adapters.dynamo);
# non-strict torch.export (the default) never enters dynamo and traces the stock forward (adapters.stock_calls).
_STRICT_EXPORT = ("packed_encoders runs the packed forward outside dynamo's graph (it reads the batch's lengths on "
                  "the host): under torch.compile the encoder is a graph break (fullgraph=True cannot hold it); export "
                  "a packed model with torch.export.export(..., strict=False), which traces the stock forward, or "
                  "pe.unpack(model) first")


class PackedForward:
    """The instance-level ``forward`` of a packed ModernBertModel (picklable, deepcopy-safe).

    Something may still call it after ``unpack()``: a wrapper set as ``forward`` after ``pack()`` (accelerate's
    hooks keep the forward they wrap), or a reference taken before. It then runs what ``unpack()`` restored:
    ``previous`` (the instance forward ``pack()`` replaced), or the class forward; ``pack()`` again keeps such a
    wrapper, and the PackedForward under it runs packed again."""

    # a method bound to it (state.instance_forward) pickles as getattr(module, __func__.__name__): the unpickled
    # module's class forward, which pack() replaces again (describe() says "bypassed" until then)
    __name__ = "forward"

    def __init__(self, module: nn.Module, previous=_NO_FORWARD):
        self.module = module
        self.previous = previous

    def __call__(self, *args, **kwargs):
        args = rebound_args(self, args)
        if STATE_ATTR not in self.module.__dict__:  # unpacked
            previous = getattr(self, "previous", _NO_FORWARD)  # (pickled before this attribute existed)
            if isinstance(previous, str):
                return type(self.module).forward(self.module, *args, **kwargs)
            return previous(*args, **kwargs)
        if torch.compiler.is_dynamo_compiling():
            return outside_dynamo(hf_forward, _STRICT_EXPORT)(self.module, *args, **kwargs)
        return hf_forward(self.module, *args, **kwargs)

    @property
    def __signature__(self):
        """The stock forward's signature (HF and other libraries read ``inspect.signature(model.forward)``)."""
        return stock_signature(type(self.module))

    @property
    def __code__(self):
        """The patched forward's code object: ``torch.export`` reads ``model.forward.__code__`` for its metadata
        (it then traces the stock forward, see ``adapters.stock_calls``)."""
        return hf_forward.__code__

    def __repr__(self) -> str:
        return f"<packed_encoders forward of {type(self.module).__name__}>"


class PackedReplicator:
    """Instance ``_replicate_for_data_parallel``: ``nn.DataParallel`` replicas copy ``__dict__`` shallowly, which
    would leave them running the original module's weights; each replica gets its own forward and state."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self):
        replica = type(self.module)._replicate_for_data_parallel(self.module)
        state = get_state(self.module)
        if state is not None:
            own = copy.copy(state)
            own.runtime = {}
            replica.__dict__[STATE_ATTR] = own
            replica.__dict__["forward"] = PackedForward(replica)
            replica.__dict__["_replicate_for_data_parallel"] = PackedReplicator(replica)
        return replica


def own_state(model: nn.Module) -> PackState | None:
    """``model``'s state when ``pack()`` installed it on ``model`` (or a copy of it was made for ``model``: deepcopy,
    unpickling, a data-parallel replica), else ``None``. A shallow copy (``copy.copy``) shares its original's
    ``__dict__`` values, this state and the forward running the original included: keeping that state for the
    copy would let ``pack(copy)`` rewrite what the original's calls compute (its heads' reads)."""
    state = get_state(model)
    if state is None:
        return None
    owner = state.runtime.get("owner")
    if owner is not None:
        return state if owner() is model else None
    # (an unpickled state names no owner) a shallow copy's forward is its original's
    forward = instance_forward(model)
    return None if isinstance(forward, PackedForward) and forward.module is not model else state


def replaced_forward(model: nn.Module):
    """The instance ``forward`` (not the packed one) that :func:`install` would replace on a model not packed yet,
    or ``None``: the packed forward runs instead of it until ``unpack()`` restores it."""
    if get_state(model) is not None:
        return None
    current = instance_forward(model)
    own = own_forward(model, current, PackedForward)
    if own is not None and own is not current:  # a wrapper over ours, kept (install)
        return None
    if own is not None:  # left by an earlier unpack()
        current = getattr(current, "previous", None)
    return None if current is None or isinstance(current, str) else current


def install(model: nn.Module, state: PackState) -> None:
    outside_dynamo(hf_forward, _STRICT_EXPORT)
    existing = get_state(model)
    current = instance_forward(model, _NO_FORWARD)
    own = own_forward(model, current, PackedForward)
    if existing is None:
        # ours, left by an earlier unpack() on the instance or under a wrapper set over it since (accelerate's hook
        # calls it through module._old_forward): unpack() restores what it replaced, not the wrapper, which stays.
        # Recorded as the forward to restore, the wrapper would outlive its hook's removal (calling the deleted
        # _hf_hook; unpicklable), and a hook added later over the PackedForward holding it would loop with it
        state.previous_forward = current if own is None else getattr(own, "previous", _NO_FORWARD)
    elif forward_bypassed(model):
        # the class forward set back over the packed one since pack() (accelerate's remove_hook_from_module restores
        # the forward its hook saved): the forward pack() replaced then (that hook's, which calls the removed hook)
        # is gone, and unpack() leaves the class forward
        state.previous_forward = _NO_FORWARD
    else:
        state.previous_forward = existing.previous_forward
    model.__dict__[STATE_ATTR] = state
    state.runtime["owner"] = weakref.ref(model)  # (PackState._stale_previous)
    if (existing is None and own is None) or isinstance(current, PackedForward) or forward_bypassed(model):
        model.__dict__["forward"] = PackedForward(model, state.previous_forward)
    # else: a forward set over the packed one after pack(), even one unpack() left since (a wrapper such as
    # accelerate's hooks, which calls the PackedForward it wrapped, reading this new state) is kept
    model.__dict__["_replicate_for_data_parallel"] = PackedReplicator(model)


def restore(model: nn.Module) -> bool:
    """Remove our attributes; returns False when ``model`` was not packed."""
    state = model.__dict__.pop(STATE_ATTR, None)
    if state is None:
        current = instance_forward(model)
        if isinstance(current, PackedForward) and current.module is model:
            # left by an earlier unpack() under a wrapper since removed (accelerate's remove_hook_from_module puts
            # back the forward its hook wrapped): take it off too
            _put_back(model, getattr(current, "previous", _NO_FORWARD))
        return False
    model.__dict__.pop("_replicate_for_data_parallel", None)
    if not isinstance(instance_forward(model), PackedForward):
        # a forward set over the packed one after pack(), e.g. accelerate's hook wrapper: it stays, and the
        # PackedForward it calls runs the previous or class forward from now on
        return True
    _put_back(model, state.previous_forward)
    return True


def _put_back(model: nn.Module, previous) -> None:
    """The instance forward ``pack()`` replaced (``previous``), or none: the class forward."""
    model.__dict__.pop("forward", None)
    if previous is not _NO_FORWARD and not isinstance(previous, str):
        model.__dict__["forward"] = previous
