"""Reading a kind's stored rows back, written once over its ``Kind``.

Records and protocol records (and any later kind whose description names a
``stored_row`` and a ``change_row``) are read by these functions, each
taking the ``Kind``; no kind has a copy of them:
- ``stored_rows``: the current rows, filtered, as the kind's ``stored_row``;
  ``list_stored`` the same on a registry, its database errors as one line
  (what ``ficache list --records`` / ``--protocol-records`` show);
- ``slice_values``: ``{namespace: {key: value}}`` one rank loads or publishes;
- ``namespace_counts``: rows per (fingerprint, namespace) (``stats``);
- ``stored_items``: the current rows as the kind's writer's items
  (``Kind.make_item``), as bundles and merges copy them;
- ``changes_of``: what one commit did to the kind, as its ``change_row``
  (``ficache.history``).

Entries keep their own readers (``ficache.stored_entries``: parsed keys,
ops, the start's bulk path). Writing is ``ficache.kind_store``'s.

Invariants:
- Read only: nothing here writes or commits.
- Current rows come in identity order (fingerprint id, scope, then the
  kind's identity columns), a commit's changes in identity then id order
  (``kind_store.commit_changes``); policies always as canonical JSON text.
- A slice overlays fingerprints and scopes as ``Registry.slice_rows`` does
  for entries: an earlier fingerprint wins over a later one, a later scope
  in ``scopes`` over an earlier one, key by key within a namespace.
- ``slice_values``, ``namespace_counts`` and the ``namespace`` filter take a
  namespaced kind: identity ``(namespace, key)`` and a ``value`` column.
- A kind whose tables the registry's schema lacks (an older revision,
  ``schema.SchemaFeatures``) reads as holding nothing (``present``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from sqlalchemy import Connection, Engine, Select, func, select
from sqlalchemy.exc import DatabaseError

from ficache import schema
from ficache.fingerprint import Fingerprint
from ficache.kind_store import changed_values, commit_changes, present
from ficache.kinds import Kind
from ficache.models import policy_text

__all__ = [
    "NamespaceMap",
    "changes_of",
    "list_stored",
    "namespace_counts",
    "present",
    "slice_values",
    "stored_items",
    "stored_rows",
]

#: ``{namespace: {key: canonical JSON value}}``: what one rank loads or publishes.
NamespaceMap = dict[str, dict[str, str]]


class _Readable(Protocol):
    """What ``list_stored`` needs of a ``Registry``: where it is and its engine."""

    location: schema.Location
    engine: Engine


def _rows_query(
    kind: Kind,
    *,
    with_commit: bool,
    fingerprint_ids: Sequence[int] | None = None,
    scope: str | None = None,
    namespace: str | None = None,
) -> Select[Any]:
    """``(fingerprint_id, scope, *identity, *values[, commit_id], *carried)`` of ``kind``'s
    current rows matching the filters given, policies as text, in identity order."""
    c = kind.rows.c
    identity = [c[name] for name in kind.identity_columns]
    values = [policy_text(c[n]) if n in kind.policy_columns else c[n] for n in kind.values]
    commit = [c.commit_id] if with_commit else []
    query = select(*identity, *values, *commit, *(c[n] for n in kind.carried))
    if fingerprint_ids is not None:
        query = query.where(c.fingerprint_id.in_(list(fingerprint_ids)))
    if scope is not None:
        query = query.where(c.scope == scope)
    if namespace is not None:
        query = query.where(_namespaced(kind).namespace == namespace)
    return query.order_by(*identity)


def _namespaced(kind: Kind) -> Any:
    """``kind``'s row columns, after checking that it is namespaced (see the module docstring)."""
    if kind.identity != ("namespace", "key") or "value" not in kind.values:
        raise TypeError(f"{kind.plural} are not namespaced (namespace, key) -> value")
    return kind.rows.c


def _row_type(kind: Kind, row_type: type | None) -> type:
    if row_type is None:
        raise TypeError(f"{kind.plural} are read by their own readers, not by ficache.kind_read")
    return row_type


def stored_rows(
    conn: Connection,
    kind: Kind,
    *,
    fingerprint_ids: Sequence[int] | None = None,
    scope: str | None = None,
    namespace: str | None = None,
    limit: int | None = None,
) -> Iterator[Any]:
    """``kind``'s current rows matching every filter given, as its ``stored_row``, in
    identity order (at most ``limit``)."""
    make = _row_type(kind, kind.stored_row)
    query = _rows_query(
        kind, with_commit=True, fingerprint_ids=fingerprint_ids, scope=scope, namespace=namespace
    )
    if limit is not None:
        query = query.limit(limit)
    if not present(conn, kind):
        return
    for row in conn.execute(query):
        yield make(*row)


def list_stored(registry: _Readable, kind: Kind, **filters: Any) -> list[Any]:
    """``stored_rows`` of ``registry`` (a ``Registry``) with ``stored_rows``' filters
    (``fingerprint_ids``, ``scope``, ``namespace``, ``limit``), a database error as
    ficache's one line."""
    try:
        with registry.engine.connect() as conn:
            return list(stored_rows(conn, kind, **filters))
    except DatabaseError as exc:
        raise schema.translate_operational_error(
            exc, registry.location, engine=registry.engine
        ) from None


def slice_values(
    conn: Connection, kind: Kind, fingerprint_ids: Sequence[int], scopes: Sequence[str]
) -> NamespaceMap:
    """``{namespace: {key: value}}`` of ``kind`` as one rank loads it: the rows of
    ``scopes`` of ``fingerprint_ids``, overlaid as the module docstring says."""
    c = _namespaced(kind)
    out: NamespaceMap = {}
    if not present(conn, kind):
        return out
    for fid in reversed(list(fingerprint_ids)):
        for scope in scopes:
            rows = conn.execute(
                select(c.namespace, c.key, c.value).where(c.fingerprint_id == fid, c.scope == scope)
            )
            for ns, key, value in rows:
                out.setdefault(ns, {})[key] = value
    return out


def namespace_counts(conn: Connection, kind: Kind) -> tuple[tuple[int, str, int], ...]:
    """``(fingerprint id, namespace, rows)`` of ``kind``, every stored namespace, in order."""
    c = _namespaced(kind)
    if not present(conn, kind):
        return ()
    rows = conn.execute(
        select(c.fingerprint_id, c.namespace, func.count())
        .group_by(c.fingerprint_id, c.namespace)
        .order_by(c.fingerprint_id, c.namespace)
    )
    return tuple((int(fid), ns, int(n)) for fid, ns, n in rows)


def stored_items(
    conn: Connection,
    kind: Kind,
    fingerprints: Mapping[int, Fingerprint],
    fingerprint_ids: Sequence[int] | None = None,
) -> list[Any]:
    """``kind``'s current rows (of ``fingerprint_ids``; None: all) as its writer's items, with
    their values, policies and ``tuned_at``, in identity order: what a bundle or a merge
    copies. ``fingerprints`` maps every fingerprint id read to its ``Fingerprint``."""
    n_identity, n_values = len(kind.identity), len(kind.values)
    query = _rows_query(kind, with_commit=False, fingerprint_ids=fingerprint_ids)
    items: list[Any] = []
    if not present(conn, kind):
        return items
    for row in conn.execute(query):
        fid, scope, *rest = row
        identity = tuple(rest[:n_identity])
        value = tuple(rest[n_identity : n_identity + n_values])
        carried = tuple(rest[n_identity + n_values :])
        items.append(kind.make_item(fingerprints[fid], scope, identity, value, carried))
    return items


def changes_of(conn: Connection, kind: Kind, commit_id: int) -> tuple[Any, ...]:
    """What commit ``commit_id`` did to ``kind``, as its ``change_row``s, by identity."""
    make = _row_type(kind, kind.change_row)
    if not present(conn, kind):
        return ()
    return tuple(
        make(
            change.action,
            change.fingerprint_id,
            change.scope,
            *(getattr(change, name) for name in kind.identity),
            *changed_values(kind, change),
            change.old_commit_id,
        )
        for change in commit_changes(conn, kind, commit_id)
    )
