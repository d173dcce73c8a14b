"""Offline merge: other registries, FlashInfer cache files and bundles into one registry.

``open_source(spec)`` reads one source whole: a registry (a SQLite path or a
SQLAlchemy URL), a FlashInfer cache file, or a bundle (``ficache.bundle``).
``plan_merge(registry, sources, policy)`` compares them with the registry and
returns a frozen ``MergePlan``; ``MergePlan.execute(registry)`` applies it as
one commit of kind ``merge``.

A conflict is one (fingerprint, scope, key) holding different values
(runner, tactic, policy) in the registry and a source, or in two sources. A
value's selection (how FlashInfer chose it) is not part of the value: it
never makes a conflict, and travels with the value that is written.
Policies decide which value stays:

- ``keep`` (default): the registry's value; among sources, the first.
- ``theirs``: the last source holding the key.
- ``newest``: the most recently tuned (``tuned_at``, dated by
  ``tuned_time.tuned_at`` as every ingest path dates it: a FlashInfer file's
  entries take the file's mtime). Ties keep the registry's value, else the
  first source's.
- ``vote``: the value most sources hold. Ties keep the registry's value,
  or take the first source holding a tied value when the registry has none.
- ``drop``: the key is removed (and not added), so the next synchronized
  start re-tunes it.
- ``fail``: nothing changes; executing raises ``MergeConflictError``.

``resolve`` is the one rule for conflicts among sources: ``import`` applies
it, with no target, to the keys its own inputs share (``ficache.importing``).

Invariants:
- Sources are read, parsed and verified before the registry's write lock is
  taken; the lock is held for SQL only. A damaged source raises one
  ``FicacheError`` line before anything is written. Sources are never
  written: a registry source is read at the current schema head and never
  upgraded.
- Entries of different fingerprints never conflict; a shared entry and a
  rank-scoped one are different entries, so neither overwrites the other.
- A plan is a function of the sources, the policy and the registry's state.
  Executing it is one ``Registry.write`` (one transaction, one commit, or
  none when nothing changes) that refuses with ``ConflictError`` when an
  entry it writes or removes changed since planning.
- Merging the same sources again changes nothing and makes no commit, for
  every policy. For ``drop`` this holds because a merge commit's removal is
  a tombstone: while the key stays absent, a source value that differs
  from the removed one still conflicts with it and is dropped again.
- The commit's provenance names the policy and every source with its kind,
  entry count and digest: the sha256 of a file's bytes; for a registry,
  the sha256 of its content (``registry_digest``). Its message and
  provenance are built from ``MergePlan.commit_sources`` by
  ``ficache.ingest_commit``, as every ingest's commit is.
- Namespaced records (``ficache.records``) merge under the same policies in
  the same plan and commit, planned by the same code (``ficache.kind_merge``
  over ``ENTRY_MERGE`` and ``RECORD_MERGE``, this module's descriptions): a
  conflict is one (fingerprint, scope, namespace, record key) with different
  values (``MergePlan.records``).
  ``newest`` compares their ``tuned_at`` (a file's mtime; a bundle carries
  no time for records, so they take the bundle file's mtime).
- FlashInfer 0.7.4's protocol records (``ficache.protocol_records``) merge
  the same way, by the same code (``PROTOCOL_MERGE``): a conflict is one
  (fingerprint, scope, namespace, key) with different values (JSON value and
  measurement policy), reported in ``MergePlan.protocol``. A merge that
  involves none reads, plans, reports and records exactly what it did
  before they were stored (``as_json``, provenance and digests unchanged).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from sqlalchemy import select
from sqlalchemy.exc import DatabaseError

from ficache import ingest, schema, tuned_time
from ficache._gcpause import paused_gc
from ficache.bundle import bundle_records, read_bundle
from ficache.errors import (
    CacheFileError,
    FingerprintError,
    MergeConflictError,
    NotARegistryError,
    SchemaError,
    StalePlanError,
)
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_cache_bytes, parse_key, read_cache_bytes
from ficache.history import EntryValue
from ficache.ingest_commit import IngestCommit, IngestSources
from ficache.kind_merge import (
    ADDED,
    IDENTICAL,
    REMOVED,
    REPLACED,
    KindPlan,
    MergeKind,
    plan_kind,
    resolve,
)
from ficache.kind_read import stored_items
from ficache.kinds import ENTRY_KIND, PROTOCOL_KIND, RECORD_KIND
from ficache.models import ENTRIES as E
from ficache.models import (
    ENTRY_VALUE_COLUMNS,
    SHARED_SCOPE,
)
from ficache.models import FINGERPRINTS as F
from ficache.protocol_records import NewProtocolRecord, ProtocolWrite
from ficache.records import NewRecord, RecordWrite
from ficache.registry_access import RegistryAccess
from ficache.values import (
    NewEntry,
    WriteResult,
    bulk_new_entry,
    fingerprint_from_row,
)

POLICIES = ("keep", "theirs", "newest", "vote", "drop", "fail")
SOURCE_KINDS = ("registry", "flashinfer", "bundle")

#: (fingerprint, scope, key): one entry's identity.
Identity = tuple[Fingerprint, str, str]
_Value = tuple[str, str, str | None]  # (runner, tactic_json, policy_json)


# --------------------------------------------------------------------------
# Sources.


@dataclass(frozen=True)
class SourceSummary:
    """A source as the plan and the commit's provenance name it."""

    name: str
    kind: str  # one of SOURCE_KINDS
    digest: str  # sha256 hex
    entries: int
    records: int = 0  # namespaced records (``_records``)
    protocol_records: int = 0  # FlashInfer 0.7.4's protocol records

    def as_json(self) -> dict[str, Any]:
        """The source as provenance names it (``protocol_records`` only when it holds some)."""
        out: dict[str, Any] = {
            "source": self.name,
            "kind": self.kind,
            "digest": self.digest,
            "entries": self.entries,
            "records": self.records,
        }
        if self.protocol_records:
            out["protocol_records"] = self.protocol_records
        return out


@dataclass(frozen=True)
class MergeSource:
    """One source, read whole and verified."""

    name: str  # as the user gave it (a URL with its password hidden)
    kind: str  # one of SOURCE_KINDS
    digest: str
    entries: tuple[NewEntry, ...] = field(repr=False)  # tuned_at set where known
    records: tuple[NewRecord, ...] = field(default=(), repr=False)
    protocol_records: tuple[NewProtocolRecord, ...] = field(default=(), repr=False)
    #: A FlashInfer file's entries skipped for a key of no form FlashInfer writes.
    unreadable_keys: tuple[str, ...] = field(default=(), repr=False)

    @property
    def summary(self) -> SourceSummary:
        return SourceSummary(
            self.name,
            self.kind,
            self.digest,
            len(self.entries),
            len(self.records),
            len(self.protocol_records),
        )


def read_sources(specs: Iterable[str | os.PathLike[str]]) -> tuple[MergeSource, ...]:
    """``open_source`` of every spec, in order, stopping at the first damaged one.

    Reads them all with the garbage collector paused (see ``ficache._gcpause``).
    """
    with paused_gc():
        return tuple(open_source(spec) for spec in specs)


def open_source(spec: str | os.PathLike[str]) -> MergeSource:
    """Read and verify one merge source: a registry, a FlashInfer file or a bundle.

    ``ingest.recognise`` says which: a URL (``scheme://``) or a SQLite file
    is a registry; a file starting with the bundle magic is a bundle; a
    directory is refused; anything else must be a FlashInfer cache file.
    Raises a ``FicacheError`` with one line for anything
    missing, damaged, truncated, foreign or too new.
    """
    with paused_gc():
        return _open_source(os.fspath(spec))


def _open_source(text: str) -> MergeSource:
    kind = ingest.recognise(text)
    if kind == ingest.REGISTRY:
        return _registry_source(text)
    path = Path(text)
    if kind in ingest.DIRECTORY_KINDS:
        raise CacheFileError(
            f"{path}: is a directory, expected a registry, a FlashInfer cache file or a bundle"
        )
    if kind == ingest.BUNDLE:
        read = read_bundle(path)
        return MergeSource(
            str(path),
            "bundle",
            read.digest,
            tuple(read.entries),
            records=tuple(bundle_records(read, tuned_time.tuned_at(None, path))),
            protocol_records=read.protocol_records,
        )
    return _flashinfer_source(path)


def _flashinfer_source(path: Path) -> MergeSource:
    """A FlashInfer file as a merge source: what ``import`` would read of it
    (``ingest.file_results``), shared, its digest the sha256 of its bytes.

    A file without ``_metadata`` is refused, pointing to ``import
    --fingerprint``; a ``_metadata`` naming no fingerprint, with the file's name.
    """
    data = read_cache_bytes(path)
    cache = parse_cache_bytes(data, source=str(path))
    try:
        fp = ingest.file_fingerprint(str(path), cache, advice=ingest.MERGE_FINGERPRINT_ADVICE)
    except FingerprintError as exc:
        if cache.metadata is None:
            raise
        raise FingerprintError(f"{path}: {exc}") from None
    read = ingest.file_results(cache, _interned(fp), scope=SHARED_SCOPE, path=path)
    return MergeSource(
        str(path),
        "flashinfer",
        hashlib.sha256(data).hexdigest(),
        read.entries,
        read.records,
        unreadable_keys=cache.unreadable_keys,
    )


@functools.lru_cache(maxsize=256)
def _interned(fp: Fingerprint) -> Fingerprint:
    """One object per distinct fingerprint across sources.

    Planning and writing look fingerprints up in dicts per entry, and a
    fingerprint hashes all its fields every time; runs of the same object
    are recognised by identity and hashed once.
    """
    return fp


def registry_digest(
    entries: Sequence[NewEntry],
    records: Sequence[NewRecord] = (),
    protocol_records: Sequence[NewProtocolRecord] = (),
) -> str:
    """The sha256 of a registry's content: one canonical JSON line per entry and record.

    Each entry's line is ``[fingerprint digest, scope, key, runner, tactic,
    policy, tuned_at]``, with its selection appended when it has one (so a
    registry without selections keeps the digest it had before 0004), each record's ``["record", fingerprint digest, scope,
    namespace, key, value, tuned_at]``, lines sorted; two registries holding
    the same entries and records have the same digest, whatever their
    histories (a registry without records has the digest it had before
    records were stored). Protocol records add ``["protocol", fingerprint digest,
    scope, namespace, key, value, policy, tuned_at]`` lines, likewise only when
    there are some.
    """
    lines: list[list[Any]] = [
        [
            e.fingerprint.digest,
            e.scope,
            e.key,
            e.runner,
            e.tactic_json,
            e.policy_json,
            e.tuned_at,
            *(() if e.selection_json is None else (e.selection_json,)),
        ]
        for e in entries
    ]
    lines += [
        ["record", r.fingerprint.digest, r.scope, r.namespace, r.key, r.value_json, r.tuned_at]
        for r in records
    ]
    lines += [
        [
            "protocol",
            *(r.fingerprint.digest, r.scope, r.namespace, r.key, r.value_json, r.policy_json),
            r.tuned_at,
        ]
        for r in protocol_records
    ]
    texts = sorted(json.dumps(line, separators=(",", ":")) for line in lines)
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _registry_source(spec: str) -> MergeSource:
    location = schema.resolve(spec)
    engine, _readonly = schema.make_engine(location, create=False)
    name = location.display
    try:
        with engine.connect() as conn:
            try:
                revision = schema.check_revision(conn, location)
            except NotARegistryError:
                raise NotARegistryError(
                    f"{name} is a database but not a ficache registry; nothing merged"
                ) from None
            head = schema.head_revision()
            if revision is None:
                raise NotARegistryError(f"{name} is an empty database, not a ficache registry")
            found = schema.features_of(revision)
            if found is None:
                raise SchemaError(
                    f"source registry {name} is at schema revision {revision!r}, older than "
                    f"{head!r}; upgrade it first (ficache --db {name} db upgrade)"
                )
            # A previous release's schema is read as it is (``schema.SchemaFeatures``).
            conn = conn.execution_options(**{schema.FEATURES_OPTION: found})
            # One snapshot, read here rather than through Registry.open, which
            # would upgrade (write) a source registry of an older schema.
            fp_rows = conn.execute(select(*schema.features(conn).columns(F)))
            fps = {row.id: _interned(fingerprint_from_row(row)) for row in fp_rows}
            rows = conn.execute(
                select(*ENTRY_VALUE_COLUMNS).order_by(E.c.fingerprint_id, E.c.scope, E.c.key)
            ).all()
            records, protocol_records = (
                tuple(stored_items(conn, kind, fps)) for kind in (RECORD_KIND, PROTOCOL_KIND)
            )
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, location) from None
    finally:
        engine.dispose()
    make = bulk_new_entry
    entries = tuple(
        [
            make(fps[fid], key, runner, tactic, policy, scope, None, tuned_at, selection)
            for fid, scope, key, runner, tactic, policy, tuned_at, selection in rows
        ]
    )
    return MergeSource(
        name,
        "registry",
        registry_digest(entries, records, protocol_records),
        entries,
        records=records,
        protocol_records=protocol_records,
    )


# --------------------------------------------------------------------------
# Plans.


@dataclass(frozen=True)
class MergeGroup:
    """Counts of one (fingerprint, scope, op) of a plan."""

    fingerprint: str  # digest
    fingerprint_id: int | None  # in the target registry; None: new there
    gpu: str
    scope: str
    op: str
    added: int = 0
    replaced: int = 0
    removed: int = 0
    identical: int = 0
    conflicting: int = 0

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class MergeConflict:
    """One entry holding different values, and how the policy resolved it."""

    fingerprint: str  # digest
    fingerprint_id: int | None
    scope: str
    key: str
    target: EntryValue | None  # the registry's value (for ``drop``: a dropped one)
    sources: tuple[tuple[int, EntryValue], ...]  # (source number from 1, value)
    resolution: str  # "target", "source N", "dropped" or "unresolved"

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "fingerprint_id": self.fingerprint_id,
            "scope": self.scope,
            "key": self.key,
            "target": self.target.as_json() if self.target is not None else None,
            "sources": [{"source": n, **v.as_json()} for n, v in self.sources],
            "resolution": self.resolution,
        }


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
    """The record part of a ``MergePlan`` (and, with a ``ProtocolWrite``, its protocol
    record part)."""

    added: int = 0
    replaced: int = 0
    removed: int = 0
    identical: int = 0
    conflicts: tuple[RecordConflict, ...] = ()
    write: RecordWrite | ProtocolWrite = field(default_factory=RecordWrite, repr=False)

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


@dataclass(frozen=True)
class MergePlan:
    """What a merge would do; compare plans with ``==``, apply with ``execute``."""

    target: str  # the registry planned against (``Location.display``)
    policy: str
    sources: tuple[SourceSummary, ...]
    groups: tuple[MergeGroup, ...]
    conflicts: tuple[MergeConflict, ...]
    writes: tuple[NewEntry, ...] = field(repr=False)
    removals: tuple[Identity, ...] = field(repr=False)
    # The commit that wrote each written or removed entry's value when planned (None: absent).
    expected: tuple[tuple[Identity, int | None], ...] = field(repr=False)
    records: RecordMergePlan = field(default_factory=RecordMergePlan)
    #: The protocol records' part (``PROTOCOL_MERGE``; its ``write`` a ``ProtocolWrite``).
    protocol: RecordMergePlan = field(
        default_factory=lambda: RecordMergePlan(write=ProtocolWrite())
    )

    def _total(self, name: str) -> int:
        return sum(getattr(g, name) for g in self.groups)

    @property
    def added(self) -> int:
        return self._total("added")

    @property
    def replaced(self) -> int:
        return self._total("replaced")

    @property
    def removed(self) -> int:
        return self._total("removed")

    @property
    def identical(self) -> int:
        return self._total("identical")

    @property
    def conflicting(self) -> int:
        return len(self.conflicts)

    @property
    def is_empty(self) -> bool:
        """True when executing would change nothing (and make no commit)."""
        return (
            not self.writes
            and not self.removals
            and self.records.write.is_empty
            and self.protocol.write.is_empty
        )

    @property
    def refused(self) -> bool:
        """True when the policy is ``fail`` and there are conflicts (of any kind)."""
        return self.policy == "fail" and bool(
            self.conflicts or self.records.conflicts or self.protocol.conflicts
        )

    @property
    def totals_str(self) -> str:
        return (
            f"{self.added} added, {self.replaced} replaced, {self.removed} removed, "
            f"{self.identical} identical, {self.conflicting} conflicting"
        )

    @property
    def provenance(self) -> dict[str, Any]:
        return {"policy": self.policy, "sources": [s.as_json() for s in self.sources]}

    @property
    def commit_sources(self) -> IngestSources:
        """What the merge commit names (``ficache.ingest_commit``): the policy and every
        source, each with its kind, counts and digest (``provenance``)."""
        return IngestSources(
            tuple(s.name for s in self.sources), f"merge ({self.policy}): ", self.provenance
        )

    def as_json(self) -> dict[str, Any]:
        """The plan as JSON; ``protocol_records`` only when a source holds some."""
        out = {
            "target": self.target,
            "policy": self.policy,
            "sources": [s.as_json() for s in self.sources],
            "groups": [g.as_json() for g in self.groups],
            "totals": {
                "added": self.added,
                "replaced": self.replaced,
                "removed": self.removed,
                "identical": self.identical,
                "conflicting": self.conflicting,
            },
            "conflicts": [c.as_json() for c in self.conflicts],
            "records": self.records.as_json(),
        }
        if self.protocol.candidates:
            out["protocol_records"] = self.protocol.as_json()
        return out

    def check(self) -> None:
        """Raise ``MergeConflictError`` when the plan is refused (``fail`` with conflicts)."""
        if self.refused:
            records = (
                f" and {len(self.records.conflicts)} conflicting records"
                if self.records.conflicts
                else ""
            )
            if self.protocol.conflicts:
                records += f" and {len(self.protocol.conflicts)} conflicting protocol records"
            raise MergeConflictError(
                f"{self.conflicting} conflicting entries{records}; nothing merged; choose how to "
                "resolve them with --on-conflict keep|theirs|newest|vote|drop"
            )

    def execute(self, registry: RegistryAccess) -> WriteResult:
        """Apply the plan as one ``merge`` commit (none when it changes nothing).

        Raises ``MergeConflictError`` for a refused plan, and ``ConflictError``
        (writing nothing) when an entry the plan writes or removes changed
        since it was made.
        """
        self.check()
        registry.require_planned_on(self.target)
        if self.is_empty:
            return WriteResult(
                None,
                unchanged=self.identical,
                records_unchanged=self.records.identical,
                protocol_unchanged=self.protocol.identical,
            )
        return IngestCommit.of("merge", self.commit_sources).write(
            registry,
            self.writes,
            removals=self.removals,
            expected=self.expected,  # pairs: no dict to build (and hash) per entry
            records=cast(RecordWrite, self.records.write),
            protocol_records=cast(ProtocolWrite, self.protocol.write),
        )


# --------------------------------------------------------------------------
# The two kinds a merge plans (``ficache.kind_merge`` decides for both).


def _entry_op(key: str, e: NewEntry) -> str:
    return e.fields.op if e.fields is not None else parse_key(key).op


def _entry_value(e: NewEntry) -> EntryValue:
    return EntryValue(e.runner, e.tactic_json, e.policy_json)


def _entry_conflict(
    digest: str,
    fingerprint_id: int | None,
    scope: str,
    key: str,
    baseline: _Value | None,
    candidates: Sequence[tuple[int, NewEntry]],
    resolution: str,
) -> MergeConflict:
    return MergeConflict(
        digest,
        fingerprint_id,
        scope,
        key,
        EntryValue(*baseline) if baseline is not None else None,
        tuple((n, _entry_value(e)) for n, e in candidates),
        resolution,
    )


def _record_op(_key: tuple[str, str], _r: NewRecord) -> str:
    return ""  # records are counted as one group


def _record_conflict(
    digest: str,
    fingerprint_id: int | None,
    scope: str,
    key: tuple[str, str],
    baseline: str | None,
    candidates: Sequence[tuple[int, NewRecord]],
    resolution: str,
) -> RecordConflict:
    namespace, record_key = key
    return RecordConflict(
        digest,
        fingerprint_id,
        scope,
        namespace,
        record_key,
        baseline,
        tuple((n, r.value_json) for n, r in candidates),
        resolution,
    )


def _protocol_conflict(
    digest: str,
    fingerprint_id: int | None,
    scope: str,
    key: tuple[str, str],
    baseline: tuple[str, str | None] | None,
    candidates: Sequence[tuple[int, NewProtocolRecord]],
    resolution: str,
) -> RecordConflict:
    """A protocol record conflict, shown by its values (its policies decide it, unshown)."""
    namespace, record_key = key
    return RecordConflict(
        digest,
        fingerprint_id,
        scope,
        namespace,
        record_key,
        baseline[0] if baseline is not None else None,
        tuple((n, r.value_json) for n, r in candidates),
        resolution,
    )


#: Entries: one per (fingerprint, scope, key); value (runner, tactic, policy).
ENTRY_MERGE = MergeKind(ENTRY_KIND, NewEntry, _entry_op, _entry_conflict)
#: Namespaced records: one per (fingerprint, scope, namespace, key); value its JSON.
RECORD_MERGE = MergeKind(RECORD_KIND, NewRecord, _record_op, _record_conflict)
#: Protocol records: one per (fingerprint, scope, namespace, key); value (JSON, policy).
PROTOCOL_MERGE = MergeKind(PROTOCOL_KIND, NewProtocolRecord, _record_op, _protocol_conflict)


def plan_merge(
    registry: RegistryAccess, sources: Sequence[MergeSource], policy: str = "keep"
) -> MergePlan:
    """Plan merging ``sources`` (in this order) into ``registry`` under ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown merge policy {policy!r}; expected one of {', '.join(POLICIES)}")
    with paused_gc():
        return _plan(registry, sources, policy)


#: Plans one merge makes at most while other writers keep committing to the rows it
#: writes between its plan and its write (each plan reads the registry anew).
MERGE_ATTEMPTS = 4


def merge_sources(
    registry: RegistryAccess,
    sources: Sequence[MergeSource],
    policy: str = "keep",
    *,
    attempts: int = MERGE_ATTEMPTS,
    first_plan: MergePlan | None = None,
) -> tuple[MergePlan, WriteResult | None]:
    """Plan and execute a merge; plan again when another writer committed in between.

    A plan's write carries the commit id of every row it writes or removes
    (``MergePlan.expected``); when another writer changed one of them after
    the plan was read, the write raises ``StalePlanError`` and writes
    nothing. Nobody confirmed the plan (``merge`` asks no question), so it
    is planned again from the registry as it is now, which is what the merge
    would have done had it started a moment later: two merges of the same
    sources at once both succeed and end as the two run one after the
    other. At most ``attempts`` plans; the last loss is raised.
    ``first_plan`` is a plan the caller already made on ``registry``.

    Returns the plan that was executed and its result, or ``(plan, None)``
    for a refused plan (``fail`` with conflicts; ``plan.check()`` raises).
    """
    plan = first_plan if first_plan is not None else plan_merge(registry, sources, policy)
    for attempt in range(1, attempts + 1):
        if plan.refused:
            return plan, None
        try:
            return plan, plan.execute(registry)
        except StalePlanError:
            if attempt == attempts:
                raise
        plan = plan_merge(registry, sources, policy)
    raise AssertionError("unreachable")  # the loop returns or raises


def _plan(registry: RegistryAccess, sources: Sequence[MergeSource], policy: str) -> MergePlan:
    """Both kinds planned on one connection (one read of the registry), then shaped.

    A source fingerprint under a measurement policy that the registry's older schema
    cannot keep apart is refused first, as the write would (``refuse_measurements``).
    """
    registry.features.refuse_measurements(
        row.fingerprint.measurement
        for s in sources
        for rows in (s.entries, s.records, s.protocol_records)
        for row in rows
    )
    try:
        with registry.engine.connect() as conn:
            entries = plan_kind(conn, ENTRY_MERGE, [s.entries for s in sources], policy)
            records = (
                _record_plan(plan_kind(conn, RECORD_MERGE, [s.records for s in sources], policy))
                if any(s.records for s in sources)
                else RecordMergePlan()
            )
            protocol = (
                _record_plan(
                    plan_kind(conn, PROTOCOL_MERGE, [s.protocol_records for s in sources], policy),
                    ProtocolWrite,
                )
                if any(s.protocol_records for s in sources)
                else RecordMergePlan(write=ProtocolWrite())
            )
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, registry.location) from None
    fps, ids = entries.fingerprints, entries.target_ids

    def order(ident: tuple[int, str, Any]) -> tuple[tuple[bool, int, str], str, Any]:
        index, scope, key_or_op = ident
        return (entries.order(index), scope, key_or_op)

    groups = tuple(
        MergeGroup(fps[i].digest, ids[i], fps[i].gpu, scope, op, *entries.counts[(i, scope, op)])
        for i, scope, op in sorted(entries.counts, key=order)
    )
    return MergePlan(
        registry.location.display,
        policy,
        tuple(s.summary for s in sources),
        groups,
        tuple(entries.conflicts[ident] for ident in sorted(entries.conflicts, key=order)),
        tuple(entries.writes),
        tuple(entries.removals),
        tuple(entries.expected),
        records,
        protocol,
    )


def _record_plan(
    plan: KindPlan, write: type[RecordWrite] | type[ProtocolWrite] = RecordWrite
) -> RecordMergePlan:
    """The records' part: totals over every group, conflicts by (digest, scope, key)."""
    added, replaced, removed, identical = (
        sum(n[i] for n in plan.counts.values()) for i in (ADDED, REPLACED, REMOVED, IDENTICAL)
    )
    fps = plan.fingerprints

    def by_digest(ident: tuple[int, str, Any]) -> tuple[str, str, Any]:
        index, scope, key = ident
        return (fps[index].digest, scope, key)

    return RecordMergePlan(
        added,
        replaced,
        removed,
        identical,
        tuple(plan.conflicts[ident] for ident in sorted(plan.conflicts, key=by_digest)),
        write(tuple(plan.writes), tuple(plan.removals), tuple(plan.expected)),
    )


__all__ = [
    "POLICIES",
    "SOURCE_KINDS",
    "MergeConflict",
    "MergeGroup",
    "MergePlan",
    "MergeSource",
    "SourceSummary",
    "open_source",
    "plan_merge",
    "read_sources",
    "registry_digest",
    "ENTRY_MERGE",
    "PROTOCOL_MERGE",
    "RECORD_MERGE",
    "RecordConflict",
    "RecordMergePlan",
    "resolve",
]
