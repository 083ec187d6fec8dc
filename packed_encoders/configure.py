"""The state ``pack()`` installs on an encoder: options, params, ops, attention policy and tuning, built once.

Both ``pack()`` and ``validate()`` build states here (validation depends on this and on the routes, never on
:mod:`packed_encoders.api`).
"""

from __future__ import annotations

import torch
from torch import nn

from .adapters.around import around
from .adapters.late_interaction import ALWAYS, ExpansionWatch
from .adapters.locate import find_encoders
from .adapters.state import PackOptions, PackState, get_state, wider
from .attention.dispatch import CHOICES, cannot_serve, load_policy
from .errors import PackedEncodersError, UnsupportedTargetError
from .graphs.config import normalize
from .model.params import ModernBertParams
from .ops.select import select_ops
from .ops.triton import set_fast_launch
from .tuning import Tuning, read_tuning


def params_of(model: nn.Module) -> ModernBertParams:
    try:
        return ModernBertParams.from_hf_config(model.config)
    except ValueError as exc:
        raise UnsupportedTargetError(f"ModernBERT config not supported by the packed path: {exc}") from exc


def device_of(model: nn.Module) -> torch.device:
    return model.embeddings.tok_embeddings.weight.device


def trailing_max_len(padded_outputs) -> int | None:
    """The widest padded call whose trailing masked positions are computed, for an explicit ``padded_outputs``
    (``"auto"``: ``None`` here, :func:`read_around` decides)."""
    if padded_outputs in ("auto", "zeros"):
        return None
    if padded_outputs == "all":
        return ALWAYS
    if isinstance(padded_outputs, int) and not isinstance(padded_outputs, bool) and padded_outputs > 0:
        return padded_outputs
    raise PackedEncodersError(
        f"padded_outputs={padded_outputs!r} is not 'auto', 'zeros', 'all' or a positive int (max padded width)")


def make_state(model: nn.Module, options: PackOptions, target=None, tuning: Tuning | None = None) -> PackState:
    """A fresh state for ``model`` (``tuning``: read now when not given)."""
    if options.attention_backend not in CHOICES:
        raise PackedEncodersError(f"attention_backend={options.attention_backend!r} is not one of {CHOICES}")
    params = params_of(model)
    device = device_of(model)
    why = cannot_serve(options.attention_backend, device_type=device.type, heads=params.num_attention_heads,
                       head_dim=params.head_dim)
    if why is not None:
        raise PackedEncodersError(f"attention_backend={options.attention_backend!r} cannot run this model (on "
                                  f"{device}): {why}")
    tuning = tuning if tuning is not None else read_tuning(device)
    ops, reason = select_ops(options.kernels, device, tuning)
    set_fast_launch(tuning.triton_fast_launch)
    policy = load_policy(device, policy_file=tuning.policy_file, cache=tuning.cache_dir)
    state = PackState(params=params, options=options, ops=ops, ops_reason=reason, policy=policy,
                      trailing_floor=trailing_max_len(options.padded_outputs), tuning=tuning)
    read_around(model, state, target)
    return state


def read_around(model: nn.Module, state: PackState, target=None) -> None:
    """Set what ``state`` computes for the modules around ``model`` that read its padded positions (with any
    ``padded_outputs`` but ``"zeros"``; ``"all"`` or an int computes at least its trailing widths besides): its
    record (:mod:`.adapters.around`) with ``target``'s readers. A question-answering head: every trailing padded
    position (HF's span loss takes its softmax over them too); query expansion: those of query calls, read per call
    (:class:`ExpansionWatch`); a cls head: ``state.position_zero``."""
    state.runtime.pop("expansion", None)
    if state.options.padded_outputs == "zeros":
        state.trailing_max_len = state.position_zero = None
        return
    readers = around(model, target)
    state.position_zero = readers.position_zero
    watch = None if readers.span else ExpansionWatch(readers.expansion, model)
    state.trailing_max_len = wider(state.trailing_floor, ALWAYS if readers.span else watch.length())
    if watch:  # query expansion set, changed or cleared after pack() is seen per call
        state.runtime["expansion"] = watch


def encoder_states(target, *, attention_backend=None, kernels=None):
    """Yield ``(path, encoder, state)``: the installed state, or the one ``pack`` would install."""
    for path, model in find_encoders(target):
        state = get_state(model)
        base = state.options if state is not None else PackOptions(cuda_graph=normalize(None), graph_auto=True)
        options = PackOptions(attention_backend=attention_backend or base.attention_backend,
                              kernels=kernels or base.kernels, validate=base.validate, cuda_graph=base.cuda_graph,
                              padded_outputs=base.padded_outputs, graph_auto=base.graph_auto)
        if state is None or options != state.options:
            state = make_state(model, options, target)
        yield path, model, state
