"""The registry: a facade over its reads, and transactional commits (plans: ``ficache.prune``, ``ficache.revert``).

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
- A damaged registry is never written: every write transaction first asks
  SQLite (``PRAGMA quick_check(1)``, under the write lock, about 0.5 ms at
  1k entries and 5 ms at 10k) and refuses a file it reports damaged with a
  ``RegistryDamagedError`` naming ``ficache verify``; nothing is written.
  ``check_storage`` asks the same of a reader (a warm start's slice export).
- A commit made is known: from the end of a write's body until every
  ``Registry.commit_listeners`` was told its id, SIGINT is held
  (``ficache._interrupts``), so a Ctrl-C never lands between the
  database's COMMIT and the caller learning of it.

Structure: ``Registry`` is a facade. It owns opening and closing a registry,
its connections, turning a database error into one line, and the write
machinery: ``transaction`` (the write lock, retries, a ``once_token``'s
lookup, commit listeners) and ``write`` (each kind prepared, staged and
applied in one commit through ``ficache.kind_store``). Prune plans and their
execution are ``ficache.prune``'s (``PrunePlan``, ``PruneGroup`` re-exported
here; ``plan_prune`` delegates); revert plans ``ficache.revert``'s. Each
read concern lives in a module of its own that takes an open connection and
never imports this one:
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
(``import_cache``: ``ficache.importing``; ``revert``: ``ficache.revert``;
``plan_prune``: ``ficache.prune``, as its ``PruneTarget``) take the registry
typed as ``ficache.registry_access.RegistryAccess`` and never
import this module, so there is no import cycle (``tests/test_structure.py``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DatabaseError, OperationalError

from ficache import (
    after_start,
    commit_log,
    file_export,
    kind_read,
    kind_store,
    prune,
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
    RegistryBusyError,
    RegistryDamagedError,
    RegistryReadOnlyError,
    SchemaTooNewError,
)
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import CacheFile
from ficache.kind_store import COMMIT_KINDS as COMMIT_KINDS  # re-exported
from ficache.kinds import ENTRY_KIND, PROTOCOL_KIND, RECORD_KIND, STORED_KINDS
from ficache.models import (
    ENTRY_VALUE_COLUMNS,
    SHARED_SCOPE,
)
from ficache.prune import PruneGroup, PrunePlan
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


class _NothingToWrite(Exception):
    """Raised inside a write transaction to roll it back with a result."""

    def __init__(self, result: WriteResult) -> None:
        self.result = result


@dataclass(frozen=True)
class _CommitHeader:
    """What a write's commit row says of it besides its counts (``kind_store.new_commit``)."""

    kind: str
    message: str | None
    world_size: int | None
    layout: str | None
    provenance: dict[str, Any] | None
    reverts_commit_id: int | None


def _validated_record_writes(
    records: rec.RecordWrite | Iterable[rec.NewRecord],
    protocol_records: proto.ProtocolWrite | Iterable[proto.NewProtocolRecord],
) -> tuple[rec.RecordWrite, proto.ProtocolWrite]:
    """``write``'s records and protocol records as the writes they are, each validated
    (``RecordError`` before anything is written)."""
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
    return record_write, protocol_write


def _prepared_kinds(
    entries: Iterable[NewEntry],
    removals: Iterable[tuple[Fingerprint, str, str]],
    expected: Expected | None,
    record_write: rec.RecordWrite,
    protocol_write: proto.ProtocolWrite,
) -> tuple[kind_store.Prepared, ...]:
    """Each stored kind's part of a write, keyed and checked before its transaction
    (``kind_store.prepare``), in ``kinds.STORED_KINDS`` order."""
    return (
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


def _stage_and_commit(
    prepared: Sequence[kind_store.Prepared],
    header: _CommitHeader,
    keep_existing: bool,
    conn: Connection,
) -> WriteResult:
    """Under the write lock: every kind's write staged against the current rows, then one
    commit row and each kind's changes applied (``ficache.kind_store``). Raises
    ``_NothingToWrite`` (rolling the transaction back) when nothing would change."""
    now = time.time()
    fids = kind_store.FingerprintIds(conn, now)
    staged = [kind_store.stage(conn, p, fids, keep_existing=keep_existing) for p in prepared]
    if not any(s.changed for s in staged):
        raise _NothingToWrite(_unchanged_result(staged))
    commit_id = kind_store.new_commit(
        conn,
        now,
        header.kind,
        staged,
        message=header.message,
        world_size=header.world_size,
        layout=header.layout,
        provenance=header.provenance,
        reverts_commit_id=header.reverts_commit_id,
    )
    for s in staged:
        kind_store.apply(conn, s, commit_id, now)
    return WriteResult(
        commit_id, shared_written=staged[0].shared_written, **kind_store.result_counts(staged)
    )


def storage_problem(conn: Connection) -> str | None:
    """SQLite's first complaint about the file behind ``conn`` (``PRAGMA quick_check(1)``,
    one line), or None: none, or not SQLite (PostgreSQL reports damage as it reads)."""
    if conn.dialect.name != "sqlite":
        return None
    try:
        line = str(conn.exec_driver_sql("PRAGMA quick_check(1)").scalar())
    except DatabaseError as exc:  # so damaged that the check itself cannot run
        line = str(exc.orig)
    if line == "ok":
        return None
    last = [part.strip() for part in line.splitlines() if part.strip() and "***" not in part]
    return (last[-1] if last else line)[:160]


def damaged_error(location: schema.Location, problem: str) -> RegistryDamagedError:
    """The one line a write (or a warm start's read) on a damaged registry is refused with."""
    return RegistryDamagedError(
        f"registry {location.display} is damaged (SQLite: {problem}); nothing written; "
        "run `ficache verify`, then restore the file from a copy or pass another --db"
    )


def _refuse_damaged(conn: Connection, location: schema.Location) -> None:
    problem = storage_problem(conn)
    if problem is not None:
        raise damaged_error(location, problem)


def _unchanged_result(staged: Sequence[kind_store.Staged]) -> WriteResult:
    """The result of a write that changes nothing: no commit, what was unchanged and kept."""
    counts = kind_store.result_counts(staged)
    fields: dict[str, Any] = {
        k.result_field(what): counts.get(k.result_field(what), 0)
        for k in STORED_KINDS
        for what in ("unchanged", "kept")
    }
    return WriteResult(None, **fields)


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
        #: What this registry's schema revision lacks of this code's head (``schema.features``).
        self.features: schema.SchemaFeatures = schema.COMPLETE
        #: The revision ``open`` upgraded this local SQLite file from (older than
        #: ``schema.oldest_readable``), else None; ``open`` logs it.
        self.upgraded_from: str | None = None
        #: Called with each commit id right after that commit is made, with SIGINT
        #: held (``ficache._interrupts``): a Ctrl-C then cannot hide a made commit.
        self.commit_listeners: list[Callable[[int], None]] = []
        #: Called with the one warning of each write that left out what this registry's
        #: older schema cannot hold (``WriteResult.skipped``).
        self.skip_listeners: list[Callable[[str], None]] = []
        #: True when ``open`` created this registry's SQLite file (``schema.is_new_sqlite_file``).
        self.created = False
        #: ``(token, kind)`` of the ``write`` under way that lands at most once, else None
        #: (``write(once_token=...)``); ``transaction`` checks it under the write lock.
        self._once: tuple[str, str] | None = None

    # -- opening ----------------------------------------------------------

    @classmethod
    def open(cls, db: str | None = None, *, create: bool = True, write: bool = True) -> Registry:
        """Open the registry at ``db``, creating or upgrading it as ``schema.ensure_schema`` allows.

        ``write=False`` opens it to read only: its schema is never changed.
        ``created`` says whether this call created a new SQLite file.
        """
        # What this process reads through a registry shows what its starts left running
        # (their served marks, ``ficache.after_start``).
        after_start.wait()
        location = schema.resolve(db)
        new = create and schema.is_new_sqlite_file(location)
        engine, readonly = schema.make_engine(location, create=create)
        try:
            check = schema.ensure_schema(
                engine, location, readonly=readonly, create=create, write=write
            )
        except BaseException:
            engine.dispose()
            raise
        registry = cls(location, engine, readonly, check.refusal)
        registry.features = check.features
        registry.upgraded_from = check.upgraded_from
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

    def ops_matching(self, text: str) -> tuple[list[str], list[str]]:
        """``(ops, suggestions)`` for an op named in part (``stored_entries.ops_matching``)."""

        return self._reading(stored_entries.ops_matching, text)

    def entries(
        self,
        *,
        fingerprint_ids: Sequence[int] | None = None,
        op: str | None = None,
        ops: Sequence[str] | None = None,
        gpu: str | None = None,
        flashinfer_version: str | None = None,
        scope: str | None = None,
        limit: int | None = None,
    ) -> Iterator[StoredEntry]:
        """The stored entries matching every filter given (``ficache.stored_entries``):
        ``op`` one op exactly, ``ops`` any of these."""
        if op is not None:
            ops = [op] if ops is None else [o for o in ops if o == op]
        try:
            with self._read() as conn:
                yield from stored_entries.entries(
                    conn,
                    fingerprint_ids=fingerprint_ids,
                    ops=ops,
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

    def log(
        self,
        limit: int | None = 20,
        *,
        commit_id: int | None = None,
        where: commit_log.LogFilter | None = None,
    ) -> list[CommitInfo]:
        """The newest commits first, those ``where`` lets through (``ficache.commit_log``)."""

        return self._reading(commit_log.log, limit, commit_id, where or commit_log.LogFilter())

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

    def check_storage(self) -> None:
        """Raise ``RegistryDamagedError`` when SQLite reports the file damaged (``storage_problem``)."""
        try:
            with self._read() as conn:
                _refuse_damaged(conn, self.location)
        except DatabaseError as exc:
            raise schema.translate_operational_error(exc, self.location) from None

    def require_planned_on(self, target: str) -> None:
        """Raise ``ValueError`` unless ``target`` (a plan's ``Location.display``) is this registry.

        A plan holds row ids and commit ids of the registry it was made on;
        applied to another, they would name unrelated rows.
        """
        if self.location.display != target:
            raise ValueError(f"this plan was made for {target}, not {self.location.display}")

    def transaction(self, body: Callable[[Connection], T]) -> T:
        """Run ``body(conn)`` in one write transaction, retrying a busy lock.

        Every commit goes through here: ``write``'s, and a prune plan's
        (``ficache.prune``). ``body`` adds one ``commits`` row with its change
        rows, or raises (nothing is written).

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
                        _refuse_damaged(conn, self.location)
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

        ``removals``: ``(fingerprint, scope, key)`` of entries to delete (an
        absent one is skipped), each recorded as ``removed`` with its old value
        and ``tuned_at``, so ``revert`` restores it. ``expected``: the commit id
        that must have written the current value of some of those identities
        (None: absent), a mapping or ``(identity, commit id)`` pairs, each
        identity once; when any differs inside the transaction, ``ConflictError``
        is raised and nothing is written (a plan made from an older state is
        never applied to a newer one). ``keep_existing=True``: an entry that
        already holds another value keeps it, decided under the write lock; the
        new value is counted in ``WriteResult.kept``. ``records`` (``NewRecord``s,
        or a ``RecordWrite`` with removals and expected commits) and
        ``protocol_records`` (``NewProtocolRecord``s, or a ``ProtocolWrite``) are
        written in the same transaction and commit, under the same rules
        (``ficache.records``, ``ficache.protocol_records``); a write that changes
        only records is a commit too, and invalid records raise ``RecordError``
        before anything is written. ``reverts_commit_id``: the commit a
        ``revert`` write undoes (``ficache.revert``). ``once_token``: the write
        lands at most once for this token, stored in the commit's provenance
        (``commit_log.TOKEN_FIELD``): under the write lock, before anything is
        written, a commit of ``kind`` holding it is looked up (a scan of the
        commits of ``kind``); when one exists (an earlier attempt landed although
        its caller never heard, or lands while this retry waits for the lock),
        its result is returned and nothing is written. ``token_is_new=True`` (a
        token never given to a write before) stores it without the lookup.
        """
        if once_token is not None:
            provenance = {**(provenance or {}), commit_log.TOKEN_FIELD: once_token}
        record_write, protocol_write = _validated_record_writes(records, protocol_records)
        header = _CommitHeader(kind, message, world_size, layout, provenance, reverts_commit_id)
        self._once = None if once_token is None or token_is_new else (once_token, kind)
        try:
            with paused_gc():  # a large write allocates many small objects, no cycles
                prepared = _prepared_kinds(
                    entries, removals, expected, record_write, protocol_write
                )
                return self._commit_prepared(prepared, header, keep_existing)
        finally:
            self._once = None

    def _commit_prepared(
        self,
        prepared: Sequence[kind_store.Prepared],
        header: _CommitHeader,
        keep_existing: bool,
    ) -> WriteResult:
        """``write``'s transaction: every kind's prepared write staged and applied in one
        commit (``_stage_and_commit``); no commit when none changes anything.

        A kind whose tables the registry's older schema lacks (``self.features``) is
        left out, and the result says so in one warning (``WriteResult.skipped``).
        """
        held = [p for p in prepared if self.features.has_table(p.kind.rows.name)]
        left_out = [
            f"{len(p.wanted) + len(p.removals)} {p.kind.plural}"
            for p in prepared
            if p not in held and not p.is_empty
        ]
        skipped = self.features.skipped(" and ".join(left_out), self.location) if left_out else None
        if all(p.is_empty for p in held):
            result = WriteResult(None)
        else:
            try:
                result = self.transaction(partial(_stage_and_commit, held, header, keep_existing))
            except _NothingToWrite as nothing:
                result = nothing.result
        if skipped is not None:
            result = dataclasses.replace(result, skipped=skipped)
            for listener in self.skip_listeners:
                listener(skipped)
        return result

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
        """Plan removing entries and records matching all the given criteria (at least one):
        ``ficache.prune.plan_prune`` on this registry; run it with ``PrunePlan.execute``.

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
        return prune.plan_prune(
            self,
            fingerprint_ids=fingerprint_ids,
            flashinfer_versions=flashinfer_versions,
            older_than_seconds=older_than_seconds,
            scope=scope,
            unused_for_seconds=unused_for_seconds,
            now=now,
        )

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
