"""GEMM epilogue fusions at document / indexing token counts, side by side on one CUDA GPU (sm90+ for quack).

    python benchmarks/gemm_epilogue.py [--out benchmarks/results/gemm_epilogue.json] [--ms 7424,122880]
                                       [--models base,large] [--quick]

What each row compares, per (model shape, M tokens), bf16, bias off (as ModernBERT):

- ``glu``: ``Wi`` + GLU (exact-erf GeGLU). ``cublas+glu``: ``F.linear`` then the Triton GLU kernel (the
  packed forward today); ``triton_fused``: ``ops.triton.small_gemm.glu_linear``; ``quack[...]``:
  ``ops.cute.gemm.glu_linear`` (quack's CuteDSL GEMM, our erf-GeGLU epilogue, HF's weight read in
  place through ``concat_layout``) under quack's default config and each of :data:`QUACK_CONFIGS`.
- ``residual``: the output projection followed by the next norm. ``linear+res_ln``: ``F.linear`` then the
  Triton residual + LayerNorm (reads two ``[M, H]`` tensors, writes two); ``addmm+ln``: cuBLAS
  ``addmm(residual, a, W.T)`` (the residual added in cuBLAS's epilogue) then a plain LayerNorm;
  ``quack_add+ln``: quack's ``gemm_add`` then the LayerNorm.
- ``linear``: plain projections, cuBLAS ``F.linear`` vs quack's ``gemm`` (its default config) and, without
  ``--quick``, ``ops.cute.gemm.linear`` under each of :data:`QUACK_CONFIGS`.
- ``rope``: ``Wqkv`` + RoPE (q, k rotated at real document positions). ``cublas+rope`` / ``quack+rope``: the
  plain ``Wqkv`` GEMM then the Triton RoPE kernel (the separate pass); ``rope_epi[...]``:
  ``ops.cute.gemm.rope_linear`` for q, k (RoPE in the epilogue, pair order) plus quack's GEMM for v, under
  :data:`packed_encoders.ops.cute.gemm.ROPE_CONFIG` and each config of :func:`rope_configs` (a config that
  does not build is recorded); ``rope_epi_qk_only``: the q, k GEMM alone, to split the cost. The reference is
  q, k in pair order (``ops.rope.rope_linear_ref``) and v.

Timing: calls captured in one CUDA graph after a warm-up on a side stream (compilation happens there and is
reported as ``first_call_s``), replayed; per-call GPU microseconds. Every implementation is first checked
against an fp32 reference (max abs error / max abs value); a mismatch is recorded and not timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gemm_small import graph_us, rel_err  # noqa: E402

DTYPE = torch.bfloat16
MODELS = {"base": (768, 1152), "large": (1024, 2624)}  # hidden_size, intermediate_size
MS = (7424, 122880)  # 8 and 128 real documents of ~930 tokens (the inference and indexing benchmarks)
TOLERANCE = 2e-2


def _config(m, n, pingpong, cm, cn):
    from quack.gemm_config import GemmConfig

    return GemmConfig(tile_m=m, tile_n=n, pingpong=pingpong, cluster_m=cm, cluster_n=cn, is_dynamic_persistent=False,
                      device_capacity=9)


def quack_configs():
    c = _config
    return [c(128, 192, True, 2, 1), c(128, 128, True, 2, 1), c(128, 256, False, 2, 1), c(256, 128, False, 2, 1),
            c(256, 192, False, 2, 1), c(128, 192, True, 1, 2), c(256, 160, False, 1, 2)]


def rope_configs():
    c = _config
    # tile_n / cluster_m must hold whole 64-wide heads of the pair layout
    return [c(128, 192, True, 1, 1), c(128, 256, False, 2, 1), c(256, 128, False, 2, 1), c(128, 128, True, 1, 2),
            c(128, 192, True, 1, 2), c(256, 192, False, 1, 1)]


def measure(row: dict, fn, ref, calls: int, view=None) -> dict:
    """``view``: maps ``fn()``'s output to the layout of ``ref`` for the check only (not timed)."""
    t0 = time.perf_counter()
    try:
        out = fn()
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  recorded, not fatal: one config that does not build must not end the run
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return row
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    out = view(out) if view is not None else (out[1] if isinstance(out, tuple) else out)
    row["rel_err"] = rel_err(out, ref)
    if not row["rel_err"] < TOLERANCE:
        row["error"] = f"mismatch: rel err {row['rel_err']:.3g}"
        return row
    try:
        row["us"] = round(graph_us(lambda i: fn(), n_calls=calls, replays=5), 2)
    except Exception as e:  # noqa: BLE001
        row["error"] = f"timing: {type(e).__name__}: {str(e)[:300]}"
        return row
    # host time of an eager call (what a forward outside CUDA graphs pays per launch), GPU work not awaited
    torch.cuda.synchronize()
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    row["host_us"] = round((time.perf_counter() - t0) * 1e6 / n, 1)
    torch.cuda.synchronize()
    return row


def glu_rows(h: int, inter: int, m: int, gen, calls: int, quick: bool):
    from packed_encoders.ops.cute import gemm as glu_gemm
    from packed_encoders.ops.triton import glu as tglu
    from packed_encoders.ops.triton import small_gemm as sg

    x = torch.randn((m, h), generator=gen, device="cuda").to(DTYPE)
    w = (torch.randn((2 * inter, h), generator=gen, device="cuda") * h ** -0.5).to(DTYPE)
    hf = F.linear(x.float(), w.float())
    ref = F.gelu(hf[:, :inter]) * hf[:, inter:]
    del hf
    impls = [("cublas+glu", lambda: tglu.forward(F.linear(x, w), "gelu")),
             ("triton_fused", lambda: sg.glu_linear(x, w, None, "gelu")),
             ("quack[default]", lambda: glu_gemm.glu_linear(x, w, "gelu"))]
    if not quick:
        impls += [(f"quack{(c.tile_m, c.tile_n, 'pp' if c.pingpong else 'coop', c.cluster_m, c.cluster_n)}",
                   lambda c=c: glu_gemm.glu_linear(x, w, "gelu", config=c)) for c in quack_configs()]
    for name, fn in impls:
        yield measure({"op": "glu", "impl": name}, fn, ref, calls)


def residual_rows(h: int, k: int, m: int, gen, calls: int):
    from packed_encoders.ops import fused

    a = torch.randn((m, k), generator=gen, device="cuda").to(DTYPE)
    x = torch.randn((m, h), generator=gen, device="cuda").to(DTYPE)
    w = (torch.randn((h, k), generator=gen, device="cuda") * k ** -0.5).to(DTYPE)
    nw = torch.randn(h, generator=gen, device="cuda").to(DTYPE)
    s = x.float() + F.linear(a.float(), w.float())
    ref = F.layer_norm(s, (h,), nw.float(), None, 1e-5)

    def quack_add():
        from quack.gemm_interface import gemm_add

        s2 = gemm_add(a, w.t(), x, tuned=False)
        return s2, fused.layer_norm(s2, nw, None, 1e-5)

    impls = [("linear+res_ln", lambda: fused.residual_layer_norm(x, F.linear(a, w), nw, None, 1e-5)),
             ("addmm+ln", lambda: (lambda s2: (s2, fused.layer_norm(s2, nw, None, 1e-5)))(torch.addmm(x, a, w.t()))),
             ("quack_add+ln", quack_add)]
    for name, fn in impls:
        yield measure({"op": "residual", "impl": name, "K": k}, fn, ref, calls)


def linear_rows(k: int, n: int, m: int, gen, calls: int, sweep: bool = False):
    a = torch.randn((m, k), generator=gen, device="cuda").to(DTYPE)
    w = (torch.randn((n, k), generator=gen, device="cuda") * k ** -0.5).to(DTYPE)
    ref = F.linear(a.float(), w.float())

    def quack_gemm():
        from quack.gemm_interface import gemm

        return gemm(a, w.t(), tuned=False)

    impls = [("cublas", lambda: F.linear(a, w)), ("quack", quack_gemm)]
    if sweep:
        from packed_encoders.ops.cute import gemm as qg

        impls += [(f"quack{(c.tile_m, c.tile_n, 'pp' if c.pingpong else 'coop', c.cluster_m, c.cluster_n)}",
                   lambda c=c: qg.linear(a, w, config=c)) for c in quack_configs()]
    for name, fn in impls:
        yield measure({"op": "linear", "impl": name, "K": k, "N": n}, fn, ref, calls)


def rope_rows(h: int, m: int, gen, calls: int, quick: bool):
    from quack.gemm_interface import gemm

    from packed_encoders.ops import fused
    from packed_encoders.ops.cute import gemm as qg
    from packed_encoders.ops.rope import pair_freq_table, rope_linear_ref

    heads, hd = h // 64, 64
    x = torch.randn((m, h), generator=gen, device="cuda").to(DTYPE)
    w = (torch.randn((3 * h, h), generator=gen, device="cuda") * h ** -0.5).to(DTYPE)
    lengths = torch.full((m // 930 + 1,), 930)
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])[:m].to("cuda")
    inv = 1.0 / (160000.0 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    freqs = torch.arange(4096, device="cuda").float()[:, None] * inv[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    freq = pair_freq_table(inv, 2 * heads)
    pos_f = positions.float()
    # reference in pair order for q, k (the layout the epilogue writes), HF order for v
    ref = torch.cat((rope_linear_ref(x.float(), w[:2 * h].float(), pos_f, inv, hd),
                     F.linear(x.float(), w[2 * h:].float())), 1)

    order = torch.arange(hd, device="cuda").view(2, hd // 2).t().reshape(-1)

    def pair(out):  # (q, k, v) in HF order -> q, k in pair order, v
        q, k, v = out
        return torch.cat((q[..., order].reshape(m, -1), k[..., order].reshape(m, -1), v.reshape(m, -1)), 1)

    def separate(linear):
        return lambda: fused.rope_qkv(linear(), cos, sin, positions, heads, hd)

    def epi(config=None):
        return lambda: (qg.rope_linear(x, w[:2 * h], pos_f, freq, hd, config=config),
                        gemm(x, w[2 * h:].t(), tuned=False))

    def joined(out):
        return torch.cat(out, 1)

    impls = [("cublas+rope", separate(lambda: F.linear(x, w))),
             ("quack+rope", separate(lambda: gemm(x, w.t(), tuned=False))),
             ("rope_epi[default]", epi())]
    if not quick:
        impls += [(f"rope_epi{(c.tile_m, c.tile_n, 'pp' if c.pingpong else 'coop', c.cluster_m, c.cluster_n)}",
                   epi(c)) for c in rope_configs()]
    for name, fn in impls:
        yield measure({"op": "rope", "impl": name}, fn, ref, calls, view=pair if "+rope" in name else joined)
    # the split of the cost: q, k GEMM with and without the epilogue
    qk_ref = F.linear(x.float(), w[:2 * h].float())
    yield measure({"op": "rope", "impl": "quack_qk_plain"}, lambda: gemm(x, w[:2 * h].t(), tuned=False), qk_ref,
                  calls)
    yield measure({"op": "rope", "impl": "rope_epi_qk_only"},
                  lambda: qg.rope_linear(x, w[:2 * h], pos_f, freq, hd), ref[:, :2 * h], calls)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--ms", default=",".join(map(str, MS)))
    p.add_argument("--models", default="base")
    p.add_argument("--ops", default="glu,residual,linear,rope")
    p.add_argument("--quick", action="store_true", help="quack's default config only (no config sweep)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("gemm_epilogue: needs a CUDA GPU", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    ops = args.ops.split(",")
    rows = []
    for model in args.models.split(","):
        h, inter = MODELS[model]
        for m in map(int, args.ms.split(",")):
            calls = max(4, min(50, 1_000_000 // m))
            groups = []
            if "glu" in ops:
                groups.append(glu_rows(h, inter, m, gen, calls, args.quick))
            if "residual" in ops:
                groups += [residual_rows(h, h, m, gen, calls), residual_rows(h, inter, m, gen, calls)]
            if "rope" in ops:
                groups.append(rope_rows(h, m, gen, calls, args.quick))
            if "linear" in ops:
                sweep = not args.quick
                groups += [linear_rows(h, 3 * h, m, gen, calls, sweep), linear_rows(h, h, m, gen, calls, sweep),
                           linear_rows(inter, h, m, gen, calls, sweep)]
            for group in groups:
                for row in group:
                    row.update(model=model, M=m)
                    rows.append(row)
                    shape = {k: row[k] for k in ("K", "N") if k in row}
                    status = (f"{row['us']:.1f} us (host {row['host_us']} us)" if "us" in row
                              else row.get("error"))
                    print(f"{model} M={m} {row['op']} {shape} {row['impl']}: {status} "
                          f"(first {row.get('first_call_s', '-')} s, err {row.get('rel_err', float('nan')):.2g})",
                          flush=True)
                torch.cuda.empty_cache()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        try:
            import quack

            meta["quack"] = getattr(quack, "__version__", "?")
        except Exception:  # noqa: BLE001
            pass
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
