"""Live reads of a module's submodules and parameters on the eager hot path, without ``nn.Module.__getattr__``.

``layer.attn`` and ``linear.weight`` go through ``nn.Module.__getattr__``, a Python function that searches the
module's registries one by one (~0.5-1.5 us per read on the machines we measure), and an eager call reads ~30 of
them per layer. :func:`sub` and :func:`param` look in the registry the name lives in (``_modules``,
``_parameters``) first: the same objects, read on every call (a module or parameter replaced after ``pack()`` is
seen at the next call). A name not registered there (a parametrization's property, a buffer, a plain attribute)
takes ``getattr``.
"""

from __future__ import annotations

from torch import nn

_MISSING = object()


def sub(module: nn.Module, name: str):
    """``module.<name>`` for a registered submodule (``getattr`` otherwise)."""
    found = module._modules.get(name, _MISSING)
    return getattr(module, name) if found is _MISSING else found


def param(module: nn.Module, name: str, *default):
    """``module.<name>`` for a registered parameter, ``None`` for one registered as ``None`` (a Linear without a
    bias); ``getattr(module, name, *default)`` otherwise."""
    found = module._parameters.get(name, _MISSING)
    return getattr(module, name, *default) if found is _MISSING else found


__all__ = ["param", "sub"]
