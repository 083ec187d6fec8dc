"""Token-level heads called with labels at padded positions: those calls get stock's encoder output there.

The packed encoder's output is zero at padded positions. HF's token-classification and masked-LM heads compute
their loss over every position whose label is not the ignore index (-100): HF's collators give padded positions
-100, but labels built by hand (``labels = input_ids.clone()``, labels padded with a class id) reach padded
positions, and there stock's encoder output (attention of the padded query over the real keys) enters the loss.

``pack(target)`` with ``padded_outputs="auto"`` puts a forward pre-hook on each such head inside ``target``. A call
passing ``labels`` and ``attention_mask`` (keywords, as HF's ``Trainer`` passes them) is checked, with one
device-to-host read: when no label at a padded position counts, nothing changes; when the counted ones all sit
after their row's last real token, the encoder call computes those trailing positions as stock does (the path of
``padded_outputs="all"``); otherwise (padding before real tokens) the encoder call runs the stock forward, counted in
``describe()["encoders"][i]["stock_forward_calls"]``. The request is handed to the encoder call the head makes next
on this thread (:func:`take_request`) and cleared when the head returns.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

IGNORE_INDEX = -100  # HF's CrossEntropyLoss default, used by both heads
HEAD_SUFFIXES = ("ForTokenClassification", "ForMaskedLM")
STOCK_REASON = ("labels at padded positions before a row's last real token (the loss reads the encoder's output "
                "there, which the packed path leaves at zero)")
TRAILING = "trailing"
STOCK = "stock"
_REQUEST = threading.local()


def request_for(labels, attention_mask) -> str | None:
    """``None`` (no label at a padded position counts), :data:`TRAILING` (all of them after their row's last real
    token) or :data:`STOCK`, for ``labels`` and ``attention_mask`` of one shape ``[B, S]``; anything else ``None``."""
    if not (isinstance(labels, torch.Tensor) and isinstance(attention_mask, torch.Tensor)):
        return None
    if labels.dim() != 2 or labels.shape != attention_mask.shape or labels.device != attention_mask.device:
        return None
    real = attention_mask != 0
    counted = ~real & (labels != IGNORE_INDEX)
    after_last = real.flip(1).cumsum(1).flip(1) == 0  # no real token at or after the position
    any_counted, inner = torch.stack((counted.any(), (counted & ~after_last).any())).tolist()
    if not any_counted:
        return None
    return STOCK if inner else TRAILING


def _pre_hook(module, args, kwargs):
    _REQUEST.what = request_for(kwargs.get("labels"), kwargs.get("attention_mask"))


def _post_hook(module, args, kwargs, output):
    _REQUEST.what = None


def take_request() -> str | None:
    """The request of the token head now calling the encoder on this thread (cleared: one encoder call takes it)."""
    what = getattr(_REQUEST, "what", None)
    _REQUEST.what = None
    return what


def token_heads(target: nn.Module) -> list[nn.Module]:
    """The token-classification and masked-LM heads inside ``target`` (by class name, as HF names them)."""
    return [m for m in target.modules() if type(m).__name__.endswith(HEAD_SUFFIXES)]


def _ours(hooks: dict) -> list:
    return [key for key, fn in hooks.items() if fn is _pre_hook or fn is _post_hook]


def watch(target: nn.Module) -> None:
    """Hook every token head inside ``target`` (once; :func:`unwatch` removes the hooks)."""
    for head in token_heads(target):
        if not _ours(head._forward_pre_hooks):
            head.register_forward_pre_hook(_pre_hook, with_kwargs=True)
            head.register_forward_hook(_post_hook, with_kwargs=True, always_call=True)


def unwatch(target: nn.Module) -> None:
    """Remove :func:`watch`'s hooks, found by function rather than by handle: a ``copy.deepcopy`` of a packed
    target copies the hooks, while a handle would still point at the original module's."""
    for head in token_heads(target):
        for hooks, extras in ((head._forward_pre_hooks, (head._forward_pre_hooks_with_kwargs,)),
                              (head._forward_hooks, (head._forward_hooks_with_kwargs,
                                                     head._forward_hooks_always_called))):
            for key in _ours(hooks):
                del hooks[key]
                for extra in extras:
                    extra.pop(key, None)
