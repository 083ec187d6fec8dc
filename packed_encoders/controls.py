"""User-facing graph controls: ``no_cuda_graph``, ``set_cuda_graph``, ``check_errors``.

They find the packed encoders inside a model (adapters) and act on each encoder's graph state
(:mod:`packed_encoders.graphs.route`), so they sit above both.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace

from .adapters.locate import find_encoders
from .adapters.state import get_state
from .configure import device_of
from .errors import PackedEncodersError
from .graphs.config import GraphConfig, normalize
from .graphs.route import RUNTIME_LOCK, precapture_encoders


def check_errors(model, *, wait: bool = False):
    """Raise the input errors of earlier ``GraphConfig(sync_free=True)`` calls on every packed encoder inside
    ``model``; returns ``model`` when there are none.

    Without ``wait`` only calls whose GPU work has completed are read (never a sync); ``wait=True`` waits for
    every pending call first (one sync: use it after the last call of a loop). The next call on an encoder
    runs the non-waiting check by itself.

    Raises:
        PackedEncodersError: an earlier sync-free call failed its input checks (each failure reported once), or
            ``model`` has no packed encoder, or ``wait`` is not a bool.
    """
    if not isinstance(wait, bool):
        raise PackedEncodersError(f"check_errors: wait={wait!r} must be a bool")
    pairs = _packed_states(model)
    if not pairs:
        raise PackedEncodersError("check_errors: no packed ModernBERT encoder inside the model; call pe.pack first")
    for _, state in pairs:
        checks = state.runtime.get("graph_checks")
        if checks is not None:
            checks.poll(wait=wait)
    return model




def _packed_states(model):
    return [(m, s) for _, m in find_encoders(model) if (s := get_state(m)) is not None]


@contextlib.contextmanager
def no_cuda_graph(model):
    """Run every packed encoder inside ``model`` eagerly within the block (model-wide, all threads; nests).

    Captured graphs are kept and serve again after the block.

    Raises:
        PackedEncodersError: ``model`` has no packed encoder.
    """
    states = [s for _, s in _packed_states(model)]
    if not states:
        raise PackedEncodersError("no_cuda_graph: no packed ModernBERT encoder inside the model; call pe.pack first")
    with RUNTIME_LOCK:
        for s in states:
            s.runtime["graphs_suspended"] = s.runtime.get("graphs_suspended", 0) + 1
    try:
        yield model
    finally:
        with RUNTIME_LOCK:
            for s in states:
                s.runtime["graphs_suspended"] = max(0, s.runtime.get("graphs_suspended", 0) - 1)


def warn_graphs_idle(pairs, call: str) -> None:
    """Warn, from ``call`` (``pack`` or :func:`set_cuda_graph`, whose caller the warning points at), that the asked-for
    CUDA graphs of the encoders in ``pairs`` (``(model, state)``) not on a CUDA device wait for one."""
    idle = sorted({str(device_of(model)) for model, state in pairs
                   if state.options.cuda_graph is not None and not state.options.graph_auto
                   and device_of(model).type != "cuda"})
    if idle:
        warnings.warn(f"{call}: the model is on {', '.join(idle)}; CUDA graphs start once it is on a CUDA device, "
                      "calls run eagerly until then (describe(model)['encoders'][i]['cuda_graph']['idle_reason'])",
                      stacklevel=3)


def set_cuda_graph(model, enabled: bool, config: GraphConfig | None = None):
    """Turn CUDA-graph replay on or off for every packed encoder inside ``model``; returns ``model``.

    ``enabled=True`` keeps the current config (or, after ``enabled=False``, the config graphs had before; else
    ``GraphConfig()``) unless ``config`` is given; a new config, or enabling again, drops captured graphs
    (re-listing the parameters). ``enabled=False`` frees them.

    Raises:
        PackedEncodersError: ``model`` has no packed encoder, ``enabled`` not a bool, ``config`` not a
            :class:`GraphConfig`, or given with ``enabled=False``.
    """
    if not isinstance(enabled, bool):
        raise PackedEncodersError(f"set_cuda_graph(enabled={enabled!r}): expected a bool")
    if config is not None and not enabled:
        raise PackedEncodersError("set_cuda_graph(enabled=False) takes no config")
    if config is not None and not isinstance(config, GraphConfig):
        raise PackedEncodersError(f"set_cuda_graph(config={config!r}): expected a packed_encoders.GraphConfig")
    pairs = _packed_states(model)
    if not pairs:
        raise PackedEncodersError("set_cuda_graph: no packed ModernBERT encoder inside the model; call pe.pack first")
    for _, state in pairs:
        new = None
        if enabled:
            new = ((None if config is None else normalize(config)) or state.options.cuda_graph
                   or state.runtime.get("graph_config_before_off") or GraphConfig())
        elif state.options.cuda_graph is not None:
            state.runtime["graph_config_before_off"] = state.options.cuda_graph
        state.options = replace(state.options, cuda_graph=new, graph_auto=False)
        state.runtime.pop("graphs", None)
    if enabled:
        warn_graphs_idle(pairs, "set_cuda_graph(...)")
        precapture_encoders(pairs)
    return model
