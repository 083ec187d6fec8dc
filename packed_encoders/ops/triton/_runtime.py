"""How a Triton kernel is launched: compiled for CUDA tensors, interpreted for CPU tensors.

Triton decides between compiling and interpreting when ``@triton.jit`` runs (it reads
``TRITON_INTERPRET`` at decoration time, for its own standard library too), which would tie the mode to
import order. The kernels here are plain Python functions wrapped on first use in both forms: a
``JITFunction`` for CUDA tensors and an ``InterpretedFunction`` for CPU tensors, the latter accepted
only while ``TRITON_INTERPRET=1`` is set (read per call). An interpreted launch runs inside
:func:`_interpreter_fixes`, which makes Triton's interpreter usable whatever mode Triton was imported
in and leaves no trace afterwards, so one process can run compiled GPU kernels and interpreted CPU
tests side by side. Kernels call no jitted helpers of their own. The converse does not hold: Triton
gives its standard library its form once, when ``triton`` is first imported, and a process that imported
it with ``TRITON_INTERPRET=1`` cannot compile (the test suite's conftest imports it with the variable unset).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Callable

import numpy as np
import torch
import triton.language as tl
import triton.runtime.interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from . import interpret_enabled


# The Triton releases whose interpreter internals :func:`_interpreter_fixes` is checked with: 3.6 (the H200 image's,
# the lock's) and 3.9 (the test extra's newest).
INTERPRETER_TRITON = ("3.6.", "3.9.")


def interpreter_unavailable() -> str | None:
    """Why CPU tensors cannot be interpreted now (``None`` when they can)."""
    if not interpret_enabled():
        return "TRITON_INTERPRET is not set"
    return unsupported_interpreter()


def unsupported_interpreter() -> str | None:
    """Why this Triton's interpreter is not supported (``None`` when it is one of :data:`INTERPRETER_TRITON`)."""
    import triton

    if triton.__version__.startswith(INTERPRETER_TRITON):
        return None
    checked = ", ".join(v.rstrip(".") for v in INTERPRETER_TRITON)
    return (f"interpreting needs Triton {checked} (this is {triton.__version__}): the interpreter fixes patch "
            "internals that change between releases")


class Kernel:
    """A kernel source with a compiled and an interpreted form, each built once on first use.

    ``do_not_specialize`` names the runtime integer arguments (token counts) that Triton must not
    specialise on (value 1, divisibility by 16), so one compiled artifact serves every batch.
    """

    def __init__(self, fn, do_not_specialize=()):
        self.fn = fn
        self.do_not_specialize = tuple(do_not_specialize)
        self._compiled = None
        self._interpreted = None

    def on(self, t: torch.Tensor):
        """The launchable form for the device of ``t``."""
        if t.device.type == "cuda":
            if self._compiled is None:
                self._compiled = FastLauncher(JITFunction(self.fn, do_not_specialize=self.do_not_specialize))
            return self._compiled
        if t.device.type == "cpu" and interpreter_unavailable() is None:
            if self._interpreted is None:
                self._interpreted = _Interpreted(InterpretedFunction(self.fn, do_not_specialize=self.do_not_specialize))
            return self._interpreted
        why = interpreter_unavailable() if t.device.type == "cpu" else f"{t.device.type} tensors"
        raise RuntimeError(f"Triton kernels run on CUDA tensors, or on CPU tensors when interpreted; here: {why}")


I32_END = 1 << 31  # a launch signature holds ``n < I32_END`` for an unspecialised int (Triton keys its 32-bit range)


# The Triton releases whose C launcher (``CompiledKernel.run.launch``) the fast launcher calls, and how each takes
# its arguments; other releases take Triton's own path. Each convention is checked byte for byte against Triton's
# own launch over a recording libcuda (tests/test_fast_launch_record.py); "flat" on the H200 too.
#   "flat" (3.6): launch(g0, g1, g2, stream, function, cooperative, pdl, global_scratch, profile_scratch,
#                 kernel_metadata, launch_metadata, enter_hook, exit_hook, *args)
#   "packed" (3.7 to 3.9): launch(g0, g1, g2, stream, function, cooperative, pdl, kernel_metadata, launch_metadata,
#                 enter_hook, exit_hook, global_scratch, profile_scratch, arg_annotations, kernel_signature, args)
# ``args``: every parameter in order, constexprs included, a tensor as its ``data_ptr()`` (both launchers take an
# integer as the device pointer as it is).
FAST_LAUNCH_TRITON = {"3.6.": "flat", "3.7.": "packed", "3.8.": "packed", "3.9.": "packed"}


def launch_convention() -> str | None:
    """How this Triton's C launcher takes its arguments (a value of :data:`FAST_LAUNCH_TRITON`), ``None`` for a
    release the fast launcher does not follow."""
    import triton

    for release, convention in FAST_LAUNCH_TRITON.items():
        if triton.__version__.startswith(release):
            return convention
    return None


def _fast_launch_enabled() -> bool:
    return _switch_or_release_off() is None


def _switch_or_release_off() -> str | None:
    """Why the fast launcher is off for the process: the switch as the last ``pack()`` set it
    (``set_fast_launch``), or a Triton release other than :data:`FAST_LAUNCH_TRITON`; ``None`` when on."""
    import triton

    from . import FAST_LAUNCH

    if not FAST_LAUNCH:
        return "PACKED_ENCODERS_TRITON_FAST_LAUNCH=0 (as the last pack() read it)"
    if launch_convention() is None:
        return (f"Triton {triton.__version__}: the fast launcher follows the C launcher of Triton "
                f"{' / '.join(v.rstrip('.') for v in FAST_LAUNCH_TRITON)}; other releases launch through Triton's "
                "own path")
    return None


def fast_launch_off() -> str | None:
    """Why the fast launcher's cached and :class:`Bound` launches do not run now (``None`` when they may): the
    switch ``pack()`` read, a Triton release other than :data:`FAST_LAUNCH_TRITON`, or launch hooks (a profiler's).
    The raw-pointer runs (``model.pointers``, ``model.stack_pointers``) need them; for ``describe()``."""
    why = _switch_or_release_off()
    if why is None and _hooks_active():
        return "Triton launch hooks are set (a profiler's)"
    return why


def compile_options() -> dict:
    """Triton compile options every CUDA launch here passes, so the kernels compile as checked on the H200.

    FP fusion (multiply-add contracted into FMA): on, as every Triton before 3.10 defaults to. Triton 3.9 (torch
    2.15's) warns when a launch leaves it to the default, which Triton 3.10 turns off (other rounding, slower
    kernels). A ``TRITON_DEFAULT_FP_FUSION`` that the user set still decides (and
    ``TRITON_FORCE_DISABLE_FP_FUSION`` overrides either in Triton)."""
    return {} if "TRITON_DEFAULT_FP_FUSION" in os.environ else {"enable_fp_fusion": True}


_KNOBS = None


def _hooks_active() -> bool:
    global _KNOBS
    if _KNOBS is None:
        from triton import knobs

        _KNOBS = knobs.runtime
    for hook in (_KNOBS.launch_enter_hook, _KNOBS.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


class FastLauncher:
    """``launcher[grid](*args, **kwargs)`` for a ``JITFunction`` on CUDA, with a cheaper per-call path.

    Triton's own launch binds the arguments, specialises each one and hashes the result on every call (tens of
    microseconds of host time on the H200 machine's CPU; a packed forward launches ~110 kernels). Here the first
    call of each specialisation goes through Triton (``JITFunction.run``, which compiles and returns the
    ``CompiledKernel``); later calls with the same key launch that kernel directly. The key holds what Triton
    specialises on: the device, each tensor's dtype and 16-byte alignment, each specialised integer's
    ``== 1`` / ``% 16 == 0`` / 32-bit range (range only for ``do_not_specialize`` ones), floats as floats, and
    the keyword arguments (constexprs, ``num_warps``, ``num_stages``) by value. Kernels here read no mutable
    globals.

    A cached launch calls the kernel's C launcher itself (``CudaLauncher.launch``, skipping the Python
    ``CudaLauncher.__call__`` frame, for kernels that need no scratch memory) with each tensor passed as its
    ``data_ptr()``: the C launcher takes an integer as the device pointer as it is, where for a tensor it calls
    ``data_ptr`` and asks the driver about the pointer (``cuPointerGetAttribute``), one driver call per tensor
    argument on every launch. A tensor that is not on a CUDA device (a CPU weight beside CUDA activations) sends
    the launch down Triton's path, whose pointer check raises an error naming the argument.

    Launch hooks (profilers such as proton) and pre-run hooks take Triton's path; so does everything when
    ``FastLauncher.enabled`` is False (read per call; decided on first use from the switch ``pack()`` sets,
    ``PACKED_ENCODERS_TRITON_FAST_LAUNCH`` in its ``Tuning`` (``set_fast_launch``), and False on Triton releases
    other than :data:`FAST_LAUNCH_TRITON`).
    """

    enabled: bool | None = None  # class-wide switch; None: decided at the next launch (_fast_launch_enabled)

    def __init__(self, jit: JITFunction):
        self.jit = jit
        self.names = tuple(p.name for p in jit.params)
        self.specialize = tuple(not (p.do_not_specialize or p.is_constexpr) for p in jit.params)
        self.align = tuple(not p.do_not_specialize_on_alignment for p in jit.params)
        self.cache: dict = {}

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def key(self, device: int, args: tuple, kwargs: dict) -> tuple:
        return self._key_and_args(device, args, kwargs)[0]

    def _key_and_args(self, device: int, args: tuple, kwargs: dict) -> tuple[tuple, list]:
        """``(key, call_args)``: the specialisation key and the arguments with each tensor as its data pointer.
        Raises ``AttributeError`` / ``TypeError`` for an argument that is none of int, float, bool, None or a
        CUDA tensor (the caller then takes Triton's path)."""
        parts = []
        call = []
        for a, spec, align in zip(args, self.specialize, self.align):
            t = type(a)
            if t is int:
                fits = -2147483648 <= a < 2147483648
                parts.append((fits, a == 1, a % 16 == 0) if spec else fits)
            elif t is float:
                parts.append(0.5)
            elif a is None or t is bool:
                parts.append(a)
            else:  # a tensor
                if not a.is_cuda:  # Triton's path names it (the C launcher would take a host pointer as it is)
                    raise TypeError("a tensor that is not on a CUDA device")
                ptr = a.data_ptr()
                parts.append((a.dtype, align and ptr % 16 == 0))
                call.append(ptr)
                continue
            call.append(a)
        return (device, len(args), tuple(parts), tuple(kwargs.items())), call

    def triton(self, grid, args: tuple, kwargs: dict):
        """Triton's own launch (compiling if needed), with :func:`compile_options` where the call sets none."""
        return self.jit[grid](*args, **{**compile_options(), **kwargs})

    def launch(self, grid, *args, **kwargs):
        enabled = FastLauncher.enabled
        if enabled is None:
            enabled = FastLauncher.enabled = _fast_launch_enabled()
        if not enabled or self.jit.pre_run_hooks or _hooks_active():
            return self.triton(grid, args, kwargs)
        device = torch._C._cuda_getDevice()
        try:
            key, call = self._key_and_args(device, args, kwargs)
            entry = self.cache.get(key)
        except (TypeError, AttributeError):  # an unhashable or unexpected argument: Triton's path
            return self.triton(grid, args, kwargs)
        if entry is None:
            compiled = self.triton(grid, args, kwargs)
            tail = self.names[len(args):]
            if compiled is not None and all(n in kwargs for n in tail):
                self.cache[key] = (compiled, tail, _c_launch(compiled))
            return compiled
        compiled, tail, direct = entry
        if tail:
            call.extend(kwargs[n] for n in tail)
        n = len(grid)
        stream = torch._C._cuda_getCurrentRawStream(device)
        if direct is not None:
            c_launch, coop, pdl, packed = direct
            if packed is None:
                c_launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function, coop,
                         pdl, None, None, compiled.packed_metadata, None, None, None, *call)
            else:
                c_launch(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function, coop,
                         pdl, compiled.packed_metadata, None, None, None, None, None, packed[0], packed[1], call)
        else:
            compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, compiled.function,
                         compiled.packed_metadata, None, None, None, *call)
        return compiled

    def bind(self, grid, *args, **kwargs) -> "Bound | None":
        """Launch as ``self[grid](*args, **kwargs)`` and return that specialisation as a :class:`Bound`, or
        ``None`` where it cannot be bound: the fast launcher off, launch hooks on, a kernel needing scratch
        memory, an argument of another kind than int, float, bool, None or CUDA tensor, or a tensor whose
        pointer is not 16-byte aligned (a bound launch is valid only for calls whose pointers all are)."""
        self.launch(grid, *args, **kwargs)
        if not bound_ok() or self.jit.pre_run_hooks:
            return None
        try:
            entry = self.cache.get(self.key(torch._C._cuda_getDevice(), args, kwargs))
        except (TypeError, AttributeError):
            return None
        if entry is None or entry[2] is None:
            return None
        for a in args:
            if a is not None and type(a) not in (int, float, bool) and a.data_ptr() % 16:
                return None
        compiled, tail, direct = entry
        return Bound(direct, compiled, tuple(kwargs[n] for n in tail))


class Bound:
    """One compiled specialisation of a kernel, launched with raw device pointers: ``bound(g0, g1, g2, stream,
    *args)``, ``args`` in the kernel's positional order with each tensor as its ``data_ptr()`` (the keyword
    arguments, constexprs included, are the bound ones).

    From :meth:`FastLauncher.bind`. The caller keeps it under its own signature, a tuple of every fact the
    specialisation depends on (dtypes, constexprs, launch options, the values of specialised integers or their
    ``== 1`` / ``% 16`` classes, and that every pointer is 16-byte aligned), and launches through it only while
    :func:`bound_ok` and on the current device. That skips the per-argument key of :meth:`FastLauncher.launch`
    (about half of a cached launch's time under cProfile on the H200 machine)."""

    __slots__ = ("c_launch", "function", "coop", "pdl", "packed", "metadata", "tail")

    def __init__(self, direct, compiled, tail: tuple):
        self.c_launch, self.coop, self.pdl, self.packed = direct
        self.function = compiled.function
        self.metadata = compiled.packed_metadata
        self.tail = tail

    def __call__(self, g0: int, g1: int, g2: int, stream: int, *args) -> None:
        if self.packed is None:
            self.c_launch(g0, g1, g2, stream, self.function, self.coop, self.pdl, None, None, self.metadata, None,
                          None, None, *args, *self.tail)
        else:
            self.c_launch(g0, g1, g2, stream, self.function, self.coop, self.pdl, self.metadata, None, None, None,
                          None, None, self.packed[0], self.packed[1], args + self.tail)

    def at(self, g0: int, g1: int, g2: int, stream: int) -> Callable[..., None]:
        """``launch(*args)``: this specialisation with its grid and stream fixed, for a caller launching it many
        times with other pointers (one Python frame and the C launch per call)."""
        c_launch, function, coop, pdl, metadata, tail = (self.c_launch, self.function, self.coop, self.pdl,
                                                          self.metadata, self.tail)
        if self.packed is None:
            def launch(*args) -> None:
                c_launch(g0, g1, g2, stream, function, coop, pdl, None, None, metadata, None, None, None, *args,
                         *tail)
        else:
            annotations, signature = self.packed

            def launch(*args) -> None:
                c_launch(g0, g1, g2, stream, function, coop, pdl, metadata, None, None, None, None, None, annotations,
                         signature, args + tail)

        return launch


def bound_ok() -> bool:
    """Whether :class:`Bound` launches may run now: the fast launcher on and no launch hooks (a profiler's)."""
    return bool(FastLauncher.enabled) and not _hooks_active()


def or_all(pointers) -> int:
    """Every pointer or-ed together: 16-byte aligned all when its low four bits are clear (``not or_all(p) & 15``),
    the last entry of a launch signature."""
    bits = 0
    for p in pointers:
        bits |= p
    return bits


def launch_cached(cache: dict, sig, kern, ref: torch.Tensor, grid: tuple, args: tuple, kwargs: dict,
                  fast_args: tuple | None) -> None:
    """Launch ``kern[grid](*args, **kwargs)`` (``kern``: a :class:`Kernel`, or the launcher of ``ref``'s device),
    through the :class:`Bound` that ``cache`` holds under ``sig`` when there is one.

    ``sig`` must hold every fact the kernel's specialisation depends on (see :class:`Bound`), the last of them
    whether every pointer in ``args`` is 16-byte aligned; ``fast_args``: ``args`` with each tensor as its
    ``data_ptr()`` (``None`` for tensors not on CUDA: the ordinary launch). The first launch of a signature goes
    through Triton (compiling if needed) and binds it, under ``(device index, sig)``; later ones call the compiled
    kernel's C launcher directly (``False`` there: it cannot be bound, e.g. it needs scratch memory; the
    launcher's own path serves it without trying again)."""
    if fast_args is not None:
        device = ref.get_device()
        bound = cache.get((device, sig))  # a compiled kernel belongs to its device's context
        if bound:
            if device == torch._C._cuda_getDevice() and bound_ok():
                n = len(grid)
                bound(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                      torch._C._cuda_getCurrentRawStream(device), *fast_args)
                return
    with device_guard(ref):
        launcher = kern.on(ref) if isinstance(kern, Kernel) else kern
        if fast_args is not None and sig[-1] and bound is None and isinstance(launcher, FastLauncher):
            bound = launcher.bind(grid, *args, **kwargs)
            if len(cache) > 256:  # signatures are few per model; a bound on memory, not a working limit
                cache.clear()
            if bound is not None:
                cache[(ref.get_device(), sig)] = bound
            elif bound_ok():  # it cannot be bound (a kernel needing scratch memory): the launcher's path from now on
                cache[(ref.get_device(), sig)] = False
        else:
            launcher[grid](*args, **kwargs)


def _c_launch(compiled):
    """``(launch, launch_cooperative_grid, launch_pdl, packed)`` of a compiled kernel's C launcher when it needs no
    scratch memory (``CudaLauncher.__call__`` then passes ``None`` for both scratch buffers) and nothing else of
    ``CudaLauncher.__call__`` (Triton's global sanitizer), else ``None`` (launch through ``compiled.run``).
    ``packed``: ``(arg_annotations, kernel_signature)`` under the "packed" convention (:data:`FAST_LAUNCH_TRITON`),
    ``None`` under "flat"."""
    runner = getattr(compiled, "run", None)
    c_launch = getattr(runner, "launch", None)
    if c_launch is None or getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1):
        return None
    packed = None
    if launch_convention() == "packed":
        if getattr(runner, "gsan_enabled", False):
            return None
        try:
            packed = (runner.arg_annotations, runner.kernel_signature)
        except AttributeError:
            return None
    return c_launch, runner.launch_cooperative_grid, runner.launch_pdl, packed


class _Interpreted:
    """``fn[grid](...)`` for an ``InterpretedFunction``, run inside :func:`_interpreter_fixes`."""

    _lock = threading.Lock()  # the fixes patch module state: one interpreted launch at a time

    def __init__(self, fn: InterpretedFunction):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            with self._lock, _interpreter_fixes():
                return self.fn[grid](*args, **kwargs)
        return launch


_STDLIB = (tl, tl.core, tl.standard, tl.math)
_INTERPRETED_STDLIB: dict[int, InterpretedFunction] = {}


def _interpreted_form(fn: JITFunction) -> InterpretedFunction:
    # one object per jitted function: the interpreter recognises reductions by identity (_sum_combine)
    form = _INTERPRETED_STDLIB.get(id(fn))
    if form is None:
        form = _INTERPRETED_STDLIB[id(fn)] = InterpretedFunction(fn.fn)
    return form


class _TrackedScope:
    """A patch scope of the interpreter that, when restored, first restores every scope opened after it.

    The interpreter opens a scope per interpreted call; those of nested standard-library calls are never
    restored (harmless when a process only interprets). Restoring last-in first-out returns every patched
    attribute to its true original."""

    def __init__(self, inner, stack: list):
        self.inner, self.stack = inner, stack

    def restore(self):
        while self.stack and self.stack[-1] is not self:
            self.stack.pop().inner.restore()
        if self.stack:
            self.stack.pop()
        self.inner.restore()


@contextlib.contextmanager
def _interpreter_fixes():
    """Held around one interpreted launch; every change is undone on exit.

    - Triton's standard-library functions (``tl.sum``, ``tl.sigmoid``) are interpreted forms even when
      Triton was imported compiled (otherwise calling them raises "Cannot call @triton.jit'd outside of
      the scope of a kernel"), and the interpreter's patch scopes are restored last-in first-out.
    - Triton 3.6's interpreter holds scalars as 1-element arrays and converts loop bounds with
      ``int(array)``, which NumPy >= 2.3 refuses; the index conversion takes the single element instead.
    - The interpreter casts fp32 -> bf16 by truncating the mantissa, while compiled Triton rounds to
      nearest even (``cvt.rn.bf16.f32``); the cast uses torch's round-to-nearest-even so that interpreted
      results carry the rounding the GPU will.
    - A comparison's result keeps its operands' NumPy dtype as its own, so a scalar one (``h < H``) broadcast
      into a block mask holds int32 0/1; Triton 3.9's loads and stores refuse a mask that is not bool (3.6's
      took nonzero as true), so masks reach them as bool.
    """
    scope = _interp._LangPatchScope()
    stack: list[_TrackedScope] = []
    original_patch_lang = _interp._patch_lang
    original_patch_tensor = _interp._patch_lang_tensor
    original_cast = _interp.InterpreterBuilder.cast_impl
    original_load = _interp.InterpreterBuilder.create_masked_load
    original_store = _interp.InterpreterBuilder.create_masked_store

    def patch_lang(fn):
        tracked = _TrackedScope(original_patch_lang(fn), stack)
        stack.append(tracked)
        return tracked

    def patch_tensor(tensor, inner_scope):
        original_patch_tensor(tensor, inner_scope)
        inner_scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16)
            return _interp.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), dst_type.scalar)
        return original_cast(self, src, dst_type)

    def bool_mask(mask):
        return mask if mask.data.dtype == np.bool_ else _interp.TensorHandle(mask.data != 0, tl.int1)

    def masked_load(self, ptrs, mask, *rest):
        return original_load(self, ptrs, bool_mask(mask), *rest)

    def masked_store(self, ptrs, value, mask, *rest):
        return original_store(self, ptrs, value, bool_mask(mask), *rest)

    for module in _STDLIB:
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                scope.set_attr(module, name, _interpreted_form(value))
    scope.set_attr(_interp, "_patch_lang", patch_lang)
    scope.set_attr(_interp, "_patch_lang_tensor", patch_tensor)
    scope.set_attr(_interp.InterpreterBuilder, "cast_impl", cast_impl)
    scope.set_attr(_interp.InterpreterBuilder, "create_masked_load", masked_load)
    scope.set_attr(_interp.InterpreterBuilder, "create_masked_store", masked_store)
    try:
        yield
    finally:
        while stack:
            stack.pop().inner.restore()
        scope.restore()


def kernel(*, do_not_specialize=()):
    """Decorator: ``@kernel(do_not_specialize=("n_rows",))`` on a Triton kernel body."""
    return lambda fn: Kernel(fn, do_not_specialize)


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(t: torch.Tensor, work_items: int, per_sm: int = 4) -> int:
    """How many programs a persistent kernel launches: ``per_sm`` per multiprocessor on CUDA,
    a handful when interpreted, never more than the work items (and at least 1)."""
    if t.device.type == "cuda":
        cap = per_sm * sm_count(t.device.index if t.device.index is not None else torch.cuda.current_device())
    else:
        cap = 3
    return max(1, min(cap, work_items))


def device_guard(t: torch.Tensor):
    """Triton launches on the current device's current stream: make ``t``'s device current (nothing to do, and
    no context switch paid, when it already is)."""
    device = t.device
    # torch._C._cuda_getDevice: torch.cuda.current_device() without its Python-side lazy-init checks (a CUDA
    # tensor exists, so CUDA is initialised)
    if device.type == "cuda" and device.index != torch._C._cuda_getDevice():
        return torch.cuda.device(device)
    return _NULL


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


_NULL = _Null()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
