"""Scenarios of the startup protocol, run on every rank of a real gloo group.

``tests/test_sync.py`` runs ``run_plan`` through ``ficache._ranks.run_ranks``
(N spawned processes, a hard timeout) and asserts on what each rank
returns. Every scenario uses the real ``AutoTuner``, filled by the CPU
stand-in (``ficache.standin``), and its own SQLite registry file. Rank 0
prepares faults (a corrupt file, a held lock, ...) before the warm start;
the other ranks wait for it inside the protocol, as a real server would.

Fault injection is named as such: ``FailingLoadTuner`` is the real
``FlashInferTuner`` whose ``load`` raises on one rank.

PostgreSQL: ``run_plan(..., dbs={scenario: url})`` gives a scenario a
database URL instead of its SQLite file (``tests/test_postgres.py``). The
scenarios that read their registry through ``registry(tmp)`` (cold_warm,
partial, per_rank_keys, disagree, locked) run on either backend; frozen_export
and frozen_commit run on PostgreSQL behind a freezing proxy; the others are
about SQLite files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import sqlite3
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ficache.errors import TunerError
from ficache.standin import DEFAULT_SHAPES, standin_tune
from ficache.sync import warm_start
from ficache.tuner import FlashInferTuner

GROUP_TIMEOUT = 60.0
SHAPES_A = DEFAULT_SHAPES[:2]  # 12 keys
ALL = len(DEFAULT_SHAPES) * 6  # 18 keys

#: Scenario name -> the registry URL it uses instead of its SQLite file (``run_plan(dbs=...)``).
_DBS: dict[str, str] = {}


def registry(tmp: Path, file: str = "registry.db") -> Path | str:
    """This scenario's registry: ``tmp / file``, or the URL ``run_plan`` was given for it."""
    return _DBS.get(tmp.name, tmp / file)


class FailingLoadTuner(FlashInferTuner):
    """Fault injection: the real FlashInfer tuner, except that ``load`` fails (and it never
    keeps a slice it holds already, so every start loads: ``tests/test_kept_slice.py``)."""

    def load(self, text: str) -> int:
        raise TunerError("injected load failure")

    def kept_slice(self, texts: Any, protocol: Any) -> None:
        return None


def _quiet_logs() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("flashinfer").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.ERROR)


def _real_loop(**tune: Any) -> Any:
    """``standin_tune``'s arguments, through FlashInfer's real ``choose_one`` loop.

    ``force_tactic`` becomes a timing skew on this rank (every other tactic
    charged 5 ms per call): under a synchronized group FlashInfer all-reduces
    the timings, so ranks whose own timings disagree still pick one tactic.
    """
    from ficache.standin_timing import real_loop_tune

    forced = tune.pop("force_tactic", None)
    if forced is not None:
        tune["skew"] = {t: 5.0 for t in range(5) if t != forced}
    return real_loop_tune(**tune)


def _held_entries() -> dict[str, Any]:
    """What the AutoTuner would save, as values ranks agree on: ``(runner, tactic, policy)``
    (FlashInfer 0.7.4 appends a selection record, each rank's own timings, to entries its
    own loop tuned; ``row_value`` leaves it out)."""
    from ficache.tuner import row_value

    return {key: row_value(row) for key, row in FlashInferTuner().entries().items()}


#: The tuning loop ``start`` runs: the stand-in's (``standin_tune``), or FlashInfer's own
#: ``choose_one`` with only CUDA timing stood in (``run_plan(loop="flashinfer")``).
_LOOP: dict[str, Callable[..., Any]] = {
    "tune": standin_tune,
    "entries": lambda: FlashInferTuner().entries(),
}


def start(
    db: Any,
    *,
    group: Any = None,
    tune: dict[str, Any] | None = None,
    fail: Callable[[], None] | None = None,
    fail_before: bool = False,
    keep: list[Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """One warm start on ``group`` around the tuning loop; the report, tuning stats, exception.

    ``keep``: the ``WarmStart`` is appended to it (for a later ``warm_start(reuse=...)``)."""
    kwargs.setdefault("timeout", GROUP_TIMEOUT)
    out: dict[str, Any] = {"exception": None}
    block_started = time.monotonic()
    try:
        with warm_start(group, db=str(db), **kwargs) as ws:
            if keep is not None:
                keep.append(ws)
            block_started = time.monotonic()
            if fail is not None and fail_before:
                fail()
            result = _LOOP["tune"](**(tune or {}))
            out["standin"] = dataclasses.asdict(result)
            if fail is not None and not fail_before:
                fail()
    except Exception as exc:  # noqa: BLE001 - recorded for the test to assert on
        out["exception"] = f"{type(exc).__name__}: {exc}"
    out["block_seconds"] = time.monotonic() - block_started
    out["report"] = ws.report.as_json()
    out["entries"] = _LOOP["entries"]()
    settled()
    return out


def settled() -> None:
    """Wait for what this process's starts left running (the served mark a start on a
    SQLite file writes on a thread of its own), so the scenario's plain SQL and file
    reads and writes after a start see the registry as that start left it."""
    from ficache.usage import wait_for_served_marks

    assert wait_for_served_marks(timeout=120), "a served mark's thread did not end"


def _sql(db: Path | str, statement: str) -> list[tuple[Any, ...]]:
    """Run one statement on a registry behind its back (plain driver SQL); its rows."""
    settled()
    if isinstance(db, Path):
        conn = sqlite3.connect(db)
        try:
            rows = conn.execute(statement).fetchall()
            conn.commit()
            return rows
        finally:
            conn.close()
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(db, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            result = conn.execute(text(statement))
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def last_served(db: Path | str) -> list[float | None]:
    """``last_served_at`` of every stored fingerprint, by id."""
    return [row[0] for row in _sql(db, "SELECT last_served_at FROM fingerprints ORDER BY id")]


def registry_summary(db: Path | str) -> dict[str, Any] | None:
    """Commits and entries per scope, read with plain SQL (None if there is no file)."""
    if isinstance(db, str):
        return {
            "commits": _sql(db, "SELECT count(*) FROM commits")[0][0],
            "scopes": dict(_sql(db, "SELECT scope, count(*) FROM entries GROUP BY scope")),
        }
    if not db.exists():
        return None
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            commits = conn.execute("SELECT count(*) FROM commits").fetchone()[0]
            scopes = dict(
                conn.execute("SELECT scope, count(*) FROM entries GROUP BY scope").fetchall()
            )
            return {"commits": commits, "scopes": scopes}
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return {"error": str(exc)}


def file_state(path: Path) -> dict[str, Any]:
    """A bad registry file's sha256, and every file in its directory (to show what a start
    left there: a rewritten file, a second registry, side files)."""
    return {
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None,
        "files": sorted(p.name for p in path.parent.iterdir()),
    }


def _boom() -> None:
    raise ValueError("boom")


# --------------------------------------------------------------------------
# Scenarios: fn(rank, world, tmp) -> dict; ``tmp`` is this scenario's directory.


def cold_warm(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = registry(tmp, "new-dir/registry.db")  # a registry that does not exist yet
    out = {"cold": start(db), "warm": start(db)}
    if rank == 0:
        out["last_served"] = last_served(db)  # the warm start served the fingerprint
        # Delete half the entries behind the registry's back.
        _sql(db, "DELETE FROM entries WHERE id % 2 = 0")
    dist.barrier()
    out["half"] = start(db)
    out["registry"] = registry_summary(db)
    return out


def reuse(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Passes of one process (``warm_start(reuse=...)``): the later ones read nothing.

    ``second`` names a registry in a directory that does not exist (a read would
    fail or create it) and reuses ``first``: it is served what ``first`` left
    each rank holding and commits where ``first`` read. ``mismatched``: rank 0
    reuses ``second``, the other ranks pass nothing to reuse. ``after_uncached``
    reuses that uncached start, so it reads the registry again.
    """
    db, absent = registry(tmp), tmp / f"absent-rank{rank}" / "registry.db"
    kept: list[Any] = []
    out = {"first": start(db, tune={"shapes": SHAPES_A}, keep=kept)}
    out["second"] = start(absent, reuse=kept[0], keep=kept)
    out["absent_created"] = absent.parent.exists()
    out["mismatched"] = start(db, reuse=kept[1] if rank == 0 else None, keep=kept)
    out["after_uncached"] = start(db, reuse=kept[2])
    out["registry"] = registry_summary(db)
    return out


def partial(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = registry(tmp)
    return {
        "first": start(db, tune={"shapes": SHAPES_A}),
        "second": start(db),
        "registry": registry_summary(db),
    }


def per_rank_keys(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = registry(tmp)
    tune = {"rank_tag": f"rank{rank}"}
    return {
        "first": start(db, tune=tune),
        "second": start(db, tune=tune),
        "registry": registry_summary(db),
    }


def disagree(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = registry(tmp)
    tune = {"force_tactic": rank % 5}
    return {
        "first": start(db, tune=tune),
        "second": start(db, tune=tune),
        "registry": registry_summary(db),
    }


def unsynchronized(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    tune = {"force_tactic": 0, "sync": False}
    return {"first": start(db, tune=tune, synchronize=False), "registry": registry_summary(db)}


def missing_dir(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    blocker = tmp / "not-a-dir"
    if rank == 0:
        blocker.write_text("a regular file where a directory should be\n")
    db = blocker / "registry.db"
    return {"first": start(db), "exists": db.exists()}


def corrupt(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    junk = b"this is not a database\n" * 100
    if rank == 0:
        db.write_bytes(junk)
    out = {"first": start(db)}
    out["unchanged"] = db.read_bytes() == junk
    out["written"] = hashlib.sha256(junk).hexdigest()
    out["after"] = file_state(db)
    out["registry"] = registry_summary(db)
    return out


def truncated(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out = {"setup": start(db)}
    if rank == 0:
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()
        data = db.read_bytes()
        db.write_bytes(data[: len(data) // 3])
        for suffix in ("-wal", "-shm"):
            Path(str(db) + suffix).unlink(missing_ok=True)
        out["before"] = file_state(db)
    dist.barrier()
    out["first"] = start(db)
    dist.barrier()  # every rank is done with the file
    if rank == 0:
        out["after"] = file_state(db)
        out["registry"] = registry_summary(db)
    return out


def newer_schema(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out = {"setup": start(db)}
    before = None
    if rank == 0:
        conn = sqlite3.connect(db)
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
        conn.commit()
        conn.close()
        before = list(sqlite3.connect(db).iterdump())
    dist.barrier()
    out["first"] = start(db)
    if rank == 0:
        out["unchanged"] = list(sqlite3.connect(db).iterdump()) == before
    return out


def locked(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = registry(tmp)
    out = {"setup": start(db, tune={"shapes": SHAPES_A})}
    holder: Any = None
    if rank == 0:  # another writer holds the write lock throughout
        if isinstance(db, Path):
            holder = sqlite3.connect(db, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
        else:
            import psycopg

            from ficache.schema import PG_MIGRATION_LOCK_ID

            holder = psycopg.connect(db.replace("postgresql+psycopg://", "postgresql://"))
            holder.execute("SELECT pg_advisory_lock(%s)", [PG_MIGRATION_LOCK_ID])
    dist.barrier()
    out["first"] = start(db, busy_timeout=0.2)
    if isinstance(holder, sqlite3.Connection):
        holder.execute("ROLLBACK")
    if holder is not None:
        holder.close()
    out["registry"] = registry_summary(db)
    return out


#: ``registry_timeout`` of the frozen-server scenarios, in seconds.
FROZEN_LIMIT = 2.0


def frozen(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """A start whose registry server stops answering: its URL is a
    ``tests/frozen_proxy.py`` proxy. Run as ``frozen_export`` (the proxy freezes on
    the export's query) and as ``frozen_commit`` (on the insert of the new entries)."""
    return {"first": start(registry(tmp), registry_timeout=FROZEN_LIMIT)}


def read_only(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out = {"setup": start(db, tune={"shapes": SHAPES_A})}
    # The registry opened read-only through SQLite's URI.
    out["uri"] = start(f"sqlite:///file:{db}?mode=ro&uri=true")
    # A file without write bits. Root may still write such a file, but
    # ficache treats a file nobody may write (chmod a-w) as read-only for
    # everyone, root included, so this phase runs in CI (as root) too.
    if rank == 0:
        db.chmod(0o444)
    dist.barrier()
    out["file"] = start(db)
    dist.barrier()
    if rank == 0:
        db.chmod(0o644)
    out["registry"] = registry_summary(db)
    return out


def load_fails(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out = {"setup": start(db)}
    tuner = FailingLoadTuner() if rank == 1 else None
    out["first"] = start(db, tuner=tuner)
    out["registry"] = registry_summary(db)
    return out


def heterogeneous(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    from ficache.fingerprint import collect

    db = tmp / "registry.db"
    out = {"setup": start(db)}
    fp = collect()
    if rank == 1:
        fp = dataclasses.replace(fp, gpu="Another GPU")
    out["first"] = start(db, fingerprint=fp)
    out["registry"] = registry_summary(db)
    return out


def raise_after(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out = {"first": start(db, fail=_boom if rank == 1 else None)}
    out["registry"] = registry_summary(db)
    return out


def raise_before(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out = {"first": start(db, fail=_boom if rank == 1 else None, fail_before=True)}
    out["registry"] = registry_summary(db)
    out["after"] = start(db)  # the next start in the same processes works
    return out


def stuck_peer(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Rank 1 misses what the others hit: the others release it instead of waiting 30 min."""
    db = tmp / "registry.db"
    out = {"setup": start(db)}

    def lose_cache() -> None:
        FlashInferTuner().clear()

    # Rank 1 forgets its loaded slice inside the block, then tunes alone.
    out["first"] = start(
        db, fail=lose_cache if rank == 1 else None, fail_before=True, release_grace=1.0
    )
    out["registry"] = registry_summary(db)
    return out


SCENARIOS: dict[str, Callable[[int, int, Path], dict[str, Any]]] = {
    f.__name__: f
    for f in (
        cold_warm,
        reuse,
        partial,
        per_rank_keys,
        disagree,
        unsynchronized,
        missing_dir,
        corrupt,
        truncated,
        newer_schema,
        locked,
        read_only,
        load_fails,
        heterogeneous,
        raise_after,
        raise_before,
        stuck_peer,
    )
}
SCENARIOS.update(frozen_export=frozen, frozen_commit=frozen)


def future_schema(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """A rolling upgrade: the registry moves to a newer, compatible schema between two starts.

    The test puts the registry (a SQLite file, or ``dbs``' URL) and the future
    migrations (``tests/future_schema.py``) in ``tmp``; this code tunes part,
    rank 0 upgrades the registry as the future ficache would, and this code
    (now the previous release) starts again: it must serve and commit.
    """
    import future_schema as future

    db = registry(tmp)
    out = {"setup": start(db, tune={"shapes": SHAPES_A})}
    if rank == 0:
        future.upgrade_to_future(db, tmp / "migrations")
    dist.barrier()
    out["future"] = start(db)
    return out


#: Scenarios run only when named (``run_plan``), not in ``tests/test_sync.py``'s sweep of SCENARIOS.
ON_REQUEST: dict[str, Callable[[int, int, Path], dict[str, Any]]] = {"future_schema": future_schema}


def run_plan(
    rank: int,
    world: int,
    root: str,
    names: list[str],
    dbs: dict[str, str] | None = None,
    loop: str = "standin",
) -> dict[str, dict[str, Any]]:
    """Run the named scenarios in order on this rank; an error in one is recorded, not raised.

    ``dbs`` maps scenario names to the database URL each uses instead of a SQLite file.
    ``loop="flashinfer"`` tunes through FlashInfer's real ``choose_one`` loop, CUDA timing
    stood in (``ficache.standin_timing``), instead of the stand-in's loop.
    """
    _quiet_logs()
    _DBS.clear()
    _DBS.update(dbs or {})
    if loop == "flashinfer":
        _LOOP.update(tune=_real_loop, entries=_held_entries)
    elif loop != "standin":
        raise ValueError(f"unknown tuning loop {loop!r}")
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        tmp = Path(root) / name
        if rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        started = time.monotonic()
        try:
            out = (SCENARIOS.get(name) or ON_REQUEST[name])(rank, world, tmp)
        except Exception:  # noqa: BLE001
            out = {"error": traceback.format_exc()}
        out["seconds"] = time.monotonic() - started
        results[name] = out
    return results
