"""Verify a registry: storage, schema, and ficache's own invariants, read-only.

``verify(db)`` opens the registry read-only and never writes it. SQLite: a
``mode=ro`` URI connection with ``query_only``; the file and its WAL are only
read (a WAL a killed writer left is read, never checkpointed), though SQLite
may create the empty ``-wal`` and the ``-shm`` a WAL reader needs (the next
writer removes them). PostgreSQL: a ``READ ONLY``, ``REPEATABLE READ``
transaction. Every table is read in bulk inside that one transaction (one
snapshot, so a writer committing meanwhile cannot make a healthy registry
look damaged), and the result is a frozen ``VerifyReport``.
It never upgrades an older schema: it reports it. Opening errors (no
registry, not a SQLite file, a truncated or unreadable file, a schema newer
than this code, a server that cannot be reached) raise the usual one-line
``RegistryError``.

The checks, and why each holds for a healthy registry (every write goes
through ``Registry.write``, ``PrunePlan.execute`` or ``Registry.revert``; see
``ficache.registry``; ``ficache.usage`` only sets ``last_served_at``):

Storage
- ``integrity``: SQLite ``PRAGMA integrity_check`` says ``ok``. PostgreSQL
  has no cheap whole-database check: every index is valid
  (``pg_index.indisvalid``), and, when the ``amcheck`` extension is
  installed (it is not by default, and verify never installs it), every
  B-tree index of the registry passes ``bt_index_check``; otherwise a note
  says the index structure was not checked. When integrity fails the data
  checks are skipped: reading a damaged file proves nothing.
- ``foreign_key``: SQLite ``PRAGMA foreign_key_check`` finds no violation of a
  foreign key other than the five the orphan checks below cover (those are
  reported once, as orphans). PostgreSQL: every constraint is validated
  (``pg_constraint.convalidated``) and no table's internal (foreign key)
  triggers are disabled, so PostgreSQL enforces the keys on every write.

Schema
- ``schema_revision``: the registry is at a revision this code reads. One
  older than ``schema.oldest_readable`` is healthy but stale: verify says
  so, exits 1, and skips the data checks; ``ficache db upgrade`` fixes it.
  One from there to head (a previous release's, during a rolling upgrade)
  is checked as it is, what it lacks absent by design, with a note.
- ``schema_drift``: the tables, columns, types and indexes match the models
  (Alembic's ``compare_metadata``, as ``tests/test_schema.py`` checks for a
  new registry): the schema changes only through migrations. When a table
  or column is missing, the data checks are skipped.

Rows (SQL joins for orphans, the rest in Python over the bulk reads)
- ``orphan_entry``: every entry's fingerprint and commit rows exist (foreign
  keys; SQLite enforces them on every ficache connection).
- ``orphan_change``: every change row's commit and fingerprint exist.
- ``fingerprint_digest``: every fingerprint's fields make a valid
  ``Fingerprint`` whose ``digest`` is the stored one (writers insert
  ``fp.digest`` with ``fp.as_dict()``).
- ``bad_key``: every key (entries and changes) parses
  (``flashinfer_format.parse_key``): writers parse it before storing it.
- ``key_columns``: an entry's ``op`` is what its key parses to (writers
  store ``parse_key``'s op) and its ``runner`` is the key's runner (every
  source ficache imports from checks that).
- ``bad_scope``: every scope is ``validate_scope``'s own form (writers
  validate scopes before storing them).
- ``bad_json``: every tactic (entries, and the old and new values of
  changes) and every stored policy (``policies``) is canonical JSON, a
  policy a JSON list: readers of files, bundles, stores and the tuner store
  ``canonical_json`` text. Entries and changes name policies by id, so
  values are compared by id (one text has one id).
- ``policy_digest``: every policy's ``digest`` is the SHA-256 of its text
  (``ficache.policies`` writes them together); policy ids that name no
  policy are orphans (``orphan_entry``, ``orphan_change``).
- ``bad_selection``: every selection (entries, and the old and new
  selections of changes) is NULL or what ``flashinfer_format.selection_json``
  makes of it: the canonical JSON of an object within its limits (every
  writer stores a selection through it, or copies a stored one).
- ``duplicate_entry``: one entry per (fingerprint, scope, key) (a unique
  constraint; a damaged index could let two in).
- ``bad_commit``: a commit's kind is one of ``registry.COMMIT_KINDS``; its
  provenance is NULL or a JSON object; it reverts a commit exactly when its
  kind is ``revert``, and then an earlier one (a revert refers to an
  existing commit by id, and ids grow in commit order), except a ``revert
  --to`` commit, whose provenance names the earlier commit it returns to
  (``revert_to``) and which reverts no one commit.
- ``empty_commit``: every commit has changes (a write that changes nothing
  makes no commit; a prune or revert of nothing makes none either).
- ``commit_counts``: a commit's ``added``/``replaced``/``removed`` equal the
  counts of its change rows per action (both are written in its
  transaction from the same lists).
- ``bad_change``: an action is ``added``, ``replaced`` or ``removed``; an
  added change has no old value, a replaced or removed one has it (revert
  restores it), a removed one has no new value; one change per entry per
  commit (writers key their work by (fingerprint, scope, key)).
- ``log_inconsistent``: change rows are in commit order (ids grow with
  commits: writers insert them in their commit's transaction, under the
  write lock, and nothing deletes them); replaying them, an added entry did
  not exist, a replaced or removed one did, and a change's old value and
  ``old_commit_id`` are the value and commit the replay holds for it
  (writers read the current row, under the write lock, as the old value).
- ``revert_mismatch``: a revert commit's changes are the inverse of its
  target's: the same entries, added for removed, removed for added,
  replaced for replaced, writing back the target's old values.
- ``entry_unlogged``: every entry is in the replayed state, written by the
  commit the entry names (each write stores its commit id in the row and a
  change row for it in the same transaction).
- ``entry_value``: every entry's value (runner, tactic, policy) is the value
  its last change wrote (``new_*``; rows written before migration 0002 may
  lack it, and then only the commit is compared).
- ``entry_lost``: every entry the replay ends with exists (nothing is removed
  without a ``removed`` change).

Namespaced records (the same rules for the ``records`` and ``record_changes``
tables; the change log is replayed by the entries' replay, over the kind's
description, ``kinds.Kind``)
- ``orphan_record``: every record and record change names an existing
  fingerprint and commit.
- ``bad_record``: scopes are ``validate_scope``'s form, namespaces
  FlashInfer's, values canonical JSON (``records.canonical_value``).
- ``record_counts``: a commit's ``records_added``/``records_replaced``/
  ``records_removed`` equal its record change rows per action (a commit
  with record changes only is not empty).
- ``record_unlogged``: replaying the record changes in id order, each follows
  the log (the rules of ``bad_change`` and ``log_inconsistent``: an added
  record was absent, a replaced or removed one held the old value and commit
  the change names; every change but a removal holds the value it wrote),
  and the replay ends with exactly the stored records, each the value its
  commit wrote.
- ``record_revert_mismatch``: a revert commit's record changes are the
  inverse of its target's (as ``revert_mismatch`` for entries).

FlashInfer 0.7.4's protocol records (``protocol_records`` and
``protocol_record_changes``) are checked by the same code as the namespaced
records, over their own description (``kinds.PROTOCOL_KIND``), and reported as
``orphan_protocol``, ``bad_protocol``, ``protocol_counts``,
``protocol_unlogged`` and ``protocol_revert_mismatch`` (the records' rules; a
protocol record's value is canonical JSON FlashInfer could have written, its
policy an existing ``policies`` row).

``Checked`` counts the rows the data checks read, table by table, the
records tables included (``records``, ``record_changes``; the protocol
records' ``protocol_records`` and ``protocol_changes``, in ``as_json`` only
when not 0, so a registry without them reports as before).

Cost: one snapshot; SQLite's ``integrity_check``; four bulk SELECTs (every
row of every table, fetched in batches as the driver's tuples) and five
orphan joins; one pass over the changes in id order (the replay) and one
over the entries, holding only the replayed state (one item per live entry)
and the columns of each distinct key: keys, scopes and tactics are checked
once per distinct value. ``benchmarks/verify_100k.py`` (95k entries, 155k
changes, an 81 MB file): 4.7 s on SQLite on this busy 2-core machine (5-6.5 s
of CPU under load; ``integrity_check`` 0.5 s, ``parse_key`` about 2 s, one
call per distinct key), 4.9-5.8 s on PostgreSQL, 115 MB of memory. It grows
linearly: a 1M-entry registry takes about ten times as long and 1 GB; the
replay is kept anyway, being the one check that proves the entries are what
the history says.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from sys import intern
from typing import Any
from urllib.parse import quote

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import (
    Connection,
    Engine,
    Table,
    create_engine,
    event,
    inspect,
    or_,
    select,
    text,
)
from sqlalchemy.engine import URL
from sqlalchemy.exc import DatabaseError
from sqlalchemy.pool import NullPool

from ficache import protocol_records as proto
from ficache import records as rec
from ficache import schema
from ficache.errors import FingerprintError, RecordError, RegistryError, SchemaTooNewError
from ficache.fingerprint import ALL_FIELDS, Fingerprint
from ficache.flashinfer_format import canonical_json, check_namespace, parse_key, selection_json
from ficache.kind_read import present
from ficache.kinds import ACTIONS, ENTRY_KIND, PROTOCOL_KIND, RECORD_KIND, Kind
from ficache.models import COMMITS as C
from ficache.models import ENTRIES as E
from ficache.models import ENTRY_CHANGES as H
from ficache.models import FINGERPRINTS as F
from ficache.models import POLICIES as P
from ficache.models import PROTOCOL_RECORD_CHANGES as PH
from ficache.models import RECORD_CHANGES as RH
from ficache.models import Base
from ficache.policies import policy_digest
from ficache.registry import COMMIT_KINDS, validate_scope

#: Kinds of problems the records' checks report, with what each means.
_RECORD_KINDS = {
    "orphan_record": "a record or record change names a missing fingerprint or commit",
    "bad_record": "a record's scope, namespace or value is not what writers store",
    "record_counts": "a commit's record counts differ from its record changes",
    "record_unlogged": "a record is not what the record change log last wrote",
    "record_revert_mismatch": "a revert's record changes are not the inverse of its target's",
}
#: The same for FlashInfer 0.7.4's protocol records.
_PROTOCOL_KINDS = {
    "orphan_protocol": "a protocol record or its change names a missing fingerprint, commit "
    "or policy",
    "bad_protocol": "a protocol record's scope, namespace, key or value is not what writers store",
    "protocol_counts": "a commit's protocol record counts differ from its protocol record changes",
    "protocol_unlogged": "a protocol record is not what its change log last wrote",
    "protocol_revert_mismatch": "a revert's protocol record changes are not the inverse of its "
    "target's",
}


@dataclass(frozen=True)
class _Log:
    """What the replay needs of one kind beyond its description (``kinds.Kind``):
    the problem kinds its findings are reported as, and two facts of its history.

    - ``reports_empty``: this kind's count check also reports commits without
      changes of any kind (once, for every kind: the entries do it).
    - ``new_may_be_unknown``: changes may lack the value they wrote (entry
      changes recorded before migration 0002); otherwise that is a bad change.
    """

    kind: Kind
    change_noun: str  # how a message names one change row
    order: str  # a change out of commit order
    bad_change: str  # a change row's action or values are invalid
    log: str  # a change contradicts the replayed log
    counts: str  # a commit's counts differ from its change rows
    revert: str  # a revert does not invert its target
    counts_prefix: str = ""
    reports_empty: bool = False
    new_may_be_unknown: bool = False

    @functools.cached_property
    def change_columns(self) -> tuple[Any, ...]:
        """A change row as the replay reads it: id, commit, fingerprint, scope, the
        identity, action, old value, old commit, new value (policies by id)."""
        kind, changes = self.kind, self.kind.changes.c
        return (
            changes.id,
            changes.commit_id,
            changes.fingerprint_id,
            changes.scope,
            *(changes[name] for name in kind.identity),
            changes.action,
            *(changes[kind.old_column(name)] for name in kind.values),
            changes.old_commit_id,
            *(changes[kind.new_column(name) or ""] for name in kind.values),
        )

    @functools.cached_property
    def positions(self) -> tuple[int, int, int, int, tuple[int, ...]]:
        """Where ``change_columns`` put the action, the old value, the old commit and
        the new value; and which value columns a value always holds (not NULL).
        Computed once per kind by name, so that the replay (the bulk hot path, see
        ``_Verifier._replay``) reads each plain row tuple at positions."""
        at_action = 4 + len(self.kind.identity)
        at_old_commit = at_action + 1 + len(self.kind.values)
        required = tuple(
            i for i, name in enumerate(self.kind.values) if not self.kind.rows.c[name].nullable
        )
        return at_action, at_action + 1, at_old_commit, at_old_commit + 1, required


_ENTRY_LOG = _Log(
    ENTRY_KIND,
    "change",
    order="log_inconsistent",
    bad_change="bad_change",
    log="log_inconsistent",
    counts="commit_counts",
    revert="revert_mismatch",
    reports_empty=True,
    new_may_be_unknown=True,
)
_RECORD_LOG = _Log(
    RECORD_KIND,
    "record change",
    order="record_unlogged",
    bad_change="record_unlogged",
    log="record_unlogged",
    counts="record_counts",
    revert="record_revert_mismatch",
    counts_prefix="record changes: ",
)
_PROTOCOL_LOG = _Log(
    PROTOCOL_KIND,
    "protocol record change",
    order="protocol_unlogged",
    bad_change="protocol_unlogged",
    log="protocol_unlogged",
    counts="protocol_counts",
    revert="protocol_revert_mismatch",
    counts_prefix="protocol record changes: ",
)


@dataclass(frozen=True)
class _RecordCheck:
    """How one records-like kind (namespaced records, protocol records) is checked:
    its log, the problem kinds of its own rows, and what one row's columns must be."""

    log: _Log
    orphan: str
    bad: str
    #: ``problem(scope, namespace, key, values)``: why a row's columns are not what
    #: writers store, or None (``values``: the value columns, None where a change has none).
    problem: Callable[[str, str, str, Iterable[Any]], str | None]
    #: ``(column, parent table, what)`` each row and change row must find.
    parents: tuple[tuple[str, Table, str], ...] = ()


#: Every kind of problem, in report order, with what it means.
KINDS: dict[str, str] = {
    "integrity": "the database file or an index is damaged",
    "foreign_key": "foreign keys are violated or not enforced",
    "schema_revision": "the schema is not at this ficache's head",
    "schema_drift": "tables, columns or indexes differ from the models",
    "orphan_entry": "an entry's fingerprint, commit or policy is missing",
    "orphan_change": "a change's commit, fingerprint or policy is missing",
    "fingerprint_digest": "a fingerprint's digest does not match its fields",
    "bad_key": "a key does not parse as a FlashInfer key",
    "key_columns": "an entry's op or runner differs from its key",
    "bad_scope": "a scope is not 'shared' or '<layout>/rank<N>'",
    "bad_json": "a tactic or policy is not canonical JSON",
    "policy_digest": "a policy's digest is not the SHA-256 of its text",
    "bad_selection": "a selection is not the canonical JSON of an object",
    "duplicate_entry": "two entries share a fingerprint, scope and key",
    "bad_commit": "a commit's kind, provenance or reverted commit is invalid",
    "empty_commit": "a commit has no changes",
    "commit_counts": "a commit's counts differ from its change rows",
    "bad_change": "a change row's action or values are invalid",
    "log_inconsistent": "the change log contradicts itself",
    "revert_mismatch": "a revert's changes are not the inverse of its target's",
    "entry_unlogged": "an entry is not what the change log last wrote",
    "entry_value": "an entry's value differs from the value the log wrote",
    "entry_lost": "the change log holds an entry the entries table lacks",
    **_RECORD_KINDS,
    **_PROTOCOL_KINDS,
}

#: Foreign keys the orphan checks cover: ``(table, parent table)``.
_ORPHAN_CHECKED = {
    ("entries", "fingerprints"),
    ("entries", "commits"),
    ("entry_changes", "commits"),
    ("entry_changes", "fingerprints"),
    ("entries", "policies"),
    ("entry_changes", "policies"),
    ("commits", "commits"),
    ("records", "fingerprints"),
    ("records", "commits"),
    ("record_changes", "commits"),
    ("record_changes", "fingerprints"),
    ("protocol_records", "fingerprints"),
    ("protocol_records", "commits"),
    ("protocol_records", "policies"),
    ("protocol_record_changes", "commits"),
    ("protocol_record_changes", "fingerprints"),
    ("protocol_record_changes", "policies"),
}
_TABLES = (
    "fingerprints",
    "commits",
    "policies",
    "entries",
    "entry_changes",
    "records",
    "record_changes",
    "protocol_records",
    "protocol_record_changes",
)
_BATCH = 10_000  # rows fetched at a time
_Ident = tuple[int, str, str]  # (fingerprint id, scope, key): one entry
_KeyColumns = tuple[str, str]  # (op, runner) as entries store them
_INVERSE = {"added": "removed", "removed": "added", "replaced": "replaced"}


@dataclass(frozen=True)
class Problem:
    """One thing wrong: its kind (a key of ``KINDS``), where, and what."""

    kind: str
    message: str
    table: str | None = None
    row_id: int | None = None

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "table": self.table, "id": self.row_id, "message": self.message}


@dataclass(frozen=True)
class Checked:
    """How many rows of each table the data checks read."""

    fingerprints: int = 0
    entries: int = 0
    commits: int = 0
    changes: int = 0
    records: int = 0  # namespaced records (``records``)
    record_changes: int = 0
    policies: int = 0  # measurement policies (``policies``)
    protocol_records: int = 0  # FlashInfer 0.7.4's protocol records (``protocol_records``)
    protocol_changes: int = 0

    def as_json(self) -> dict[str, int]:
        """Every count; the protocol records' only when one is not 0."""
        out = asdict(self)
        if not (self.protocol_records or self.protocol_changes):
            del out["protocol_records"], out["protocol_changes"]
        return out


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` found; ``ok`` when nothing."""

    location: str
    backend: str
    revision: str | None
    head: str
    checked: Checked | None  # None: the data checks were skipped (see ``notes``)
    problems: tuple[Problem, ...]
    notes: tuple[str, ...] = ()  # what was not checked, and why

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def counts(self) -> tuple[tuple[str, int], ...]:
        """``(kind, problems)`` of each kind found, in ``KINDS`` order."""
        found = Counter(p.kind for p in self.problems)
        return tuple((kind, found[kind]) for kind in KINDS if found[kind])

    def examples(self, kind: str, limit: int) -> tuple[Problem, ...]:
        return tuple(p for p in self.problems if p.kind == kind)[:limit]

    def as_json(self) -> dict[str, Any]:
        return {
            "registry": self.location,
            "backend": self.backend,
            "read_only": True,
            "revision": self.revision,
            "head": self.head,
            "ok": self.ok,
            "checked": None if self.checked is None else self.checked.as_json(),
            "counts": dict(self.counts),
            "problems": [p.as_json() for p in self.problems],
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------
# Opening read-only.


def _read_only_engine(location: schema.Location) -> Engine:
    """An engine that cannot write ``location`` (checked like any opening first)."""
    engine, readonly = schema.make_engine(location, create=False)
    if location.path is None or readonly:
        return engine  # a server URL, or a SQLite file already opened immutable and read-only
    engine.dispose()  # never connected: it only validated the path
    url = URL.create(
        "sqlite",
        database=f"file:{quote(str(location.path))}",
        query={"mode": "ro", "uri": "true"},
    )
    engine = create_engine(url, poolclass=NullPool)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # transactions begin in "begin" below
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {schema.BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA query_only = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        conn.exec_driver_sql("BEGIN")  # one read transaction: one snapshot of the file

    return engine


def verify(db: str | os.PathLike[str] | None = None) -> VerifyReport:
    """Check the registry at ``db`` (as ``Registry.open`` resolves it) without writing it."""
    location = schema.resolve(db)
    engine = _read_only_engine(location)
    try:
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn = conn.execution_options(
                    isolation_level="REPEATABLE READ", postgresql_readonly=True
                )
            # A read-only transaction, ended by a rollback: a commit would have nothing
            # to write, and on a file whose damage the checks ran into, it raises.
            transaction = conn.begin()
            try:
                return _Verifier(conn, location).run()
            finally:
                with contextlib.suppress(DatabaseError):
                    transaction.rollback()
    except DatabaseError as exc:
        hot_journal = _hot_journal(location)
        if hot_journal is not None:
            # A writer killed mid-transaction in rollback-journal mode: SQLite
            # must roll it back before anyone reads, and that is a write.
            raise RegistryError(
                f"registry {location.display} holds a transaction a killed writer left "
                f"unfinished ({hot_journal.name}); open it once for writing (e.g. `ficache "
                "stats`) so SQLite rolls it back, then verify again"
            ) from None
        raise schema.translate_operational_error(exc, location) from None
    finally:
        engine.dispose()


def _hot_journal(location: schema.Location) -> Path | None:
    """The rollback journal a killed writer left beside a SQLite registry, if any."""
    if location.path is None:
        return None
    journal = location.path.with_name(location.path.name + "-journal")
    try:
        return journal if journal.stat().st_size > 0 else None
    except OSError:
        return None


# --------------------------------------------------------------------------
# The checks.


def _short(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _json_problem(value: str, *, is_policy: bool) -> str | None:
    """Why ``value`` is not what a writer stores (canonical JSON), or None."""

    def reject(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        parsed = json.loads(value, parse_constant=reject)
        canonical = canonical_json(parsed)
    except (ValueError, RecursionError):
        return "is not JSON"
    if canonical != value:
        return "is not canonical JSON"
    if is_policy and not isinstance(parsed, list):
        return "is not a JSON list"
    return None


def _selection_problem(value: str) -> str | None:
    """Why ``value`` is not a selection as writers store it (``selection_json``), or None."""

    def reject(name: str) -> Any:
        raise ValueError(f"non-standard JSON constant {name}")

    try:
        parsed = json.loads(value, parse_constant=reject)
    except (ValueError, RecursionError):
        return f"{_short(value)} is not JSON"
    try:
        canonical = selection_json(parsed)
    except (ValueError, RecursionError) as exc:
        return f"{_short(value)}: {exc}"
    if canonical != value:
        return f"{_short(value)} is not canonical JSON"
    return None


def _record_problem(
    scope: str, namespace: str, _key: str, values: Iterable[str | None]
) -> str | None:
    """Why a record's scope, namespace or a value is not what writers store, or None."""
    try:
        if validate_scope(scope) != scope:
            return f"scope {scope[:80]!r} is not in its canonical form"
        check_namespace(namespace)
        for value in values:
            if value is not None:
                rec.canonical_value(value)
    except (ValueError, RecordError) as exc:
        return str(exc)
    return None


def _protocol_problem(scope: str, namespace: str, key: str, values: Iterable[Any]) -> str | None:
    """Why a protocol record's scope, namespace, key or value is not what writers store, or
    None (its policy, an id, is checked as an orphan and by ``policy_digest``)."""
    value = next(iter(values))
    try:
        if validate_scope(scope) != scope:
            return f"scope {scope[:80]!r} is not in its canonical form"
        proto.check_protocol_identity(namespace, key)
        if value is not None and proto.protocol_value_json(json.loads(value)) != value:
            return f"value {_short(value)} is not canonical JSON"
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


_RECORDS_CHECK = _RecordCheck(
    _RECORD_LOG,
    "orphan_record",
    "bad_record",
    _record_problem,
    (("fingerprint_id", F, "fingerprint"), ("commit_id", C, "commit")),
)
_PROTOCOL_CHECK = _RecordCheck(
    _PROTOCOL_LOG,
    "orphan_protocol",
    "bad_protocol",
    _protocol_problem,
    (
        ("fingerprint_id", F, "fingerprint"),
        ("commit_id", C, "commit"),
        ("policy_id", P, "policy"),
        ("old_policy_id", P, "old policy"),
        ("new_policy_id", P, "new policy"),
    ),
)


class _Verifier:
    def __init__(self, conn: Connection, location: schema.Location) -> None:
        self.conn = conn
        self.location = location
        self.backend = conn.dialect.name
        self.problems: list[Problem] = []
        self.notes: list[str] = []
        # Values already checked (keys, scopes and tactics repeat across rows).
        self._good_keys: dict[str, _KeyColumns] = {}
        self._bad_keys: dict[str, str] = {}
        self._good_scopes: set[str] = set()
        self._good_tactics: set[str] = set()

    def problem(
        self, kind: str, message: str, table: str | None = None, row_id: int | None = None
    ) -> None:
        self.problems.append(Problem(kind, message, table, row_id))

    def report(self, revision: str | None, checked: Checked | None = None) -> VerifyReport:
        return VerifyReport(
            self.location.display,
            self.backend,
            revision,
            schema.head_revision(),
            checked,
            tuple(self.problems),
            tuple(self.notes),
        )

    def run(self) -> VerifyReport:
        try:
            revision = schema.check_revision(self.conn, self.location)  # foreign: raise
            newer = False
        except SchemaTooNewError:  # reported, with what storage checks can still say
            revision, newer = schema.current_revision(self.conn), True
        if revision is None and not inspect(self.conn).get_table_names():
            raise RegistryError(
                f"no registry in {self.location.display}; import a cache file first "
                "(ficache import FILE)"
            )
        if self.backend == "sqlite":
            self._sqlite_storage()
        elif self.backend == "postgresql":
            self._postgres_storage()
        if any(p.kind == "integrity" for p in self.problems):
            self.notes.append("data checks skipped: the database is damaged")
            return self.report(revision)
        head = schema.head_revision()
        if newer:
            self.problem(
                "schema_revision",
                f"schema is at {revision}, newer than this ficache knows (head {head}); "
                "upgrade ficache (pip install -U ficache) to check its data",
            )
            self.notes.append("data checks skipped: the schema is newer than this ficache")
            return self.report(revision)
        found = schema.features_of(revision) if revision != head else schema.COMPLETE
        if found is not None and not found.complete:
            # An older schema this code reads and writes as it is (rolling upgrades): every
            # check runs over what it holds; what it lacks reads as absent.
            self.conn = self.conn.execution_options(**{schema.FEATURES_OPTION: found})
            self.notes.append(
                f"schema is at {revision}, older than head {head}: it lacks "
                + ", ".join(adds for _rev, adds in found.lacking)
                + " (ficache db upgrade adds them once every ficache that writes it reads them)"
            )
        elif revision != head:
            self.problem(
                "schema_revision",
                f"schema is at {revision or '(no revision)'}, head is {head}; "
                "upgrade it (ficache db upgrade)",
            )
            self.notes.append("data checks skipped: they need the schema at head")
            return self.report(revision)
        if self._schema_drift():
            self.notes.append("data checks skipped: the schema lacks tables or columns")
            return self.report(revision)
        self._orphans()
        return self.report(revision, self._rows())

    # -- storage -----------------------------------------------------------

    def _sqlite_storage(self) -> None:
        try:
            for (line,) in self.conn.exec_driver_sql("PRAGMA integrity_check"):
                if line != "ok":
                    self.problem("integrity", f"integrity_check: {line}")
        except DatabaseError as exc:
            # Damage that stops the check itself midway (a page it cannot walk) is
            # found damage too, reported as such rather than as a failure to verify.
            self.problem("integrity", f"integrity_check stopped: {exc.orig or exc}")
        if self.problems:  # reading foreign keys through damaged pages raises
            return
        for table, rowid, parent, _fkid in self.conn.exec_driver_sql("PRAGMA foreign_key_check"):
            if (table, parent) not in _ORPHAN_CHECKED:
                self.problem(
                    "foreign_key",
                    f"{table} row {rowid} refers to a missing {parent} row",
                    table,
                    rowid,
                )

    def _postgres_storage(self) -> None:
        """What the catalogue says of the registry's indexes, constraints and
        triggers, then, where ``amcheck`` is installed, each B-tree index's structure."""
        tables = {"tables": list(_TABLES)}
        self._postgres_catalogue(tables)
        self._postgres_index_structure(tables)

    def _postgres_catalogue(self, tables: dict[str, list[str]]) -> None:
        """Invalid indexes, unvalidated constraints and disabled foreign key triggers."""
        for table, index in self.conn.execute(
            text(
                "SELECT t.relname, i.relname FROM pg_index x "
                "JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid "
                "WHERE t.relnamespace = current_schema()::regnamespace "
                "AND t.relname = ANY(:tables) AND NOT x.indisvalid ORDER BY 1, 2"
            ),
            tables,
        ):
            self.problem("integrity", f"index {index} of {table} is invalid; REINDEX it", table)
        for table, constraint in self.conn.execute(
            text(
                "SELECT t.relname, c.conname FROM pg_constraint c "
                "JOIN pg_class t ON t.oid = c.conrelid "
                "WHERE t.relnamespace = current_schema()::regnamespace "
                "AND t.relname = ANY(:tables) AND NOT c.convalidated ORDER BY 1, 2"
            ),
            tables,
        ):
            self.problem(
                "foreign_key", f"constraint {constraint} of {table} is not validated", table
            )
        for table, disabled in self.conn.execute(
            text(
                "SELECT t.relname, count(*) FROM pg_trigger g JOIN pg_class t ON t.oid = g.tgrelid "
                "WHERE t.relnamespace = current_schema()::regnamespace "
                "AND t.relname = ANY(:tables) AND g.tgisinternal AND g.tgenabled = 'D' "
                "GROUP BY 1 ORDER BY 1"
            ),
            tables,
        ):
            self.problem(
                "foreign_key",
                f"{disabled} internal trigger(s) of {table} are disabled, so its foreign keys "
                "are not enforced (ALTER TABLE ... ENABLE TRIGGER ALL)",
                table,
            )

    def _postgres_index_structure(self, tables: dict[str, list[str]]) -> None:
        """``bt_index_check`` of every valid B-tree index, or a note without ``amcheck``."""
        has_amcheck = self.conn.execute(
            text("SELECT count(*) FROM pg_extension WHERE extname = 'amcheck'")
        ).scalar_one()
        if not has_amcheck:
            self.notes.append(
                "PostgreSQL: the amcheck extension is not installed, so index structure was "
                "not checked (CREATE EXTENSION amcheck enables it)"
            )
            return
        indexes = self.conn.execute(
            text(
                "SELECT i.oid, i.relname, t.relname FROM pg_index x "
                "JOIN pg_class i ON i.oid = x.indexrelid JOIN pg_class t ON t.oid = x.indrelid "
                "JOIN pg_am a ON a.oid = i.relam "
                "WHERE t.relnamespace = current_schema()::regnamespace "
                "AND t.relname = ANY(:tables) AND a.amname = 'btree' AND x.indisvalid "
                "ORDER BY 2"
            ),
            tables,
        ).all()
        for oid, index, table in indexes:
            try:
                with self.conn.begin_nested():
                    self.conn.execute(text("SELECT bt_index_check(:oid)"), {"oid": oid})
            except DatabaseError as exc:
                detail = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
                self.problem("integrity", f"index {index} of {table}: {detail}", table)

    # -- schema ------------------------------------------------------------

    def _schema_drift(self) -> bool:
        """Report differences from the models; True when a table or column is missing."""
        context = MigrationContext.configure(
            self.conn, opts={"compare_type": True, "compare_server_default": True}
        )
        missing = False
        lacks = schema.features(self.conn)
        for diff in compare_metadata(context, Base.metadata):
            if _lacked(diff, lacks):
                continue
            self.problem("schema_drift", _describe_diff(diff))
            missing |= not isinstance(diff, list) and diff[0] in ("add_table", "add_column")
        return missing

    # -- orphans (SQL, on every backend) -------------------------------------

    def _orphans(self) -> None:
        checks: list[tuple[str, Table, str, Table, str]] = [
            ("orphan_entry", E, "fingerprint_id", F, "fingerprint"),
            ("orphan_entry", E, "commit_id", C, "commit"),
            ("orphan_change", H, "commit_id", C, "commit"),
            ("orphan_change", H, "fingerprint_id", F, "fingerprint"),
            ("orphan_entry", E, "policy_id", P, "policy"),
            ("orphan_change", H, "old_policy_id", P, "old policy"),
            ("orphan_change", H, "new_policy_id", P, "new policy"),
        ]
        for kind, child, column, parent, what in checks:
            ref = child.c[column]
            query = (
                select(child.c.id, ref)
                .select_from(child.outerjoin(parent, parent.c.id == ref))
                .where(ref.is_not(None), parent.c.id.is_(None))
                .order_by(child.c.id)
            )
            noun = "entry" if child is E else "change"
            for row_id, missing in self.conn.execute(query):
                self.problem(
                    kind, f"{noun} {row_id}: {what} {missing} is missing", child.name, row_id
                )
        target = C.alias("target")
        query = (
            select(C.c.id, C.c.reverts_commit_id)
            .select_from(C.outerjoin(target, target.c.id == C.c.reverts_commit_id))
            .where(C.c.reverts_commit_id.is_not(None), target.c.id.is_(None))
            .order_by(C.c.id)
        )
        for row_id, missing in self.conn.execute(query):
            self.problem(
                "bad_commit",
                f"commit {row_id} reverts commit {missing}, which is missing",
                "commits",
                row_id,
            )

    # -- rows ----------------------------------------------------------------

    def _stream(self, query: Any) -> Iterator[tuple[Any, ...]]:
        """The rows of ``query`` as the driver's plain tuples, a batch at a time, so no
        table is held in Python objects whole (psycopg keeps the raw result)."""
        result = self.conn.execute(query)  # not stream_results: it would buffer rows ahead
        try:
            while batch := result.cursor.fetchmany(_BATCH):
                yield from batch
        except self.conn.dialect.loaded_dbapi.Error as exc:
            raise DatabaseError(str(query), None, exc) from None
        finally:
            result.close()

    def _parse_key(self, key: str) -> _KeyColumns | str:
        """``key``'s columns, or why it does not parse; remembered (keys repeat)."""
        known = self._bad_keys.get(key)
        if known is not None:
            return known
        try:
            fields = parse_key(key)
        except ValueError as exc:
            self._bad_keys[key] = str(exc)
            return str(exc)
        # Ops and runners repeat across keys: keep one copy of each.
        columns = (intern(fields.op), intern(fields.runner))
        self._good_keys[key] = columns
        return columns

    def _scope_is_valid(self, scope: str) -> bool:
        try:
            valid = validate_scope(scope) == scope
        except ValueError:
            valid = False
        if valid:
            self._good_scopes.add(scope)
        return valid

    def _check_json(self, where: tuple[str, int], label: str, value: str) -> None:
        why = _json_problem(value, is_policy=False)
        if why is None:
            self._good_tactics.add(value)
            return
        table, row_id = where
        noun = "entry" if table == "entries" else "change"
        self.problem("bad_json", f"{noun} {row_id}: {label} {_short(value)} {why}", *where)

    def _policies(self) -> int:
        """Check every stored policy's text and digest; return how many there are."""
        count = 0
        rows = self._stream(select(P.c.id, P.c.digest, P.c.policy).order_by(P.c.id))
        for pid, digest, policy in rows:
            count += 1
            where = ("policies", pid)
            why = _json_problem(policy, is_policy=True)
            if why is not None:
                self.problem("bad_json", f"policy {pid}: {_short(policy)} {why}", *where)
            if digest != policy_digest(policy):
                self.problem(
                    "policy_digest",
                    f"policy {pid}: digest {_short(digest)} is not the SHA-256 of its text",
                    *where,
                )
        return count

    def _check_row(
        self,
        where: tuple[str, int],
        scope: str,
        key: str,
        tactics: tuple[tuple[str, str | None], ...],
    ) -> _KeyColumns | None:
        """Scope, key and JSON tactics of one entry or change; the key's columns when it parses."""
        table, row_id = where
        noun = "entry" if table == "entries" else "change"
        if scope not in self._good_scopes and not self._scope_is_valid(scope):
            self.problem("bad_scope", f"{noun} {row_id}: scope {_short(scope)} is invalid", *where)
        columns = self._good_keys.get(key)
        if columns is None:
            parsed = self._parse_key(key)
            if isinstance(parsed, str):
                self.problem(
                    "bad_key",
                    f"{noun} {row_id}: key {_short(key)} does not parse: {parsed}",
                    *where,
                )
            else:
                columns = parsed
        for label, tactic in tactics:
            if tactic is not None and tactic not in self._good_tactics:
                self._check_json(where, f"{label}tactic", tactic)
        return columns

    def _rows(self) -> Checked:
        fingerprints = list(
            self._stream(
                select(
                    F.c.id,
                    F.c.digest,
                    *(F.c[n] for n in ALL_FIELDS),
                    schema.features(self.conn).column(F, "measurement"),
                )
            )
        )
        commits = list(
            self._stream(
                select(
                    C.c.id,
                    C.c.kind,
                    C.c.added,
                    C.c.replaced,
                    C.c.removed,
                    C.c.provenance,
                    C.c.reverts_commit_id,
                ).order_by(C.c.id)
            )
        )
        self._fingerprints(fingerprints)
        reverts = self._commits(commits)
        record_commits = self._changing_commits((RH, PH))
        changes = self._stream(select(*_ENTRY_LOG.change_columns).order_by(H.c.id))
        state, n_changes = self._replay(
            _ENTRY_LOG, changes, reverts, self._entry_change, record_commits
        )
        entries = self._stream(
            select(
                E.c.id,
                E.c.fingerprint_id,
                E.c.scope,
                E.c.key,
                E.c.op,
                E.c.runner,
                E.c.tactic,
                E.c.policy_id,
                E.c.commit_id,
            ).order_by(E.c.id)
        )
        n_entries = self._entries(entries, state)
        n_policies = self._policies()
        self._selections()
        n_records, n_record_changes = self._records(_RECORDS_CHECK, reverts)
        n_protocol, n_protocol_changes = self._records(_PROTOCOL_CHECK, reverts)
        return Checked(
            len(fingerprints),
            n_entries,
            len(commits),
            n_changes,
            n_records,
            n_record_changes,
            n_policies,
            n_protocol,
            n_protocol_changes,
        )

    def _changing_commits(self, change_tables: Iterable[Table]) -> set[int]:
        """The ids of the commits with a row in any of ``change_tables`` (a table an older
        schema lacks holds none)."""
        holds = schema.features(self.conn).has_table
        return {
            cid
            for changes in change_tables
            if holds(changes.name)
            for (cid,) in self.conn.execute(select(changes.c.commit_id).distinct())
        }

    def _selections(self) -> None:
        """``bad_selection``: the selections stored (most rows hold none), each value once."""
        good: set[str] = set()

        def check(noun: str, where: tuple[str, int], label: str, value: str) -> None:
            if value in good:
                return
            why = _selection_problem(value)
            if why is None:
                good.add(value)
            else:
                self.problem("bad_selection", f"{noun} {where[1]}: {label} {why}", *where)

        for eid, selection in self._stream(
            select(E.c.id, E.c.selection).where(E.c.selection.is_not(None)).order_by(E.c.id)
        ):
            check("entry", ("entries", eid), "selection", selection)
        for hid, old, new in self._stream(
            select(H.c.id, H.c.old_selection, H.c.new_selection)
            .where(or_(H.c.old_selection.is_not(None), H.c.new_selection.is_not(None)))
            .order_by(H.c.id)
        ):
            for label, value in (("old selection", old), ("new selection", new)):
                if value is not None:
                    check("change", ("entry_changes", hid), label, value)

    def _fingerprints(self, rows: Iterable[tuple[Any, ...]]) -> None:
        for fid, digest, *values, measurement in rows:
            try:
                fp = Fingerprint(
                    **dict(zip(ALL_FIELDS, values, strict=True)), measurement=measurement or ""
                )
            except FingerprintError as exc:
                self.problem("fingerprint_digest", f"fingerprint {fid}: {exc}", "fingerprints", fid)
                continue
            if fp.digest != digest:
                self.problem(
                    "fingerprint_digest",
                    f"fingerprint {fid}: digest {str(digest)[:12]} is not its fields' "
                    f"{fp.digest[:12]}",
                    "fingerprints",
                    fid,
                )

    def _commits(self, rows: Iterable[tuple[Any, ...]]) -> dict[int, int]:
        """Check each commit's own columns; return ``{revert commit: its target}``."""
        reverts: dict[int, int] = {}
        for cid, kind, _added, _replaced, _removed, provenance, target in rows:
            where = ("commits", cid)
            if kind not in COMMIT_KINDS:
                self.problem("bad_commit", f"commit {cid}: unknown kind {_short(kind)}", *where)
            reverts_to = None
            if provenance is not None:
                try:
                    loaded = json.loads(provenance)
                except (ValueError, RecursionError):
                    loaded = None
                if not isinstance(loaded, dict):
                    self.problem(
                        "bad_commit", f"commit {cid}: provenance is not a JSON object", *where
                    )
                else:
                    reverts_to = loaded.get("revert_to")
            if kind == "revert" and target is None and isinstance(reverts_to, int):
                if not 0 < reverts_to < cid:
                    self.problem(
                        "bad_commit",
                        f"commit {cid} reverts to commit {reverts_to}, not an earlier one",
                        *where,
                    )
            elif kind == "revert" and target is None:
                self.problem("bad_commit", f"commit {cid}: a revert without its target", *where)
            elif kind != "revert" and target is not None:
                self.problem(
                    "bad_commit", f"commit {cid}: a {kind} commit names a reverted commit", *where
                )
            elif target is not None and target >= cid:
                self.problem(
                    "bad_commit",
                    f"commit {cid} reverts commit {target}, not an earlier one",
                    *where,
                )
            elif target is not None:
                reverts[cid] = target
        return reverts

    def _entries(self, rows: Iterable[tuple[Any, ...]], state: dict[_Ident, Any]) -> int:
        """Check each entry's own columns and that it is what the log ends with.

        ``state`` is ``_replay``'s; each entry found in it is marked with the
        entry's id, so a second entry with its identity is a duplicate and
        what stays unmarked was lost. Returns the number of entries.
        """
        count = 0
        for eid, fid, scope, key, op, runner, tactic, policy, cid in rows:
            count += 1
            where = ("entries", eid)
            columns = self._check_row(where, scope, key, (("", tactic),))
            if columns is not None and (op, runner) != columns:
                self._key_columns_differ(where, key, (op, runner), columns)
            ident = (fid, scope, key)
            logged = state.get(ident)
            state[ident] = eid
            if isinstance(logged, int):
                self.problem(
                    "duplicate_entry",
                    f"entry {eid} repeats entry {logged} (fingerprint {fid}, scope {scope}, "
                    f"key {_short(key)})",
                    *where,
                )
            elif logged is None:
                self.problem(
                    "entry_unlogged", f"entry {eid}: no change in the log holds it", *where
                )
            elif logged[0] != cid:
                self.problem(
                    "entry_unlogged",
                    f"entry {eid} names commit {cid}, its last change is in commit {logged[0]}",
                    *where,
                )
            elif logged[1] is not None and logged[1:] != (runner, tactic, policy):
                self.problem(
                    "entry_value",
                    f"entry {eid}: value differs from the one commit {cid} wrote",
                    *where,
                )
        self._lost_entries(state)
        return count

    def _key_columns_differ(
        self, where: tuple[str, int], key: str, stored: _KeyColumns, parsed: _KeyColumns
    ) -> None:
        """``key_columns``: an entry's stored (op, runner) are not what its key parses to."""
        differ = [
            name
            for name, stored_value, parsed_value in zip(
                ("op", "runner"), stored, parsed, strict=True
            )
            if stored_value != parsed_value
        ]
        self.problem(
            "key_columns",
            f"entry {where[1]}: {' and '.join(differ)} "
            f"{'differs' if len(differ) == 1 else 'differ'} from its key {_short(key)}",
            *where,
        )

    def _lost_entries(self, state: dict[_Ident, Any]) -> None:
        """``entry_lost``: what the log ends with that no entry marked (``_entries``)."""
        for (fid, scope, key), logged in state.items():
            if not isinstance(logged, int):
                self.problem(
                    "entry_lost",
                    f"commit {logged[0]} wrote an entry that is missing (fingerprint {fid}, "
                    f"scope {scope}, key {_short(key)})",
                )

    def _entry_change(self, where: tuple[str, int], row: tuple[Any, ...]) -> None:
        """Scope, key and tactics of one entry change (``_ENTRY_LOG.change_columns``)."""
        _hid, _cid, _fid, scope, key, _action, _runner, old_tactic, *_old, new_tactic, _new = row
        if not (  # the common case, values the entries already showed valid, inline
            scope in self._good_scopes
            and key in self._good_keys
            and (old_tactic is None or old_tactic in self._good_tactics)
            and (new_tactic is None or new_tactic in self._good_tactics)
        ):
            self._check_row(where, scope, key, (("old ", old_tactic), ("new ", new_tactic)))

    def _records(self, check: _RecordCheck, reverts: Mapping[int, int]) -> tuple[int, int]:
        """One records-like kind's tables (``check``): orphans, then the replay of its
        change log (the entries' rules), then every stored row against it. Returns the
        numbers of rows and changes read."""
        kind = check.log.kind
        if not present(self.conn, kind):
            return 0, 0
        for table, name in ((kind.rows, kind.name), (kind.changes, check.log.change_noun)):
            for column, parent, what in check.parents:
                if column not in table.c:
                    continue
                ref = table.c[column]
                query = (
                    select(table.c.id, ref)
                    .select_from(table.outerjoin(parent, parent.c.id == ref))
                    .where(ref.is_not(None), parent.c.id.is_(None))
                    .order_by(table.c.id)
                )
                for row_id, missing in self.conn.execute(query):
                    self.problem(
                        check.orphan,
                        f"{name} {row_id}: {what} {missing} is missing",
                        table.name,
                        row_id,
                    )
        other_commits = self._changing_commits(t for t in (H, RH, PH) if t is not kind.changes)
        changes = self._stream(select(*check.log.change_columns).order_by(kind.changes.c.id))

        def check_change(where: tuple[str, int], row: tuple[Any, ...]) -> None:
            at_action, at_old, at_old_commit, at_new, _required = check.log.positions
            _hid, _cid, _fid, scope, namespace, key = row[:at_action]
            for values in (row[at_old:at_old_commit], row[at_new:]):
                problem = check.problem(scope, namespace, key, values)
                if problem is not None:
                    self.problem(check.bad, f"{check.log.change_noun} {row[0]}: {problem}", *where)
                    return

        state, n_changes = self._replay(check.log, changes, reverts, check_change, other_commits)
        return self._stored_records(check, state), n_changes

    def _stored_records(self, check: _RecordCheck, state: dict[tuple[Any, ...], Any]) -> int:
        """Every stored row of ``check``'s kind is what the replayed log ends with;
        returns their number."""
        kind = check.log.kind
        rows, name, unlogged = kind.rows, kind.name, check.log.log
        count = 0
        for rid, fid, scope, ns, key, *value, cid in self._stream(
            select(
                rows.c.id,
                *(rows.c[n] for n in kind.identity_columns),
                *(rows.c[n] for n in kind.values),
                rows.c.commit_id,
            ).order_by(rows.c.id)
        ):
            count += 1
            problem = check.problem(scope, ns, key, value)
            if problem is not None:
                self.problem(check.bad, f"{name} {rid}: {problem}", rows.name, rid)
            logged = state.pop((fid, scope, ns, key), None)
            if logged is None:
                self.problem(unlogged, f"{name} {rid}: no {name} change holds it", rows.name, rid)
            elif logged != (cid, *value):
                self.problem(
                    unlogged,
                    f"{name} {rid} is not what commit {logged[0]} wrote",
                    rows.name,
                    rid,
                )
        for (fid, scope, ns, key), (cid, *_value) in state.items():
            self.problem(
                unlogged,
                f"commit {cid} wrote a {name} that is missing (fingerprint {fid}, scope {scope}, "
                f"namespace {ns[:80]}, key {key[:80]!r})",
            )
        return count

    def _replay(
        self,
        log: _Log,
        rows: Iterable[tuple[Any, ...]],
        reverts: Mapping[int, int],
        check_row: Callable[[tuple[str, int], tuple[Any, ...]], None],
        other_changes: set[int],
    ) -> tuple[dict[tuple[Any, ...], Any], int]:
        """Check every change of ``log``'s kind, in commit order, replaying its log.

        ``rows`` are ``log.change_columns``, in change id order; ``check_row``
        checks one row's own columns, ``_replay_change`` its action and values
        against the log. Then each commit's counts (``_check_counts``;
        ``other_changes``: the commits with changes of other kinds) and each
        revert, on the rows of reverts and their targets kept on the way.
        Returns the rows the log ends with, ``identity -> (commit, *value)``
        (the value's first column None when the log does not hold it: an entry
        change recorded before migration 0002), and the number of changes.

        This is verify's bulk hot path: it (with ``_replay_change``,
        ``_check_against_log`` and ``_check_revert``) sees every change row of
        the registry, 155,400 in ``benchmarks/verify_100k.py``, where all of
        verify takes 5.5 s. So rows stay the driver's plain tuples
        (``_stream``), read at positions computed once per kind from its
        description (``_Log.positions``), not named per row: making each row a
        namedtuple and reading it by name measured 0.30 s against 0.09 s for
        the positional reads of 155,400 such rows (a loop of the reads alone,
        best of 7).
        """
        kept_for_reverts = set(reverts) | set(reverts.values())
        by_commit: dict[int, list[tuple[Any, ...]]] = {}
        counts: Counter[tuple[int, str]] = Counter()  # (commit, action) -> changes
        state: dict[tuple[Any, ...], Any] = {}
        in_commit: set[tuple[Any, ...]] = set()  # identities the current commit changed
        last_commit = None
        table, at_action = log.kind.changes.name, log.positions[0]
        for row in rows:
            hid, cid = row[0], row[1]
            counts[cid, row[at_action]] += 1
            where = (table, hid)
            if cid != last_commit:
                if last_commit is not None and cid < last_commit:
                    self.problem(
                        log.order,
                        f"{log.change_noun} {hid} of commit {cid} follows changes of commit "
                        f"{last_commit}",
                        *where,
                    )
                in_commit.clear()
                last_commit = cid
            if cid in kept_for_reverts:
                by_commit.setdefault(cid, []).append(row)
            check_row(where, row)
            self._replay_change(log, where, row, state, in_commit)
        self._check_counts(log, counts, other_changes)
        for cid, target in sorted(reverts.items()):
            self._check_revert(log, cid, target, by_commit.get(cid, []), by_commit.get(target, []))
        return state, counts.total()

    def _replay_change(
        self,
        log: _Log,
        where: tuple[str, int],
        row: tuple[Any, ...],
        state: dict[tuple[Any, ...], Any],
        in_commit: set[tuple[Any, ...]],
    ) -> None:
        """One change of ``_replay``: its action, its identity once in its commit, the
        old and new values its action needs, then the log's ``state`` moved past it."""
        problem, noun, item = self.problem, log.change_noun, log.kind.name
        at_action, at_old, at_old_commit, at_new, required = log.positions
        hid, cid, action = row[0], row[1], row[at_action]
        if action not in _INVERSE:
            problem(log.bad_change, f"{noun} {hid}: unknown action {_short(str(action))}", *where)
            return
        ident = row[2:at_action]  # (fingerprint id, scope, *identity)
        if ident in in_commit:
            problem(
                log.bad_change,
                f"{noun} {hid}: a second change to its {item} in commit {cid}",
                *where,
            )
        in_commit.add(ident)
        old = row[at_old:at_old_commit]
        new = row[at_new:]
        first_required = required[0]
        if action == "added" and old[first_required] is not None:
            problem(log.bad_change, f"{noun} {hid}: an added {item} with an old value", *where)
        if action != "added" and any(old[i] is None for i in required):
            problem(
                log.bad_change, f"{noun} {hid}: a {action} {item} without its old value", *where
            )
        if action == "removed" and any(v is not None for v in new):
            problem(log.bad_change, f"{noun} {hid}: a removed {item} with a new value", *where)
        elif action != "removed" and not log.new_may_be_unknown and new[first_required] is None:
            problem(
                log.bad_change, f"{noun} {hid}: a {action} {item} without its new value", *where
            )
        self._check_against_log(log, where, row, state.get(ident))
        if action == "removed":
            state.pop(ident, None)
        else:
            state[ident] = (cid, *new)

    def _check_against_log(
        self, log: _Log, where: tuple[str, int], row: tuple[Any, ...], before: Any
    ) -> None:
        """A change agrees with ``before``, what the log held for its identity (None:
        nothing): an add finds nothing, another action finds the old commit and value."""
        noun, item = log.change_noun, log.kind.name
        at_action, at_old, at_old_commit, _at_new, _required = log.positions
        hid, cid, action = row[0], row[1], row[at_action]
        if action == "added":
            if before is not None:
                self.problem(
                    log.log,
                    f"{noun} {hid} (commit {cid}) adds an {item} commit {before[0]} holds",
                    *where,
                )
        elif before is None:
            self.problem(
                log.log,
                f"{noun} {hid} (commit {cid}): {action} an {item} no earlier change holds",
                *where,
            )
        else:
            old_cid = row[at_old_commit]
            if old_cid != before[0]:
                self.problem(
                    log.log,
                    f"{noun} {hid} (commit {cid}): old commit {old_cid}, the log's {before[0]}",
                    *where,
                )
            if before[1] is not None and row[at_old:at_old_commit] != before[1:]:
                self.problem(
                    log.log,
                    f"{noun} {hid} (commit {cid}): old value is not the one commit "
                    f"{before[0]} wrote",
                    *where,
                )

    def _check_counts(
        self, log: _Log, counts: Counter[tuple[int, str]], other_changes: set[int]
    ) -> None:
        """A commit's counts of ``log``'s kind equal its change rows per action; with
        ``log.reports_empty``, a commit without changes of any kind is reported once."""
        has_changes = {cid for cid, _action in counts}
        columns = [C.c[log.kind.count_column(action)] for action in ACTIONS]
        for cid, *stored in self._stream(select(C.c.id, *columns).order_by(C.c.id)):
            if (
                log.reports_empty
                and cid not in has_changes
                and cid not in other_changes
                and not any(stored)
            ):
                self.problem("empty_commit", f"commit {cid} has no changes", "commits", cid)
                continue
            differ = [
                f"{counts[cid, action]} {action} (the commit says {said})"
                for action, said in zip(ACTIONS, stored, strict=True)
                if counts[cid, action] != said
            ]
            if differ:
                self.problem(
                    log.counts,
                    f"commit {cid} has {log.counts_prefix}{', '.join(differ)}",
                    "commits",
                    cid,
                )

    def _check_revert(
        self,
        log: _Log,
        cid: int,
        target: int,
        done: list[tuple[Any, ...]],
        undone: list[tuple[Any, ...]],
    ) -> None:
        """A revert's changes of ``log``'s kind are the inverse of its target's: the same
        rows, added for removed, removed for added, replaced for replaced, writing back
        the target's old values."""
        at_action, at_old, at_old_commit, at_new, _required = log.positions
        expected = {r[2:at_action]: r for r in undone}
        wrong = 0
        for row in done:
            original = expected.pop(row[2:at_action], None)
            if original is None or row[at_action] != _INVERSE.get(original[at_action]):
                wrong += 1
                continue
            # What it wrote back (unknown in rows from before 0002) is what the target replaced.
            wrong += (
                row[at_action] != "removed"
                and row[at_new] is not None
                and row[at_new:] != original[at_old:at_old_commit]
            )
        wrong += len(expected)
        if wrong:
            self.problem(
                log.revert,
                f"commit {cid} reverts commit {target}, but {wrong} of its {log.kind.plural} "
                "do not undo it",
                "commits",
                cid,
            )


def _lacked(diff: Any, lacks: schema.SchemaFeatures) -> bool:
    """Whether ``compare_metadata``'s ``diff`` is a table, column or index an older schema
    lacks by design (``schema.SchemaFeatures``), not drift."""
    if isinstance(diff, list) or not str(diff[0]).startswith("add_"):
        return False
    if diff[0] == "add_column":  # (op, schema, table, column)
        return not lacks.has_column(str(diff[2]), diff[3].name)
    obj = diff[1]
    table = obj if isinstance(obj, Table) else getattr(obj, "table", None)
    return table is not None and not lacks.has_table(table.name)


def _describe_diff(diff: Any) -> str:
    """One line for one of Alembic's ``compare_metadata`` differences (what the
    database has, against the models)."""
    if isinstance(diff, list):  # modify_* ops come as a list of tuples
        return "; ".join(_describe_diff(d) for d in diff)
    op, *args = diff
    action, _, what = str(op).partition("_")
    if action == "modify":  # (op, schema, table, column, ...)
        return f"{what} of column {'.'.join(str(a) for a in args[1:3])} differs from the model"
    obj = next((a for a in args if not isinstance(a, str) and hasattr(a, "name")), None)
    table = getattr(getattr(obj, "table", None), "name", None)
    name = f"{table}.{obj.name}" if obj is not None and table else str(getattr(obj, "name", args))
    if action == "add":
        return f"{what} {name} is missing"
    if action == "remove":
        return f"unexpected {what} {name}"
    return f"{op} {name}"
