"""FlashAttention-4's compiled varlen kernels called directly, without ``flash_attn.cute``'s Python planning.

``flash_attn.cute``'s entry points plan every call in Python (tile sizes, schedulers, a compile-cache key of ~50
fields, tensor checks) before they call the compiled kernel: on the H200 machine ~110-470 us of host time per
forward and ~350-950 us per backward (four kernels), against ~6-9 us and ~17-23 us for the compiled kernels' own
calls, and a ModernBERT-base forward calls attention 22 times. The kernels themselves take ~0.5-0.7x the GPU time
of FlashAttention-2 on ModernBERT's shapes (backward ~0.53-0.64x).

How: for a *class* of calls (device, dtype, heads, head_dim, window, scale, ``max_seqlen`` in a span of
:data:`SPANS`) the planning is run once, through ``flash_attn.cute.interface``'s own ``_flash_attn_fwd`` /
``_flash_attn_bwd`` on two synthetic single-sequence inputs, at the span's shortest and longest ``max_seqlen``,
with the interface's compile caches wrapped so every compiled-kernel call is recorded. The class is served
directly only when both ends record the same kernels with the same arguments, each tensor argument being one of
the call's own tensors (``q, k, v``, the output, the log-sum-exp, ``cu_seqlens``, the output gradient, the
input gradients) or one of the backward's scratch buffers of the shapes this module allocates. The planning
depends on ``max_seqlen`` only through threshold tests (a single tile or not, ...), so agreement at both ends of
a span means agreement inside it. A call then substitutes its tensors into the recorded arguments.

Anything else takes the public entry point (``None`` from :func:`kernels`, with the reason in
:func:`class_status`): a FlashAttention-4 release other than :data:`VERIFIED` (its internal call layout is what is
read here), a batch of more than 256 sequences (the interface adds a scheduler table there), a span past the
last, a recording that disagrees, a class first met while a CUDA graph is being captured (the recording allocates
and compiles), operands whose layout the kernels would need copied.
"""

from __future__ import annotations

import bisect
import functools
import threading
import warnings
from contextlib import contextmanager
from dataclasses import dataclass

import torch

VERIFIED = ("4.0.0b36",)  # flash-attn-4 releases whose interface's internal call layout this module was checked on
SPANS = (64, 128, 192, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)  # upper ends of max_seqlen spans
MAX_BATCH = 256  # the interface's BIN_BATCH_SEARCH_THRESH: past it, calls carry a scheduler table built per call

# roles of a recorded tensor argument: the call's own tensors, then the backward's scratch buffers
_ROLES = ("q", "k", "v", "out", "lse", "cu", "dout", "dq", "dk", "dv", "dpsum", "lse_log2", "dq_accum")
_INDEX = {name: i for i, name in enumerate(_ROLES)}

_lock = threading.Lock()
_classes: dict[tuple, "_Kernels | str"] = {}


@dataclass(frozen=True)
class _Call:
    """One recorded compiled-kernel call: ``fn(*args)`` with ``args[pos] = tensors[role]`` for ``subs``."""

    fn: object
    args: tuple
    subs: tuple[tuple[int, int], ...]

    def __call__(self, tensors: list) -> None:
        args = list(self.args)
        for pos, role in self.subs:
            args[pos] = tensors[role]
        self.fn(*args)


@dataclass(frozen=True)
class _Kernels:
    """The recorded calls of one class: ``forward`` (one call) and ``backward`` (preprocess, kernel, postprocess;
    ``None`` until a backward of the class was recorded). ``m_block`` / ``hdim_rounded``: the backward scratch
    buffers' geometry (``dpsum``, ``lse_log2``: ``[heads, padded]``; ``dq_accum``: ``[heads, padded * hdim_rounded]``
    fp32, ``padded``: :func:`_padded_rows`)."""

    forward: tuple[_Call, ...]
    backward: tuple[_Call, ...] | None
    m_block: int
    hdim_rounded: int

    def run_forward(self, q, k, v, out, lse, cu_seqlens) -> None:
        tensors = [q, k, v, out, lse, cu_seqlens]
        for call in self.forward:
            call(tensors)

    def scratch(self, total: int, heads: int, batch: int, device, cache: dict | None = None) -> tuple:
        """``(dpsum, lse_log2, dq_accum)`` for a backward of ``total`` tokens in ``batch`` sequences; from ``cache``
        (filled on a miss) when given: one set serves every backward of that geometry queued on one stream (the
        preprocess kernel writes all three before the others read them)."""
        padded = _padded_rows(total, batch, self.m_block)
        key = (padded, heads, self.hdim_rounded)
        found = None if cache is None else cache.get(key)
        if found is None:
            found = (torch.empty((heads, padded), dtype=torch.float32, device=device),
                     torch.empty((heads, padded), dtype=torch.float32, device=device),
                     torch.empty((heads, padded * self.hdim_rounded), dtype=torch.float32, device=device))
            if cache is not None:
                cache[key] = found
        return found

    def run_backward(self, dout, q, k, v, out, lse, cu_seqlens, dq, dk, dv, scratch: dict | None = None) -> None:
        total, heads, _ = q.shape
        tensors = [q, k, v, out, lse, cu_seqlens, dout, dq, dk, dv,
                   *self.scratch(total, heads, cu_seqlens.shape[0] - 1, q.device, scratch)]
        for call in self.backward:
            call(tensors)


def _padded_rows(total: int, batch: int, m_block: int) -> int:
    """Rows of the backward's scratch buffers for ``total`` tokens in ``batch`` sequences (the interface's: ``total +
    (batch + 1) * m_block - 1`` rounded down to a multiple of ``m_block``)."""
    return (total + (batch + 1) * m_block - 1) // m_block * m_block


@functools.lru_cache(maxsize=None)
def version_status() -> str | None:
    """``None`` when the installed FlashAttention-4 is a release this module reads (:data:`VERIFIED`)."""
    try:
        from importlib.metadata import version

        found = version("flash-attn-4")
    except Exception:  # noqa: BLE001 - not installed as that distribution
        return "flash-attn-4's version is unknown"
    return None if found in VERIFIED else f"flash-attn-4 {found} is not a release whose internals were checked " \
                                          f"({', '.join(VERIFIED)})"


def span_of(max_seqlen: int) -> tuple[int, int] | None:
    """``(lo, hi)``: the span of :data:`SPANS` holding ``max_seqlen`` (``None`` past the last)."""
    i = bisect.bisect_left(SPANS, max_seqlen)
    if i == len(SPANS):
        return None
    return (SPANS[i - 1] + 1 if i else 1), SPANS[i]


def aligned(t: torch.Tensor) -> bool:
    """Whether the kernels take ``t`` (``[total, heads, head_dim]``) as it is (the interface would copy it
    otherwise): contiguous last dimension, 16-byte aligned address and other strides, no broadcast dimension."""
    s0, s1, s2 = t.stride()
    per = 16 // t.element_size()
    return s2 == 1 and s0 and s1 and not (s0 % per or s1 % per or t.data_ptr() & 15)


def _key(q: torch.Tensor, window: int | None, scale: float, span: tuple[int, int]) -> tuple:
    _, heads, head_dim = q.shape
    return q.get_device(), q.dtype, heads, head_dim, window, scale, span


def kernels(q: torch.Tensor, window: int | None, scale: float, max_seqlen: int, batch: int,
            backward: bool) -> _Kernels | None:
    """The recorded kernels for calls like ``q`` (``[total, heads, head_dim]``) with ``window`` (symmetric; ``None``:
    global), ``scale``, ``max_seqlen`` and ``batch`` sequences, with the backward's when ``backward``; ``None``
    when the public entry point must run (:func:`class_status` says why). Records the class on first use."""
    span = span_of(max_seqlen)
    if span is None or batch > MAX_BATCH:
        return None
    key = _key(q, window, scale, span)
    found = _classes.get(key)
    if type(found) is _Kernels and (not backward or found.backward is not None):
        return found
    if isinstance(found, str) or torch.cuda.is_current_stream_capturing():
        return None
    with _lock:
        found = _classes.get(key)
        if found is None or (isinstance(found, _Kernels) and backward and found.backward is None):
            found = version_status()
            if found is None:
                try:
                    found = _record(q, window, float(scale), span, backward)
                except Exception as exc:  # noqa: BLE001 - the class takes the public entry point, and says why
                    found = f"recording failed ({exc.__class__.__name__}: {exc})"
            _classes[key] = found
    return found if isinstance(found, _Kernels) else None


def _size_status(num_seqs: int, max_seqlen: int) -> str | None:
    if span_of(max_seqlen) is None:
        return f"max_seqlen {max_seqlen} is past the last recorded span ({SPANS[-1]})"
    if num_seqs > MAX_BATCH:
        return f"more than {MAX_BATCH} sequences"
    return None


def workload_status(num_seqs: int, max_seqlen: int) -> str | None:
    """Why calls of this size take the public entry point, from what is known before any call (the release,
    ``max_seqlen``'s span, the batch size), or ``None``: how the attention policy weighs FlashAttention-4's host
    cost for eager calls (``dispatch.resolve``)."""
    return version_status() or _size_status(num_seqs, max_seqlen)


def class_status(q: torch.Tensor, window: int | None, scale: float, max_seqlen: int, batch: int) -> str | None:
    """Why calls like these take the public entry point (``None``: they are served directly, or not met yet)."""
    why = _size_status(batch, max_seqlen)
    if why is not None:
        return why
    found = _classes.get(_key(q, window, scale, span_of(max_seqlen)))
    return found if isinstance(found, str) else None


def forward(q, k, v, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
            backward: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """``(out [total, heads, head_dim], lse [heads, total] fp32)`` of the recorded forward, or ``None`` when the
    public entry point must run. ``backward``: record the class's backward too (before any graph capture).
    ``out`` / ``lse``: where to write them (``out`` as :func:`aligned` requires, ``lse`` contiguous and 16-byte
    aligned; a caller's workspace views), else new tensors."""
    got = kernels(q, window, scale, max_seqlen, cu_seqlens.shape[0] - 1, backward)
    if got is None or not (aligned(q) and aligned(k) and aligned(v) and (out is None or aligned(out))):
        return None
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    elif lse.shape != (q.shape[1], q.shape[0]) or lse.dtype != torch.float32 or not lse.is_contiguous() \
            or lse.data_ptr() & 15:
        raise ValueError(f"lse must be a contiguous, 16-byte aligned fp32 [{q.shape[1]}, {q.shape[0]}] tensor")
    got.run_forward(q, k, v, out, lse, cu_seqlens)
    return out, lse


def backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen: int, *, window: int | None, scale: float,
             grads: tuple | None = None, scratch: dict | None = None):
    """``(dq, dk, dv)`` of :func:`forward`'s call (``backward=True``) for the output gradient ``dout``: new
    contiguous tensors, or ``grads`` (three contiguous tensors shaped as ``q, k, v``, e.g. one set a caller reuses
    for every layer's backward on one stream). ``scratch``: a dict that keeps the backward's scratch buffers for
    later calls of the same geometry (see :meth:`_Kernels.scratch`). Raises ``RuntimeError`` when the class's
    backward was not recorded."""
    got = kernels(q, window, scale, max_seqlen, cu_seqlens.shape[0] - 1, True)
    if got is None or got.backward is None:
        raise RuntimeError("FlashAttention-4 direct backward of a call whose forward was not served directly")
    if not aligned(dout):  # (a contiguous but misaligned one too)
        dout = dout.clone(memory_format=torch.contiguous_format)
    if grads is None:
        grads = tuple(torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    elif any(g.shape != t.shape or g.dtype != t.dtype or not g.is_contiguous() or g.data_ptr() & 15
             for g, t in zip(grads, (q, k, v))):
        raise ValueError("grads must be three contiguous, 16-byte aligned tensors shaped as q, k, v")
    got.run_backward(dout, q, k, v, out, lse, cu_seqlens, *grads, scratch=scratch)
    return grads


# cutlass-dsl (4.8) warns at each FlashAttention-4 compile that an argument of flash_attn.cute's kernel classes (its
# ``AuxData``) "cannot be converted to a JitArgument"; flash_attn.cute passes it as a compile-time value and the kernels
# are unaffected (tests/gpu). flash_attn.cute's sm_90 kernels also use names cutlass-dsl has deprecated
# (``warpgroup.OperandMajorMode``): a DeprecationWarning attributed to flash_attn (matched by its message too, should
# cutlass-dsl's code generation run that code under another module name). A user's first packed call
# compiles (``pack()``'s validation included): without this, it would print the first, and under ``-W error`` (or
# ``warnings.simplefilter("error")``) either would fail the call.
_JIT_ARGUMENT_NOISE = r"Argument \w+ \(position \d+\) cannot be converted to a JitArgument"
_COMPILER_MODULES = r"(flash_attn|cutlass)(\.|$)"
_DEPRECATED_NAMES = r"warpgroup\.\w+ is deprecated"


@contextmanager
def quiet_compile():
    """Hide, around calls that compile FA4 kernels, cutlass-dsl's JitArgument conversion warning and the
    DeprecationWarnings that flash_attn.cute's and cutlass-dsl's own code raises; no other warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_JIT_ARGUMENT_NOISE, category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=_COMPILER_MODULES)
        warnings.filterwarnings("ignore", message=_DEPRECATED_NAMES, category=DeprecationWarning)
        yield


class _Recorder:
    """Wraps every compile cache of ``flash_attn.cute.interface`` for one recording (under :data:`_lock`)."""

    def __init__(self, interface):
        self.calls: list[tuple[object, tuple, dict]] = []
        self.owners = [fn for fn in vars(interface).values() if callable(fn) and hasattr(fn, "compile_cache")]
        self.saved = [fn.compile_cache for fn in self.owners]

    def __enter__(self):
        for fn, cache in zip(self.owners, self.saved):
            fn.compile_cache = _RecordingCache(cache, self.calls)
        return self

    def __exit__(self, *exc):
        for fn, cache in zip(self.owners, self.saved):
            fn.compile_cache = cache


class _RecordingCache:
    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def __contains__(self, key) -> bool:
        return key in self.inner

    def __setitem__(self, key, value) -> None:
        self.inner[key] = value

    def __getitem__(self, key):
        fn, calls = self.inner[key], self.calls

        def call(*args, **kwargs):
            calls.append((fn, args, kwargs))
            return fn(*args, **kwargs)

        return call


def _same_tensor(t: torch.Tensor) -> tuple:
    """What makes a tensor argument one of the call's own: its memory and layout (the interface passes
    ``detach()`` ed aliases of its inputs)."""
    return t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype


def _template(calls, tensors: dict) -> tuple[_Call, ...]:
    """:class:`_Call` s of recorded ``calls`` whose tensor arguments are all in ``tensors``
    (``{_same_tensor(t): role}``)."""
    out = []
    for fn, args, kwargs in calls:
        if kwargs:
            raise ValueError("a compiled kernel was called with keyword arguments")
        subs, kept = [], []
        for pos, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                role = tensors.get(_same_tensor(arg))
                if role is None:
                    raise ValueError(f"argument {pos} of a compiled kernel is a tensor the interface made itself")
                subs.append((pos, _INDEX[role]))
                kept.append(None)
            else:
                if isinstance(arg, (tuple, list)) and any(isinstance(a, torch.Tensor) for a in arg):
                    raise ValueError(f"argument {pos} of a compiled kernel holds tensors")
                kept.append(arg)
        out.append(_Call(fn, tuple(kept), tuple(subs)))
    return tuple(out)


def _record_one(q_like: torch.Tensor, length: int, window: int | None, scale: float, backward: bool, geometry,
                interface=None):
    """``(forward calls, backward calls or None)`` recorded on one synthetic sequence of ``length`` tokens."""
    if interface is None:
        from flash_attn.cute import interface
    heads, head_dim = q_like.shape[1], q_like.shape[2]
    device, dtype = q_like.device, q_like.dtype
    q, k, v = (torch.randn(length, heads, head_dim, device=device, dtype=dtype) for _ in range(3))
    cu = torch.tensor([0, length], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    lse = torch.empty((heads, length), dtype=torch.float32, device=device)
    roles = {_same_tensor(t): name for t, name in ((q, "q"), (k, "k"), (v, "v"), (out, "out"), (lse, "lse"),
                                                   (cu, "cu"))}
    with _Recorder(interface) as rec, quiet_compile():
        interface._flash_attn_fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length,
                                  max_seqlen_k=length, softmax_scale=scale, causal=False, window_size_left=window,
                                  window_size_right=window, out=out, lse=lse, return_lse=True)
    fwd = _template(rec.calls, roles)
    if len(fwd) != 1:
        raise ValueError(f"the forward made {len(fwd)} compiled-kernel calls (one expected)")
    if not backward:
        return fwd, None
    dout = torch.randn_like(q)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    roles.update({_same_tensor(t): name for t, name in ((dout, "dout"), (dq, "dq"), (dk, "dk"), (dv, "dv"))})
    with _Recorder(interface) as rec, quiet_compile():
        interface._flash_attn_bwd(q, k, v, out, dout, lse, scale, False, 0.0, window_size_left=window,
                                  window_size_right=window, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length,
                                  max_seqlen_k=length, dq=dq, dk=dk, dv=dv)
    # the scratch buffers: identified by shape and place, then checked against the geometry this module allocates
    m, hdim_rounded = geometry
    padded = _padded_rows(length, 1, m)
    expected = {"dpsum": (heads, padded), "lse_log2": (heads, padded), "dq_accum": (heads, padded * hdim_rounded)}
    pre = rec.calls[0][1] if rec.calls else ()
    if len(pre) < 6:
        raise ValueError("the backward's first compiled-kernel call is not the preprocess")
    for name, arg in zip(("dpsum", "lse_log2", "dq_accum"), (pre[2], pre[4], pre[5])):
        if not isinstance(arg, torch.Tensor) or tuple(arg.shape) != expected[name] or arg.dtype != torch.float32 \
                or not arg.is_contiguous():
            raise ValueError(f"the backward's {name} buffer is not the [{expected[name]}] fp32 one this module makes")
        roles[_same_tensor(arg)] = name
    return fwd, _template(rec.calls, roles)


def _record(q: torch.Tensor, window: int | None, scale: float, span: tuple[int, int], backward: bool) -> _Kernels | str:
    """Record the class of ``q`` at both ends of ``span`` (module docstring); the reason as a string otherwise."""
    from flash_attn.cute import interface

    major, minor = torch.cuda.get_device_capability(q.device)
    if major != 9:
        return f"sm_{major}{minor}: the direct calls were checked on sm_90 only"
    head_dim = q.shape[2]
    cfg = interface._tile_size_bwd_sm90(head_dim, head_dim, False, window is not None)
    multiple = 64 if cfg.dKV_swapAB else 32  # the interface's hdim_multiple_of on sm_90
    geometry = (cfg.m_block_size, -(-head_dim // multiple) * multiple)
    with torch.cuda.device(q.device), torch.no_grad():
        ends = [_record_one(q, length, window, scale, backward, geometry) for length in span]
    (fwd, bwd), (fwd2, bwd2) = ends
    if not _same(fwd, fwd2) or (backward and not _same(bwd, bwd2)):
        return f"the kernels differ across max_seqlen {span[0]}..{span[1]}"
    return _Kernels(fwd, bwd, geometry[0], geometry[1])


def _same(a: tuple[_Call, ...], b: tuple[_Call, ...]) -> bool:
    return len(a) == len(b) and all(x.fn is y.fn and x.subs == y.subs and _eq(x.args, y.args) for x, y in zip(a, b))


def _eq(a: tuple, b: tuple) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an argument without a plain equality
        return False


__all__ = ["MAX_BATCH", "SPANS", "VERIFIED", "aligned", "backward", "class_status", "forward", "kernels", "span_of",
           "version_status", "workload_status"]
