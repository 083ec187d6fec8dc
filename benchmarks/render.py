"""JSON rows -> markdown tables and matplotlib bar charts.

Ratios are computed only between rows of the same run (same ``run_id``): ``x sdpa`` against that run's
``hf_sdpa`` row and ``x compile`` against its ``compile`` row (steady state, medians).

    python -m benchmarks.render benchmarks/results                 # every *.jsonl in the folder
    python -m benchmarks.render FILE.jsonl --md results.md --png-dir benchmarks/results/plots
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.common import read_rows  # noqa: E402

GIB = 2**30


def _groups(rows: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in rows:
        groups[(r.get("run_id", "?"), r.get("runner"), r.get("endpoint"), r.get("family"))].append(r)
    return groups


def _ratio(value, base) -> str:
    return f"{value / base:.2f}x" if value and base else "-"


def _fmt(x, digits=1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _attention(r: dict) -> str:
    enc = (r.get("describe") or [{}])[0]
    if not enc:
        return ""
    att = enc.get("last_attention") or {}
    return ", ".join(f"{k}: {v}" for k, v in att.items()) + (f"; kernels {enc['kernels']}" if enc.get("kernels")
                                                              else "")


def table(group: list[dict]) -> str:
    """One markdown table for the rows of one (run, endpoint, family)."""
    ok = {r["variant"]: r for r in group if r.get("status") == "ok"}
    sdpa = ok.get("hf_sdpa", {}).get("seqs_per_s_median")
    comp = ok.get("compile", {}).get("seqs_per_s_median")
    sdpa_mem = ok.get("hf_sdpa", {}).get("peak_reserved_bytes")
    lines = ["| variant | seq/s median (min-max) | tokens/s | x hf_sdpa | x compile | first result s | first pass s "
             "| peak reserved GiB (trials / first pass) | mem x hf_sdpa | token cos min / mean | pooled cos min "
             "| attention |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in group:
        v = r["variant"]
        if r.get("status") != "ok":
            lines.append(f"| {v} | {r.get('status')}: {r.get('reason', '')} |" + " |" * 10)
            continue
        p = r.get("parity", {})
        mem, mem0 = r.get("peak_reserved_bytes"), r.get("peak_reserved_first_pass_bytes")
        mem_txt = f"{mem / GIB:.2f} / {mem0 / GIB:.2f}" if mem and mem0 else "-"
        lines.append(
            f"| {v} | {_fmt(r['seqs_per_s_median'])} ({_fmt(r['seqs_per_s_worst'])}-{_fmt(r['seqs_per_s_best'])}) "
            f"| {_fmt(r['tokens_per_s_median'], 0)} | {_ratio(r['seqs_per_s_median'], sdpa)} "
            f"| {_ratio(r['seqs_per_s_median'], comp)} | {_fmt(r.get('time_to_first_result_s'), 2)} "
            f"| {_fmt(r['first_pass_s'], 2)} | {mem_txt} | {_ratio(mem, sdpa_mem)} "
            f"| {p.get('token_cos_min', 0):.5f} / {p.get('token_cos_mean', 0):.5f} "
            f"| {p.get('pooled_cos_min', 0):.5f} | {_attention(r)} |")
    return "\n".join(lines)


def _header(group: list[dict]) -> str:
    r = next((x for x in group if x.get("status") == "ok"), group[0])
    env = r.get("env", {})
    hw = env.get("gpu") or env.get("cpu") or env.get("device")
    s = r.get("lengths") or {}
    length = (f"{r.get('n_seqs')} seqs from `{r.get('set')}`, batch {r.get('batch')}: p50 {s.get('p50')}, "
              f"p90 {s.get('p90')}, p99 {s.get('p99')}, max {s.get('max')} tokens; padding "
              f"{s.get('padding_fraction', 0):.0%} of padded tokens") if s else ""
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "sentence_transformers", "triton",
                                                     *common.KIT) if env.get(k))
    missing = common.missing_kit(env)
    kit = (f" **Without {', '.join(missing)}: packed variants ran without the kit's kernels (quack GEMMs, FA4, "
           "CuteDSL).**") if missing else ""
    return (f"### {r.get('runner')} / {r.get('endpoint')} / {r.get('family')} -- {r.get('model')} "
            f"{r.get('dtype')}\n\n{hw}; driver {env.get('driver', '-')}; {versions}; git {env.get('git_sha')}. "
            f"{length}. Impl: {r.get('impl', '-')}.{kit}")


def index_table(rows: list[dict]) -> str:
    """On-disk ColBERT index sizes written by the indexing runner (packed vs padded layout, same run)."""
    idx = [r for r in rows if r.get("status") == "ok" and r.get("index")]
    if not idx:
        return ""
    padded = {r.get("run_id"): r["index"]["bytes"] for r in idx if r["index"]["layout"] == "padded"}
    lines = ["| run | variant | layout | documents | tokens | bytes on disk | MiB | vs padded |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in idx:
        i = r["index"]
        ratio = _ratio(i["bytes"], padded.get(r.get("run_id")))
        lines.append(f"| {r.get('run_id')} | {r['variant']} | {i['layout']} | {i['documents']:,} | {i['tokens']:,} "
                     f"| {i['bytes']:,} | {i['bytes'] / 2**20:,.1f} | {ratio} |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """All tables for ``rows``."""
    parts = []
    for _, group in sorted(_groups(rows).items(), key=lambda kv: tuple(str(k) for k in kv[0])):
        parts.append(_header(group) + "\n\n" + table(group))
    it = index_table(rows)
    if it:
        parts.append("### ColBERT index on disk (fp16 token vectors)\n\n" + it)
    cmd = next((r.get("command") for r in rows if r.get("command")), None)
    if cmd:
        parts.append(f"Command: `{cmd}`")
    return "\n\n".join(parts) + "\n"


def plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """One PNG per (run, endpoint, family): median sequences/s per variant, min-max as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for (run_id, runner, endpoint, family), group in _groups(rows).items():
        ok = [r for r in group if r.get("status") == "ok"]
        if not ok:
            continue
        names = [r["variant"] for r in ok]
        med = [r["seqs_per_s_median"] for r in ok]
        lo = [m - r["seqs_per_s_worst"] for m, r in zip(med, ok)]
        hi = [r["seqs_per_s_best"] - m for m, r in zip(med, ok)]
        base = next((r["seqs_per_s_median"] for r in ok if r["variant"] == "hf_sdpa"), None)
        fig, ax = plt.subplots(figsize=(1.1 * len(ok) + 2.5, 4))
        colors = ["#9e9e9e" if n.startswith("hf_") or n == "compile" else "#1f77b4" for n in names]
        bars = ax.bar(names, med, yerr=[lo, hi], capsize=3, color=colors)
        for bar, m, top in zip(bars, med, hi):
            label = (f"{m:,.0f}" if m >= 100 else f"{m:.3g}") + (f"\n{m / base:.2f}x" if base else "")
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, m + top), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 3), textcoords="offset points")
        ax.set_ylabel("sequences / s (median, min-max)")
        env = ok[0].get("env", {})
        ax.set_title(f"{runner} {endpoint} / {family} -- {ok[0].get('model')} {ok[0].get('dtype')} on "
                     f"{env.get('gpu') or env.get('device')}", fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax.margins(y=0.18)
        fig.tight_layout()
        path = out_dir / f"{runner}_{endpoint}_{family}_{str(run_id).replace(':', '-')}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="JSON-lines files or folders holding them")
    ap.add_argument("--md", help="write the markdown here (default: stdout)")
    ap.add_argument("--png-dir", help="write PNG bar charts here")
    args = ap.parse_args(argv)
    files = []
    for p in map(Path, args.inputs):
        files += sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    rows = read_rows(files)
    text = markdown(rows)
    if args.md:
        Path(args.md).write_text(text, encoding="utf-8")
    else:
        print(text)
    if args.png_dir:
        for path in plots(rows, Path(args.png_dir)):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
