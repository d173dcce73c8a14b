"""The commit log, read: the newest commits (``Registry.log``) and the commit a write with a
token made (``Registry.commit_with_token``).

This module owns reading ``commits`` rows: turning them into ``CommitInfo``,
and finding the one commit whose provenance holds a write's token. It does
not own writing commits (``ficache.registry``'s write machinery), what one
commit changed entry by entry (``ficache.history``), connections or error
translation: every function takes an open ``Connection`` from its caller
(``Registry`` opens it and turns a database error into one line).

Invariants:
- Read-only: nothing here writes.
- A token names at most one commit of a kind: a write given a token stores
  it in its commit's provenance (``TOKEN_FIELD``) and looks it up first,
  under the write lock, so a retried write never lands twice
  (``Registry.write(once_token=...)``). ``commit_with_token`` matches the
  token exactly, in the decoded provenance, never as a substring.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial

from sqlalchemy import Connection, func, select

from ficache import schema
from ficache.models import COMMITS as C
from ficache.models import ENTRIES as E
from ficache.models import SHARED_SCOPE
from ficache.values import CommitInfo, WriteResult

#: The provenance field that holds a write's token (the warm start's name for it).
TOKEN_FIELD = "start_token"


@dataclass(frozen=True)
class LogFilter:
    """Which commits ``log`` shows: every condition given must hold.

    ``since``: made at or after this time (epoch seconds); ``kinds`` / ``hosts``:
    one of these (empty: any); ``before``: ids below this one, the next page
    after a page whose oldest commit was ``before``.
    """

    since: float | None = None
    kinds: tuple[str, ...] = ()
    hosts: tuple[str, ...] = ()
    before: int | None = None


def log(
    conn: Connection, limit: int | None, commit_id: int | None, where: LogFilter = LogFilter()
) -> list[CommitInfo]:
    """The newest commits first (at most ``limit``; only ``commit_id`` when given), those
    ``where`` lets through."""
    query = select(*schema.features(conn).columns(C)).order_by(C.c.id.desc())
    if commit_id is not None:
        query = query.where(C.c.id == commit_id)
    if where.since is not None:
        query = query.where(C.c.created_at >= where.since)
    if where.kinds:
        query = query.where(C.c.kind.in_(where.kinds))
    if where.hosts:
        query = query.where(C.c.host.in_(where.hosts))
    if where.before is not None:
        query = query.where(C.c.id < where.before)
    if limit is not None:
        query = query.limit(limit)
    return [
        CommitInfo(
            r.id,
            r.created_at,
            r.kind,
            r.host,
            r.user,
            r.message,
            r.world_size,
            r.layout,
            r.added,
            r.replaced,
            r.removed,
            json.loads(r.provenance) if r.provenance else {},
            r.reverts_commit_id,
            r.records_added,
            r.records_replaced,
            r.records_removed,
            r.protocol_added,
            r.protocol_replaced,
            r.protocol_removed,
        )
        for r in conn.execute(query)
    ]


def commit_with_token(conn: Connection, token: str, kind: str) -> WriteResult | None:
    """The commit of ``kind`` whose provenance holds ``token``, as its write's result, or None.

    The counts come from the commit row; ``shared_written`` counts the shared
    entries that commit still holds; ``kept`` is not stored (reported 0).
    """
    column = partial(schema.features(conn).column, C)
    rows = conn.execute(
        select(
            C.c.id,
            C.c.provenance,
            C.c.added,
            C.c.replaced,
            C.c.records_added,
            C.c.records_replaced,
            column("protocol_added"),
            column("protocol_replaced"),
        ).where(C.c.kind == kind, C.c.provenance.contains(token))
    ).all()
    for (
        commit_id,
        provenance,
        added,
        replaced,
        records_added,
        records_replaced,
        protocol_added,
        protocol_replaced,
    ) in rows:
        if json.loads(provenance or "{}").get(TOKEN_FIELD) != token:
            continue
        shared = conn.execute(
            select(func.count())
            .select_from(E)
            .where(E.c.commit_id == commit_id, E.c.scope == SHARED_SCOPE)
        ).scalar_one()
        return WriteResult(
            commit_id,
            added=added,
            replaced=replaced,
            shared_written=int(shared),
            records_added=records_added,
            records_replaced=records_replaced,
            protocol_added=protocol_added,
            protocol_replaced=protocol_replaced,
        )
    return None
