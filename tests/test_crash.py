"""Crash safety: SIGKILL at random moments of import, merge, prune, revert, a warm
start's commit and a schema upgrade, on SQLite and on PostgreSQL.

After every kill the registry passes ``ficache.verify.verify`` (read-only, on the
state the killed process left), opens, and holds each commit whole or not at
all: its fingerprints, entries and commits (kind, counts, change rows) equal
the state before the operation or the state after it, exactly.

How a kill is made:
- The operations run in children forked from one long-lived process (the
  *forker*) that imported torch, FlashInfer and ficache once: an interpreter
  start with torch costs ~8 s here, a fork ~10 ms. Each child is a real
  process running the real CLI (``ficache.cli.main``), ``Registry.open`` or
  ``ficache.warm_start`` with the CPU stand-in (``ficache.standin``) on a
  registry of its own (a fresh copy of a base SQLite file, or a PostgreSQL
  database cloned from a template database).
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
upgrades it, finds nothing but the stale schema; opened (which upgrades it),
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
import select
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pg_server
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from ficache import schema
from ficache.bundle import render_bundle
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_cache_bytes
from ficache.registry import NewEntry, Registry
from ficache.verify import verify

REPO = Path(__file__).resolve().parent.parent
FROZEN_0001 = Path(__file__).parent / "data" / "registry-0001_registry.db"
HEAD = schema.head_revision()

KILLS_PER_OPERATION = int(os.environ.get("FICACHE_CRASH_KILLS", "10"))
SEED = int(os.environ.get("FICACHE_CRASH_SEED") or random.SystemRandom().randrange(2**32))
OPERATIONS = ("import", "merge", "prune", "revert", "warm_start", "upgrade")
#: Hard limits: the forker's start (imports torch and FlashInfer), one child's run.
FORKER_START_S = 300.0
CHILD_DEADLINE_S = 120.0
#: Top-up kills per phase that got none from the planned ones.
TOP_UPS = 3

#: Entries of the base registry: N of H200 in commit 1, R in commit 2 (half of them
#: replacing commit 1's), and the new fingerprint's entries an import or merge adds.
N = 3000
R = 400
NEW_FP_ENTRIES = 500
#: Entries of the current environment a warm start loads before it commits.
WARM_ENTRIES = 3000

META = {
    "flashinfer_version": "0.7.2",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "4.8.1",
}
H200 = {**META, "gpu": "NVIDIA H200"}
B200 = {**META, "gpu": "NVIDIA B200"}

#: Runs a test on SQLite and on PostgreSQL (``registry_db`` follows ``backend``).
both_backends = pytest.mark.usefixtures("backend")


def key(op: int, m: int) -> str:
    return str((f"flashinfer::op{op}", "Runner", ((m, 4096), (4096, 1024)), ("torch.bfloat16", op)))


def cache_bytes(metadata: dict[str, str] | None, ms: range, tactic: int, op: int = 0) -> bytes:
    entries = {key(op, m): ["Runner", [tactic, m]] for m in ms}
    return json.dumps({"_metadata": metadata, **entries} if metadata else entries).encode()


# -- the forker ----------------------------------------------------------------------------

# Imports once, then forks one child per request line (JSON) on stdin and
# answers "pid N" at once and "exit CODE" when the child has gone.
_FORKER = r"""
import contextlib, json, os, sys, time, traceback
import torch
torch.set_num_threads(1)  # no OpenMP worker threads in this process: safe to fork
torch.ones(2, 2) @ torch.ones(2, 2)  # torch's lazy set-up, once, before any fork
import flashinfer.autotuner
import ficache, ficache.bundle, ficache.cli, ficache.merge, ficache.standin, ficache.sync
from ficache import schema
from ficache.fingerprint import collect
from ficache.registry import Registry


def mark(fd, name):
    os.write(fd, f"{name} {time.monotonic()!r}\n".encode())


def observe_write_transactions(fd):
    real = schema.write_transaction

    @contextlib.contextmanager
    def observed(engine):
        mark(fd, "pre")
        with real(engine) as conn:
            mark(fd, "begin")
            yield conn
        mark(fd, "committed")

    schema.write_transaction = observed


def run(op, args):
    if op == "cli":
        try:
            ficache.cli.main(args)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        return 0
    if op == "open":
        Registry.open(args[0]).close()
        return 0
    if op == "warm_start":
        with ficache.warm_start(None, db=args[0]) as ws:
            ficache.standin.standin_tune(force_tactic=1)
        print(json.dumps(ws.report.as_json()))
        return 0 if ws.report.commit_id is not None else 3
    if op == "fingerprint":
        print(json.dumps(collect().as_dict()))
        return 0
    raise ValueError(f"unknown op {op!r}")


def child(request):
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.update(request["env"])
    fd = os.open(request["fifo"], os.O_WRONLY)
    observe_write_transactions(fd)
    mark(fd, "start")
    code = run(request["op"], request["args"])
    mark(fd, "done")
    return code


print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = child(request)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(f"pid {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


class _Lines:
    """Lines read from a raw file descriptor, as they come."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.eof = False

    def read(self) -> list[str]:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:  # a non-blocking FIFO whose writer is still there
            return []
        if not data:
            self.eof = True
            return []
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in lines]


class Forker:
    """The long-lived process the children are forked from (see ``_FORKER``)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.runs = 0
        env = {k: v for k, v in os.environ.items() if k != schema.ENV_VAR}
        env["XDG_CACHE_HOME"] = str(workdir / "user-cache")
        self.stderr = (workdir / "forker.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FORKER],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        assert self.proc.stdout is not None
        self.out = _Lines(self.proc.stdout.fileno())
        self.pending: list[str] = []
        self.current_fingerprint: Fingerprint | None = None
        if self.line(time.monotonic() + FORKER_START_S) != "ready":
            self.fail("the forker did not start")

    def read(self) -> None:
        """Take in what the forker wrote (call when its stdout is readable)."""
        self.pending.extend(self.out.read())
        if self.out.eof and not self.pending:
            self.fail("the forker died")

    def line(self, deadline: float) -> str | None:
        """The forker's next line, or None at ``deadline``."""
        while not self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.out.fd], [], [], left)
            if ready:
                self.read()
        return self.pending.pop(0)

    def fail(self, message: str) -> None:
        self.stop()
        log = (self.workdir / "forker.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"{message}; forker log:\n{log}")

    def spawn(self, op: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        if self.proc.poll() is not None:
            pytest.fail("the forker is gone (stopped by an earlier failure; see that one)")
        self.runs += 1
        fifo = self.workdir / f"markers-{self.runs}.fifo"
        log = self.workdir / f"child-{self.runs}.log"
        os.mkfifo(fifo)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        request = {"op": op, "args": args, "env": env or {}, "fifo": str(fifo), "log": str(log)}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self.line(time.monotonic() + CHILD_DEADLINE_S)
        if answer is None or not answer.startswith("pid "):
            os.close(fd)
            self.fail(f"the forker answered {answer!r} to {op} {args}")
        assert answer is not None
        return Child(self, int(answer.split()[1]), _Lines(fd), log, fifo)

    def fingerprint(self) -> Fingerprint:
        """This environment's fingerprint, as the children's warm starts collect it."""
        if self.current_fingerprint is None:
            child = self.spawn("fingerprint", [])
            code = child.reap()
            output = child.log.read_text()
            assert code == 0, output
            [line] = [line for line in output.splitlines() if line.startswith('{"')]
            self.current_fingerprint = Fingerprint(**json.loads(line))
        return self.current_fingerprint

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.communicate(timeout=30)
        self.stderr.close()


@dataclass
class Child:
    """One forked child: the markers it wrote (name -> monotonic time) and its exit code."""

    forker: Forker
    pid: int
    fifo: _Lines
    log: Path
    fifo_path: Path
    markers: dict[str, float] = field(default_factory=dict)
    exit_code: int | None = None
    deadline: float = field(default_factory=lambda: time.monotonic() + CHILD_DEADLINE_S)

    def _take(self, lines: list[str]) -> None:
        for line in lines:
            name, at = line.split()
            self.markers.setdefault(name, float(at))

    def _pump(self, timeout: float) -> None:
        """Take in what the child and the forker wrote, waiting at most ``timeout``."""
        if self.exit_code is None and self.forker.pending:
            self._answer(self.forker.pending.pop(0))
        if self.exit_code is not None:
            # It has ended: everything it wrote is in the FIFO already.
            while not self.fifo.eof:
                lines = self.fifo.read()
                if not lines and not self.fifo.eof:
                    break  # a process it forked still holds the FIFO: take what is there
                self._take(lines)
            return
        fds = [self.forker.out.fd] + ([] if self.fifo.eof else [self.fifo.fd])
        ready, _, _ = select.select(fds, [], [], max(timeout, 0.0))
        if self.fifo.fd in ready:
            self._take(self.fifo.read())
        if self.forker.out.fd in ready:
            self.forker.read()
            if self.forker.pending:
                self._answer(self.forker.pending.pop(0))
                self._pump(0.0)

    def _answer(self, line: str) -> None:
        if not line.startswith("exit "):
            self.forker.fail(f"the forker answered {line!r}")
        self.exit_code = int(line.split()[1])

    def _past_deadline(self, what: str) -> None:
        if time.monotonic() < self.deadline:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.forker.fail(f"child {self.pid} still ran {what} after {CHILD_DEADLINE_S:g} s; killed")

    def wait_for(self, marker: str) -> float | None:
        """When the child wrote ``marker``; None when it ended without it."""
        while marker not in self.markers and self.exit_code is None:
            self._past_deadline(f"waiting for {marker!r}")
            self._pump(self.deadline - time.monotonic())
        return self.markers.get(marker)

    def sleep_until(self, moment: float) -> None:
        """Wait until the monotonic ``moment``, taking in markers meanwhile."""
        while self.exit_code is None and time.monotonic() < moment:
            self._pump(moment - time.monotonic())

    def kill(self) -> None:
        self._pump(0.0)  # an exit already reported: nothing to kill
        if self.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> int:
        """Wait for the child's end (its markers all taken in); its exit code."""
        while self.exit_code is None:
            self._past_deadline("at its end")
            self._pump(self.deadline - time.monotonic())
        self._pump(0.0)
        os.close(self.fifo.fd)
        self.fifo_path.unlink()
        return self.exit_code

    @property
    def phase(self) -> str:
        if "committed" in self.markers:
            return "after"
        return "during" if "begin" in self.markers else "before"


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forker]:
    f = Forker(tmp_path_factory.mktemp("forker"))
    try:
        yield f
    finally:
        f.stop()


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
                    "SELECT f.digest, e.scope, e.key, e.runner, e.tactic, e.policy "
                    "FROM entries e JOIN fingerprints f ON f.id = e.fingerprint_id"
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


def schema_state(db: str) -> tuple[str | None, dict[str, list[tuple[Any, ...]]]]:
    """The revision and the frozen registry's columns of every table, read without upgrading."""
    url = db if "://" in db else f"sqlite:///{db}"
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            revision = schema.current_revision(conn)
            rows = {}
            for table, (names, _rows) in _frozen_rows().items():
                columns = ", ".join(f'"{n}"' for n in names)
                rows[table] = [
                    tuple(r)
                    for r in conn.execute(text(f'SELECT {columns} FROM "{table}" ORDER BY id'))
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
        "upgrade": Operation("upgrade", "open", lambda db: [db], None),
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
        Registry.open(db).close()  # upgrades what is still at 0001
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
