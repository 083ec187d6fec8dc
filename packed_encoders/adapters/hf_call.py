"""The patched ``ModernBertModel.forward``: HF's padded (or packed) call <-> PackedBatch <-> HF outputs.

Accepted: ``input_ids`` or ``inputs_embeds`` ``[B, S]``, ``attention_mask`` ``[B, S]`` (padding on either
side), ``position_ids``, ``return_dict``, ``output_hidden_states``, all-zero ``token_type_ids``, and the packed
kwargs of HF v5 / sentence-transformers' flattening collator (``cu_seq_lens_q/k``, ``max_length_q/k``,
``seq_idx``) or packed ``position_ids`` with batch 1 and no mask. Padded positions of the output are zeros,
except the trailing masked positions of query calls under ColBERT query expansion
(:mod:`packed_encoders.adapters.late_interaction`) and of token heads' calls whose labels reach them
(:mod:`packed_encoders.adapters.token_labels`), which get HF's values.
Calls stock serves and the packed path does not reproduce run the stock forward
(:mod:`packed_encoders.adapters.stock_calls`); anything else the packed path cannot honour raises
:class:`~packed_encoders.errors.PackedEncodersError`.

This module only translates: HF arguments -> host facts and a :class:`~packed_encoders.batch.PackedBatch` (or
the padded tensors), the route chosen once per call by :mod:`packed_encoders.call`, and the result -> HF outputs.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings

import torch
from torch import nn

from ..batch import check_embeds_dtype, from_packed, is_int_like
from ..call import empty_output, packed_route, padded_route, raise_earlier_errors, serve_batch, serve_padded
from ..errors import PackedEncodersError, StockOnlyInput
from .around import COLUMN_ZERO, FIRST_REAL
from .state import wider
from .stock_calls import mask_holes_reason, positional_names, stock_call_reason
from .structure import structure_check
from .token_labels import TRAILING, head_request, position_zero_reader, restore_bypassed

# Keyword arguments that do not change the encoder's output, accepted and not used:
# num_items_in_batch is a loss-normalisation count HF heads forward to every submodule; use_cache has no
# meaning for a bidirectional encoder; output_router_logits (in HF v5's TransformersKwargs, which stock's forward
# takes) asks for a mixture-of-experts router's logits, and ModernBERT has no router; is_causal, also one of them,
# is ignored only when false (bidirectional, as the packed path attends): a true one runs the stock forward before
# this (adapters.stock_calls).
# sentence-transformers' modules write their outputs into the features dict, and its Transformer module passes every
# feature as a keyword to a forward taking **kwargs: a dict that went through the pipeline once carries these into
# the next call (CachedGISTEmbedLoss runs the model, then its guide, on one dict). Stock hands them to its attention
# function, which does not read them; they are outputs of an earlier call, never inputs.
IGNORED_KWARGS = ("num_items_in_batch", "use_cache", "output_router_logits", "is_causal", "token_embeddings",
                  "sentence_embedding", "all_layer_embeddings", "token_weights_sum", "cls_token_embeddings",
                  # what a tokenizer adds to a batch on request (return_special_tokens_mask, return_length,
                  # return_offsets_mapping, return_overflowing_tokens), which model(**batch) passes and stock ignores
                  "special_tokens_mask", "length", "offset_mapping", "overflow_to_sample_mapping")
# transformers v4's internal unpadding kwargs (passed by v4 heads under flash_attention_2).
_V4_UNPADDED = ("sliding_window_mask", "indices", "cu_seqlens", "max_seqlen", "batch_size", "seq_len")
_PACKED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def _forward_reads_flags(cls: type) -> bool:
    """Whether stock's ``forward`` takes ``return_dict`` and ``output_hidden_states`` as arguments and collects the
    hidden states itself (transformers v4 and 5.0); from 5.1 a decorator (``check_model_inputs``, then
    ``capture_outputs``) reads them from ``**kwargs`` and records the hidden states."""
    return "return_dict" in positional_names(cls)


@functools.lru_cache(maxsize=None)
def _config_can_untie() -> bool:
    """Whether this transformers reads ``config.tie_last_hidden_states`` (its ``capture_outputs`` looks the name up on
    the config; earlier 5.x releases take only the decorator's argument, and their stock ties whatever the config
    says). Read from the compiled code, so an install without sources answers too."""
    try:
        from transformers.utils.output_capturing import capture_outputs
    except ImportError:
        return False
    codes = [capture_outputs.__code__]
    while codes:
        code = codes.pop()
        if "tie_last_hidden_states" in code.co_consts:
            return True
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
    return False


def _hidden_pre_norm_last(model) -> bool:
    """Whether stock's last ``hidden_states`` entry is the last layer's output before ``final_norm``: always where
    the forward collects them itself; under the decorators when ``config.tie_last_hidden_states`` is set false (a
    ``PretrainedConfig`` option)."""
    config = model.config
    if _forward_reads_flags(type(model)):
        return True
    tie = getattr(config, "tie_last_hidden_states", None)
    return tie is not None and not tie and _config_can_untie()


_UNSET = object()  # an argument not passed, which stock may read differently from None


@functools.lru_cache(maxsize=None)
def _none_return_dict_is_unset() -> bool:
    """Whether ``return_dict=None`` reads as not passed where a decorator resolves it: so under transformers 5.1's
    ``check_model_inputs``; ``capture_outputs`` (5.2 on, which brought ``utils.output_capturing``) keeps the None,
    and None is not False, so the call returns a ``ModelOutput`` whatever the config says."""
    try:
        import transformers.utils.output_capturing  # noqa: F401
    except ImportError:
        return True
    return False


def _stock_flags(model, return_dict, output_hidden_states) -> tuple[bool, bool]:
    """``(tuple output, hidden states)`` as stock ``ModernBertModel.forward`` reads its ``return_dict`` and
    ``output_hidden_states`` (``_UNSET``: not passed). Where the forward names them (transformers v4 and 5.0), None
    means the config's value and any falsy ``return_dict`` gives a tuple. From 5.1 a decorator reads them from
    ``**kwargs``: the config's value only when not passed, and a tuple only for ``return_dict is False`` (0 and, from
    5.2, None give a ``ModelOutput``; a head's ``can_return_tuple`` applies its own rule to its output)."""
    config = model.config
    if _forward_reads_flags(type(model)):
        if return_dict is _UNSET or return_dict is None:
            return_dict = getattr(config, "use_return_dict", getattr(config, "return_dict", True))
        if output_hidden_states is _UNSET or output_hidden_states is None:
            output_hidden_states = getattr(config, "output_hidden_states", False)
        return not return_dict, bool(output_hidden_states)
    if return_dict is _UNSET or (return_dict is None and _none_return_dict_is_unset()):
        return_dict = getattr(config, "return_dict", True)
    if output_hidden_states is _UNSET:
        output_hidden_states = getattr(config, "output_hidden_states", False)
    return return_dict is False, bool(output_hidden_states)


def _output(last, hidden, as_tuple):
    from transformers.modeling_outputs import BaseModelOutput

    out = BaseModelOutput(last_hidden_state=last, hidden_states=hidden, attentions=None)
    return out.to_tuple() if as_tuple else out


# packed_encoders/ and torch/ (nn.Module.__call__): frames a warning about a user's call should skip; so are the
# libraries that call the encoder for the user (a head's forward, SentenceTransformer.encode), where loaded
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_CALLERS = ("transformers", "sentence_transformers", "pylate", "accelerate", "peft")


def _eager_half_window(model, state) -> int | None:
    """The local half window when stock's computed padded positions depend on it, else ``None``: with
    ``attn_implementation="eager"``, a padded query with no key in its local window softmaxes a row of equal
    minima (every value averaged), where SDPA and the packed attention give zeros."""
    params = state.params
    if all(params.layer_is_global) or getattr(model.config, "_attn_implementation", None) != "eager":
        return None
    return params.window


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside packed_encoders, torch (``nn.Module.__call__``) and the
    libraries calling the encoder (transformers' heads, sentence-transformers, PyLate, accelerate, peft), so a
    warning names the user's call rather than a library's."""
    dirs = _LIBRARY_DIRS + tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                                 for module in map(sys.modules.get, _CALLERS)
                                 if module is not None and getattr(module, "__file__", None))
    frame, level = sys._getframe(1), 1
    # (abspath: a frame's filename keeps the import path as given, e.g. with ".." in PYTHONPATH; once per warning)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame, level = frame.f_back, level + 1
    return level


def _stock_fallback(model, state, reason: str, args, kwargs):
    """Run HF's own forward because the packed one cannot reproduce the live modules or the call (warned once
    per reason; ``describe()["encoders"][i]["stock_forward_calls"]`` counts the calls per reason)."""
    impl = str(getattr(model.config, "_attn_implementation", None))
    if kwargs.get("cu_seq_lens_q") is not None and "flash" not in impl:
        # the packed path keeps the sequences apart; stock's SDPA / eager attention reads no cu_seq_lens
        reason += (f"; stock's {impl} attention does not read cu_seq_lens_q, so this call's sequences attend to "
                   "each other there")
    counts = state.runtime.setdefault("stock_forward_calls", {})
    counts[reason] = counts.get(reason, 0) + 1
    if counts[reason] == 1:
        warnings.warn(f"packed_encoders: running the stock forward: {reason}", RuntimeWarning,
                      stacklevel=_caller_stacklevel())
    state.last_plan = {}
    state.last_fallbacks = [f"stock forward: {reason}"]
    return type(model).forward(model, *args, **kwargs)


def _note_restarts(state) -> None:
    """A call read as several sequences from its restarting ``position_ids`` (batch 1, no mask, no
    ``cu_seq_lens_q``): counted (``describe()["encoders"][i]["restarting_position_ids_calls"]``) and warned once.
    Stock ModernBERT reads such a call as one sequence whatever its attention implementation (its layers get the
    positions for RoPE only, so even FlashAttention-2 sees no restart)."""
    n = state.runtime["restarting_position_ids_calls"] = state.runtime.get("restarting_position_ids_calls", 0) + 1
    if n == 1:
        warnings.warn(
            "packed_encoders: position_ids that restart at 0 in a call of batch 1 without attention_mask start a new "
            "sequence at every 0 (the FlashAttention packing convention of transformers' flattening collators); "
            "stock ModernBERT attends across them. Pass cu_seq_lens_q to say so, or an attention_mask to have one "
            "sequence", RuntimeWarning, stacklevel=_caller_stacklevel())


def hf_forward(model: nn.Module, *args, **kwargs):
    """Drop-in for ``type(model).forward(model, *args, **kwargs)`` running the packed path."""
    state = model._packed_encoders
    raise_earlier_errors(state)  # of earlier sync-free graph calls (GraphConfig.sync_free); never waits
    request = head_request()  # a head's loss reads padded positions (adapters.token_labels)
    if request is None:
        request = restore_bypassed(model, state)
    problem = structure_check(model, state)
    names = positional_names(type(model))
    if problem is None:
        problem = stock_call_reason(model, names, args, kwargs)
    if problem is None and request not in (None, TRAILING):  # why this head's loss needs the stock forward
        return _stock_fallback(model, state, request, args, kwargs)
    if problem is not None:
        return _stock_fallback(model, state, padded_route(model, state, structure=problem).reason, args, kwargs)
    call = dict(kwargs)  # as given: a mask with holes, found after the sync, runs stock with them
    if len(args) > len(names):
        raise PackedEncodersError(f"{type(model).__name__}.forward takes {len(names)} positional arguments; got {len(args)}")
    for name, value in zip(names, args):
        if name in kwargs:
            raise PackedEncodersError(f"forward got multiple values for argument {name!r}")
        kwargs[name] = value
    input_ids = kwargs.pop("input_ids", None)
    inputs_embeds = kwargs.pop("inputs_embeds", None)
    attention_mask = kwargs.pop("attention_mask", None)
    position_ids = kwargs.pop("position_ids", None)
    token_type_ids = kwargs.pop("token_type_ids", None)
    as_tuple, output_hidden_states = _stock_flags(model, kwargs.pop("return_dict", _UNSET),
                                                  kwargs.pop("output_hidden_states", _UNSET))
    kwargs.pop("output_attentions", None)  # True runs stock (stock_call_reason)
    packed_kw = {k: kwargs.pop(k) for k in _PACKED if kwargs.get(k) is not None}
    for k in _PACKED:
        kwargs.pop(k, None)
    v4 = [k for k in _V4_UNPADDED if kwargs.pop(k, None) is not None]
    for k in IGNORED_KWARGS:
        kwargs.pop(k, None)

    if "sliding_window_mask" in v4:
        raise PackedEncodersError(
            "sliding_window_mask: a custom sliding-window mask is not supported by the packed path (its local "
            "layers use config.local_attention); call pe.unpack(model) or run the stock forward for it")
    if v4:
        raise PackedEncodersError(
            f"{v4}: transformers v4's internal unpadding kwargs are not accepted by the packed path (it unpads by "
            "itself): pass a padded batch with its attention_mask, HF v5's cu_seq_lens_q / max_length_q, or call "
            "pe.packed_forward(model, None, input_ids, cu_seqlens, max_seqlen); a v4 head passing them under "
            "flash_attention_2 should be loaded with attn_implementation='sdpa'")
    unsupported = sorted(k for k, v in kwargs.items() if v is not None)  # None: not given, as HF reads it
    if unsupported:
        raise PackedEncodersError(f"unsupported keyword argument(s) {unsupported} for the packed ModernBERT forward")
    if (input_ids is None) == (inputs_embeds is None):
        raise PackedEncodersError("pass exactly one of input_ids or inputs_embeds")
    if inputs_embeds is not None and not inputs_embeds.is_floating_point():
        raise PackedEncodersError(f"inputs_embeds must be a floating tensor (got {inputs_embeds.dtype})")
    if input_ids is not None and input_ids.dim() == 0:
        raise PackedEncodersError("input_ids is a 0-d tensor; a padded batch is [batch, seq_len], a packed one [T] "
                                  "or [1, T]")
    if inputs_embeds is not None and (inputs_embeds.dim() == 0 or inputs_embeds.shape[-1] != state.params.hidden_size):
        raise PackedEncodersError(f"inputs_embeds has shape {tuple(inputs_embeds.shape)}; its last dimension must be "
                                  f"the model's hidden_size {state.params.hidden_size}")
    if inputs_embeds is not None:
        check_embeds_dtype(inputs_embeds, model.embeddings.tok_embeddings.weight.dtype)

    vocab_size = model.embeddings.tok_embeddings.num_embeddings  # live: resize_token_embeddings after pack
    src = input_ids if input_ids is not None else inputs_embeds
    if token_type_ids is not None and not isinstance(token_type_ids, torch.Tensor):
        # stock ignores token_type_ids, so an array or a list there reaches us: checked as a tensor (not through
        # NumPy's __array_wrap__ on a tensor operand, which NumPy 2 deprecates)
        try:
            token_type_ids = torch.as_tensor(token_type_ids, device=src.device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise PackedEncodersError(f"token_type_ids must be integers shaped as the inputs; got "
                                      f"{type(token_type_ids).__name__} ({e})") from None
    packed = bool(packed_kw) or (position_ids is not None and attention_mask is None and src.shape[0] == 1
                                 and src.dim() == (2 if input_ids is not None else 3))
    pre_norm_last = output_hidden_states and _hidden_pre_norm_last(model)
    if packed or src.dim() == (1 if input_ids is not None else 2):
        batch, squeeze = _packed_batch(vocab_size, input_ids, inputs_embeds, attention_mask, position_ids,
                                       token_type_ids, packed_kw)
        if not packed_kw and position_ids is not None and batch.num_seqs > 1:
            _note_restarts(state)
        hidden = [] if output_hidden_states else None
        if batch.total_tokens == 0:
            out = empty_output(model, state, src)
            if hidden is not None:
                hidden.extend([out] * (state.params.num_hidden_layers + 1))
        else:
            route = packed_route(model, state, batch, hidden_states=output_hidden_states)
            out = serve_batch(model, state, route, batch, hidden_states=hidden, hidden_pre_norm_last=pre_norm_last)
        hidden_t = None if hidden is None else tuple(squeeze(h) for h in hidden)
        return _output(squeeze(out), hidden_t, as_tuple)
    width = src.shape[1]
    watch = state.runtime.get("expansion")
    query_len = None if watch is None else watch.length()
    if watch is not None:
        state.trailing_max_len = wider(state.trailing_floor, query_len)
    within = state.trailing_max_len is not None and width <= state.trailing_max_len
    trailing = attention_mask is not None and (request == TRAILING or within)
    # a query-expansion call: left padding puts scored [MASK] positions before the real tokens (stock computes them);
    # a head reading position 0 (adapters.token_labels): a row padded there is read where stock computes it (the
    # multiple-choice head reads each row's first real token: only a row without one is read at padding)
    reads = position_zero_reader(model, state) if attention_mask is not None else None
    leading_stock = trailing and query_len is not None and width <= query_len
    padded = dict(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                  position_ids=position_ids, token_type_ids=token_type_ids, trailing=trailing)
    route = padded_route(model, state, hidden_states=output_hidden_states, position_zero=reads is not None, **padded)
    try:
        last, hidden_t = serve_padded(model, state, route, hidden_states=output_hidden_states,
                                      hidden_pre_norm_last=pre_norm_last, leading_stock=leading_stock,
                                      column_zero_stock=reads == COLUMN_ZERO, empty_rows_stock=reads == FIRST_REAL,
                                      far_padding_stock=_eager_half_window(model, state) if trailing else None,
                                      **padded)
    except StockOnlyInput as error:  # raised by unpad at the call's one sync, before any layer ran
        return _stock_fallback(model, state, mask_holes_reason(error), args, call)
    return _output(last, hidden_t, as_tuple)


def _packed_batch(vocab_size, input_ids, inputs_embeds, attention_mask, position_ids, token_type_ids, packed_kw):
    """Packed call: ``[1, T]`` (or ``[T]``) inputs with cu_seq_lens_* kwargs or restarting position_ids."""
    src = input_ids if input_ids is not None else inputs_embeds
    flat_dim = 1 if input_ids is not None else 2
    batched = src.dim() == flat_dim + 1
    if batched and src.shape[0] != 1:
        raise PackedEncodersError(f"a packed call needs batch size 1 ([1, T] inputs); got shape {tuple(src.shape)}")
    padded_shape = "[batch, seq_len]" if input_ids is not None else "[batch, seq_len, hidden]"
    if attention_mask is not None:
        raise PackedEncodersError(
            "a packed call (cu_seq_lens_q / packed position_ids) takes no attention_mask" +
            ("" if batched else f"; {tuple(src.shape)} inputs make a packed call: a padded batch is {padded_shape}"))
    if not batched and not packed_kw and position_ids is None:
        raise PackedEncodersError(
            f"inputs of shape {tuple(src.shape)} make a packed call, which needs cu_seq_lens_q or restarting "
            f"position_ids; a padded batch is {padded_shape} (with an attention_mask of [batch, seq_len])")
    ids = None if input_ids is None else (input_ids[0] if batched else input_ids)
    embeds = None if inputs_embeds is None else (inputs_embeds[0] if batched else inputs_embeds)
    cu_q, cu_k = packed_kw.get("cu_seq_lens_q"), packed_kw.get("cu_seq_lens_k")
    # checked before cu_k is compared with cu_q: a list or NumPy array (a collator run with return_tensors="np")
    # would otherwise reach that comparison's tensor methods and raise a bare AttributeError
    for name, value in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if value is not None and not isinstance(value, torch.Tensor):
            raise PackedEncodersError(f"{name} must be a 1-D int32 or int64 torch.Tensor [N + 1]; got "
                                      f"{type(value).__name__}")
    if cu_q is None and cu_k is not None:
        cu_q = cu_k
    if cu_k is not None and cu_k is not cu_q and (cu_k.shape != cu_q.shape or not torch.equal(cu_k.to(cu_q.device), cu_q)):
        raise PackedEncodersError("cu_seq_lens_k differs from cu_seq_lens_q: an encoder attends within each sequence")
    max_q, max_k = packed_kw.get("max_length_q"), packed_kw.get("max_length_k")
    for name, value in (("max_length_q", max_q), ("max_length_k", max_k)):
        if value is not None and not is_int_like(value):
            raise PackedEncodersError(f"{name} must be an int (or a 0-d integer tensor); got {value!r}")
    if max_q is not None and max_k is not None and int(max_q) != int(max_k):
        raise PackedEncodersError(f"max_length_q={int(max_q)} differs from max_length_k={int(max_k)}")
    max_len = max_q if max_q is not None else max_k
    batch = from_packed(input_ids=ids, inputs_embeds=embeds, cu_seqlens=cu_q,
                        max_seqlen=None if max_len is None else int(max_len),
                        position_ids=position_ids, vocab_size=vocab_size,
                        token_type_ids=token_type_ids)
    if batched:
        return batch, (lambda t: t[None])
    return batch, (lambda t: t)
