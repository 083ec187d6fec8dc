"""Is the live module tree still the one the packed forward reproduces?

The packed forward reads parameters straight off the HF modules and calls no ``forward`` of theirs, except in a
projection slot (``attn.Wqkv``, ``attn.Wo``, ``mlp.Wi``, ``mlp.Wo``) holding anything but an ``nn.Linear`` (a peft LoRA
layer, a wrapped, quantised or parametrized Linear): that module is called (:mod:`packed_encoders.model.calls`;
the snapshot's ``calls`` says which, for the plan and the router). Anything that would run in stock HF's forward but
not in the packed one is found here: a module replaced (a container such as ``ModernBertMLP`` replaced by a subclass
with its own ``forward`` or by a wrapper, another module in a LayerNorm or embedding slot, FSDP2 sharding a module
inside the encoder: ``adapters.fsdp``) or deleted, a called module of the wrong width, a ``forward`` set on a module
instance, a hook of any kind (forward, forward-pre, backward, backward-pre; per module or global) on a module the
packed path skips (the rotary embedding included) or calls on its packed rows, layers
reordered or replaced by layers of the other attention type, a changed activation, added or removed layers, attention
projections of another shape (pruned heads), token embedding options the packed lookup does not apply (``max_norm``,
``scale_grad_by_freq``, ``sparse``), and the config values that transformers reads on every call (the sliding window,
the layer types, the attention function). :func:`structure_problem` finds those;
the patched forward then runs the stock forward instead and says so (a one-time warning and ``describe()``);
``packed_forward`` raises; ``pack()`` refuses them (whatever ``validate`` is).
"""

from __future__ import annotations

import functools
import importlib
import operator
import sys
from itertools import count, repeat

from torch import nn
from torch.nn.utils import parametrize, prune
from torch.utils.hooks import RemovableHandle

from ..model.calls import is_called, read_calls, type_name
from ..model.dropout import dropout_modules
from ..model.params import _ACTIVATIONS
from .fsdp import fsdp_problem

# Hooks transformers itself installs, which the packed forward honours by other means: the output-capturing
# hooks (inert unless HF's own forward collects outputs; output_hidden_states is implemented here) and
# enable_input_require_grads' hook on the input embeddings (emulated in model/forward.py).
KNOWN_HOOKS = ("output_capturing_hook", "make_inputs_require_grads")

# projection slots: an nn.Linear's weights are read; any other module there is called (model.calls)
_LINEAR = "linear slot"
_NORM = (nn.LayerNorm,)
# dropout slots: read per call (a call with dropout in force never replays a graph), so a module swapped in there
# leaves captured graphs as they are (see snapshot's ``tree``); nn.Identity is no dropout (HF's own attn.out_drop at
# attention_dropout 0, and what code removing dropout puts in any slot: every reader applies none for it)
_DROPOUT = (nn.Identity, nn.Dropout)
_ACT = "act"


def _child(parent: nn.Module | None, name: str) -> nn.Module | None:
    """``parent``'s submodule ``name`` (from ``_modules``: a wrapper that proxies attributes does not count), or
    ``None`` where ``parent`` is missing or has none."""
    return None if parent is None else parent._modules.get(name)


def _expected(model: nn.Module) -> list[tuple[str, nn.Module | None, object]]:
    """``(path, module, kind)`` for every module whose forward the packed path skips (or calls: the projection slots,
    :data:`_LINEAR`). ``kind``: a tuple of the exact leaf types it reproduces, the name of the HF container class
    whose forward it reproduces, :data:`_ACT` or :data:`_LINEAR`.
    ``module`` is ``None`` where the slot is empty; a container listed before its children, so a wrapper put in
    its place (which holds none of HF's children) is the problem found first."""
    emb = _child(model, "embeddings")
    items = [("embeddings", emb, "ModernBertEmbeddings"),
             ("embeddings.tok_embeddings", _child(emb, "tok_embeddings"), (nn.Embedding,)),
             ("embeddings.norm", _child(emb, "norm"), _NORM), ("embeddings.drop", _child(emb, "drop"), _DROPOUT),
             ("final_norm", _child(model, "final_norm"), _NORM)]
    if "rotary_emb" in model._modules:  # transformers v5: one rotary module for the model
        items.append(("rotary_emb", model.rotary_emb, "ModernBertRotaryEmbedding"))
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        attn, mlp = _child(layer, "attn"), _child(layer, "mlp")
        items += [(p, layer, "ModernBertEncoderLayer"),
                  (f"{p}.attn_norm", _child(layer, "attn_norm"), (nn.Identity, nn.LayerNorm)),
                  (f"{p}.attn", attn, "ModernBertAttention"), (f"{p}.attn.Wqkv", _child(attn, "Wqkv"), _LINEAR),
                  (f"{p}.attn.Wo", _child(attn, "Wo"), _LINEAR),
                  (f"{p}.attn.out_drop", _child(attn, "out_drop"), _DROPOUT),
                  (f"{p}.mlp_norm", _child(layer, "mlp_norm"), _NORM), (f"{p}.mlp", mlp, "ModernBertMLP"),
                  (f"{p}.mlp.Wi", _child(mlp, "Wi"), _LINEAR), (f"{p}.mlp.Wo", _child(mlp, "Wo"), _LINEAR),
                  (f"{p}.mlp.act", _child(mlp, "act"), _ACT), (f"{p}.mlp.drop", _child(mlp, "drop"), _DROPOUT)]
        if attn is not None and "rotary_emb" in attn._modules:  # transformers v4: one per attention module
            items.append((f"{p}.attn.rotary_emb", attn.rotary_emb, "ModernBertRotaryEmbedding"))
    return items


def _hf_module(model: nn.Module):
    """The transformers module defining the model's ModernBERT classes (v4 or v5, whichever is installed)."""
    for cls in type(model).__mro__:
        if cls.__name__ == "ModernBertModel":
            return sys.modules[cls.__module__]
    from transformers.models.modernbert import modeling_modernbert

    return modeling_modernbert


def _activation_types(activation: str) -> tuple[type, ...]:
    """The HF activation module types (``ACT2FN``) computing the GLU's ``activation``."""
    from transformers.activations import ACT2FN

    return tuple({type(ACT2FN[name]) for name, act in _ACTIVATIONS.items() if act == activation})


def _slot_widths(params) -> dict:
    """``{slot suffix: (out_features, in_features)}`` of a layer's projections, from the config."""
    h, i = params.hidden_size, params.intermediate_size
    return {".attn.Wqkv": (3 * h, h), ".attn.Wo": (h, h), ".mlp.Wi": (2 * i, h), ".mlp.Wo": (h, i)}


def _called_problem(path: str, m: nn.Module, params) -> str | None:
    """A module the packed forward calls in a projection slot whose declared widths (``out_features`` /
    ``in_features``, as nn.Linear, peft's layers and quantised Linears carry them) are not the slot's: stock would
    fail on them, or (pruned heads) run fewer heads than the config's. Without them, the forward checks the output
    width of each call (``model.calls.call``)."""
    want = _slot_widths(params)[path[path.find(".", len("layers.")):]]
    got = tuple(vars(m).get(name) for name in ("out_features", "in_features"))
    # each width it declares is checked: one declared alone (the other left out) is the slot's too
    if any(isinstance(n, int) and not isinstance(n, bool) and n != w for n, w in zip(got, want)):
        show = ["?" if not isinstance(n, int) else n for n in got]
        return (f"{path} ({type_name(m)}) maps {show[1]} -> {show[0]} features, not {want[1]} -> {want[0]}: the "
                "packed layer runs the config's widths (attention heads pruned?)")
    return None


def _kind_problem(path: str, m: nn.Module, kind, hf, params) -> str | None:
    if kind is _LINEAR:
        # an nn.Linear's parameters are read; any other module is called on the packed rows (model.calls)
        problem = _called_problem(path, m, params) if is_called(m) else None
        if problem is not None:
            return problem
    elif kind == _ACT:
        want = _activation_types(params.activation)
        if type(m) not in want:
            return (f"{path} is a {type(m).__name__}; the packed GLU applies config.hidden_activation "
                    f"({params.activation}, HF's {' or '.join(sorted(t.__name__ for t in want))})")
    elif isinstance(kind, str):
        stock = getattr(hf, kind, None)
        if stock is not None and (type(m).forward is not stock.forward or type(m).__call__ is not stock.__call__):
            return (f"{path} is a {type(m).__module__}.{type(m).__qualname__}, whose forward is not HF's "
                    f"{kind}.forward: the packed path would skip it")
    elif type(m) not in kind:
        if parametrize.is_parametrized(m):
            return (f"{path} is parametrized (torch.nn.utils.parametrize: its weight is computed at each access), "
                    "which the packed path, reading its parameters directly, would skip: "
                    "parametrize.remove_parametrizations(module, name) makes it a plain parameter, or run the "
                    "model unpacked")
        want = " or ".join(t.__name__ for t in kind)
        return (f"{path} is a {type(m).__module__}.{type(m).__qualname__}, not {want}: the packed path reads its "
                "parameters directly and would skip its forward (merge adapters / undo the wrapping, or run the "
                "model unpacked)")
    # (also on a called module: what it wraps may assume [batch, seq, features] inputs)
    return _instance_forward_problem(path, m, "which the packed path would skip")


def _instance_forward_problem(path: str, m: nn.Module, why: str) -> str | None:
    """An instance ``forward`` on ``m`` (``why``: what the packed path would do to it), or ``None``."""
    if "forward" not in vars(m):
        return None
    if "_hf_hook" in vars(m):  # accelerate moves weights in and out around each submodule's forward
        return (f"{path} has an accelerate hook on its forward (a device_map that offloads or splits the model), "
                f"{why}: load the model on one device")
    return f"{path} has its own instance forward, {why}"


# nn.Embedding options its forward applies and the packed lookup (F.embedding with padding_idx, real tokens only)
# does not: max_norm renormalises the looked-up rows in place, scale_grad_by_freq scales gradients by the batch's id
# counts (padding included), sparse makes a sparse gradient. Their "off" values.
_EMBEDDING_OPTIONS = {"max_norm": None, "scale_grad_by_freq": False, "sparse": False}


def _embedding_problem(path: str, m: nn.Module) -> str | None:
    if not isinstance(m, nn.Embedding):
        return None
    on = [f"{name}={vars(m).get(name)!r}" for name, off in _EMBEDDING_OPTIONS.items() if vars(m).get(name, off) != off]
    if on:
        return (f"{path} has {', '.join(on)}, which the packed embedding lookup does not apply (it reads the weight "
                "at real tokens only)")
    return None


def _attention_shape_problem(path: str, m: nn.Module, params) -> str | None:
    """An attention projection of another shape than the config's (heads pruned: stock HF views ``Wqkv``'s output
    by ``head_dim`` and runs fewer heads; the packed path splits it into ``config.num_attention_heads``)."""
    h = params.hidden_size
    want = {".attn.Wqkv": (3 * h, h), ".attn.Wo": (h, h)}.get(path[path.find(".", len("layers.")):])
    weight = getattr(m, "weight", None)
    if want is None or not isinstance(weight, nn.Parameter) or tuple(weight.shape) == want:
        return None
    return (f"{path}.weight has shape {tuple(weight.shape)}, not {want}: the packed attention runs the config's "
            f"{params.num_attention_heads} heads (attention heads pruned?)")


def _hooks_problem(path: str, m: nn.Module, called: bool = False) -> str | None:
    """Hooks on a module the packed path skips, or calls (``called``): a called module's hooks would fire, but on
    its packed ``[T, features]`` rows rather than stock's ``[batch, seq, features]`` (peft's ``adapter_names``
    pre-hook picks an adapter per batch row), so they run stock too."""
    rows = (" (the packed path calls it on packed [tokens, features] rows, not stock's [batch, seq, features]: a "
            "hook may read the batch layout, as peft's adapter_names= does)")
    if m._backward_hooks or m._backward_pre_hooks:
        return f"{path} has backward hooks" + (rows if called else ", which fire only when its forward runs")
    for hooks in (m._forward_hooks, m._forward_pre_hooks):
        for fn in hooks.values():
            if isinstance(fn, prune.BasePruningMethod):
                return (f"{path} is pruned (torch.nn.utils.prune recomputes its weight in a forward pre-hook), "
                        "which the packed path would skip: prune.remove(module, name) makes the pruning permanent")
            if getattr(fn, "__name__", "") not in KNOWN_HOOKS:
                return f"{path} has forward hooks" + (rows if called else ", which the packed path would skip")
    return None


def _inner_problem(path: str, m: nn.Module) -> str | None:
    """Hooks or an instance ``forward`` (accelerate's hooks) on a module inside a called slot (peft's ``lora_A``,
    ``lora_B``, ``lora_dropout``, ``base_layer``): the slot's forward calls it on the packed rows too."""
    for name, sub in m.named_modules():
        if sub is not m:
            problem = (_instance_forward_problem(f"{path}.{name}", sub, "which the packed path would call on packed "
                                                 "[tokens, features] rows, not stock's [batch, seq, features]")
                       or _hooks_problem(f"{path}.{name}", sub, called=True))
            if problem is not None:
                return problem
    return None


def _layer_facts(model: nn.Module, expected: list) -> tuple[tuple[dict, ...], tuple[str, ...]]:
    """The per-layer attributes stock HF reads on every call to choose a layer's attention (its mask and RoPE):
    ``(instance dicts, attribute names)``, parallel; v5 ``layer.attention_type``, v4 ``attn.local_attention``,
    ``attn.is_causal`` (transformers' sdpa and flash attention read it);
    the token embedding's options (:data:`_EMBEDDING_OPTIONS`), which its forward reads on every call; and every
    LayerNorm's ``eps``, which the eager packed path reads live but a captured CUDA graph holds as a kernel
    argument (a change moves the snapshot's ``tree``, which drops the graphs)."""
    dicts, names = [], []
    tokens = model.embeddings.tok_embeddings
    if isinstance(tokens, nn.Embedding):
        for name in _EMBEDDING_OPTIONS:
            dicts.append(vars(tokens))
            names.append(name)
    for layer in model.layers:
        for owner, name in ((layer, "attention_type"), (layer.attn, "local_attention"), (layer.attn, "is_causal")):
            if name in vars(owner):
                dicts.append(vars(owner))
                names.append(name)
    for _, m, _ in expected:  # _expected(model), which the caller walked already
        if isinstance(m, nn.LayerNorm):
            dicts.append(vars(m))
            names.append("eps")
    return tuple(dicts), tuple(names)


def _layer_type_problem(model: nn.Module, params) -> str | None:
    """A layer whose attention type is not the one the packed model runs at its index (layers reordered, or one
    of the other type put in), or whose attention is made causal."""
    for i, layer in enumerate(model.layers):
        d, attn = vars(layer), vars(layer.attn)
        # (a missing one is not read as True, as transformers' sdpa reads it: transformers 5.0's ModernBERT has
        # none and calls SDPA itself)
        if attn.get("is_causal"):
            return (f"layers.{i}.attn.is_causal is {attn['is_causal']!r}: transformers' sdpa and flash attention then "
                    "mask causally on calls without padding, where the packed attention is bidirectional, as "
                    "ModernBERT is built")
        if "attention_type" in d:
            name, value, is_global = "attention_type", d["attention_type"], d["attention_type"] == "full_attention"
        elif "local_attention" in attn:
            name, value = "attn.local_attention", attn["local_attention"]
            is_global = tuple(value) == (-1, -1)
        else:
            continue
        if is_global != params.layer_is_global[i]:
            kind = "global" if params.layer_is_global[i] else f"local (window {params.window})"
            fix = ("set config.layer_types = [layer.attention_type for layer in model.layers], then pe.pack(model)"
                   if name == "attention_type" else "re-pack a model whose layers match its config")
            return (f"layers.{i}.{name} is {value!r} but the packed model runs layer {i} as {kind} (layers "
                    f"reordered or replaced: {fix})")
    return None


# Numbers the ``tree`` of successive snapshots: a fresh one whenever the modules in their slots or the facts differ.
_TREES = count()


def snapshot(model: nn.Module, params, previous: dict | None = None) -> dict:
    """The module slots the packed forward was set up for, as parallel tuples for a C-level check per call:
    ``children`` (each parent's ``_modules``), ``names`` (the attribute), ``modules``, ``types`` and
    ``module_dicts`` (each module's instance ``__dict__``); and the per-layer attention attributes stock reads
    per call (``fact_dicts``, ``fact_names``, ``facts``); the config and what :func:`config_problem` compares its
    per-call values with (``config``, ``config_dict``, ``layer_types``, ``hf``: the transformers module, whose
    attention registry it reads); ``hook_counter`` (see
    :func:`_no_new_hooks`); ``inner``: what lies inside the called projection slots (:func:`_inner`, ``None``
    without called slots); ``dropout``:
    the dropout-applying modules (:func:`~packed_encoders.model.dropout.dropout_modules`) whose modes and rates the
    router reads per call (kept here: a snapshot is rebuilt whenever a module changes); ``calls``: the projection
    slots whose module the forward calls (:func:`~packed_encoders.model.calls.read_calls`, ``None`` when all are
    ``nn.Linear``), which the plan and the router read per call for the same reason; ``baked``: the modules but
    the dropout slots' and the modules inside called slots; ``tree``: ``previous``'s when the same ``baked``
    modules sit in the same slots with the same
    facts (a rebuild after a hook rescan, or a dropout module swapped), else a new number. The eager path reads
    modules live and needs none of this; a captured CUDA graph holds the modules it was captured with (weights by
    address, ``eps`` as an argument, the layer order), so the graphs' weights fingerprint includes ``tree`` and a
    new one drops them."""
    children, names, modules, baked = [], [], [], []
    expected = _expected(model)
    called = [m for _, m, kind in expected if kind is _LINEAR and is_called(m)]
    inner = _inner(called) if called else None
    for path, m, kind in expected:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        children.append(parent._modules)
        names.append(name)
        modules.append(m)
        if kind is not _DROPOUT:
            baked.append(m)
    fact_dicts, fact_names = _layer_facts(model, expected)
    baked = tuple(baked) + (() if inner is None else inner["modules"])
    facts = tuple(map(dict.get, fact_dicts, fact_names))
    same = (previous is not None and len(previous["baked"]) == len(baked)
            and all(map(operator.is_, previous["baked"], baked)) and previous["facts"] == facts)
    config = model.config
    return {"layers": model.layers, "config": config, "config_dict": _config_dict(config), "hf": _hf_module(model),
            "layer_types": _layer_type_names(params),
            "children": tuple(children), "names": tuple(names), "modules": tuple(modules),
            "types": tuple(map(type, modules)), "module_dicts": tuple(vars(m) for m in modules),
            "fact_dicts": fact_dicts, "fact_names": fact_names, "facts": facts,
            # (hook_counter: taken after a full check found no foreign hook)
            "hook_counter": RemovableHandle.next_id, "dropout": dropout_modules(model), "calls": read_calls(model),
            "inner": inner,
            "baked": baked, "tree": previous["tree"] if same else next(_TREES)}


# read from each module's instance __dict__: a dict lookup, ~2.5x cheaper than getattr on an nn.Module; one
# itemgetter for the four hook dicts (any() of the tuple is True when one is non-empty)
_HOOK_DICTS = operator.itemgetter("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


_MODULES = operator.itemgetter("_modules")


def _inner(called: list) -> dict:
    """What lies inside the called slots ``called`` (modules come and go there with no change to the slot: peft's
    ``add_adapter`` / ``delete_adapter``, a module put into ``lora_A``, ``Sequential.insert``, which registers
    nothing), for :func:`_inner_holds`: the ``_modules`` dict of every module in their subtrees (``holders``) and a
    copy of each (``copies``: a dict compares its entries by identity in C, modules having no ``__eq__``), the
    modules they hold (``modules``), and the instance ``__dict__``s of the modules below the slots (``dicts``)."""
    parents = [p for m in called for p in m.modules()]
    holders = tuple(map(_MODULES, map(vars, parents)))
    copies = tuple(map(dict, holders))
    inside = set(map(id, called))
    return {"holders": holders, "copies": copies, "modules": tuple(c for d in copies for c in d.values()),
            "dicts": tuple(vars(p) for p in parents if id(p) not in inside)}


def _inner_holds(inner: dict | None) -> bool:
    """The called slots' subtrees still hold the modules :func:`_inner` listed, none with an instance ``forward``
    (~0.5 µs per LoRA slot)."""
    return inner is None or (all(map(operator.eq, inner["holders"], inner["copies"]))
                             and not any(map(operator.contains, inner["dicts"], repeat("forward"))))


def _no_new_hooks(snap: dict) -> bool:
    """No module of the snapshot, nor one inside a called slot, has a hook. Every hook registration (module,
    global or tensor hook) creates a ``torch.utils.hooks.RemovableHandle``, whose class counter moves: while it has
    not moved since the last scan found no hook, the scan (the costliest part of the check) is skipped. A scan reads
    the hook dicts live (code may assign a module a new dict and register into it). A hooked module put inside a
    called slot makes no handle: :func:`_inner_holds` sees it come."""
    counter = RemovableHandle.next_id
    if counter == snap["hook_counter"]:
        return True
    inner = snap["inner"]
    if any(map(any, map(_HOOK_DICTS, snap["module_dicts"]))) or (
            inner is not None and any(map(any, map(_HOOK_DICTS, inner["dicts"])))):
        return False  # a hook (perhaps a known one): the slow path decides
    snap["hook_counter"] = counter
    return True


def _snapshot_holds(snap: dict) -> bool:
    """Every slot still holds its module, of its type, with no instance ``forward``, no hook of any kind, the
    called slots' insides as listed, and the layers' attention attributes unchanged (``map`` runs the loops in C)."""
    modules, dicts = snap["modules"], snap["module_dicts"]
    return (all(map(operator.is_, map(dict.get, snap["children"], snap["names"]), modules))
            and all(map(operator.is_, map(type, modules), snap["types"]))
            and not any(map(operator.contains, dicts, repeat("forward")))
            and tuple(map(dict.get, snap["fact_dicts"], snap["fact_names"])) == snap["facts"]
            and _inner_holds(snap["inner"]) and _no_new_hooks(snap))


# transformers' config classes override __getattribute__ (attribute_map, per-layer attributes): one attribute read
# costs ~3 µs (transformers 5.24), so the per-call check reads the values below from the config's instance __dict__,
# which the snapshot keeps when it holds them as getattr gives them
_PER_CALL_CONFIG = ("local_attention", "layer_types")
_ABSENT = object()


def _config_dict(config) -> dict | None:
    """``config``'s instance ``__dict__`` when it holds :data:`_PER_CALL_CONFIG` as ``getattr`` reads them (plain
    attributes: no property or ``attribute_map`` entry in the way), else ``None``."""
    d = getattr(config, "__dict__", None)
    if not isinstance(d, dict):
        return None
    same = all(d.get(name, _ABSENT) is getattr(config, name, _ABSENT) for name in _PER_CALL_CONFIG)
    return d if same else None


def _layer_type_names(params) -> list[str]:
    """``config.layer_types`` as the packed model runs it (v5 names; the packed params accept no others)."""
    return ["full_attention" if is_global else "sliding_attention" for is_global in params.layer_is_global]


@functools.cache
def _own_attention(hf) -> frozenset:
    """transformers' own attention functions, which compute softmax attention over each layer's window as the packed
    attention does: sdpa, flash attention (2, 3, 4 and the hub's flash kernels, registered through it), flex
    attention and the model's eager one (read once per transformers module)."""
    fns = [getattr(hf, "eager_attention_forward", None)]
    for module, name in (("sdpa_attention", "sdpa_attention_forward"), ("flash_attention", "flash_attention_forward"),
                         ("flex_attention", "flex_attention_forward")):
        try:
            fns.append(getattr(importlib.import_module(f"transformers.integrations.{module}"), name, None))
        except ImportError:
            pass
    return frozenset(fn for fn in fns if fn is not None)


@functools.cache
def _mask_registry() -> tuple:
    """``(transformers' AttentionMaskInterface registry, its own mask functions)``; ``(None, frozenset())``
    without one."""
    try:
        from transformers import masking_utils as mu
    except ImportError:
        return None, frozenset()
    own = (getattr(mu, n, None) for n in ("sdpa_mask", "eager_mask", "flash_attention_mask", "flex_attention_mask"))
    return getattr(mu, "ALL_MASK_ATTENTION_FUNCTIONS", None), frozenset(f for f in own if f)


def _function_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"


def _mask_problem(implementation) -> str | None:
    """Why the masks stock builds for ``implementation`` are not the packed attention's (padding and each layer's
    window), or ``None``. transformers 5 builds them per call through ``masking_utils.ALL_MASK_ATTENTION_FUNCTIONS``:
    a name absent from its global mapping (``None``, a ``paged|`` name, a name registered for attention alone) gets
    no mask at all (stock attends to padding and past the window), and a mask function registered in it (under
    ``sdpa`` itself too) is what stock runs. Read as two dict lookups per call."""
    masks, own = _mask_registry()
    if masks is None:
        return None
    local, glob = masks._local_mapping, masks._global_mapping
    if implementation not in glob:
        return (f"config._attn_implementation is {implementation!r}, for which stock builds no attention mask "
                "(it is not in transformers' AttentionMaskInterface): stock attends to padding and past each layer's "
                "window, which the packed forward does not: model.set_attn_implementation('sdpa'), then "
                "pe.pack(model)")
    fn = local[implementation] if implementation in local else glob[implementation]
    if fn in own:
        return None
    return (f"config._attn_implementation is {implementation!r}, whose attention mask stock builds with a registered "
            f"mask function ({_function_name(fn)}) that the packed forward does not run (transformers' "
            "AttentionMaskInterface): register transformers' own back, then pe.pack(model)")


# transformers 4's ModernBERT module defines its table's functions itself
_V4_OWN = ("eager_attention_forward", "sdpa_attention_forward", "flash_attention_forward")


def attention_problem(hf, implementation) -> str | None:
    """Why the attention stock's layers call for ``config._attn_implementation`` (``implementation``) is not the
    packed attention, or ``None``. transformers 5 resolves the name on every call in its ``AttentionInterface``
    registry (``hf.ALL_ATTENTION_FUNCTIONS``), where anyone may register a function of their own (a block-sparse
    hub kernel, a user's attention); transformers 4's ModernBERT has a fixed table and fails on other names."""
    registry = getattr(hf, "ALL_ATTENTION_FUNCTIONS", None)
    if registry is None:
        table = getattr(hf, "MODERNBERT_ATTENTION_FUNCTION", None)
        if table is None or implementation is None:
            return None
        if implementation not in table:
            return (f"config._attn_implementation is {implementation!r}, which transformers' ModernBERT does not "
                    f"have ({', '.join(map(repr, table))}): its next call fails in stock")
        fn = table[implementation]
        if any(fn is getattr(hf, own, None) for own in _V4_OWN):
            return None
        return (f"config._attn_implementation is {implementation!r}, whose entry in transformers' ModernBERT table "
                f"is another function ({_function_name(fn)}) that the packed forward does not run: put the module's "
                "own back, then pe.pack(model)")
    name = implementation if implementation in (None, "paged|eager") else implementation.removeprefix("paged|")
    try:
        fn = registry[name]
    except KeyError:
        if name is None or name == "eager":  # (stock's default: the model's eager attention)
            return _mask_problem(implementation)
        return (f"config._attn_implementation is {implementation!r}, which is not a registered attention function "
                "(transformers' AttentionInterface): its next call fails in stock")
    if fn in _own_attention(hf):
        return _mask_problem(implementation)
    return (f"config._attn_implementation is {implementation!r}, a registered attention function "
            f"({_function_name(fn)}) that the packed forward does not run (it computes softmax attention over each "
            "layer's window, as transformers' sdpa, flash, flex and eager attention do): "
            "model.set_attn_implementation('sdpa'), then pe.pack(model)")


def config_problem(model: nn.Module, params, snap: dict | None = None) -> str | None:
    """A config change after ``pack`` that stock HF honours on its next call but the packed state does not.

    transformers reads three config values on every call: ``config.sliding_window`` (``= local_attention // 2``),
    from which it builds the sliding-window mask, (v5) ``config.layer_types``, whose set of types picks the
    rotary tables it computes (a layer keeps the ``attention_type`` it was built with; stock fails on a type no
    longer listed), and ``config._attn_implementation``, the attention function (:func:`attention_problem`). RoPE,
    norms, activation and dropout are read into modules when the model is built (the packed forward reads those
    modules live). The packed window, layer kinds, attention plan and any captured graph come from
    :class:`ModernBertParams` read at ``pack()``. With a ``snap`` of this config (:func:`snapshot`) the check is a
    few dict reads and one list comparison.
    """
    config = model.config
    if snap is not None and snap["config"] is config and snap["config_dict"] is not None:
        d, expected = snap["config_dict"], snap["layer_types"]
        local, types = d.get("local_attention"), d.get("layer_types")
        if (local is None or local == params.local_attention) and (types is None or types == expected):
            # (the property's value as stored; None or absent: the property, which some releases map to "eager")
            implementation = d.get("_attn_implementation_internal")
            if implementation is None:
                implementation = getattr(config, "_attn_implementation", None)
            return attention_problem(snap["hf"], implementation)
    else:
        local, types = getattr(config, "local_attention", None), getattr(config, "layer_types", None)
        expected = _layer_type_names(params)
    if local is not None and local != params.local_attention:
        return (f"config.local_attention is {local} (sliding_window {local // 2}) but the model was packed with "
                f"{params.local_attention} (sliding_window {params.local_attention // 2}); pe.pack(model) again "
                "packs the new window")
    if types is None or list(types) == expected:  # (the same types in another sequence type)
        return attention_problem(_hf_module(model), getattr(config, "_attn_implementation", None))
    types = list(types)
    if len(types) != len(expected):
        what = f" has {len(types)} entries but the model was packed with {len(expected)}"
    else:
        i = next(i for i, (now, then) in enumerate(zip(types, expected)) if now != then)
        what = f"[{i}] is {types[i]!r} but the model was packed with {expected[i]!r} there"
    return (f"config.layer_types{what} (transformers reads the list on every call: the rotary tables of the types "
            "it lists, while each layer runs the attention_type it was built with); set it back, or give the layers "
            "matching attention types and pe.pack(model) again")


def _global_hooks_problem() -> str | None:
    g = nn.modules.module
    if g._global_forward_hooks or g._global_forward_pre_hooks:
        return "global module forward hooks are registered (the packed path calls no submodule forward)"
    if g._global_backward_hooks or g._global_backward_pre_hooks:
        return "global module backward hooks are registered (they fire only when a submodule's forward runs)"
    return None


def _layer_count_problem(model: nn.Module, params) -> str:
    """Layers pruned or added after the config was written, with what makes the model packable again (the packed
    parameters come from the config; stock reads the layers and, per call, ``config.layer_types``)."""
    n = len(model.layers)
    types = (" and config.layer_types = [layer.attention_type for layer in model.layers]"
             if getattr(model.config, "layer_types", None) is not None else "")
    return (f"model.layers has {n} layers but the packed parameters, read from config.num_hidden_layers, have "
            f"{params.num_hidden_layers} (layers pruned or added): set config.num_hidden_layers = {n}{types}, "
            "then pe.pack(model)")


def structure_problem(model: nn.Module, params, snap: dict | None) -> tuple[str | None, bool]:
    """``(problem, unchanged)``: ``problem`` is ``None`` when the packed forward reproduces ``model``, else what it
    would skip; ``unchanged`` says ``snap`` still describes the module tree (so it can be kept).

    With a current ``snapshot`` this is a few identity, type and dict checks per module run in C (tens of
    microseconds for ModernBERT-base), cheap enough for every call."""
    problem = _global_hooks_problem() or config_problem(model, params, snap)
    if problem is not None:
        return problem, False
    if len(model.layers) != params.num_hidden_layers:
        return _layer_count_problem(model, params), False
    if (snap is not None and snap["layers"] is model.layers and snap["config"] is model.config
            and _snapshot_holds(snap)):
        return None, True
    # something changed (or no snapshot yet): find and name the problem; FSDP2 before the hooks, which would name
    # fully_shard's hooks without saying why
    problem = fsdp_problem(model)
    if problem is not None:
        return problem, False
    hf = _hf_module(model)
    for path, m, kind in _expected(model):
        if m is None:
            return f"{path} is missing (stock HF's forward reads it; the packed path reads its parameters)", False
        called = kind is _LINEAR and is_called(m)
        problem = (_kind_problem(path, m, kind, hf, params) or _embedding_problem(path, m)
                   or (None if called else _attention_shape_problem(path, m, params))
                   or _hooks_problem(path, m, called) or (_inner_problem(path, m) if called else None))
        if problem is not None:
            return problem, False
    return _layer_type_problem(model, params), False


def structure_check(model: nn.Module, state) -> str | None:
    """What the packed forward would skip in the live module tree of a packed (or about to be packed) encoder,
    or ``None``; the snapshot in ``state.runtime`` is refreshed when the tree changed harmlessly (e.g. an
    ``nn.Linear`` replaced by another: its weights are read live; a LoRA layer put in or taken out: it is called)."""
    snap = state.runtime.get("structure")
    problem, unchanged = structure_problem(model, state.params, snap)
    if problem is None and not unchanged:
        state.runtime["structure"] = snapshot(model, state.params, snap)
    return problem
