"""The fast launcher against Triton's own launch, both through this Triton's real C launcher over a recording
libcuda (tests/launch_record.py). Run in a process of its own by tests/test_fast_launch_record.py:

    python tests/fast_launch_record_check.py REPO   -> prints "ok <triton version> <convention> <launches>"

For every case, a launch through Triton's path (``JITFunction.run``: binds, specialises, compiles, launches) and the
same launch through each fast path (``FastLauncher``'s cached launch, ``launch_cached``'s ``Bound``, ``Bound.at``)
must hand the driver the same thing: the same compiled kernel (one function handle per loaded module), grid, block,
shared memory, stream, launch attributes and parameter bytes. Cases run in one process one after another, so a
cache key coarser than Triton's specialisation would fire an earlier case's kernel and be caught.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

repo = Path(sys.argv[1])
sys.path[:0] = [str(repo), str(repo / "tests")]

import launch_record as L  # noqa: E402

rec = L.recording_driver(Path(tempfile.mkdtemp()))

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

from packed_encoders.ops.triton import _runtime as R  # noqa: E402
from packed_encoders.ops.triton import glu as G  # noqa: E402


class Cuda:
    """A CPU tensor standing for a CUDA tensor on device 0 (what the launchers read of one)."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()

    def get_device(self) -> int:
        return 0


def record(launch, signature: dict) -> dict:
    rec.expect(signature)
    before = rec.count
    launch()
    assert rec.count == before + 1, "no launch reached the driver"
    return rec.launch()


def same(a: dict, b: dict, what: str) -> None:
    assert a == b, f"{what}: the driver got\n{b}\nwhere Triton's own launch gave\n{a}"


def probe(X, Y, W, n, n_any, stride, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    # every kind of argument the kernels here take: pointers of two dtypes, one optional, specialised and
    # unspecialised integers, a 64-bit integer, a float, constexprs
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + tl.program_id(0).to(tl.int64) * stride + offs, mask=mask).to(tl.float32)
    if HAS_W:
        x = x * tl.load(W + offs, mask=mask)
    tl.store(Y + offs, x * eps + n_any, mask=mask)


def parameters(args: dict, specialised=()) -> dict:
    """The kernel parameters Triton passes for ``args`` and their types: a ``None`` pointer and a specialised
    integer equal to 1 become constants (no parameter); an integer is i32 within its range, else i64."""
    out = {}
    for name, a in args.items():
        if a is None or (name in specialised and a == 1):
            continue
        if isinstance(a, Cuda):
            out[name] = "*"
        elif isinstance(a, float):
            out[name] = "fp32"
        else:
            out[name] = "i32" if -(1 << 31) <= a < (1 << 31) else "i64"
    return out


def check_probe() -> int:
    launcher = R.Kernel(probe, do_not_specialize=("n_any",)).on(Cuda(torch.empty(1)))
    x = torch.zeros(512, dtype=torch.bfloat16)
    y, w = torch.zeros(256), torch.zeros(256)
    base = dict(X=Cuda(x), Y=Cuda(y), W=Cuda(w), n=100, n_any=100, stride=64, eps=0.5)
    cases = [{}, dict(n=1), dict(n=16), dict(n=32), dict(n=1 << 31), dict(n_any=1), dict(n_any=16),
             dict(n_any=(1 << 31) + 16), dict(stride=1 << 40), dict(stride=16), dict(eps=2.0),
             dict(X=Cuda(x[1:])), dict(W=None), dict(n=16, n_any=1, X=Cuda(x[3:]))]
    launches = 0
    for i, change in enumerate(cases):
        args = {**base, **change}
        kwargs = dict(HAS_W=args["W"] is not None, BLOCK=128, num_warps=4 if i % 2 else 2)
        pos = tuple(args.values())
        sig = parameters(args, specialised=("n", "stride"))
        ref = record(lambda: launcher.triton((3,), pos, kwargs), sig)
        for attempt in range(2):  # the first fills the cache through Triton's path, the second launches directly
            got = record(lambda: launcher[(3,)](*pos, **kwargs), sig)
            same(ref, got, f"probe case {change} (launch {attempt})")
        launches += 3
    return launches


def check_glu() -> int:
    """GLU forward as ``glu.forward`` launches it (``launch_cached``: bound on the first launch), then as the
    raw-pointer runs do (``glu.forward_launcher`` -> ``Bound.at``)."""
    launches = 0
    for t, inner in ((100, 1152), (7, 64), (4096, 1152)):
        x = Cuda(torch.zeros(t, 2 * inner, dtype=torch.bfloat16))
        y = Cuda(torch.zeros(t, inner, dtype=torch.bfloat16))
        bt, bi, warps = G.config(inner)
        act = G.ACTIVATIONS["gelu"]
        grid = (R.cdiv(t, bt), R.cdiv(inner, bi))
        kwargs = dict(I=inner, BLOCK_T=bt, BLOCK_I=bi, ACT=act, num_warps=warps)
        fast = (x.data_ptr(), y.data_ptr(), t)
        sig = G._forward_signature(x.dtype, inner, act, t, fast[0] | fast[1])
        params = parameters(dict(X=x, Y=y, n_rows=t))
        ref = record(lambda: G._glu_fwd_kernel.on(x).triton(grid, (x, y, t), kwargs), params)
        for attempt in range(2):  # binds, then launches through the Bound
            got = record(lambda: R.launch_cached(G._FWD_BOUND, sig, G._glu_fwd_kernel, x, grid, (x, y, t), kwargs,
                                                 fast), params)
            same(ref, got, f"glu t={t} inner={inner} (launch_cached {attempt})")
        run = G.forward_launcher(t, inner, act, x.dtype, 0, L.STREAM)
        assert run is not None, "the GLU forward was not bound"
        same(ref, record(lambda: run(*fast[:2]), params), f"glu t={t} inner={inner} (forward_launcher)")
        launches += 4
    return launches


def main() -> None:
    import triton

    convention = R.launch_convention()
    assert convention is not None, f"Triton {triton.__version__} is not in FAST_LAUNCH_TRITON"
    assert R.fast_launch_off() is None, R.fast_launch_off()
    launches = check_probe() + check_glu()
    print("ok", triton.__version__, convention, launches)


if __name__ == "__main__":
    main()
