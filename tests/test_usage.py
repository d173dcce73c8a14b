"""Pruning by use: a warm start marks the fingerprints it served, ``prune
--unused-for`` removes the entries of those no start served for that long, and
``fingerprints`` / ``stats`` show the marks. On SQLite and on PostgreSQL."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

import ficache
from ficache import schema
from ficache.fingerprint import Fingerprint, collect
from ficache.registry import NewEntry, PruneGroup, Registry
from ficache.standin import standin_tune
from ficache.usage import SERVED_MARK_RESOLUTION_S, mark_served, wait_for_served_marks

#: Runs a test on SQLite and on PostgreSQL (``registry_db`` and ``cli`` follow).
both_backends = pytest.mark.usefixtures("backend")

DAY = 86400.0
FIELDS = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "nvidia-cutlass-dsl==4.8.1",
}
#: Four environments, each in its own state of use (see ``used``).
STALE = Fingerprint(**FIELDS, gpu="NVIDIA A100")  # served 40 days ago
RECENT = Fingerprint(**FIELDS, gpu="NVIDIA H200")  # stored 100 days ago, served yesterday
NEVER_OLD = Fingerprint(**FIELDS, gpu="NVIDIA B200")  # stored 40 days ago, never served
NEVER_NEW = Fingerprint(**FIELDS, gpu="NVIDIA L40S")  # stored now, never served


def key(m: int) -> str:
    return str(("flashinfer::mm_fp4", "CutlassRunner", ((m, 4096),), ("torch.bfloat16",)))


def entries(fp: Fingerprint, scope: str = "shared") -> list[NewEntry]:
    return [NewEntry(fp, key(m), "CutlassRunner", str(m % 3), scope=scope) for m in (16, 32)]


def set_times(db: str, fp: Fingerprint, *, created_at: float, last_served_at: float | None) -> None:
    """Backdate a fingerprint's times behind the registry's back (plain SQL)."""
    engine = create_engine(schema.resolve(db).url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE fingerprints SET created_at = :c, last_served_at = :s WHERE digest = :d"
                ),
                {"c": created_at, "s": last_served_at, "d": fp.digest},
            )
    finally:
        engine.dispose()


def served_times(db: str) -> dict[str, float | None]:
    """gpu -> last_served_at."""
    with Registry.open(db) as reg:
        return {i.fingerprint.gpu: i.last_served_at for i in reg.fingerprints()}


@pytest.fixture
def used(registry_db: str) -> float:
    """A registry holding the four fingerprints above, backdated; returns "now"."""
    with Registry.open(registry_db) as reg:
        reg.write(
            [
                *entries(STALE),
                *entries(STALE, "tp2/rank1"),
                *entries(RECENT),
                *entries(NEVER_OLD),
                *entries(NEVER_NEW),
            ],
            kind="import",
        )
    now = time.time()
    set_times(registry_db, STALE, created_at=now - 100 * DAY, last_served_at=now - 40 * DAY)
    set_times(registry_db, RECENT, created_at=now - 100 * DAY, last_served_at=now - DAY)
    set_times(registry_db, NEVER_OLD, created_at=now - 40 * DAY, last_served_at=None)
    return now


def fid(reg: Registry, fp: Fingerprint) -> int:
    [found] = [i.id for i in reg.fingerprints() if i.fingerprint == fp]
    return found


# -- the plan ---------------------------------------------------------------------


@both_backends
def test_unused_for_plans_exactly_the_stale_fingerprints_entries(
    registry_db: str, used: float
) -> None:
    with Registry.open(registry_db) as reg:
        stale, never_old = fid(reg, STALE), fid(reg, NEVER_OLD)

        plan = reg.plan_prune(unused_for_seconds=30 * DAY, now=used)

        assert plan.criteria == (("unused_for_seconds", "2592000"),)
        assert plan.groups == (
            PruneGroup(stale, "NVIDIA A100", "0.7.2.post1", "shared", 2),
            PruneGroup(stale, "NVIDIA A100", "0.7.2.post1", "tp2/rank1", 2),
            PruneGroup(never_old, "NVIDIA B200", "0.7.2.post1", "shared", 2),
        )
        # 50 days: only the fingerprint served 40 days ago... is not that old either
        assert reg.plan_prune(unused_for_seconds=50 * DAY, now=used).is_empty
        # 12 hours: everything but the fingerprint stored just now
        assert {g.gpu for g in reg.plan_prune(unused_for_seconds=DAY / 2, now=used).groups} == {
            "NVIDIA A100",
            "NVIDIA H200",
            "NVIDIA B200",
        }
        # combined with other criteria: all must match
        assert reg.plan_prune(unused_for_seconds=30 * DAY, scope="tp2/rank1", now=used).groups == (
            PruneGroup(stale, "NVIDIA A100", "0.7.2.post1", "tp2/rank1", 2),
        )
        assert reg.plan_prune(
            unused_for_seconds=30 * DAY, fingerprint_ids=[never_old], now=used
        ).criteria == (("fingerprint", str(never_old)), ("unused_for_seconds", "2592000"))


@both_backends
def test_executing_removes_only_those_entries_and_revert_restores_them(
    registry_db: str, used: float
) -> None:
    with Registry.open(registry_db) as reg:
        before = {(e.fingerprint_id, e.scope, e.key): e.tactic_json for e in reg.entries()}
        plan = reg.plan_prune(unused_for_seconds=30 * DAY, now=used)

        result = plan.execute(reg)

        assert result.removed == 6
        left = {reg.fingerprint(e.fingerprint_id).fingerprint.gpu for e in reg.entries()}
        assert left == {"NVIDIA H200", "NVIDIA L40S"}
        newest = reg.log()[0]
        assert (newest.kind, newest.removed, newest.message) == (
            "prune",
            6,
            "unused_for_seconds=2592000",
        )
        reg.revert(result.commit_id)  # type: ignore[arg-type]
        after = {(e.fingerprint_id, e.scope, e.key): e.tactic_json for e in reg.entries()}
        assert after == before


# -- the CLI ----------------------------------------------------------------------------


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


@both_backends
def test_cli_prune_unused_for(cli, registry_db: str, used: float, dump_db) -> None:
    before = dump_db(registry_db)

    dry = cli("prune", "--unused-for", "30d", "--dry-run")

    assert (dry.exit_code, dry.stderr) == (0, "")
    assert dry.stdout.splitlines() == [
        "prune plan (unused_for_seconds=2592000):",
        "fingerprint  gpu          flashinfer   scope      entries",
        "1            NVIDIA A100  0.7.2.post1  shared     2",
        "1            NVIDIA A100  0.7.2.post1  tp2/rank1  2",
        "3            NVIDIA B200  0.7.2.post1  shared     2",
        "6 entries would be removed (revertible with `ficache revert`)",
        "dry run: nothing changed",
    ]
    assert dump_db(registry_db) == before
    assert cli("prune", "--unused-for", "200d", "--yes").stdout == (
        "nothing matches: nothing to prune\n"
    )
    assert cli("prune", "--unused-for", "soon").exit_code == 2

    done = cli("prune", "--unused-for", "30d", "--yes")

    assert done.stdout.splitlines()[-1] == "removed 6 entries (commit 2)"


@both_backends
def test_cli_fingerprints_and_stats_show_when_each_was_served(
    cli, registry_db: str, used: float
) -> None:
    table = cli("fingerprints", "--wide").stdout.splitlines()
    as_json = json.loads(cli("fingerprints", "--format", "json").stdout)
    stats = cli("stats").stdout.splitlines()

    assert [line[: len("id  entries  records  last served        ")] for line in table] == [
        "id  entries  records  last served        ",
        f"1   4        0        {when(used - 40 * DAY)}",
        f"2   2        0        {when(used - DAY)}",
        "3   2        0        never              ",
        "4   2        0        never              ",
    ]
    assert [(i["id"], i["last_served_at"]) for i in as_json] == [
        (1, pytest.approx(used - 40 * DAY)),
        (2, pytest.approx(used - DAY)),
        (3, None),
        (4, None),
    ]
    assert stats[-6:] == [
        "",
        "fingerprint  last served          starts  replay starts  replay misses",
        f"1            {when(used - 40 * DAY)}  0       0              0",
        f"2            {when(used - DAY)}  0       0              0",
        "3            never                0       0              0",
        "4            never                0       0              0",
    ]


# -- the mark ---------------------------------------------------------------------------


@both_backends
def test_mark_served_sets_the_given_fingerprints_only(registry_db: str, used: float) -> None:
    with Registry.open(registry_db) as reg:
        ids = [fid(reg, NEVER_OLD), fid(reg, NEVER_NEW)]

        assert mark_served(reg, ids, now=used + 5) is True
        assert mark_served(reg, [], now=used + 6) is False  # nothing to mark: no statement

    assert served_times(registry_db) == {
        "NVIDIA A100": pytest.approx(used - 40 * DAY),
        "NVIDIA H200": pytest.approx(used - DAY),
        "NVIDIA B200": used + 5,
        "NVIDIA L40S": used + 5,
    }


def start_counts(db: str) -> dict[str, tuple[int, int, int]]:
    """gpu -> (starts served, replay starts, replay misses), as ``stats`` counts them."""
    with Registry.open(db) as reg:
        gpus = {i.id: i.fingerprint.gpu for i in reg.fingerprints()}
        return {gpus[f]: (n, r, m) for f, n, r, m in reg.stats().start_counts}


@both_backends
def test_a_fresh_mark_keeps_its_time_and_every_mark_counts(registry_db: str, used: float) -> None:
    with Registry.open(registry_db) as reg:
        ids = [fid(reg, NEVER_NEW)]
        assert mark_served(reg, ids, now=used) is True

        # Within the resolution (an hour): the time is fresh and stays; the start counts.
        assert mark_served(reg, ids, now=used + 60) is True
        assert served_times(registry_db)["NVIDIA L40S"] == used
        assert mark_served(reg, ids, now=used + 120, missed=3) is True  # a replay start
        assert mark_served(location_of(reg), ids, now=used + 180, missed=0) is True  # SQLite fast

        assert mark_served(reg, ids, now=used + 2 * 3600) is True
        assert served_times(registry_db)["NVIDIA L40S"] == used + 2 * 3600
        assert len(reg.log()) == 1  # marks are no commits
    counts = start_counts(registry_db)
    assert counts["NVIDIA L40S"] == (5, 2, 3)
    assert counts["NVIDIA A100"] == (0, 0, 0)


def location_of(reg: Registry) -> Any:
    """The SQLite file a warm path marks without opening it; the registry itself elsewhere."""
    return reg.location if reg.location.path is not None else reg


@contextmanager
def another_writer_holding_the_lock(db: str) -> Iterator[None]:
    """Another writer holds what the mark needs for the block (plain driver SQL)."""
    location = schema.resolve(db)
    if location.path is not None:
        conn = sqlite3.connect(location.path, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")  # SQLite's write lock
            yield
            conn.execute("ROLLBACK")
        finally:
            conn.close()
        return
    engine = create_engine(location.url, poolclass=NullPool)
    try:
        with engine.connect() as conn, conn.begin() as transaction:
            conn.execute(text("SELECT id FROM fingerprints FOR UPDATE"))  # every fingerprint row
            yield
            transaction.rollback()
    finally:
        engine.dispose()


@both_backends
def test_a_busy_registry_skips_the_mark_and_changes_nothing(
    registry_db: str, used: float, dump_db
) -> None:
    before = dump_db(registry_db)
    with Registry.open(registry_db) as reg:
        ids = [fid(reg, STALE)]
        location = schema.resolve(registry_db)
        with another_writer_holding_the_lock(registry_db):
            assert mark_served(reg, ids, now=used, timeout=0.05) is False
            assert mark_served(reg, ids, now=used, timeout=0.05, missed=2) is False
            if location.path is not None:  # the SQLite warm path marks the file itself
                assert mark_served(location, ids, now=used, timeout=0.05) is False
        assert dump_db(registry_db) == before  # a skipped mark is not counted either
        assert mark_served(reg, ids, now=used) is True  # free again


def test_a_read_only_registry_is_never_marked(registry_db: str, used: float, dump_db) -> None:
    location = schema.resolve(registry_db)  # a SQLite file: read-only files are its matter
    assert location.path is not None
    location.path.chmod(0o444)  # read-only for root too: ficache checks the mode bits
    before = dump_db(registry_db)

    with Registry.open(registry_db) as reg:
        assert reg.readonly
        assert mark_served(reg, [1], now=used) is False
    assert mark_served(location, [1], now=used) is False

    assert dump_db(registry_db) == before


# -- warm starts ------------------------------------------------------------------------


def start(db: str, **kwargs: Any) -> Any:
    with ficache.warm_start(db=db, **kwargs) as ws:
        standin_tune()
    return ws.report


@both_backends
def test_a_warm_start_marks_its_fingerprint_served(registry_db: str, autotuner: Any) -> None:
    digest = collect().digest

    def last_served() -> float | None:
        with Registry.open(registry_db) as reg:
            [info] = [i for i in reg.fingerprints() if i.fingerprint.digest == digest]
            return info.last_served_at

    cold = start(registry_db)
    assert (cold.status, cold.committed) == ("cold", 18)
    assert last_served() is None  # a cold start served nothing

    before_warm = time.time()
    warm = start(registry_db)
    first = last_served()

    assert (warm.status, warm.loaded, warm.committed) == ("warm", 18, 0)
    assert first is not None and first >= before_warm

    again = start(registry_db)  # on SQLite, the slice cache's warm path: no registry opened
    second = last_served()

    assert (again.status, again.slice_cache) == ("warm", "hit")
    assert second == first  # a mark younger than SERVED_MARK_RESOLUTION_S is not written again

    with Registry.open(registry_db) as reg:
        [created] = [i.created_at for i in reg.fingerprints() if i.fingerprint.digest == digest]
    stale = first - SERVED_MARK_RESOLUTION_S - 60  # as if the last start were over an hour ago
    set_times(registry_db, collect(), created_at=created, last_served_at=stale)
    before_later = time.time()
    later = start(registry_db)
    third = last_served()

    assert (later.status, later.slice_cache) == ("warm", "hit")  # the state is unchanged
    assert third is not None and third >= before_later  # this start, on the warm path, marked it
    with Registry.open(registry_db) as reg:
        assert len(reg.log()) == 1  # the marks are no commits


@both_backends
def test_a_start_that_cannot_mark_still_serves(registry_db: str, autotuner: Any, dump_db) -> None:
    start(registry_db)
    before = dump_db(registry_db)
    with another_writer_holding_the_lock(registry_db):
        # A commit would wait for the lock too: nothing is tuned here, so none is made.
        warm = start(registry_db)
        # On SQLite the mark is written on a thread of its own: it gives up while the lock
        # is still held.
        assert wait_for_served_marks(timeout=60)

    assert (warm.status, warm.loaded, warm.tuned, warm.reason) == ("warm", 18, 0, None)
    assert dump_db(registry_db) == before


@both_backends
def test_stats_show_how_many_starts_each_fingerprint_served_and_what_replays_missed(
    cli, registry_db: str, autotuner: Any
) -> None:
    from ficache.standin_timing import real_loop_serve

    def serve(mode: str) -> Any:
        with ficache.warm_start(db=registry_db, mode=mode) as ws:
            real_loop_serve()  # FlashInfer's real choose_one for all 18 keys
        return ws.report

    cold = serve("tune")
    engine = create_engine(schema.resolve(registry_db).url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM entries WHERE id % 2 = 0"))  # 9 keys lost
    finally:
        engine.dispose()
    replays = [serve("replay"), serve("replay")]
    tuned = serve("tune")  # tunes the 9 again; marks at its export

    assert (cold.status, cold.committed) == ("cold", 18)  # served nothing: not counted
    assert [(r.mode, r.missed, r.committed) for r in replays] == [("replay", 9, 0)] * 2
    assert (tuned.mode, tuned.status, tuned.committed) == ("tune", "partial", 9)
    [served] = served_times(registry_db).values()
    assert served is not None
    stats = cli("stats")
    assert stats.exit_code == 0, stats.stderr
    assert stats.stdout.splitlines()[-2:] == [
        "fingerprint  last served          starts  replay starts  replay misses",
        f"1            {when(served)}  3       2              18",
    ]
    as_json = json.loads(cli("stats", "--format", "json").stdout)
    assert as_json["start_counts"] == {
        "1": {"served_starts": 3, "replay_starts": 2, "replay_misses": 18}
    }


# -- the mark off the start's path (SQLite) -------------------------------------------


def served_starts_over_sqlite3(db: str) -> int:
    """The served-start count of every fingerprint, read with plain ``sqlite3``: no
    ``Registry.open``, which would first wait for this process's pending marks."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        [(count,)] = conn.execute("SELECT coalesce(sum(served_starts), 0) FROM fingerprints")
    return int(count)


def test_a_start_on_a_sqlite_file_returns_before_its_mark_is_written(
    registry_db: str, autotuner: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The mark's thread is held at a gate (test stand-in: the real ``mark_served``, called
    once the gate opens): the start has returned, served, with its mark still pending;
    ``wait_for_served_marks`` and ``Registry.open`` wait for it."""
    import threading

    import ficache.usage

    start(registry_db)  # cold: commits, marks nothing
    gate = threading.Event()
    real_mark = ficache.usage.mark_served

    def gated_mark(*args: Any, **kwargs: Any) -> bool:
        assert gate.wait(timeout=120), "the test never opened the gate"
        return real_mark(*args, **kwargs)

    monkeypatch.setattr(ficache.usage, "mark_served", gated_mark)
    warm = start(registry_db)
    again = start(registry_db)  # its mark waits behind the first one's: order is kept

    assert (warm.status, warm.loaded, again.status) == ("warm", 18, "warm")
    assert served_starts_over_sqlite3(registry_db) == 0  # nothing written yet
    assert wait_for_served_marks(timeout=0) is False

    threading.Timer(1.0, gate.set).start()  # opens while Registry.open is waiting
    with Registry.open(registry_db) as reg:
        [info] = reg.fingerprints()
        [(counted_id, served, _, _)] = reg.stats().start_counts
    assert info.last_served_at is not None
    assert (counted_id, served) == (info.id, 2)
    assert wait_for_served_marks(timeout=0) is True


EXIT_AFTER_A_START = """
import sys
import ficache
from ficache.standin import standin_tune
with ficache.warm_start(db=sys.argv[1]) as ws:
    standin_tune()
assert ws.report.status == "warm", ws.report
sys.exit(0)  # at once: the interpreter's shutdown joins the mark's thread
"""


EXIT_WHILE_A_SLOW_MARK_IS_WRITTEN = """
import sys, threading, time
import ficache
import ficache.usage
from ficache.standin import standin_tune

written = ficache.usage.mark_served


def slow_disk_mark(*args, **kwargs):
    # Slow-disk stand-in: the mark takes 1.5 s longer than it would (a disk that is slow to
    # write and fsync), so it is still running well after the interpreter began to exit.
    time.sleep(1.5)
    return written(*args, **kwargs)


ficache.usage.mark_served = slow_disk_mark
with ficache.warm_start(db=sys.argv[1]) as ws:
    standin_tune()
assert ws.report.status == "warm", ws.report
assert [t.name for t in threading.enumerate() if t.name == "ficache-served-mark"], "no mark"
sys.exit(0)  # the mark has not finished: only a joined, non-daemon thread still writes it
"""


def test_a_slow_mark_still_running_when_its_process_exits_normally_is_written(
    registry_db: str, autotuner: Any, tmp_path: Any
) -> None:
    """The served mark survives a normal exit even when it takes longer than the exit: a
    mark run on a daemon thread would be dropped by the interpreter's shutdown."""
    import os
    import subprocess
    import sys

    start(registry_db)  # cold: commits the entries this machine's fingerprint loads
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "user-cache")}
    env.pop("FICACHE_DB", None)
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_A_SLOW_MARK_IS_WRITTEN, registry_db],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert served_starts_over_sqlite3(registry_db) == 1


def test_a_process_that_exits_right_after_its_start_leaves_the_mark(
    registry_db: str, autotuner: Any, tmp_path: Any
) -> None:
    """A fresh interpreter, warm start, then exit: the mark written off the start's path
    is in the registry once the process has ended."""
    import os
    import subprocess
    import sys

    start(registry_db)  # cold: commits the entries this machine's fingerprint loads
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "user-cache")}
    env.pop("FICACHE_DB", None)
    for n in (1, 2):
        done = subprocess.run(
            [sys.executable, "-c", EXIT_AFTER_A_START, registry_db],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        assert served_starts_over_sqlite3(registry_db) == n
