"""The registry: queries, transactional commits, exports, prune (revert plans: ``ficache.revert``).

Invariants:
- Every write is one transaction that adds exactly one ``commits`` row with
  its provenance and counts, and one ``entry_changes`` row per entry it
  added, replaced or removed (keeping the replaced value). A write that
  would change nothing adds nothing and returns ``commit_id=None``.
- A write either commits whole or leaves the registry exactly as it was.
  Writers queue on the registry's write lock (``BEGIN IMMEDIATE`` on SQLite,
  an advisory lock on PostgreSQL) and retry when the lock is busy past the
  busy timeout.
- Exports render stored JSON fragments; a stored key is exported verbatim.
- Policies are stored once (``ficache.policies``) and named by id: a write
  maps each value's policy text to its id inside its transaction, so
  callers (``NewEntry``, ``slice_rows``, ``entry_values``) only ever see
  the canonical JSON text.
- Destructive operations are plans first (``PrunePlan``), then a commit that
  records what it removed, so ``revert`` can restore it. ``write`` given
  ``expected`` commit ids (a merge plan's) checks them inside its
  transaction and raises ``ConflictError``, writing nothing, when any
  differs: a plan is never applied to a state it was not made from.
- ``revert`` refuses (``ConflictError``) when a later commit changed an entry
  the reverted commit touched, or the commit is already reverted; it never
  overwrites later work. It is ``ficache.revert``'s plan, executed as one
  ``write`` with ``expected`` commit ids. Every plan (prune, merge, revert)
  is applied only to the registry it was made on (``require_planned_on``).
- Namespaced records (``ficache.records``) ride in the same commits: ``write``
  stores ``records`` with its entries in its one transaction and commit,
  ``revert`` undoes both, exports carry them as ``_records``.
- An entry's selection (how FlashInfer chose the value, a cache value's
  fourth element) is not part of its value: ``write`` compares (runner,
  tactic, policy) only, so an equal value with another selection is
  unchanged (the stored selection stays, as ``tuned_at`` does) and never a
  conflict; a written value writes its selection, a replaced or removed one
  keeps its selection in ``entry_changes``, and ``revert`` restores it.
- A commit made is known: from the end of a write's body until every
  ``Registry.commit_listeners`` was told its id, SIGINT is held
  (``ficache._interrupts``), so a Ctrl-C never lands between the
  database's COMMIT and the caller learning of it.

Structure: the value types a write takes and returns (``NewEntry``,
``WriteResult``, ``CommitInfo``, scopes) live in ``ficache.values`` and are
re-exported here. The modules this one's facade methods call
(``import_cache``: ``ficache.importing``; ``revert``: ``ficache.revert``) take
the registry typed as ``ficache.registry_access.RegistryAccess`` and never
import this module, so there is no import cycle (``tests/test_structure.py``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy import (
    Connection,
    Engine,
    case,
    func,
    select,
)
from sqlalchemy import text as sql_text
from sqlalchemy.exc import DatabaseError, OperationalError

from ficache import kind_store, schema
from ficache import records as rec
from ficache._gcpause import paused_gc
from ficache._interrupts import HeldInterrupts
from ficache.errors import (
    ConflictError,
    FicacheError,
    FingerprintError,
    NotFoundError,
    RegistryBusyError,
    RegistryReadOnlyError,
    SchemaTooNewError,
)
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import CacheFile, parse_key, render_cache
from ficache.kind_store import COMMIT_KINDS as COMMIT_KINDS  # re-exported
from ficache.kinds import ENTRY_KIND, RECORD_KIND
from ficache.models import COMMITS as C
from ficache.models import ENTRIES as E
from ficache.models import (
    ENTRY_POLICY,
    ENTRY_VALUE_COLUMNS,
    SHARED_SCOPE,
)
from ficache.models import FINGERPRINTS as F
from ficache.values import (
    CommitInfo,
    Expected,
    NewEntry,
    WriteResult,
    bulk_new_entry,
    fingerprint_from_row,
    rank_scope,
    validate_scope,
)

T = TypeVar("T")

#: The largest row id SQLite stores (a signed 64-bit integer).
MAX_ROW_ID = 2**63 - 1

WRITE_ATTEMPTS = 4


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


@dataclass(frozen=True)
class FingerprintInfo:
    id: int
    fingerprint: Fingerprint
    entries: int
    created_at: float
    last_served_at: float | None = None  # when a warm start last served it; None: never

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "digest": self.fingerprint.digest,
            **self.fingerprint.reported(),  # a missing field as null
            "entries": self.entries,
            "created_at": self.created_at,
            "last_served_at": self.last_served_at,
        }


@dataclass(frozen=True)
class PruneGroup:
    fingerprint_id: int
    gpu: str
    flashinfer_version: str
    scope: str
    entries: int
    records: int = 0  # namespaced records (``ficache.records``) of the group


@dataclass(frozen=True)
class PrunePlan:
    """What a prune would remove; compare plans with ``==``, run ``execute``.

    ``total`` counts entries, ``records_total`` namespaced records: a prune
    removes the records that match its criteria with the entries (see
    ``Registry.plan_prune``). ``execute`` refuses a registry other than
    ``target``, the one it was planned on.
    """

    target: str  # the registry planned on (``Location.display``)
    criteria: tuple[tuple[str, str], ...]
    groups: tuple[PruneGroup, ...]
    entry_versions: tuple[tuple[int, int], ...] = field(repr=False)  # (entry id, commit id)
    #: (record id, commit id) of the records it removes.
    record_versions: tuple[tuple[int, int], ...] = field(default=(), repr=False)

    @property
    def total(self) -> int:
        return len(self.entry_versions)

    @property
    def records_total(self) -> int:
        return len(self.record_versions)

    @property
    def is_empty(self) -> bool:
        return not self.entry_versions and not self.record_versions

    def execute(self, registry: Registry) -> WriteResult:
        return registry._execute_prune(self)


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

    def as_json(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["ops"] = dict(self.ops)
        data["last_served"] = {str(fid): served for fid, served in self.last_served}
        data["record_namespaces"] = [
            {"fingerprint": fid, "namespace": ns, "records": n}
            for fid, ns, n in self.record_namespaces
        ]
        return data


class _NothingToWrite(Exception):
    """Raised inside a write transaction to roll it back with a result."""

    def __init__(self, result: WriteResult) -> None:
        self.result = result


def _shapes_and_extras(key: str) -> tuple[str, str]:
    """A stored key's shapes (JSON) and extras, as ``list`` shows them; a key
    that does not parse (a damaged registry: ``ficache verify`` names it)
    shows ``null`` shapes and no extras rather than failing the listing."""
    try:
        fields = parse_key(key)
    except ValueError:
        return "null", ""
    return fields.shapes_json, fields.extras


class Registry:
    """A registry opened on one database. Use ``Registry.open`` (a context manager)."""

    def __init__(
        self,
        location: schema.Location,
        engine: Engine,
        readonly: bool,
        write_refusal: str | None = None,
    ) -> None:
        self.location = location
        self.engine = engine
        self.readonly = readonly
        #: Why this code may not write a newer schema it can read (``schema.write_refusal``).
        self.write_refusal = write_refusal
        #: Called with each commit id right after that commit is made, with SIGINT
        #: held (``ficache._interrupts``): a Ctrl-C then cannot hide a made commit.
        self.commit_listeners: list[Callable[[int], None]] = []
        #: True when ``open`` created this registry's SQLite file (``schema.is_new_sqlite_file``).
        self.created = False

    # -- opening ----------------------------------------------------------

    @classmethod
    def open(cls, db: str | None = None, *, create: bool = True, write: bool = True) -> Registry:
        """Open the registry at ``db``, creating or upgrading it as ``schema.ensure_schema`` allows.

        ``write=False`` opens it to read only: its schema is never changed.
        ``created`` says whether this call created a new SQLite file.
        """
        location = schema.resolve(db)
        new = create and schema.is_new_sqlite_file(location)
        engine, readonly = schema.make_engine(location, create=create)
        try:
            refusal = schema.ensure_schema(
                engine, location, readonly=readonly, create=create, write=write
            )
        except BaseException:
            engine.dispose()
            raise
        registry = cls(location, engine, readonly, refusal)
        registry.created = new
        return registry

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading ----------------------------------------------------------

    def _read(self) -> Any:
        return self.engine.connect()

    def _guard(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return fn(*args, **kwargs)
        except (OperationalError, DatabaseError) as exc:
            raise schema.translate_operational_error(
                exc, self.location, engine=self.engine
            ) from None

    def fingerprints(self, *, ids: Sequence[int] | None = None) -> list[FingerprintInfo]:
        """Stored fingerprints (all, or those with ``ids``) with their entry counts.

        Counting uses the entries index per fingerprint, so asking for a few
        fingerprints of a large registry stays cheap.
        """

        def run() -> list[FingerprintInfo]:
            fp_query = select(F).order_by(F.c.id)
            count_query = select(E.c.fingerprint_id, func.count()).group_by(E.c.fingerprint_id)
            if ids is not None:
                fp_query = fp_query.where(F.c.id.in_(list(ids)))
                count_query = count_query.where(E.c.fingerprint_id.in_(list(ids)))
            with self._read() as conn:
                counts = dict(conn.execute(count_query).all())
                return [
                    FingerprintInfo(
                        row.id,
                        fingerprint_from_row(row),
                        counts.get(row.id, 0),
                        row.created_at,
                        row.last_served_at,
                    )
                    for row in conn.execute(fp_query)
                ]

        return self._guard(run)

    def _fingerprint_ids(self) -> list[tuple[int, Fingerprint]]:
        def run() -> list[tuple[int, Fingerprint]]:
            with self._read() as conn:
                return [(row.id, fingerprint_from_row(row)) for row in conn.execute(select(F))]

        return self._guard(run)

    def fingerprint(self, ref: int | str) -> FingerprintInfo:
        """Find a stored fingerprint by id or (a prefix of at least 6 of) its digest."""
        text = str(ref).strip()
        if text.isascii() and text.isdigit():
            # Past the largest id a database stores ("²" is a digit int() refuses): not found.
            found = self.fingerprints(ids=[int(text)]) if int(text) <= MAX_ROW_ID else []
            if found:
                return found[0]
        elif len(text) >= 6:
            matches = [
                fid for fid, fp in self._fingerprint_ids() if fp.digest.startswith(text.lower())
            ]
            if len(matches) == 1:
                return self.fingerprints(ids=matches)[0]
            if len(matches) > 1:
                raise FingerprintError(
                    f"fingerprint prefix {text!r} is ambiguous; give more characters or the id"
                )
        raise NotFoundError(f"no fingerprint {text!r} in the registry; see `ficache fingerprints`")

    def serving(self, current: Fingerprint) -> list[FingerprintInfo]:
        """Stored fingerprints whose entries ``current`` may use, exact match first."""
        ids = [fid for fid, fp in self._fingerprint_ids() if fp.serves(current)]
        infos = self.fingerprints(ids=ids) if ids else []
        infos.sort(key=lambda i: (i.fingerprint != current, -i.id))
        return infos

    def entries(
        self,
        *,
        fingerprint_ids: Sequence[int] | None = None,
        op: str | None = None,
        gpu: str | None = None,
        flashinfer_version: str | None = None,
        scope: str | None = None,
        limit: int | None = None,
    ) -> Iterator[StoredEntry]:
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
        try:
            with self._read() as conn:
                for fid, sc, key, op_, runner, tactic, pol, cid, updated, sel in conn.execute(
                    query
                ):
                    shapes, extras = _shapes_and_extras(key)
                    yield StoredEntry(
                        fid, sc, key, op_, runner, shapes, extras, tactic, pol, cid, updated, sel
                    )
        except (OperationalError, DatabaseError) as exc:
            raise schema.translate_operational_error(
                exc, self.location, engine=self.engine
            ) from None

    def slice_rows(
        self, fingerprint_ids: Sequence[int], scopes: Sequence[str]
    ) -> dict[str, tuple[str, str, str, str | None, str | None]]:
        """``key -> (key, runner, tactic, policy, selection)`` as one rank should load it.

        Earlier fingerprints win over later ones; a later scope in ``scopes``
        wins over an earlier one (pass ``["shared", "tp2/rank1"]``).
        """

        def run() -> dict[str, tuple[str, str, str, str | None, str | None]]:
            result: dict[str, tuple[str, str, str, str | None, str | None]] = {}
            # One indexed range per (fingerprint, scope), weakest first, so a
            # stronger row simply overwrites a weaker one.
            with self._read() as conn:
                for fid in reversed(list(fingerprint_ids)):
                    for scope in scopes:
                        rows = conn.execute(
                            select(
                                E.c.key, E.c.runner, E.c.tactic, ENTRY_POLICY, E.c.selection
                            ).where(E.c.fingerprint_id == fid, E.c.scope == scope)
                        )
                        result.update({row[0]: row for row in rows})
            return result

        return self._guard(run)

    def entry_values(
        self, fingerprint_ids: Sequence[int]
    ) -> list[tuple[int, str, str, str, str, str | None, float, str | None]]:
        """``(fingerprint_id, scope, key, runner, tactic, policy, tuned_at, selection)``
        of every entry of ``fingerprint_ids``: an entry's value with when it was
        tuned and how it was chosen, as bundles and merges copy it (``tuned_at``
        falls back to ``updated_at``)."""
        query = (
            select(*ENTRY_VALUE_COLUMNS)
            .where(E.c.fingerprint_id.in_(list(fingerprint_ids)))
            .order_by(E.c.fingerprint_id, E.c.scope, E.c.key)
        )

        def run() -> list[tuple[int, str, str, str, str, str | None, float, str | None]]:
            with self._read() as conn:
                return [tuple(row) for row in conn.execute(query)]

        return self._guard(run)

    def export_text(self, fingerprint_id: int, *, scope: str = SHARED_SCOPE) -> tuple[str, int]:
        """The FlashInfer cache file of one stored fingerprint's entries, and its size."""
        info = self.fingerprint(fingerprint_id)
        scopes = [SHARED_SCOPE] if scope == SHARED_SCOPE else [SHARED_SCOPE, scope]
        rows = self.slice_rows([info.id], scopes)
        records = self.slice_records([info.id], scopes)
        return render_cache(info.fingerprint.flashinfer_metadata(), rows.values(), records), len(
            rows
        )

    def slice_records(self, fingerprint_ids: Sequence[int], scopes: Sequence[str]) -> rec.RecordMap:
        """``{namespace: {key: canonical JSON}}`` as one rank loads it (``slice_rows``'s order)."""

        def run() -> rec.RecordMap:
            with self._read() as conn:
                return rec.slice_records(conn, fingerprint_ids, scopes)

        return self._guard(run)

    def export_for(self, current: Fingerprint, *, scope: str = SHARED_SCOPE) -> tuple[str, int]:
        """The cache file the environment ``current`` should load, and its size.

        Entries come from every stored fingerprint that serves ``current``;
        ``_metadata`` is ``current``'s own, so FlashInfer accepts the file.
        """
        infos = self.serving(current)
        if not infos:
            raise NotFoundError(
                "no stored fingerprint serves the current environment; "
                "see `ficache fingerprints` and `ficache fingerprint`"
            )
        scopes = [SHARED_SCOPE] if scope == SHARED_SCOPE else [SHARED_SCOPE, scope]
        rows = self.slice_rows([i.id for i in infos], scopes)
        records = self.slice_records([i.id for i in infos], scopes)
        return render_cache(current.flashinfer_metadata(), rows.values(), records), len(rows)

    def log(self, limit: int | None = 20, *, commit_id: int | None = None) -> list[CommitInfo]:
        query = select(C).order_by(C.c.id.desc())
        if commit_id is not None:
            query = query.where(C.c.id == commit_id)
        if limit is not None:
            query = query.limit(limit)

        def run() -> list[CommitInfo]:
            with self._read() as conn:
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
                    )
                    for r in conn.execute(query)
                ]

        return self._guard(run)

    def stats(self) -> Stats:
        def run() -> Stats:
            with self._read() as conn:
                n_fp = conn.execute(select(func.count()).select_from(F)).scalar_one()
                # Counted with CASE: PostgreSQL will not group by an expression
                # holding a bound parameter (each use binds a parameter of its own).
                n_entries, n_shared = conn.execute(
                    select(
                        func.count(),
                        func.coalesce(func.sum(case((E.c.scope == SHARED_SCOPE, 1), else_=0)), 0),
                    ).select_from(E)
                ).one()
                last_served = tuple(
                    (int(fid), served)
                    for fid, served in conn.execute(
                        select(F.c.id, F.c.last_served_at).order_by(F.c.id)
                    )
                )
                ops = tuple(
                    (op, n)
                    for op, n in conn.execute(
                        select(E.c.op, func.count())
                        .group_by(E.c.op)
                        .order_by(func.count().desc(), E.c.op)
                    )
                )
                n_commits, last = conn.execute(select(func.count(), func.max(C.c.created_at))).one()
                record_namespaces = rec.record_counts(conn)
                revision = schema.current_revision(conn)
                size = None
                if conn.dialect.name == "postgresql":
                    size = conn.execute(
                        sql_text("SELECT pg_database_size(current_database())")
                    ).scalar_one()
            shared = int(n_shared)
            scoped = int(n_entries) - shared
            if self.location.path is not None and self.location.path.exists():
                size = sum(
                    p.stat().st_size
                    for p in (
                        self.location.path,
                        self.location.path.with_name(self.location.path.name + "-wal"),
                    )
                    if p.exists()
                )
            return Stats(
                n_fp,
                shared + scoped,
                shared,
                scoped,
                n_commits,
                ops,
                last,
                revision,
                self.location.display,
                size,
                last_served,
                sum(n for _fid, _ns, n in record_namespaces),
                record_namespaces,
            )

        return self._guard(run)

    # -- writing ----------------------------------------------------------

    def require_writable(self) -> None:
        """Raise ``RegistryReadOnlyError`` (``SchemaTooNewError``) unless this registry may be written."""
        if self.write_refusal is not None:
            raise SchemaTooNewError(self.write_refusal)
        if self.readonly:
            raise RegistryReadOnlyError(
                f"registry {self.location.display} is read-only; pass a writable --db"
            )

    def require_planned_on(self, target: str) -> None:
        """Raise ``ValueError`` unless ``target`` (a plan's ``Location.display``) is this registry.

        A plan holds row ids and commit ids of the registry it was made on;
        applied to another, they would name unrelated rows.
        """
        if self.location.display != target:
            raise ValueError(f"this plan was made for {target}, not {self.location.display}")

    def _write(self, body: Callable[[Connection], T]) -> T:
        """Run ``body(conn)`` in one write transaction, retrying a busy lock.

        Only what can succeed on a second attempt is retried: a busy lock
        (on PostgreSQL also a serialization failure or a deadlock, which
        ``translate_operational_error`` reports as busy). A lock still busy
        after the last attempt is a ``RegistryBusyError`` that says how long
        the write waited, over how many attempts. Anything else, an
        ``IntegrityError`` first (a constraint the same write breaks again),
        is raised at once as one ``RegistryError`` line; nothing is written.
        """
        self.require_writable()
        delay = 0.05
        started = time.monotonic()
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with HeldInterrupts() as held:
                    with schema.write_transaction(self.engine) as conn:
                        result = body(conn)
                        held.start()  # from here to the recorded commit id, SIGINT waits
                    self._made(getattr(result, "commit_id", None))
                return result
            except (OperationalError, DatabaseError) as exc:
                error = schema.translate_operational_error(
                    exc,
                    self.location,
                    engine=self.engine,
                    waited_s=time.monotonic() - started,
                    attempts=attempt + 1,
                )
                if not isinstance(error, RegistryBusyError) or attempt == WRITE_ATTEMPTS - 1:
                    raise error from None
                time.sleep(delay)
                delay *= 4
        raise AssertionError("unreachable")

    def _made(self, commit_id: int | None) -> None:
        """Tell the listeners of a commit just made (SIGINT is held)."""
        if commit_id is None:
            return
        for listener in self.commit_listeners:
            listener(commit_id)

    def write(
        self,
        entries: Iterable[NewEntry],
        *,
        kind: str,
        message: str | None = None,
        world_size: int | None = None,
        layout: str | None = None,
        provenance: dict[str, Any] | None = None,
        removals: Iterable[tuple[Fingerprint, str, str]] = (),
        expected: Expected | None = None,
        keep_existing: bool = False,
        records: rec.RecordWrite | Iterable[rec.NewRecord] = (),
        reverts_commit_id: int | None = None,
    ) -> WriteResult:
        """Store ``entries`` (insert or replace) and delete ``removals`` as one commit.

        ``removals`` are ``(fingerprint, scope, key)`` of entries to delete; an
        absent one is skipped. Each deletion is recorded as ``removed`` with
        its old value and ``tuned_at``, so ``revert`` restores it.
        ``expected`` maps some of those identities (of ``entries`` or
        ``removals``) to the commit id that must have written their current
        value (None: absent), as a mapping or as ``(identity, commit id)``
        pairs, each identity once; when any differs inside the transaction,
        ``ConflictError`` is raised and nothing is written (a plan made from
        an older state is never applied to a newer one).
        ``keep_existing=True``: an entry that already holds another value
        keeps it, decided inside the transaction (under the write lock); the
        new value is not written and is counted in ``WriteResult.kept``.
        ``records`` (``NewRecord``s, or a ``RecordWrite`` with removals and
        expected commits) are written in the same transaction and commit,
        under the same rules (``ficache.records``); a write that changes
        only records is a commit too. Invalid records raise ``RecordError``
        before anything is written. ``reverts_commit_id``: the commit a
        ``revert`` write undoes (``ficache.revert``).
        """
        record_write = (
            records if isinstance(records, rec.RecordWrite) else rec.RecordWrite(tuple(records))
        )
        record_write.validate()
        with paused_gc():  # a large write allocates many small objects, no cycles
            return self._write_entries(
                entries,
                kind=kind,
                message=message,
                world_size=world_size,
                layout=layout,
                provenance=provenance,
                removals=removals,
                expected=expected,
                keep_existing=keep_existing,
                record_write=record_write,
                reverts_commit_id=reverts_commit_id,
            )

    def _write_entries(
        self,
        entries: Iterable[NewEntry],
        *,
        kind: str,
        message: str | None,
        world_size: int | None,
        layout: str | None,
        provenance: dict[str, Any] | None,
        removals: Iterable[tuple[Fingerprint, str, str]],
        expected: Expected | None,
        keep_existing: bool,
        record_write: rec.RecordWrite = rec.RecordWrite(),  # noqa: B008 - frozen, never mutated
        reverts_commit_id: int | None = None,
    ) -> WriteResult:
        """``write``'s body, run with the garbage collector paused: each kind's
        write prepared, then staged and applied in one commit (``ficache.kind_store``)."""
        prepared = (
            kind_store.prepare(ENTRY_KIND, entries, removals, expected),
            kind_store.prepare(
                RECORD_KIND, record_write.records, record_write.removals, record_write.expected
            ),
        )
        if all(p.is_empty for p in prepared):
            return WriteResult(None)

        def body(conn: Connection) -> WriteResult:
            now = time.time()
            fids = kind_store.FingerprintIds(conn, now)
            staged = [
                kind_store.stage(conn, p, fids, keep_existing=keep_existing) for p in prepared
            ]
            if not any(s.changed for s in staged):
                counts = kind_store.result_counts(staged)
                raise _NothingToWrite(
                    WriteResult(
                        None,
                        unchanged=counts["unchanged"],
                        kept=counts["kept"],
                        records_unchanged=counts["records_unchanged"],
                        records_kept=counts["records_kept"],
                    )
                )
            commit_id = kind_store.new_commit(
                conn,
                now,
                kind,
                staged,
                message=message,
                world_size=world_size,
                layout=layout,
                provenance=provenance,
                reverts_commit_id=reverts_commit_id,
            )
            for s in staged:
                kind_store.apply(conn, s, commit_id, now)
            return WriteResult(
                commit_id,
                shared_written=staged[0].shared_written,
                **kind_store.result_counts(staged),
            )

        try:
            return self._write(body)
        except _NothingToWrite as nothing:
            return nothing.result

    def import_cache(
        self,
        files: Sequence[tuple[str, CacheFile]],
        *,
        fingerprint: Fingerprint | None = None,
        scope: str = SHARED_SCOPE,
        provenance: dict[str, Any] | None = None,
        on_conflict: str = "keep",
    ) -> WriteResult:
        """Import parsed FlashInfer files in one commit.

        A file's own ``_metadata`` names its fingerprint; ``fingerprint`` is
        used only for files that have none, and such a file without it is
        refused before anything is written. A key two files hold is
        imported once, chosen by ``on_conflict`` when their values differ
        (``ficache.importing``: merge's policies, ``keep`` = the first file's;
        ``fail`` raises ``MergeConflictError`` and writes nothing).
        """
        from ficache.importing import file_inputs, plan_import

        plan = plan_import(file_inputs(files, fingerprint=fingerprint, scope=scope), on_conflict)
        return plan.execute(
            self, message=", ".join(source for source, _ in files), provenance=provenance
        )

    # -- prune --------------------------------------------------------------

    def plan_prune(
        self,
        *,
        fingerprint_ids: Sequence[int] = (),
        flashinfer_versions: Sequence[str] = (),
        older_than_seconds: float | None = None,
        scope: str | None = None,
        unused_for_seconds: float | None = None,
        now: float | None = None,
    ) -> PrunePlan:
        """Plan removing entries and records matching all the given criteria (at least one).

        ``unused_for_seconds``: entries of fingerprints no warm start has
        served for that long: last served before ``now - unused_for_seconds``,
        or, never served, created before it (``ficache.usage``).

        Namespaced records (``ficache.records``) are pruned by the same
        criteria, since each is one they have too: a fingerprint, its
        FlashInfer version and last use (``--fingerprint``,
        ``--flashinfer-version``, ``--unused-for`` select whole fingerprints,
        so all their records go), the row's scope (``--scope``) and when the
        row was last written (``--older-than``). They go in the same commit
        as the entries (its ``record_changes``, so ``show`` lists them and
        ``revert`` restores them). A criterion records lack (an op or key
        filter) would leave records untouched.
        """
        if (
            not fingerprint_ids
            and not flashinfer_versions
            and older_than_seconds is None
            and scope is None
            and unused_for_seconds is None
        ):
            raise FicacheError(
                "prune needs a criterion: --fingerprint, --flashinfer-version, --older-than, "
                "--unused-for or --scope"
            )
        criteria: list[tuple[str, str]] = []
        # Each criterion as a condition on a table of rows with fingerprint_id,
        # scope and updated_at (entries, records), joined with its fingerprint.
        conditions: list[Callable[[Any], Any]] = []
        if fingerprint_ids:
            for fid in fingerprint_ids:
                self.fingerprint(fid)  # raises NotFoundError for an unknown id
            ids = list(fingerprint_ids)
            conditions.append(lambda t: t.c.fingerprint_id.in_(ids))
            criteria.append(("fingerprint", ",".join(map(str, sorted(fingerprint_ids)))))
        if flashinfer_versions:
            versions_in = F.c.flashinfer_version.in_(list(flashinfer_versions))
            conditions.append(lambda t: versions_in)
            criteria.append(("flashinfer_version", ",".join(sorted(flashinfer_versions))))
        if older_than_seconds is not None:
            written_before = (now if now is not None else time.time()) - older_than_seconds
            conditions.append(lambda t: t.c.updated_at < written_before)
            criteria.append(("older_than_seconds", f"{older_than_seconds:g}"))
        if scope is not None:
            wanted_scope = validate_scope(scope)
            conditions.append(lambda t: t.c.scope == wanted_scope)
            criteria.append(("scope", scope))
        if unused_for_seconds is not None:
            used_before = (now if now is not None else time.time()) - unused_for_seconds
            unused = func.coalesce(F.c.last_served_at, F.c.created_at) < used_before
            conditions.append(lambda t: unused)
            shown = (
                f"{unused_for_seconds:.0f}"
                if float(unused_for_seconds).is_integer()
                else f"{unused_for_seconds:g}"
            )
            criteria.append(("unused_for_seconds", shown))

        def run() -> PrunePlan:
            groups: dict[tuple[int, str], list[Any]] = {}
            versions: list[tuple[int, int]] = []
            record_versions: list[tuple[int, int]] = []
            with self._read() as conn:
                for at, (kind, found) in enumerate(
                    ((ENTRY_KIND, versions), (RECORD_KIND, record_versions)), start=2
                ):
                    for row_id, cid, fid, sc, gpu, fiver in kind_store.prune_candidates(
                        conn, kind, conditions
                    ):
                        found.append((row_id, cid))
                        g = groups.setdefault((fid, sc), [gpu, fiver, 0, 0])
                        g[at] += 1
            return PrunePlan(
                self.location.display,
                tuple(criteria),
                tuple(
                    PruneGroup(fid, g[0], g[1], sc, g[2], g[3])
                    for (fid, sc), g in sorted(groups.items())
                ),
                tuple(versions),
                tuple(record_versions),
            )

        return self._guard(run)

    def _execute_prune(self, plan: PrunePlan) -> WriteResult:
        self.require_planned_on(plan.target)
        if plan.is_empty:
            return WriteResult(None)

        def body(conn: Connection) -> WriteResult:
            staged = []
            for kind, versions in (
                (ENTRY_KIND, plan.entry_versions),
                (RECORD_KIND, plan.record_versions),
            ):
                found = kind_store.stage_planned_removals(conn, kind, versions)
                if len(found.removed) != len(versions):
                    raise ConflictError(
                        f"{len(versions) - len(found.removed)} of {len(versions)} planned "
                        f"{kind.plural} changed since the plan was made; nothing removed, "
                        "run prune again"
                    )
                staged.append(found)
            now = time.time()
            commit_id = kind_store.new_commit(
                conn,
                now,
                "prune",
                staged,
                message="; ".join(f"{k}={v}" for k, v in plan.criteria),
            )
            for s in staged:
                kind_store.apply(conn, s, commit_id, now)
            counts = kind_store.result_counts(staged)
            return WriteResult(
                commit_id, removed=counts["removed"], records_removed=counts["records_removed"]
            )

        return self._write(body)

    # -- revert -----------------------------------------------------------

    def revert(self, commit_id: int) -> WriteResult:
        """Undo one commit as a new ``revert`` commit: ``ficache.revert``'s plan, executed.

        Raises ``NotFoundError`` for an unknown commit and ``ConflictError``
        (writing nothing) when the plan is refused: the commit is already
        reverted, or a later commit changed one of its entries or records.
        """
        from ficache.revert import plan_revert  # revert builds on this module

        return plan_revert(self, commit_id).execute(self)


# Re-exported helpers for callers that build queries of their own; the value
# types come from ``ficache.values`` and are importable from here as before.
__all__ = [
    "ENTRY_VALUE_COLUMNS",
    "SHARED_SCOPE",
    "CommitInfo",
    "Expected",
    "FingerprintInfo",
    "NewEntry",
    "PruneGroup",
    "PrunePlan",
    "Registry",
    "Stats",
    "StoredEntry",
    "WriteResult",
    "bulk_new_entry",
    "fingerprint_from_row",
    "rank_scope",
    "validate_scope",
]
