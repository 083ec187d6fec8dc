"""Per-instance patch record: what `pack()` put on a ModernBertModel and how to take it off exactly.

Three instance attributes are set: ``forward`` (a :class:`PackedForward`, a plain picklable object holding
the module), ``_packed_encoders`` (a :class:`PackState`) and ``_replicate_for_data_parallel`` (so
``nn.DataParallel`` replicas run their own weights). No class is touched. The record
survives ``copy.deepcopy`` (the copy's forward runs the copy's weights) and pickling; transient runtime
objects (CUDA graphs) are dropped from copies and rebuilt on demand.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from ..model.params import ModernBertParams
from ..ops import TORCH_OPS, OpSet

STATE_ATTR = "_packed_encoders"
_NO_FORWARD = "<class forward>"


@dataclass(frozen=True)
class PackOptions:
    attention_backend: str = "auto"
    kernels: str = "auto"
    validate: bool = True
    cuda_graph: Any = None
    padded_outputs: Any = "auto"


@dataclass
class PackState:
    params: ModernBertParams
    options: PackOptions
    ops: OpSet = TORCH_OPS
    ops_reason: str = ""
    trailing_max_len: int | None = None  # padded calls this narrow compute trailing masked positions
    policy: Any = None
    previous_forward: Any = _NO_FORWARD
    report: Any = None
    last_plan: dict = field(default_factory=dict)
    last_fallbacks: list = field(default_factory=list)
    runtime: dict = field(default_factory=dict)  # graphs and other device objects; never copied

    def __getstate__(self):
        d = dict(self.__dict__)
        d["runtime"] = {}
        return d

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        for k, v in self.__dict__.items():
            if k != "runtime":
                setattr(new, k, copy.deepcopy(v, memo))
        new.runtime = {}
        return new

    def with_options(self, options: PackOptions) -> "PackState":
        return replace(self, options=options, runtime={})


class PackedForward:
    """The instance-level ``forward`` of a packed ModernBertModel (picklable, deepcopy-safe)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        from .hf_call import hf_forward

        return hf_forward(self.module, *args, **kwargs)

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


def get_state(model: nn.Module) -> PackState | None:
    return model.__dict__.get(STATE_ATTR)


def install(model: nn.Module, state: PackState) -> None:
    existing = get_state(model)
    if existing is None:
        state.previous_forward = model.__dict__.get("forward", _NO_FORWARD)
    else:
        state.previous_forward = existing.previous_forward
    model.__dict__[STATE_ATTR] = state
    model.__dict__["forward"] = PackedForward(model)
    model.__dict__["_replicate_for_data_parallel"] = PackedReplicator(model)


def restore(model: nn.Module) -> bool:
    """Remove our attributes; returns False when ``model`` was not packed."""
    state = model.__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    model.__dict__.pop("forward", None)
    model.__dict__.pop("_replicate_for_data_parallel", None)
    if state.previous_forward is not _NO_FORWARD and not isinstance(state.previous_forward, str):
        model.__dict__["forward"] = state.previous_forward
    return True
