"""Compile every Triton kernel for sm_90 (Hopper) on this machine, with no GPU: the compiled frontend,
the TTGIR/LLVM passes and ptxas run as they will on the H200, so errors the interpreter cannot see
(non-constexpr globals, type mismatches across branches, loop lowering) fail here in CI. Register use and
spills come from ``cuobjdump`` on the cubin; the ModernBERT-base geometry must not spill.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from packed_encoders.ops.triton import glu as G  # noqa: E402
from packed_encoders.ops.triton import layer_norm as L  # noqa: E402
from packed_encoders.ops.triton import rope as R  # noqa: E402
from packed_encoders.ops.triton._runtime import compile_options  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _compile(kernel, signature: dict, constexprs: dict, num_warps: int):
    fn = JITFunction(kernel.fn, do_not_specialize=kernel.do_not_specialize)
    sig = {name: ("constexpr" if name in constexprs else signature[name]) for name in fn.arg_names}
    # the options every CUDA launch passes (FastLauncher.triton), so this compiles what the GPU will run
    return triton.compile(ASTSource(fn, sig, constexprs=constexprs), target=TARGET,
                          options={"num_warps": num_warps, **compile_options()})


def _resources(compiled) -> dict:
    """``{"REG": n, "STACK": n, ...}`` from cuobjdump, or ``{}`` when the tool is not found."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def _ptr(dtype):
    return "*" + {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}[dtype]


LN_VARIANTS = [
    # (hidden, x/out dtype, residual, bias)
    (768, "bf16", True, False), (768, "bf16", False, False), (1024, "fp16", True, True),
    (1792, "bf16", True, False), (384, "fp32", True, True), (300, "bf16", False, True), (256, "bf16", True, True),
    (4096, "bf16", True, False),
]


@pytest.mark.parametrize("hidden,dt,residual,bias", LN_VARIANTS)
def test_layer_norm_compiles(hidden, dt, residual, bias):
    es = 4 if dt == "fp32" else 2
    block_n, rows, warps = L.config(hidden, es)
    p = _ptr(dt)
    fwd = _compile(L._layer_norm_fwd_kernel, dict(X=p, D=p, W=p, B=p, S=p, Y=p, MEAN="*fp32", RSTD="*fp32",
                                                  n_rows="i32", eps="fp32"),
                   dict(N=hidden, BLOCK_N=block_n, ROWS=rows, HAS_RES=residual, HAS_W=True, HAS_B=bias, STATS=True),
                   warps)
    block_n, rows, warps = L.config(hidden, es, backward=True)
    bwd = _compile(L._layer_norm_bwd_kernel, dict(DY=p, X=p, W=p, MEAN="*fp32", RSTD="*fp32", DRES=p, DX=p,
                                                  DX2="*bf16", DW="*fp32", DB="*fp32", n_rows="i32", n_tiles="i32",
                                                  n_programs="i32"),
                   dict(N=hidden, BLOCK_N=block_n, ROWS=rows, HAS_W=True, HAS_B=bias, HAS_DRES=residual,
                        HAS_DX2=dt == "fp32", STAGES=L.BWD_STAGES), warps)
    for k in (fwd, bwd):
        res = _resources(k)
        assert res.get("STACK", 0) == 0, res
    # the persistent backward's programs (BWD_WARPS_PER_SM warps) must all be resident at once
    assert _resources(bwd).get("REG", 0) * 32 * L.BWD_WARPS_PER_SM <= 65536, _resources(bwd)


def test_launch_options_compile_with_fp_fusion(monkeypatch):
    """:func:`compile_options` names an option this Triton's CUDA backend takes, and the kernel compiles with FP
    fusion on, as on Triton releases before 3.10 by default (3.9 warns when it is left to the default; 3.10
    turns it off)."""
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    block_t, block_i, warps = G.config(1152)
    fwd = _compile(G._glu_fwd_kernel, dict(X="*bf16", Y="*bf16", n_rows="i32"),
                   dict(I=1152, BLOCK_T=block_t, BLOCK_I=block_i, ACT=next(iter(G.ACTIVATIONS.values()))), warps)
    assert fwd.metadata.enable_fp_fusion is True


@pytest.mark.parametrize("stages", [2, 3])
def test_layer_norm_backward_pipelined_compiles(stages):
    """The software-pipelined tile loop (``BWD_STAGES`` > 1, swept by benchmarks/kernels.py) lowers for sm_90
    without spills."""
    block_n, rows, warps = L.config(768, 2, backward=True)
    bwd = _compile(L._layer_norm_bwd_kernel, dict(DY="*bf16", X="*bf16", W="*bf16", MEAN="*fp32", RSTD="*fp32",
                                                  DRES="*bf16", DX="*bf16", DX2="*bf16", DW="*fp32", DB="*fp32",
                                                  n_rows="i32", n_tiles="i32", n_programs="i32"),
                   dict(N=768, BLOCK_N=block_n, ROWS=rows, HAS_W=True, HAS_B=False, HAS_DRES=True, HAS_DX2=False,
                        STAGES=stages), warps)
    assert _resources(bwd).get("STACK", 0) == 0, _resources(bwd)


@pytest.mark.parametrize("nh,hd,dt", [(12, 64, "bf16"), (16, 64, "fp16"), (6, 96, "bf16"), (4, 256, "fp32"),
                                      (8, 32, "bf16")])
def test_rope_compiles(nh, hd, dt):
    block, rows, warps = R.config(nh, hd)
    p = _ptr(dt)
    meta = dict(NH=nh, HD=hd, HALF=hd // 2, BLOCK=block, ROWS=rows)
    for out_stride, clean_v in ((nh * hd, False), (3 * nh * hd, True)):  # new q, k / rotated inside qkv
        fwd = _compile(R._rope_fwd_kernel, dict(QKV=p, COS="*fp32", SIN="*fp32", POS="*i64", Q=p, K=p, n_rows="i32"),
                       dict(meta, OUT_STRIDE=out_stride, CLEAN_V=clean_v), warps)
        assert _resources(fwd).get("STACK", 0) == 0, _resources(fwd)
    strides = {n: "i32" for n in ("dq_st", "dq_sh", "dk_st", "dk_sh", "dv_st", "dv_sh")}
    for has_dv in (True, False):
        bwd = _compile(R._rope_bwd_kernel, dict(DQ=p, DK=p, DV=p, COS="*fp32", SIN="*fp32", POS="*i64", DQKV=p,
                                           n_rows="i32", **strides), dict(meta, HAS_DV=has_dv), warps)
        assert _resources(bwd).get("STACK", 0) == 0, _resources(bwd)


@pytest.mark.parametrize("inner,dt", [(1152, "bf16"), (2624, "fp16"), (1000, "fp32")])
def test_glu_compiles(inner, dt):
    block_t, block_i, warps = G.config(inner)
    p = _ptr(dt)
    for act in G.ACTIVATIONS.values():
        meta = dict(I=inner, BLOCK_T=block_t, BLOCK_I=block_i, ACT=act)
        fwd = _compile(G._glu_fwd_kernel, dict(X=p, Y=p, n_rows="i32"), meta, warps)
        for has_y in (False, True):
            bwd = _compile(G._glu_bwd_kernel, dict(DY=p, X=p, DX=p, Y=p, n_rows="i32"), dict(meta, HAS_Y=has_y), warps)
            assert _resources(bwd).get("STACK", 0) == 0, _resources(bwd)
        assert _resources(fwd).get("STACK", 0) == 0, _resources(fwd)


@pytest.mark.parametrize("trailing", [False, True])
@pytest.mark.parametrize("block", [256, 1024])
def test_unpad_kernels_compile(block, trailing):
    """``ops.triton.unpad``'s two kernels (the statistics per row, then ``cu_seqlens``, the summed checks and the
    scatter), with an int64 mask and ids as padded calls pass them."""
    from packed_encoders.ops.triton import unpad as U

    i32 = dict.fromkeys(("S", "B", "vocab", "sm_b", "sm_s", "si_b", "si_s", "st_b", "st_s", "sp_b", "sp_s"), "i32")
    flags = dict(HAS_MASK=True, TRAILING=trailing)
    rows = _compile(U._rows_kernel, dict(MASK="*i64", IDS="*i64", TT_IDS="*i64", POS="*i64", ROWS="*i64", **i32),
                    dict(BLOCK=block, HAS_IDS=True, HAS_TT=False, HAS_POS=False, **flags), 4)
    pack = _compile(U._pack_kernel, dict(ROWS="*i64", IDS="*i64", POS="*i64", MASK="*i64", CU="*i32", STATS="*i64",
                                         KL="*i32", OUT_IDS="*i64", OUT_POS="*i64", OUT_IDX="*i64", **i32),
                    dict(BLOCK=block, BLOCK_B=16, HAS_IDS=True, HAS_POS=False, **flags), 4)
    for compiled in (rows, pack):
        assert _resources(compiled).get("STACK", 0) == 0, _resources(compiled)
