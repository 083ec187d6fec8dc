"""Host cost of the single launches an eager packed forward is made of, one op at a time.

    python -m benchmarks.host_ops                       # CUDA (the H200): about half a minute
    python -m benchmarks.host_ops --device cpu          # CPU smoke run (the plain PyTorch ops only)

An eager ModernBERT-base forward issues ~110-180 launches; where the host pays more per launch than the GPU works,
the forward is host-bound (``benchmarks/host.py`` measures whole calls). This runs each op ``--calls`` times back to
back on a small problem (``--tokens`` rows of the model's hidden size: a few microseconds of GPU work per call) and
reports per op:

- ``host_us``: the loop's time per call up to its last call's return, the GPU not waited for (median of
  ``--repeats`` loops): what issuing the op costs the host;
- ``wall_us``: the same loop up to the GPU's completion: when it is well above ``host_us`` the op is GPU-bound at
  this size and ``host_us`` is a lower bound.

Ops (each skipped, with the reason in its row, where it cannot run): ``python_call`` (an empty Python function:
the unit), ``empty`` (``torch.empty [T, H]``), ``view``, ``linear`` (``F.linear``, the ``Wqkv`` shape),
``linear_cublaslt`` (the same with ``torch.backends.cuda.preferred_blas_library("cublaslt")``), ``mm_out``
(``torch.mm`` into a preallocated output, weight pre-transposed), ``mm_dx`` / ``mm_dw_fp32`` (a training
backward's two GEMMs per projection: ``dy @ w``, and ``dy.T @ x`` written as fp32 from bf16 operands),
``mm_lt`` / ``mm_lt_dw_fp32`` (the ``Wqkv`` forward and fp32 weight-gradient products as one ``cublasLtMatmul`` on
raw pointers, ``packed_encoders.ops.cublaslt``, as the training stack calls them), ``mm_lt_new_t`` (``mm_lt`` made
for another token count of the same class on every call, as each eager call or training step meets one), ``ln_direct`` / ``ln_checked``
(the Triton residual LayerNorm, unchecked launch and the checked op), ``ln_bound`` (the same kernel launched on raw
pointers through its bound signature, as the raw-pointer paths launch it), ``glu``
(Triton), ``attn_triton`` (the Triton attention kernel, unchecked launch), ``attn_varlen`` (torch ``varlen_attn``),
``attn_fa4`` (FlashAttention-4). Rows go to ``--out`` as JSON lines (``runner: "host_ops"``); a table is printed.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import ROOT, environment, synchronize, write_rows


def _noop():
    return None


def ops(device: str, tokens: int, hidden: int, heads: int, seqs: int) -> dict:
    """``{name: (callable, None) | (None, reason)}`` for the ops of the module docstring."""
    cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    x, d = rand(tokens, hidden), rand(tokens, hidden)
    w_ln = rand(hidden)
    w_qkv = rand(3 * hidden, hidden)
    w_t = w_qkv.t().contiguous()
    out = torch.empty(tokens, 3 * hidden, device=device, dtype=dtype)
    dy = rand(tokens, 3 * hidden)
    h = rand(tokens, 2 * 1152)
    head_dim = hidden // heads
    qkv = rand(tokens, 3, heads, head_dim)
    q, k, v = qkv.unbind(1)
    lens = [tokens // seqs] * seqs
    lens[-1] += tokens - sum(lens)
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
    max_seqlen = max(lens)
    scale = head_dim ** -0.5
    table: dict = {
        "python_call": (_noop, None),
        "empty": (lambda: torch.empty(tokens, hidden, device=device, dtype=dtype), None),
        "view": (lambda: x.view(tokens, heads, head_dim), None),
        "linear": (lambda: F.linear(x, w_qkv), None),
        "mm_out": (lambda: torch.mm(x, w_t, out=out), None),
        "mm_dx": (lambda: torch.mm(dy, w_qkv), None),
    }
    if not cuda:
        for name in ("linear_cublaslt", "mm_dw_fp32", "mm_lt", "mm_lt_dw_fp32", "ln_direct", "ln_checked", "ln_bound",
                     "glu", "attn_triton", "attn_varlen", "attn_fa4"):
            table[name] = (None, "CUDA only")
        return table

    table["linear_cublaslt"] = table["linear"]  # the same call: run() switches the BLAS library around it
    table["mm_dw_fp32"] = (lambda: torch.mm(dy.t(), x, out_dtype=torch.float32), None)
    try:
        from packed_encoders.ops.fused import DIRECT_OPS, TRITON_OPS
        from packed_encoders.ops.triton import glu

        table["ln_direct"] = (lambda: DIRECT_OPS.residual_layer_norm(x, d, w_ln, None, 1e-5), None)
        table["ln_checked"] = (lambda: TRITON_OPS.residual_layer_norm(x, d, w_ln, None, 1e-5), None)
        table["glu"] = (lambda: glu.forward(h, "gelu"), None)
    except Exception as exc:  # noqa: BLE001 - a row says why
        for name in ("ln_direct", "ln_checked", "glu"):
            table[name] = (None, f"{exc.__class__.__name__}: {exc}")
    table["ln_bound"] = _ln_bound(x, d, w_ln, tokens, hidden, dtype)
    table.update(_cublaslt_ops(x, w_qkv, dy, tokens, hidden, dtype))
    try:
        from packed_encoders.attention.triton_short import triton_short_attention_direct

        table["attn_triton"] = (lambda: triton_short_attention_direct(q, k, v, cu, max_seqlen, window=None,
                                                                      scale=scale), None)
    except Exception as exc:  # noqa: BLE001
        table["attn_triton"] = (None, f"{exc.__class__.__name__}: {exc}")
    from packed_encoders.attention.flash import fa4_status, fa4_varlen, torch_varlen, torch_varlen_status

    why = torch_varlen_status()
    table["attn_varlen"] = ((lambda: torch_varlen(q, k, v, cu, max_seqlen, window=None, scale=scale)), None) \
        if why is None else (None, why)
    why = fa4_status()
    table["attn_fa4"] = ((lambda: fa4_varlen(q, k, v, cu, max_seqlen, window=None, scale=scale)), None) \
        if why is None else (None, why)
    return table


def _ln_bound(x, d, w, tokens: int, hidden: int, dtype):
    """The residual LayerNorm forward with statistics launched through its bound signature (bound by one tensor
    launch first), as ``model/stack_pointers.py`` launches it."""
    try:
        from packed_encoders.ops.triton import layer_norm

        layer_norm.forward(x, d, w, None, 1e-5, dtype, dtype)  # binds the signature
        device = x.device.index
        launch = layer_norm.forward_launcher(tokens, hidden, True, True, False, dtype, device,
                                             torch._C._cuda_getCurrentRawStream(device), stats=True)
    except Exception as exc:  # noqa: BLE001 - a row says why
        return None, f"{exc.__class__.__name__}: {exc}"
    if launch is None:
        return None, "the signature did not bind (fast launcher off, or launch hooks on)"
    s, y = torch.empty_like(x), torch.empty_like(x)
    mean, rstd = (torch.empty(tokens, device=x.device, dtype=torch.float32) for _ in range(2))
    ptrs = (x.data_ptr(), d.data_ptr(), w.data_ptr(), x.data_ptr(), s.data_ptr(), y.data_ptr(), mean.data_ptr(),
            rstd.data_ptr())
    return (lambda: launch(*ptrs, 1e-5)), None


def _cublaslt_ops(x, w, dy, tokens: int, hidden: int, dtype) -> dict:
    """``mm_lt`` (``x @ w.T``) and ``mm_lt_dw_fp32`` (``dy.T @ x`` in fp32) as single ``cublasLtMatmul`` calls."""
    from packed_encoders.ops import cublaslt

    why = cublaslt.status()
    if why is not None:
        return {"mm_lt": (None, why), "mm_lt_dw_fp32": (None, why), "mm_lt_new_t": (None, why)}
    device = x.device.index
    n = w.shape[0]
    ws = torch.empty(cublaslt.WORKSPACE_BYTES, dtype=torch.uint8, device=x.device)
    stream = torch._C._cuda_getCurrentRawStream(device)
    y = torch.empty(tokens, n, device=x.device, dtype=dtype)
    dw = torch.empty(n, hidden, device=x.device, dtype=torch.float32)
    fwd = cublaslt.linear(tokens, n, hidden, dtype, device).call
    wgrad = cublaslt.weight_grad(tokens, n, hidden, dtype, torch.float32, device).call
    a = (w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), stream)
    b = (x.data_ptr(), dy.data_ptr(), dw.data_ptr(), ws.data_ptr(), stream)
    counts = itertools.cycle(range(tokens - 15, tokens + 1))  # 16 token counts of one class, one per call

    def new_t():
        cublaslt.linear(next(counts), n, hidden, dtype, device).call(*a)

    return {"mm_lt": ((lambda: fwd(*a)), None), "mm_lt_dw_fp32": ((lambda: wgrad(*b)), None),
            "mm_lt_new_t": (new_t, None)}


def run(fn, name: str, device: str, calls: int, repeats: int) -> dict:
    lt = name == "linear_cublaslt"
    before = torch.backends.cuda.preferred_blas_library() if lt else None
    if lt:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        with torch.no_grad():
            for _ in range(20):  # compile, autotune, heuristics caches
                fn()
            synchronize(device)
            host, wall = [], []
            for _ in range(repeats):
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                t1 = time.perf_counter()
                synchronize(device)
                t2 = time.perf_counter()
                host.append((t1 - t0) / calls)
                wall.append((t2 - t0) / calls)
    finally:
        if lt:
            torch.backends.cuda.preferred_blas_library(before)
    return {"host_us": statistics.median(host) * 1e6, "wall_us": statistics.median(wall) * 1e6}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=96, help="rows per op (8 queries of 12 tokens)")
    ap.add_argument("--seqs", type=int, default=8, help="sequences in the attention calls")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ops", default=None, help="comma list (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host"))
    args = ap.parse_args(argv)
    table = ops(args.device, args.tokens, args.hidden, args.heads, args.seqs)
    names = args.ops.split(",") if args.ops else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown op(s) {unknown}; choose from {', '.join(table)}")
    rows = []
    run_id = time.strftime("%Y%m%d-%H%M%S")
    for name in names:
        fn, why = table[name]
        row = {"runner": "host_ops", "op": name, "run_id": run_id, "tokens": args.tokens, "hidden": args.hidden,
               "calls": args.calls, "repeats": args.repeats}
        if fn is None:
            row.update(status="skipped", reason=why)
        else:
            try:
                row.update(status="ok", **run(fn, name, args.device, args.calls, args.repeats))
            except Exception as exc:  # noqa: BLE001 - one op failing must not hide the others
                row.update(status="failed", reason=f"{exc.__class__.__name__}: {exc}"[:500])
        rows.append(row)
    env = environment(args.device)
    for r in rows:
        r["env"] = env
    path = Path(args.out) / f"host_ops_{run_id}.jsonl"
    write_rows(path, rows)
    print(f"| op | host us / call | wall us / call |   ({args.device}, {args.tokens} tokens x {args.hidden})")
    print("|---|---:|---:|")
    for r in rows:
        if r["status"] == "ok":
            print(f"| {r['op']} | {r['host_us']:.2f} | {r['wall_us']:.2f} |")
        else:
            print(f"| {r['op']} | {r['status']}: {r['reason'][:80]} | |")
    print(f"rows: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
