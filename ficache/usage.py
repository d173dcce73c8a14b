"""When each fingerprint was last served, and how often: the mark a warm start leaves.

A warm start *serves* a fingerprint when rank 0 exports the slices its ranks
load from that fingerprint's entries (every stored fingerprint that serves
the running environment, ``Registry.serving``), or reuses what an earlier
start of its process served (``warm_start(reuse=...)``: an SGLang pass after
the first, which marks the fingerprints that first read served, and nothing
when that start was cold). Rank 0 then records it with
``mark_served``, in one statement over those fingerprints: the time
(``fingerprints.last_served_at = now``) and, from revision
``0008_start_counts`` on, the counts (``served_starts + 1``; a replay start
also ``replay_starts + 1`` and ``replay_misses + N``, its misses). A start
marks once its block ran and its commit (if any) was tried (``ficache.sync``):
a replay start only then knows its misses, and a start whose commit met the
registry failing (a full disk, a server gone) leaves no mark, so such a
registry is left exactly as it was.
``ficache prune --unused-for AGE`` removes the entries of fingerprints no
start has served for ``AGE`` (``Registry.plan_prune(unused_for_seconds=...)``),
and ``ficache fingerprints`` / ``ficache stats`` show the marks and counts.

How counts are kept: counters on the fingerprint's row, incremented in the
mark's one UPDATE (no row per start, so the registry does not grow with
starts). A start served by several fingerprints counts once on each, with
all its misses. The counts are a lower bound: a mark that is skipped (see
below) is not counted, and is never retried or made up later; the start
itself still served. A start that served nothing (a cold or uncached one)
counts nowhere.

Invariants:
- At most one UPDATE per start, never one per entry, outside the registry's
  write lock, and it is not a commit: it changes no entry, adds no history,
  and leaves the state the slice cache is keyed by unchanged. Every mark
  writes (the counters grow); the time keeps a resolution of
  ``SERVED_MARK_RESOLUTION_S`` (an hour): a time younger than that is left
  as it is, so ages of days (``--unused-for 30d``) lose nothing.
- The mark never fails or stalls a start: it waits at most ``timeout``
  (``SERVED_MARK_TIMEOUT_S``) for a lock, is never retried, and any problem
  (a read-only registry, a writer holding the lock, a lost connection) only
  skips it, with a debug log line.
- On a SQLite file a start's mark is written off the start's path
  (``mark_served_after_start``): on a thread of its own
  (``ficache.after_start``), started when the start's last collective is
  done, so no rank waits for its UPDATE or for the fsyncs of the WAL
  checkpoint its connection's close makes. The process waits for that thread
  when it exits normally, and every ``Registry.open`` in the process waits
  for it first, so whatever this process reads through a registry shows its
  own marks (``wait_for_served_marks`` waits for them too). Marks of one
  process are written in the order of their starts. A process that ends without its
  interpreter's shutdown (``os._exit``, a kill) within those milliseconds
  loses its mark, a skipped mark as above. A PostgreSQL registry is marked
  on the start's path, through the start's bounded registry connection.
- A fingerprint never served (``last_served_at`` NULL) counts as last used
  when it was created, so one imported or tuned today is
  not "unused for 30 days" today (``coalesce(last_served_at, created_at)``
  in ``Registry.plan_prune``).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ficache import after_start, sqlite_fast
from ficache.location import Location

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from ficache.registry import Registry

logger = logging.getLogger(__name__)

#: The longest a start waits for the lock the mark needs; past it the mark is skipped.
SERVED_MARK_TIMEOUT_S = 0.25
#: A mark time younger than this is not moved: the counters still grow at every mark,
#: and ages of days (``--unused-for 30d``) lose no precision.
SERVED_MARK_RESOLUTION_S = 3600.0


def mark_served(
    target: Registry | Location,
    fingerprint_ids: Sequence[int],
    *,
    now: float | None = None,
    timeout: float = SERVED_MARK_TIMEOUT_S,
    resolution: float = SERVED_MARK_RESOLUTION_S,
    missed: int | None = None,
) -> bool:
    """Mark ``fingerprint_ids`` served by one start at ``now``; True when the mark was written.

    One UPDATE: the time where older than ``resolution`` (or absent), and the
    counts (``missed`` not None: a replay start that missed that many keys).
    ``target`` is an open registry, or the location of a SQLite registry file
    (the warm path reads its slices without opening the registry). Never
    raises: a registry that cannot take the mark within ``timeout`` is left
    as it was.
    """
    ids = sorted({int(i) for i in fingerprint_ids})
    if not ids:
        return False
    when = time.time() if now is None else now
    stale_before = when - resolution
    misses = None if missed is None else max(int(missed), 0)
    # A Location is a SQLite file the warm path read without opening it (and without
    # importing SQLAlchemy, which an open Registry has loaded already).
    registry: Registry | None
    if isinstance(target, Location):
        registry, location = None, target
    else:
        registry, location = target, target.location
    reason: str | None
    try:
        if registry is not None and registry.readonly:
            reason = "the registry is read-only"
        elif registry is not None and registry.write_refusal is not None:
            reason = registry.write_refusal
        elif location.path is not None:
            reason = _mark_sqlite_file(location.path, ids, when, stale_before, timeout, misses)
        elif registry is not None:
            reason = _mark_through_engine(registry.engine, ids, when, stale_before, timeout, misses)
        else:
            reason = "no open registry"
    except Exception as exc:  # noqa: BLE001 - the mark never fails a start
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
    if reason is not None:
        logger.debug("ficache: served mark of %s not recorded: %s", location.display, reason)
        return False
    return True


def mark_served_after_start(
    location: Location, fingerprint_ids: Sequence[int], *, missed: int | None = None
) -> None:
    """``mark_served`` of a SQLite registry file, dated now and written on a thread of its
    own (``ficache.after_start``), so that the caller does not wait for it. Never raises,
    and returns at once; ``wait_for_served_marks`` waits for it."""
    ids = sorted({int(i) for i in fingerprint_ids})
    if ids:
        after_start.submit("served-mark", _mark_later, location, ids, time.time(), missed)


def _mark_later(location: Location, ids: list[int], when: float, missed: int | None) -> None:
    # Looked up when it runs (not bound at submission), as every caller of mark_served does.
    mark_served(location, ids, now=when, missed=missed)


def wait_for_served_marks(timeout: float | None = None) -> bool:
    """Wait until every mark this process started with ``mark_served_after_start`` is
    written or skipped (at most ``timeout`` seconds); True when none is left pending.

    ``Registry.open`` waits so (``ficache.after_start.wait``), so a registry opened in
    the process that started shows that process's marks.
    """
    return after_start.wait(timeout)


def _mark_sqlite_file(
    path: Path, ids: list[int], when: float, stale_before: float, timeout: float, missed: int | None
) -> str | None:
    # A file nobody may write (chmod a-w) is read-only for ficache, root included.
    if not path.stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return "the registry is read-only"
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        return "the registry is read-only"
    return sqlite_fast.write_served_marks(
        path, ids, when, stale_before, timeout, replay_misses=missed
    )


def _mark_through_engine(
    engine: Engine,
    ids: list[int],
    when: float,
    stale_before: float,
    timeout: float,
    missed: int | None,
) -> str | None:
    from sqlalchemy import case, or_, text, update

    from ficache import schema
    from ficache.models import FINGERPRINTS as F

    milliseconds = max(int(timeout * 1000), 1)
    with engine.connect() as conn, conn.begin():
        if conn.dialect.name == "postgresql":
            conn.execute(text(f"SET LOCAL lock_timeout = {milliseconds}"))
            conn.execute(text(f"SET LOCAL statement_timeout = {4 * milliseconds}"))
        elif conn.dialect.name == "sqlite":
            conn.exec_driver_sql(f"PRAGMA busy_timeout = {milliseconds}")
        values: dict[str, Any] = {
            "last_served_at": case(
                (or_(F.c.last_served_at.is_(None), F.c.last_served_at < stale_before), when),
                else_=F.c.last_served_at,
            ),
            "served_starts": F.c.served_starts + 1,
        }
        if missed is not None:
            values["replay_starts"] = F.c.replay_starts + 1
            values["replay_misses"] = F.c.replay_misses + missed
        # An older schema (shared with older servers) may lack the counters: the time only.
        values = schema.features(conn).writable(F.name, values)
        conn.execute(update(F).where(F.c.id.in_(ids)).values(**values))
    return None
