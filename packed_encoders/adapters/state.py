"""Per-instance patch record: what `pack()` put on a ModernBertModel and how to take it off exactly.

Three instance attributes are set by :func:`.patch.install`: ``forward`` (a ``PackedForward``, a plain picklable
object holding the module), ``_packed_encoders`` (a :class:`PackState`) and ``_replicate_for_data_parallel`` (so
``nn.DataParallel`` replicas run their own weights). No class is touched. The record
survives ``copy.deepcopy`` (the copy's forward runs the copy's weights) and pickling; transient runtime
objects (CUDA graphs) are dropped from copies and rebuilt on demand, while the query-expansion watch follows the
copied or unpickled target.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

from torch import nn

from ..model.params import ModernBertParams
from ..ops import TORCH_OPS, OpSet
from ..tuning import Tuning

STATE_ATTR = "_packed_encoders"
_NO_FORWARD = "<class forward>"


@dataclass(frozen=True)
class PackOptions:
    attention_backend: str = "auto"
    kernels: str = "auto"
    validate: bool = True
    cuda_graph: Any = None          # a GraphConfig, or None: graphs off
    padded_outputs: Any = "auto"
    graph_auto: bool = False        # cuda_graph was left at its default (None): graphs on where they can serve


def wider(a: int | None, b: int | None) -> int | None:
    """The wider of two trailing widths (``None``: none computed)."""
    return a if b is None else b if a is None else max(a, b)


@dataclass
class PackState:
    params: ModernBertParams
    options: PackOptions
    ops: OpSet = TORCH_OPS
    ops_reason: str = ""
    trailing_max_len: int | None = None  # padded calls this narrow compute trailing masked positions
    trailing_floor: int | None = None  # what an explicit padded_outputs ("all" or an int) asks for besides the readers
    position_zero: str | None = None  # what a classifier_pooling="cls" head around the encoder reads (token_labels)
    label_checked: bool = False  # a head has checked this encoder's calls' labels (token_labels.restore_bypassed)
    policy: Any = None
    tuning: Tuning = field(default_factory=Tuning)  # switches and budgets read at pack()
    previous_forward: Any = _NO_FORWARD
    report: Any = None
    last_plan: dict = field(default_factory=dict)
    last_fallbacks: list = field(default_factory=list)
    runtime: dict = field(default_factory=dict)  # graphs and other device objects; never copied (a copy gets the
    # expansion watch and the weak reference to its own module, "owner", where the copy has them)

    def _stale_previous(self) -> bool:
        """The forward to restore is stale: the class forward was set back on the owner's instance since
        ``pack()`` (accelerate's ``remove_hook_from_module`` for a hook added before it), so ``unpack()`` would not
        restore it and ``pack()`` again drops it (``patch.install``); it may be the removed hook's wrapper, which
        neither pickles nor runs."""
        owner = self.runtime.get("owner")
        module = None if owner is None else owner()
        return module is not None and module.__dict__.get(STATE_ATTR) is self and forward_bypassed(module)

    def __getstate__(self):
        d = dict(self.__dict__)
        watch = self.runtime.get("expansion")  # the query-expansion watch follows a pickled target
        d["runtime"] = {} if watch is None else {"expansion": watch}
        if self._stale_previous():
            d["previous_forward"] = _NO_FORWARD
        return d

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        stale = self._stale_previous()
        for k, v in self.__dict__.items():
            if k != "runtime":
                setattr(new, k, _NO_FORWARD if stale and k == "previous_forward" else copy.deepcopy(v, memo))
        new.runtime = {}
        watch = self.runtime.get("expansion")  # the query-expansion watch follows a copied target
        if watch is not None:
            new.runtime["expansion"] = watch.copied(memo)
        owner = self.runtime.get("owner")
        twin = None if owner is None else memo.get(id(owner()))
        if twin is not None:  # (the module copied before its __dict__, as nn.Module's deepcopy does)
            new.runtime["owner"] = weakref.ref(twin)
        return new


def get_state(model: nn.Module) -> PackState | None:
    return model.__dict__.get(STATE_ATTR)


def instance_forward(module: nn.Module, default=None):
    """``module``'s instance ``forward``, seen through a re-binding to the module: accelerate's
    ``unwrap_model(keep_fp32_wrapper=False)`` sets ``MethodType(<the instance forward>, module)`` back on it."""
    current = module.__dict__.get("forward", default)
    func = getattr(current, "__func__", None)
    if func is not None and getattr(current, "__self__", None) is module and not isinstance(func, FunctionType):
        return func
    return current


def rebound_args(forward, args: tuple) -> tuple:
    """``args`` of a call of ``forward`` (an instance forward of ours, holding ``module``), without the module
    itself where a re-binding (:func:`instance_forward`) passed it first; ``forward`` is then put back as the
    module's instance forward, so the module pickles as it did."""
    if args and args[0] is forward.module:
        if instance_forward(forward.module) is forward:
            forward.module.__dict__["forward"] = forward
        return args[1:]
    return args


def own_forward(module: nn.Module, forward, cls):
    """The instance forward of ours (a ``cls`` holding ``module``) that ``forward`` is, or wraps: a wrapper set over it
    (accelerate's hooks, ``functools.wraps``) names it ``__wrapped__`` (``functools.update_wrapper``); else ``None``."""
    for _ in range(16):  # (a bound on ``__wrapped__`` chains that never end)
        if isinstance(forward, cls) and forward.module is module:
            return forward
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return None
    return None


def forward_bypassed(module: nn.Module) -> bool:
    """Whether calls of ``module`` run its class forward instead of the instance forward ``pack()`` set (the packed
    encoder's, a head's label check): its instance forward is gone, or is the class forward bound to it (accelerate's
    ``remove_hook_from_module`` restores the forward it saved when its hook was added before ``pack()``)."""
    current = module.__dict__.get("forward")
    return current is None or (getattr(current, "__func__", None) is type(module).forward
                               and getattr(current, "__self__", None) is module)
