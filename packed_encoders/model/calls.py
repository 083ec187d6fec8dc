"""Linear slots whose live module the packed forward calls rather than reading its weights.

The packed forward reads ``weight`` and ``bias`` of a layer's four projections (``attn.Wqkv``, ``attn.Wo``,
``mlp.Wi``, ``mlp.Wo``) and runs its own GEMMs on them. That reproduces an ``nn.Linear`` exactly, and nothing else:
a peft LoRA layer (``BaseTunerLayer``: its active adapters, ``disable_adapter()``, merged state, ``lora_dropout``,
DoRA, rslora), a quantised or otherwise wrapped Linear, or a parametrized one computes its output in its own
``forward``. A slot holding any module but an ``nn.Linear`` itself is *called*: the forward runs ``module(x)`` on the
packed ``[T, in_features]`` activations, as stock HF runs it on ``[B, S, in_features]`` (a token-wise map gives the
same rows), and every route that reads a weight for that slot stays off (:mod:`.plan` decides: no fused RoPE epilogue
on a called ``Wqkv``, no ``Wi`` + GLU GEMM on a called ``Wi``, no raw-pointer runs, training blocks or stack, no
unchecked launches; the router turns CUDA graphs off).

:func:`read_calls` reads the slots from the live modules; the per-call structure check keeps its result in its
snapshot (rebuilt whenever a module in a slot changes), so a call pays nothing for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import PackedEncodersError

# a layer's Linear slots, in the order of the flags below: (parent module, attribute)
SLOTS = (("attn", "Wqkv"), ("attn", "Wo"), ("mlp", "Wi"), ("mlp", "Wo"))
MODULE_CALL = "module call at "  # how every ModuleCalls reason starts (the graph route's fallbacks tell them so)
PLAIN = (False, False, False, False)  # a layer whose four slots are nn.Linear


def is_called(module: nn.Module | None) -> bool:
    """Whether the forward calls the module in a Linear slot (anything but an ``nn.Linear`` itself: a subclass may
    compute its weight or output otherwise, e.g. a parametrized or quantised Linear)."""
    return module is not None and type(module) is not nn.Linear


def type_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class ModuleCalls:
    """Which Linear slots of an encoder hold a module the packed forward calls.

    Attributes:
        layers: per layer, ``(Wqkv, attn.Wo, mlp.Wi, mlp.Wo)`` flags (``True``: called).
        slots: each called slot as ``"layers.<i>.<slot> (<module type>)"``, in layer order (for ``describe()``).
    """

    layers: tuple[tuple[bool, bool, bool, bool], ...]
    slots: tuple[str, ...]

    def summary(self) -> str:
        """``"module call at layers.0.attn.Wqkv (peft.tuners.lora.layer.Linear)"`` (and how many more slots)."""
        more = len(self.slots) - 1
        return f"{MODULE_CALL}{self.slots[0]}" + (f" and {more} more slot{'s' * (more > 1)}" if more else "")

    def graph_reason(self) -> str:
        """Why no CUDA graph serves the encoder's calls (``describe()``, the graph fallbacks)."""
        return (f"{self.summary()}: CUDA graphs off (a graph replays the weights it captured, not the module's "
                "forward); merge adapters (peft's merge_and_unload) for graphs")

    def plan_reason(self) -> str:
        """Why the forward runs the checked per-op path (``describe()["encoders"][i]["eager_plan"]``)."""
        return (f"{self.summary()}: its output is read as the module returns it (checked ops, one autograd node per "
                "op with gradients)")


def read_calls(model: nn.Module) -> ModuleCalls | None:
    """The called Linear slots of a ``ModernBertModel`` (``None`` when every slot holds an ``nn.Linear``: the common
    case, which the plan caches under ``None``). Reads the module registries, never ``__getattr__``; an empty or
    missing slot is left to the structure check (it refuses those)."""
    flags, slots = [], []
    for index, layer in enumerate(model.layers):
        row = []
        for parent, name in SLOTS:
            owner = layer._modules.get(parent)
            module = None if owner is None else owner._modules.get(name)
            called = is_called(module)
            row.append(called)
            if called:
                slots.append(f"layers.{index}.{parent}.{name} ({type_name(module)})")
        flags.append(tuple(row))
    return ModuleCalls(tuple(flags), tuple(slots)) if slots else None


def call(module: nn.Module, x: torch.Tensor, width: int, index: int, slot: str,
         dtype: torch.dtype | None = None) -> torch.Tensor:
    """``module(x)`` for a called Linear slot: ``x`` ``[T, in_features]`` -> ``[T, width]``, in ``dtype`` where
    given (the activations' dtype the attention and GLU kernels after ``Wqkv`` / ``Wi`` were planned for: under
    autocast a module may return fp32, e.g. one adding fp32 terms, where stock's attention is cast by autocast).

    Raises:
        PackedEncodersError: the module returned something else than a ``[T, width]`` tensor (the packed layer reads
            that width, as stock's views and residual sums do).
    """
    y = module(x)
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.shape[0] != x.shape[0] or y.shape[1] != width:
        got = f"shape {tuple(y.shape)}" if isinstance(y, torch.Tensor) else f"a {type(y).__name__}"
        raise PackedEncodersError(
            f"layers.{index}.{slot} ({type_name(module)}) returned {got} for input {tuple(x.shape)}; the packed "
            f"forward calls it on [tokens, features] rows and reads [tokens, {width}] (a token-wise map, as an "
            "nn.Linear is): pe.unpack(model) runs stock HF")
    return y if dtype is None or y.dtype is dtype else y.to(dtype)


__all__ = ["MODULE_CALL", "ModuleCalls", "PLAIN", "SLOTS", "call", "is_called", "read_calls", "type_name"]
