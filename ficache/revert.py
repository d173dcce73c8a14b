"""Reverting one commit: a frozen plan first, then one ``revert`` commit.

``plan_revert(registry, commit_id)`` reads what the commit did (its entry
and namespaced-record changes) and what the registry holds now, and returns
a ``RevertPlan``: the counts, the conflicts, the reason it is refused (if
any) and the exact write that undoes the commit. ``RevertPlan.execute``
applies it as one ``Registry.write`` of kind ``revert``. ``Registry.revert``
is ``plan_revert`` then ``execute``: a dry run and a run take one code path.

Invariants:
- A plan is refused (``refusal``; ``check`` and ``execute`` raise
  ``ConflictError`` with that line) when the commit is already undone (the
  last of an odd chain of reverts starting at it is in effect), or when a
  later commit changed one of its entries or records: one it added or
  replaced no longer holds the value it wrote, or one it removed is back.
  Each such change is a ``RevertConflict`` naming the later commit. A
  revert never overwrites later work. A revert commit can itself be
  reverted (that redoes what it undid), under the same rules.
- ``execute`` writes nothing unless the registry is the one planned on and
  every entry and record the plan touches is still held by the commit that
  held it when planned (``Registry.write``'s ``expected``, checked under the
  write lock, as ``MergePlan`` does); otherwise it raises ``ConflictError``
  ("plan it again") and the registry is exactly as it was.
- A later change that a later revert undid again is no conflict: a change
  is stale when the identity no longer holds the value the commit wrote (or,
  for one it removed, is held again), whichever commit wrote it. So
  ``import A; import B; revert B; revert A`` succeeds.
- ``plan_revert_to(registry, n)`` (``revert --to``) returns every identity a
  later commit changed to its state after commit ``n`` (the state the first
  later change replaced) as one ``revert`` commit, with the same ``expected``
  check; it never refuses, and the later commits stay in the log.
- Entries, records and protocol records are kinds of stored result with one
  description each (``ficache.kinds``); reading changes, finding conflicts
  and building the inverse write are written once for all.
- Undoing a change restores the value it replaced with its ``tuned_at`` and
  (for entries) its policy and selection, removes what it added, and
  re-adds what it removed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from sqlalchemy import Connection, Table, func, select
from sqlalchemy.exc import DatabaseError

from ficache import schema
from ficache.errors import ConflictError, NotFoundError
from ficache.fingerprint import Fingerprint
from ficache.kind_store import (
    changes_after,
    commit_changes,
    replaced_value,
    restored_item,
    written_value,
)
from ficache.kinds import ENTRY_KIND, KINDS, PROTOCOL_KIND, RECORD_KIND, Kind
from ficache.models import COMMITS as C
from ficache.models import FINGERPRINTS as F
from ficache.models import policy_text
from ficache.protocol_records import ProtocolWrite
from ficache.records import RecordWrite
from ficache.registry_access import RegistryAccess
from ficache.values import CommitInfo, NewEntry, WriteResult, fingerprint_from_row

__all__ = [
    "RevertConflict",
    "RevertCounts",
    "RevertPlan",
    "RevertToPlan",
    "plan_revert",
    "plan_revert_to",
]

_CHUNK = 500  # keys per IN (...) list


@dataclass(frozen=True)
class RevertConflict:
    """One entry or record of the commit that a later commit changed."""

    kind: str  # "entry", "record" or "protocol record"
    fingerprint_id: int
    scope: str
    namespace: str | None  # records and protocol records only
    key: str
    action: str  # what the reverted commit did to it: added, replaced, removed
    changed_by: int | None  # the later commit that holds it now or removed it

    def as_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass(frozen=True)
class RevertCounts:
    """What undoing one kind's changes does: remove what the commit added,
    restore what it replaced, re-add what it removed."""

    remove: int = 0
    restore: int = 0
    re_add: int = 0

    @property
    def total(self) -> int:
        return self.remove + self.restore + self.re_add

    def as_json(self) -> dict[str, int]:
        return {"remove": self.remove, "restore": self.restore, "re_add": self.re_add}


@dataclass(frozen=True)
class RevertPlan:
    """What reverting ``commit`` would do; compare plans with ``==``, apply with ``execute``."""

    target: str  # the registry planned on (``Location.display``)
    commit: CommitInfo
    entries: RevertCounts
    records: RevertCounts
    conflicts: tuple[RevertConflict, ...]
    #: The revert commit that undoes ``commit`` now (None: it is in effect).
    reverted_by: int | None = None
    writes: tuple[NewEntry, ...] = field(default=(), repr=False)
    removals: tuple[tuple[Fingerprint, str, str], ...] = field(default=(), repr=False)
    #: Each touched entry's identity and the commit holding it when planned (None: absent).
    expected: tuple[tuple[tuple[Fingerprint, str, str], int | None], ...] = field(
        default=(), repr=False
    )
    record_write: RecordWrite = field(default_factory=RecordWrite, repr=False)
    #: What undoing the commit's protocol record changes does (``ficache.protocol_records``).
    protocol: RevertCounts = RevertCounts()
    protocol_write: ProtocolWrite = field(default_factory=ProtocolWrite, repr=False)

    @property
    def refusal(self) -> str | None:
        """Why executing this plan is refused (one line, what to do next); None: it is not."""
        cid = self.commit.id
        if self.reverted_by is not None:
            return (
                f"commit {cid} is already reverted by commit {self.reverted_by}; nothing to "
                f"revert (revert commit {self.reverted_by} to bring it back)"
            )
        if not self.conflicts:
            return None
        n_entries = sum(c.kind == ENTRY_KIND.name for c in self.conflicts)
        n_records = sum(c.kind == RECORD_KIND.name for c in self.conflicts)
        n_protocol = len(self.conflicts) - n_entries - n_records
        parts = []
        if n_entries:
            parts.append(f"{n_entries} of {self.entries.total} entries")
        if n_records:
            parts.append(f"{n_records} of {self.records.total} records")
        if n_protocol:
            parts.append(f"{n_protocol} of {self.protocol.total} protocol records")
        return (
            f"{' and '.join(parts)} of commit {cid} changed in later commits; "
            "revert those first (ficache log)"
        )

    @property
    def changed_by(self) -> tuple[int, ...]:
        """The later commits that conflict, in order."""
        return tuple(sorted({c.changed_by for c in self.conflicts if c.changed_by is not None}))

    def check(self) -> None:
        """Raise ``ConflictError`` with ``refusal`` when the plan is refused."""
        if self.refusal is not None:
            raise ConflictError(self.refusal)

    def as_json(self) -> dict[str, Any]:
        """The plan as JSON; ``protocol_records`` only when the commit changed some."""
        out = {
            "target": self.target,
            "reverts": self.commit.as_json(),
            "entries": self.entries.as_json(),
            "records": self.records.as_json(),
            "reverted_by": self.reverted_by,
            "conflicts": [c.as_json() for c in self.conflicts],
            "refused": self.refusal,
        }
        if self.protocol.total:
            out["protocol_records"] = self.protocol.as_json()
        return out

    def execute(self, registry: RegistryAccess) -> WriteResult:
        """Apply the plan as one ``revert`` commit.

        Raises ``ConflictError`` for a refused plan, and (writing nothing) when
        anything the plan touches changed since it was made.
        """
        self.check()
        registry.require_planned_on(self.target)
        cid = self.commit.id
        return _write_revert(
            registry,
            self,
            planned=f"the revert of commit {cid}",
            again=f"ficache revert {cid}",
            message=f"revert commit {cid}",
            reverts_commit_id=cid,
        )


def plan_revert(registry: RegistryAccess, commit_id: int) -> RevertPlan:
    """Plan undoing commit ``commit_id`` of ``registry``; ``NotFoundError`` if there is none."""
    found = registry.log(None, commit_id=commit_id)
    if not found:
        raise NotFoundError(f"no commit {commit_id}; see `ficache log`")
    try:
        with registry.engine.connect() as conn:
            fingerprints: dict[int, Fingerprint] = {}
            entries = _undo(conn, ENTRY_KIND, commit_id, fingerprints)
            records = _undo(conn, RECORD_KIND, commit_id, fingerprints)
            protocol = _undo(conn, PROTOCOL_KIND, commit_id, fingerprints)
            reverted_by = _undone_by(conn, commit_id)
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, registry.location) from None
    return RevertPlan(
        registry.location.display,
        found[0],
        entries.counts,
        records.counts,
        entries.conflicts + records.conflicts + protocol.conflicts,
        reverted_by,
        tuple(entries.writes),
        tuple(entries.removals),
        tuple(entries.expected),
        RecordWrite(tuple(records.writes), tuple(records.removals), tuple(records.expected)),
        protocol.counts,
        ProtocolWrite(tuple(protocol.writes), tuple(protocol.removals), tuple(protocol.expected)),
    )


@dataclass(frozen=True)
class RevertToPlan:
    """What returning the registry to its state after ``commit`` would do (``revert --to``);
    compare plans with ``==``, apply with ``execute``."""

    target: str  # the registry planned on (``Location.display``)
    commit: CommitInfo
    #: The commits after ``commit`` whose changes are undone, oldest first.
    later: tuple[int, ...]
    entries: RevertCounts
    records: RevertCounts
    protocol: RevertCounts
    writes: tuple[NewEntry, ...] = field(default=(), repr=False)
    removals: tuple[tuple[Fingerprint, str, str], ...] = field(default=(), repr=False)
    expected: tuple[tuple[tuple[Fingerprint, str, str], int | None], ...] = field(
        default=(), repr=False
    )
    record_write: RecordWrite = field(default_factory=RecordWrite, repr=False)
    protocol_write: ProtocolWrite = field(default_factory=ProtocolWrite, repr=False)

    @property
    def is_empty(self) -> bool:
        """True when the registry already holds what it held after ``commit``."""
        return not (self.entries.total or self.records.total or self.protocol.total)

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "to": self.commit.as_json(),
            "undoes": list(self.later),
            "entries": self.entries.as_json(),
            "records": self.records.as_json(),
            "protocol_records": self.protocol.as_json(),
        }

    def execute(self, registry: RegistryAccess) -> WriteResult:
        """Apply the plan as one ``revert`` commit (none when ``is_empty``).

        Raises ``ConflictError`` (writing nothing) when anything the plan
        touches changed since it was made.
        """
        registry.require_planned_on(self.target)
        cid = self.commit.id
        return _write_revert(
            registry,
            self,
            planned=f"the revert to commit {cid}",
            again=f"ficache revert --to {cid}",
            message=f"revert to commit {cid} (undoes {_later_commits(self.later)})",
            provenance={"revert_to": cid},
        )


def _write_revert(
    registry: RegistryAccess, plan: Any, *, planned: str, again: str, **commit: Any
) -> WriteResult:
    """A revert plan's (``RevertPlan``, ``RevertToPlan``) one ``revert`` commit: its writes,
    removals, expected versions and records; a registry changed since ``planned`` is a
    ``ConflictError`` naming the command to run ``again``."""
    try:
        return registry.write(
            plan.writes,
            kind="revert",
            removals=plan.removals,
            expected=plan.expected,
            records=plan.record_write,
            protocol_records=plan.protocol_write,
            **commit,
        )
    except ConflictError:
        raise ConflictError(
            f"registry {plan.target} changed since {planned} was planned; "
            f"nothing changed, plan it again ({again})"
        ) from None


def _later_commits(ids: Sequence[int]) -> str:
    """``commit 7``, ``commits 7-9`` or ``4 commits from 7 to 12`` (ids may skip)."""
    if len(ids) == 1:
        return f"commit {ids[0]}"
    if ids[-1] - ids[0] == len(ids) - 1:
        return f"commits {ids[0]}-{ids[-1]}"
    return f"{len(ids)} commits from {ids[0]} to {ids[-1]}"


def plan_revert_to(registry: RegistryAccess, commit_id: int) -> RevertToPlan:
    """Plan returning ``registry`` to its state right after commit ``commit_id``, as one
    new commit; ``NotFoundError`` if there is no such commit.

    For every identity (of every kind) a later commit changed, the state it
    had after ``commit_id`` is the state the first later change replaced
    (absent where that change added it); an identity that holds another state
    now is restored, re-added or removed. History stays: the later commits
    remain in the log, and the new commit can itself be reverted.
    """
    found = registry.log(None, commit_id=commit_id)
    if not found:
        raise NotFoundError(f"no commit {commit_id}; see `ficache log`")
    try:
        with registry.engine.connect() as conn:
            fingerprints: dict[int, Fingerprint] = {}
            later: set[int] = set()
            undone = [_back_to(conn, k, commit_id, fingerprints, later) for k in KINDS]
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, registry.location) from None
    entries, records, protocol = undone
    return RevertToPlan(
        registry.location.display,
        found[0],
        tuple(sorted(later)),
        entries.counts,
        records.counts,
        protocol.counts,
        tuple(entries.writes),
        tuple(entries.removals),
        tuple(entries.expected),
        RecordWrite(tuple(records.writes), tuple(records.removals), tuple(records.expected)),
        ProtocolWrite(tuple(protocol.writes), tuple(protocol.removals), tuple(protocol.expected)),
    )


def _back_to(
    conn: Connection,
    kind: Kind,
    commit_id: int,
    fingerprints: dict[int, Fingerprint],
    later: set[int],
) -> _Undo:
    """The write that returns ``kind``'s rows to their state after ``commit_id``."""
    first: dict[tuple[Any, ...], Any] = {}
    for ch in changes_after(conn, kind, commit_id):
        later.add(int(ch.commit_id))
        first.setdefault(kind.identity_of(ch), ch)
    undo = _Undo()
    if not first:
        return undo
    _load_fingerprints(conn, {ident[0] for ident in first}, fingerprints)
    current = _current(conn, kind, list(first))
    remove = restore = re_add = 0
    for ident, ch in first.items():
        holder, value = current.get(ident, (None, None))
        wanted = replaced_value(kind, ch)
        if value == wanted:
            continue
        fp = fingerprints[ch.fingerprint_id]
        identity = (fp, *ident[1:])
        undo.expected.append((identity, holder))
        if wanted is None:
            undo.removals.append(identity)
            remove += 1
        else:
            undo.writes.append(restored_item(kind, ch, fp))
            restore += value is not None
            re_add += value is None
    undo.counts = RevertCounts(remove, restore, re_add)
    return undo


def _undone_by(conn: Connection, commit_id: int) -> int | None:
    """The revert commit that undoes ``commit_id`` now: the last of an odd chain of reverts."""
    depth, at = 0, commit_id
    while True:
        nxt = conn.execute(select(func.max(C.c.id)).where(C.c.reverts_commit_id == at)).scalar()
        if nxt is None:
            return at if depth % 2 else None
        depth, at = depth + 1, int(nxt)


# --------------------------------------------------------------------------
# The machinery written once over the kinds (``ficache.kinds``).


@dataclass
class _Undo:
    """The inverse of one commit's changes of one kind, as ``Registry.write`` takes it."""

    counts: RevertCounts = RevertCounts()
    conflicts: tuple[RevertConflict, ...] = ()
    writes: list[Any] = field(default_factory=list)
    removals: list[tuple[Any, ...]] = field(default_factory=list)
    expected: list[tuple[tuple[Any, ...], int | None]] = field(default_factory=list)


def _undo(
    conn: Connection, kind: Kind, commit_id: int, fingerprints: dict[int, Fingerprint]
) -> _Undo:
    """What undoing ``commit_id``'s changes of ``kind`` writes, and what conflicts with it."""
    changes = commit_changes(conn, kind, commit_id, by_identity=False)
    undo = _Undo()
    if not changes:
        return undo
    _load_fingerprints(conn, {ch.fingerprint_id for ch in changes}, fingerprints)
    idents = [kind.identity_of(ch) for ch in changes]
    current = _current(conn, kind, idents)
    conflicting = []
    for ch, ident in zip(changes, idents, strict=True):
        holder, value = current.get(ident, (None, None))
        # Stale: it no longer holds what the commit left, whoever wrote it (a later
        # change that a later revert undid again leaves it as the commit left it).
        if value != written_value(kind, ch):
            conflicting.append((ch, ident, holder))
        fp = fingerprints[ch.fingerprint_id]
        identity = (fp, *ident[1:])
        undo.expected.append((identity, holder))
        if ch.action == "added":
            undo.removals.append(identity)
        else:
            undo.writes.append(restored_item(kind, ch, fp))
    absent = [ident for _ch, ident, holder in conflicting if holder is None]
    removed_by = (
        {
            i: int(row.holder)
            for i, row in _holders(conn, kind, kind.changes, absent, after=commit_id).items()
        }
        if absent
        else {}
    )
    undo.conflicts = tuple(
        RevertConflict(
            kind.name,
            ch.fingerprint_id,
            ch.scope,
            getattr(ch, "namespace", None),
            ch.key,
            ch.action,
            holder if holder is not None else removed_by.get(ident),
        )
        for ch, ident, holder in conflicting
    )
    actions = [ch.action for ch in changes]
    undo.counts = RevertCounts(
        actions.count("added"), actions.count("replaced"), actions.count("removed")
    )
    return undo


def _current(
    conn: Connection, kind: Kind, idents: Sequence[tuple[Any, ...]]
) -> dict[tuple[Any, ...], tuple[int, tuple[Any, ...]]]:
    """``(commit holding it, value with policies as text)`` of each of ``idents`` held
    now (absent ones are left out)."""
    rows = kind.rows
    value_columns = [
        policy_text(rows.c[c]).label(c) if c in kind.policy_columns else rows.c[c]
        for c in kind.values
    ]
    n = len(kind.values)
    found = _holders(conn, kind, rows, idents, value_columns)
    return {ident: (int(row[-1]), tuple(row[-1 - n : -1])) for ident, row in found.items()}


def _holders(
    conn: Connection,
    kind: Kind,
    table: Table,
    idents: Sequence[tuple[Any, ...]],
    extra: Sequence[Any] = (),
    *,
    after: int | None = None,
) -> dict[tuple[Any, ...], Any]:
    """The row naming each of ``idents`` in ``table`` (absent ones are left out), its
    last column ``holder``: the commit holding it, after the ``extra`` columns.

    ``table`` is the kind's rows (the commit that wrote each current value),
    or, with ``after``, its change log (the last commit after ``after`` that
    changed each).
    """
    columns = [table.c[name] for name in kind.identity_columns]
    holder = (table.c.commit_id if after is None else func.max(table.c.commit_id)).label("holder")
    fingerprint_and_key = itemgetter(
        kind.identity_columns.index("fingerprint_id"), kind.identity_columns.index("key")
    )
    keys_by_fp: dict[int, set[Any]] = {}
    for ident in idents:
        fid, key = fingerprint_and_key(ident)
        keys_by_fp.setdefault(fid, set()).add(key)
    wanted = set(idents)
    found: dict[tuple[Any, ...], Any] = {}
    for fid, keys in keys_by_fp.items():
        ordered = sorted(keys)
        for start in range(0, len(ordered), _CHUNK):
            query = select(*columns, *extra, holder).where(
                table.c.fingerprint_id == fid, table.c.key.in_(ordered[start : start + _CHUNK])
            )
            if after is not None:
                query = query.where(table.c.commit_id > after).group_by(*columns)
            for row in conn.execute(query):
                ident = kind.identity_of(row)
                if ident in wanted:
                    found[ident] = row
    return found


def _load_fingerprints(conn: Connection, ids: set[int], into: dict[int, Fingerprint]) -> None:
    missing = sorted(ids - into.keys())
    if missing:
        for row in conn.execute(
            select(*schema.features(conn).columns(F)).where(F.c.id.in_(missing))
        ):
            into[row.id] = fingerprint_from_row(row)
