"""tests/hf_suite/compare.py: which tests it reports between a stock and a packed junit report of HF's suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("hf_suite_compare", Path(__file__).parent / "hf_suite" / "compare.py")
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

_CLS = "tests.models.modernbert.test_modeling_modernbert.ModernBertModelTest"


def _junit(path: Path, cases: dict[str, str], counts: dict[str, tuple[int, int]] | None = None) -> str:
    rows = []
    for name, status in cases.items():
        body = "" if status == "passed" else f'<{status} message="{status} of {name}"/>'
        if counts and name in counts:
            packed, stock = counts[name]
            body += (f'<properties><property name="packed_forwards" value="{packed}"/>'
                     f'<property name="stock_forwards" value="{stock}"/></properties>')
        rows.append(f'<testcase classname="{_CLS}" name="{name}">{body}</testcase>')
    path.write_text(f'<testsuites><testsuite>{"".join(rows)}</testsuite></testsuites>')
    return str(path)


def test_a_regression_not_in_known_fails_and_known_ones_do_not(tmp_path, capsys):
    known = next(iter(compare.KNOWN))
    stock = _junit(tmp_path / "s.xml", {"test_a": "passed", known: "passed", "test_b": "failure", "test_c": "passed"})
    packed_cases = {"test_a": "passed", known: "failure", "test_b": "failure", "test_c": "passed"}
    counts = {"test_a": (3, 0), "test_c": (0, 2)}
    assert compare.main(stock, _junit(tmp_path / "p.xml", packed_cases, counts)) == 0
    out = capsys.readouterr().out
    assert f"known {_CLS}::{known}" in out
    assert "3 passed of 4; packed: 2 of those pass, 1 of them running the packed path, 1 only the stock" in out
    assert f"stock forward only: {_CLS}::test_c (2 calls)" in out

    packed_cases["test_a"] = "error"
    assert compare.main(stock, _junit(tmp_path / "p2.xml", packed_cases, counts)) == 1
    assert f"NEW {_CLS}::test_a: packed error: error of test_a" in capsys.readouterr().out


def test_a_test_missing_from_the_packed_report_is_a_regression(tmp_path, capsys):
    stock = _junit(tmp_path / "s.xml", {"test_a": "passed"})
    assert compare.main(stock, _junit(tmp_path / "p.xml", {})) == 1
    assert f"NEW {_CLS}::test_a: packed missing" in capsys.readouterr().out
