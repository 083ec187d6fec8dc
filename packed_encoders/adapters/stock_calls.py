"""Calls stock HF serves that the packed path does not reproduce: the patched forward runs the stock forward for
them (a one-time ``RuntimeWarning``, the reason in ``describe()``), so code written for stock HF keeps working.

Named before the call: attention probabilities (``output_attentions=True``), causal attention (``is_causal=True``),
HF's precomputed per-layer-type mask mapping (a dict ``attention_mask``), a mask per query and key (a 3-D / 4-D
tensor ``attention_mask``),
layer-selecting ``output_hidden_states`` (a list or tuple), tracing by ``torch.export`` or ``torch.jit.trace`` (the
exported program / trace is the stock graph: the packed forward syncs the host on the lengths), calls inside a
``torch.func`` transform, and calls with gradients on CUDA that ask for deterministic attention (:data:`DETERMINISTIC`).
Found while unpacking: a mask with holes inside a row, or padding before a row's real tokens where trailing padded
positions are computed (:class:`~packed_encoders.errors.StockOnlyInput`).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ..errors import StockOnlyInput

EXPORT = ("torch.export traces the stock forward (the packed forward reads the batch's lengths on the host, which "
          "an exported graph cannot)")
# torch.jit.trace records the packed path's host reads (the batch's lengths) as constants: a trace replayed on a batch
# with another token count fails inside the trace ("index out of range in self"), so the trace is the stock graph
JIT_TRACE = ("torch.jit.trace traces the stock forward (the packed forward reads the batch's lengths on the host, "
             "which a trace would record as constants)")


# torch.func's interpreter stack (grad, vmap, jvp, ...): None outside any transform
_functorch_level = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None)
FUNCTORCH = ("a torch.func transform (grad, vjp, jvp, vmap, ...) is active: the packed training path's autograd "
             "functions do not support functorch")


# HF's ModernBERT passes config.deterministic_flash_attn to FlashAttention-2's backward (and torch's deterministic mode
# makes aten's flash backward deterministic, or raises for kernels that cannot be); the packed training path's attention
# backward (FlashAttention-4's compiled kernels, or aten's FlashAttention-2 pair) accumulates dq in an order that is
# not fixed. Forwards are deterministic (no atomics in any packed kernel), so calls without gradients stay packed, and
# so do CPU calls (plain PyTorch ops).
DETERMINISTIC = ("a call with gradients on CUDA asks for deterministic attention (config.deterministic_flash_attn=True "
                 "or torch.use_deterministic_algorithms(True)); the packed attention backward does not fix the order "
                 "in which it accumulates the query gradients")


def _on_cuda(model: nn.Module) -> bool:
    return model._modules["embeddings"]._modules["tok_embeddings"]._parameters["weight"].is_cuda


def deterministic_reason(model: nn.Module) -> str | None:
    """:data:`DETERMINISTIC` when this call (gradients enabled, weights on CUDA) asks for a deterministic attention
    backward, else ``None`` (``config.deterministic_flash_attn`` read live, as HF's forward reads it)."""
    if torch.is_grad_enabled() and (getattr(model.config, "deterministic_flash_attn", False)
                                    or torch.are_deterministic_algorithms_enabled()) and _on_cuda(model):
        return DETERMINISTIC
    return None


def _argument(name: str, names: tuple[str, ...], args: tuple, kwargs: dict):
    """The call's ``name`` argument, given by keyword or positionally (``names``: the positional parameters)."""
    value = kwargs.get(name)
    if value is None and args and name in names[:len(args)]:
        value = args[names.index(name)]
    return value


def _batched(ids) -> bool:
    """Whether ``input_ids`` is absent or ``[batch, seq_len]``: ids of another rank with a mask per query and key
    fail inside stock as an ``IndexError``; the packed path's check names their shape instead."""
    return not isinstance(ids, torch.Tensor) or ids.dim() == 2


def stock_call_reason(model: nn.Module, names: tuple[str, ...], args: tuple, kwargs: dict) -> str | None:
    """Why this call must run the stock forward, or ``None``. ``names``: the forward's positional parameter names
    (after ``self``), to find ``attention_mask`` and ``input_ids`` passed positionally. A few dict lookups on the hot
    path."""
    if torch.compiler.is_exporting():
        return EXPORT
    if torch.jit.is_tracing():
        return JIT_TRACE
    if _functorch_level() is not None:
        return FUNCTORCH
    mask = _argument("attention_mask", names, args, kwargs)
    if isinstance(mask, dict):
        return ("attention_mask is a dict of per-layer-type masks (HF's precomputed mask mapping); the packed path "
                "reads a [batch, seq_len] padding mask")
    if isinstance(mask, torch.Tensor) and mask.dim() > 2 and _batched(_argument("input_ids", names, args, kwargs)):
        # no shape in the reason: it keys the per-model counts and the once-per-reason warning, which would grow
        # with every batch shape a service sees
        return (f"attention_mask is a {mask.dim()}-D tensor (a mask per query and key); "
                "the packed path reads a [batch, seq_len] padding mask")
    if kwargs.get("is_causal"):
        return ("is_causal=True asks for causal attention; the packed path attends both ways (stock applies it where "
                "its attention function does)")
    attentions = kwargs.get("output_attentions")
    if attentions is None:
        attentions = getattr(model.config, "output_attentions", False)
    if attentions:
        return "output_attentions=True: the packed path never materialises attention probabilities"
    hidden = kwargs.get("output_hidden_states")
    if hidden is not None and not isinstance(hidden, bool):
        return (f"output_hidden_states={hidden!r} selects layers; the packed path returns all of them "
                "(output_hidden_states=True) or none")
    return deterministic_reason(model)


def mask_holes_reason(error: StockOnlyInput) -> str:
    if "holes" in error.reason:
        return (f"{error.reason} (stock HF attends around the holes, with positions counted from the row's first "
                "column)")
    # query expansion with left padding, a head reading a padded position 0, eager attention's far padding: stock
    # computes those positions
    return f"{error.reason}; stock HF computes every position"


@functools.lru_cache(maxsize=None)
def stock_signature(cls: type) -> inspect.Signature:
    """The signature of ``cls.forward`` bound to an instance (``self`` dropped), as ``inspect.signature`` gives
    for an unpatched model's ``forward``."""
    sig = inspect.signature(cls.forward)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


@functools.lru_cache(maxsize=None)
def positional_names(cls: type) -> tuple[str, ...]:
    """The names ``cls.forward`` takes positionally, in order (``self`` dropped): a call's positional arguments
    mapped to them read as its keywords."""
    return tuple(p.name for p in stock_signature(cls).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
