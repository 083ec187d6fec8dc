"""RoPE fused into the Triton attention kernel (``rope=(cos, sin, rows)``), on CPU under the Triton interpreter.

The fused kernel must give what the unfused path gives (``ops.rope_qkv`` then the kernel): the rotation is the same
fp32 expressions rounded once to the activation dtype, so under the interpreter the outputs are bit-identical; and
both must meet the tolerance rule against the fp32 reference (fp32 rotation, fp32 attention). Launches run inside
``_runtime._interpreter_fixes()``: it rounds fp32 -> bf16 to nearest even as the GPU does (the bare interpreter
truncates) and makes the interpreter usable whatever mode Triton itself was imported in, so this module passes alone,
before and after the other interpreter modules.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from packed_encoders.attention import backends, triton_short  # noqa: E402
from packed_encoders.attention.backends import BACKENDS  # noqa: E402
from packed_encoders.attention.reference import attention_ref, attention_same_dtype  # noqa: E402
from packed_encoders.attention.triton_short import TileConfig, triton_short_attention  # noqa: E402
from packed_encoders.ops import TORCH_OPS, rope_qkv_ref, rope_qkv_torch, rope_tables  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16, FP16 = torch.bfloat16, torch.float16
# w=5 stands for ModernBERT's 64; tiles of 16 put window edges and sequence changes on tile boundaries; empty
# sequences sit inside cu_seqlens (cu[s] == cu[s+1]), also at the start and the end.
LENGTHS = [0, 5, 6, 0, 0, 11, 1, 20, 3, 0]
SMALL = TileConfig(16, 16)


pytestmark = pytest.mark.usefixtures("interpret_on_cpu", "supported_interpreter")  # CPU: interpreted


def make(lengths, heads=2, head_dim=64, dtype=BF16, kind="per_token", seed=0):
    """``qkv`` ``[T, 3 * heads * head_dim]``, ``cu_seqlens``, ``max_seqlen`` and ``(cos, sin, rows)`` of one of the
    two kinds the forward builds: per-token tables ``[T, hd/2]`` with ``rows = arange(T)``, or a theta table
    ``[P, hd/2]`` indexed by the position ids."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    qkv = torch.randn(total, 3 * heads * head_dim, generator=g).to(device=DEV, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    pos = torch.cat([torch.arange(n) for n in lengths]).to(DEV)
    if kind == "per_token":
        inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        freqs = pos.float()[:, None] * inv.to(DEV)[None, :]
        rope = (freqs.cos(), freqs.sin(), torch.arange(total, device=DEV))
    else:
        cos, sin = rope_tables(160000.0, head_dim, max(lengths), DEV)
        rope = (cos, sin, pos)
    return qkv, cu, max(lengths), rope


def views(qkv, heads, head_dim):
    """Unrotated q, k, v: strided views of the projection, as the forward hands them to a fusing backend."""
    return qkv.view(qkv.shape[0], 3, heads, head_dim).unbind(1)


def attend(q, k, v, cu, smax, window, config=SMALL, **kw):
    return triton_short_attention(q, k, v, cu, smax, window=window, scale=q.shape[-1] ** -0.5, config=config, **kw)


def check_fused(qkv, cu, smax, rope, window, heads, head_dim, config=SMALL, key_lens=None):
    """Fused == unfused (bit for bit under the interpreter), and fused within the rule of the fp32 reference."""
    extra = {} if key_lens is None else {"key_lens": key_lens}
    q, k, v = views(qkv, heads, head_dim)
    fused = attend(q, k, v, cu, smax, window, config, rope=rope, **extra)
    rq, rk, v = rope_qkv_torch(qkv, *rope, heads, head_dim)
    unfused = attend(rq, rk, v, cu, smax, window, config, **extra)
    assert fused.shape == q.shape and fused.dtype == qkv.dtype and fused.is_contiguous()
    if DEV == "cpu":
        assert torch.equal(fused, unfused), (fused.float() - unfused.float()).abs().max()
    q32, k32, v32 = rope_qkv_ref(qkv, *rope, heads, head_dim)
    ref = attention_ref(q32, k32, v32, cu, window, key_lens=key_lens)
    yard = (attention_same_dtype(rq, rk, v, cu, window, key_lens=key_lens).float() - ref).abs().max().item()
    err = (fused.float() - ref).abs().max().item()
    assert err <= 2 * yard + 1e-3, f"max err {err:.4g} > 2 * {yard:.4g} + 1e-3"
    return fused


# Every (dtype, window, table kind) on the stream grid; the seq grid (slower to interpret: a program per tile of
# every sequence) on two crossings of them.
CASES = [(d, w, "stream", k) for d in ("bf16", "fp16") for w in (None, 5) for k in ("per_token", "theta")]
CASES += [("bf16", 5, "seq", "per_token"), ("fp16", None, "seq", "theta")]


@pytest.mark.parametrize("dtype,window,grid,kind", CASES)
def test_fused_matches_unfused_and_reference(dtype, window, grid, kind):
    qkv, cu, smax, rope = make(LENGTHS, dtype={"bf16": BF16, "fp16": FP16}[dtype], kind=kind)
    check_fused(qkv, cu, smax, rope, window, 2, 64, dataclasses.replace(SMALL, grid=grid))


def test_head_dim_128_heads_per_program_and_table_tiles():
    # 3 heads, 2 per program: the query tables are read once per program and serve a masked head slot too
    qkv, cu, smax, rope = make([9, 0, 14, 2], heads=3, head_dim=128, dtype=FP16, kind="theta", seed=1)
    check_fused(qkv, cu, smax, rope, 4, 3, 128, TileConfig(16, 16, heads_per_program=2))
    qkv, cu, smax, rope = make([37, 1, 12], seed=2)
    check_fused(qkv, cu, smax, rope, None, 2, 64, config=None)  # the tile table's launch shape (32 x 64)


@pytest.mark.parametrize("window", [None, 3])
def test_fused_with_key_lens(window):
    lengths = [6, 20, 0, 5, 9]
    qkv, cu, smax, rope = make(lengths, seed=3)
    kl = torch.tensor([4, 17, 0, 1, 2], dtype=torch.int32, device=DEV)
    check_fused(qkv, cu, smax, rope, window, 2, 64, key_lens=kl)


def test_strided_tables_and_int32_rows():
    """Tables that are column slices of a wider one (row stride hd) are read in place; int32 rows work."""
    qkv, cu, smax, (cos, sin, pos) = make([7, 12, 9], kind="theta", seed=4)
    wide_cos = torch.cat([cos, torch.full_like(cos, float("nan"))], 1)[:, :32]
    wide_sin = torch.cat([sin, torch.full_like(sin, float("nan"))], 1)[:, :32]
    assert wide_cos.stride() == (64, 1)
    q, k, v = views(qkv, 2, 64)
    base = attend(q, k, v, cu, smax, None, rope=(cos, sin, pos))
    assert torch.equal(attend(q, k, v, cu, smax, None, rope=(wide_cos, wide_sin, pos.int())), base)
    mixed = (wide_cos, sin, pos)  # different row strides: laid out contiguously first, same result
    assert torch.equal(attend(q, k, v, cu, smax, None, rope=mixed), base)


def test_isolation_and_empty_batch():
    qkv, cu, smax, rope = make([7, 12, 9], seed=5)
    q, k, v = views(qkv, 2, 64)
    before = attend(q, k, v, cu, smax, None, rope=rope)
    other = qkv.clone()
    other[7:19].normal_()
    q2, k2, v2 = views(other, 2, 64)
    after = attend(q2, k2, v2, cu, smax, None, rope=rope)
    assert torch.equal(before[:7], after[:7]) and torch.equal(before[19:], after[19:])
    empty = torch.empty(0, 3 * 128, dtype=BF16, device=DEV)
    q, k, v = views(empty, 2, 64)
    zero_rows = torch.zeros(0, dtype=torch.long, device=DEV)
    out = attend(q, k, v, torch.zeros(1, dtype=torch.int32, device=DEV), 0, None,
                 rope=(rope[0], rope[1], zero_rows))
    assert out.shape == (0, 2, 64)


def test_rope_errors_and_grad():
    qkv, cu, smax, (cos, sin, rows) = make([9, 4], seed=6)
    q, k, v = views(qkv, 2, 64)
    bad = [
        ((cos, sin), "tuple"),
        ((cos.double(), sin, rows), "fp32"),
        ((cos[:, :16], sin[:, :16], rows), r"\[R, 32\]"),
        ((cos, sin[:5], rows), "fp32"),
        ((cos, sin, rows[:5]), "rows"),
        ((cos, sin, rows.float()), "rows"),
    ]
    for rope, match in bad:
        with pytest.raises(ValueError, match=match):
            attend(q, k, v, cu, smax, None, rope=rope)
    leaf = qkv.detach().clone().requires_grad_(True)
    gq, gk, gv = views(leaf, 2, 64)
    with pytest.raises(ValueError, match="no backward"):  # a fused forward is never differentiated
        attend(gq, gk, gv, cu, smax, None, rope=(cos, sin, rows))
    with torch.no_grad():
        torch.testing.assert_close(attend(gq, gk, gv, cu, smax, None, rope=(cos, sin, rows)),
                                   attend(q, k, v, cu, smax, None, rope=(cos, sin, rows)), atol=0, rtol=0)


def test_custom_op_carries_rope():
    qkv, cu, smax, (cos, sin, rows) = make([9, 4], seed=7)
    q, k, v = views(qkv, 2, 64)
    op = triton_short._custom_op()
    out = op(q, k, v, cu, smax, 3, 64 ** -0.5, None, cos, sin, rows)
    assert torch.equal(out, triton_short_attention(q, k, v, cu, smax, window=3, scale=64 ** -0.5,
                                                   rope=(cos, sin, rows)))
    fake = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake:
        shaped = op(*(fake.from_tensor(t) for t in (q, k, v, cu)), smax, None, 0.125, None,
                    *(fake.from_tensor(t) for t in (cos, sin, rows)))
    assert shaped.shape == q.shape and shaped.is_contiguous()


def test_backend_capability_and_switch(monkeypatch):
    assert BACKENDS["triton"].fuses_rope
    assert not any(b.fuses_rope for name, b in BACKENDS.items() if name != "triton")
    assert BACKENDS["triton"].fuse_rope(grad=False) is backends.FUSED_ROPE is True  # a default Tuning()'s
    assert not BACKENDS["triton"].fuse_rope(grad=True)
    limit = backends.FUSED_ROPE_MAX_TOKENS
    with monkeypatch.context() as m:
        assert BACKENDS["triton"].fuse_rope(False, limit - 1)
        assert BACKENDS["triton"].fuse_rope(False, None)  # no size given (global layers): fused
        assert not BACKENDS["triton"].fuse_rope(False, limit)  # large calls: a separate pass is cheaper
        assert BACKENDS["triton"].fuse_rope(False, limit, max_tokens=limit + 1)
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert BACKENDS["triton"].fuse_rope(False, limit)  # traced: no size guard
    assert not BACKENDS["triton"].fuse_rope(grad=False, enabled=False)
    assert not BACKENDS["triton"].fuse_rope(False, 8, enabled=False)
    # the environment switch is read at pack() (into the Tuning, then the plan's Rules), never by the backend
    monkeypatch.setenv("PACKED_ENCODERS_FUSED_ROPE", "0")
    assert BACKENDS["triton"].fuse_rope(grad=False)
    from packed_encoders.model.plan import rules_for
    from packed_encoders.tuning import read_tuning

    assert rules_for(read_tuning()).fused_rope is False


# ------------------------------------------------------------------------------------------------ the model


def _forward(model, batch, ops=TORCH_OPS, rules=None):
    from packed_encoders.attention.dispatch import Decision
    from packed_encoders.model.forward import encoder_forward
    from packed_encoders.model.params import ModernBertParams

    params = ModernBertParams.from_hf_config(model.config)
    plan = {w: Decision("triton") for w in {params.layer_window(i) for i in range(params.num_hidden_layers)}}
    return encoder_forward(model, params, batch, attention=plan, ops=ops, rules=rules)


@pytest.mark.parametrize("tables", ["live_inv_freq", "theta"])
def test_model_fused_equals_unfused_and_matches_stock(monkeypatch, tables):
    """Packed bf16 forward with the Triton backend under no_grad: fused RoPE gives the same output as the switch
    off (bit for bit under the interpreter), skips ``ops.rope_qkv`` entirely, and matches stock HF within the
    rule (fp32 stock on the same bf16 weights is the reference; stock bf16 the yardstick)."""
    from packed_encoders.batch import from_packed
    from packed_encoders.model import forward
    from packed_encoders.model.params import ModernBertParams
    from tests.helpers import make_model

    if tables == "theta":  # no readable inv_freq buffer: the cached theta tables indexed by position_ids
        monkeypatch.setattr(forward, "live_inv_freq", lambda model, is_global, params: (None, 1.0))
    from packed_encoders.model.plan import Rules

    model = make_model("base_like").to(BF16).to(DEV)  # 2 heads x 64, 4 layers, global and window-8 layers
    lengths = [5, 0, 17, 3, 12]
    ids = torch.randint(3, 211, (sum(lengths),), generator=torch.Generator().manual_seed(8)).to(DEV)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    batch = from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=max(lengths),
                        position_ids=None, vocab_size=211)
    calls = []

    def counting_rope(*args):
        calls.append(1)
        return TORCH_OPS.rope_qkv(*args)

    ops = dataclasses.replace(TORCH_OPS, rope_qkv=counting_rope)
    with torch.no_grad():
        fused = _forward(model, batch, ops)  # the default Rules: fused
        assert calls == []
        # a call this large rotates apart ... on its local layers only: global ones stay fused
        by_size = _forward(model, batch, ops, Rules(fused_rope_max_tokens=sum(lengths)))
        params = ModernBertParams.from_hf_config(model.config)
        local = [i for i in range(params.num_hidden_layers)
                 if params.layer_window(i) is not None and params.layer_window(i) < max(lengths) - 1]
        assert 0 < len(local) < params.num_hidden_layers and len(calls) == len(local)
        if DEV == "cpu":
            assert torch.equal(by_size, fused)
        calls.clear()
        unfused = _forward(model, batch, ops, Rules(fused_rope=False))  # PACKED_ENCODERS_FUSED_ROPE=0 at pack()
        assert len(calls) == model.config.num_hidden_layers
        if DEV == "cpu":
            assert torch.equal(fused, unfused)
        else:
            torch.testing.assert_close(fused, unfused, atol=3e-2, rtol=3e-2)
        padded = torch.zeros(len(lengths), max(lengths), dtype=torch.long, device=DEV)
        mask = torch.zeros_like(padded)
        for row, (start, n) in enumerate(zip(cu.tolist(), lengths)):
            padded[row, :n] = ids[start:start + n]
            mask[row, :n] = 1
        real = mask.bool()
        stock16 = type(model).forward(model, input_ids=padded, attention_mask=mask).last_hidden_state[real]
        model.float()
        stock32 = type(model).forward(model, input_ids=padded, attention_mask=mask).last_hidden_state[real]
    err = (fused.float() - stock32).abs().max().item()
    yard = (stock16.float() - stock32).abs().max().item()
    assert err <= 2 * yard + 1e-2, f"packed fused vs stock fp32: {err:.4g} > 2 * {yard:.4g} + 1e-2"


def test_grad_mode_keeps_the_separate_rope():
    """With gradients on the forward never hands RoPE to a backend (none with a backward fuses it)."""
    assert not any(b.fuse_rope(grad=True) for b in BACKENDS.values())


# ------------------------------------------------------------------------------------------------ sm_90 compile


_AOT = """
import os, re, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from packed_encoders.attention import triton_short_kernel, triton_short
from packed_encoders.ops.triton._runtime import compile_options
jit = JITFunction(getattr(triton_short_kernel.packed_attn_rope_fwd, "fn", triton_short_kernel.packed_attn_rope_fwd))
tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
for head_dim, dt, smax, local, has_kl in ((64, "bf16", 64, False, False), (64, "bf16", 1024, True, True),
                                          (128, "fp16", 1024, False, False)):
    cfg = triton_short.tile_config(smax, head_dim, local)
    const = {"HEAD_DIM": head_dim, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
             "HEADS_PER_PROGRAM": cfg.heads_per_program, "LOCAL": local, "PER_SEQ": cfg.grid == "seq",
             "DOT_F32": False, "HAS_KL": has_kl}
    pointers = {"Q": "*" + dt, "K": "*" + dt, "V": "*" + dt, "O": "*" + dt, "CU": "*i32", "KL": "*i32",
                "COS": "*fp32", "SIN": "*fp32", "ROWS": "*i64", "qk_scale": "fp32"}
    sig = {n: pointers.get(n, "constexpr" if n in const else "i32") for n in jit.arg_names}
    compiled = triton.compile(ASTSource(jit, sig, const), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **compile_options()})
    stack = "?"
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        stack = re.findall(r"STACK:(\\d+)", out)[0]
    print(head_dim, smax, local, "stack", stack)
"""


def test_fused_kernel_compiles_for_sm90_without_spills():
    # The interpreter accepts programs the compiler rejects: compile the fused entry for Hopper ahead of time (in a
    # fresh process without TRITON_INTERPRET, as tests/test_attention.py does for the plain entry). ModernBERT-base
    # geometry (head_dim 64) must not spill, under both releases this module runs with (3.6, the GPU's, and 3.9:
    # the rerun loop's pipelining depth is chosen per release for that, see triton_short_kernel._RERUN_STAGES).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.strip().splitlines()]
    assert len(rows) == 3
    spilled = [row for row in rows if row[0] == "64" and row[4] not in ("0", "?")]
    assert not spilled, proc.stdout


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_rope", [False, True])
def test_direct_entry_equals_checked(window, with_rope):
    """The unchecked entry the packed forward's no-grad plan calls launches exactly what the checked one does."""
    from packed_encoders.attention.triton_short import triton_short_attention_direct

    lengths = [5, 0, 17, 3]
    qkv, cu, _, rope = make(lengths)
    q, k, v = views(qkv, 2, 64)
    kw = {"rope": rope} if with_rope else {}
    want = attend(q, k, v, cu, max(lengths), window, config=None, **kw)
    got = triton_short_attention_direct(q, k, v, cu, max(lengths), window=window, scale=64 ** -0.5, **kw)
    assert torch.equal(got, want)
