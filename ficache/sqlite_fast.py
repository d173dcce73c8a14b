"""Raw ``sqlite3`` fast paths: what a warm start asks a SQLite registry file without opening it.

Opening a registry costs an engine and Alembic's checks; a server start on a
warm SQLite file needs three small answers before that, and asks them here,
over plain ``sqlite3`` connections: the registry's state token (the slice
cache's key, ``ficache.slices``), whether a fingerprint serving this
environment holds entries (``ficache.adopt``), and the served mark
(``ficache.usage``). Every other access to a registry goes through SQLAlchemy
(``ficache.registry``); connection setup for engines is ``ficache.schema``'s.

What it may do:
- Read, over a read-only connection (``mode=ro``): ``alembic_version``,
  ``commits``, ``entries``, ``records`` (``state``), ``fingerprints`` and
  ``entries`` (``fingerprints_with_entries``).
- Write exactly one thing: the served mark of some fingerprints
  (``write_served_marks``: ``last_served_at`` and the start counters where the
  file's ``fingerprints`` has them, from ``0008_start_counts`` on), in one
  autocommit UPDATE. Never an entry, a record or a
  commit; no history.

Schema revisions it assumes, and how it stays in step with the models:
- Table names are the models' (``ficache.models``, ``__tablename__``; written
  out in ``*_TABLE`` constants, since importing the models imports SQLAlchemy) and
  fingerprint columns are ``Fingerprint``'s (``ALL_FIELDS``); the columns it
  names (``id``, ``created_at``, ``updated_at``, ``fingerprint_id``,
  ``last_served_at``) exist from revision 0003 (``records``) on; the start
  counters where the file's ``fingerprints`` has them (from ``0008_start_counts``
  on: ``COUNTER_COLUMN``), and the mark names them only there.
- It never decides what a revision means: ``state`` returns the revision
  it read and ``slices.cached_slices`` trusts a state only at this code's
  head; an older, newer or foreign file raises ``sqlite3.Error`` (or reads a
  state that is not trusted) and every caller then takes the full path
  through ``Registry.open``, which explains the problem, or (the served
  mark) skips. ``STATE_SQL`` is also what the full path asks through the
  engine (``slices.registry_state``), so both paths compute one token.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from ficache.fingerprint import ALL_FIELDS

#: The models' table names (``ficache.models``), written out: importing the models imports
#: SQLAlchemy. ``tests/test_start_imports.py`` checks each against its model.
COMMITS_TABLE = "commits"
ENTRIES_TABLE = "entries"
RECORDS_TABLE = "records"
PROTOCOL_RECORDS_TABLE = "protocol_records"
FINGERPRINTS_TABLE = "fingerprints"


#: The registry's state token: (schema revision, last commit id, its time, entry
#: count, last entry id, last entry update, record count, last record id, last
#: record update, and the same three of protocol records). Portable SQL: the full
#: path runs it through the engine.
def state_sql(*, protocol_records: bool = True) -> str:
    """``STATE_SQL``; without ``protocol_records`` (a schema from before the revision that
    adds their table: ``schema.SchemaFeatures``), their three values as NULL."""
    protocol = (
        f"(SELECT count(*) FROM {PROTOCOL_RECORDS_TABLE}), "
        f"(SELECT max(id) FROM {PROTOCOL_RECORDS_TABLE}), "
        f"(SELECT max(updated_at) FROM {PROTOCOL_RECORDS_TABLE})"
        if protocol_records
        else "NULL, NULL, NULL"
    )
    return (
        "SELECT (SELECT max(version_num) FROM alembic_version), "
        f"(SELECT max(id) FROM {COMMITS_TABLE}), (SELECT max(created_at) FROM {COMMITS_TABLE}), "
        f"(SELECT count(*) FROM {ENTRIES_TABLE}), (SELECT max(id) FROM {ENTRIES_TABLE}), "
        f"(SELECT max(updated_at) FROM {ENTRIES_TABLE}), "
        f"(SELECT count(*) FROM {RECORDS_TABLE}), (SELECT max(id) FROM {RECORDS_TABLE}), "
        f"(SELECT max(updated_at) FROM {RECORDS_TABLE}), {protocol}"
    )


STATE_SQL = state_sql()

_HOLDS_SQL = (
    f"SELECT {', '.join(ALL_FIELDS)}, coalesce(measurement, '') FROM {FINGERPRINTS_TABLE} f "
    "WHERE EXISTS "
    f"(SELECT 1 FROM {ENTRIES_TABLE} e WHERE e.fingerprint_id = f.id)"
)


def _read_only(path: Path, timeout: float) -> sqlite3.Connection:
    return sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=timeout)


def state(path: Path) -> tuple[Any, ...]:
    """``STATE_SQL`` of the SQLite file ``path``; ``sqlite3.Error`` when it cannot be read."""
    conn = _read_only(path, 1.0)
    try:
        return tuple(conn.execute(STATE_SQL).fetchone())
    finally:
        conn.close()


def fingerprints_with_entries(path: Path) -> list[tuple[Any, ...]]:
    """The ``ALL_FIELDS`` values and the measurement (``""``: default) of every fingerprint
    of ``path`` that holds an entry; ``sqlite3.Error`` before ``0010_measurement_fingerprints``
    (the caller then takes the full path)."""
    conn = _read_only(path, 1.0)
    try:
        return conn.execute(_HOLDS_SQL).fetchall()
    finally:
        conn.close()


#: A start counter's column (``0008_start_counts`` adds the three): a file whose
#: ``fingerprints`` lacks it (an older schema, shared with older servers) is marked without them.
COUNTER_COLUMN = "served_starts"


def served_mark_sql(placeholders: int, *, counts: bool) -> str:
    """The served mark's one UPDATE (qmark style; parameters: ``when, stale_before,
    replay_starts, replay_misses, *ids`` with ``counts``, else ``when, stale_before, *ids``).

    ``last_served_at`` is rewritten only where absent or older than ``stale_before``
    (its resolution); the counters, where the table has them, grow at every mark.
    """
    fresh = "CASE WHEN last_served_at IS NULL OR last_served_at < ? THEN ? ELSE last_served_at END"
    sets = f"last_served_at = {fresh}"
    if counts:
        sets += (
            ", served_starts = served_starts + 1, replay_starts = replay_starts + ?, "
            "replay_misses = replay_misses + ?"
        )
    return f"UPDATE {FINGERPRINTS_TABLE} SET {sets} WHERE id IN ({','.join('?' * placeholders)})"


def write_served_marks(
    path: Path,
    ids: list[int],
    when: float,
    stale_before: float,
    timeout: float,
    *,
    replay_misses: int | None = None,
) -> str | None:
    """The served mark of ``ids`` (``served_mark_sql``), in one autocommit UPDATE: a replay
    start (``replay_misses`` not None) also counts itself and its misses.

    On a file without the counters only the time is marked. Waits at most
    ``timeout`` for the lock; returns why it did not write (the ``sqlite3``
    error), None when written.
    """
    conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = NORMAL")  # WAL: no fsync for this small write
        [(check,)] = conn.execute("PRAGMA quick_check(1)").fetchall()
        if check != "ok":  # a damaged file is never written (``ficache.registry``)
            return "the registry is damaged; run `ficache verify`"
        columns = conn.execute(f"PRAGMA table_info({FINGERPRINTS_TABLE})").fetchall()
        counts = any(column[1] == COUNTER_COLUMN for column in columns)
        params: list[Any] = [stale_before, when]
        if counts:
            params += [int(replay_misses is not None), int(replay_misses or 0)]
        conn.execute(served_mark_sql(len(ids), counts=counts), [*params, *ids])
    except (sqlite3.Error, ValueError) as exc:
        return str(exc)
    finally:
        conn.close()
    return None


__all__ = [
    "COUNTER_COLUMN",
    "STATE_SQL",
    "fingerprints_with_entries",
    "served_mark_sql",
    "state",
    "write_served_marks",
]
