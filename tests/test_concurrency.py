"""Many servers at once, on SQLite and on PostgreSQL: 8 processes committing to one
registry at the same moment, concurrent startup commits of the same keys, and a
writer killed before its commit. Nothing is lost, nothing is half-written, and
the history explains every entry.

The rule for concurrent startup commits (``WarmStart._commit``): the value
committed first wins; a later server's different value for the same key is not
written and is counted (``WriteResult.kept``, ``WarmStartReport.kept``). The
8-process test makes the startup path's own call (``Registry.write(kind="startup",
keep_existing=True)``) from processes that import no torch; the warm-start test
below shows the startup path makes that call.

Every subprocess wait has a hard deadline: processes still running then are
killed and the test fails.
"""

from __future__ import annotations

import json
import select
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import reliability_log
from samples import SHORT_H200_METADATA
from sqlalchemy import text

import ficache
from ficache import schema
from ficache.fingerprint import collect
from ficache.flashinfer_format import read_cache_file
from ficache.registry import NewEntry, Registry
from ficache.standin import standin_tune
from ficache.tuner import FlashInferTuner, row_value

REPO = Path(__file__).resolve().parent.parent
META = SHORT_H200_METADATA
WRITERS = 8
ENTRIES_PER_FILE = 400
#: Hard limit for a group of processes, start to exit; then they are killed.
DEADLINE_S = 180.0
#: Every process waits for this long after it is spawned, until every interpreter is ready.
START_DELAY_S = 4.0

#: Runs a test on SQLite and on PostgreSQL (``registry_db`` follows ``backend``).
both_backends = pytest.mark.usefixtures("backend")


def key(writer: int, m: int) -> str:
    return str(
        (f"flashinfer::op{writer}", "Runner", ((m, 4096), (4096, 1024)), ("torch.bfloat16", writer))
    )


def write_file(path: Path, writer: int, gpu: str = "NVIDIA H200") -> None:
    entries = {key(writer, m): ["Runner", [m % 7, [writer, m]]] for m in range(ENTRIES_PER_FILE)}
    path.write_text(json.dumps({"_metadata": {**META, "gpu": gpu}, **entries}))


def run_all(argvs: list[list[str]], deadline_s: float = DEADLINE_S) -> list[tuple[int, str, str]]:
    """Run processes at once; ``(returncode, stdout, stderr)`` of each.

    All must exit within ``deadline_s`` together: any still running then is
    killed (every one of them, and each is reaped) and the test fails.
    """
    procs = [
        subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in argvs
    ]
    deadline = time.monotonic() + deadline_s
    outputs: list[tuple[int, str, str]] = []
    try:
        for proc in procs:
            try:
                out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pytest.fail(f"a writer still ran after {deadline_s:g} s; all were killed")
            outputs.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    return outputs


def changes(db: str) -> list[Any]:
    """Every ``entry_changes`` row, in order."""
    with Registry.open(db) as reg, reg.engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    "SELECT commit_id, fingerprint_id, scope, key, action, new_tactic "
                    "FROM entry_changes ORDER BY id"
                )
            )
        )


def assert_history_explains_every_entry(db: str) -> None:
    """Each entry's commit recorded writing exactly its current value."""
    written = {
        (c.commit_id, c.fingerprint_id, c.scope, c.key): c.new_tactic
        for c in changes(db)
        if c.action in ("added", "replaced")
    }
    with Registry.open(db) as reg:
        for e in reg.entries():
            assert written[(e.commit_id, e.fingerprint_id, e.scope, e.key)] == e.tactic_json


# -- 8 importers --------------------------------------------------------------------

# Waits for a shared start time, so every process writes at the same moment.
_IMPORT_AT = """
import sys, time
import ficache.registry  # import everything before the start line
from ficache.cli import main
start = float(sys.argv[1])
while time.time() < start:
    time.sleep(0.001)
main(sys.argv[2:])
"""


@both_backends
def test_parallel_importers_all_succeed_and_lose_nothing(
    tmp_path: Path, registry_db: str, backend: str, request: pytest.FixtureRequest
) -> None:
    Registry.open(registry_db).close()
    files = []
    for writer in range(WRITERS):
        files.append(tmp_path / f"rank{writer}.json")
        write_file(files[-1], writer, gpu="NVIDIA H200" if writer < 5 else "NVIDIA B200")
    start = time.time() + START_DELAY_S
    outputs = run_all(
        [
            [sys.executable, "-c", _IMPORT_AT, repr(start), "--db", registry_db, "import", str(f)]
            for f in files
        ]
    )

    assert [(code, err) for code, _out, err in outputs] == [(0, "")] * WRITERS
    for _code, out, _err in outputs:
        assert out.startswith(
            f"imported {ENTRIES_PER_FILE} entries from 1 file(s): {ENTRIES_PER_FILE} added"
        )
    with Registry.open(registry_db) as reg:
        stored = {e.key: json.loads(e.tactic_json) for e in reg.entries()}
        commits = reg.log(None)
        fingerprints = {i.fingerprint.gpu: i.entries for i in reg.fingerprints()}
    assert stored == {
        key(w, m): [m % 7, [w, m]] for w in range(WRITERS) for m in range(ENTRIES_PER_FILE)
    }
    assert sorted(c.message for c in commits) == sorted(str(f) for f in files)
    assert {(c.kind, c.added) for c in commits} == {("import", ENTRIES_PER_FILE)}
    assert len({c.id for c in commits}) == WRITERS
    assert fingerprints == {
        "NVIDIA H200": 5 * ENTRIES_PER_FILE,
        "NVIDIA B200": 3 * ENTRIES_PER_FILE,
    }
    assert len(changes(registry_db)) == WRITERS * ENTRIES_PER_FILE
    assert_history_explains_every_entry(registry_db)
    reliability_log.record(
        item="8. concurrent writers",
        test=request.node.nodeid,
        backend=backend,
        applied=f"{WRITERS} processes importing {ENTRIES_PER_FILE} entries each at one moment",
        outcome=f"{WRITERS}/{WRITERS} committed, entries lost 0, history explains every entry",
        ok=True,
        figures={"writers": WRITERS, "entries": len(stored), "lost": 0},
    )


# -- 2 importers of the same keys (issue 23) -------------------------------------------------

SAME_KEYS = 610


def write_same_keys(path: Path, writer: int, count: int = SAME_KEYS) -> None:
    """``count`` entries every writer's file holds; half of them with this writer's value."""
    entries = {key(0, m): ["Runner", [m, writer if m % 2 else 0]] for m in range(count)}
    path.write_text(json.dumps({"_metadata": META, **entries}))


def stored_values(db: str) -> dict[str, str]:
    with Registry.open(db, create=False) as reg:
        return {e.key: e.tactic_json for e in reg.entries()}


@both_backends
def test_two_importers_of_the_same_keys_both_succeed_and_end_as_a_sequential_run(
    tmp_path: Path, registry_db: str
) -> None:
    """Each import's values are compared with the stored ones under the write lock, so the
    one that waits for the other's commit still succeeds, replacing what differs."""
    Registry.open(registry_db).close()
    files = [tmp_path / "a.json", tmp_path / "b.json"]
    for writer, path in enumerate(files, start=1):
        write_same_keys(path, writer)
    start = time.time() + START_DELAY_S
    outputs = run_all(
        [
            [sys.executable, "-c", _IMPORT_AT, repr(start), "--db", registry_db, "import", str(f)]
            for f in files
        ]
    )

    assert [(code, err) for code, _out, err in outputs] == [(0, "")] * 2
    with Registry.open(registry_db) as reg:
        order = [c.message for c in reversed(reg.log(None))]  # in commit order
    assert sorted(order) == sorted(str(f) for f in files)
    replaced = SAME_KEYS // 2
    by_file = dict(zip((str(f) for f in files), (out for _code, out, _err in outputs), strict=True))
    assert by_file[order[0]].startswith(
        f"imported {SAME_KEYS} entries from 1 file(s): {SAME_KEYS} added, 0 replaced"
    )
    assert by_file[order[1]].startswith(
        f"imported {SAME_KEYS} entries from 1 file(s): 0 added, {replaced} replaced, "
        f"{SAME_KEYS - replaced} unchanged"
    )
    sequential = str(tmp_path / "sequential.db")
    for name in order:
        with Registry.open(sequential) as reg:
            reg.import_cache([(name, read_cache_file(name))])
    assert stored_values(registry_db) == stored_values(sequential)
    assert_history_explains_every_entry(registry_db)


#: Keys of each concurrent merge: enough that reading and planning them takes longer than
#: the two processes' start-up differs, so both plan before either writes (with 610 the
#: first had committed before the second planned, and the race was never run).
MERGED_KEYS = 20_000


@both_backends
def test_two_merges_of_the_same_keys_both_succeed_and_end_as_a_sequential_run(
    tmp_path: Path, registry_db: str
) -> None:
    """A merge's plan expects the rows it read; the merge that commits second finds them
    changed, writes nothing, plans again on what the first committed, and succeeds (issue
    23: on PostgreSQL the loser used to fail with "... changed since the plan was made")."""
    Registry.open(registry_db).close()
    files = [tmp_path / "a.json", tmp_path / "b.json"]
    for writer, path in enumerate(files, start=1):
        write_same_keys(path, writer, MERGED_KEYS)
    start = time.time() + START_DELAY_S
    merge = ["merge", "--on-conflict", "theirs"]
    outputs = run_all(
        [
            [sys.executable, "-c", _IMPORT_AT, repr(start), "--db", registry_db, *merge, str(f)]
            for f in files
        ]
    )

    assert [(code, err) for code, _out, err in outputs] == [(0, "")] * 2
    with Registry.open(registry_db) as reg:
        order = [c.message.rsplit(": ", 1)[1] for c in reversed(reg.log(None))]
    assert sorted(order) == sorted(str(f) for f in files)
    sequential = str(tmp_path / "sequential.db")
    Registry.open(sequential).close()
    for name in order:
        done = subprocess.run(
            [sys.executable, "-m", "ficache", "--db", sequential, *merge, name],
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr
    assert stored_values(registry_db) == stored_values(sequential)
    assert_history_explains_every_entry(registry_db)


# -- 8 servers committing the same keys at once --------------------------------------------

SHARED_KEYS = 50  # every server tuned these
OWN_KEYS = 20  # and these only it did

# One server's startup commit, as ``WarmStart._commit`` makes it, at a shared start time.
_STARTUP_COMMIT_AT = """
import json, sys, time
from ficache.fingerprint import Fingerprint
from ficache.registry import NewEntry, Registry
db, start, writer = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
fp = Fingerprint.from_flashinfer_metadata(json.loads(sys.argv[4]))
shared, own = json.loads(sys.argv[5]), json.loads(sys.argv[6])
entries = [NewEntry(fp, k, "Runner", json.dumps([writer, i])) for i, k in enumerate(shared + own)]
with Registry.open(db) as reg:
    while time.time() < start:
        time.sleep(0.001)
    result = reg.write(
        entries, kind="startup", message=f"server {writer}", keep_existing=True
    )
print(json.dumps({"commit": result.commit_id, "added": result.added,
                  "replaced": result.replaced, "kept": result.kept}))
"""


@both_backends
def test_concurrent_startup_commits_keep_the_value_committed_first(
    registry_db: str, backend: str, request: pytest.FixtureRequest
) -> None:
    Registry.open(registry_db).close()
    shared = [key(99, m) for m in range(SHARED_KEYS)]
    own = {w: [key(w, m) for m in range(OWN_KEYS)] for w in range(WRITERS)}
    start = time.time() + START_DELAY_S
    outputs = run_all(
        [
            [
                sys.executable,
                "-c",
                _STARTUP_COMMIT_AT,
                registry_db,
                repr(start),
                str(w),
                json.dumps(META),
                json.dumps(shared),
                json.dumps(own[w]),
            ]
            for w in range(WRITERS)
        ]
    )

    assert [(code, err) for code, _out, err in outputs] == [(0, "")] * WRITERS
    results = [json.loads(out) for _code, out, _err in outputs]
    # Exactly one server stored the shared keys; every other one kept them.
    [first] = [w for w, r in enumerate(results) if r["kept"] == 0]
    assert results[first]["added"] == SHARED_KEYS + OWN_KEYS
    assert results[first]["commit"] == min(r["commit"] for r in results)
    for w, r in enumerate(results):
        assert r["replaced"] == 0
        if w != first:
            assert (r["added"], r["kept"]) == (OWN_KEYS, SHARED_KEYS)
    with Registry.open(registry_db) as reg:
        stored = {e.key: json.loads(e.tactic_json) for e in reg.entries()}
        commits = reg.log(None)
    n = len(shared)
    assert stored == {
        **{k: [first, i] for i, k in enumerate(shared)},
        **{k: [w, n + i] for w in range(WRITERS) for i, k in enumerate(own[w])},
    }
    assert sorted(c.id for c in commits) == sorted(r["commit"] for r in results)
    assert {c.kind for c in commits} == {"startup"}
    # No value was ever replaced: the history is one "added" per stored entry.
    history = changes(registry_db)
    assert {c.action for c in history} == {"added"}
    assert len(history) == len(stored)
    assert_history_explains_every_entry(registry_db)
    reliability_log.record(
        item="8. concurrent writers",
        test=request.node.nodeid,
        backend=backend,
        applied=f"{WRITERS} servers committing {SHARED_KEYS} shared keys at one moment",
        outcome=(
            f"the first commit's values kept ({(WRITERS - 1) * SHARED_KEYS} later values not "
            "written, counted), entries lost 0, nothing replaced"
        ),
        ok=True,
        figures={"writers": WRITERS, "entries": len(stored), "lost": 0},
    )


@both_backends
def test_a_start_keeps_the_value_another_server_committed_first(
    registry_db: str, autotuner: Any
) -> None:
    fp = collect()
    with ficache.warm_start(db=registry_db) as ws:
        standin_tune()
        mine = FlashInferTuner().tuned()
        # Another server of the same fingerprint commits the same keys first,
        # with other tactics, while this one is still in its block.
        theirs = {
            k: (runner, json.dumps((json.loads(tactic) + 1) % 5), policy)
            for k, (runner, tactic, policy, _selection) in mine.items()
        }
        with Registry.open(registry_db) as other:
            other.write(
                [NewEntry(fp, k, *value) for k, value in theirs.items()],
                kind="startup",
                keep_existing=True,
            )

    report = ws.report
    assert (report.tuned, report.committed, report.kept, report.commit_id) == (18, 0, 18, None)
    assert (report.shared, report.scoped) == (0, 0)  # what this start stored: nothing
    assert report.reason is None
    assert report.warnings == [
        "18 tuned values not stored: another server committed other values for those keys "
        "first; every rank loads the stored ones"
    ]
    with Registry.open(registry_db) as reg:
        assert len(reg.log()) == 1  # the other server's commit only
        assert {e.key: e.tactic_json for e in reg.entries()} == {k: v[1] for k, v in theirs.items()}
    # This server now uses the stored values too, like every later start will.
    assert {k: row_value(v) for k, v in FlashInferTuner().entries().items()} == theirs


# -- a writer killed before its commit ---------------------------------------------------------

# Imports through the library, but pauses after the last insert, just before
# COMMIT, and waits to be killed. The pause is the only stand-in: it wraps the
# real write transaction (``ficache.schema.write_transaction``) that every
# registry write goes through.
_KILLED_BEFORE_COMMIT = """
import sys, time
from contextlib import contextmanager
from ficache import schema
from ficache.flashinfer_format import read_cache_file
from ficache.registry import Registry

real_write_transaction = schema.write_transaction

@contextmanager
def write_transaction_that_stalls_before_commit(engine):
    with real_write_transaction(engine) as conn:
        yield conn
        print("inserted, not committed", flush=True)
        time.sleep(120)

schema.write_transaction = write_transaction_that_stalls_before_commit
with Registry.open(sys.argv[1]) as reg:
    reg.import_cache([(sys.argv[2], read_cache_file(sys.argv[2]))])
print("committed?!", flush=True)
"""


@both_backends
def test_a_writer_killed_before_commit_leaves_the_registry_as_it_was(
    tmp_path: Path, registry_db: str, dump_db
) -> None:
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    write_file(first, 0)
    write_file(second, 1)
    with Registry.open(registry_db) as reg:
        reg.import_cache([(str(first), read_cache_file(first))])
    before = dump_db(registry_db)

    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BEFORE_COMMIT, registry_db, str(second)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
        assert ready, f"the writer printed nothing within {DEADLINE_S:g} s; killed"
        line = proc.stdout.readline()
        assert line == "inserted, not committed\n", proc.stderr.read() if proc.stderr else ""
        # the uncommitted write holds the lock; readers still see the old state
        assert dump_db(registry_db) == before
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert dump_db(registry_db) == before
    path = schema.resolve(registry_db).path
    if path is not None:
        with closing(sqlite3.connect(path)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    with Registry.open(registry_db) as reg:
        assert len(reg.log()) == 1
        result = reg.import_cache([(str(second), read_cache_file(second))])
        # (PostgreSQL's sequences do not roll back: the killed commit's id stays unused.)
        assert result.added == ENTRIES_PER_FILE and [c.id for c in reg.log()] == [
            result.commit_id,
            1,
        ]
        assert len(list(reg.entries())) == 2 * ENTRIES_PER_FILE
    assert_history_explains_every_entry(registry_db)
