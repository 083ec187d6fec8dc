"""The README's results block is rendered from the committed JSON rows (benchmarks/render.py --readme)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.common import read_rows
from benchmarks.render import README_BEGIN, README_END, readme_block, replace_readme_block

ROOT = Path(__file__).resolve().parents[1]


def _row(run, variant, rate, mem, endpoint="queries"):
    return {"runner": "inference", "run_id": f"random:base@{run}", "endpoint": endpoint, "set": endpoint,
            "variant": variant, "status": "ok", "batch": 8, "lengths": {"p50": 12.0}, "seqs_per_s_median": rate,
            "peak_reserved_bytes": mem, "parity": {"token_cos_min": 0.99999}, "code_commit": run[-3:],
            "command": "python -m benchmarks.inference --endpoints queries --out /tmp/x", "env": {"gpu": "G"}}


def test_block_takes_the_latest_complete_run_and_its_ratios():
    rows = [_row("20260101-000000", "hf_sdpa", 100.0, 10), _row("20260101-000000", "pack", 300.0, 5),
            _row("20260202-000000", "hf_sdpa", 200.0, 10), _row("20260202-000000", "pack", 1000.0, 20),
            _row("20260303-000000", "pack", 9999.0, 1)]  # no stock row in that run: not comparable
    block = readme_block(rows)
    line = next(x for x in block.splitlines() if x.startswith("| queries"))
    assert "| 200 seq/s | 1,000 | 5.00x | 2.00x | 0.99999 | 000 |" in line
    assert "--out" not in line and "9,999" not in block
    text = f"intro\n{README_BEGIN}\nold\n{README_END}\noutro\n"
    assert replace_readme_block(text, block) == f"intro\n{block}\noutro\n"


def test_models_sets_and_training_graphs_get_their_own_rows():
    large = [dict(_row("20260404-000000", v, r, 10, endpoint="documents"), model="random:modernbert-large")
             for v, r in (("hf_sdpa", 50.0), ("pack", 150.0))]
    base = [_row("20260101-000000", v, r, 10, endpoint="documents") for v, r in (("hf_sdpa", 100.0), ("pack", 400.0))]
    train = [{"runner": "training", "run_id": "random:base@20260505-000000", "workload": "single", "variant": v,
              "status": "ok", "step_ms_median": ms, "host_ms_per_step": host, "gpu_ms_per_step": 40.0,
              "peak_reserved_bytes": 10, "precision": "p", "env": {"gpu": "G"}}
             for v, ms, host in (("hf_sdpa", 300.0, 200.0), ("pack", 100.0, 90.0), ("pack_train_graphs", 50.0, -3.0))]
    lines = readme_block(large + base + train).splitlines()
    assert any(x.startswith("| documents, batch 8") and "| 4.00x |" in x for x in lines)  # not hidden by large's run
    assert any(x.startswith("| modernbert-large, documents") and "| 3.00x |" in x for x in lines)
    graphs = next(x for x in lines if "training graphs (" in x)
    assert "| 6.00x |" in graphs and "host -," in graphs  # a negative profiler host figure is not shown
    assert any(x.startswith("| training step, single (p) |") and "| 3.00x |" in x for x in lines)


def test_readme_block_matches_the_committed_rows():
    rows = read_rows(sorted((ROOT / "benchmarks" / "results" / "h200").glob("*.jsonl")))
    assert rows, "no committed H200 rows"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = readme.index(README_BEGIN), readme.index(README_END) + len(README_END)
    assert readme[start:end] == readme_block(rows), \
        "README results block is stale: python -m benchmarks.render benchmarks/results/h200 --readme README.md"


def test_render_names_inputs_it_cannot_use(tmp_path, capsys):
    import pytest

    from benchmarks.render import main

    (tmp_path / "empty").mkdir()
    for args, message in (([str(tmp_path / "absent")], "no such file or folder"),
                          ([str(tmp_path / "empty")], "no result rows")):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2 and message in capsys.readouterr().err


def test_render_takes_host_rows_and_names_runners_it_leaves_out(tmp_path, capsys):
    import json

    from benchmarks.render import main

    host = {"runner": "host", "workload": "documents", "variant": "new_eager", "status": "ok", "config": "base",
            "host_ms": 2.0, "gpu_ms": 5.0, "wall_ms": 5.5, "layers": 22, "python_calls": 100, "aten_ops": 40,
            "launches": 180, "memsets": 22, "token_cos_min": 0.99999, "env": {"gpu": "G", "git_sha": "abc"}}
    lines = [host, dict(host, variant="stock", host_ms=20.0),
             {"runner": "host_ops", "op": "ln"}, {"runner": "host_ops", "op": "gemm"}]
    (tmp_path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    assert main([str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "### host / base -- run.jsonl" in out and "| documents | new_eager | 1 | 2.00 | 91 | 5.00 |" in out
    assert "| documents | stock | 1 | 20.00 |" in out
    assert "2 rows of runner 'host_ops'" in err
