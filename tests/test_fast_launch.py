"""The Triton fast launcher's cache key and routing (pure host logic; the GPU tests launch through it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from packed_encoders.ops.triton import _runtime as R  # noqa: E402


def _param(name, dns=False, constexpr=False):
    return SimpleNamespace(name=name, do_not_specialize=dns, is_constexpr=constexpr,
                           do_not_specialize_on_alignment=False)


class Cuda:
    """A CPU tensor standing for a CUDA one (what the key and the launch read of a tensor: dtype, data pointer,
    device type)."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self):
        return self.t.data_ptr()

    def get_device(self):
        return 0


class FakeCompiled:
    """Stands for a ``CompiledKernel`` whose ``run`` is a plain callable (launches through ``compiled.run``)."""

    function, packed_metadata = "fn", "meta"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class FakeCudaLauncher:
    """Stands for Triton's ``CudaLauncher``: ``launch`` is its C launcher; ``scratch`` bytes force its own path."""

    launch_cooperative_grid, launch_pdl = 0, 1

    def __init__(self, scratch=0):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.calls, self.launches = [], []

    def __call__(self, *args):
        self.calls.append(args)

    def launch(self, *args):
        self.launches.append(args)


class FakeCompiledC:
    function, packed_metadata = "fn", "meta"

    def __init__(self, scratch=0):
        self.run = FakeCudaLauncher(scratch)


class FakeJit:
    """Records Triton-path launches; returns one compiled kernel per distinct key it is asked for."""

    def __init__(self):
        self.params = [_param("X"), _param("n_rows", dns=True), _param("stride"), _param("eps"),
                       _param("BLOCK", constexpr=True)]
        self.pre_run_hooks = []
        self.slow_calls = 0
        self.slow_kwargs = []
        self.compiled = FakeCompiled()

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow_calls += 1
            self.slow_kwargs.append(kwargs)
            return self.compiled
        return run


@pytest.fixture
def launcher(monkeypatch):
    import triton

    # the fakes stand for Triton 3.6's C launcher, whatever Triton is installed (each convention:
    # test_cached_launch_calls_the_c_launcher_unless_scratch_is_needed)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 1234, raising=False)
    jit = FakeJit()
    fast = R.FastLauncher(jit)
    monkeypatch.setattr(R.FastLauncher, "enabled", True)
    return jit, fast


def test_key_separates_what_triton_specialises_on(launcher):
    _, fast = launcher
    t = torch.zeros(64, dtype=torch.bfloat16)
    x = Cuda(t)
    kw = {"BLOCK": 64}
    base = fast.key(0, (x, 100, 32, 1e-5), kw)
    assert fast.key(0, (x, 7, 32, 1e-5), kw) == base                     # n_rows is not specialised on
    assert fast.key(0, (x, 100, 32, 1e-6), kw) == base                   # floats are not specialised on
    assert fast.key(0, (x, 1 << 40, 32, 1e-5), kw) != base               # ... but its 32/64-bit type is
    assert fast.key(0, (Cuda(t[1:]), 100, 32, 1e-5), kw) != base         # 16-byte alignment
    assert fast.key(0, (Cuda(t.half()), 100, 32, 1e-5), kw) != base      # dtype
    assert fast.key(0, (x, 100, 48, 1e-5), kw) == base                   # both divisible by 16
    assert fast.key(0, (x, 100, 33, 1e-5), kw) != base                   # divisibility by 16
    assert fast.key(0, (x, 100, 1, 1e-5), kw) != fast.key(0, (x, 100, 33, 1e-5), kw)   # == 1
    assert fast.key(0, (x, 100, 32, 1e-5), {"BLOCK": 128}) != base       # constexprs by value
    assert fast.key(1, (x, 100, 32, 1e-5), kw) != base                   # device
    assert fast.key(0, (x, 100, 32, None), kw) != base


def test_first_call_goes_through_triton_then_direct(launcher):
    jit, fast = launcher
    t = torch.zeros(64, dtype=torch.float32)
    x = Cuda(t)
    fast[(3,)](x, 10, 16, 1e-5, BLOCK=64)
    assert jit.slow_calls == 1 and jit.compiled.runs == []
    fast[(5, 2)](x, 11, 32, 1e-5, BLOCK=64)
    assert jit.slow_calls == 1
    (args,) = jit.compiled.runs
    # grid padded to 3-D, the current raw stream, the compiled function, then every argument incl. constexprs
    # tensors go as their data pointers (the C launcher takes an int as the pointer, with no driver query)
    assert args[:6] == (5, 2, 1, 1234, "fn", "meta") and args[9:] == (x.data_ptr(), 11, 32, 1e-5, 64)
    fast[(5,)](Cuda(t[1:]), 11, 32, 1e-5, BLOCK=64)                       # misaligned: a new specialisation
    assert jit.slow_calls == 2
    fast[(5,)](t, 11, 32, 1e-5, BLOCK=64)  # a tensor not on CUDA: Triton's path (its pointer check names it)
    assert jit.slow_calls == 3 and len(jit.compiled.runs) == 1


@pytest.mark.parametrize("convention", ["flat", "packed"])
@pytest.mark.parametrize("scratch", [0, 64])
def test_cached_launch_calls_the_c_launcher_unless_scratch_is_needed(launcher, scratch, convention, monkeypatch):
    """Each C launcher convention, as the fast launcher calls it (checked against Triton's real launchers in
    tests/test_fast_launch_record.py)."""
    monkeypatch.setattr(R, "launch_convention", lambda: convention)
    jit, fast = launcher
    jit.compiled = FakeCompiledC(scratch)
    jit.compiled.run.arg_annotations, jit.compiled.run.kernel_signature = "annotations", b"signature"
    x = Cuda(torch.zeros(64, dtype=torch.float32))
    fast[(3,)](x, 10, 16, 1e-5, BLOCK=64)
    fast[(4,)](x, 10, 16, 1e-5, BLOCK=64)
    runner = jit.compiled.run
    args = (x.data_ptr(), 10, 16, 1e-5, 64)
    if scratch:  # CudaLauncher.__call__ allocates the scratch buffers: its own path
        assert runner.launches == [] and runner.calls == [(4, 1, 1, 1234, "fn", "meta", None, None, None, *args)]
    elif convention == "flat":  # grid, stream, function, cooperative / PDL flags, no scratch, metadata, no hooks
        assert runner.calls == [] and runner.launches == [(4, 1, 1, 1234, "fn", 0, 1, None, None, "meta", None,
                                                           None, None, *args)]
    else:  # ..., metadata, no hooks, no scratch, the argument annotations and signature, the arguments as one list
        assert runner.calls == [] and runner.launches == [(4, 1, 1, 1234, "fn", 0, 1, "meta", None, None, None,
                                                           None, None, "annotations", b"signature", list(args))]


def test_hooks_kill_switch_and_other_releases_take_triton_path(launcher, monkeypatch):
    jit, fast = launcher
    x = Cuda(torch.zeros(64))
    jit.pre_run_hooks.append(lambda *a, **k: None)
    for _ in range(2):
        fast[(1,)](x, 1, 16, 1.0, BLOCK=64)
    assert jit.slow_calls == 2 and jit.compiled.runs == []
    jit.pre_run_hooks.clear()
    monkeypatch.setattr(R.FastLauncher, "enabled", False)
    fast[(1,)](x, 1, 16, 1.0, BLOCK=64)
    assert jit.slow_calls == 3 and jit.compiled.runs == []
    from packed_encoders.ops import triton as T

    monkeypatch.setattr(T, "FAST_LAUNCH", True)
    T.set_fast_launch(False)  # what pack() does with PACKED_ENCODERS_TRITON_FAST_LAUNCH=0
    assert R.FastLauncher.enabled is None and R._fast_launch_enabled() is False
    fast[(1,)](x, 1, 16, 1.0, BLOCK=64)
    assert R.FastLauncher.enabled is False and jit.slow_calls == 4
    T.set_fast_launch(True)
    import triton

    monkeypatch.setattr(triton, "__version__", "3.10.0")
    assert R._fast_launch_enabled() is False
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert R._fast_launch_enabled() is True


def test_bound_launches_skip_the_key_per_signature(launcher, monkeypatch):
    jit, fast = launcher
    jit.compiled = FakeCompiledC()
    runner = jit.compiled.run
    t = torch.zeros(64, dtype=torch.float32)
    cache = {}

    def call(x, n):
        p = x.data_ptr()
        R.launch_cached(cache, (torch.float32, 16, 64, not p & 15), fast, x, (3, 2), (x, n, 16, 1e-5),
                        {"BLOCK": 64}, (p, n, 16, 1e-5))

    x = Cuda(t)
    call(x, 10)  # the first launch of a signature: Triton's path, then bound
    assert jit.slow_calls == 1 and runner.launches == [] and len(cache) == 1
    call(x, 11)  # the C launcher with the caller's pointers and ints, the bound constexprs appended
    assert jit.slow_calls == 1 and runner.launches == [(3, 2, 1, 1234, "fn", 0, 1, None, None, "meta", None, None,
                                                        None, x.data_ptr(), 11, 16, 1e-5, 64)]
    misaligned = Cuda(t[1:])
    call(misaligned, 11)
    call(misaligned, 11)  # never bound (its signature says unaligned): the launcher's own cached path
    assert len(cache) == 1 and jit.slow_calls == 2 and runner.launches[-1][13] == misaligned.data_ptr()
    monkeypatch.setattr(R.FastLauncher, "enabled", False)  # the kill switch: Triton's path again
    call(x, 12)
    assert jit.slow_calls == 3 and len(runner.launches) == 2
    monkeypatch.setattr(R.FastLauncher, "enabled", True)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)  # another device is current
    monkeypatch.setattr(R, "device_guard", lambda ref: R._NULL)  # (no CUDA here to switch devices on)
    call(x, 13)
    assert len(runner.launches) == 2  # not the bound launch (it would run on the current device's stream)


def test_bind_refuses_what_a_signature_cannot_stand_for(launcher):
    jit, fast = launcher
    t = torch.zeros(64, dtype=torch.float32)
    jit.compiled = FakeCompiledC(scratch=64)  # scratch memory: CudaLauncher.__call__ allocates it
    assert fast.bind((1,), Cuda(t), 10, 16, 1e-5, BLOCK=64) is None
    jit.compiled = FakeCompiledC()
    fast.cache.clear()
    assert fast.bind((1,), Cuda(t[1:]), 10, 16, 1e-5, BLOCK=64) is None  # a pointer not 16-byte aligned
    bound = fast.bind((1,), Cuda(t), 10, 16, 1e-5, BLOCK=64)
    assert bound is not None and bound.tail == (64,)


def test_an_unbindable_signature_is_not_tried_again(launcher):
    jit, fast = launcher
    jit.compiled = FakeCompiledC(scratch=64)  # needs scratch memory: CudaLauncher.__call__ allocates it
    runner = jit.compiled.run
    x = Cuda(torch.zeros(64, dtype=torch.float32))
    cache = {}
    for n in (10, 11, 12):
        R.launch_cached(cache, (torch.float32, True), fast, x, (3,), (x, n, 16, 1e-5), {"BLOCK": 64},
                        (x.data_ptr(), n, 16, 1e-5))
    assert list(cache.values()) == [False] and jit.slow_calls == 1
    assert len(runner.calls) == 2 and runner.launches == []  # the launcher's own cached path, no second bind


def test_triton_path_pins_fp_fusion_unless_the_user_chose(launcher, monkeypatch):
    """Every launch that reaches Triton asks for FP fusion explicitly: Triton 3.9 (torch 2.15's) warns when it is
    left to the default, and Triton 3.10 turns the default off. A user's TRITON_DEFAULT_FP_FUSION still decides,
    and so does an explicit ``enable_fp_fusion`` in the call."""
    jit, fast = launcher
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    x = Cuda(torch.zeros(64))
    fast[(1,)](x, 1, 16, 1.0, BLOCK=64)  # the first call of a specialisation (compiles)
    assert jit.slow_kwargs[-1] == {"BLOCK": 64, "enable_fp_fusion": True}
    fast[(1,)](x, 1, 16, 1.0, BLOCK=64)  # cached: the compiled kernel, no Triton call
    assert jit.slow_calls == 1
    assert fast.key(0, (x, 1, 16, 1.0), {"BLOCK": 64}) in fast.cache  # the key holds the caller's kwargs only
    monkeypatch.setattr(R.FastLauncher, "enabled", False)  # every call through Triton (a Triton other than 3.6)
    fast[(1,)](x, 1, 16, 1.0, BLOCK=64)
    assert jit.slow_kwargs[-1] == {"BLOCK": 64, "enable_fp_fusion": True}
    fast[(1,)](x, 1, 16, 1.0, BLOCK=64, enable_fp_fusion=False)
    assert jit.slow_kwargs[-1] == {"BLOCK": 64, "enable_fp_fusion": False}
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    fast[(1,)](x, 1, 16, 1.0, BLOCK=64)
    assert jit.slow_kwargs[-1] == {"BLOCK": 64}


def test_fast_launch_off_names_why(monkeypatch):
    """Why cached and bound launches (and so the raw-pointer runs) do not run: the switch pack() read, a Triton
    release whose C launcher the fast path does not follow (each release may change its calling convention), or
    launch hooks; describe()'s eager plan reports it instead of claiming raw-pointer runs."""
    import triton

    from packed_encoders.api import _plan_facts
    from packed_encoders.ops import triton as T

    monkeypatch.setattr(T, "FAST_LAUNCH", True)
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(R, "_hooks_active", lambda: False)
    assert R.fast_launch_off() is None
    plan = SimpleNamespace(direct=True, why_checked=None, glu="split", linear_route="F.linear", pointers=True,
                           kernels=None, stack=False, stack_off=None, merged=0)
    assert _plan_facts(plan)["pointers"] is True and _plan_facts(plan)["pointers_off"] is None
    monkeypatch.setattr(triton, "__version__", "3.10.0")
    why = R.fast_launch_off()
    assert why.startswith("Triton 3.10.0: the fast launcher follows the C launcher of Triton 3.6 / 3.7 / 3.8 / 3.9"), why
    assert _plan_facts(plan)["pointers"] is False and _plan_facts(plan)["pointers_off"] == why
    plan.pointers = False  # a plan that never runs pointers names no launcher
    assert _plan_facts(plan)["pointers_off"] is None
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(R, "_hooks_active", lambda: True)
    assert R.fast_launch_off() == "Triton launch hooks are set (a profiler's)"
    monkeypatch.setattr(T, "FAST_LAUNCH", False)
    assert R.fast_launch_off().startswith("PACKED_ENCODERS_TRITON_FAST_LAUNCH=0")
