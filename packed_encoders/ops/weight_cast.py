"""Low-precision copies of fp32 weights under autocast, made once and reused until the weights change.

Under autocast every ``F.linear`` casts its fp32 weight to bf16 again, in every forward (GradCache runs each chunk
twice, so a step pays the casts many times; each is a launch plus a read and a write of the weight). :func:`cast`
keeps one copy per (parameter, dtype) and hands it out while the parameter is unchanged, judged by:

- its version counter (``param._version``: every in-place op through the tensor bumps it, e.g. a foreach
  optimizer step, ``param.copy_()``, ``param.mul_()``),
- its storage address (``param.data = other`` swaps it), dtype and device,
- a generation counter bumped after every ``torch.optim`` optimizer step (a global step hook, installed on first
  use): fused optimizers (``AdamW(fused=True)``) update parameters in place without bumping their version,
- a counter bumped by every training step of the encoder (:func:`expire`: the backward of each of its autograd
  functions, or the forward of a call with gradients on the per-op path, whose backward is autograd's own): a
  hand-written update after it (``p.data.add_(p.grad, alpha=-lr)``, which bumps no version counter) is read by the
  next forward, as stock HF's casts would read it.
- the same generation counter, bumped when a module holding a parameter a copy was made from is put into a module
  tree (a global module registration hook, installed with the optimizer one): peft's ``merge_and_unload()`` adds
  the adapters into the base weight through ``.data``, then puts the base Linear back into its slot, also with no
  call of the encoder between loading and merging an adapter (``PeftModel.from_pretrained(model, d)
  .merge_and_unload()``), where the module tree the next call sees is the one the copies were made under.

:func:`cast_group` does the same for a group of tensors (an encoder's projection weights) with one entry: one
lookup while none changed, one multi-tensor copy when any did.

In a ``torch.distributed`` process group nothing is cached (each call casts, as stock's autocast does) and
:class:`StaticCopies` cast at every refresh: FSDP2 all-gathers the weights into the same parameters at each forward,
often at the address they had, and keeps their version counters, so weights loaded or edited through their shards
(``set_model_state_dict``, an in-place copy) change nothing these tests read.

Not seen: an in-place edit through ``param.data`` (``param.data.copy_(...)``, e.g. a hand-written EMA update)
with neither an optimizer step nor a training step of the encoder since the copy was made, since ``.data`` has a
version counter of its own. Call :func:`clear` after such edits.

The copy is made without gradient tracking: callers that need the gradient to reach the fp32 parameter (the
block autograd functions of :mod:`packed_encoders.model.blocks`) compute the weight gradient themselves and return
it in the parameter's dtype. Inference tensors (no version counter), calls under CUDA-graph capture and calls
within :func:`off` (a training graph's warm-ups, whose allocations go to the graph's pool) are cast each time,
not cached. Entries go with their parameters' storage: the weak references are to the storage, never to the
parameter, since ``torch.utils.swap_tensors`` refuses a tensor that has one (``module.to()`` and ``load_state_dict``
swap parameters that way under ``torch.__future__.set_swap_module_params_on_conversion(True)``, and always for
tensor-subclass parameters). While an entry lives its storages do, so a tensor with the address, version and shape
it was made from reads those very bytes.

CUDA graphs read weights by address, so a graph captured under autocast would cast every weight again at each
replay. :class:`StaticCopies` keeps copies at fixed addresses instead: within :meth:`StaticCopies.serving`
:func:`cast` hands them out (a capture records reads of them), and :meth:`StaticCopies.refresh`, called before
each replay, casts them again when a source parameter changed or the encoder trained since (the same tests).
"""

from __future__ import annotations

import contextlib
import operator
import threading
import weakref

import torch
import torch.distributed as dist
from torch._utils import _unflatten_dense_tensors

_CACHE: dict = {}
_LOCK = threading.Lock()
_STATE = {"generation": 0, "backwards": 0, "hooked": False}
_LOCAL = threading.local()
# id() of every tensor a copy was made from (kept past the copies: an id reused by another tensor only costs an
# expiry that was not needed)
_SOURCES: set = set()


def _bump(*_args, **_kwargs) -> None:
    _STATE["generation"] += 1


def _module_registered(_parent, _name, submodule):
    """Global module registration hook: ``submodule`` put into a module tree (``setattr``, ``add_module``). When it
    holds a parameter a copy was made from, that parameter may have changed through ``.data`` on the way (peft's
    ``merge_and_unload`` merges into the base Linear's weight, then puts it back): every copy expires."""
    if submodule is None or not _SOURCES:
        return None
    try:
        hit = any(id(p) in _SOURCES for p in submodule.parameters())
    except Exception:  # a module whose parameters cannot be listed now: expire rather than guess
        hit = True
    if hit:
        _bump()
    return None


def _install_hook() -> None:
    with _LOCK:
        if not _STATE["hooked"]:
            from torch.nn.modules.module import register_module_module_registration_hook
            from torch.optim.optimizer import register_optimizer_step_post_hook

            register_optimizer_step_post_hook(_bump)
            register_module_module_registration_hook(_module_registered)
            _STATE["hooked"] = True


def expire() -> None:
    """Copies made before this call are not handed out again: called by each training step of the encoder, after
    which a weight may be updated through ``.data`` before the next forward. :class:`StaticCopies` cast again at
    their next :meth:`~StaticCopies.refresh` (a CUDA graph's copies change only there, before a replay)."""
    _STATE["backwards"] += 1


def clear() -> None:
    """Drop every cached copy (after editing weights in a way :func:`cast` cannot see, e.g. ``p.data.copy_``)."""
    with _LOCK:
        _CACHE.clear()
        _GROUPS.clear()
        _SOURCES.clear()
    _bump()


@contextlib.contextmanager
def off():
    """Within the block, on this thread, :func:`cast` makes fresh copies and caches nothing (a cached copy made
    there would live in whatever memory pool the block allocates from)."""
    before = getattr(_LOCAL, "off", False)
    _LOCAL.off = True
    try:
        yield
    finally:
        _LOCAL.off = before


def may_cache(device: torch.device) -> bool:
    """Whether a tensor made now on ``device`` may be kept for later calls: not within :func:`off`, not while the
    current stream is being captured into a CUDA graph (tensors made there belong to the graph's pool)."""
    return not getattr(_LOCAL, "off", False) and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _in_process_group() -> bool:
    """Whether this process is in a ``torch.distributed`` process group (where FSDP2 may hold the weights: see the
    module's docstring)."""
    return dist.is_available() and dist.is_initialized()


def cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in ``dtype`` (``t`` itself when it already is, or when either is ``None``), from the cache while ``t``
    is unchanged. The result carries no autograd history."""
    if t is None or dtype is None or t.dtype is dtype:
        return t
    static = getattr(_LOCAL, "static", None)
    if static is not None:
        hit = static.get((t.data_ptr(), dtype))
        if hit is not None:
            return hit
    if t.is_inference() or not may_cache(t.device) or _in_process_group():
        with torch.no_grad():
            return t.to(dtype)
    if not _STATE["hooked"]:
        _install_hook()
    key = (id(t), dtype)
    stamp = (_STATE["generation"], _STATE["backwards"], t._version, t.data_ptr(), t.shape, t.device)
    hit = _CACHE.get(key)
    if hit is not None and hit[1] == stamp:
        return hit[2]
    # a normal tensor even under inference_mode: a later training forward may save the cached copy for backward
    with torch.inference_mode(False), torch.no_grad():
        out = t.to(dtype)
    token = object()
    refs = _storage_refs((t,), _CACHE, key, token)
    if refs is not None:
        with _LOCK:
            _CACHE[key] = (token, stamp, out, refs)
            _SOURCES.add(id(t))
    return out


def _storage_refs(tensors, table: dict, key, token) -> tuple | None:
    """Weak references to the storages of ``tensors`` that drop ``table[key]`` when any storage goes, if the entry
    there is still ``token``'s (a newer entry under the same key stays); ``None`` for a tensor without a storage
    (a tensor subclass): its copy is not cached."""
    def drop(_ref, table=table, key=key, token=token):
        hit = table.get(key)
        if hit is not None and hit[0] is token:
            table.pop(key, None)

    try:
        return tuple(weakref.ref(t.untyped_storage(), drop) for t in tensors)
    except (RuntimeError, NotImplementedError, TypeError):
        return None


_VERSION = operator.attrgetter("_version")
_GROUPS: dict = {}
_MAX_GROUPS = 8


def cast_group(tensors: tuple, dtype: torch.dtype | None) -> tuple:
    """:func:`cast` of every tensor of ``tensors`` (a tuple, e.g. all projection weights of an encoder), with one
    cache entry for the group: while none of them changed (the same tests as :func:`cast`) the group's copies come
    back from one lookup, and after a change all are cast again by one multi-tensor copy into a new buffer (a
    training step changes every weight: one launch instead of one per weight). Copies handed out earlier stay as
    they were (a backward still pending may read them). Tensors already in ``dtype``, inference tensors, calls
    under capture or within :func:`off` take :func:`cast` one by one."""
    if dtype is None or not tensors:
        return tensors
    if (getattr(_LOCAL, "off", False) or getattr(_LOCAL, "static", None) is not None
            or any(t.dtype is dtype or t.is_inference() for t in tensors)
            or (tensors[0].is_cuda and torch.cuda.is_current_stream_capturing())):
        return tuple(cast(t, dtype) for t in tensors)
    keep = not _in_process_group()
    if keep:
        if not _STATE["hooked"]:
            _install_hook()
        key = (tuple(map(id, tensors)), dtype)
        stamp = (_STATE["generation"], _STATE["backwards"], tuple(map(_VERSION, tensors)),
                 tuple(t.data_ptr() for t in tensors))
        hit = _GROUPS.get(key)
        if hit is not None and hit[1] == stamp:
            return hit[2]
    with torch.inference_mode(False), torch.no_grad():
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            return tuple(cast(t, dtype) for t in tensors)
        flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
        # the views in one C++ call (one slice and view per tensor from Python: ~3x the host time)
        copies = tuple(_unflatten_dense_tensors(flat, tensors))
        torch._foreach_copy_(list(copies), list(tensors))
    if not keep:
        return copies
    # weak references to the storages: the entry must not keep the parameters (or, through them, a model) alive,
    # and goes when any of them goes
    token = object()
    refs = _storage_refs(tensors, _GROUPS, key, token)
    if refs is None:
        return copies
    with _LOCK:
        if len(_GROUPS) >= _MAX_GROUPS and key not in _GROUPS:
            _GROUPS.pop(next(iter(_GROUPS)))
        _GROUPS[key] = (token, stamp, copies, refs)
        _SOURCES.update(key[0])
    return copies


class StaticCopies:
    """``dtype`` copies of ``params`` (fp32 weights), at addresses fixed for the object's life, for CUDA graphs.

    Args:
        params: the parameters to copy (their storage must not move: a graph manager drops its graphs, and these
            copies, when a parameter's address changes).
        dtype: the copies' dtype (the autocast dtype the graphs are captured under).

    ``epoch`` counts the casts :meth:`refresh` made because a parameter's version or the optimizer-step generation
    moved: a training graph's backward reads the copies its forward read, so it compares the epoch of its forward
    with the current one. A cast made only because the encoder trained since the last one (:func:`expire`: a
    hand-written update through ``.data`` may have followed, which moves neither) leaves ``epoch`` as it is.
    """

    def __init__(self, params, dtype: torch.dtype):
        if not _STATE["hooked"]:
            _install_hook()
        self.params = tuple(params)
        with _LOCK:
            _SOURCES.update(map(id, self.params))
        self.dtype = dtype
        with torch.no_grad(), torch.inference_mode(False):
            self.copies = tuple(torch.empty_like(p, dtype=dtype) for p in self.params)
        self._by_address = {(p.data_ptr(), dtype): c for p, c in zip(self.params, self.copies)}
        self._stamp = None
        self._backwards = None
        self.epoch = 0

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.copies)

    def refresh(self) -> int:
        """Cast the parameters into the copies (on the current stream) unless none changed since the last cast
        (outside a process group); returns :attr:`epoch`."""
        stamp = (_STATE["generation"], *map(_VERSION, self.params))
        backwards = _STATE["backwards"]
        if stamp != self._stamp or backwards != self._backwards or _in_process_group():
            with torch.no_grad(), torch.inference_mode(False):
                torch._foreach_copy_(self.copies, self.params)
            if stamp != self._stamp:
                self.epoch += 1
            self._stamp, self._backwards = stamp, backwards
        return self.epoch

    @contextlib.contextmanager
    def serving(self):
        """Within the block, on this thread, :func:`cast` of one of the parameters (or of a tensor at its
        address, e.g. an alias) to ``dtype`` returns its copy, as it is (call :meth:`refresh` first)."""
        before = getattr(_LOCAL, "static", None)
        _LOCAL.static = self._by_address if before is None else {**before, **self._by_address}
        try:
            yield
        finally:
            _LOCAL.static = before
