"""Is the live module tree still the one the packed forward reproduces?

The packed forward reads parameters straight off the HF modules and never calls their ``forward``. A module
replaced after ``pack`` (a LoRA wrapper, a quantised Linear, a custom subclass), a forward hook, a changed
activation, or added/removed layers would be skipped silently, and so would a config value that transformers reads
on every call (the sliding window). :func:`structure_problem` finds those; the patched forward then runs the stock
forward instead and says so (a one-time warning and ``describe()``); ``packed_forward`` raises.
"""

from __future__ import annotations

import operator

from torch import nn

from .fsdp import fsdp_problem

# Hooks transformers itself installs, which the packed forward honours by other means: the output-capturing
# hooks (inert unless HF's own forward collects outputs; output_hidden_states is implemented here) and
# enable_input_require_grads' hook on the input embeddings (emulated in model/forward.py).
KNOWN_HOOKS = ("output_capturing_hook", "make_inputs_require_grads")


def _foreign_hooks(m: nn.Module) -> bool:
    for hooks in (m._forward_hooks, m._forward_pre_hooks):
        for fn in hooks.values():
            if getattr(fn, "__name__", "") not in KNOWN_HOOKS:
                return True
    return False


_LINEAR = (nn.Linear,)
_NORM = (nn.LayerNorm,)


def _expected(model: nn.Module) -> list[tuple[str, nn.Module, tuple | None]]:
    emb = model.embeddings
    items = [("embeddings", emb, None), ("embeddings.tok_embeddings", emb.tok_embeddings, (nn.Embedding,)),
             ("embeddings.norm", emb.norm, _NORM), ("embeddings.drop", emb.drop, (nn.Dropout,)),
             ("final_norm", model.final_norm, _NORM)]
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        items += [(p, layer, None), (f"{p}.attn_norm", layer.attn_norm, (nn.Identity, nn.LayerNorm)),
                  (f"{p}.attn", layer.attn, None), (f"{p}.attn.Wqkv", layer.attn.Wqkv, _LINEAR),
                  (f"{p}.attn.Wo", layer.attn.Wo, _LINEAR),
                  (f"{p}.attn.out_drop", layer.attn.out_drop, (nn.Identity, nn.Dropout)),
                  (f"{p}.mlp_norm", layer.mlp_norm, _NORM), (f"{p}.mlp", layer.mlp, None),
                  (f"{p}.mlp.Wi", layer.mlp.Wi, _LINEAR), (f"{p}.mlp.Wo", layer.mlp.Wo, _LINEAR),
                  (f"{p}.mlp.act", layer.mlp.act, None), (f"{p}.mlp.drop", layer.mlp.drop, (nn.Dropout,))]
    return items


def snapshot(model: nn.Module) -> dict:
    """The module slots the packed forward was set up for, as parallel tuples for a C-level check per call:
    ``children`` (each parent's ``_modules``), ``names`` (the attribute), ``modules`` and ``module_dicts`` (each
    module's instance ``__dict__``); and the activation module types (a swapped activation would be skipped:
    the GLU applies the config's)."""
    children, names, modules = [], [], []
    for path, m, _ in _expected(model):
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        children.append(parent._modules)
        names.append(name)
        modules.append(m)
    return {"layers": model.layers, "acts": [type(layer.mlp.act) for layer in model.layers],
            "children": tuple(children), "names": tuple(names), "modules": tuple(modules),
            "module_dicts": tuple(vars(m) for m in modules)}


# read from each module's instance __dict__: a dict lookup, ~2.5x cheaper than getattr on an nn.Module
_FORWARD_HOOKS = operator.itemgetter("_forward_hooks")
_FORWARD_PRE_HOOKS = operator.itemgetter("_forward_pre_hooks")


def _snapshot_holds(snap: dict) -> bool:
    """Every slot still holds its module and no module has a forward hook (~50 us for ModernBERT-base on a
    2-core CI host: ``map`` runs the loops in C). The hook dicts are read live (code may assign a module a new
    dict and register into it)."""
    if not all(map(operator.is_, map(dict.get, snap["children"], snap["names"]), snap["modules"])):
        return False
    dicts = snap["module_dicts"]
    # a hook (perhaps a known one): the slow path decides
    return not (any(map(len, map(_FORWARD_HOOKS, dicts))) or any(map(len, map(_FORWARD_PRE_HOOKS, dicts))))


def config_problem(model: nn.Module, params) -> str | None:
    """A config change after ``pack`` that stock HF honours on its next call but the packed state does not.

    Only the local attention window qualifies: transformers builds the sliding-window mask from
    ``config.sliding_window`` (``= local_attention // 2``) on every call, while the layer types, RoPE, norms,
    activation and dropout are read into modules when the model is built. The packed window, the attention
    plan and any captured graph come from :class:`ModernBertParams` read at ``pack()``.
    """
    local = getattr(model.config, "local_attention", None)
    if local is None or local == params.local_attention:
        return None
    return (f"config.local_attention is {local} (sliding_window {local // 2}) but the model was packed with "
            f"{params.local_attention} (sliding_window {params.local_attention // 2}); pe.unpack(model) then "
            "pe.pack(model) packs the new window")


def structure_problem(model: nn.Module, params, snap: dict | None) -> tuple[str | None, bool]:
    """``(problem, unchanged)``: ``problem`` is ``None`` when the packed forward reproduces ``model``, else what it
    would skip; ``unchanged`` says ``snap`` still describes the module tree (so it can be kept).

    With a current ``snapshot`` this is one identity and two dict checks per module (tens of microseconds for
    ModernBERT-base), cheap enough for every call."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return "global module forward hooks are registered (the packed path calls no submodule forward)", False
    problem = config_problem(model, params)
    if problem is not None:
        return problem, False
    if len(model.layers) != params.num_hidden_layers:
        return (f"model.layers has {len(model.layers)} layers but the packed config has {params.num_hidden_layers} "
                "(re-pack after pruning or adding layers)"), False
    if snap is not None and snap["layers"] is model.layers:
        if _snapshot_holds(snap):
            return None, True
        for children, name, then in zip(snap["children"], snap["names"], snap["modules"]):
            if children.get(name) is not then or ((then._forward_hooks or then._forward_pre_hooks)
                                                  and _foreign_hooks(then)):
                break  # rare: find and name the problem on the slow path below
        else:
            return None, True
    problem = fsdp_problem(model)  # before the hook check, which would name FSDP's hooks without saying why
    if problem is not None:
        return problem, False
    for path, m, types in _expected(model):
        if types is not None and type(m) not in types:
            return _describe_swap(path, m, types), False
        if _foreign_hooks(m):
            return f"{path} has forward hooks, which the packed path would skip", False
    if snap is not None:
        for i, (layer, act) in enumerate(zip(model.layers, snap["acts"])):
            if type(layer.mlp.act) is not act:
                return (f"layers.{i}.mlp.act was replaced by {type(layer.mlp.act).__name__}; the packed GLU applies "
                        f"config.hidden_activation ({params.activation})"), False
    return None, False


def _describe_swap(path: str, module: nn.Module, types) -> str:
    if types is not None and type(module) not in types:
        want = " or ".join(t.__name__ for t in types)
        return (f"{path} is a {type(module).__module__}.{type(module).__qualname__}, not {want}: the packed path "
                "reads its parameters directly and would skip its forward (merge adapters / undo the wrapping, or "
                "pe.unpack the model)")
    return f"{path} was replaced after pe.pack (re-pack to check the new module)"


def check_at_pack(model: nn.Module, params) -> str | None:
    """Structure problems that make ``pack()`` refuse (types and hooks; no snapshot yet)."""
    return structure_problem(model, params, None)[0]




def structure_check(model: nn.Module, state) -> str | None:
    """What the packed forward would skip in the live module tree of a packed (or about to be packed) encoder,
    or ``None``; the snapshot in ``state.runtime`` is refreshed when the tree changed harmlessly (e.g. an
    ``nn.Linear`` replaced by another: its weights are read live)."""
    snap = state.runtime.get("structure")
    problem, unchanged = structure_problem(model, state.params, snap)
    if problem is None and not unchanged:
        state.runtime["structure"] = snapshot(model) if snap is None else {**snapshot(model), "acts": snap["acts"]}
    return problem
