"""Smoke test of benchmarks/training.py: the quick CPU path on the tiny config, real parent/child machinery.

Stock HF and fully packed on the single-vector and ColBERT GradCache workloads, plus sentence-transformers'
trainer on the packed model: 1 warm-up + 3 timed + 1 profiled steps each, JSON rows, the markdown table and plots;
and ``pack`` against ``pack@DIR``, the package of another tree.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """A token cache built from the package's sample (no wheel, no network)."""
    from benchmarks.data import cache_from_sample

    return cache_from_sample(tmp_path_factory.mktemp("tokens") / "tokens.npz")


def _run(tokens, out, workloads, variants):
    """Rows of one quick CPU run of the training harness (tiny config)."""
    cmd = [sys.executable, "-m", "benchmarks.training", "--quick", "--device", "cpu", "--config", "tiny",
           "--workloads", workloads, "--variants", variants, "--tokens", str(tokens), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(out.glob("training_*.jsonl"))
    assert len(files) == 1
    return [json.loads(line) for line in files[0].read_text().splitlines()]


def test_training_quick_cpu(tmp_path, tokens):
    from benchmarks import render

    rows = _run(tokens, tmp_path / "results", "single,colbert",
                "hf_sdpa,packed,pack_train_graphs,st_pack,pack_varlen")
    status = {(r["workload"], r["variant"]): r["status"] for r in rows}
    assert status == {("single", "hf_sdpa"): "ok", ("single", "packed"): "ok", ("single", "st_pack"): "ok",
                      ("single", "pack_train_graphs"): "ok", ("colbert", "hf_sdpa"): "ok",
                      ("colbert", "packed"): "ok", ("colbert", "pack_train_graphs"): "ok",
                      ("colbert", "st_pack"): "skipped", ("single", "pack_varlen"): "skipped",
                      ("colbert", "pack_varlen"): "skipped"}  # torch varlen needs CUDA
    assert len({r["run_id"] for r in rows}) == 1
    ok = {(r["workload"], r["variant"]): r for r in rows if r["status"] == "ok"}
    for r in ok.values():
        assert r["runner"] == "training" and r["model"] == "random:tiny" and r["env"]["torch"]
        assert r["timed_steps"] == 3 and len(r["step_ms"]) == 3 and r["step_ms_median"] > 0
        assert len(r["losses"]) == 5 and all(x == x for x in r["losses"])  # warm-up + timed + profiled, no NaN
        assert r["host_ms_per_step"] > 0 and r["gpu_ms_per_step"] is None and "peak_reserved_bytes" in r
        # host timers without the profiler: the step's span before its closing sync, within the step's wall time
        assert 0 < r["host_timer_ms_median"] <= r["step_ms_max"], (r["host_timer_ms_median"], r["step_ms"])
    for wl in ("single", "colbert"):  # fp32 on CPU: the packed step computes the stock step's losses
        ref, got = ok[(wl, "hf_sdpa")]["losses"], ok[(wl, "packed")]["losses"]
        # distinct texts per step (identical documents would give ln N at every step, whatever the model computes)
        assert len({round(x, 4) for x in ref}) > 1, (wl, ref)
        assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-4, (wl, ref, got)
        assert ok[(wl, "packed")]["describe"][0]["packed"]
    assert abs(ok[("single", "st_pack")]["losses"][0] - ok[("single", "hf_sdpa")]["losses"][0]) < 1e-4
    assert ok[("colbert", "packed")]["workload_spec"]["chunk"] == 4
    text = render.training_markdown(rows)
    assert "| packed |" in text and "x hf_sdpa" in text and "| pack_train_graphs |" in text
    for wl in ("single", "colbert"):  # on CPU the training graphs run eagerly: the eager path's losses
        ref, got = ok[(wl, "packed")]["losses"], ok[(wl, "pack_train_graphs")]["losses"]
        assert max(abs(a - b) for a, b in zip(ref, got)) < 1e-4, (wl, ref, got)
        assert ok[(wl, "pack_train_graphs")]["describe"][0]["cuda_graph"]["config"]["training"]
    if importlib.util.find_spec("matplotlib"):  # the bench extra
        assert len(render.training_plots(rows, tmp_path / "plots")) == 2


def test_training_with_the_package_of_another_tree(tmp_path, tokens):
    """``pack@DIR`` trains as ``pack`` with the package of the tree DIR (here a copy of this one, a git repository
    of its own): the child imports it from there, the row names the whole spec and DIR's commit, and the variant
    keeps NAME's skip rules (``pack_varlen@DIR`` needs CUDA as ``pack_varlen`` does)."""
    from benchmarks import render

    tree = tmp_path / "before"
    shutil.copytree(ROOT / "packed_encoders", tree / "packed_encoders", ignore=shutil.ignore_patterns("__pycache__"))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tree)]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "before"]):
        subprocess.run(git + args, check=True, capture_output=True)
    sha = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    rows = _run(tokens, tmp_path / "results", "single", f"hf_sdpa,pack,pack@{tree},pack_varlen@{tree}")
    by_variant = {r["variant"]: r for r in rows}
    assert [r["variant"] for r in rows] == ["hf_sdpa", "pack", f"pack@{tree}", f"pack_varlen@{tree}"]
    assert [r["status"] for r in rows] == ["ok", "ok", "ok", "skipped"]
    ours, before = by_variant["pack"], by_variant[f"pack@{tree}"]
    assert "code_dir" not in ours and "package_file" not in ours
    assert ours["describe"][0]["packed"] and before["describe"][0]["packed"]
    assert before["code_dir"] == str(tree.resolve()) and before["code_sha"] == sha
    assert before["package_file"] == str(tree.resolve() / "packed_encoders" / "__init__.py")
    assert ours["losses"] == before["losses"]  # the same code on the same texts, fp32 on one CPU thread
    skipped = by_variant[f"pack_varlen@{tree}"]
    assert skipped["reason"] == "torch varlen needs CUDA" and skipped["code_sha"] == sha
    text = render.training_markdown(rows)
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| pack@{tree} (code {sha[:7]}) |")]
    assert line.split("|")[3].strip().endswith("x"), line  # its own ratio against the run's hf_sdpa
    assert f"| pack_varlen@{tree} (code {sha[:7]}) | skipped: torch varlen needs CUDA |" in text


def test_gpu_time_counts_kernels_not_annotation_spans():
    """The profiler draws a ``record_function`` range (``Optimizer.step#AdamW.step``) on the GPU timeline too; that
    span encloses kernels already counted and must not be added to the GPU time a second time."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.common import device_work

    def event(name, device, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation)

    kernel = event("multi_tensor_apply_kernel", DeviceType.CUDA)
    memset = event("Memset (Device)", DeviceType.CUDA)
    events = [event("Optimizer.step#AdamW.step", DeviceType.CPU, True), kernel, memset,
              event("Optimizer.step#AdamW.step", DeviceType.CUDA, True),  # flagged as an annotation
              event("Optimizer.step#AdamW.step", DeviceType.CUDA),  # not flagged: known by its CPU range's name
              event("aten::mm", DeviceType.CPU)]
    assert device_work(events) == [kernel, memset]


def test_device_idle_splits_steps_and_names_the_gaps():
    """Two profiled steps: the GPU idles 30 us in step 1 (20 + 10) and 40 us in step 2; the gap between the steps
    (the harness's sync and the next step's start) is no step's idle. Gaps of 20 us and more are named by the kernels
    on either side; an event that ends inside an earlier, longer one opens no gap."""
    from types import SimpleNamespace

    from benchmarks import render
    from benchmarks.common import device_idle

    def ev(name, start, end):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))

    step1 = [ev("gemm", 100, 200), ev("ln", 150, 160), ev("rope", 220, 240), ev("attn", 250, 300)]
    step2 = [ev("gemm", 1000, 1100), ev("rope", 1140, 1150)]
    idle = device_idle(step2 + step1, step_starts=[90, 900])
    assert idle["gpu_idle_ms_per_step"] == (30 + 40) / 1e3 / 2
    assert idle["idle_gaps"] == [{"place": "gemm -> rope", "ms": 0.03, "count": 1.0}]
    row = {"variant": "pack", "status": "ok", "step_ms_median": 5.0, "step_ms_min": 4.0, "step_ms_max": 6.0,
           "gpu_ms_per_step": 3.0, "profile": {"gpu_kernels_only": True, "gpu_idle_ms_per_step": 12.34},
           "losses": [1.0]}
    assert "| 3.0 (idle 12.3) |" in render.training_table([row])
    row["profile"].pop("gpu_idle_ms_per_step")  # rows from before the harness measured it
    assert "| 3.0 |" in render.training_table([row])
