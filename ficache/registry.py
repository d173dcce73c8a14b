"""The registry: a facade over its reads, and transactional commits, prune (revert plans: ``ficache.revert``).

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

Structure: ``Registry`` is a facade. It owns opening and closing a registry,
its connections, turning a database error into one line, and the write
machinery (``write``, prune plans, revert). Each read concern lives in a
module of its own that takes an open connection and never imports this one:
``ficache.stored_fingerprints`` (``fingerprints``, ``fingerprint``,
``serving``), ``ficache.stored_entries`` (``entries``, ``slice_rows``,
``entry_values``), ``ficache.kind_read`` (``slice_records``,
``slice_protocol_records``), ``ficache.file_export``
(``export_text``, ``export_for``), ``ficache.commit_log`` (``log``,
``commit_with_token``) and ``ficache.registry_stats`` (``stats``); their
value types (``FingerprintInfo``, ``StoredEntry``, ``Stats``) are re-exported
here. The value types a write takes and returns (``NewEntry``,
``WriteResult``, ``CommitInfo``, scopes) live in ``ficache.values`` and are
re-exported here. The modules this one's facade methods call
(``import_cache``: ``ficache.importing``; ``revert``: ``ficache.revert``) take
the registry typed as ``ficache.registry_access.RegistryAccess`` and never
import this module, so there is no import cycle (``tests/test_structure.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from sqlalchemy import (
    Connection,
    Engine,
    func,
)
from sqlalchemy.exc import DatabaseError, OperationalError

from ficache import (
    commit_log,
    file_export,
    kind_read,
    kind_store,
    registry_stats,
    schema,
    stored_entries,
    stored_fingerprints,
)
from ficache import protocol_records as proto
from ficache import records as rec
from ficache._gcpause import paused_gc
from ficache._interrupts import HeldInterrupts
from ficache.errors import (
    ConflictError,
    FicacheError,
    RegistryBusyError,
    RegistryReadOnlyError,
    SchemaTooNewError,
)
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import CacheFile
from ficache.kind_store import COMMIT_KINDS as COMMIT_KINDS  # re-exported
from ficache.kinds import ENTRY_KIND, PROTOCOL_KIND, RECORD_KIND, STORED_KINDS, Kind
from ficache.models import (
    ENTRY_VALUE_COLUMNS,
    SHARED_SCOPE,
)
from ficache.models import FINGERPRINTS as F
from ficache.registry_stats import Stats
from ficache.stored_entries import StoredEntry
from ficache.stored_fingerprints import MAX_ROW_ID as MAX_ROW_ID  # re-exported
from ficache.stored_fingerprints import FingerprintInfo
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


WRITE_ATTEMPTS = 4


@dataclass(frozen=True)
class PruneGroup:
    fingerprint_id: int
    gpu: str
    flashinfer_version: str
    scope: str
    entries: int
    records: int = 0  # namespaced records (``ficache.records``) of the group
    protocol_records: int = 0  # FlashInfer 0.7.4's protocol records of the group


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
    #: (protocol record id, commit id) of the protocol records it removes.
    protocol_versions: tuple[tuple[int, int], ...] = field(default=(), repr=False)

    @property
    def total(self) -> int:
        return len(self.entry_versions)

    @property
    def records_total(self) -> int:
        return len(self.record_versions)

    @property
    def protocol_total(self) -> int:
        return len(self.protocol_versions)

    @property
    def is_empty(self) -> bool:
        return not self.entry_versions and not self.record_versions and not self.protocol_versions

    def versions(self, kind: Kind) -> tuple[tuple[int, int], ...]:
        """``(row id, commit id)`` of the rows of ``kind`` the plan removes."""
        return {
            ENTRY_KIND.name: self.entry_versions,
            RECORD_KIND.name: self.record_versions,
            PROTOCOL_KIND.name: self.protocol_versions,
        }[kind.name]

    def execute(self, registry: Registry) -> WriteResult:
        return registry._execute_prune(self)


class _NothingToWrite(Exception):
    """Raised inside a write transaction to roll it back with a result."""

    def __init__(self, result: WriteResult) -> None:
        self.result = result


def _prune_conditions(
    fingerprint_ids: Sequence[int],
    flashinfer_versions: Sequence[str],
    older_than_seconds: float | None,
    scope: str | None,
    unused_for_seconds: float | None,
    now: float,
) -> tuple[list[Callable[[Any], Any]], list[tuple[str, str]]]:
    """``Registry.plan_prune``'s criteria as conditions on a kind's table (joined with its
    fingerprint), and as the ``(name, value)`` pairs the plan shows."""
    criteria: list[tuple[str, str]] = []
    # Each criterion as a condition on a table of rows with fingerprint_id,
    # scope and updated_at (entries, records), joined with its fingerprint.
    conditions: list[Callable[[Any], Any]] = []
    if fingerprint_ids:
        ids = list(fingerprint_ids)
        conditions.append(lambda t: t.c.fingerprint_id.in_(ids))
        criteria.append(("fingerprint", ",".join(map(str, sorted(fingerprint_ids)))))
    if flashinfer_versions:
        versions_in = F.c.flashinfer_version.in_(list(flashinfer_versions))
        conditions.append(lambda t: versions_in)
        criteria.append(("flashinfer_version", ",".join(sorted(flashinfer_versions))))
    if older_than_seconds is not None:
        written_before = now - older_than_seconds
        conditions.append(lambda t: t.c.updated_at < written_before)
        criteria.append(("older_than_seconds", f"{older_than_seconds:g}"))
    if scope is not None:
        wanted_scope = validate_scope(scope)
        conditions.append(lambda t: t.c.scope == wanted_scope)
        criteria.append(("scope", scope))
    if unused_for_seconds is not None:
        used_before = now - unused_for_seconds
        unused = func.coalesce(F.c.last_served_at, F.c.created_at) < used_before
        conditions.append(lambda t: unused)
        shown = (
            f"{unused_for_seconds:.0f}"
            if float(unused_for_seconds).is_integer()
            else f"{unused_for_seconds:g}"
        )
        criteria.append(("unused_for_seconds", shown))
    return conditions, criteria


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
        #: ``(token, kind)`` of the ``write`` under way that lands at most once, else None
        #: (``write(once_token=...)``); ``_write`` checks it under the write lock.
        self._once: tuple[str, str] | None = None

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

    def _reading(self, query: Callable[..., T], *args: Any) -> T:
        """``query(conn, *args)`` on one read connection, a database error as one line."""

        def run() -> T:
            with self._read() as conn:
                return query(conn, *args)

        return self._guard(run)

    def fingerprints(self, *, ids: Sequence[int] | None = None) -> list[FingerprintInfo]:
        """Stored fingerprints (all, or those with ``ids``) with their entry counts
        (``ficache.stored_fingerprints``)."""
        return self._reading(stored_fingerprints.fingerprints, ids)

    def fingerprint(self, ref: int | str) -> FingerprintInfo:
        """Find a stored fingerprint by id or (a prefix of at least 6 of) its digest."""
        return self._reading(stored_fingerprints.fingerprint, ref)

    def serving(self, current: Fingerprint) -> list[FingerprintInfo]:
        """Stored fingerprints whose entries ``current`` may use, exact match first."""
        return self._reading(stored_fingerprints.serving, current)

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
        """The stored entries matching every filter given (``ficache.stored_entries``)."""
        try:
            with self._read() as conn:
                yield from stored_entries.entries(
                    conn,
                    fingerprint_ids=fingerprint_ids,
                    op=op,
                    gpu=gpu,
                    flashinfer_version=flashinfer_version,
                    scope=scope,
                    limit=limit,
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
        return self._reading(stored_entries.slice_rows, fingerprint_ids, scopes)

    def entry_values(
        self, fingerprint_ids: Sequence[int]
    ) -> list[tuple[int, str, str, str, str, str | None, float, str | None]]:
        """``(fingerprint_id, scope, key, runner, tactic, policy, tuned_at, selection)``
        of every entry of ``fingerprint_ids``: an entry's value with when it was
        tuned and how it was chosen, as bundles and merges copy it (``tuned_at``
        falls back to ``updated_at``)."""
        return self._reading(stored_entries.entry_values, fingerprint_ids)

    def export_text(self, fingerprint_id: int, *, scope: str = SHARED_SCOPE) -> tuple[str, int]:
        """The FlashInfer cache file of one stored fingerprint's entries, and its size."""
        return self._reading(file_export.export_text, fingerprint_id, scope)

    def slice_records(
        self, fingerprint_ids: Sequence[int], scopes: Sequence[str]
    ) -> kind_read.NamespaceMap:
        """``{namespace: {key: canonical JSON}}`` as one rank loads it (``slice_rows``'s order)."""
        return self._reading(kind_read.slice_values, RECORD_KIND, fingerprint_ids, scopes)

    def slice_protocol_records(self, fingerprint_ids: Sequence[int]) -> kind_read.NamespaceMap:
        """``{namespace: {key: canonical JSON}}`` every rank publishes: the shared protocol
        records of ``fingerprint_ids``, an earlier fingerprint winning."""
        return self._reading(kind_read.slice_values, PROTOCOL_KIND, fingerprint_ids, [SHARED_SCOPE])

    def export_for(self, current: Fingerprint, *, scope: str = SHARED_SCOPE) -> tuple[str, int]:
        """The cache file the environment ``current`` should load, and its size.

        Entries come from every stored fingerprint that serves ``current``;
        ``_metadata`` is ``current``'s own, so FlashInfer accepts the file.
        """
        return self._reading(file_export.export_for, current, scope)

    def log(self, limit: int | None = 20, *, commit_id: int | None = None) -> list[CommitInfo]:
        """The newest commits first (``ficache.commit_log``)."""

        return self._reading(commit_log.log, limit, commit_id)

    def commit_with_token(self, token: str, *, kind: str = "startup") -> WriteResult | None:
        """The commit of ``kind`` a write given ``once_token=token`` made, as its result, or None
        (``ficache.commit_log``)."""

        return self._reading(commit_log.commit_with_token, token, kind)

    def stats(self) -> Stats:
        """The registry's totals (``ficache.registry_stats``)."""
        return self._reading(registry_stats.stats, self.location)

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
        Under a ``write(once_token=...)``, a commit that token already made is
        looked up first, under the lock, and returned in place of ``body``'s.
        """
        self.require_writable()
        delay = 0.05
        started = time.monotonic()
        for attempt in range(WRITE_ATTEMPTS):
            try:
                with HeldInterrupts() as held:
                    with schema.write_transaction(self.engine) as conn:
                        landed = self._landed(conn)
                        result = body(conn) if landed is None else cast(T, landed)
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

    def _landed(self, conn: Connection) -> WriteResult | None:
        """Under the write lock: the commit the ``once_token`` write under way already made."""
        if self._once is None:
            return None
        token, kind = self._once
        return commit_log.commit_with_token(conn, token, kind)

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
        protocol_records: proto.ProtocolWrite | Iterable[proto.NewProtocolRecord] = (),
        reverts_commit_id: int | None = None,
        once_token: str | None = None,
        token_is_new: bool = False,
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
        before anything is written. ``protocol_records`` (``NewProtocolRecord``s, or a
        ``ProtocolWrite``) likewise, for FlashInfer 0.7.4's protocol records
        (``ficache.protocol_records``). ``reverts_commit_id``: the commit a
        ``revert`` write undoes (``ficache.revert``).
        ``once_token``: the write lands at most once for this token. The token
        is stored in the commit's provenance (``commit_log.TOKEN_FIELD``), and
        inside the transaction, under the write lock and before anything is
        written, a commit of ``kind`` that already holds it is looked up: when
        one exists (an earlier attempt landed although its caller never heard),
        its result is returned and nothing is written. A retried write that
        waits for the lock behind the attempt still landing so sees it.
        The lookup scans the commits of ``kind``; ``token_is_new=True`` (a first
        attempt with a token never given to a write before, which no commit can
        hold) stores the token without it.
        """
        if once_token is not None:
            provenance = {**(provenance or {}), commit_log.TOKEN_FIELD: once_token}
        record_write = (
            records if isinstance(records, rec.RecordWrite) else rec.RecordWrite(tuple(records))
        )
        record_write.validate()
        protocol_write = (
            protocol_records
            if isinstance(protocol_records, proto.ProtocolWrite)
            else proto.ProtocolWrite(tuple(protocol_records))
        )
        protocol_write.validate()
        self._once = None if once_token is None or token_is_new else (once_token, kind)
        try:
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
                    protocol_write=protocol_write,
                    reverts_commit_id=reverts_commit_id,
                )
        finally:
            self._once = None

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
        protocol_write: proto.ProtocolWrite = proto.ProtocolWrite(),  # noqa: B008 - frozen
        reverts_commit_id: int | None = None,
    ) -> WriteResult:
        """``write``'s body, run with the garbage collector paused: each kind's
        write prepared, then staged and applied in one commit (``ficache.kind_store``)."""
        prepared = (
            kind_store.prepare(ENTRY_KIND, entries, removals, expected),
            kind_store.prepare(
                RECORD_KIND, record_write.records, record_write.removals, record_write.expected
            ),
            kind_store.prepare(
                PROTOCOL_KIND,
                protocol_write.records,
                protocol_write.removals,
                protocol_write.expected,
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
                        **{
                            k.result_field(what): counts[k.result_field(what)]
                            for k in STORED_KINDS
                            for what in ("unchanged", "kept")
                        },
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
        filter) would leave records untouched. FlashInfer 0.7.4's protocol
        records (``ficache.protocol_records``) are pruned by the same
        criteria and code, every stored kind in turn (``kinds.STORED_KINDS``).
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
        for fid in fingerprint_ids:
            self.fingerprint(fid)  # raises NotFoundError for an unknown id
        conditions, criteria = _prune_conditions(
            fingerprint_ids,
            flashinfer_versions,
            older_than_seconds,
            scope,
            unused_for_seconds,
            time.time() if now is None else now,
        )

        def run() -> PrunePlan:
            groups: dict[tuple[int, str], list[Any]] = {}
            found: list[list[tuple[int, int]]] = [[] for _kind in STORED_KINDS]
            with self._read() as conn:
                for at, kind in enumerate(STORED_KINDS, start=2):
                    for row_id, cid, fid, sc, gpu, fiver in kind_store.prune_candidates(
                        conn, kind, conditions
                    ):
                        found[at - 2].append((row_id, cid))
                        g = groups.setdefault((fid, sc), [gpu, fiver, *(0 for _ in STORED_KINDS)])
                        g[at] += 1
            return PrunePlan(
                self.location.display,
                tuple(criteria),
                tuple(
                    PruneGroup(fid, g[0], g[1], sc, *g[2:])
                    for (fid, sc), g in sorted(groups.items())
                ),
                *(tuple(versions) for versions in found),
            )

        return self._guard(run)

    def _execute_prune(self, plan: PrunePlan) -> WriteResult:
        self.require_planned_on(plan.target)
        if plan.is_empty:
            return WriteResult(None)

        def body(conn: Connection) -> WriteResult:
            staged = []
            for kind in STORED_KINDS:
                versions = plan.versions(kind)
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
                commit_id,
                **{
                    k.result_field("removed"): counts[k.result_field("removed")]
                    for k in STORED_KINDS
                },
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
