"""FlashInfer's namespaced records in the registry: storage, history, reads.

A FlashInfer cache file may hold, besides tactics, ``"_records": {namespace:
{record key: JSON value}}`` (``AutoTuner.publish_namespaced_records`` /
``get_namespaced_records``; FlashInfer's fused-MoE dynamic-allocation runtime
keeps its tuned plans in namespace ``trtllm_moe_da``). They are tuning
results too, and ficache keeps them like entries: one ``records`` row per
(fingerprint, scope, namespace, record key), the value as canonical JSON
text (``flashinfer_format.record_value_json``), and one ``record_changes``
row per change (``ficache.models``).

Invariants:
- Records are written only inside ``Registry.write``'s transaction
  (``stage`` then ``apply``), so a write that changes records is one commit
  with its provenance, the same commit as the entries it writes with them;
  the commit counts its record changes (``records_added``,
  ``records_replaced``, ``records_removed``). A write that changes neither
  entries nor records makes no commit. ``Registry.revert`` undoes a commit's
  record changes with its entry changes, as one ``Registry.write``
  (``ficache.revert``), and refuses when a later commit changed one of its
  records. A prune removes the records its criteria match in the prune's
  one commit (``prune_candidates``, ``stage_planned_removals``; see
  ``Registry.plan_prune``), as ``removed`` record changes a revert restores.
- A record equal to the stored one (same canonical JSON) is unchanged, not
  replaced; ``keep_existing`` keeps a stored value that differs; ``expected``
  commit ids are checked under the write lock, as for entries.
- Scopes are the entries' (``shared`` or ``<layout>/rank<N>``). A rank's
  records are the shared ones overlaid, key by key within a namespace, by
  its own scope's (``slice_records``); earlier fingerprints win, as in
  ``Registry.slice_rows``.
- Every value is validated before the transaction: canonical JSON of a value
  JSON carries exactly, at most ``MAX_RECORD_DEPTH`` deep; namespaces as
  FlashInfer demands. A bad record raises ``RecordError`` and nothing is
  written.

It does not merge or verify records: ``ficache.merge`` plans their merges
with the entries' (``ficache.kind_merge``, one machinery for both kinds), and
``ficache.verify`` replays their change log as it replays the entries'.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, insert, select, update
from sqlalchemy.exc import DatabaseError

from ficache.errors import RecordError, StalePlanError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import (
    MAX_RECORD_DEPTH,
    check_namespace,
    record_value_json,
)
from ficache.models import FINGERPRINTS as F
from ficache.models import RECORD_CHANGES as RH
from ficache.models import RECORDS as R
from ficache.values import NewRecord, RecordIdentity, validate_scope

__all__ = [
    "MAX_RECORD_DEPTH",
    "NewRecord",
    "RecordChange",
    "RecordIdentity",
    "RecordWrite",
    "StoredRecord",
    "canonical_value",
]

#: ``{namespace: {record key: canonical JSON}}``: what one rank loads.
RecordMap = dict[str, dict[str, str]]


def canonical_value(value_json: str) -> str:
    """``value_json`` checked to be a record value's canonical JSON; ``RecordError`` if not."""
    try:
        text = record_value_json(json.loads(value_json))
    except (ValueError, RecursionError, TypeError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        raise RecordError(f"record value {str(value_json)[:80]!r} refused: {detail}") from None
    if text != value_json:
        raise RecordError(f"record value {value_json[:80]!r} is not canonical JSON")
    return text


@dataclass(frozen=True)
class RecordWrite:
    """What one ``Registry.write`` does to records: store, remove, expect."""

    records: tuple[NewRecord, ...] = ()
    removals: tuple[RecordIdentity, ...] = ()
    #: (identity, commit id that must hold it now, or None: absent).
    expected: tuple[tuple[RecordIdentity, int | None], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.records and not self.removals

    def validate(self) -> None:
        """Check scopes, namespaces and values; ``RecordError`` for the first bad one."""
        seen: set[RecordIdentity] = set()
        for r in self.records:
            try:
                validate_scope(r.scope)
                check_namespace(r.namespace)
            except ValueError as exc:
                raise RecordError(f"record {r.key[:80]!r} refused: {exc}") from None
            if not isinstance(r.key, str) or not r.key:
                raise RecordError(f"a record key of namespace {r.namespace!r} is empty")
            canonical_value(r.value_json)
            seen.add(r.identity)
        for ident in self.removals:
            if ident in seen:
                raise ValueError(f"record {ident[3][:80]!r} is both written and removed")


def records_of_file(
    fingerprint: Fingerprint,
    rows: Iterable[tuple[str, str, str]],
    scope: str,
    tuned_at: float | None = None,
) -> list[NewRecord]:
    """``NewRecord`` of a parsed file's ``CacheFile.record_rows``."""
    return [NewRecord(fingerprint, ns, key, value, scope, tuned_at) for ns, key, value in rows]


def records_of_map(
    fingerprint: Fingerprint, by_ns: Mapping[str, Mapping[str, Any]], scope: str
) -> list[NewRecord]:
    """``NewRecord`` of parsed ``{namespace: {key: value}}``; ``ValueError`` for a bad one."""
    out = []
    for ns, by_key in sorted(by_ns.items()):
        check_namespace(ns)
        for key, value in sorted(by_key.items()):
            out.append(NewRecord(fingerprint, ns, key, record_value_json(value), scope))
    return out


# --------------------------------------------------------------------------
# Writing (inside Registry.write's transaction).

#: A stored record's state: (row id, value, commit id, tuned_at).
_Old = tuple[int, str, int, float]


@dataclass
class StagedRecords:
    """What a write will do to records, decided under the write lock."""

    added: list[tuple[int, NewRecord]] = field(default_factory=list)  # (fingerprint id, record)
    replaced: list[tuple[int, NewRecord, _Old]] = field(default_factory=list)
    removed: list[tuple[int, str, str, str, _Old]] = field(default_factory=list)
    unchanged: int = 0
    kept: int = 0

    @property
    def changed(self) -> int:
        return len(self.added) + len(self.replaced) + len(self.removed)


def _current(conn: Connection, fid: int, scopes: Iterable[str]) -> dict[tuple[str, str, str], _Old]:
    rows = conn.execute(
        select(
            R.c.scope, R.c.namespace, R.c.key, R.c.id, R.c.value, R.c.commit_id, R.c.tuned_at
        ).where(R.c.fingerprint_id == fid, R.c.scope.in_(sorted(set(scopes))))
    )
    return {
        (scope, ns, key): (rid, value, cid, tuned)
        for scope, ns, key, rid, value, cid, tuned in rows
    }


def stage(
    conn: Connection,
    write: RecordWrite,
    fingerprint_id: Callable[[Fingerprint, bool], int | None],
    *,
    keep_existing: bool,
) -> StagedRecords:
    """Compare ``write`` with the stored records; raise ``ConflictError`` on a stale plan.

    ``fingerprint_id(fp, create)`` is the write's lookup of a fingerprint row
    (creating it when ``create``; None when absent and not created).
    """
    staged = StagedRecords()
    if write.is_empty:
        return staged
    wanted: dict[tuple[int, str, str, str], NewRecord] = {}
    for r in write.records:
        fid = fingerprint_id(r.fingerprint, True)
        assert fid is not None
        wanted[(fid, r.scope, r.namespace, r.key)] = r  # a later duplicate wins
    removals: list[tuple[int, str, str, str]] = []
    for fp, scope, ns, key in write.removals:
        fid = fingerprint_id(fp, False)
        if fid is not None:
            removals.append((fid, scope, ns, key))
    scopes: dict[int, set[str]] = {}
    for fid, scope, _ns, _key in [*wanted, *removals]:
        scopes.setdefault(fid, set()).add(scope)
    current: dict[tuple[int, str, str, str], _Old] = {}
    for fid, fid_scopes in scopes.items():
        for (scope, ns, key), row in _current(conn, fid, fid_scopes).items():
            current[(fid, scope, ns, key)] = row
    if write.expected:
        stale = 0
        for (fp, scope, ns, key), commit in write.expected:
            fid = fingerprint_id(fp, False)
            now_row = current.get((fid, scope, ns, key)) if fid is not None else None
            stale += (now_row[2] if now_row is not None else None) != commit
        if stale:
            raise StalePlanError(
                f"{stale} of {len(write.expected)} records changed since the plan was made; "
                "nothing written, run the command again"
            )
    for ident, r in sorted(wanted.items(), key=lambda item: item[0]):
        old = current.get(ident)
        if old is None:
            staged.added.append((ident[0], r))
        elif old[1] == r.value_json:
            staged.unchanged += 1
        elif keep_existing:
            staged.kept += 1
        else:
            staged.replaced.append((ident[0], r, old))
    for ident in sorted(set(removals)):
        old = current.get(ident)
        if old is not None:
            staged.removed.append((*ident, old))
    return staged


def apply(conn: Connection, commit_id: int, staged: StagedRecords, now: float) -> None:
    """Write ``staged`` as part of commit ``commit_id`` (its rows and change rows)."""
    if staged.added:
        conn.execute(
            insert(R),
            [
                {
                    "fingerprint_id": fid,
                    "scope": r.scope,
                    "namespace": r.namespace,
                    "key": r.key,
                    "value": r.value_json,
                    "commit_id": commit_id,
                    "updated_at": now,
                    "tuned_at": r.tuned_at if r.tuned_at is not None else now,
                }
                for fid, r in staged.added
            ],
        )
    if staged.replaced:
        conn.execute(
            update(R)
            .where(R.c.id == bindparam("b_id"))
            .values(
                value=bindparam("b_value"),
                commit_id=bindparam("b_commit"),
                updated_at=bindparam("b_now"),
                tuned_at=bindparam("b_tuned"),
            ),
            [
                {
                    "b_id": old[0],
                    "b_value": r.value_json,
                    "b_commit": commit_id,
                    "b_now": now,
                    "b_tuned": r.tuned_at if r.tuned_at is not None else now,
                }
                for _fid, r, old in staged.replaced
            ],
        )
    for chunk_start in range(0, len(staged.removed), 500):
        ids = [old[0] for *_ident, old in staged.removed[chunk_start : chunk_start + 500]]
        conn.execute(delete(R).where(R.c.id.in_(ids)))
    changes = [
        _change(commit_id, fid, r.scope, r.namespace, r.key, "added", None, r.value_json)
        for fid, r in staged.added
    ]
    changes += [
        _change(commit_id, fid, r.scope, r.namespace, r.key, "replaced", old, r.value_json)
        for fid, r, old in staged.replaced
    ]
    changes += [
        _change(commit_id, fid, scope, ns, key, "removed", old, None)
        for fid, scope, ns, key, old in staged.removed
    ]
    if changes:
        conn.execute(insert(RH), changes)


def _change(
    commit_id: int,
    fid: int,
    scope: str,
    ns: str,
    key: str,
    action: str,
    old: _Old | None,
    new_value: str | None,
) -> dict[str, Any]:
    return {
        "commit_id": commit_id,
        "fingerprint_id": fid,
        "scope": scope,
        "namespace": ns,
        "key": key,
        "action": action,
        "old_value": old[1] if old is not None else None,
        "old_commit_id": old[2] if old is not None else None,
        "old_tuned_at": old[3] if old is not None else None,
        "new_value": new_value,
    }


# --------------------------------------------------------------------------
# Prune (``Registry.plan_prune`` and its execution).


def prune_candidates(
    conn: Connection, conditions: Iterable[Callable[[Any], Any]]
) -> list[tuple[int, int, int, str, str, str]]:
    """``(record id, commit id, fingerprint id, scope, gpu, flashinfer version)`` of the
    records matching every condition (each a function of a table with ``fingerprint_id``,
    ``scope`` and ``updated_at`` columns, joined with its fingerprint), in id order."""
    query = (
        select(
            R.c.id, R.c.commit_id, R.c.fingerprint_id, R.c.scope, F.c.gpu, F.c.flashinfer_version
        )
        .join(F, F.c.id == R.c.fingerprint_id)
        .where(*(condition(R) for condition in conditions))
        .order_by(R.c.id)
    )
    return [tuple(row) for row in conn.execute(query)]


def stage_planned_removals(conn: Connection, versions: Sequence[tuple[int, int]]) -> StagedRecords:
    """The planned ``(record id, commit id)`` still as planned, staged for removal.

    A record that changed (another commit) or went since the plan was made is
    left out; the caller compares the count with the plan's.
    """
    staged = StagedRecords()
    for start in range(0, len(versions), 500):
        expected = dict(versions[start : start + 500])
        rows = conn.execute(
            select(
                R.c.id,
                R.c.fingerprint_id,
                R.c.scope,
                R.c.namespace,
                R.c.key,
                R.c.value,
                R.c.commit_id,
                R.c.tuned_at,
            ).where(R.c.id.in_(list(expected)))
        )
        for rid, fid, scope, ns, key, value, cid, tuned in rows:
            if expected.get(rid) == cid:
                staged.removed.append((fid, scope, ns, key, (rid, value, cid, tuned)))
    staged.removed.sort(key=lambda item: item[:4])
    return staged


# --------------------------------------------------------------------------
# Reading.


@dataclass(frozen=True)
class StoredRecord:
    fingerprint_id: int
    scope: str
    namespace: str
    key: str
    value_json: str
    commit_id: int
    tuned_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint_id,
            "scope": self.scope,
            "namespace": self.namespace,
            "key": self.key,
            "value": json.loads(self.value_json),
            "commit": self.commit_id,
            "tuned_at": self.tuned_at,
        }


def stored_records(
    conn: Connection,
    *,
    fingerprint_ids: Sequence[int] | None = None,
    scope: str | None = None,
    namespace: str | None = None,
    limit: int | None = None,
) -> Iterator[StoredRecord]:
    query = select(
        R.c.fingerprint_id,
        R.c.scope,
        R.c.namespace,
        R.c.key,
        R.c.value,
        R.c.commit_id,
        R.c.tuned_at,
    )
    if fingerprint_ids is not None:
        query = query.where(R.c.fingerprint_id.in_(list(fingerprint_ids)))
    if scope is not None:
        query = query.where(R.c.scope == scope)
    if namespace is not None:
        query = query.where(R.c.namespace == namespace)
    query = query.order_by(R.c.fingerprint_id, R.c.scope, R.c.namespace, R.c.key)
    if limit is not None:
        query = query.limit(limit)
    for row in conn.execute(query):
        yield StoredRecord(*row)


def list_records(
    registry: Any,
    *,
    fingerprint_ids: Sequence[int] | None = None,
    scope: str | None = None,
    namespace: str | None = None,
    limit: int | None = None,
) -> list[StoredRecord]:
    """Stored records of ``registry`` (a ``Registry``), in (fingerprint, scope, namespace, key) order."""
    from ficache import schema

    try:
        with registry.engine.connect() as conn:
            return list(
                stored_records(
                    conn,
                    fingerprint_ids=fingerprint_ids,
                    scope=scope,
                    namespace=namespace,
                    limit=limit,
                )
            )
    except DatabaseError as exc:
        raise schema.translate_operational_error(
            exc, registry.location, engine=registry.engine
        ) from None


def slice_records(
    conn: Connection, fingerprint_ids: Sequence[int], scopes: Sequence[str]
) -> RecordMap:
    """``{namespace: {key: value}}`` as one rank loads it (see the module docstring)."""
    out: RecordMap = {}
    for fid in reversed(list(fingerprint_ids)):
        for scope in scopes:
            rows = conn.execute(
                select(R.c.namespace, R.c.key, R.c.value).where(
                    R.c.fingerprint_id == fid, R.c.scope == scope
                )
            )
            for ns, key, value in rows:
                out.setdefault(ns, {})[key] = value
    return out


def scopes_holding_records(conn: Connection, fingerprint_ids: Sequence[int]) -> set[str]:
    if not fingerprint_ids:
        return set()
    rows = conn.execute(
        select(R.c.scope).where(R.c.fingerprint_id.in_(list(fingerprint_ids))).distinct()
    )
    return {row[0] for row in rows}


def record_values(
    conn: Connection, fingerprint_ids: Sequence[int] | None = None
) -> list[tuple[int, str, str, str, str, float]]:
    """``(fingerprint_id, scope, namespace, key, value, tuned_at)``, as bundles and merges copy them."""
    query = select(R.c.fingerprint_id, R.c.scope, R.c.namespace, R.c.key, R.c.value, R.c.tuned_at)
    if fingerprint_ids is not None:
        query = query.where(R.c.fingerprint_id.in_(list(fingerprint_ids)))
    query = query.order_by(R.c.fingerprint_id, R.c.scope, R.c.namespace, R.c.key)
    return [tuple(row) for row in conn.execute(query)]


def record_counts(conn: Connection) -> tuple[tuple[int, str, int], ...]:
    """``(fingerprint id, namespace, records)``, every stored namespace."""
    rows = conn.execute(
        select(R.c.fingerprint_id, R.c.namespace, func.count())
        .group_by(R.c.fingerprint_id, R.c.namespace)
        .order_by(R.c.fingerprint_id, R.c.namespace)
    )
    return tuple((int(fid), ns, int(n)) for fid, ns, n in rows)


@dataclass(frozen=True)
class RecordChange:
    """What one commit did to one record."""

    action: str
    fingerprint_id: int
    scope: str
    namespace: str
    key: str
    old: str | None  # canonical JSON of the value replaced or removed
    new: str | None  # the value written
    old_commit_id: int | None

    def as_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "fingerprint": self.fingerprint_id,
            "scope": self.scope,
            "namespace": self.namespace,
            "key": self.key,
            "old": json.loads(self.old) if self.old is not None else None,
            "new": json.loads(self.new) if self.new is not None else None,
            "old_commit": self.old_commit_id,
        }


def record_changes(conn: Connection, commit_id: int) -> tuple[RecordChange, ...]:
    query = (
        select(
            RH.c.action,
            RH.c.fingerprint_id,
            RH.c.scope,
            RH.c.namespace,
            RH.c.key,
            RH.c.old_value,
            RH.c.new_value,
            RH.c.old_commit_id,
        )
        .where(RH.c.commit_id == commit_id)
        .order_by(RH.c.fingerprint_id, RH.c.scope, RH.c.namespace, RH.c.key, RH.c.id)
    )
    return tuple(RecordChange(*row) for row in conn.execute(query))
