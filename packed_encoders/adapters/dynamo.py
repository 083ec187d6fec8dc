"""Functions run outside dynamo's graph: the packed forward reads the batch's lengths on the host and picks its own
kernels and CUDA graphs per call, so under ``torch.compile`` it runs as it is (the code around it still compiles),
and so do a head's label check and ``packed_forward``.

Wrappers are made on first use rather than at import: making one imports ``torch._dynamo`` (~0.6 s), which
``pack()`` imports anyway.
"""

from __future__ import annotations

import torch

_WRAPPED: dict = {}


def outside_dynamo(fn, reason: str | None = None, recursive: bool = True):
    """``fn`` wrapped by ``torch.compiler.disable`` (``recursive=False``: only ``fn``'s own frame, what it calls is
    traced again), made once per ``(fn, recursive)``; ``reason`` is what dynamo says of it (e.g. under
    ``fullgraph=True``) on a torch that takes one."""
    key = (fn, reason, recursive)
    wrapped = _WRAPPED.get(key)
    if wrapped is None:
        try:
            wrapped = torch.compiler.disable(fn, recursive=recursive, reason=reason)
        except TypeError:  # torch without disable(reason=...)
            wrapped = torch.compiler.disable(fn, recursive=recursive)
        wrapped = _WRAPPED.setdefault(key, wrapped)
    return wrapped
