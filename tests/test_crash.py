"""Crash safety: SIGKILL at random moments of import, merge, prune, revert, a warm
start's commit and a schema upgrade, on SQLite and on PostgreSQL.

After every kill the registry passes ``ficache.verify.verify`` (read-only, on the
state the killed process left), opens, and holds each commit whole or not at
all: its fingerprints, entries and commits (kind, counts, change rows) equal
the state before the operation or the state after it, exactly.

How a kill is made:
- The operations run in children forked from one long-lived process (the
  *forker*, ``tests/forker.py``) that imported torch, FlashInfer and ficache
  once: an interpreter start with torch costs ~8 s here, a fork ~10 ms. Each
  child is a real process running the real CLI (``ficache.cli.main``),
  ``Registry.open`` or ``ficache.warm_start`` with the CPU stand-in
  (``ficache.standin``) on a registry of its own (a fresh copy of a base
  SQLite file, or a PostgreSQL database cloned from a template database).
- The child reports its progress as marker lines on a FIFO: ``start``,
  ``pre`` (just before the registry's write transaction begins: it wraps
  ``ficache.schema.write_transaction``, the one path of every write, and
  only observes it), ``begin`` (the transaction holds the write lock),
  ``committed`` (the transaction has committed) and ``done``.
- One unkilled run per operation (the calibration) gives the state after
  it and how long its phases take. Kill *i* then waits a delay drawn from
  a seeded RNG, cycling four ways: from ``pre``, anywhere in the
  transaction's duration (lands during the commit); from ``start``,
  within the time before ``pre`` (before it); from ``pre``, at 80-105% of
  the transaction's duration (around the COMMIT itself); from ``start``,
  anywhere in the whole run (also after it). Where a phase got no kill, up
  to three more kills aim at it (at ``start`` at once, or at ``begin`` at
  once), so every phase that can be known is covered.
- Phases come from the markers the child wrote before it died: no
  ``begin``: *before* (the registry must be exactly as before);
  ``committed``: *after* (exactly as after); otherwise *during* (either one).

The schema upgrade opens a copy of the frozen 0001 registry (on PostgreSQL,
its rows loaded into a database at 0001, as ``tests/test_postgres.py``
does). Whole or absent means: at 0001 with exactly its rows, or at head with
the same rows (in 0001's columns). Verify, read-only and before anything
upgrades it, finds nothing but the stale schema; upgraded (`ficache db upgrade`),
the registry passes verify at head.

Each case prints its seed and phase counts and records every kill in
``kills.json`` under its ``tmp_path`` (and one line per case in
``crash-kills.jsonl`` under pytest's base temp directory).
``FICACHE_CRASH_KILLS`` sets the kills per operation (default 10: 60 per
backend, about 35 s on SQLite and 75-95 s on PostgreSQL here);
``FICACHE_CRASH_SEED`` sets the seed (the same delays again; where they land
still depends on timing). Every wait on a child has a hard deadline, past
which the child (and if need be the forker) is killed and the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pg_server
import pytest
import reliability_log
from forker import Child, Forker
from samples import SHORT_H200_METADATA
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from ficache import schema
from ficache.bundle import render_bundle
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_cache_bytes
from ficache.registry import NewEntry, Registry
from ficache.verify import verify

FROZEN_0001 = Path(__file__).parent / "data" / "registry-0001_registry.db"
HEAD = schema.head_revision()

KILLS_PER_OPERATION = int(os.environ.get("FICACHE_CRASH_KILLS", "10"))
SEED = int(os.environ.get("FICACHE_CRASH_SEED") or random.SystemRandom().randrange(2**32))
OPERATIONS = ("import", "merge", "prune", "revert", "warm_start", "upgrade")
#: Top-up kills per phase that got none from the planned ones.
TOP_UPS = 3

#: Entries of the base registry: N of H200 in commit 1, R in commit 2 (half of them
#: replacing commit 1's), and the new fingerprint's entries an import or merge adds.
N = 3000
R = 400
NEW_FP_ENTRIES = 500
#: Entries of the current environment a warm start loads before it commits.
WARM_ENTRIES = 3000

META = {k: v for k, v in SHORT_H200_METADATA.items() if k != "gpu"}
H200 = {**META, "gpu": "NVIDIA H200"}
B200 = {**META, "gpu": "NVIDIA B200"}

#: Runs a test on SQLite and on PostgreSQL (``registry_db`` follows ``backend``).
both_backends = pytest.mark.usefixtures("backend")


def key(op: int, m: int) -> str:
    return str((f"flashinfer::op{op}", "Runner", ((m, 4096), (4096, 1024)), ("torch.bfloat16", op)))


def cache_bytes(metadata: dict[str, str] | None, ms: range, tactic: int, op: int = 0) -> bytes:
    entries = {key(op, m): ["Runner", [tactic, m]] for m in ms}
    return json.dumps({"_metadata": metadata, **entries} if metadata else entries).encode()


# -- registries to kill: fresh copies of one base ---------------------------------------------


class SqliteCopies:
    """Fresh copies of a closed base registry file, one per run."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.made = 0

    def fresh(self) -> str:
        self.made += 1
        path = self.base.with_name(f"copy-{self.made}.db")
        shutil.copyfile(self.base, path)
        for suffix in ("-wal", "-journal"):  # a closed registry has none; copied if it had
            side = self.base.with_name(self.base.name + suffix)
            if side.exists():
                shutil.copyfile(side, path.with_name(path.name + suffix))
        return str(path)

    def discard(self, db: str) -> None:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(db + suffix).unlink(missing_ok=True)

    def close(self) -> None:
        pass


class PostgresCopies:
    """Fresh databases cloned from the base database (``CREATE DATABASE ... TEMPLATE``)."""

    def __init__(self, server: pg_server.PostgresServer, base_url: str) -> None:
        import psycopg

        self.server = server
        self.base = make_url(base_url).database
        self.made = 0
        self.admin = psycopg.connect(server.url("postgres", driver=False), autocommit=True)

    def fresh(self) -> str:
        self.made += 1
        name = f"{self.base}_copy{self.made}"
        self.admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.base}"')
        return self.server.url(name)

    def discard(self, db: str) -> None:
        self.server.drop_database(str(make_url(db).database))

    def close(self) -> None:
        self.admin.close()


# -- states -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """What a commit changes: fingerprints, entries, and every commit with its change rows."""

    fingerprints: frozenset[str]
    entries: frozenset[tuple[Any, ...]]  # (digest, scope, key, runner, tactic, policy)
    commits: tuple[tuple[Any, ...], ...]  # (id, kind, added, replaced, removed, reverts, changes)

    def describe(self) -> str:
        commits = [c[:6] for c in self.commits]
        return f"{len(self.fingerprints)} fingerprints, {len(self.entries)} entries, {commits=}"


def registry_state(db: str) -> State:
    with Registry.open(db, create=False) as reg, reg.engine.connect() as conn:
        fingerprints = frozenset(conn.execute(text("SELECT digest FROM fingerprints")).scalars())
        entries = frozenset(
            tuple(row)
            for row in conn.execute(
                text(
                    "SELECT f.digest, e.scope, e.key, e.runner, e.tactic, p.policy "
                    "FROM entries e JOIN fingerprints f ON f.id = e.fingerprint_id "
                    "LEFT JOIN policies p ON p.id = e.policy_id"
                )
            )
        )
        commits = tuple(
            tuple(row)
            for row in conn.execute(
                text(
                    "SELECT c.id, c.kind, c.added, c.replaced, c.removed, c.reverts_commit_id, "
                    "(SELECT count(*) FROM entry_changes h WHERE h.commit_id = c.id) "
                    "FROM commits c ORDER BY c.id"
                )
            )
        )
    return State(fingerprints, entries, commits)


def assert_verifies(db: str) -> None:
    report = verify(db)
    assert report.ok, [p.message for p in report.problems[:5]]
    assert report.revision == HEAD


# -- the operations -----------------------------------------------------------------------------


@dataclass
class Operation:
    """How to run one operation on a copy, and how to check what a kill left."""

    name: str
    op: str  # the forker's op
    args: Callable[[str], list[str]]  # argv for a copy's db
    #: After the calibration run: the kind and (added, replaced, removed) of its commit.
    expected_commit: tuple[str, int, int, int] | None
    env: Callable[[], dict[str, str]] = dict


def _build_fleet_base(db: str, work: Path) -> dict[str, Path]:
    """Commits 1 and 2 of H200; files for the import and merge that add B200."""
    with Registry.open(db) as reg:
        reg.import_cache([("h200-1.json", parse_cache_bytes(cache_bytes(H200, range(N), 1)))])
        second = range(N - R // 2, N + R // 2)
        reg.import_cache([("h200-2.json", parse_cache_bytes(cache_bytes(H200, second, 2)))])
    half = range(N // 2, N + N // 2)
    files = {"h200": work / "h200-3.json", "b200": work / "b200.json", "bundle": work / "m.bundle"}
    files["h200"].write_bytes(cache_bytes(H200, half, 3))
    files["b200"].write_bytes(cache_bytes(B200, range(NEW_FP_ENTRIES), 3, op=1))
    h200, b200 = (Fingerprint.from_flashinfer_metadata(m) for m in (H200, B200))
    bundle_entries = [
        NewEntry(h200, key(0, m), "Runner", f"[4,{m}]", None, "shared", None, 5.0) for m in half
    ]
    bundle_entries += [
        NewEntry(b200, key(1, m), "Runner", f"[4,{m}]", None, "tp2/rank1", None, 5.0)
        for m in range(NEW_FP_ENTRIES)
    ]
    files["bundle"].write_bytes(render_bundle(bundle_entries))
    return files


def _build_warm_base(db: str, current: Fingerprint) -> None:
    entries = [
        NewEntry(current, key(7, m), "Runner", f"[1,{m}]", None, "shared", None, 1.0)
        for m in range(WARM_ENTRIES)
    ]
    with Registry.open(db) as reg:
        reg.write(entries, kind="import", message="warm base")


def _frozen_rows() -> dict[str, tuple[list[str], list[tuple[Any, ...]]]]:
    """Every table of the frozen 0001 registry: its columns and rows by id."""
    found = {}
    with contextlib.closing(sqlite3.connect(f"file:{FROZEN_0001}?mode=ro", uri=True)) as conn:
        for table in ("fingerprints", "commits", "entries", "entry_changes"):
            cursor = conn.execute(f'SELECT * FROM "{table}" ORDER BY id')
            found[table] = ([d[0] for d in cursor.description], [tuple(r) for r in cursor])
    return found


def _build_0001_base(db: str, backend: str, registry_path: Path) -> str:
    """The frozen 0001 registry: the file itself, or its rows in a 0001 PostgreSQL database."""
    if backend == "sqlite":
        shutil.copyfile(FROZEN_0001, registry_path)
        return str(registry_path)
    location = schema.resolve(db)
    engine, _readonly = schema.make_engine(location)
    try:
        schema.upgrade(engine, location, "0001_registry")
        with engine.begin() as conn:
            for table, (names, rows) in _frozen_rows().items():
                columns = ", ".join(f'"{n}"' for n in names)
                values = ", ".join(f":{n}" for n in names)
                conn.execute(
                    text(f'INSERT INTO "{table}" ({columns}) VALUES ({values})'),
                    [dict(zip(names, row, strict=True)) for row in rows],
                )
                conn.execute(
                    text(
                        f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                        f'(SELECT max(id) FROM "{table}"))'
                    )
                )
    finally:
        engine.dispose()
    return db


#: Columns of the frozen 0001 registry that later revisions no longer store as
#: such: a policy's text (0006 keeps it once, in ``policies``, by id) and the
#: shapes and extras an entry's key holds (0006 reads them from the key).
_POLICY_TEXT_COLUMNS = {
    "policy": "policy_id",
    "old_policy": "old_policy_id",
    "new_policy": "new_policy_id",
}
_KEY_COLUMNS = {"shapes", "extras"}


def schema_state(db: str) -> tuple[str | None, dict[str, list[tuple[Any, ...]]]]:
    """The revision and the frozen registry's data in every table, read without
    upgrading: its columns, each policy as its text whichever way the revision
    stores it, and not the shapes and extras its keys hold."""
    url = db if "://" in db else f"sqlite:///{db}"
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            revision = schema.current_revision(conn)
            rows = {}
            for table, (names, _rows) in _frozen_rows().items():
                present = {c["name"] for c in inspect(conn).get_columns(table)}
                columns = []
                for name in names:
                    if name in _KEY_COLUMNS:
                        continue
                    by_id = _POLICY_TEXT_COLUMNS.get(name)
                    if name in present or by_id is None:
                        columns.append(f'"{name}"')
                    else:
                        columns.append(f'(SELECT p.policy FROM policies p WHERE p.id = "{by_id}")')
                rows[table] = [
                    tuple(r)
                    for r in conn.execute(
                        text(f'SELECT {", ".join(columns)} FROM "{table}" ORDER BY id')
                    )
                ]
        return revision, rows
    finally:
        engine.dispose()


# -- the test ------------------------------------------------------------------------------------


@dataclass
class Kill:
    index: int
    mode: str  # commit | commit-end | start | any | top-up-start | top-up-begin
    delay_s: float
    phase: str  # before | during | after (from the child's markers)
    exit_code: int  # -9: killed; 0: it had finished
    state: str  # before | after: which state the registry holds


def _kill_once(
    forker: Forker,
    operation: Operation,
    db: str,
    mode: str,
    rng: random.Random,
    timing: dict[str, float],
    index: int,
) -> Kill:
    child = forker.spawn(operation.op, operation.args(db), operation.env())
    started = child.wait_for("start")
    assert started is not None, child.log.read_text()
    if mode == "commit":
        anchor = child.wait_for("pre")
        delay = rng.uniform(0.0, timing["txn"])
    elif mode == "commit-end":  # around the COMMIT itself
        anchor = child.wait_for("pre")
        delay = rng.uniform(0.8, 1.05) * timing["txn"]
    elif mode == "start":
        anchor, delay = started, rng.uniform(0.0, timing["pre"])
    elif mode == "any":
        anchor, delay = started, rng.uniform(0.0, 1.1 * timing["total"])
    elif mode == "top-up-start":
        anchor, delay = started, 0.0
    else:  # top-up-begin
        anchor, delay = child.wait_for("begin"), 0.0
    if anchor is not None:  # None: it ended first (its exit code says how)
        child.sleep_until(anchor + delay)
    child.kill()
    code = child.reap()
    assert code in (-signal.SIGKILL, 0), f"exit {code}: {child.log.read_text()[-3000:]}"
    if code == 0:
        assert "done" in child.markers
    return Kill(index, mode, round(delay, 4), child.phase, code, "?")


def _timing(child: Child) -> dict[str, float]:
    m = child.markers
    assert {"start", "pre", "begin", "committed", "done"} <= set(m), m
    return {
        "pre": m["pre"] - m["start"],
        "txn": m["committed"] - m["pre"],
        "total": m["done"] - m["start"],
    }


def _plan_modes(kills: int) -> list[str]:
    cycle = ("commit", "start", "commit-end", "any")
    return [cycle[i % len(cycle)] for i in range(kills)]


@both_backends
@pytest.mark.parametrize("operation_name", OPERATIONS)
def test_a_killed_operation_leaves_each_commit_whole_or_absent(
    operation_name: str,
    backend: str,
    registry_db: str,
    registry_path: Path,
    forker: Forker,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    caches = iter(range(10**6))

    def fresh_cache_dir() -> dict[str, str]:
        path = work / f"user-cache-{next(caches)}"
        path.mkdir()
        return {"XDG_CACHE_HOME": str(path)}

    # The base registry: a SQLite file, or the test's PostgreSQL database used as a template.
    files: dict[str, Path] = {}
    if operation_name == "upgrade":
        base_db = _build_0001_base(registry_db, backend, registry_path)
    elif operation_name == "warm_start":
        base_db = registry_db
        _build_warm_base(base_db, forker.fingerprint())
    else:
        base_db = registry_db
        files = _build_fleet_base(base_db, work)
    if backend == "sqlite":
        copies: SqliteCopies | PostgresCopies = SqliteCopies(Path(base_db))
    else:
        copies = PostgresCopies(request.getfixturevalue("postgres_server"), base_db)

    half = N // 2
    operations = {
        "import": Operation(
            "import",
            "cli",
            lambda db: ["--db", db, "import", str(files["h200"]), str(files["b200"])],
            ("import", half - R // 2 + NEW_FP_ENTRIES, half + R // 2, 0),
        ),
        "merge": Operation(
            "merge",
            "cli",
            lambda db: ["--db", db, "merge", str(files["bundle"]), "--on-conflict", "theirs"],
            ("merge", half - R // 2 + NEW_FP_ENTRIES, half + R // 2, 0),
        ),
        "prune": Operation(
            "prune",
            "cli",
            lambda db: ["--db", db, "prune", "--fingerprint", "1", "--yes"],
            ("prune", 0, 0, N + R // 2),
        ),
        "revert": Operation(
            "revert",
            "cli",
            lambda db: ["--db", db, "revert", "2", "--yes"],
            ("revert", 0, R // 2, R // 2),
        ),
        "warm_start": Operation(
            "warm_start", "warm_start", lambda db: [db], ("startup", 18, 0, 0), fresh_cache_dir
        ),
        # `ficache db upgrade`: the one command that moves a shared registry's schema.
        "upgrade": Operation(
            "upgrade", "cli", lambda db: ["--db", db, "db", "upgrade", "--yes"], None
        ),
    }
    operation = operations[operation_name]
    rng = random.Random(f"{SEED}/{backend}/{operation_name}")

    def state_of(db: str) -> Any:
        return schema_state(db) if operation.name == "upgrade" else registry_state(db)

    try:
        # Calibration: one run to the end gives the state after and the phases' durations.
        db = copies.fresh()
        before = state_of(db)
        child = forker.spawn(operation.op, operation.args(db), operation.env())
        code = child.reap()
        assert code == 0, child.log.read_text()[-3000:]
        timing = _timing(child)
        assert_verifies(db)
        after = state_of(db)
        copies.discard(db)
        if operation.name == "upgrade":
            assert before[0] == "0001_registry" and after == (HEAD, before[1])
        else:
            assert operation.expected_commit is not None
            assert after.commits[:-1] == before.commits
            assert after.commits[-1][1:5] == operation.expected_commit
            assert after.commits[-1][6] == sum(operation.expected_commit[1:])

        kills: list[Kill] = []

        def kill(mode: str) -> None:
            db = copies.fresh()
            try:
                k = _kill_once(forker, operation, db, mode, rng, timing, len(kills))
                k.state = _check(db, k.phase, operation.name, before, after)
                kills.append(k)
            finally:
                copies.discard(db)

        for mode in _plan_modes(KILLS_PER_OPERATION):
            kill(mode)
        for phase, mode in (("before", "top-up-start"), ("during", "top-up-begin")):
            for _ in range(TOP_UPS):
                if any(k.phase == phase for k in kills):
                    break
                kill(mode)
    finally:
        copies.close()

    phases = {p: sum(k.phase == p for k in kills) for p in ("before", "during", "after")}
    ended = {
        s: sum(k.phase == "during" and k.state == s for k in kills) for s in ("before", "after")
    }
    record = {
        "backend": backend,
        "operation": operation_name,
        "seed": SEED,
        "timing_s": {k: round(v, 4) for k, v in timing.items()},
        "phases": phases,
        "during_ended": ended,
        "kills": [k.__dict__ for k in kills],
    }
    (tmp_path / "kills.json").write_text(json.dumps(record, indent=2))
    with (tmp_path_factory.getbasetemp() / "crash-kills.jsonl").open("a") as every_case:
        every_case.write(json.dumps(record) + "\n")
    print(
        f"\n{backend} {operation_name}: {len(kills)} kills (seed {SEED}; txn "
        f"{timing['txn'] * 1000:.0f} ms of {timing['total'] * 1000:.0f} ms): "
        f"{phases['before']} before the commit, {phases['during']} during it "
        f"(registry as before {ended['before']}, as after {ended['after']}), "
        f"{phases['after']} after it"
    )
    assert len(kills) >= KILLS_PER_OPERATION
    assert phases["before"] >= 1 and phases["during"] >= 1, record
    # Every kill passed _check (verify clean, each commit whole or absent), or the test failed there.
    reliability_log.record(
        item="1. crash safety",
        test=request.node.nodeid,
        backend=backend,
        applied=f"{len(kills)} SIGKILLs at random moments of {operation_name} (seed {SEED})",
        outcome=(
            f"{len(kills)}/{len(kills)} verify clean, whole or absent; killed before the commit "
            f"{phases['before']}, during it {phases['during']} (ended as before {ended['before']}, "
            f"as after {ended['after']}), after it {phases['after']}"
        ),
        ok=len(kills) >= KILLS_PER_OPERATION and phases["before"] >= 1 and phases["during"] >= 1,
        figures={"kills": len(kills), "verify_clean": len(kills), "seed": SEED, **phases},
    )


def _upgrade_to_head(db: str) -> None:
    location = schema.resolve(db)
    engine, _readonly = schema.make_engine(location)
    try:
        schema.upgrade(engine, location)
    finally:
        engine.dispose()


def _check(db: str, phase: str, operation: str, before: Any, after: Any) -> str:
    """Verify the registry a kill left; which whole state it holds."""
    if operation == "upgrade":
        if not db.startswith("postgresql"):
            # "The registry opens": a killed upgrade of a rollback-journal file
            # leaves a hot journal, which SQLite rolls back at the first
            # read-write open (verify only reads, and says so). Open it the
            # plain way, without upgrading, to see what the kill left.
            with contextlib.closing(sqlite3.connect(db)) as conn:
                conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        report = verify(db)  # before any upgrade: at 0001 it is healthy but stale
        kinds = {p.kind for p in report.problems}
        assert report.ok or kinds == {"schema_revision"}, [p.message for p in report.problems]
        now = schema_state(db)
        _upgrade_to_head(db)  # what is still at 0001, as `ficache db upgrade` does
        assert_verifies(db)
        assert schema_state(db) == after
    else:
        assert_verifies(db)
        now = registry_state(db)
    state = "before" if now == before else "after" if now == after else "neither"
    allowed = {"before": ["before"], "after": ["after"], "during": ["before", "after"]}[phase]
    assert state in allowed, (
        f"killed {phase} the commit, the registry holds {state}: "
        f"{now if operation == 'upgrade' else now.describe()}"
    )
    return state
