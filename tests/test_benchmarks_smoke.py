"""Smoke test of the benchmark harness: the quick CPU path of benchmarks/inference.py, 2 variants.

Runs the real parent/child machinery (fresh process per variant, parity gate, timing, JSON rows, markdown)
on the tiny config with a token cache built from the package's sample, so it needs no wheel and no network.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_inference_quick_cpu_two_variants(tmp_path):
    from benchmarks.data import cache_from_sample, load_corpus

    tokens = cache_from_sample(tmp_path / "tokens.npz")
    assert len(load_corpus(tokens, build=False)["queries"]) == 64
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "benchmarks.inference", "--quick", "--device", "cpu", "--config", "tiny",
           "--variants", "hf_sdpa,packed", "--endpoints", "queries", "--tokens", str(tokens), "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = list(out.glob("inference_*.jsonl"))
    assert len(files) == 1
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [(r["variant"], r["status"]) for r in rows] == [("hf_sdpa", "ok"), ("packed", "ok")]
    for r in rows:
        assert r["endpoint"] == "queries" and r["n_seqs"] == 32 and r["trials"] == 5 and len(r["trial_s"]) == 5
        assert r["seqs_per_s_median"] > 0 and r["tokens_per_s_median"] > 0
        assert r["parity"]["passed"] and r["parity"]["token_cos_min"] > 0.9999
        assert r["env"]["torch"] and r["lengths"]["max"] <= 128
    assert "x hf_sdpa" in proc.stdout and "| packed |" in proc.stdout and "CPU run" in proc.stdout


def test_rows_without_the_kit_on_hopper_say_so():
    """A GPU run that lost the CuteDSL / FA4 kit (e.g. a PYTHONPATH that dropped it) is flagged in the table header,
    not passed off as kit numbers; CPU rows and older GPUs need no kit."""
    from benchmarks import common, render

    full = {"capability": "sm_90", "gpu": "NVIDIA H200", "cutlass_dsl": "4.8.1", "fa4": "4.0.0b36", "quack": "0.6.5"}
    assert common.missing_kit(full) == ()
    bare = dict(full, fa4=None, quack=None)
    assert common.missing_kit(bare) == ("fa4", "quack")
    assert common.missing_kit(dict(bare, capability="sm_80")) == ()
    assert common.missing_kit({"device": "cpu"}) == ()
    row = {"status": "ok", "runner": "inference", "endpoint": "documents", "family": "hf", "env": bare}
    assert "**Without fa4, quack" in render._header([row])
    assert "Without" not in render._header([dict(row, env=full)])


def test_host_ops_cpu_smoke(tmp_path):
    """``benchmarks.host_ops`` on CPU: the plain PyTorch ops are timed, the CUDA-only ones skipped with a reason."""
    import json

    from benchmarks import host_ops

    assert host_ops.main(["--device", "cpu", "--hidden", "64", "--heads", "4", "--tokens", "16", "--seqs", "2",
                          "--calls", "5", "--repeats", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("host_ops_*.jsonl")
    rows = {r["op"]: r for r in map(json.loads, path.read_text().splitlines())}
    for op in ("python_call", "empty", "view", "linear", "mm_out"):
        assert rows[op]["status"] == "ok" and rows[op]["wall_us"] >= rows[op]["host_us"] > 0, rows[op]
    for op in ("linear_cublaslt", "ln_direct", "attn_triton", "attn_fa4"):
        assert rows[op]["status"] == "skipped" and rows[op]["reason"] == "CUDA only"
    assert all(r["runner"] == "host_ops" and "env" in r for r in rows.values())


def test_host_rounds_and_a_second_code_tree(tmp_path):
    """``benchmarks.host`` on CPU: variants run round-robin for ``--rounds``, each in a fresh process, and a
    ``NAME@DIR`` variant imports the package of another tree (here a copy of this one, proved by the path)."""
    import shutil

    from benchmarks import host
    from benchmarks.data import cache_from_sample

    tokens = cache_from_sample(tmp_path / "tokens.npz")
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "packed_encoders", tree / "packed_encoders",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "results"
    assert host.main(["--device", "cpu", "--config", "tiny", "--quick", "--tokens", str(tokens), "--rounds", "2",
                      "--workloads", "queries", "--variants", f"new_eager,new_eager@{tree}", "--out", str(out),
                      "--profile-dir", str(tmp_path / "prof")]) == 0
    profiles = sorted(p.relative_to(tmp_path / "prof").as_posix() for p in (tmp_path / "prof").rglob("*.txt"))
    assert len(profiles) == 2 and profiles[0] == "round0_new_eager/queries.txt", profiles  # first round only
    text = (tmp_path / "prof" / profiles[0]).read_text()
    assert "cProfile" in text and "encoder_forward" in text and "torch.profiler" in text and "aten::" in text
    (path,) = out.glob("host_*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["variant"], r["round"], r["status"]) for r in rows] == [
        ("new_eager", 0, "ok"), (f"new_eager@{tree}", 0, "ok"), ("new_eager", 1, "ok"), (f"new_eager@{tree}", 1, "ok")]
    assert "code_dir" not in rows[0] and rows[1]["code_dir"] == str(tree.resolve())
    assert rows[1]["package_file"] == str(tree.resolve() / "packed_encoders" / "__init__.py")
    assert all(r["host_ms"] > 0 and r["token_cos_min"] > 0.9999 for r in rows)
    assert all(r["launches"] == 0 and r["memsets"] == 0 for r in rows)  # no CUDA runtime calls on CPU
    text = host.table(rows)
    assert "| launches (memsets) |" in text and "| 0 (0) |" in text
    assert f"| queries | new_eager@{tree} | 2 |" in text and "| queries | new_eager | 2 |" in text
    import pytest

    with pytest.raises(SystemExit, match="holds no packed_encoders"):
        host.parse_variant(f"new_eager@{tmp_path}")
    with pytest.raises(SystemExit, match="unknown variant"):
        host.parse_variant("newer")


def test_host_rows_are_kept_as_each_variant_ends(tmp_path, monkeypatch):
    """A ``benchmarks.host`` run killed after its first child process (a remote time limit) leaves that child's
    rows, with the environment, in ``host_*.jsonl.partial``; a finished run leaves only ``host_*.jsonl``."""
    import pytest

    from benchmarks import host

    row = {"runner": "host", "workload": "queries", "host_ms": 1.0, "gpu_ms": 0.5, "wall_ms": 1.2, "layers": 2,
           "python_calls": 10, "aten_ops": 5}
    calls = []

    def child(argv, timeout, env):
        calls.append(argv)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the kill, while the second variant runs
        return 0, "HOSTJSON " + json.dumps({"rows": [dict(row)]}), 0.1

    monkeypatch.setattr(host, "run_child", child)
    monkeypatch.setattr(host, "environment", lambda device: {"device": device})
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        host.main(["--device", "cpu", "--workloads", "queries", "--variants", "new_eager,stock", "--out", str(out)])
    (partial,) = out.glob("host_*.jsonl.partial")
    rows = [json.loads(line) for line in partial.read_text().splitlines()]
    assert [(r["variant"], r["status"], r["env"]) for r in rows] == [("new_eager", "ok", {"device": "cpu"})]
    assert not list(out.glob("host_*.jsonl"))
    monkeypatch.setattr(host, "run_child", lambda argv, timeout, env: (
        0, "HOSTJSON " + json.dumps({"rows": [dict(row)]}), 0.1))
    done = tmp_path / "done"
    assert host.main(["--device", "cpu", "--workloads", "queries", "--variants", "new_eager,stock",
                      "--out", str(done)]) == 0
    (path,) = done.glob("host_*.jsonl")
    assert not list(done.glob("*.partial"))
    assert [r["variant"] for r in map(json.loads, path.read_text().splitlines())] == ["new_eager", "stock"]


def test_variant_specs_name_a_harness_variant_and_a_package_tree(tmp_path, monkeypatch):
    """``benchmarks.common``'s ``NAME@DIR`` pieces, shared by the host and training harnesses: the parser checks
    NAME against the harness's list and DIR for a package, the child's package is checked to come from DIR."""
    import re

    import pytest

    from benchmarks import common

    tree = tmp_path / "tree"
    (tree / "packed_encoders").mkdir(parents=True)
    (tree / "packed_encoders" / "__init__.py").write_text("")
    names = ("pack", "hf_sdpa")
    assert common.parse_variant(" pack ", names) == ("pack", "pack", None)
    monkeypatch.chdir(tmp_path)
    assert common.parse_variant("pack@tree", names) == ("pack@tree", "pack", str(tree.resolve()))
    with pytest.raises(SystemExit, match=r"unknown variant 'packs' in 'packs@tree'; choose from pack, hf_sdpa"):
        common.parse_variant("packs@tree", names)
    empty = re.escape(f"'pack@{tmp_path}': {tmp_path} holds no packed_encoders package")
    with pytest.raises(SystemExit, match=empty):
        common.parse_variant(f"pack@{tmp_path}", names)
    assert common.import_package(None).__file__ == str(ROOT / "packed_encoders" / "__init__.py")
    assert common.code_fields(None, None) == {}
    with pytest.raises(SystemExit, match=re.escape(f"not from {tree}")):  # this process imported this checkout's package
        common.import_package(str(tree))
    path = [str(tmp_path)]
    monkeypatch.setattr(common.sys, "path", path)
    common.code_tree_first(["benchmarks.training", "--child", "--code"])  # no DIR after the flag: nothing to do
    common.code_tree_first(["benchmarks.training", "--child", "--code", "tree"])
    assert path == [str(tree.resolve()), str(tmp_path)]
    assert common.file_name(f"pack@{tree}") == "pack_" + str(tree).replace("/", "_")


def test_harness_modules_leave_the_package_unimported():
    """A ``NAME@DIR`` child puts DIR first on ``sys.path`` after importing its harness module and
    ``benchmarks.common``: neither may have imported ``packed_encoders`` by then."""
    code = ("import sys; import benchmarks.common, benchmarks.host, benchmarks.training; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'packed_encoders'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_harness_refuses_bad_arguments_and_exits_1_when_a_variant_fails(tmp_path, monkeypatch, capsys):
    """Arguments the children could not use are refused up front (they used to end in tracebacks, or in an error
    row per variant and exit 0); a run whose child fails publishes the error rows and exits 1."""
    import pytest

    from benchmarks import harness, inference
    from benchmarks.data import cache_from_sample

    tokens = cache_from_sample(tmp_path / "tokens.npz")
    base = ["--quick", "--device", "cpu", "--config", "tiny", "--tokens", str(tokens), "--out", str(tmp_path / "r"),
            "--variants", "packed", "--endpoints", "queries"]

    def run(*extra):
        return harness.main("inference", "benchmarks.inference", inference.endpoints, "", argv=[*base, *extra],
                            extra_args=inference.extra_args)

    for bad, says in ((["--dtype", "fp8"], "invalid choice"), (["--batch", "0"], "0 is below 1"),
                      (["--trials", "0"], "0 is below 1"), (["--num-seqs", "-3"], "-3 is below 1")):
        with pytest.raises(SystemExit):
            run(*bad)
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--device foo"):
        run("--device", "foo")
    monkeypatch.setattr(harness, "_spawn", lambda *a: ([], 1, "RuntimeError: boom\n"))
    assert run() == 1
    (path,) = (tmp_path / "r").glob("inference_*.jsonl")
    assert [(r["status"], r["reason"]) for r in map(json.loads, path.read_text().splitlines())] == [
        ("error", "RuntimeError: boom")]
