"""Stored entries, read: listing them (``Registry.entries``), one rank's slice of them
(``slice_rows``) and their values as copies take them (``entry_values``).

This module owns the read queries over ``entries`` (the records beside them are
``ficache.kind_read``'s, as every kind's). It does not own writing
entries (the registry's write machinery), rendering a slice as a FlashInfer
file (``ficache.file_export``, ``ficache.slices``), connections or error
translation: every function takes an open ``Connection`` from ``Registry``.

Invariants:
- Read-only: nothing here writes.
- A slice layers its inputs: an earlier fingerprint wins over a later one, a
  later scope over an earlier one; each (fingerprint, scope) is one indexed
  range, read weakest first so a stronger row overwrites a weaker one.
- Stored keys and JSON fragments are handed back verbatim; a key that does
  not parse (a damaged registry: ``ficache verify`` names it) is listed with
  ``null`` shapes rather than failing the listing.
- Listings are ordered by fingerprint id, scope, key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select

from ficache.flashinfer_format import parse_key
from ficache.models import ENTRIES as E
from ficache.models import ENTRY_POLICY, ENTRY_VALUE_COLUMNS
from ficache.models import FINGERPRINTS as F

#: ``key -> (key, runner, tactic, policy, selection)``: one rank's slice of entries.
SliceRows = dict[str, tuple[str, str, str, str | None, str | None]]
#: ``(fingerprint_id, scope, key, runner, tactic, policy, tuned_at, selection)``.
EntryValue = tuple[int, str, str, str, str, str | None, float, str | None]


@dataclass(frozen=True)
class StoredEntry:
    fingerprint_id: int
    scope: str
    key: str
    op: str
    runner: str
    shapes: str
    extras: str
    tactic_json: str
    policy_json: str | None
    commit_id: int
    updated_at: float
    selection_json: str | None = None  # how FlashInfer chose the value, when known

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint_id,
            "scope": self.scope,
            "op": self.op,
            "runner": self.runner,
            "shapes": json.loads(self.shapes),
            "extras": self.extras,
            "key": self.key,
            "tactic": json.loads(self.tactic_json),
            "policy": json.loads(self.policy_json) if self.policy_json is not None else None,
            "commit": self.commit_id,
            "updated_at": self.updated_at,
            "selection": (
                json.loads(self.selection_json) if self.selection_json is not None else None
            ),
        }


def _shapes_and_extras(key: str) -> tuple[str, str]:
    """A stored key's shapes (JSON) and extras, as ``list`` shows them; a key
    that does not parse shows ``null`` shapes and no extras."""
    try:
        fields = parse_key(key)
    except ValueError:
        return "null", ""
    return fields.shapes_json, fields.extras


def entries(
    conn: Connection,
    *,
    fingerprint_ids: Sequence[int] | None = None,
    op: str | None = None,
    gpu: str | None = None,
    flashinfer_version: str | None = None,
    scope: str | None = None,
    limit: int | None = None,
) -> Iterator[StoredEntry]:
    """The stored entries matching every filter given, one at a time."""
    query = select(
        E.c.fingerprint_id,
        E.c.scope,
        E.c.key,
        E.c.op,
        E.c.runner,
        E.c.tactic,
        ENTRY_POLICY,
        E.c.commit_id,
        E.c.updated_at,
        E.c.selection,
    )
    if gpu is not None or flashinfer_version is not None:
        query = query.join(F, F.c.id == E.c.fingerprint_id)
        if gpu is not None:
            query = query.where(F.c.gpu == gpu)
        if flashinfer_version is not None:
            query = query.where(F.c.flashinfer_version == flashinfer_version)
    if fingerprint_ids is not None:
        query = query.where(E.c.fingerprint_id.in_(list(fingerprint_ids)))
    if op is not None:
        query = query.where(E.c.op == op)
    if scope is not None:
        query = query.where(E.c.scope == scope)
    query = query.order_by(E.c.fingerprint_id, E.c.scope, E.c.key)
    if limit is not None:
        query = query.limit(limit)
    for fid, sc, key, op_, runner, tactic, pol, cid, updated, sel in conn.execute(query):
        shapes, extras = _shapes_and_extras(key)
        yield StoredEntry(fid, sc, key, op_, runner, shapes, extras, tactic, pol, cid, updated, sel)


def slice_rows(
    conn: Connection, fingerprint_ids: Sequence[int], scopes: Sequence[str]
) -> SliceRows:
    """``key -> (key, runner, tactic, policy, selection)`` as one rank should load it."""
    result: SliceRows = {}
    for fid in reversed(list(fingerprint_ids)):
        for scope in scopes:
            rows = conn.execute(
                select(E.c.key, E.c.runner, E.c.tactic, ENTRY_POLICY, E.c.selection).where(
                    E.c.fingerprint_id == fid, E.c.scope == scope
                )
            )
            result.update({row[0]: row for row in rows})
    return result


def entry_values(conn: Connection, fingerprint_ids: Sequence[int]) -> list[EntryValue]:
    """Every entry of ``fingerprint_ids`` with when it was tuned and how it was chosen, as
    bundles and merges copy it (``tuned_at`` falls back to ``updated_at``)."""
    query = (
        select(*ENTRY_VALUE_COLUMNS)
        .where(E.c.fingerprint_id.in_(list(fingerprint_ids)))
        .order_by(E.c.fingerprint_id, E.c.scope, E.c.key)
    )
    return [tuple(row) for row in conn.execute(query)]
