"""A registry's totals (``Registry.stats``, ``ficache stats``).

This module owns counting what a registry holds: fingerprints, entries
(shared and scoped), commits, ops, record namespaces, the schema revision and
the size on disk or on the server. It does not own the rows themselves
(``ficache.stored_fingerprints``, ``ficache.stored_entries``,
``ficache.kind_read``), connections or error translation: ``stats`` takes an
open ``Connection`` from ``Registry``.

Invariants:
- Read-only: nothing here writes.
- ``entries == shared_entries + scoped_entries``; a SQLite registry's size
  counts its WAL file too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import Connection, case, func, select
from sqlalchemy import text as sql_text

from ficache import schema
from ficache.kind_read import namespace_counts
from ficache.kinds import PROTOCOL_KIND, RECORD_KIND
from ficache.models import COMMITS as C
from ficache.models import ENTRIES as E
from ficache.models import FINGERPRINTS as F
from ficache.models import SHARED_SCOPE


@dataclass(frozen=True)
class Stats:
    fingerprints: int
    entries: int
    shared_entries: int
    scoped_entries: int
    commits: int
    ops: tuple[tuple[str, int], ...]
    last_commit_at: float | None
    revision: str | None
    location: str
    size_bytes: int | None
    #: ``(fingerprint id, last served at)``; None: never served by a warm start.
    last_served: tuple[tuple[int, float | None], ...] = ()
    records: int = 0
    #: ``(fingerprint id, namespace, records)`` of every stored record namespace.
    record_namespaces: tuple[tuple[int, str, int], ...] = ()
    #: ``(fingerprint id, starts served, replay starts, keys those replay starts missed)``
    #: (``ficache.usage``: counted by the served mark, a lower bound).
    start_counts: tuple[tuple[int, int, int, int], ...] = ()
    #: ``(fingerprint id, namespace, protocol records)`` of every stored protocol namespace.
    protocol_namespaces: tuple[tuple[int, str, int], ...] = ()

    @property
    def protocol_records(self) -> int:
        return sum(n for _fid, _ns, n in self.protocol_namespaces)

    def as_json(self) -> dict[str, Any]:
        """Every field; the protocol records' only when the registry holds some."""
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        del data["protocol_namespaces"]
        if self.protocol_namespaces:
            data["protocol_records"] = self.protocol_records
            data["protocol_namespaces"] = [
                {"fingerprint": fid, "namespace": ns, "protocol_records": n}
                for fid, ns, n in self.protocol_namespaces
            ]
        data["ops"] = dict(self.ops)
        data["last_served"] = {str(fid): served for fid, served in self.last_served}
        data["start_counts"] = {
            str(fid): {"served_starts": n, "replay_starts": replays, "replay_misses": misses}
            for fid, n, replays, misses in self.start_counts
        }
        data["record_namespaces"] = [
            {"fingerprint": fid, "namespace": ns, "records": n}
            for fid, ns, n in self.record_namespaces
        ]
        return data


def stats(conn: Connection, location: schema.Location) -> Stats:
    """The totals of the registry ``conn`` reads, which lives at ``location``."""
    n_fp = conn.execute(select(func.count()).select_from(F)).scalar_one()
    # Counted with CASE: PostgreSQL will not group by an expression
    # holding a bound parameter (each use binds a parameter of its own).
    n_entries, n_shared = conn.execute(
        select(
            func.count(),
            func.coalesce(func.sum(case((E.c.scope == SHARED_SCOPE, 1), else_=0)), 0),
        ).select_from(E)
    ).one()
    column = partial(schema.features(conn).column, F)
    served_rows = conn.execute(
        select(
            F.c.id,
            F.c.last_served_at,
            column("served_starts"),
            column("replay_starts"),
            column("replay_misses"),
        ).order_by(F.c.id)
    ).all()
    last_served = tuple((int(row.id), row.last_served_at) for row in served_rows)
    start_counts = tuple(
        (int(row.id), int(row.served_starts), int(row.replay_starts), int(row.replay_misses))
        for row in served_rows
    )
    ops = tuple(
        (op, n)
        for op, n in conn.execute(
            select(E.c.op, func.count()).group_by(E.c.op).order_by(func.count().desc(), E.c.op)
        )
    )
    n_commits, last = conn.execute(select(func.count(), func.max(C.c.created_at))).one()
    record_namespaces = namespace_counts(conn, RECORD_KIND)
    shared = int(n_shared)
    scoped = int(n_entries) - shared
    return Stats(
        n_fp,
        shared + scoped,
        shared,
        scoped,
        n_commits,
        ops,
        last,
        schema.current_revision(conn),
        location.display,
        _size_bytes(conn, location),
        last_served,
        sum(n for _fid, _ns, n in record_namespaces),
        record_namespaces,
        start_counts,
        namespace_counts(conn, PROTOCOL_KIND),
    )


def _size_bytes(conn: Connection, location: schema.Location) -> int | None:
    """The SQLite file's size with its WAL, or the PostgreSQL database's; else None."""
    path = location.path
    if path is not None and path.exists():
        wal = path.with_name(path.name + "-wal")
        return sum(p.stat().st_size for p in (path, wal) if p.exists())
    if conn.dialect.name == "postgresql":
        return int(
            conn.execute(sql_text("SELECT pg_database_size(current_database())")).scalar_one()
        )
    return None
