"""Triton's real C launchers on a machine without a GPU, over a libcuda that records launches (recording_cuda.c).

``recording_driver(tmp)`` builds the stand-in ``libcuda.so.1`` with the C compiler, loads it, points Triton at it and
makes a ``CudaDriver`` over it Triton's active driver, so a ``JITFunction`` compiles for sm_90 and launches through
Triton's own C launcher for this release, compiled here. ``Recorder.launch`` then reads back what
the driver was handed (grid, block, shared memory, stream, function, launch attributes, every parameter's bytes).
Used by tests/test_fast_launch_record.py, in the test environment (Triton 3.6) and, through tests/envs/triton.sh,
with the newest Triton.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("recording_cuda.c")
STREAM = 0x5EED  # the current stream as the recording driver reports it

# Bytes per kernel parameter, by Triton signature type.
SIZES = {"i1": 1, "i8": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2, "i32": 4, "u32": 4, "fp32": 4,
         "i64": 8, "u64": 8, "fp64": 8}


def unavailable() -> str | None:
    """Why the recording driver cannot be built here (``None`` when it can)."""
    if shutil.which(os.environ.get("CC", "gcc")) is None:
        return "no C compiler"
    try:
        import triton  # noqa: F401
        from triton.backends.nvidia import driver  # noqa: F401
    except ImportError as e:
        return f"no Triton with its CUDA backend ({e})"
    return None


class Recorder:
    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib

    def expect(self, signature: dict) -> None:
        """Set the parameter sizes the next launches carry: ``signature`` in Triton's form (name -> type),
        constexprs left out, plus the two scratch pointers every Triton >= 3.4 kernel takes last."""
        sizes = [8 if ty.startswith("*") else SIZES[ty] for ty in signature.values() if ty != "constexpr"]
        sizes += [8, 8]
        self.lib.record_set_param_sizes(len(sizes), (ctypes.c_int * len(sizes))(*sizes))

    @property
    def count(self) -> int:
        return self.lib.record_launches()

    def launch(self) -> dict:
        """The last launch as the driver saw it."""
        dims = (ctypes.c_uint * 7)()
        stream_function = (ctypes.c_uint64 * 2)()
        attrs = (ctypes.c_int * 32)()
        params = (ctypes.c_ubyte * 1024)()
        code = self.lib.record_last(dims, stream_function, attrs, params)
        n_attrs, n_bytes = divmod(code, 1000)
        return {"grid": tuple(dims[:3]), "block": tuple(dims[3:6]), "shared": dims[6],
                "stream": stream_function[0], "function": stream_function[1],
                "attrs": tuple(attrs[:2 * n_attrs]), "params": bytes(params[:n_bytes])}


def recording_driver(tmp: Path) -> Recorder:
    """Build and load the recording libcuda under ``tmp`` and make a ``CudaDriver`` over it Triton's active driver
    (process-wide: run this in a process of its own). Device 0 is current, for torch too, an sm_90 one; its
    current stream is :data:`STREAM`."""
    lib_dir = tmp / "recording-libcuda"
    lib_dir.mkdir(parents=True, exist_ok=True)
    so = lib_dir / "libcuda.so.1"
    subprocess.check_call([os.environ.get("CC", "gcc"), "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1",
                           str(SOURCE), "-o", str(so)])
    (lib_dir / "libcuda.so").symlink_to(so.name)
    lib = ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)  # launchers linked with -lcuda resolve to this copy
    os.environ["TRITON_LIBCUDA_PATH"] = str(lib_dir)
    os.environ.setdefault("TRITON_CACHE_DIR", str(tmp / "triton-cache"))

    import triton
    from triton.backends.nvidia.driver import CudaDriver

    import torch
    from triton.backends.compiler import GPUTarget

    driver = CudaDriver()
    driver.get_current_device = lambda: 0
    driver.set_current_device = lambda device: None
    driver.get_current_stream = lambda device=None: STREAM
    driver.get_current_target = lambda: GPUTarget("cuda", 90, 32)
    triton.runtime.driver.set_active(driver)
    # what the fast launcher asks torch (a CPU build has neither)
    torch._C._cuda_getDevice = lambda: 0
    torch._C._cuda_getCurrentRawStream = lambda device: STREAM
    return Recorder(lib)

