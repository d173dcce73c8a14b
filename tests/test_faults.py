"""Full disks, read-only registries and PostgreSQL servers that are gone (issue 10 item 3).

A commit (CLI ``import``, ``merge``, ``prune``, ``revert``; a warm start's
commit) that cannot be written fails with one clear line (exit 1 for the
CLI) and leaves the registry byte-identical: the same content (``dump_db``)
and, for SQLite, the same bytes in the registry file. A warm start in that
state still starts: its block runs, tuning proceeds, and its report says why
nothing was committed. After the fault is gone (space freed, the server
back), the same command succeeds: the message's advice works.

How a disk is made full:
- ``tmpfs``: a small tmpfs mounted for the test, filled with a ballast file
  (``posix_fallocate``) until only a few KiB remain, so the registry's WAL
  (and its shared-memory file) growing is what hits the end of the disk, as
  on a real full disk. Mounting needs root (CAP_SYS_ADMIN); where the test
  may not mount, these cases skip with that reason.
- ``page_limit``: the stand-in where mounting is not allowed: SQLite's
  ``PRAGMA max_page_count``, set on every connection the test's process
  opens (an SQLAlchemy ``connect`` event on all engines, removed after the
  test) to the registry's current size, so a commit that must grow the file
  fails with SQLite's own "database or disk is full" (SQLITE_FULL). No
  production knob: the limit lives in the test only.

Read-only: a registry file without write bits (``chmod a-w``, read-only to
ficache even for root), and a registry on a read-only mount (``mount -o
remount,ro``: EROFS, where the tmpfs can be mounted).

PostgreSQL (``postgres`` marker): a throwaway server of this test's own
(``pg_server.PostgresServer``, so the session's server is never disturbed),
stopped before a CLI command and before or during a warm start, then started
again to compare its content; and a server that is unreachable: a port
nothing listens on (refused at once), and a listener that accepts TCP but
never answers (a host that drops everything after the handshake: bounded by
the URL's ``connect_timeout``, 2 s here; ficache's default is
``schema.CONNECT_TIMEOUT_S``).

Every case records its outcome with ``reliability_log.record``.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pg_server
import pytest
from reliability_log import record
from samples import H200_METADATA
from sqlalchemy import Engine, event

import ficache
import ficache.schema
from ficache.standin import DEFAULT_SHAPES, standin_tune
from ficache.usage import wait_for_served_marks

ITEM = "full disk and read-only"
OPERATIONS = ("import", "merge", "prune", "revert")
#: Space the ballast leaves on the tmpfs: room for SQLite's shared-memory
#: file (32 KiB, made when a WAL registry is opened) plus a few KiB, so the
#: open succeeds and the commit's WAL growth is what fills the disk.
WAL_SHM_BYTES = 32 * 1024
FEW_KIB = 8 * 1024
TMPFS_SIZE = "8m"
SHAPES_A = DEFAULT_SHAPES[:2]  # 12 of the stand-in's 18 keys
#: The stand-in's 18 keys and 240 more: a start that loads 12 and tunes 246,
#: whose commit needs pages the registry does not have yet (however tightly
#: the schema packs rows), so a full disk or a page limit stops it.
GROWING_SHAPES = DEFAULT_SHAPES + tuple((64, 64 + 8 * i) for i in range(1, 41))
GROWING_TUNED = 6 + 240


def key(op: int, m: int) -> str:
    return str((f"flashinfer::op{op}", "Runner", ((m, 4096), (4096, 1024)), ("torch.bfloat16",)))


def write_cache(path: Path, op: int, count: int, tactic: int) -> Path:
    entries: dict[str, Any] = {"_metadata": H200_METADATA}
    for m in range(count):
        entries[key(op, m)] = ["Runner", [tactic, m, [m] * 8]]
    path.write_text(json.dumps(entries))
    return path


def file_bytes(path: Path) -> bytes:
    """The file's bytes once no served mark of this process is still being written."""
    assert wait_for_served_marks(timeout=60)
    return path.read_bytes()


# --------------------------------------------------------------------------
# Faults


def _mount(*args: str) -> str | None:
    """Run ``mount ARGS``; None when it worked, else why not."""
    try:
        result = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"mount failed: {exc}"
    return None if result.returncode == 0 else f"mount failed: {result.stderr.strip()}"


class Tmpfs:
    """A small tmpfs mounted at ``path`` for one test."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ballast = path / "ballast"

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int) -> int:
        """Fill the disk with ballast until ``leave`` bytes remain; the bytes that remain."""
        fd = os.open(self.ballast, os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.posix_fallocate(fd, 0, max(self.free() - leave, 1))
        finally:
            os.close(fd)
        return self.free()

    def empty(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def remount(self, mode: str) -> None:
        error = _mount("-o", f"remount,{mode}", str(self.path))
        assert error is None, error


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Tmpfs]:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; the page_limit cases stand in for a full disk")
    error = _mount("-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(mnt))
    if error is not None:
        pytest.skip(f"cannot mount a tmpfs here ({error}); the page_limit cases stand in")
    try:
        yield Tmpfs(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


class PageLimit:
    """``PRAGMA max_page_count`` on every SQLite connection this process opens while on."""

    def __init__(self) -> None:
        self.pages: int | None = None

    def _on_connect(self, dbapi_connection: Any, _record: Any) -> None:
        if self.pages is not None and isinstance(dbapi_connection, sqlite3.Connection):
            dbapi_connection.execute(f"PRAGMA max_page_count = {self.pages}")

    def limit_to(self, db: Path) -> None:
        """No growth past ``db``'s current size."""
        conn = sqlite3.connect(db)
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        finally:
            conn.close()


@pytest.fixture
def page_limit() -> Iterator[PageLimit]:
    limit = PageLimit()
    event.listen(Engine, "connect", limit._on_connect)
    try:
        yield limit
    finally:
        event.remove(Engine, "connect", limit._on_connect)


# --------------------------------------------------------------------------
# The registry every CLI case starts from: commit 1 imports 120 entries,
# commit 2 replaces 60 of them (so prune and revert have work that writes).


def build_registry(cli: Callable[..., Any], db: str, work: Path) -> None:
    first = write_cache(work / "first.json", op=0, count=120, tactic=1)
    second = write_cache(work / "second.json", op=0, count=60, tactic=2)
    for path in (first, second):
        result = cli("import", str(path), db=db)
        assert result.exit_code == 0, result.output


def operation_args(name: str, work: Path) -> list[str]:
    if name == "import":
        return ["import", str(write_cache(work / "import.json", op=1, count=400, tactic=3))]
    if name == "merge":
        return ["merge", str(write_cache(work / "merge.json", op=2, count=400, tactic=4))]
    if name == "prune":
        return ["prune", "--fingerprint", "1", "--yes"]
    return ["revert", "2", "--yes"]


def checkpoint(db: Path) -> None:
    """Fold the WAL into the file, so the file's bytes are the registry's whole content
    (after the served marks this process's starts write on threads of their own)."""
    assert wait_for_served_marks(timeout=60)
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def assert_one_line_error(result: Any, expected: str) -> None:
    assert result.exit_code == 1, result.output
    assert result.stdout == "" or not result.stdout.strip().startswith("Traceback")
    assert result.stderr == f"error: {expected}\n", result.stderr
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------
# SQLite: CLI commits on a full disk


@pytest.mark.parametrize("operation", OPERATIONS)
def test_cli_commit_on_a_full_tmpfs_fails_cleanly(
    operation: str, tmpfs: Tmpfs, tmp_path: Path, cli: Callable[..., Any], dump_db: Any
) -> None:
    db = tmpfs.path / "registry.db"
    build_registry(cli, str(db), tmp_path)
    args = operation_args(operation, tmp_path)
    checkpoint(db)
    before, before_bytes = dump_db(db), file_bytes(db)
    left = tmpfs.fill(WAL_SHM_BYTES + FEW_KIB)

    result = cli(*args, db=str(db))
    expected = f"disk full while writing registry {db}; free space and retry"
    ok = result.exit_code == 1 and result.stderr == f"error: {expected}\n"
    unchanged = dump_db(db) == before and file_bytes(db) == before_bytes
    # The advice works: with space freed, the same command commits.
    tmpfs.empty()
    retry = cli(*args, db=str(db))
    assert_one_line_error(result, expected)
    assert unchanged
    assert retry.exit_code == 0, retry.output
    record(
        item=ITEM,
        test=f"cli {operation} on a full tmpfs",
        applied=f"{operation} with {left // 1024} KiB left on an 8 MiB tmpfs (ballast file)",
        outcome=f"exit {result.exit_code}, {result.stderr.strip()!r}, registry "
        f"{'byte-identical' if unchanged else 'CHANGED'}, retry after freeing: exit {retry.exit_code}",
        ok=ok and unchanged and retry.exit_code == 0,
        figures={"free_bytes": left},
    )


@pytest.mark.parametrize("operation", OPERATIONS)
def test_cli_commit_past_a_page_limit_fails_cleanly(
    operation: str,
    page_limit: PageLimit,
    registry_path: Path,
    tmp_path: Path,
    cli: Callable[..., Any],
    dump_db: Any,
) -> None:
    """Where a tmpfs cannot be mounted: SQLite's own page limit makes the disk "full"."""
    db = registry_path
    build_registry(cli, str(db), tmp_path)
    args = operation_args(operation, tmp_path)
    page_limit.limit_to(db)
    before, before_bytes = dump_db(db), file_bytes(db)

    result = cli(*args, db=str(db))
    expected = f"disk full while writing registry {db}; free space and retry"
    unchanged = dump_db(db) == before and file_bytes(db) == before_bytes
    page_limit.pages = None
    retry = cli(*args, db=str(db))
    assert_one_line_error(result, expected)
    assert unchanged
    assert retry.exit_code == 0, retry.output
    record(
        item=ITEM,
        test=f"cli {operation} past a SQLite page limit",
        applied=f"{operation} with PRAGMA max_page_count at the registry's size",
        outcome=f"exit {result.exit_code}, {result.stderr.strip()!r}, registry "
        f"{'byte-identical' if unchanged else 'CHANGED'}, retry without the limit: exit {retry.exit_code}",
        ok=result.exit_code == 1 and unchanged and retry.exit_code == 0,
    )


def test_cli_on_a_disk_too_full_to_open_the_registry(
    tmpfs: Tmpfs, tmp_path: Path, cli: Callable[..., Any], dump_db: Any
) -> None:
    """A few KiB left: not even SQLite's shared-memory file fits (an I/O error, not SQLITE_FULL)."""
    db = tmpfs.path / "registry.db"
    build_registry(cli, str(db), tmp_path)
    args = operation_args("import", tmp_path)
    checkpoint(db)
    before, before_bytes = dump_db(db), file_bytes(db)
    left = tmpfs.fill(FEW_KIB // 2)

    result = cli(*args, db=str(db))
    expected = f"disk full while writing registry {db}; free space and retry"
    unchanged = file_bytes(db) == before_bytes
    tmpfs.empty()
    unchanged = unchanged and dump_db(db) == before
    retry = cli(*args, db=str(db))
    assert_one_line_error(result, expected)
    assert unchanged
    assert retry.exit_code == 0, retry.output
    record(
        item=ITEM,
        test="cli import on a disk too full to open the registry",
        applied=f"import with {left // 1024} KiB left on a tmpfs",
        outcome=f"exit {result.exit_code}, {result.stderr.strip()!r}, registry "
        f"{'byte-identical' if unchanged else 'CHANGED'}, retry after freeing: exit {retry.exit_code}",
        ok=result.exit_code == 1 and unchanged and retry.exit_code == 0,
        figures={"free_bytes": left},
    )


# --------------------------------------------------------------------------
# SQLite: CLI commits on a read-only registry


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("how", ["chmod", "ro_mount"])
def test_cli_commit_on_a_read_only_registry_fails_cleanly(
    operation: str,
    how: str,
    request: pytest.FixtureRequest,
    registry_path: Path,
    tmp_path: Path,
    cli: Callable[..., Any],
    dump_db: Any,
) -> None:
    if how == "ro_mount":
        mount: Tmpfs = request.getfixturevalue("tmpfs")
        db = mount.path / "registry.db"
    else:
        db = registry_path
    build_registry(cli, str(db), tmp_path)
    args = operation_args(operation, tmp_path)
    checkpoint(db)
    before, before_bytes = dump_db(db), file_bytes(db)
    files = sorted(p.name for p in db.parent.iterdir())
    if how == "ro_mount":
        mount.remount("ro")
    else:
        db.chmod(0o444)

    result = cli(*args, db=str(db))
    expected = f"registry {db} is read-only; pass a writable --db"
    unchanged = (
        dump_db(db) == before
        and file_bytes(db) == before_bytes
        and sorted(p.name for p in db.parent.iterdir()) == files  # no side files either
    )
    if how == "ro_mount":
        mount.remount("rw")
    else:
        db.chmod(0o644)
    assert_one_line_error(result, expected)
    assert unchanged
    record(
        item=ITEM,
        test=f"cli {operation} on a read-only registry ({how})",
        applied=f"{operation} on a registry {'on a read-only mount' if how == 'ro_mount' else 'chmod a-w'}",
        outcome=f"exit {result.exit_code}, {result.stderr.strip()!r}, registry "
        f"{'byte-identical' if unchanged else 'CHANGED'}",
        ok=result.exit_code == 1 and result.stderr == f"error: {expected}\n" and unchanged,
    )


# --------------------------------------------------------------------------
# SQLite: a read-only registry whose WAL still holds commits


WAL_HOLDER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1])
conn.execute("SELECT count(*) FROM commits").fetchone()
print("holding", flush=True)
time.sleep(600)
"""


def leave_a_commit_in_the_wal(cli: Callable[..., Any], db: Path, work: Path) -> None:
    """Import one more file, then leave that commit in the WAL, not folded into the file.

    A child holds a connection while the import commits, so the import's
    closing connection is not the last one and does not fold the WAL in;
    the child is then SIGKILLed, as a writer killed mid-life would be.
    """
    holder = subprocess.Popen(
        [sys.executable, "-c", WAL_HOLDER, str(db)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        result = cli(
            "import", str(write_cache(work / "in-wal.json", op=3, count=40, tactic=5)), db=str(db)
        )
        assert result.exit_code == 0, result.output
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert Path(f"{db}-wal").stat().st_size > 32  # the commit is in the WAL only


@pytest.mark.parametrize("how", ["chmod", "ro_mount", "ro_mount_without_shm"])
def test_a_read_only_registry_reads_the_commits_its_wal_still_holds(
    how: str,
    request: pytest.FixtureRequest,
    registry_path: Path,
    tmp_path: Path,
    cli: Callable[..., Any],
) -> None:
    if how.startswith("ro_mount"):
        mount: Tmpfs = request.getfixturevalue("tmpfs")
        db = mount.path / "registry.db"
    else:
        db = registry_path
    build_registry(cli, str(db), tmp_path)
    checkpoint(db)
    leave_a_commit_in_the_wal(cli, db, tmp_path)
    if how == "ro_mount_without_shm":
        Path(f"{db}-shm").unlink()  # copied without it: SQLite cannot read the WAL there
    files = {p.name: p.read_bytes() for p in db.parent.iterdir() if p.name != "ballast"}
    if how.startswith("ro_mount"):
        mount.remount("ro")
    else:
        db.chmod(0o444)

    log = cli("log", "--format", "json", db=str(db))
    listed = cli("list", "--op", "flashinfer::op3", "--format", "json", db=str(db))
    after = {p.name: p.read_bytes() for p in db.parent.iterdir() if p.name != "ballast"}
    if how.startswith("ro_mount"):
        mount.remount("rw")
    else:
        db.chmod(0o644)

    # The database and its WAL stay as they were. Beside a chmod a-w file in a
    # writable directory, SQLite may rewrite the -shm (its index of the WAL):
    # no data. On a read-only mount nothing can change.
    data_kept = all(after.get(name) == files[name] for name in ("registry.db", "registry.db-wal"))
    if after == files:
        kept = "files unchanged"
    else:
        kept = "database and WAL unchanged" if data_kept else "database or WAL CHANGED"
        kept += (
            ", -shm rewritten"
            if after.get("registry.db-shm") != files.get("registry.db-shm")
            else ""
        )
    if how == "ro_mount_without_shm":
        expected = (
            f"registry {db} is read-only and its WAL (registry.db-wal, "
            f"{len(files['registry.db-wal'])} bytes) holds commits that cannot be read here"
        )
        ok = log.exit_code == 1 and log.stderr.startswith(f"error: {expected}")
        outcome = f"exit {log.exit_code}, {log.stderr.strip()[:120]!r}"
    else:
        commits = json.loads(log.stdout) if log.exit_code == 0 else []
        entries = json.loads(listed.stdout) if listed.exit_code == 0 else []
        ok = len(commits) == 3 and len(entries) == 40
        outcome = f"{len(commits)} commits and {len(entries)} entries of the WAL's import read"
    if how == "ro_mount_without_shm":
        assert_one_line_error(log, log.stderr.removeprefix("error: ").rstrip("\n"))
        assert log.stderr.startswith(f"error: {expected}")
        assert "run any ficache command on it where it is writable" in log.stderr
    else:
        assert log.exit_code == 0, log.output
        assert [c["kind"] for c in json.loads(log.stdout)] == ["import", "import", "import"]
        assert listed.exit_code == 0, listed.output
        assert len(json.loads(listed.stdout)) == 40  # the WAL's commit, read
    assert data_kept
    if how != "chmod":
        assert after == files
    record(
        item=ITEM,
        test=f"read-only registry whose WAL holds a commit ({how})",
        applied="import left in the WAL (its holder SIGKILLed), then "
        + {
            "chmod": "chmod a-w",
            "ro_mount": "a read-only remount",
            "ro_mount_without_shm": "its -shm removed and a read-only remount",
        }[how],
        outcome=outcome + f", {kept}",
        ok=ok and data_kept and (how == "chmod" or after == files),
    )


# --------------------------------------------------------------------------
# SQLite: a warm start on a full disk or a read-only registry (world 1, in process)


def warm(
    db: str | None, shapes: Any = DEFAULT_SHAPES, registry_timeout: float = 60.0
) -> tuple[Any, Any]:
    with ficache.warm_start(db=db, timeout=60, registry_timeout=registry_timeout) as ws:
        tuned = standin_tune(shapes=shapes)
    return ws.report, tuned


def prepare_warm_registry(db: str | None) -> None:
    """Commit 12 of the 18 stand-in keys, then serve them once (so the served mark is fresh
    and a later start writes nothing but its commit)."""
    first, _ = warm(db, SHAPES_A)
    assert first.committed == 12, first
    second, _ = warm(db, SHAPES_A)
    assert (second.loaded, second.tuned) == (12, 0), second


def assert_started_without_commit(report: Any, tuned: Any, reason: str, missing: int = 6) -> None:
    """The block ran and tuned the ``missing`` keys; nothing was committed, and the report says why."""
    assert tuned.profiled == missing and tuned.hits == 12
    assert (report.status, report.loaded, report.tuned) == ("partial", 12, missing)
    assert (report.committed, report.commit_id) == (0, None)
    assert report.reason == reason


def test_warm_start_on_a_full_disk_starts_and_says_why_nothing_was_committed(
    tmpfs: Tmpfs, monkeypatch: pytest.MonkeyPatch, autotuner: Any, dump_db: Any
) -> None:
    # The default registry (and the slice cache) under the user cache dir, on the full disk.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmpfs.path / "user-cache"))
    db = ficache.schema.default_registry_path()
    prepare_warm_registry(None)
    checkpoint(db)
    before, before_bytes = dump_db(db), file_bytes(db)
    left = tmpfs.fill(WAL_SHM_BYTES + FEW_KIB)

    report, tuned = warm(None, GROWING_SHAPES)
    reason = f"nothing committed: commit failed: disk full while writing registry {db}; free space and retry"
    unchanged = dump_db(db) == before and file_bytes(db) == before_bytes
    tmpfs.empty()
    retry, _ = warm(None, GROWING_SHAPES)
    assert_started_without_commit(report, tuned, reason, GROWING_TUNED)
    assert unchanged
    assert (retry.status, retry.committed) == ("partial", GROWING_TUNED)
    record(
        item=ITEM,
        test="warm start commit on a full tmpfs",
        applied=f"warm start (12 loaded, {GROWING_TUNED} tuned) with {left // 1024} KiB left on a tmpfs",
        outcome=f"started ({report.status}, tuned {report.tuned}), reason {report.reason!r}, "
        f"registry {'byte-identical' if unchanged else 'CHANGED'}, "
        f"next start after freeing committed {retry.committed}",
        ok=report.reason == reason and unchanged and retry.committed == GROWING_TUNED,
        figures={"free_bytes": left, "start_seconds": report.total_seconds},
    )


def test_warm_start_on_a_disk_too_full_to_open_the_registry_tunes_uncached(
    tmpfs: Tmpfs, monkeypatch: pytest.MonkeyPatch, autotuner: Any, dump_db: Any
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmpfs.path / "user-cache"))
    db = ficache.schema.default_registry_path()
    prepare_warm_registry(None)
    checkpoint(db)
    before_bytes = file_bytes(db)
    left = tmpfs.fill(FEW_KIB // 2)

    report, tuned = warm(None)
    reason = f"disk full while writing registry {db}; free space and retry"
    unchanged = file_bytes(db) == before_bytes
    tmpfs.empty()
    assert tuned.profiled == 18  # the block ran and tuned everything, uncached
    assert (report.status, report.reason) == ("uncached", reason)
    assert (report.loaded, report.tuned, report.committed) == (0, 18, 0)
    assert unchanged
    record(
        item=ITEM,
        test="warm start on a disk too full to open the registry",
        applied=f"warm start with {left // 1024} KiB left on a tmpfs",
        outcome=f"started {report.status!r}, tuned {report.tuned}, committed {report.committed}, "
        f"registry {'byte-identical' if unchanged else 'CHANGED'}",
        ok=report.reason == reason and report.tuned == 18 and unchanged,
        figures={"free_bytes": left, "start_seconds": report.total_seconds},
    )


def test_warm_start_past_a_page_limit_starts_and_says_why_nothing_was_committed(
    page_limit: PageLimit, registry_path: Path, autotuner: Any, dump_db: Any
) -> None:
    db = registry_path
    prepare_warm_registry(str(db))
    page_limit.limit_to(db)
    before, before_bytes = dump_db(db), file_bytes(db)

    report, tuned = warm(str(db), GROWING_SHAPES)
    reason = f"nothing committed: commit failed: disk full while writing registry {db}; free space and retry"
    unchanged = dump_db(db) == before and file_bytes(db) == before_bytes
    assert_started_without_commit(report, tuned, reason, GROWING_TUNED)
    assert unchanged
    record(
        item=ITEM,
        test="warm start commit past a SQLite page limit",
        applied=f"warm start (12 loaded, {GROWING_TUNED} tuned) with PRAGMA max_page_count at the registry's size",
        outcome=f"started ({report.status}), reason {report.reason!r}, "
        f"registry {'byte-identical' if unchanged else 'CHANGED'}",
        ok=report.reason == reason and unchanged,
        figures={"start_seconds": report.total_seconds},
    )


@pytest.mark.parametrize("how", ["chmod", "ro_mount"])
def test_warm_start_on_a_read_only_registry_serves_and_says_why_nothing_was_committed(
    how: str,
    request: pytest.FixtureRequest,
    registry_path: Path,
    autotuner: Any,
    dump_db: Any,
) -> None:
    if how == "ro_mount":
        mount: Tmpfs = request.getfixturevalue("tmpfs")
        db = mount.path / "registry.db"
    else:
        db = registry_path
    prepare_warm_registry(str(db))
    checkpoint(db)
    before, before_bytes = dump_db(db), file_bytes(db)
    if how == "ro_mount":
        mount.remount("ro")
    else:
        db.chmod(0o444)

    report, tuned = warm(str(db))
    reason = f"nothing committed: registry {db} is read-only"
    unchanged = dump_db(db) == before and file_bytes(db) == before_bytes
    if how == "ro_mount":
        mount.remount("rw")
    else:
        db.chmod(0o644)
    assert_started_without_commit(report, tuned, reason)
    assert f"registry {db} is read-only: this start commits nothing" in report.warnings
    assert unchanged
    record(
        item=ITEM,
        test=f"warm start on a read-only registry ({how})",
        applied=f"warm start (12 loaded, 6 tuned) on a registry "
        f"{'on a read-only mount' if how == 'ro_mount' else 'chmod a-w'}",
        outcome=f"started ({report.status}), reason {report.reason!r}, "
        f"registry {'byte-identical' if unchanged else 'CHANGED'}",
        ok=report.reason == reason and unchanged,
        figures={"start_seconds": report.total_seconds},
    )


# --------------------------------------------------------------------------
# PostgreSQL: a server stopped or unreachable


class ThrowawayServer:
    """A PostgreSQL server of this test's own, which the test may stop and start again."""

    def __init__(self) -> None:
        self.server = pg_server.PostgresServer.start()
        self.bin_dir = Path(pg_server._embedded()._commands.POSTGRES_BIN_PATH)
        self.running = True

    def url(self) -> str:
        return self.server.url("postgres")

    def _pg_ctl(self, *args: str) -> None:
        self.server._run(self.bin_dir / "pg_ctl", "-D", str(self.server.pgdata), *args)

    def halt(self) -> None:
        """Stop the server as a crash or an operator would (fast shutdown, data kept)."""
        if self.server._admin is not None:
            with contextlib.suppress(Exception):
                self.server._admin.close()
            self.server._admin = None
        self._pg_ctl("-m", "fast", "-w", "stop")
        self.running = False

    def resume(self) -> None:
        options = (
            f"-h 127.0.0.1 -p {self.server.port} -k {self.server.root} "
            "-c fsync=off -c lc_messages=C -c autovacuum=off"
        )
        self._pg_ctl(
            "-l", str(self.server.root / "server.log"), "-w", "-t", "60", "-o", options, "start"
        )
        self.running = True

    def stop(self) -> None:
        self.server.stop()


@pytest.fixture
def throwaway_server(postgres_server: Any) -> Iterator[ThrowawayServer]:
    """Needs the session server's availability checks only; never touches that server."""
    server = ThrowawayServer()
    try:
        yield server
    finally:
        server.stop()


#: The URL's own ``connect_timeout`` in the unreachable-server cases, far below ficache's
#: default (``schema.CONNECT_TIMEOUT_S``, 10 s), and the promised bound's ceiling: a
#: start or command that gives up on such a server within 3 times the URL's limit
#: honoured the URL, one that waited out the default did not.
CONNECT_LIMIT_S = 2
CONNECT_CEILING_S = 3 * CONNECT_LIMIT_S


def unreachable_reason(url: str) -> str:
    return f"cannot reach registry {url} ("


@pytest.mark.postgres
@pytest.mark.parametrize("operation", OPERATIONS)
def test_cli_commit_with_the_server_stopped(
    operation: str,
    throwaway_server: ThrowawayServer,
    tmp_path: Path,
    cli: Callable[..., Any],
    dump_db: Any,
) -> None:
    url = throwaway_server.url()
    build_registry(cli, url, tmp_path)
    args = operation_args(operation, tmp_path)
    before = dump_db(url)
    throwaway_server.halt()

    started = time.monotonic()
    result = cli(*args, db=url)
    seconds = time.monotonic() - started
    throwaway_server.resume()
    unchanged = dump_db(url) == before
    retry = cli(*args, db=url)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"error: {unreachable_reason(url)}"), result.stderr
    assert result.stderr.endswith("; check that the server runs and the URL is right\n")
    assert "Connection refused" in result.stderr or "No such file" in result.stderr
    assert result.stderr.count("\n") == 1
    assert unchanged
    assert retry.exit_code == 0, retry.output
    record(
        item=ITEM,
        test=f"cli {operation} with the PostgreSQL server stopped",
        applied=f"{operation} against a stopped server",
        outcome=f"exit {result.exit_code} in {seconds:.2f} s, {result.stderr.strip()!r}, "
        f"registry {'unchanged' if unchanged else 'CHANGED'}, retry with the server back: "
        f"exit {retry.exit_code}",
        ok=result.exit_code == 1 and unchanged and retry.exit_code == 0,
        backend="postgres",
        figures={"seconds": round(seconds, 3)},
    )


class SilentHost:
    """A TCP listener that never accepts or answers: connects complete, then nothing comes back."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def silent_host() -> Iterator[SilentHost]:
    host = SilentHost()
    try:
        yield host
    finally:
        host.close()


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.postgres
@pytest.mark.parametrize("where", ["closed_port", "silent_host"])
def test_cli_commit_with_the_server_unreachable(
    where: str, request: pytest.FixtureRequest, tmp_path: Path, cli: Callable[..., Any]
) -> None:
    request.getfixturevalue("postgres_server")  # the availability checks
    silent = where == "silent_host"
    port = request.getfixturevalue("silent_host").port if silent else closed_port()
    url = (
        f"postgresql+psycopg://postgres@127.0.0.1:{port}/ficache?connect_timeout={CONNECT_LIMIT_S}"
    )
    args = operation_args("import", tmp_path)
    started = time.monotonic()
    result = cli(*args, db=url)
    seconds = time.monotonic() - started
    assert result.exit_code == 1
    assert seconds < CONNECT_CEILING_S, f"gave up after {seconds:.1f} s, not the URL's limit"
    detail = "Connection refused" if where == "closed_port" else "connection timeout expired"
    assert result.stderr.startswith(f"error: {unreachable_reason(url)}"), result.stderr
    assert detail in result.stderr
    assert result.stderr.endswith("; check that the server runs and the URL is right\n")
    assert result.stderr.count("\n") == 1
    record(
        item=ITEM,
        test=f"cli import with the PostgreSQL server unreachable ({where})",
        applied=f"import against {'a port nothing listens on' if where == 'closed_port' else 'a host that never answers'} (connect_timeout=2)",
        outcome=f"exit {result.exit_code} in {seconds:.2f} s, {result.stderr.strip()!r}",
        ok=result.exit_code == 1 and seconds < CONNECT_CEILING_S,
        backend="postgres",
        figures={"seconds": round(seconds, 3)},
    )


@pytest.mark.postgres
def test_warm_start_with_the_server_stopped_before_it_tunes_uncached(
    throwaway_server: ThrowawayServer, autotuner: Any
) -> None:
    url = throwaway_server.url()
    prepare_warm_registry(url)
    throwaway_server.halt()
    report, tuned = warm(url, registry_timeout=CONNECT_LIMIT_S)  # refused: retried that long
    assert tuned.profiled == 18
    assert (report.loaded, report.tuned, report.committed) == (0, 18, 0)
    assert (report.status, bool(report.reason)) == ("uncached", True)
    assert report.reason.startswith(unreachable_reason(url)), report.reason
    assert report.reason.endswith("check that the server runs and the URL is right")
    record(
        item=ITEM,
        test="warm start with the PostgreSQL server stopped before it",
        applied="warm start against a stopped server",
        outcome=f"started {report.status!r}, tuned {report.tuned} in "
        f"{report.total_seconds:.2f} s, reason {report.reason!r}",
        ok=report.tuned == 18 and report.committed == 0,
        backend="postgres",
        figures={"start_seconds": report.total_seconds},
    )


@pytest.mark.postgres
def test_warm_start_with_the_server_stopped_during_it_says_why_nothing_was_committed(
    throwaway_server: ThrowawayServer, autotuner: Any, dump_db: Any
) -> None:
    url = throwaway_server.url()
    prepare_warm_registry(url)
    before = dump_db(url)
    # The commit's refused connection is retried (the server may come back) for that long.
    with ficache.warm_start(db=url, timeout=60, registry_timeout=CONNECT_LIMIT_S) as ws:
        throwaway_server.halt()  # the server goes away while the server tunes
        tuned = standin_tune()
    report = ws.report
    throwaway_server.resume()
    unchanged = dump_db(url) == before
    assert tuned.profiled == 6
    assert (report.status, report.loaded, report.tuned, report.committed) == ("partial", 12, 6, 0)
    assert report.reason is not None
    assert report.reason.startswith(f"nothing committed: commit failed: {unreachable_reason(url)}")
    assert report.reason.endswith("check that the server runs and the URL is right")
    assert unchanged
    record(
        item=ITEM,
        test="warm start with the PostgreSQL server stopped during it",
        applied="server stopped inside the warm-start block (after the export, before the commit)",
        outcome=f"started ({report.status}), tuned {report.tuned}, reason {report.reason!r}, "
        f"registry {'unchanged' if unchanged else 'CHANGED'}",
        ok=report.committed == 0 and unchanged,
        backend="postgres",
        figures={"start_seconds": report.total_seconds},
    )


@pytest.mark.postgres
def test_warm_start_with_the_server_unreachable_tunes_uncached_within_the_connect_timeout(
    silent_host: SilentHost, postgres_server: Any, autotuner: Any
) -> None:
    url = (
        f"postgresql+psycopg://postgres@127.0.0.1:{silent_host.port}/ficache"
        f"?connect_timeout={CONNECT_LIMIT_S}"
    )
    report, tuned = warm(url)
    seconds = report.seconds.get("export", 0.0)  # rank 0's export: where it waits on the host
    assert tuned.profiled == 18
    assert (report.loaded, report.tuned, report.committed) == (0, 18, 0)
    assert report.reason is not None and "connection timeout expired" in report.reason
    assert (report.status, bool(report.reason)) == ("uncached", True)
    # The URL's connect_timeout bounded the export's wait on the host.
    assert seconds < CONNECT_CEILING_S, f"gave up after {seconds:.1f} s, not the URL's limit"
    record(
        item=ITEM,
        test="warm start with the PostgreSQL server unreachable (silent host)",
        applied="warm start against a host that accepts TCP and never answers (connect_timeout=2)",
        outcome=f"started {report.status!r}, tuned {report.tuned}, export took "
        f"{report.seconds.get('export', 0):.2f} s, reason {report.reason!r}",
        ok=report.tuned == 18 and report.committed == 0 and seconds < CONNECT_CEILING_S,
        backend="postgres",
        figures={
            "export_seconds": report.seconds.get("export", 0.0),
            "start_seconds": report.total_seconds,
        },
    )
