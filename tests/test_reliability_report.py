"""``benchmarks/reliability.py`` renders what the runs found: fed a synthetic JUnit XML
and reliability log, a case that logged a row and then failed is a failed row (and
the report exits 1), and every skipped case is listed with its reason."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "reliability.py"

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="2" skipped="1" tests="6">
<testcase classname="tests.test_crash" name="test_logs_then_fails" time="0.2">
<failure message="AssertionError: assert verify(db).ok">tests/test_crash.py:90: AssertionError</failure>
</testcase>
<testcase classname="tests.test_crash" name="test_logs_and_passes" time="0.1" />
<testcase classname="tests.test_crash" name="test_fails_before_logging" time="0.1">
<failure message="TimeoutError: rank 1 never answered">tests/test_crash.py:120: TimeoutError</failure>
</testcase>
<testcase classname="tests.test_verify" name="test_needs_amcheck" time="0.0">
<skipped type="pytest.skip" message="amcheck is not installed">tests/test_verify.py:10: amcheck is not installed</skipped>
</testcase>
<testcase classname="tests.test_verify" name="test_plain[sqlite]" time="0.0" />
<testcase classname="tests.test_verify" name="test_other[sqlite]" time="0.0" />
</testsuite></testsuites>
"""


def line(test: str, ok: bool = True) -> str:
    return json.dumps(
        {
            "item": "1. crash safety",
            "test": f"tests/test_crash.py::{test}",
            "backend": "sqlite",
            "applied": "10 SIGKILLs",
            "outcome": "10/10 verify clean",
            "ok": ok,
            "figures": {},
        }
    )


@pytest.fixture
def reliability(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (its dataclasses need it in ``sys.modules`` to load)."""
    spec = importlib.util.spec_from_file_location("reliability_report", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def kept(tmp_path: Path, reliability: ModuleType) -> Path:
    """A directory as ``--keep`` leaves it: the log, and the run with its JUnit cases."""
    junit = tmp_path / "junit-sqlite.xml"
    junit.write_text(JUNIT)
    (tmp_path / "log.jsonl").write_text(
        line("test_logs_then_fails") + "\n" + line("test_logs_and_passes") + "\n"
    )
    run = reliability.Run(
        "sqlite", ["python", "-m", "pytest"], 1, 3.0, "2 failed", reliability._junit_cases(junit)
    )
    runs = {"argv": [], "present": ["tests/test_crash.py"], "absent": [], "runs": [run.__dict__]}
    (tmp_path / "runs.json").write_text(json.dumps(runs))
    return tmp_path


def test_a_case_that_logged_and_then_failed_is_a_failed_row(
    kept: Path, reliability: ModuleType
) -> None:
    runs = json.loads((kept / "runs.json").read_text())["runs"]
    run = reliability.Run(**{**runs[0], "cases": [tuple(c) for c in runs[0]["cases"]]})

    rows = reliability.rows_of(kept / "log.jsonl", [run])

    assert [(r.test, r.ok, r.outcome) for r in rows] == [
        (
            "test_crash.py::test_fails_before_logging",
            False,
            "failed: TimeoutError: rank 1 never answered",
        ),
        ("test_crash.py::test_logs_and_passes", True, "10/10 verify clean"),
        (
            "test_crash.py::test_logs_then_fails",
            False,
            "10/10 verify clean; then failed: AssertionError: assert verify(db).ok",
        ),
        ("test_verify.py: 2 other cases", True, "passed (no figures recorded)"),
    ]


def render(kept: Path, reliability: ModuleType, output: Path) -> tuple[int, str]:
    status = reliability.main(["--render", str(kept), "--output", str(output)])
    return status, output.read_text()


def test_the_report_shows_the_row_failed(
    kept: Path, reliability: ModuleType, tmp_path: Path
) -> None:
    status, text = render(kept, reliability, tmp_path / "RELIABILITY.md")

    assert status == 1
    [row] = [r for r in text.splitlines() if "`test_crash.py::test_logs_then_fails`" in r]
    assert row.endswith(
        "| 10/10 verify clean; then failed: AssertionError: assert verify(db).ok | FAIL |"
    )


def test_the_report_lists_skipped_cases_with_their_reasons(
    kept: Path, reliability: ModuleType, tmp_path: Path
) -> None:
    _status, text = render(kept, reliability, tmp_path / "RELIABILITY.md")

    assert "- Cases: 4 rows, 2 failed, 1 skipped (listed below)" in text.splitlines()
    assert text.split("## Skipped cases\n", 1)[-1].startswith(
        "\nCases a run skipped, with pytest's reason.\n\n"
        "- `test_verify.py::test_needs_amcheck` (sqlite): amcheck is not installed\n"
    )
