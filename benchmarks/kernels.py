"""Per-token op kernels and the packed forward, timed on one CUDA GPU.

    python benchmarks/kernels.py [--out benchmarks/results/kernels.json] [--tokens 4096,65536,524288]
                                 [--no-compile] [--no-e2e]

Per kernel (LayerNorm and residual + LayerNorm at hidden 768, RoPE at ModernBERT-base's 12 x 64 heads,
GLU at its intermediate 1152; bf16), forward and backward, at each token count: median device time of one
call with the host out of the loop (10 calls captured in a CUDA graph, the replay timed by
``triton.testing.do_bench``; ``eager_ms`` keeps the eager per-call time, host launch path included) and
achieved GB/s from the bytes each op must read
and write (activations only; weights, tables and fp32 row statistics are below 0.3% and left out),
against the measured device-to-device copy bandwidth. Implementations: plain PyTorch eager, the same
under ``torch.compile(dynamic=True)``, the Triton op set, the cute op set (quack's CuteDSL LayerNorm,
when importable) and Liger (when importable). Backward is timed through ``torch.autograd.grad`` on a
retained graph, the way a training step reaches it, for every implementation alike. Before timing, each
implementation's forward and backward are checked against the fp32 reference with the kernel rule
(``err <= 2 * err_torch_same_dtype + eps``); the row records both errors.

End to end: the packed ModernBERT-base forward (``transformers.ModernBertConfig()`` defaults, random
init, bf16) on 128 documents of lognormal lengths (median ~600, capped at 2048), each op set in a fresh
process on identical weights and batch; forward under ``no_grad`` and forward + backward. The parent
compares the op sets' outputs per token (cosine against the plain-torch op set).

Writes JSON rows (one per measurement, each with GPU, driver, versions, git sha) and prints markdown tables.
Runs in about 3-4 minutes on an H200.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from packed_encoders.calibrate import dist_version  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, INNER = 768, 12, 64, 1152
DTYPE = torch.bfloat16


# ------------------------------------------------------------------------------------------------ environment


def environment() -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=ROOT).stdout.strip() or None
        except Exception:
            return None

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name, "sm": f"sm_{props.major}{props.minor}", "sms": props.multi_processor_count,
        "driver": run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": dist_version("triton"),
        "transformers": dist_version("transformers"), "cutlass_dsl": dist_version("nvidia-cutlass-dsl"),
        "quack": dist_version("quack-kernels"), "git_sha": os.environ.get("PE_GIT_SHA") or run(["git", "rev-parse", "HEAD"]),
    }


# ------------------------------------------------------------------------------------------------ timing


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def bench_graph_ms(fn, inner: int = 10) -> float | None:
    """Device time of one ``fn`` call with the host out of the loop: ``inner`` calls captured in one CUDA graph,
    the replay timed by ``do_bench`` and divided by ``inner``. ``None`` when ``fn`` cannot be captured.

    Eager timing (``bench_ms``) of a small kernel includes the host's launch path whenever that path is
    slower than the GPU: autograd's engine alone costs ~0.1-0.2 ms per backward call, which made the
    backward rows look like a fixed cost per call."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except Exception as exc:  # noqa: BLE001 - report eager timing only for this implementation
        print(f"[kernels] graph capture failed: {exc!r}"[:200], flush=True)
        torch.cuda.synchronize()
        return None
    return bench_ms(graph.replay) / inner


def copy_bandwidth() -> float:
    """Device-to-device copy GB/s (bytes read + written) on a 2 GiB buffer."""
    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


# ------------------------------------------------------------------------------------------------ op cases


class Case:
    """One op at one token count: inputs, the fp32 reference, bytes moved, and how to call each impl."""

    def __init__(self, op: str, tokens: int, seed: int = 0):
        from packed_encoders.ops import rope_tables

        self.op, self.tokens = op, tokens
        g = torch.Generator(device="cuda").manual_seed(seed)
        t = tokens

        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device="cuda") * scale).to(DTYPE)

        es = torch.empty((), dtype=DTYPE).element_size()
        if op in ("layer_norm", "residual_layer_norm"):
            self.x, self.d = rnd(t, HIDDEN, scale=2.0), rnd(t, HIDDEN)
            self.w = (rnd(HIDDEN) * 0.2 + 1).to(DTYPE)
            res = op == "residual_layer_norm"
            self.grads = [rnd(t, HIDDEN) for _ in range(2 if res else 1)]
            self.bytes = {"fwd": (4 if res else 2) * t * HIDDEN * es, "bwd": (4 if res else 3) * t * HIDDEN * es}
        elif op == "rope_qkv":
            self.qkv = rnd(t, 3 * HEADS * HEAD_DIM)
            self.cos, self.sin = rope_tables(160000.0, HEAD_DIM, 2048, "cuda")
            self.pos = torch.randint(0, 2048, (t,), device="cuda", generator=g)
            self.grads = [rnd(t, HEADS, HEAD_DIM) for _ in range(3)]
            self.bytes = {"fwd": 4 * t * HEADS * HEAD_DIM * es, "bwd": 6 * t * HEADS * HEAD_DIM * es}
        elif op == "glu":
            self.x = rnd(t, 2 * INNER, scale=2.0)
            self.grads = [rnd(t, INNER)]
            self.bytes = {"fwd": 3 * t * INNER * es, "bwd": 5 * t * INNER * es}
        else:
            raise ValueError(op)

    def inputs(self, dtype=None):
        """Fresh leaves (requiring grad) in ``dtype`` (default: the case dtype)."""
        def leaf(t):
            return t.detach().to(dtype or t.dtype).requires_grad_(True)

        if self.op == "layer_norm":
            return [leaf(self.x), leaf(self.w)]
        if self.op == "residual_layer_norm":
            return [leaf(self.x), leaf(self.d), leaf(self.w)]
        if self.op == "rope_qkv":
            return [leaf(self.qkv)]
        return [leaf(self.x)]

    def call(self, ops, inputs):
        """Outputs (a list) of op set ``ops`` on ``inputs``."""
        if self.op == "layer_norm":
            return [ops.layer_norm(inputs[0], inputs[1], None, 1e-5)]
        if self.op == "residual_layer_norm":
            return list(ops.residual_layer_norm(inputs[0], inputs[1], inputs[2], None, 1e-5))
        if self.op == "rope_qkv":
            return list(ops.rope_qkv(inputs[0], self.cos, self.sin, self.pos, HEADS, HEAD_DIM))
        return [ops.glu(inputs[0], "gelu")]


def _ref_ops():
    from packed_encoders.ops import OpSet, geglu_ref, layer_norm_ref, residual_layer_norm_ref, rope_qkv_ref

    return OpSet("ref", layer_norm_ref, residual_layer_norm_ref, rope_qkv_ref, geglu_ref)


def _compiled_ops():
    from packed_encoders.ops import TORCH_OPS, OpSet

    c = lambda f: torch.compile(f, dynamic=True)  # noqa: E731
    return OpSet("torch.compile", c(TORCH_OPS.layer_norm), c(TORCH_OPS.residual_layer_norm), c(TORCH_OPS.rope_qkv),
                 c(TORCH_OPS.glu))


def _liger_ops():
    """Liger's LayerNorm (its GEGLU is tanh-only, so not comparable to ModernBERT's erf GELU)."""
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    from packed_encoders.ops import OpSet

    def ln(x, w, b, eps):
        return LigerLayerNormFunction.apply(x, w, b if b is not None else torch.zeros_like(w), eps)

    def res_ln(x, d, w, b, eps):
        s = x + d
        return s, ln(s, w, b, eps)

    return OpSet("liger", ln, res_ln, None, None)


def implementations() -> tuple[dict, dict]:
    """``({name: OpSet}, {name: why unavailable})``."""
    from packed_encoders.ops import TORCH_OPS

    impls, missing = {"torch": TORCH_OPS}, {}
    try:
        from packed_encoders.ops.fused import TRITON_OPS

        impls["triton"] = TRITON_OPS
    except Exception as exc:
        missing["triton"] = repr(exc)
    try:
        from packed_encoders.ops.cute import unavailable

        why = unavailable(torch.device("cuda"))
        if why:
            missing["cute"] = why
        else:
            from packed_encoders.ops.cute.opset import CUTE_OPS

            impls["cute"] = CUTE_OPS
    except Exception as exc:
        missing["cute"] = repr(exc)
    try:
        impls["liger"] = _liger_ops()
    except Exception as exc:
        missing["liger"] = f"not importable ({exc.__class__.__name__})"
    return impls, missing


_CUTE_OPS = ("layer_norm", "residual_layer_norm")  # the cute op set's own kernels; RoPE/GLU are Triton's


def _max_err(outs, refs):
    return max(((o.float() - r.float()).abs().max().item() for o, r in zip(outs, refs)), default=0.0)


def kernel_rows(tokens_list, with_compile: bool, copy_gbps: float) -> list[dict]:
    impls, missing = implementations()
    if with_compile:
        impls["torch.compile"] = _compiled_ops()
    rows = []
    for name, why in missing.items():
        print(f"[kernels] {name}: skipped ({why})", flush=True)
    for op in ("layer_norm", "residual_layer_norm", "rope_qkv", "glu"):
        for t in tokens_list:
            case = Case(op, t)
            ref_in = case.inputs(torch.float32)
            ref_out = case.call(_ref_ops(), ref_in)
            ref_grad = torch.autograd.grad(ref_out, ref_in, [g.float() for g in case.grads], allow_unused=True)
            base_err = None
            for name, ops in impls.items():
                if (name == "cute" and op not in _CUTE_OPS) or (name == "liger" and op not in _CUTE_OPS):
                    continue
                inputs = case.inputs()
                try:
                    outs = case.call(ops, inputs)
                    grads = torch.autograd.grad(outs, inputs, case.grads, retain_graph=True, allow_unused=True)
                except Exception as exc:
                    rows.append(dict(section="kernel", op=op, tokens=t, impl=name, error=repr(exc)[:300]))
                    print(f"[kernels] {op} T={t} {name}: failed {exc!r}"[:300], flush=True)
                    continue
                err = {"fwd": _max_err(outs, ref_out),
                       "bwd": _max_err([g for g in grads if g is not None],
                                       [r for g, r in zip(grads, ref_grad) if g is not None])}
                if name == "torch":
                    base_err = err
                scale = max(1.0, max(r.float().abs().max().item() for r in ref_out))
                timers = {
                    "fwd": lambda: case.call(ops, inputs),
                    "bwd": lambda: torch.autograd.grad(outs, inputs, case.grads, retain_graph=True, allow_unused=True),
                }
                for direction, fn in timers.items():
                    with torch.no_grad() if direction == "fwd" else contextlib.nullcontext():
                        eager_ms = bench_ms(fn)
                        graph_ms = bench_graph_ms(fn)
                    ms = graph_ms if graph_ms is not None else eager_ms
                    gbps = case.bytes[direction] / ms / 1e6
                    ok = base_err is not None and err[direction] <= 2 * base_err[direction] + 32 * 2.0 ** -23 * scale
                    rows.append(dict(section="kernel", op=op, direction=direction, tokens=t, impl=name,
                                     ms=round(ms, 5), timing="cuda_graph" if graph_ms is not None else "eager",
                                     eager_ms=round(eager_ms, 5),
                                     gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1),
                                     bytes=case.bytes[direction], max_err=err[direction],
                                     torch_err=None if base_err is None else base_err[direction], rule_ok=ok))
                    print(f"[kernels] {op:20s} {direction} T={t:7d} {name:14s} {ms:8.4f} ms (eager {eager_ms:8.4f}) "
                          f"{gbps:8.1f} GB/s "
                          f"({100 * gbps / copy_gbps:5.1f}% copy) err {err[direction]:.3g} ok={ok}", flush=True)
            case = None  # dropped before empty_cache; not `del`: the timers above read the name
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------ end to end


def _e2e_batch(n_docs=128, cap=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n_docs, generator=g) * 0.6 + math.log(600)).round().clamp(16, cap).long()
    return lengths.tolist()


def e2e_child(variant: str, out_path: str) -> None:
    """One op set, fresh process: build the model and batch, save the first output, time fwd and fwd+bwd."""
    import transformers

    from packed_encoders.batch import from_packed
    from packed_encoders.model.forward import encoder_forward, plan_attention
    from packed_encoders.model.params import ModernBertParams
    from packed_encoders.ops.select import select_ops

    cfg = transformers.ModernBertConfig()
    torch.manual_seed(0)
    model = transformers.ModernBertModel(cfg).to("cuda", DTYPE).eval()
    params = ModernBertParams.from_hf_config(cfg)
    ops, reason = select_ops(variant, torch.device("cuda"))
    lengths = _e2e_batch()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, cfg.vocab_size, (sum(lengths),), generator=g).cuda()
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    batch = from_packed(input_ids=ids, inputs_embeds=None, cu_seqlens=cu, max_seqlen=max(lengths),
                        position_ids=None, vocab_size=cfg.vocab_size)
    result = {"variant": variant, "ops": ops.name, "reason": reason, "tokens": sum(lengths), "docs": len(lengths)}
    for mode in ("fwd", "fwd+bwd"):
        grad = mode != "fwd"
        with torch.set_grad_enabled(grad):
            plan = plan_attention(params, batch, "auto", grad=grad, dtype=DTYPE, dropout=False)
            result[f"attention_{mode}"] = {str(k): v.backend for k, v in plan.items()}

            def step():
                out = encoder_forward(model, params, batch, attention=plan, ops=ops)
                if grad:
                    out.float().square().mean().backward()
                    model.zero_grad(set_to_none=True)
                return out

            first = step()
            if mode == "fwd":
                torch.save(first.detach().cpu(), out_path + ".out.pt")
            for _ in range(3):
                step()
            times = []
            for _ in range(10):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
        ms = statistics.median(times)
        result[mode] = {"ms": round(ms, 3), "tokens_per_s": round(sum(lengths) / ms * 1e3),
                        "seqs_per_s": round(len(lengths) / ms * 1e3, 1)}
    if hasattr(ops, "fallbacks"):
        result["fallbacks"] = ops.fallbacks()
    Path(out_path).write_text(json.dumps(result))


def e2e_rows(variants) -> list[dict]:
    rows, outs = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in variants:
            path = os.path.join(tmp, variant + ".json")
            t0 = time.time()
            proc = subprocess.run([sys.executable, __file__, "--e2e-child", variant, path], capture_output=True,
                                  text=True, cwd=ROOT, timeout=240)
            if proc.returncode != 0 or not os.path.exists(path):
                rows.append(dict(section="e2e", variant=variant, error=(proc.stderr or proc.stdout)[-1500:]))
                print(f"[e2e] {variant}: failed\n{proc.stderr[-1500:]}", flush=True)
                continue
            res = json.loads(Path(path).read_text())
            outs[variant] = torch.load(path + ".out.pt")
            print(f"[e2e] {variant}: fwd {res['fwd']} fwd+bwd {res['fwd+bwd']} ({time.time() - t0:.0f} s)", flush=True)
            rows.append(dict(section="e2e", **res))
    if "torch" in outs:
        base = outs["torch"].float()
        for row in rows:
            other = outs.get(row.get("variant"))
            if other is not None:
                cos = torch.nn.functional.cosine_similarity(other.float(), base, dim=-1)
                row["cosine_vs_torch_ops"] = {"min": round(cos.min().item(), 6), "mean": round(cos.mean().item(), 6)}
        t_fwd = next((r["fwd"]["ms"] for r in rows if r.get("variant") == "torch" and "fwd" in r), None)
        t_all = next((r["fwd+bwd"]["ms"] for r in rows if r.get("variant") == "torch" and "fwd" in r), None)
        for row in rows:
            if "fwd" in row and t_fwd:
                row["speedup_fwd_vs_torch_ops"] = round(t_fwd / row["fwd"]["ms"], 3)
                row["speedup_fwd_bwd_vs_torch_ops"] = round(t_all / row["fwd+bwd"]["ms"], 3)
    return rows


# ------------------------------------------------------------------------------------------------ sweep


def sweep_rows(tokens: int, copy_gbps: float) -> list[dict]:
    """Time the Triton launchers directly (no autograd) under alternative launch configurations, at the
    benchmark geometry, to calibrate the ``config()`` heuristics of ``packed_encoders/ops/triton/*.py``."""
    from packed_encoders.ops import rope_tables
    from packed_encoders.ops.triton import glu as G
    from packed_encoders.ops.triton import layer_norm as L
    from packed_encoders.ops.triton import rope as R

    t, es = tokens, 2
    g = torch.Generator(device="cuda").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(DTYPE)  # noqa: E731
    x, d, dy, ds = (rnd(t, HIDDEN) for _ in range(4))
    w = rnd(HIDDEN)
    s, _, mean, rstd = L.forward(x, d, w, None, 1e-5, DTYPE, DTYPE)
    qkv = rnd(t, 3 * HEADS * HEAD_DIM)
    cos, sin = rope_tables(160000.0, HEAD_DIM, 2048, "cuda")
    pos = torch.randint(0, 2048, (t,), device="cuda", generator=g)
    dq, dk, dv = (rnd(t, HEADS, HEAD_DIM) for _ in range(3))
    z, dz = rnd(t, 2 * INNER), rnd(t, INNER)
    ln_block = L.config(HIDDEN, 2)[0]
    rope_block = R.config(HEADS, HEAD_DIM)[0]
    cases = [
        ("residual_layer_norm", "fwd", L, [(ln_block, r, nw, None) for r in (1, 2, 4, 8) for nw in (4, 8)],
         lambda: L.forward(x, d, w, None, 1e-5, DTYPE, DTYPE), 4 * t * HIDDEN * es),
        ("residual_layer_norm", "bwd", L, [(ln_block, r, nw, (ps, st)) for r in (1, 2, 4) for nw in (4, 8)
                                           for ps in (4, 8, 12) for st in (1, 2, 3)],
         lambda: L.backward(dy, s, w, mean, rstd, ds, False, DTYPE, None), 4 * t * HIDDEN * es),
        ("rope_qkv", "fwd", R, [(rope_block, r, nw, None) for r in (1, 2, 4, 8) for nw in (2, 4, 8)],
         lambda: R.forward(qkv, cos, sin, pos, HEADS, HEAD_DIM), 4 * t * HEADS * HEAD_DIM * es),
        ("rope_qkv", "bwd", R, [(rope_block, r, nw, None) for r in (1, 2, 4, 8) for nw in (2, 4, 8)],
         lambda: R.backward(dq, dk, dv, cos, sin, pos, HEADS, HEAD_DIM, DTYPE), 6 * t * HEADS * HEAD_DIM * es),
        ("glu", "fwd", G, [(bt, bi, nw, None) for bt, bi in ((8, 128), (16, 128), (32, 128), (64, 128), (16, 256),
                                                              (4, 1024), (2, 2048)) for nw in (4, 8)],
         lambda: G.forward(z, "gelu"), 3 * t * INNER * es),
        ("glu", "bwd", G, [(bt, bi, nw, None) for bt, bi in ((8, 128), (16, 128), (32, 128), (64, 128), (16, 256),
                                                              (4, 1024), (2, 2048)) for nw in (4, 8)],
         lambda: G.backward(dz, z, "gelu"), 5 * t * INNER * es),
    ]
    rows = []
    for op, direction, module, candidates, fn, nbytes in cases:
        default = (L.config(HIDDEN, 2, direction == "bwd") if module is L else
                   R.config(HEADS, HEAD_DIM) if module is R else G.config(INNER))
        original, original_ps, original_st = module.config, L.BWD_PROGRAMS_PER_SM, L.BWD_STAGES
        results = []
        for a, b, nw, ps in candidates:
            module.config = lambda *args, _c=(a, b, nw), **kw: _c
            if ps is not None:  # (programs per SM, pipeline stages) of the persistent LayerNorm backward
                L.BWD_PROGRAMS_PER_SM, L.BWD_STAGES = ps
            try:
                ms = bench_ms(fn)
            except Exception as exc:
                print(f"[sweep] {op} {direction} {(a, b, nw, ps)}: {exc!r}"[:200], flush=True)
                continue
            finally:
                module.config, L.BWD_PROGRAMS_PER_SM, L.BWD_STAGES = original, original_ps, original_st
            gbps = nbytes / ms / 1e6
            results.append(dict(section="sweep", op=op, direction=direction, tokens=t, config=[a, b, nw],
                                programs_per_sm=None if ps is None else ps[0], stages=None if ps is None else ps[1],
                                is_default=(a, b, nw) == tuple(default) and ps in (None, (L.BWD_WARPS_PER_SM // nw,
                                                                                          L.BWD_STAGES)),
                                ms=round(ms, 5), gbps=round(gbps, 1), pct_copy=round(100 * gbps / copy_gbps, 1)))
        results.sort(key=lambda r: r["ms"])
        for r in results[:3] + [r for r in results[3:] if r["is_default"]]:
            print(f"[sweep] {op:20s} {direction} cfg={r['config']} per_sm={r['programs_per_sm']} stages={r.get('stages')} "
                  f"{r['ms']:.4f} ms {r['gbps']:.0f} GB/s ({r['pct_copy']}%){' <- default' if r['is_default'] else ''}",
                  flush=True)
        rows += results
    return rows


# ------------------------------------------------------------------------------------------------ report


def print_tables(rows, copy_gbps):
    print(f"\nDevice copy bandwidth: {copy_gbps:.0f} GB/s (read + write)\n")
    kern = [r for r in rows if r.get("section") == "kernel" and "ms" in r]
    if not kern:
        return
    impls = list(dict.fromkeys(r["impl"] for r in kern))
    print("| op | dir | tokens | " + " | ".join(f"{i} ms (GB/s, % copy)" for i in impls) + " |")
    print("|---|---|---:|" + "---:|" * len(impls))
    keys = list(dict.fromkeys((r["op"], r["direction"], r["tokens"]) for r in kern))
    for op, direction, t in keys:
        cells = []
        for i in impls:
            r = next((r for r in kern if (r["op"], r["direction"], r["tokens"], r["impl"]) == (op, direction, t, i)), None)
            cells.append("" if r is None else f"{r['ms']:.4f} ({r['gbps']:.0f}, {r['pct_copy']:.0f}%)"
                         + ("" if r["rule_ok"] else " ERR"))
        print(f"| {op} | {direction} | {t} | " + " | ".join(cells) + " |")

def print_e2e(rows):
    e2e = [r for r in rows if r.get("section") == "e2e" and "fwd" in r]
    if e2e:
        print("\n| op set | tokens | fwd ms | fwd tok/s | fwd+bwd ms | speedup fwd | speedup fwd+bwd | cos min/mean vs torch ops |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for r in e2e:
            cos = r.get("cosine_vs_torch_ops", {})
            print(f"| {r['variant']} | {r['tokens']} | {r['fwd']['ms']} | {r['fwd']['tokens_per_s']} | "
                  f"{r['fwd+bwd']['ms']} | {r.get('speedup_fwd_vs_torch_ops')} | "
                  f"{r.get('speedup_fwd_bwd_vs_torch_ops')} | {cos.get('min')}/{cos.get('mean')} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    parser.add_argument("--tokens", default="4096,65536,524288")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end packed forward")
    parser.add_argument("--no-kernels", action="store_true", help="skip the per-kernel rows")
    parser.add_argument("--sweep", action="store_true",
                        help="only time the Triton kernels under alternative launch configs (64k tokens)")
    parser.add_argument("--e2e-child", nargs=2, metavar=("VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.e2e_child:
        e2e_child(*args.e2e_child)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernels.py needs a CUDA GPU")
    t0 = time.time()
    env = environment()
    copy_gbps = copy_bandwidth()
    rows = [dict(section="copy", gbps=round(copy_gbps, 1))]
    if args.sweep:
        rows += sweep_rows(65536, copy_gbps)
        args.no_kernels = args.no_e2e = True
    if not args.no_kernels:
        rows += kernel_rows([int(t) for t in args.tokens.split(",")], not args.no_compile, copy_gbps)
    if not args.no_e2e:
        variants = ["torch", "triton"]
        impls_missing = implementations()[1]
        if "cute" not in impls_missing:
            variants.append("cute")
        rows += e2e_rows(variants)
    rows = [dict(r, **env) for r in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(json.dumps(r, default=str) for r in rows) + "\n")
    print_tables(rows, copy_gbps)
    print_e2e(rows)
    print(f"\n{len(rows)} rows -> {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    importlib.invalidate_caches()
    main()
