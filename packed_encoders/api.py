"""Public entry points: pack / unpack / is_packed / describe / packed_forward."""

from __future__ import annotations

import functools
import warnings
from dataclasses import replace

import torch
from torch import nn

from .adapters import around, token_labels
from .adapters.dynamo import outside_dynamo
from .adapters.fsdp import gathered, sharded
from .adapters.late_interaction import ALWAYS
from .adapters.locate import find_encoders
from .adapters.patch import install, own_state, replaced_forward, restore
from .adapters.state import PackOptions, forward_bypassed, get_state, wider
from .adapters.stock_calls import deterministic_reason
from .adapters.structure import snapshot, structure_check, structure_problem
from .batch import check_embeds_dtype, from_packed
from .call import empty_output, packed_route, raise_earlier_errors, serve_batch
from .configure import device_of, make_state, params_of, read_around
from .controls import warn_graphs_idle
from .errors import PackedEncodersError, UnsupportedTargetError, ValidationError
from .graph_check import check_graph_path
from .graphs.config import normalize as normalize_graph_option
from .graphs.route import describe_graphs, precapture_encoders
from .model.calls import read_calls
from .model.params import ModernBertParams
from .model.pointers import off_reason as pointers_off
from .ops.triton import set_fast_launch
from .tuning import read_tuning, same_switches
from .validation import ValidationReport, check_encoder


def pack(target, *, attention_backend: str = "auto", kernels: str = "auto", validate: bool = True,
         padded_outputs="auto", validation_lengths=None, cuda_graph=None):
    """Replace the forward of every ModernBertModel inside ``target`` (on the instance) with the packed one.

    ``target`` may be a ``ModernBertModel``, any ``ModernBertFor*`` head, a SentenceTransformer, a PyLate
    ColBERT, or any ``nn.Module`` holding them. Weights are not copied. The environment switches
    (``PACKED_ENCODERS_*``) are read here, once, into the encoder's frozen tuning (``describe()["encoders"][i]
    ["tuning"]``). Calling ``pack`` again with the same options and switches keeps the encoder's state (its graphs
    and validation; ``validate=False`` keeps an earlier validation, and ``validation_lengths``, or weights moved to
    another dtype or device since the check, validate it again); with other options (or changed switches) it
    reconfigures to exactly those (unset ones take their defaults: ``pack(model)`` after ``pack(model,
    cuda_graph=GraphConfig(...))`` returns to the automatic graphs; use :func:`~packed_encoders.set_cuda_graph` to
    change graphs alone). Either way, with any
    ``padded_outputs`` but ``"zeros"``, what the heads and wrappers inside ``target`` read at padded positions (see
    ``padded_outputs``) is applied to each encoder inside them and kept for it: ``pe.pack(head.model, ...)``
    later (with other options, or after ``pe.unpack(head.model)``) still honours the head, until
    ``pe.unpack(head)`` or ``pe.pack(head, padded_outputs="zeros")`` (:mod:`packed_encoders.adapters.around`).

    Args:
        attention_backend: ``"auto"`` (policy per batch), ``"flash"`` (torch varlen_attn / FlashAttention-4),
            ``"sdpa"``, or a concrete ``"varlen"``, ``"fa4"``, ``"triton"``.
        kernels: ``"auto"``, ``"torch"``, ``"triton"`` or ``"cute"`` (see :mod:`packed_encoders.ops.select`).
            ``"cute"`` runs quack's LayerNorm on the checked path only: forwards without gradient that the op set
            covers (eager and graph captures) and training blocks use the Triton LayerNorm, whose launch costs
            less host time; ``describe()["encoders"][i]["kernel_substitutions"]`` says so.
        validate: run :func:`packed_encoders.validate` on the selected path first.
        padded_outputs: what the output holds at padded positions. ``"zeros"``; ``"all"``: trailing masked
            positions (after each row's last real token) get HF's values, computed as query-only tokens;
            an int ``N``: the same for calls of padded width ``<= N``; ``"auto"``: ``"zeros"``, ``"all"`` for
            question-answering heads (their loss reads padded positions; a loss call with padding before real
            tokens runs the stock forward), or the query length of a ColBERT target
            using masked query expansion (PyLate, sentence-transformers v6); and a token-classification or
            masked-LM head called with ``labels`` that count at padded positions (not -100) gets stock's values
            there: trailing ones computed, other padding by the stock forward for that call
            (:mod:`packed_encoders.adapters.token_labels`). ``"all"`` and an int do what ``"auto"`` does and
            compute their trailing positions besides; only ``"zeros"`` leaves every padded position at zero,
            whatever reads it.
        validation_lengths: override the validation batch's lengths (given for an already packed encoder, with
            ``validate=True``: it is validated again, on a new state; with ``validate=False`` they are unused,
            warned).
        cuda_graph: ``None`` (default, automatic): ``GraphConfig()`` bounds (sequences up to 2,048 tokens, calls
            up to 32k tokens), graphs captured lazily on first use of a bucket and kept within a memory budget
            (LRU; ``PACKED_ENCODERS_GRAPH_MEMORY``, default 0.1 of the free GPU memory at pack), silently eager
            on a model that is not on CUDA, and the graph path checked per capture rather than at pack.
            ``True`` or a :class:`~packed_encoders.GraphConfig`: the same, requested explicitly (the graph path
            is validated here, and a model not on CUDA is warned about). ``False``: off. Inference calls (no
            grad, any autocast state) within the bounds replay captured CUDA graphs; everything else runs
            eagerly, the reason counted in ``describe()`` (see :mod:`packed_encoders.graphs`).
            ``GraphConfig.precapture`` buckets are captured here when the model is on CUDA.

    Returns:
        ``target`` itself.

    Raises:
        UnsupportedTargetError: no ModernBERT encoder inside ``target``, a config the path cannot run, or a module
            the packed forward would skip (hooks, wrapped or swapped submodules, pruned heads, ...).
        PackedEncodersError: an unknown option value, a named ``attention_backend`` that cannot run on the model's
            device, or an environment switch that cannot be read (:mod:`packed_encoders.tuning`).
        ValidationError: the selected path disagrees with stock HF; the model is left as it was.
    """
    if not isinstance(validate, bool):
        raise PackedEncodersError(f"validate={validate!r} must be True or False")
    options = PackOptions(attention_backend=attention_backend, kernels=kernels, validate=validate,
                          padded_outputs=padded_outputs, cuda_graph=normalize_graph_option(cuda_graph),
                          graph_auto=cuda_graph is None)
    if validation_lengths is not None and not validate:
        warnings.warn("pack(validation_lengths=...) has no effect with validate=False (nothing is validated)",
                      RuntimeWarning, stacklevel=2)
    encoders = find_encoders(target)
    planned, kept = [], []
    for path, model in encoders:
        # first: what follows reads the module tree (the weights' device), which a wrapper in a slot may not hold
        params = params_of(model)
        problem, _ = structure_problem(model, params, None)
        if problem is not None:
            raise UnsupportedTargetError(f"cannot pack {path or type(model).__name__}: {problem}")
        current = own_state(model)  # (a shallow copy's is its original's: a new state for the copy)
        tuning = read_tuning(device_of(model))
        # the same options, switches and config: the state is kept (its graphs and validation), and only what the
        # target's heads and wrappers read is applied below (a config edited since, e.g. a new local_attention,
        # makes a new state; the packed path otherwise runs stock for the unexpected geometry); lengths to
        # validate on: validated again, with a new state
        # a validation in another dtype or device than the weights' now does not cover the kernels they run
        stale = (validate and current is not None
                 and _validated(current.report, model.embeddings.tok_embeddings.weight) is None)
        # ``validate`` chooses a check, not the path: ``validate=False`` keeps an earlier validation and graphs
        if (current is not None and current.options == replace(options, validate=current.options.validate)
                and same_switches(current.tuning, tuning)
                and current.params == params and not (validate and validation_lengths is not None)
                and not stale):
            kept.append((model, current))
            continue
        state = make_state(model, options, target, tuning)  # with what the heads and wrappers around it read
        # the snapshot taken now, so graphs precaptured at pack() carry the module tree the first call checks
        state.runtime["structure"] = snapshot(model, state.params)
        if validate and model.embeddings.tok_embeddings.weight.is_meta:
            raise PackedEncodersError(f"cannot validate {path or type(model).__name__}: its weights are on the meta "
                                      "device (no values to compare); load them first, or pack with validate=False")
        if validate:
            with gathered(target, path, model):
                report = check_encoder(model, state, path, validation_lengths)
                if report.passed and options.graph_auto and options.cuda_graph is not None:
                    report.checks.append("cuda_graph: automatic, captured lazily; each capture is checked "
                                         "against its eager warm-up")
                elif report.passed:
                    check_graph_path(model, state, report)  # captures the check batch's bucket on CUDA
            state.report = report
            if not report.passed:
                result = ValidationReport([report])
                kernels = _hub_kernels(model)
                hub = ("" if not kernels else "\nstock ran transformers hub kernels the packed path replaces: "
                       + "; ".join(kernels))
                # neutral wording: the summary says whether the packed path or the model itself is at fault
                raise ValidationError("pack(): validation against stock Hugging Face failed; the model is "
                                      "unchanged:\n" + result.summary() + hub, result)
        planned.append((model, state))
    for model, state in planned:
        previous = replaced_forward(model)
        if previous is not None:
            warnings.warn(f"packed_encoders: {type(model).__name__}.forward is set on the instance "
                          f"({_callable_name(previous)}); "
                          "the packed forward replaces it while the model is packed, so it does not run "
                          "(pe.unpack restores it); a wrapper set after pack() calls the packed forward",
                          RuntimeWarning, stacklevel=2)
        install(model, state)
    for model, state in kept:
        if forward_bypassed(model):  # the class forward set back on the instance since: the packed one again
            install(model, state)
        read_around(model, state, target)
        # process-wide: the last pack() sets it, a kept state included (make_state sets it for a new one)
        set_fast_launch(state.tuning.triton_fast_launch)
    packed = [model for _, model in encoders]
    # made before any trace, as install() makes the patched forward's: made inside a fullgraph trace it would fail
    # with dynamo's own error instead of this reason
    outside_dynamo(packed_forward, _PACKED_FORWARD_UNTRACEABLE)
    if options.padded_outputs != "zeros":
        around.remember(target, packed)
    else:
        around.forget(target, packed)
    around.mark_readers(packed)
    token_labels.sync(_heads(target, packed))
    warn_graphs_idle(planned, "pack(cuda_graph=...)")
    precapture_encoders(planned)
    return target


def unpack(target):
    """Restore the stock forward of every packed ModernBertModel inside ``target``; returns ``target``.

    Afterwards no instance attribute set by ``pack`` remains and ``type(model).forward`` runs again, on the
    encoders, on the heads inside ``target`` and on the heads around them left holding no packed encoder (their
    label check comes off; packing the encoder again puts it back). What the heads and wrappers inside ``target``
    read is forgotten; those around it are still honoured when the encoder is packed again.

    Raises:
        UnsupportedTargetError: no ModernBERT encoder inside ``target``.
    """
    encoders = [model for _, model in find_encoders(target)]
    heads = _heads(target, encoders)
    for model in encoders:
        restore(model)
    around.forget(target)
    # a head holding one of them since pack(head) replaced its encoder: found in no record of theirs
    heads += [h for h in around.replaced_reads(encoders) if all(h is not known for known in heads)]
    around.mark_readers(encoders, target)  # as do the marks of readers left reading no packed encoder
    token_labels.sync(heads)  # the checks of heads left holding no packed encoder come off too
    return target


def _heads(target, encoders) -> list:
    """The token heads inside ``target`` and those recorded around ``encoders``, each once."""
    heads = {id(h): h for h in token_labels.token_heads(target)}
    heads.update((id(h), h) for h in around.checked_heads(encoders))
    return list(heads.values())


def is_packed(target) -> bool:
    """True when every ModernBERT encoder inside ``target`` is packed and its calls run the packed forward. False
    also for a packed encoder whose calls run stock HF: the class forward set on the instance since ``pack()``
    (accelerate's ``remove_hook_from_module`` for a hook added before it: ``pack()`` again re-installs it), or
    something in its live module tree that the packed forward would skip (a hook, a container or norm replaced by
    a module with its own forward: ``describe()`` names it under ``runs_stock``; undoing the change makes it True
    again). A projection slot holding a module the packed forward calls (a peft LoRA layer, a wrapped Linear) is
    packed: ``describe()`` lists it under ``module_calls``.

    Raises:
        UnsupportedTargetError: no ModernBERT encoder inside ``target`` (nothing to be packed or not).
    """
    return all(_runs_packed(m) for _, m in find_encoders(target))


def _runs_packed(model: nn.Module) -> bool:
    state = get_state(model)
    return state is not None and not forward_bypassed(model) and structure_check(model, state) is None


def _validated(report, weight: torch.Tensor) -> bool | None:
    # a check in fp32 says nothing of the bf16 kernels a later .to(torch.bfloat16) runs
    if report is None or report.dtype != str(weight.dtype).replace("torch.", "") or report.device != str(weight.device):
        return None
    return report.passed


def describe(target) -> dict:
    """What is active for each encoder: backend requested and last chosen, kernels, device, validation.

    Returns ``{"encoders": [ {...}, ... ]}``, one JSON-serialisable dict per ModernBERT encoder, with ``path``,
    ``packed`` (as :func:`is_packed`: ``False`` too, with ``bypassed`` saying why, when the class forward was set on
    the instance after ``pack()``, or with ``runs_stock`` naming what in the module tree the packed forward would
    skip, so that calls run stock HF), ``device``, ``dtype`` (on CUDA also ``gpu``, the device name, and
    ``capability``, e.g. ``"sm_90"``) and, once packed: ``attention_backend`` (as requested), ``last_attention`` (the
    last call's backend per layer kind: ``"global"`` and ``"window N"``, ``N`` the half window, keys within
    ``|i - j| <= N``), ``attention_fallbacks``, ``stock_forward_calls`` (calls that ran the stock forward, by
    reason), ``unpad_syncs_skipped`` (calls with gradients that reused an earlier call's lengths instead of
    syncing: ``batch.LengthsMemo``), ``restarting_position_ids_calls`` (calls of batch 1 without a mask read as
    several sequences from their restarting ``position_ids``), ``attention_policy``, ``kernels`` /
    ``kernels_reason``, ``gemm``, ``kernel_fallbacks``, ``kernel_substitutions``, ``eager_plan`` (what the last
    eager call's plan decided: ``direct``, ``why_checked``, ``glu``, ``linear``, ``pointers``, ``pointers_off``,
    ``blocks``, ``stack``, ``stack_off``, ``stack_pointers``, ``stack_pointers_off``, ``dropout``; see
    :func:`_plan_facts`), ``cuda_graph``,
    ``tuning`` (the switches read at ``pack()``), ``padded_outputs``, ``read_around`` (what heads around the
    encoder read besides trailing positions: ``position_zero``, a ``classifier_pooling="cls"`` head's
    ``"column 0"`` / ``"first real token"`` or ``None``, and ``label_checks``, the classes of the heads whose calls'
    labels are checked), ``hub_kernels`` (transformers hub kernels bound to the encoder, e.g. by
    ``use_kernels=True``, which the packed forward does not call: it runs its own), ``module_calls`` (the projection
    slots whose module the packed forward calls, e.g. peft LoRA layers, as ``"layers.<i>.<slot> (<module type>)"``;
    without gradients LoRA layers run on merged weights (``eager_plan["merged_lora_slots"]``), the others are called
    on the per-op checked path; CUDA graphs replay peft's LoRA layers only: ``cuda_graph["idle_reason"]`` says why
    not others), ``validated`` (``True`` / ``False``: what ``pack()``'s check against stock found; ``None``: not
    validated, or for another dtype or device than the encoder's now) and ``validated_as`` (the dtype and device it
    was checked in).

    Raises:
        UnsupportedTargetError: no ModernBERT encoder inside ``target``.
    """
    out = []
    for path, model in find_encoders(target):
        try:
            weight = model.embeddings.tok_embeddings.weight
        except AttributeError:  # a wrapper put in its slot since pack(): calls run stock, and this says why
            weight = next(model.parameters())
        state = get_state(model)
        entry = {"path": path, "packed": state is not None, "device": str(weight.device),
                 "dtype": str(weight.dtype).replace("torch.", "")}
        if state is not None and forward_bypassed(model):
            entry["packed"] = False
            entry["bypassed"] = ("the class forward was set on the instance after pack() (e.g. accelerate's "
                                 "remove_hook_from_module): calls run stock HF; pe.pack(target) again re-installs "
                                 "the packed forward")
        elif state is not None:
            problem = structure_check(model, state)
            if problem is not None:
                entry["packed"] = False
                entry["runs_stock"] = problem
        if weight.device.type == "cuda":
            entry["gpu"] = torch.cuda.get_device_name(weight.device)
            entry["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(weight.device)
        if state is not None:
            watch = state.runtime.get("expansion")  # query expansion as the target has it now
            trailing = state.trailing_max_len if watch is None else wider(state.trailing_floor, watch.length())
            entry.update({
                "attention_backend": state.options.attention_backend,
                "last_attention": dict(state.last_plan),
                "attention_fallbacks": list(state.last_fallbacks),
                "stock_forward_calls": dict(state.runtime.get("stock_forward_calls", {})),
                "unpad_syncs_skipped": state.runtime.get("unpad_syncs_skipped", 0),
                "restarting_position_ids_calls": state.runtime.get("restarting_position_ids_calls", 0),
                "attention_policy": None if state.policy is None else state.policy.name,
                "kernels": state.ops.name,
                "kernels_reason": state.ops_reason,
                "gemm": state.ops.gemm,
                "kernel_fallbacks": state.ops.fallbacks() if hasattr(state.ops, "fallbacks") else {},
                "kernel_substitutions": list(getattr(state.ops, "substitutions", ())),
                "eager_plan": _plan_facts(state.runtime.get("eager_plan"), state.runtime.get("eager_dropout"),
                                          state.runtime.get("eager_stack_pointers_off")),
                "cuda_graph": describe_graphs(state, weight.device, model),
                "module_calls": _module_call_slots(model),
                "hub_kernels": _hub_kernels(model),
                "tuning": state.tuning.describe(),
                "padded_outputs": ("zeros" if trailing is None else
                                   "trailing masked positions computed" + (
                                       "" if trailing >= ALWAYS else f" for calls <= {trailing} wide")),
                "read_around": {"position_zero": state.position_zero,
                                "label_checks": sorted({type(h).__name__ for h in around.checked_heads([model])})},
                "validated": _validated(state.report, weight),
                "validated_as": None if state.report is None else f"{state.report.dtype} on {state.report.device}",
            })
        out.append(entry)
    return {"encoders": out}


def _module_call_slots(model: nn.Module) -> list[str]:
    """The projection slots whose module the packed forward calls, read from the live modules."""
    calls = read_calls(model)
    return [] if calls is None else list(calls.slots)


def _hub_kernels(model: nn.Module) -> list[str]:
    """transformers' hub kernels (``kernelize``, sentence-transformers' ``use_kernels=True``) bound to the encoder's
    attention modules (``_kernel_funcs``: ModernBERT's ``rotary_pos_emb``). The packed forward runs its own kernels
    for the whole attention block, RoPE included, so these run only under ``pe.unpack`` or a stock fallback."""
    found: dict[str, int] = {}
    for layer in model.layers:
        for name, func in (vars(layer.attn).get("_kernel_funcs") or {}).items():
            if "forward" in getattr(func, "__dict__", {}):  # (kernelize sets the hub kernel's forward there)
                found[name] = found.get(name, 0) + 1
    return [f"{name} on {n} of {len(model.layers)} layers: not called (the packed path applies its own RoPE)"
            if name == "rotary_pos_emb" else f"{name} on {n} of {len(model.layers)} layers: not called"
            for name, n in found.items()]


def _plan_facts(plan, dropout: bool | None = None, stack_pointers_off: str | None = None) -> dict | None:
    """What the last eager call's plan decided (``None`` before one): ``direct``: its kernels launched unchecked
    (``why_checked``: why not), ``glu``: the ``Wi`` + GLU path, ``linear``: the other projections (``"F.linear"``,
    ``"small_gemm"``: the Triton GEMM of small eager calls, or the op set's route, e.g. ``"quack"``), ``pointers``:
    the call may run as raw-pointer launches over one workspace (``model.pointers``; ``pointers_off``: why
    not: off for the process after a run disagreed with the tensor path, or the fast Triton launcher is off, e.g.
    under a Triton release it does not follow), ``blocks``: the kernel family of the
    per-block training autograd, ``stack``: every layer's blocks ran as one autograd node (``model.stack``;
    ``stack_off``: why a call with gradients did not (one node per block, or per op), ``None`` when it did or no
    gradient was wanted; ``stack_pointers``: that node launched its kernels on raw pointers
    (``model.stack_pointers``), ``stack_pointers_off``: why it did not), ``dropout``: some dropout module applied
    dropout in that call (its train mode and a non-zero rate, read live), ``merged_lora_slots``: how many projection
    slots holding a peft LoRA layer ran as one GEMM on its merged weight (``model.calls.merged_weights``)."""
    if plan is None:
        return None
    off = pointers_off(launch=plan.pointers)  # (a plan that runs pointers has the Triton family: Triton imports)
    return {"direct": plan.direct, "why_checked": plan.why_checked, "glu": plan.glu, "linear": plan.linear_route,
            "pointers": plan.pointers and off is None, "pointers_off": off,
            "blocks": None if plan.kernels is None else plan.kernels.name, "stack": plan.stack,
            "stack_off": plan.stack_off, "stack_pointers": plan.stack and stack_pointers_off is None,
            "stack_pointers_off": stack_pointers_off if plan.stack else None, "dropout": dropout,
            "merged_lora_slots": plan.merged}


def _single_encoder(model) -> nn.Module:
    encoders = find_encoders(model)
    if len(encoders) != 1:
        raise PackedEncodersError(f"packed_forward needs exactly one ModernBERT encoder; found {len(encoders)}")
    return encoders[0][1]


def _bypassed_wrapper(model: nn.Module, encoder: nn.Module) -> str | None:
    """What a distributed wrapper's own forward would have done that a direct ``packed_forward`` skips: DDP's
    gradient all-reduce (its forward prepares the reducer; without it each rank keeps its local gradients), FSDP's
    weight all-gather (the encoder's weights are still shards). Looked for only in a torch.distributed world."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.nn.parallel import DistributedDataParallel

    ddp = next((type(m).__name__ for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
    if ddp is not None:
        return (f"the model is wrapped in {ddp}, whose forward prepares the gradient all-reduce that a direct call "
                "skips (each rank would keep its own gradients): call packed_forward on the wrapped module from "
                "inside its forward (the module DDP wraps), or call the DDP model")
    if sharded(encoder):
        return ("the encoder's weights are sharded (DTensor, e.g. FSDP2's fully_shard), which the sharded module's "
                "forward gathers and a direct call does not: call packed_forward from inside that module's forward, "
                "or call the model")
    return None


# packed_forward reads cu_seqlens on the host and picks its kernels and graphs per call, as the patched HF forward does:
# under torch.compile it runs as it is, outside the compiled graph (traced, every host read would break the graph, a
# graph per fragment and token count); an exported graph could only record the example's segmentation, so a
# non-strict torch.export (which has no stock forward to fall back to here) is refused.
_PACKED_FORWARD_UNTRACEABLE = (
    "packed_forward reads cu_seqlens on the host (its kernels and graphs are picked per call), which an exported "
    "graph cannot: export the padded model (a packed model's torch.export traces the stock forward) or call "
    "packed_forward outside the exported code")


def packed_forward(model, params: ModernBertParams | None, packed_ids: torch.Tensor | None,
                   cu_seqlens: torch.Tensor, max_seqlen: int, position_ids: torch.Tensor | None = None, *,
                   backend: str | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """Encode an already packed batch: ``[T]`` ids -> ``[T, hidden_size]`` (after ``final_norm``).

    Args:
        model: a ``ModernBertModel`` or anything holding exactly one (packed or not).
        params: ``ModernBertParams.from_hf_config(model.config)``; ``None`` reads it from the model.
        packed_ids: int ``[T]``, the sequences concatenated with no padding.
        cu_seqlens: int32 / int64 ``[N + 1]`` cumulative lengths, starting at 0 and ending at ``T``, ``N >= 1``
            (an empty call: ``[0, 0]``).
        max_seqlen: host int, the longest sequence (checked).
        position_ids: int ``[T]``; ``None`` means ``arange`` within each sequence.
        backend: attention backend for this call (default: the model's pack option, else ``"auto"``).
        inputs_embeds: ``[T, hidden_size]`` in the model's dtype (or autocast's, under autocast), instead of
            ``packed_ids``.

    Under ``torch.compile`` it runs outside the compiled graph (a graph break; ``fullgraph=True`` raises); a
    non-strict ``torch.export`` tracing it raises ``PackedEncodersError`` (a strict one, dynamo's error).

    Raises:
        PackedEncodersError: inconsistent ``cu_seqlens`` / ``max_seqlen`` (or a ``max_seqlen`` that is neither an
            int nor a 0-d integer tensor), ids outside the vocabulary, ``inputs_embeds`` of another shape or dtype;
            ``params`` other than the model's; a model changed since ``pack()`` in a way the packed forward would
            skip (a forward hook, a wrapped or swapped submodule, pruned layers, a new
            ``config.local_attention`` or ``config.layer_types``); in a ``torch.distributed`` world, a model wrapped
            in ``DistributedDataParallel`` or an encoder whose weights are sharded (their wrapper's forward, which
            a direct call skips, all-reduces the gradients / gathers the weights); a call with gradients on CUDA
            that asks for deterministic attention (``config.deterministic_flash_attn=True`` or
            ``torch.use_deterministic_algorithms(True)``), which the packed attention backward does not give.
    """
    if torch.compiler.is_dynamo_compiling():  # also a strict torch.export, which dynamo traces (adapters.patch)
        return outside_dynamo(packed_forward, _PACKED_FORWARD_UNTRACEABLE)(
            model, params, packed_ids, cu_seqlens, max_seqlen, position_ids, backend=backend,
            inputs_embeds=inputs_embeds)
    if torch.compiler.is_exporting():
        raise PackedEncodersError(_PACKED_FORWARD_UNTRACEABLE)
    encoder = _single_encoder(model)
    problem = _bypassed_wrapper(model, encoder)
    if problem is not None:
        raise PackedEncodersError(f"packed_forward: {problem}")
    state = get_state(encoder)
    if state is not None:
        raise_earlier_errors(state)  # of earlier sync-free graph calls (never waits)
    state = state or make_state(encoder, PackOptions())
    if params is not None and params != state.params:
        raise PackedEncodersError("params differ from the model's (ModernBertParams.from_hf_config(model.config) "
                                  "when it was packed; re-pack after changing the config)")
    if (packed_ids is None) == (inputs_embeds is None):
        raise PackedEncodersError("pass exactly one of packed_ids or inputs_embeds")
    for name, t in (("packed_ids", packed_ids), ("cu_seqlens", cu_seqlens), ("position_ids", position_ids),
                    ("inputs_embeds", inputs_embeds)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise PackedEncodersError(f"{name} must be a torch.Tensor (got {type(t).__name__})")
        if t is not None and t.is_meta:  # (cu_seqlens and position_ids are read on the host: a meta one has nothing)
            raise PackedEncodersError(f"{name} is a meta tensor: it holds no values to run on")
    if packed_ids is not None and packed_ids.dim() != 1:
        raise PackedEncodersError(f"packed_ids must be 1-D [T]; got shape {tuple(packed_ids.shape)}")
    if inputs_embeds is not None:
        if inputs_embeds.dim() != 2 or inputs_embeds.shape[-1] != state.params.hidden_size:
            raise PackedEncodersError(f"inputs_embeds must be [T, hidden_size] = [T, {state.params.hidden_size}]; "
                                      f"got shape {tuple(inputs_embeds.shape)}")
        check_embeds_dtype(inputs_embeds, encoder.embeddings.tok_embeddings.weight.dtype)
    batch = from_packed(input_ids=packed_ids, inputs_embeds=inputs_embeds, cu_seqlens=cu_seqlens,
                        max_seqlen=max_seqlen, position_ids=position_ids,
                        vocab_size=encoder.embeddings.tok_embeddings.num_embeddings)
    if batch.total_tokens == 0:
        return empty_output(encoder, state, packed_ids if packed_ids is not None else inputs_embeds,
                            encoder.embeddings.tok_embeddings.weight.dtype)
    # checked before any route: a graph replay reads no module and would skip a hook or a swap
    problem = structure_check(encoder, state)
    if problem is not None:
        raise PackedEncodersError(f"the packed forward cannot run this model: {problem}")
    problem = deterministic_reason(encoder)
    if problem is not None:
        raise PackedEncodersError(f"packed_forward: {problem}; call the padded model, which runs the stock forward "
                                  "for such calls")
    route = packed_route(encoder, state, batch)
    return serve_batch(encoder, state, route, batch, backend=backend)


def _callable_name(fn) -> str:
    """``fn`` named by module and qualified name (a ``functools.partial`` by what it wraps): its ``repr`` may hold
    whole arguments, e.g. the model a hook's partial binds (a warning of dozens of lines)."""
    if isinstance(fn, functools.partial):
        return f"functools.partial of {_callable_name(fn.func)}"
    func = getattr(fn, "__func__", fn)
    name = getattr(func, "__qualname__", None) or type(fn).__qualname__
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module else name
