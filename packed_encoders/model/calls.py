"""Linear slots whose live module the packed forward calls rather than reading its weights.

The packed forward reads ``weight`` and ``bias`` of a layer's four projections (``attn.Wqkv``, ``attn.Wo``,
``mlp.Wi``, ``mlp.Wo``) and runs its own GEMMs on them. That reproduces an ``nn.Linear`` exactly, and nothing else:
a peft LoRA layer (``BaseTunerLayer``: its active adapters, ``disable_adapter()``, merged state, ``lora_dropout``,
DoRA, rslora), a quantised or otherwise wrapped Linear, or a parametrized one computes its output in its own
``forward``. A slot holding any module but an ``nn.Linear`` itself is *called*: the forward runs ``module(x)`` on the
packed ``[T, in_features]`` activations, as stock HF runs it on ``[B, S, in_features]`` (a token-wise map gives the
same rows), and every route that reads a weight for that slot stays off (:mod:`.plan` decides: no fused RoPE epilogue
on a called ``Wqkv``, no ``Wi`` + GLU GEMM on a called ``Wi``, no raw-pointer runs, training blocks or stack, no
unchecked launches).

Without gradients, a slot whose peft LoRA layer is one linear map now (:func:`merged_weights`) is not called: it
runs as one GEMM on ``W + sum s B A``, made from the live weights at each call, on every route a plain slot takes
but the raw-pointer runs (which read the slots' modules).

CUDA graphs capture what a call launched for these slots (the merge, or the module's forward), reading parameters by
address (the graph fingerprint holds every parameter's): a replay is that only while the Python state it branched on
is unchanged. For peft's LoRA ``Linear`` that state is known and small (active adapters, disabled, merged, each
adapter's ``scaling``, which the kernels were launched with), so :func:`replay_state` reads it once per call (the
router's ``Facts.adapters``) and the graph fingerprint keys on it: ``set_adapter``, ``disable_adapter()``,
``set_scale`` or a merge drop the graphs, which are captured again. Its train-mode ``lora_dropout`` (a graph does not
apply dropout), LoRA variants (DoRA, ...) and every other module type (unknown state) run eagerly, as do calls with
gradients under training graphs. Hooks or an instance ``forward`` on a called slot or inside it run the call stock
(the structure check refuses them: they would see packed rows).

:func:`read_calls` reads the slots from the live modules; the per-call structure check keeps its result in its
snapshot (rebuilt whenever a module in a slot, or inside a called one, changes), so a call pays nothing for it.
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
        """Why no training graph serves the encoder's calls with gradients (``describe()``, the graph fallbacks)."""
        return (f"{self.summary()}: training graphs off (they capture the packed layers' own backward, not the "
                "module's); merge adapters (peft's merge_and_unload) for them")

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


_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")  # (module, qualname) of the called type graphs may replay


def _hooked(module: nn.Module) -> bool:
    """Forward hooks or an instance forward: a replay would skip what they do."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))


def _lora_state(module: nn.Module) -> tuple | str:
    """The Python state peft's LoRA ``Linear.forward`` (peft 0.17-0.21) branches on, or why a graph may not replay
    the module (a str)."""
    cls = type(module)
    if (cls.__module__, cls.__qualname__) != _LORA_LINEAR:
        return ("CUDA graphs off (a graph would replay the module's forward as captured, and only the state of "
                "peft's LoRA Linear is followed); merge adapters (peft's merge_and_unload) for graphs")
    state = vars(module)
    children = state["_modules"]
    base = children.get("base_layer")
    if type(base) is not nn.Linear or _hooked(base):
        return "CUDA graphs off: its base_layer is not a plain nn.Linear"
    disabled = bool(state.get("_disable_adapters", False))
    merged = tuple(state.get("merged_adapters", ()))
    if disabled and merged:
        return "CUDA graphs off: adapters disabled while merged (peft unmerges them on the next call)"
    adapters = []
    if not disabled and not merged:
        lora_a, lora_b, drops = children.get("lora_A"), children.get("lora_B"), children.get("lora_dropout")
        variants, scaling = state.get("lora_variant", {}), state.get("scaling", {})
        for name in module.active_adapters:
            if lora_a is None or name not in lora_a:
                continue  # (peft skips it too)
            if name in variants:
                return (f"CUDA graphs off: adapter {name!r} is a LoRA variant ({type(variants[name]).__name__}: "
                        "DoRA, ...), whose state graphs do not follow")
            a, b, drop = lora_a[name], lora_b[name], drops[name]
            if type(a) is not nn.Linear or type(b) is not nn.Linear or _hooked(a) or _hooked(b) or _hooked(drop):
                return (f"CUDA graphs off: adapter {name!r} has hooks, an instance forward or a non-Linear "
                        "lora_A / lora_B")
            if type(drop) not in (nn.Identity, nn.Dropout):
                return f"CUDA graphs off: adapter {name!r}'s lora_dropout is a {type(drop).__name__}"
            if type(drop) is nn.Dropout and drop.training and drop.p > 0:
                return (f"CUDA graphs off: adapter {name!r}'s lora_dropout applies (train mode, p={drop.p}), "
                        "which a replay would not")
            adapters.append((name, scaling.get(name)))
    return (id(module), disabled, merged, tuple(adapters), state.get("cast_input_dtype_enabled", True))


def _called_slots(model: nn.Module, calls: ModuleCalls):
    """``(layer index, slot position in SLOTS, "layers.<i>.<slot> (<type>)", module)`` of each called slot."""
    for index, (layer, flags) in enumerate(zip(model.layers, calls.layers)):
        if flags == PLAIN:
            continue
        for pos, ((parent, name), called) in enumerate(zip(SLOTS, flags)):
            if called:
                module = layer._modules[parent]._modules[name]
                yield index, pos, f"layers.{index}.{parent}.{name} ({type_name(module)})", module


def replay_state(model: nn.Module, calls: ModuleCalls) -> tuple | str:
    """What a CUDA graph of the encoder ``model`` depends on in its called slots beyond the parameters' addresses
    (which the graph fingerprint holds): per slot, peft LoRA's adapter state (:func:`_lora_state`); or why no graph
    may replay them, as ``"module call at layers.<i>.<slot> (<type>): <why>"``."""
    key = []
    for _, _, slot, module in _called_slots(model, calls):
        state = _lora_state(module)
        if isinstance(state, str):
            return f"{MODULE_CALL}{slot}: {state}"
        key.append(state)
    return tuple(key)


def _merge(weight, bias, terms, dtype, kernel=None) -> tuple:
    """``(W + sum s B A, b + sum s b_B)`` in ``dtype`` (GEMMs accumulate in fp32; autocast off: it would round the
    product); with no ``terms``, ``(W, b)`` in ``dtype``. One adapter with a number for ``scaling``: ``kernel``
    (:attr:`..ops.OpSet.lora_merge`, one pass summing in fp32) where it takes the operands; else, on a weight in
    ``dtype`` already, one ``addmm`` in ``dtype``, its factors ``A`` / ``B`` rounded to ``dtype`` first (peft keeps
    them in fp32 on a bf16 model), the sum rounded once (a fp32 copy of the weight would cost four times its memory
    traffic at every call). Otherwise the sum is made in fp32 and rounded once."""
    if not terms:
        return weight.to(dtype), None if bias is None else bias.to(dtype)
    w = None
    with torch.autocast(weight.device.type, enabled=False):
        if len(terms) == 1 and isinstance(terms[0][3], (int, float)):
            a_w, b_w, _, s = terms[0]
            if kernel is not None:
                w = kernel(weight, a_w, b_w, s, dtype)
            if w is None and weight.dtype is dtype:
                w = torch.addmm(weight, b_w.to(dtype), a_w.to(dtype), alpha=s)
        if w is None:
            w = weight.float()
            for a_w, b_w, _, s in terms:
                a_w, b_w = a_w.float(), b_w.float()
                w = torch.addmm(w, b_w, a_w, alpha=s) if isinstance(s, (int, float)) else w + s * (b_w @ a_w)
        extra = [s * b_b.float() for _, _, b_b, s in terms if b_b is not None]
        b = bias if not extra else (0 if bias is None else bias.float()) + sum(extra)
    return w.to(dtype), None if b is None else b.to(dtype)


def merged_weights(model: nn.Module, calls: ModuleCalls, dtype: torch.dtype | None, kernel=None) -> tuple:
    """For a call without gradients: the called slots holding a peft LoRA ``Linear`` whose forward is one Linear map
    now (:func:`_lora_state`: vanilla LoRA, no dropout applied, no hooks or instance forward) as that map's
    ``(weight, bias)``, ``W + sum_a scaling_a * B_a @ A_a`` (the base layer's own when the adapters are disabled or
    merged), in ``dtype`` (``None``: the base weight's); so the slot runs as one GEMM on the fused routes instead of
    peft's ops on ``[T, out]`` rows. Made from the live weights at every call, as peft's forward reads them (a kept
    copy would miss edits through ``.data``: peft merges, unmerges and hot-swaps adapters that way); a CUDA graph's
    capture records the merge, so a replay makes it again. ``kernel``: the op set's merge
    (:attr:`..ops.OpSet.lora_merge`; ``None``: torch ops).

    Returns:
        ``(left, table)``: the slots still called (:class:`ModuleCalls`, ``None`` when none is) and
        ``{(layer, slot position in SLOTS): (weight, bias)}``.
    """
    table, left = {}, []
    rows = [list(flags) for flags in calls.layers]
    for index, pos, slot, module in _called_slots(model, calls):
        state = _lora_state(module)
        if isinstance(state, str) or getattr(module, "fan_in_fan_out", False):
            left.append(slot)
            continue
        rows[index][pos] = False
        base = module._modules["base_layer"]
        lora_a, lora_b = module._modules.get("lora_A"), module._modules.get("lora_B")
        terms = tuple((lora_a[n].weight, lora_b[n].weight, lora_b[n].bias, s) for n, s in state[3])
        table[(index, pos)] = _merge(base.weight, base.bias, terms, dtype or base.weight.dtype, kernel)
    return (ModuleCalls(tuple(map(tuple, rows)), tuple(left)) if left else None), table


def graph_refusal(model: nn.Module, calls: ModuleCalls | None, training_graph: bool = False) -> tuple:
    """``(refusal, adapters)``: why no graph may serve a call of the encoder ``model`` because of its called slots
    ``calls`` (``None``: a graph may), and what an inference graph's replay depends on in them
    (:func:`replay_state`; ``None`` with no called slot or a refusal), read once for the call. ``training_graph``:
    a call with gradients that training graphs would serve (never with a called slot)."""
    if calls is None:
        return None, None
    if training_graph:
        return calls.graph_reason(), None
    state = replay_state(model, calls)
    return (state, None) if isinstance(state, str) else (None, state)


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


__all__ = ["MODULE_CALL", "ModuleCalls", "PLAIN", "SLOTS", "call", "graph_refusal", "is_called", "merged_weights",
           "read_calls", "replay_state", "type_name"]
