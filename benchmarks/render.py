"""JSON rows -> markdown tables and matplotlib bar charts.

Ratios are computed only between rows of the same run (same ``run_id``): ``x sdpa`` against that run's
``hf_sdpa`` row and ``x compile`` against its ``compile`` row (steady state, medians). Training rows
(``runner == "training"``, from ``benchmarks/training.py``) get their own tables and plots: step time, memory,
host / GPU time per step, loss curves, all against the run's ``hf_sdpa`` row. Host rows (``runner == "host"``, from
``benchmarks/host.py``, one file per run) get that runner's table per file; rows of other runners (``host_ops``,
``gemm_eager``: their runners print their own tables) are counted on stderr, not rendered.

    python -m benchmarks.render benchmarks/results                 # every *.jsonl in the folder
    python -m benchmarks.render FILE.jsonl --md results.md --png-dir benchmarks/results/plots
    python -m benchmarks.render benchmarks/results/h200/training_*.jsonl --md docs/results/h200-training.md \\
        --png-dir docs/results/png             # training rows: step time, memory, host/GPU ms, loss curves
    python -m benchmarks.render benchmarks/results/h200 --readme README.md   # the README's results block

A row's ``code_commit`` (when set) names the commit whose tree ran; ``env.git_sha`` is what ``git`` said in the
run's copy of the tree (a device copy may carry another checkout's ``.git``). A training row of a ``NAME@DIR``
variant (the package of another tree) shows DIR's commit, its ``code_sha``, after the variant.
"""

from __future__ import annotations

import argparse
import math
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


def lead_with_pack(group: list[dict]) -> list[dict]:
    """``pe.pack(model)`` with no options (the ``pack`` variant) first, then the rest in their order."""
    return sorted(group, key=lambda r: r.get("variant") != "pack")


def table(group: list[dict]) -> str:
    """One markdown table for the rows of one (run, endpoint, family); the default ``pack`` row leads."""
    group = lead_with_pack(group)
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


def _run_env(group: list[dict]) -> tuple[dict, dict, str, str]:
    """``(row, env, hardware, versions)`` of a group's first successful row (else its first): what every table
    header states about the run."""
    r = next((x for x in group if x.get("status") == "ok"), group[0])
    env = r.get("env", {})
    hw = env.get("gpu") or env.get("cpu") or env.get("device")
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "sentence_transformers", "triton",
                                                     *common.KIT) if env.get(k))
    return r, env, hw, versions


def _header(group: list[dict]) -> str:
    r, env, hw, versions = _run_env(group)
    s = r.get("lengths") or {}
    length = (f"{r.get('n_seqs')} seqs from `{r.get('set')}`, batch {r.get('batch')}: p50 {s.get('p50')}, "
              f"p90 {s.get('p90')}, p99 {s.get('p99')}, max {s.get('max')} tokens; padding "
              f"{s.get('padding_fraction', 0):.0%} of padded tokens") if s else ""
    missing = common.missing_kit(env)
    kit = (f" **Without {', '.join(missing)}: packed variants ran without the kit's kernels (quack GEMMs, FA4, "
           "CuteDSL).**") if missing else ""
    return (f"### {r.get('runner')} / {r.get('endpoint')} / {r.get('family')} -- {r.get('model')} "
            f"{r.get('dtype')}\n\n{hw}; driver {env.get('driver', '-')}; {versions}; code {code_of(r)}. "
            f"{length}. Impl: {r.get('impl', '-')}.{kit}{_cpu_note(env)}")


CPU_NOTE = (" **CPU run: it checks that the harness works; its timings say nothing about the GPU kernels or "
            "graphs.**")


def _cpu_note(env: dict) -> str:
    return CPU_NOTE if env.get("device") == "cpu" else ""


def code_of(r: dict) -> str:
    """The commit whose code produced row ``r`` (abbreviated; ``-dirty`` kept)."""
    return _short_sha(r.get("code_commit") or (r.get("env") or {}).get("git_sha") or "-")


def _short_sha(sha: str) -> str:
    head, dirty = sha.removesuffix("-dirty"), sha.endswith("-dirty")
    return head[:7] + ("-dirty" if dirty else "")


def _variant_cell(r: dict) -> str:
    """A row's variant; a ``NAME@DIR`` row's with the commit of DIR where git knows it, since its spec names only a
    local path and the table's header names the harness's commit."""
    return r["variant"] + (f" (code {_short_sha(r['code_sha'])})" if r.get("code_sha") else "")


README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"


def _command(r: dict) -> str:
    """The row's command without its machine-specific ``--out`` folder (rows default to benchmarks/results/h200)."""
    words = (r.get("command") or "").split()
    out = [w for i, w in enumerate(words) if w != "--out" and (i == 0 or words[i - 1] != "--out")]
    return " ".join(out)


PACKED = ("pack", "pack_train_graphs")  # the README's packed variants: the default call, and training graphs
PACKED_LABEL = {"pack": "", "pack_train_graphs": ", training graphs (`GraphConfig(training=True)`)"}


def _workload_key(r: dict) -> tuple:
    """What makes two rows the same README workload: the model, and the endpoint, text set and batch (inference,
    indexing) or the workload (training)."""
    if r.get("runner") == "training":
        return ("training", r.get("model"), r.get("workload"))
    return (r.get("runner"), r.get("model"), r.get("endpoint"), r.get("set"), r.get("batch"))


def _latest_runs(rows: list[dict]) -> dict[tuple, dict[str, tuple[dict, dict]]]:
    """Per workload key and packed variant, ``(hf_sdpa row, packed row)`` of the latest run holding both."""
    runs: dict = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        if r.get("status") == "ok" and r.get("runner") in ("inference", "indexing", "training"):
            runs[_workload_key(r)][r.get("run_id", "?")][r["variant"]] = r
    out: dict = defaultdict(dict)
    for key, by_run in runs.items():
        for variant in PACKED:
            full = sorted((k for k, v in by_run.items() if "hf_sdpa" in v and variant in v),
                          key=lambda k: k.split("@")[-1])
            if full:
                out[key][variant] = (by_run[full[-1]]["hf_sdpa"], by_run[full[-1]][variant])
    return out


def _model_label(r: dict) -> str:
    model = str(r.get("model") or "")
    return "" if not model or model.endswith("modernbert-base") else f"{model.split(':')[-1]}, "


def readme_block(rows: list[dict]) -> str:
    """The README's results block: per workload (model, endpoint, text set, batch) and packed variant (the default
    ``pe.pack(model)``; for training also training graphs), the latest run holding both that variant and stock HF
    sdpa, the ratio within that run: inference in sequences/s, training in ms per step with host and GPU time."""
    lines = ["| workload | stock HF sdpa | `pe.pack(model)` | vs stock | peak memory vs stock | token cos min | code "
             "| command |", "|---|---:|---:|---:|---:|---:|---|---|"]
    env = None
    latest = _latest_runs(rows)
    for key in sorted(latest, key=lambda k: (k[0] == "training", tuple(str(x) for x in k))):
        for variant in PACKED:
            if variant not in latest[key]:
                continue
            base, ours = latest[key][variant]
            env = env or ours.get("env")
            mem = _ratio(ours.get("peak_reserved_bytes"), base.get("peak_reserved_bytes"))
            if key[0] == "training":
                host = ours.get("host_ms_per_step")
                host = None if host is not None and host < 0 else host  # profiler artefact under graph launches
                lines.append(
                    f"| training step, {_model_label(ours)}{key[2]} ({ours.get('precision', '')})"
                    f"{PACKED_LABEL[variant]} | {_fmt(base['step_ms_median'])} ms | {_fmt(ours['step_ms_median'])} ms "
                    f"(host {_fmt(host)}{_timers(ours)}, GPU {_fmt(gpu_ms(ours))}) "
                    f"| {_ratio(base['step_ms_median'], ours['step_ms_median'])} | {mem} | - | {code_of(ours)} "
                    f"| `{_command(ours)}` |")
                continue
            name = key[2]
            n = ours.get("lengths") or {}
            data = f" ({ours.get('set')})" if ours.get("set") != name else ""
            what = f"{_model_label(ours)}{name}{data}, batch {ours.get('batch')} (p50 {n.get('p50'):g} tokens)"
            lines.append(f"| {what} | {_fmt(base['seqs_per_s_median'], 0)} seq/s | {_fmt(ours['seqs_per_s_median'], 0)} "
                         f"| {_ratio(ours['seqs_per_s_median'], base['seqs_per_s_median'])} | {mem} "
                         f"| {ours.get('parity', {}).get('token_cos_min', 0):.5f} | {code_of(ours)} "
                         f"| `{_command(ours)}` |")
    env = env or {}
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "triton", *common.KIT) if env.get(k))
    head = (f"<!-- Rendered by `python -m benchmarks.render benchmarks/results/h200 --readme README.md` from the JSON "
            f"rows under benchmarks/results/h200/ (per workload and variant, the latest run with both rows). -->\n\n"
            f"{env.get('gpu', '-')}, driver {env.get('driver', '-')}; {versions}. ModernBERT-base geometry unless a "
            "row names another, random weights, bf16 (training: fp32 master weights under bf16 autocast, AdamW), real "
            "text from the token cache (`benchmarks/README.md`); each variant in a fresh process, medians, ratios "
            "within one run. Training time per step: wall clock; host and GPU ms per step from `torch.profiler` "
            "(GPU: the step's kernels, memcpys and memsets; with training graphs the host figure is not meaningful: "
            "the host waits in graph launches); \"by "
            "timers\": the host span again without the profiler's per-op overhead, where the row has it.")
    return f"{README_BEGIN}\n{head}\n\n" + "\n".join(lines) + f"\n{README_END}"


def replace_readme_block(text: str, block: str) -> str:
    """``text`` with the part between :data:`README_BEGIN` and :data:`README_END` (markers included) replaced."""
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    return text[:start] + block + text[end:]


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
        ok = [r for r in lead_with_pack(group) if r.get("status") == "ok"]
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


# ---------------------------------------------------------------------------------------------- training

def _training_groups(rows: list[dict]) -> dict:
    groups = defaultdict(list)
    for r in rows:
        if r.get("runner") == "training":
            groups[(r.get("run_id", "?"), r.get("workload"))].append(r)
    return groups


def _curve_vs(r: dict, base: dict | None) -> str:
    """First-step loss difference and the largest / mean |difference| over the shared steps, against ``base``."""
    if not base or not r.get("losses") or not base.get("losses"):
        return "-"
    a, b = r["losses"], base["losses"]
    n = min(len(a), len(b))
    diffs = [abs(x - y) for x, y in zip(a[:n], b[:n]) if math.isfinite(x) and math.isfinite(y)]
    if not diffs:
        return f"no finite pair of losses ({n} steps)"
    skipped = f"; {n - len(diffs)} steps with a non-finite loss skipped" if len(diffs) < n else ""
    return f"{a[0] - b[0]:+.4f} / {max(diffs):.4f} / {sum(diffs) / len(diffs):.4f} ({len(diffs)}{skipped})"


def training_table(group: list[dict]) -> str:
    """One markdown table for the rows of one (run, workload); ratios against that run's hf_sdpa / compile."""
    ok = {r["variant"]: r for r in group if r.get("status") == "ok"}
    sdpa, comp = ok.get("hf_sdpa", {}), ok.get("compile", {})
    lines = ["| variant | step ms median (min-max) | x hf_sdpa | x compile | host ms / step (profiler; timers) "
             "| GPU ms / step "
             "| peak reserved GiB | mem x hf_sdpa | wall s (warm-up s) | first loss | loss vs hf_sdpa: first / max / "
             "mean abs diff (steps) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in group:
        v = r["variant"]
        if r.get("status") != "ok":
            lines.append(f"| {_variant_cell(r)} | {r.get('status')}: {r.get('reason', '')} |" + " |" * 9)
            continue
        med = r["step_ms_median"]
        mem = r.get("peak_reserved_bytes")
        lines.append(
            f"| {_variant_cell(r)} | {_fmt(med)} ({_fmt(r['step_ms_min'])}-{_fmt(r['step_ms_max'])}) "
            f"| {_ratio(sdpa.get('step_ms_median'), med)} | {_ratio(comp.get('step_ms_median'), med)} "
            f"| {_host_cell(r)} | {_fmt(gpu_ms(r))}{_idle(r)} "
            f"| {_fmt(mem / GIB if mem else None, 2)} | {_ratio(mem, sdpa.get('peak_reserved_bytes'))} "
            f"| {_fmt(r.get('wall_s'))} ({_fmt(r.get('warmup_s'))}) | {r['losses'][0]:.4f} "
            f"| {_curve_vs(r, sdpa) if v != 'hf_sdpa' else '-'} |")
    return "\n".join(lines)


def gpu_ms(r: dict) -> float | None:
    """A training row's GPU time per step (ms): its kernels, memcpys and memsets. Rows written before the harness
    left out the profiler's GPU-timeline span of ``Optimizer.step`` (their ``profile`` has no
    ``gpu_kernels_only``) counted that span on top of the optimizer kernels it encloses; it is taken off here, by
    the row's own list of its largest device entries."""
    ms = r.get("gpu_ms_per_step")
    prof = r.get("profile") or {}
    if ms is None or prof.get("gpu_kernels_only"):
        return ms
    return ms - sum(k["ms"] for k in prof.get("top_device_ms_per_step") or () if k["name"].startswith("Optimizer."))


def _idle(r: dict) -> str:
    """`` (idle X)``: the GPU's idle time per step inside the step's device span, for rows that measured it."""
    idle = (r.get("profile") or {}).get("gpu_idle_ms_per_step")
    return "" if idle is None else f" (idle {_fmt(idle)})"


def _timers(r: dict) -> str:
    timer = r.get("host_timer_ms_median")
    return "" if timer is None else f"; by timers {_fmt(timer)}"


def _host_cell(r: dict) -> str:
    """A training row's host time per step: under the profiler, then by host timers where the row has them."""
    timer = r.get("host_timer_ms_median")
    return _fmt(r.get("host_ms_per_step")) + ("" if timer is None else f"; {_fmt(timer)}")


def _training_header(group: list[dict]) -> str:
    r, env, hw, versions = _run_env(group)
    missing = common.missing_kit(env)
    kit = f" **Without {', '.join(missing)}.**" if missing else ""
    spec = r.get("workload_spec") or {}
    d, q = r.get("doc_lengths") or {}, r.get("query_lengths") or {}
    what = (f"{spec.get('queries')} queries (p50 {q.get('p50')}, max {q.get('max')} tokens) + "
            f"{spec.get('queries', 0) * spec.get('docs_per_query', 0)} documents (p50 {d.get('p50')}, max "
            f"{d.get('max')}), {spec.get('pooling')}" + (f", GradCache chunks of {spec['chunk']}" if spec.get("chunk")
                                                         else "")) if spec else ""
    steps = f"{r.get('warmup_steps')} warm-up + {r.get('timed_steps')} timed steps" if r.get("timed_steps") else ""
    return (f"### training / {r.get('workload')} -- {r.get('model')}, {r.get('precision', '')}\n\n{hw}; driver "
            f"{env.get('driver', '-')}; {versions}; code {code_of(r)}. {what}; {steps}; "
            f"{r.get('optimizer', '')}. Run `{r.get('run_id')}`.{kit}{_cpu_note(env)}")


def training_markdown(rows: list[dict]) -> str:
    """All training tables for ``rows`` (``runner == "training"``)."""
    parts = [_training_header(g) + "\n\n" + training_table(g)
             for _, g in sorted(_training_groups(rows).items(), key=lambda kv: tuple(str(k) for k in kv[0]))]
    parts.append("Step ms: wall clock of one synchronised step (forward, loss, backward, optimizer). Host ms: CPU "
                 "time of the step's Python and dispatch, excluding time blocked on the GPU; GPU ms: summed device "
                 "time of its kernels and copies (both from torch.profiler over the profiled steps; see "
                 "benchmarks/training.py), and where a row has it, in brackets, the time the GPU waited inside the "
                 "step's device span (under the profiler, which slows the host); after the semicolon, where a row "
                 "has it, the host span by host timers over the timed steps (median), without the profiler's per-op "
                 "overhead.")
    cmds = sorted({r.get("command") for r in rows if r.get("command")})
    parts += [f"Command: `{c}`" for c in cmds]
    return "\n\n".join(parts) + "\n"


def training_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per (run, workload): loss curves of every variant, and median step time per variant (min-max bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for (run_id, workload), group in _training_groups(rows).items():
        ok = [r for r in group if r.get("status") == "ok"]
        if not ok:
            continue
        env = ok[0].get("env", {})
        title = f"training {workload} -- {ok[0].get('model')} on {env.get('gpu') or env.get('device')}"
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
        for r in ok:
            ax1.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["variant"], linewidth=1)
        ax1.set_xlabel("step")
        ax1.set_ylabel("loss")
        ax1.legend(fontsize=7)
        ax1.set_title("loss per step (same texts per step)", fontsize=9)
        names = [r["variant"] for r in ok]
        med = [r["step_ms_median"] for r in ok]
        err = [[m - r["step_ms_min"] for m, r in zip(med, ok)], [r["step_ms_max"] - m for m, r in zip(med, ok)]]
        colors = ["#9e9e9e" if n in ("hf_sdpa", "hf_eager", "compile", "st_sdpa") else "#1f77b4" for n in names]
        bars = ax2.bar(names, med, yerr=err, capsize=3, color=colors)
        for bar, m in zip(bars, med):
            ax2.annotate(f"{m:,.0f}", (bar.get_x() + bar.get_width() / 2, m), ha="center", va="bottom", fontsize=8,
                         xytext=(0, 3), textcoords="offset points")
        if max(r["step_ms_max"] for r in ok) > 20 * min(med):  # a compile or capture step would flatten the rest
            ax2.set_yscale("log")
        ax2.set_ylabel("ms / step (median, min-max)")
        ax2.tick_params(axis="x", labelrotation=30, labelsize=8)
        ax2.set_title("step time", fontsize=9)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        path = out_dir / f"training_{workload}_{str(run_id).replace(':', '-').replace('@', '_')}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


_INFERENCE_RUNNERS = ("inference", "indexing")


def host_markdown(path: Path, rows: list[dict]) -> str:
    """``benchmarks.host``'s table for the rows of one of its runs (``path``: the run's file), under a heading
    naming the run's card, software and code."""
    from benchmarks.host import table

    env = next((r["env"] for r in rows if isinstance(r.get("env"), dict)), {})
    config = next((r["config"] for r in rows if r.get("config")), "?")
    return (f"### host / {config} -- {path.name}\n\n{env.get('gpu', '?')}; torch {env.get('torch', '?')}, "
            f"triton {env.get('triton', '?')}; code {env.get('git_sha', '?')}. Host ms: the call's return with the "
            f"GPU idle at its start; GPU ms: its kernels (torch.profiler); wall ms: back to back (CUDA events)."
            f"\n\n{table(rows)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="+", help="JSON-lines files or folders holding them")
    ap.add_argument("--md", help="write the markdown here (default: stdout)")
    ap.add_argument("--png-dir", help="write PNG bar charts here")
    ap.add_argument("--readme", help="rewrite this file's results block (between the results:begin/end markers)")
    args = ap.parse_args(argv)
    files = []
    for p in map(Path, args.inputs):
        if not p.exists():
            ap.error(f"{p}: no such file or folder")
        files += sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    if args.png_dir:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            ap.error("--png-dir needs matplotlib (pip install -e \".[bench]\")")
    per_file = [(f, read_rows([f])) for f in files]
    rows = [r for _, rs in per_file for r in rs]
    if not rows:
        ap.error(f"no result rows in {', '.join(args.inputs)} (JSON lines the benchmark runners wrote)")
    if args.readme:
        path = Path(args.readme)
        path.write_text(replace_readme_block(path.read_text(encoding="utf-8"), readme_block(rows)), encoding="utf-8")
        return 0
    inference = [r for r in rows if r.get("runner") in _INFERENCE_RUNNERS]
    training = [r for r in rows if r.get("runner") == "training"]
    host = [(f, [r for r in rs if r.get("runner") == "host"]) for f, rs in per_file]
    other = defaultdict(int)
    for r in rows:
        if r.get("runner") not in (*_INFERENCE_RUNNERS, "training", "host"):
            other[r.get("runner")] += 1
    if other:
        print("render: not rendered (their runners print their own tables): "
              + ", ".join(f"{n} rows of runner {k!r}" for k, n in sorted(other.items(), key=str)), file=sys.stderr)
    text = "\n\n".join(([markdown(inference)] if inference else []) + ([training_markdown(training)] if training
                                                                          else [])
                        + [host_markdown(f, rs) for f, rs in host if rs])
    if args.md:
        Path(args.md).write_text(text, encoding="utf-8")
    else:
        print(text)
    if args.png_dir:
        for path in plots(inference, Path(args.png_dir)) + training_plots(training, Path(args.png_dir)):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
