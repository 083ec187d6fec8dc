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
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=110)
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
    assert "x hf_sdpa" in proc.stdout and "| packed |" in proc.stdout
