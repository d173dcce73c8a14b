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
- Listings are ordered by fingerprint id, scope, op and runner, then by shapes
  compared as numbers (``(128, 64)`` before ``(1024, 64)``); only one run of one
  runner's rows is held at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
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


def ops_matching(conn: Connection, text: str) -> tuple[list[str], list[str]]:
    """``(ops, suggestions)`` for ``list --op TEXT``: the stored op named exactly, else every
    stored op containing ``TEXT`` (case-insensitive); when none, up to three stored ops
    that look like it."""
    import difflib

    text.encode("utf-8")  # a name SQLite could not hold is refused as a query of it would be
    stored = sorted(op for (op,) in conn.execute(select(E.c.op).distinct()) if op is not None)
    if text in stored:
        return [text], []
    found = [op for op in stored if text.lower() in op.lower()]
    if found:
        return found, []
    return [], difflib.get_close_matches(text, stored, n=3, cutoff=0.5)


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
    ops: Sequence[str] | None = None,
    gpu: str | None = None,
    flashinfer_version: str | None = None,
    scope: str | None = None,
    limit: int | None = None,
) -> Iterator[StoredEntry]:
    """The stored entries matching every filter given (``ops``: of one of these ops), one
    at a time: by fingerprint, scope, op and runner, then shapes as numbers."""
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
    if ops is not None:
        query = query.where(E.c.op.in_(list(ops)))
    if scope is not None:
        query = query.where(E.c.scope == scope)
    query = query.order_by(E.c.fingerprint_id, E.c.scope, E.c.key)
    listed = 0
    for group in _runs_of_one_runner(conn.execute(query)):
        for entry in sorted(group, key=_shape_order):
            if limit is not None and listed >= limit:
                return
            listed += 1
            yield entry


def _runs_of_one_runner(rows: Iterable[Any]) -> Iterator[list[StoredEntry]]:
    """``rows`` (ordered by fingerprint, scope, key) as runs of one fingerprint, scope, op
    and runner: a key's text starts with its op and runner, so each run is contiguous."""
    run: list[StoredEntry] = []
    for fid, sc, key, op_, runner, tactic, pol, cid, updated, sel in rows:
        shapes, extras = _shapes_and_extras(key)
        entry = StoredEntry(
            fid, sc, key, op_, runner, shapes, extras, tactic, pol, cid, updated, sel
        )
        if run and (run[0].fingerprint_id, run[0].scope, run[0].op, run[0].runner) != (
            fid,
            sc,
            op_,
            runner,
        ):
            yield run
            run = []
        run.append(entry)
    if run:
        yield run


def _shape_order(entry: StoredEntry) -> tuple[Any, ...]:
    """Shapes compared as numbers (``(128, 64)`` before ``(1024, 64)``), then extras; a
    value that is no number sorts after the numbers, as text."""

    def numeric(value: Any) -> Any:
        if isinstance(value, list):
            return (1, tuple(numeric(v) for v in value))
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return (0, value)
        return (2, str(value))

    try:
        shapes = json.loads(entry.shapes)
    except ValueError:
        shapes = None
    return (numeric(shapes) if shapes is not None else (3,), entry.extras, entry.key)


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
