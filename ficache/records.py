"""FlashInfer's namespaced records in the registry: storage, history, reads, merges, checks.

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
  (``ficache.kind_store``'s ``stage`` then ``apply`` over
  ``ficache.kinds.RECORD_KIND``, the entries' one path), so a write that changes records is one commit
  with its provenance, the same commit as the entries it writes with them;
  the commit counts its record changes (``records_added``,
  ``records_replaced``, ``records_removed``). A write that changes neither
  entries nor records makes no commit. ``Registry.revert`` undoes a commit's
  record changes with its entry changes, as one ``Registry.write``
  (``ficache.revert``), and refuses when a later commit changed one of its
  records. A prune removes the records its criteria match in the prune's
  one commit (``kind_store.prune_candidates``,
  ``kind_store.stage_planned_removals``; see ``Registry.plan_prune``), as ``removed`` record changes a revert restores.
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
- Merges (``plan_record_merge``) follow ``ficache.merge``'s policies; a
  conflict is one (fingerprint, scope, namespace, key) with two values.
  ``newest`` compares ``tuned_at``; records from bundles carry none (the
  bundle format has no field for it) and lose to any dated value.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy.exc import DatabaseError

from ficache.errors import RecordError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import (
    MAX_RECORD_DEPTH,
    check_namespace,
    record_value_json,
)
from ficache.kind_store import commit_changes, current_states
from ficache.kinds import RECORD_KIND
from ficache.models import COMMITS as C
from ficache.models import FINGERPRINTS as F
from ficache.models import RECORD_CHANGES as RH
from ficache.models import RECORDS as R
from ficache.values import NewRecord, RecordIdentity, validate_scope

__all__ = [
    "MAX_RECORD_DEPTH",
    "NewRecord",
    "RecordChange",
    "RecordConflict",
    "RecordIdentity",
    "RecordMergePlan",
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
# Writing: ``ficache.kind_store`` over ``kinds.RECORD_KIND`` (inside Registry.write's
# transaction); merge planning reads the current rows here.

#: A stored record's state: (row id, value, commit id, tuned_at).
_Old = tuple[int, str, int, float]


def _current(conn: Connection, fid: int, scopes: Iterable[str]) -> dict[tuple[str, str, str], _Old]:
    return {
        (scope, ns, key): (row_id, value, cid, tuned)
        for (_fid, scope, ns, key), (row_id, cid, value, tuned) in current_states(
            conn, RECORD_KIND, fid, scopes
        ).items()
    }


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
    """What commit ``commit_id`` did to records, by (fingerprint, scope, namespace, key)."""
    return tuple(
        RecordChange(
            ch.action,
            ch.fingerprint_id,
            ch.scope,
            ch.namespace,
            ch.key,
            ch.old_value,
            ch.new_value,
            ch.old_commit_id,
        )
        for ch in commit_changes(conn, RECORD_KIND, commit_id)
    )


# --------------------------------------------------------------------------
# Merging.


@dataclass(frozen=True)
class RecordConflict:
    """One record holding different values, and how the policy resolved it."""

    fingerprint: str  # digest
    fingerprint_id: int | None
    scope: str
    namespace: str
    key: str
    target: str | None  # the registry's value (for ``drop``: a dropped one)
    sources: tuple[tuple[int, str], ...]  # (source number from 1, value)
    resolution: str

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "fingerprint_id": self.fingerprint_id,
            "scope": self.scope,
            "namespace": self.namespace,
            "key": self.key,
            "target": json.loads(self.target) if self.target is not None else None,
            "sources": [{"source": n, "value": json.loads(v)} for n, v in self.sources],
            "resolution": self.resolution,
        }


@dataclass(frozen=True)
class RecordMergePlan:
    """The record part of a ``MergePlan``."""

    added: int = 0
    replaced: int = 0
    removed: int = 0
    identical: int = 0
    conflicts: tuple[RecordConflict, ...] = ()
    write: RecordWrite = field(default_factory=RecordWrite, repr=False)

    @property
    def candidates(self) -> int:
        return self.added + self.replaced + self.removed + self.identical + len(self.conflicts)

    def as_json(self) -> dict[str, Any]:
        return {
            "added": self.added,
            "replaced": self.replaced,
            "removed": self.removed,
            "identical": self.identical,
            "conflicting": len(self.conflicts),
            "conflicts": [c.as_json() for c in self.conflicts],
        }


#: ``merge.resolve``: (policy, (target value, tuned_at) | None, [(source n, record)]) -> winner.
Resolve = Callable[[str, "tuple[str, float | None] | None", list[tuple[int, NewRecord]]], Any]


def plan_record_merge(
    conn: Connection,
    sources: Sequence[Sequence[NewRecord]],
    policy: str,
    resolve: Resolve,
    *,
    target_word: str = "target",
    drop_word: str = "dropped",
) -> RecordMergePlan:
    """Plan merging the records of ``sources`` (in order) under ``policy``.

    ``resolve`` decides a conflict as ``ficache.merge`` does for entries; it
    returns ``target_word``, ``drop_word``, "unresolved" or a candidate.
    """
    by_ident: dict[RecordIdentity, list[tuple[int, NewRecord]]] = {}
    for number, records in enumerate(sources, start=1):
        for r in records:
            found = by_ident.setdefault(r.identity, [])
            if found and found[-1][0] == number:
                found[-1] = (number, r)  # a duplicate within one source: the later wins
            else:
                found.append((number, r))
    if not by_ident:
        return RecordMergePlan()
    digests = {ident[0].digest for ident in by_ident}
    stored = dict(
        conn.execute(select(F.c.digest, F.c.id).where(F.c.digest.in_(sorted(digests)))).all()
    )
    current: dict[tuple[int, str, str, str], _Old] = {}
    scopes: dict[int, set[str]] = {}
    for fp, scope, _ns, _key in by_ident:
        fid = stored.get(fp.digest)
        if fid is not None:
            scopes.setdefault(fid, set()).add(scope)
    for fid, fid_scopes in scopes.items():
        for (scope, ns, key), row in _current(conn, fid, fid_scopes).items():
            current[(fid, scope, ns, key)] = row
    tombstones = _tombstones(conn, sorted(scopes)) if policy == "drop" else {}
    counts = Counter[str]()
    conflicts: list[RecordConflict] = []
    writes: list[NewRecord] = []
    removals: list[RecordIdentity] = []
    expected: list[tuple[RecordIdentity, int | None]] = []
    for ident in sorted(by_ident, key=lambda i: (i[0].digest, i[1], i[2], i[3])):
        fp, scope, ns, key = ident
        cands = by_ident[ident]
        fid = stored.get(fp.digest)
        now = current.get((fid, scope, ns, key)) if fid is not None else None
        baseline = now[1] if now is not None else None
        if baseline is None and fid is not None:
            baseline = tombstones.get((fid, scope, ns, key))
        values = {r.value_json for _n, r in cands}
        first = cands[0][1]
        if len(values) == 1 and (baseline is None or baseline == first.value_json):
            if now is None:
                writes.append(first)
                expected.append((ident, None))
                counts["added"] += 1
            else:
                counts["identical"] += 1
            continue
        target = (now[1], now[3]) if now is not None else None
        winner = resolve(policy, target, cands)
        resolution = winner if isinstance(winner, str) else f"source {winner[0]}"
        if winner == drop_word:
            if now is not None:
                removals.append(ident)
                expected.append((ident, now[2]))
                counts["removed"] += 1
        elif not isinstance(winner, str):
            chosen = winner[1]
            if now is None:
                writes.append(chosen)
                expected.append((ident, None))
                counts["added"] += 1
            elif chosen.value_json != now[1]:
                writes.append(chosen)
                expected.append((ident, now[2]))
                counts["replaced"] += 1
            else:
                resolution = target_word
        conflicts.append(
            RecordConflict(
                fp.digest,
                fid,
                scope,
                ns,
                key,
                baseline,
                tuple((n, r.value_json) for n, r in cands),
                resolution,
            )
        )
    return RecordMergePlan(
        counts["added"],
        counts["replaced"],
        counts["removed"],
        counts["identical"],
        tuple(conflicts),
        RecordWrite(tuple(writes), tuple(removals), tuple(expected)),
    )


def _tombstones(
    conn: Connection, fingerprint_ids: Sequence[int]
) -> dict[tuple[int, str, str, str], str]:
    """Absent records whose latest change is a merge's removal, with the value it removed."""
    if not fingerprint_ids:
        return {}
    latest: dict[tuple[int, str, str, str], tuple[str, str, str | None]] = {}
    rows = conn.execute(
        select(
            RH.c.fingerprint_id,
            RH.c.scope,
            RH.c.namespace,
            RH.c.key,
            RH.c.action,
            C.c.kind,
            RH.c.old_value,
        )
        .join(C, C.c.id == RH.c.commit_id)
        .where(RH.c.fingerprint_id.in_(list(fingerprint_ids)))
        .order_by(RH.c.id)
    )
    for fid, scope, ns, key, action, kind, old in rows:
        latest[(fid, scope, ns, key)] = (action, kind, old)
    return {
        ident: old
        for ident, (action, kind, old) in latest.items()
        if action == "removed" and kind == "merge" and old is not None
    }


# --------------------------------------------------------------------------
# Verification (``ficache verify``).

#: Kinds of problems ``check`` reports, with what each means (``ficache.verify.KINDS``).
PROBLEM_KINDS = {
    "orphan_record": "a record or record change names a missing fingerprint or commit",
    "bad_record": "a record's scope, namespace or value is not what writers store",
    "record_counts": "a commit's record counts differ from its record changes",
    "record_unlogged": "a record is not what the record change log last wrote",
}


def check(
    conn: Connection, counted: Counter[str] | None = None
) -> Iterator[tuple[str, str, str | None, int | None]]:
    """Every problem of the records tables: ``(kind, message, table, row id)``.

    ``counted["records"]`` and ``counted["record_changes"]`` grow by the
    rows it reads (``ficache verify``'s counts).

    Records belong to an existing fingerprint and commit; scopes, namespaces
    and values are what writers store; a commit's record counts equal its
    record change rows per action; replaying the record changes in id order
    ends with exactly the stored records, each written by the commit it names.
    """
    for table, name in ((R, "record"), (RH, "record change")):
        for column, parent, what in (
            ("fingerprint_id", F, "fingerprint"),
            ("commit_id", C, "commit"),
        ):
            ref = table.c[column]
            query = (
                select(table.c.id, ref)
                .select_from(table.outerjoin(parent, parent.c.id == ref))
                .where(parent.c.id.is_(None))
                .order_by(table.c.id)
            )
            for row_id, missing in conn.execute(query):
                yield (
                    "orphan_record",
                    f"{name} {row_id}: {what} {missing} is missing",
                    table.name,
                    row_id,
                )

    def bad(scope: str, ns: str, values: Iterable[str | None]) -> str | None:
        try:
            if validate_scope(scope) != scope:
                return f"scope {scope[:80]!r} is not in its canonical form"
            check_namespace(ns)
            for value in values:
                if value is not None:
                    canonical_value(value)
        except (ValueError, RecordError) as exc:
            return str(exc)
        return None

    counts: Counter[tuple[int, str]] = Counter()
    state: dict[tuple[int, str, str, str], tuple[int, str | None]] = {}
    for hid, cid, fid, scope, ns, key, action, old, old_cid, new in conn.execute(
        select(
            RH.c.id,
            RH.c.commit_id,
            RH.c.fingerprint_id,
            RH.c.scope,
            RH.c.namespace,
            RH.c.key,
            RH.c.action,
            RH.c.old_value,
            RH.c.old_commit_id,
            RH.c.new_value,
        ).order_by(RH.c.id)
    ):
        counts[cid, action] += 1
        if counted is not None:
            counted["record_changes"] += 1
        problem = bad(scope, ns, (old, new))
        if problem is not None:
            yield ("bad_record", f"record change {hid}: {problem}", "record_changes", hid)
        ident = (fid, scope, ns, key)
        before = state.get(ident)
        valid = {
            "added": before is None and old is None and new is not None,
            "replaced": before is not None
            and old == before[1]
            and old_cid == before[0]
            and new is not None,
            "removed": before is not None
            and old == before[1]
            and old_cid == before[0]
            and new is None,
        }
        if not valid.get(action, False):
            yield (
                "record_unlogged",
                f"record change {hid} (commit {cid}): {str(action)[:16]} does not follow the log",
                "record_changes",
                hid,
            )
        if action == "removed":
            state.pop(ident, None)
        else:
            state[ident] = (cid, new)
    for cid, added, replaced, removed in conn.execute(
        select(C.c.id, C.c.records_added, C.c.records_replaced, C.c.records_removed).order_by(
            C.c.id
        )
    ):
        stored = {"added": added, "replaced": replaced, "removed": removed}
        differ = [
            f"{counts[cid, action]} {action} (the commit says {stored[action]})"
            for action in ("added", "replaced", "removed")
            if counts[cid, action] != stored[action]
        ]
        if differ:
            yield (
                "record_counts",
                f"commit {cid} has record changes: {', '.join(differ)}",
                "commits",
                cid,
            )
    for rid, fid, scope, ns, key, value, cid in conn.execute(
        select(
            R.c.id, R.c.fingerprint_id, R.c.scope, R.c.namespace, R.c.key, R.c.value, R.c.commit_id
        ).order_by(R.c.id)
    ):
        if counted is not None:
            counted["records"] += 1
        problem = bad(scope, ns, (value,))
        if problem is not None:
            yield ("bad_record", f"record {rid}: {problem}", "records", rid)
        ident = (fid, scope, ns, key)
        logged = state.pop(ident, None)
        if logged is None:
            yield ("record_unlogged", f"record {rid}: no record change holds it", "records", rid)
        elif logged != (cid, value):
            yield (
                "record_unlogged",
                f"record {rid} is not what commit {logged[0]} wrote",
                "records",
                rid,
            )
    for (fid, scope, ns, key), (cid, _value) in state.items():
        yield (
            "record_unlogged",
            f"commit {cid} wrote a record that is missing (fingerprint {fid}, scope {scope}, "
            f"namespace {ns[:80]}, key {key[:80]!r})",
            None,
            None,
        )


def commits_with_record_changes(conn: Connection) -> set[int]:
    return {row[0] for row in conn.execute(select(RH.c.commit_id).distinct())}
