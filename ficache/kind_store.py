"""The write machinery every kind of stored result goes through, driven by its ``Kind``.

One path, written once over ``ficache.kinds``' descriptions, for entries and
namespaced records alike:
- ``prepare``: a writer's items, removals and expected commits, checked and
  keyed before the write's transaction (scopes validated, derived columns
  computed, a later duplicate wins, nothing both written and removed);
- ``stage``: under the write lock, the current rows compared with the items:
  added, replaced, unchanged or kept (``keep_existing``), the removals found,
  the ``expected`` commits checked (``StalePlanError``, nothing written);
- ``new_commit`` and ``apply``: one commit row counting every kind's
  changes, then each kind's current rows inserted, updated and deleted and
  one change row per change, keeping the state each change replaced;
- ``commit_changes``: a commit's changes of one kind, read back (history,
  revert), policies as text (``changed_values``: each value column's old and
  new value of one);
- ``prune_candidates`` and ``stage_planned_removals``: what a prune plans
  and, under the lock, what of it is still as planned.

It owns SQL over a kind's two tables and the commit row; it does not own the
transaction, its retries or the registry's location (``ficache.registry``),
validation of a kind's values (``ficache.records`` for records), or plans
(``revert``, ``merge``, ``ficache.prune``).

Invariants:
- Nothing here commits or rolls back: a caller raising after ``stage`` leaves
  the registry as it was.
- A staged change of a row holds its state as read under the lock (flat
  ``(id, commit_id, *values, *carried)``); ``apply`` writes exactly the
  staged changes, with the replaced state in the change row.
- Values compare by the kind's value columns alone, policies by id (one text
  one id): a carried column never makes a change.
- Added rows and their change rows are written in bulk: the rows through the
  driver's ``executemany`` (``_insert_many``), their change rows copied
  inside the database by one ``INSERT ... SELECT`` (``_added_changes``).
"""

from __future__ import annotations

import getpass
import json
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, insert, literal, select, update

from ficache import schema
from ficache.errors import StalePlanError
from ficache.fingerprint import Fingerprint
from ficache.kinds import ACTIONS, STORED_KINDS, Kind
from ficache.models import COMMITS as C
from ficache.models import FINGERPRINTS as F
from ficache.models import policy_text
from ficache.policies import policy_ids
from ficache.scopes import SHARED_SCOPE, validate_scope
from ficache.values import COMMIT_KINDS as _COMMIT_KINDS

__all__ = [
    "COMMIT_KINDS",
    "FingerprintIds",
    "Prepared",
    "Staged",
    "apply",
    "changes_after",
    "commit_changes",
    "replaced_value",
    "written_value",
    "restored_item",
    "current_states",
    "new_commit",
    "prepare",
    "prune_candidates",
    "result_counts",
    "stage",
    "stage_planned_removals",
]

COMMIT_KINDS = _COMMIT_KINDS
_CHUNK = 500  # rows per IN (...) list

#: A row's identity in the database: ``(fingerprint id, scope, *Kind.identity)``.
RowKey = tuple[Any, ...]
#: A current row's state: ``(id, commit_id, *Kind.values, *Kind.carried)``.
State = tuple[Any, ...]


def _chunks(items: Sequence[Any], size: int = _CHUNK) -> Iterable[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _tuple_getter(names: Sequence[str]) -> Callable[[Any], tuple[Any, ...]]:
    """``attrgetter`` that always returns a tuple, one name included."""
    if len(names) == 1:
        one = attrgetter(names[0])
        return lambda obj: (one(obj),)
    return attrgetter(*names)


def present(conn: Connection, kind: Kind) -> bool:
    """Whether the registry ``conn`` reads holds ``kind``'s tables (``schema.features``: an
    older schema, from before the revision that added them, holds no row of it and takes
    none: readers see nothing, ``Registry.write`` leaves the kind out with a warning)."""
    return schema.features(conn).has_table(kind.rows.name)


def _inserted_id(result: Any) -> int:
    key = result.inserted_primary_key
    assert key is not None, "INSERT returned no primary key"
    return int(key[0])


# --------------------------------------------------------------------------
# Fingerprints and commits.


class FingerprintIds:
    """The fingerprint rows of one write, looked up (or created) once per fingerprint."""

    def __init__(self, conn: Connection, now: float) -> None:
        self.conn = conn
        self.now = now
        self._ids: dict[Fingerprint, int | None] = {}
        #: Ids of rows this write inserted: they hold nothing yet.
        self.created: set[int] = set()

    def get(self, fp: Fingerprint, *, create: bool) -> int | None:
        """``fp``'s row id; None when absent and not ``create``d."""
        found = self._ids.get(fp)
        if found is not None or (fp in self._ids and not create):
            return found
        row = self.conn.execute(select(F.c.id).where(F.c.digest == fp.digest)).scalar_one_or_none()
        if row is not None:
            found = int(row)
        elif create:
            # Stored without its policy it would be the default's fingerprint: refused
            # whole (registry unchanged) rather than mixed in.
            schema.features(self.conn).refuse_measurements((fp.measurement,))
            values = fp.as_dict()
            result = self.conn.execute(
                insert(F).values(digest=fp.digest, created_at=self.now, **values)
            )
            found = _inserted_id(result)
            self.created.add(found)
        self._ids[fp] = found
        return found


def new_commit(
    conn: Connection, now: float, kind: str, staged: Sequence[Staged] = (), **values: Any
) -> int:
    """Insert one ``commits`` row of ``kind`` counting ``staged``'s changes; its id."""
    if kind not in COMMIT_KINDS:
        raise ValueError(f"unknown commit kind {kind!r}")
    provenance = values.pop("provenance", None)
    try:
        user: str | None = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user database in some containers
        user = None
    counts = {k.count_column(a): 0 for k in STORED_KINDS for a in ACTIONS}
    for s in staged:
        counts.update({s.kind.count_column(a): n for a, n in s.counts().items()})
    holds = schema.features(conn).writable
    result = conn.execute(
        insert(C).values(
            created_at=now,
            kind=kind,
            host=socket.gethostname(),
            user=user,
            provenance=json.dumps(provenance, sort_keys=True) if provenance else None,
            **holds(C.name, {**counts, **values}),
        )
    )
    return _inserted_id(result)


def result_counts(staged: Iterable[Staged]) -> dict[str, Any]:
    """``WriteResult``'s count fields of ``staged`` (each kind by its ``result_prefix``)."""
    out: dict[str, Any] = {}
    for s in staged:
        field_of = s.kind.result_field
        out.update({field_of(a): n for a, n in s.counts().items()})
        out[field_of("unchanged")] = s.unchanged
        out[field_of("kept")] = s.kept
    return out


# --------------------------------------------------------------------------
# Preparing (before the transaction) and staging (under the write lock).


@dataclass
class Prepared:
    """A writer's items of one kind, keyed and checked, ready to stage."""

    kind: Kind
    #: Distinct fingerprints of the items, in the order first seen.
    fingerprints: list[Fingerprint] = field(default_factory=list)
    #: The scopes each fingerprint's items are in (by index into ``fingerprints``).
    scopes: list[set[str]] = field(default_factory=list)
    #: ``(fingerprint index, scope, *identity) -> item``; a later duplicate wins.
    wanted: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    #: The derived values of each of ``wanted``'s items, in its order (empty: none).
    derived: list[tuple[Any, ...]] = field(default_factory=list)
    #: ``(fingerprint, scope, *identity)`` of the rows to delete.
    removals: set[tuple[Any, ...]] = field(default_factory=set)
    #: ``((fingerprint, scope, *identity), commit id | None)`` pairs.
    expected: Sequence[tuple[tuple[Any, ...], int | None]] = ()
    n_expected: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.wanted and not self.removals


def prepare(
    kind: Kind,
    items: Iterable[Any],
    removals: Iterable[tuple[Any, ...]] = (),
    expected: Mapping[Any, int | None] | Sequence[tuple[Any, int | None]] | None = None,
) -> Prepared:
    """Key and check a write of ``kind`` before its transaction (the lock is held for SQL only).

    Raises ``ValueError`` for a bad scope or an identity both written and
    removed, and what ``kind.derive`` raises for an item it cannot store.
    """
    prepared = Prepared(kind)
    fingerprints: dict[Fingerprint, int] = {}
    wanted = prepared.wanted
    identity_of = attrgetter("scope", *kind.item_identity)
    last_fp: Fingerprint | None = None
    fp_index = -1
    scopes: set[str] = set()
    for item in items:
        fp = item.fingerprint
        if fp is not last_fp:  # items come in runs of one fingerprint: hash it once
            last_fp = fp
            fp_index = fingerprints.setdefault(fp, len(fingerprints))
            if fp_index == len(prepared.scopes):
                prepared.scopes.append(set())
            scopes = prepared.scopes[fp_index]
        ident = identity_of(item)
        if ident[0] not in scopes:
            validate_scope(ident[0])
            scopes.add(ident[0])
        wanted[(fp_index, *ident)] = item
    prepared.fingerprints = list(fingerprints)
    for removal in removals:
        fp, scope, *rest = removal
        validate_scope(scope)
        if fp in fingerprints and (fingerprints[fp], scope, *rest) in wanted:
            raise ValueError(f"{kind.name} {rest[-1][:80]!r} is both written and removed")
        prepared.removals.add(tuple(removal))
    if kind.derive is not None:
        prepared.derived = kind.derive(wanted.values())
    if expected:
        prepared.n_expected = len(expected)
        prepared.expected = tuple(expected.items() if isinstance(expected, Mapping) else expected)
    return prepared


@dataclass
class Staged:
    """What a write does to one kind, decided under the write lock."""

    kind: Kind
    #: (prepared row key, item): the key's first part is the fingerprint's *index*
    #: (``fid_at[index]`` is its row id), as ``Prepared.wanted`` keys it, so the bulk case
    #: takes ``wanted``'s items as they are and ``apply`` maps the column once.
    added: list[tuple[RowKey, Any]] = field(default_factory=list)
    fid_at: list[int] = field(default_factory=list)
    replaced: list[tuple[RowKey, Any, State]] = field(default_factory=list)
    removed: list[tuple[RowKey, State]] = field(default_factory=list)
    unchanged: int = 0
    kept: int = 0
    #: The derived values of each of ``added``'s items, in its order (empty: none).
    added_derived: list[tuple[Any, ...]] = field(default_factory=list)
    #: The policy id of each policy text the items hold (None -> None).
    policy_id: Callable[[Any], Any] = field(default=lambda text: text)
    #: True when every written row is of the shared scope.
    all_shared: bool = False

    @property
    def changed(self) -> int:
        return len(self.added) + len(self.replaced) + len(self.removed)

    def counts(self) -> dict[str, int]:
        return dict(
            zip(ACTIONS, (len(self.added), len(self.replaced), len(self.removed)), strict=True)
        )

    @property
    def shared_written(self) -> int:
        """Of the rows added or replaced, those of the shared scope."""
        if self.all_shared:  # the common case: every scope written is shared
            return len(self.added) + len(self.replaced)
        return sum(k[1] == SHARED_SCOPE for k, _ in self.added) + sum(
            k[1] == SHARED_SCOPE for k, _i, _s in self.replaced
        )


def current_states(
    conn: Connection,
    kind: Kind,
    fingerprint_id: int,
    scopes: Iterable[str],
    key_prefix: Any = None,
) -> dict[RowKey, State]:
    """``(fingerprint id, scope, *identity) -> state`` of the rows of ``scopes``
    (``key_prefix`` in the fingerprint id's place when given)."""
    rows = kind.rows
    n = 1 + len(kind.identity)
    query = select(rows.c.scope, *(rows.c[c] for c in kind.identity), *kind.state_columns).where(
        rows.c.fingerprint_id == fingerprint_id, rows.c.scope.in_(sorted(set(scopes)))
    )
    columns = list(zip(*conn.execute(query), strict=True))  # column-wise: no call per row
    if not columns:
        return {}
    prefix = fingerprint_id if key_prefix is None else key_prefix
    keys = zip(repeat(prefix), *columns[:n], strict=False)
    return dict(zip(keys, zip(*columns[n:], strict=True), strict=False))


def stage(
    conn: Connection, prepared: Prepared, fids: FingerprintIds, *, keep_existing: bool
) -> Staged:
    """Compare ``prepared`` with the current rows; ``StalePlanError`` on a stale plan.

    The fingerprints of its items are created when absent; those of removals
    and expected commits are only looked up. Current rows are keyed as
    ``prepared.wanted`` is, by fingerprint index (``fid_at[index]`` is its row
    id), so an unchanged item costs one lookup. Longer than the guide: the
    index mapping it sets up is shared by removals, expected commits and the
    comparison, which split apart would each rebuild it.
    """
    kind = prepared.kind
    staged = Staged(kind)
    fid_at = staged.fid_at
    index_of: dict[int, int] = {}  # fingerprint row id -> index
    for fp in prepared.fingerprints:
        fid = fids.get(fp, create=True)
        assert fid is not None
        index_of[fid] = len(fid_at)
        fid_at.append(fid)
    scopes_at = [set(scopes) for scopes in prepared.scopes]
    staged.all_shared = all(scopes == {SHARED_SCOPE} for scopes in prepared.scopes)

    def index(fp: Fingerprint) -> int | None:
        """The index of a removal's or expectation's fingerprint; None: not stored."""
        fid = fids.get(fp, create=False)
        if fid is None:
            return None
        if fid not in index_of:
            index_of[fid] = len(fid_at)
            fid_at.append(fid)
            scopes_at.append(set())
        return index_of[fid]

    removals = []
    for fp, scope, *rest in sorted(prepared.removals, key=lambda r: (r[0].digest, *r[1:])):
        at = index(fp)
        if at is not None:  # absent: nothing of it to remove
            scopes_at[at].add(scope)
            removals.append((at, scope, *rest))
    existing: dict[RowKey, State] = {}
    for at, scopes in enumerate(scopes_at):
        if scopes and fid_at[at] not in fids.created:
            existing.update(current_states(conn, kind, fid_at[at], scopes, key_prefix=at))
    if prepared.expected:
        _check_expected(kind, prepared, index, existing)
    for key in removals:
        state = existing.get(key)
        if state is not None:
            staged.removed.append(((fid_at[key[0]], *key[1:]), state))
    staged.policy_id = _policy_id_map(conn, kind, prepared.wanted.values())
    if not existing:  # the common bulk case: new identities (or a new fingerprint) only
        staged.added = list(prepared.wanted.items())
        staged.added_derived = prepared.derived
        return staged
    n_values = len(kind.values)
    items = list(prepared.wanted.values())
    values = zip(
        *_written_columns(kind, items, staged.policy_id, 0.0, values_only=True), strict=True
    )
    derived = prepared.derived or repeat(())
    for (k, item), value, item_derived in zip(
        prepared.wanted.items(), values, derived, strict=False
    ):
        old = existing.get(k)
        if old is None:
            staged.added.append((k, item))
            staged.added_derived.append(item_derived)
        elif old[2 : 2 + n_values] == value:
            staged.unchanged += 1
        elif keep_existing:
            staged.kept += 1
        else:
            staged.replaced.append(((fid_at[k[0]], *k[1:]), item, old))
    return staged


def _check_expected(
    kind: Kind,
    prepared: Prepared,
    index: Callable[[Fingerprint], int | None],
    existing: Mapping[RowKey, State],
) -> None:
    """Raise ``StalePlanError`` unless every expected identity is held by its commit."""
    stale = 0
    last_fp: Fingerprint | None = None
    at: int | None = None
    for (fp, *rest), commit in prepared.expected:
        if fp is not last_fp:  # runs of one fingerprint: look it up once
            last_fp, at = fp, index(fp)
        held = existing.get((at, *rest)) if at is not None else None
        stale += (held[1] if held is not None else None) != commit
    if stale:
        raise StalePlanError(
            f"{stale} of {prepared.n_expected} {kind.plural} changed since the plan was made; "
            "nothing written, run the command again"
        )


def _policy_id_map(conn: Connection, kind: Kind, items: Iterable[Any]) -> Callable[[Any], Any]:
    """Policy text -> id for the items' policies (inserting new ones); NULL maps to NULL."""
    if not kind.policy_columns:
        return lambda text: text
    texts: set[Any] = set()
    for name in kind.policy_columns:
        texts.update(map(attrgetter(kind.item_values[kind.values.index(name)]), items))
    ids: dict[str | None, int | None] = {None: None}
    ids.update(policy_ids(conn, texts))
    return ids.__getitem__


# --------------------------------------------------------------------------
# Applying (inside the commit).


def _insert_many(
    conn: Connection, table: Any, rows: list[tuple[Any, ...]], columns: Sequence[str]
) -> None:
    """Bulk insert positional rows; the bulk path of every write.

    Goes to the driver's ``executemany`` directly where its paramstyle is
    positional (SQLite, psycopg): SQLAlchemy's per-row parameter processing
    would otherwise cost more than the insert itself.
    """
    if not rows:
        return
    marker = {"qmark": "?", "format": "%s", "pyformat": "%s"}.get(conn.dialect.paramstyle)
    if marker is None:
        conn.execute(insert(table), [dict(zip(columns, row, strict=True)) for row in rows])
        return
    quote = conn.dialect.identifier_preparer.quote
    sql = (
        f"INSERT INTO {quote(table.name)} ({', '.join(quote(c) for c in columns)}) "
        f"VALUES ({', '.join([marker] * len(columns))})"
    )
    conn.exec_driver_sql(sql, rows)


@cache
def _added_changes(kind: Kind) -> Any:
    """``INSERT INTO <changes> ... SELECT`` of the ``added`` rows of a commit.

    One statement instead of a bound row per row: the rows a commit added
    are the rows holding its id before it replaces any, in the order they
    were inserted (the order of their ids). Every one of them has an id above
    ``after``, the largest id before the insert (ids come from an
    ever-growing rowid or sequence), so the rows are read as a range of the
    primary key.
    """
    rows, changes = kind.rows, kind.changes
    values = {
        "commit_id": rows.c.commit_id,
        **{c: rows.c[c] for c in kind.identity_columns},
        "action": literal("added", changes.c.action.type),
        **{change_column: rows.c[row_column] for row_column, change_column in kind.new},
    }
    source = (
        select(*values.values())
        .where(rows.c.id > bindparam("after"), rows.c.commit_id == bindparam("commit_id"))
        .order_by(rows.c.id)
    )
    return insert(changes).from_select(list(values), source)


def _change_columns(kind: Kind) -> tuple[str, ...]:
    """The columns of a change row as ``apply`` writes one (positional)."""
    return (
        "commit_id",
        *kind.identity_columns,
        "action",
        *(change for _row, change in kind.old),
        *(change for _row, change in kind.new),
    )


def _written_columns(
    kind: Kind,
    items: Sequence[Any],
    policy_id: Callable[[Any], Any],
    now: float,
    *,
    values_only: bool = False,
) -> list[Sequence[Any]]:
    """The ``values`` then ``carried`` columns of ``items`` as written, column by column.

    Column-wise, so a bulk write converts a column with one ``map`` (policies
    to ids, ``now_if_none`` columns' None to ``now``) instead of a Python call
    per item.
    """
    n_values = len(kind.values)
    names = kind.item_values if values_only else (*kind.item_values, *kind.item_carried)
    if not items:
        return [() for _ in names]
    get = _tuple_getter(names)
    columns: list[Sequence[Any]] = list(zip(*map(get, items), strict=True))
    for name in kind.policy_columns:
        at = kind.values.index(name)
        columns[at] = list(map(policy_id, columns[at]))
    for name in kind.now_if_none if not values_only else ():
        at = n_values + kind.carried.index(name)
        columns[at] = [now if v is None else v for v in columns[at]]
    return columns


def apply(conn: Connection, staged: Staged, commit_id: int, now: float) -> None:
    """Write ``staged`` as part of commit ``commit_id``: its rows and their change rows.

    Longer than the guide: it is the bulk path of every write, each
    statement's rows built column-wise by ``zip`` (no Python call per row),
    and split up it would pass the same columns around.
    """
    kind = staged.kind
    rows = kind.rows
    n_values = len(kind.values)
    written = (*kind.values, *kind.carried)
    new_at = [written.index(row) for row, _change in kind.new]
    if staged.added:
        at_column, *identity_columns = zip(*[key for key, _item in staged.added], strict=True)
        columns = _written_columns(
            kind, [item for _key, item in staged.added], staged.policy_id, now
        )
        derived: list[Any] = []
        if kind.derived:
            derived = list(zip(*staged.added_derived, strict=True))
        after = conn.execute(select(func.max(rows.c.id))).scalar()
        _insert_many(
            conn,
            rows,
            list(
                zip(
                    map(staged.fid_at.__getitem__, at_column),
                    *identity_columns,
                    *derived,
                    *columns[:n_values],
                    repeat(commit_id),
                    repeat(now),
                    *columns[n_values:],
                )
            ),
            (
                *kind.identity_columns,
                *kind.derived,
                *kind.values,
                "commit_id",
                "updated_at",
                *kind.carried,
            ),
        )
        # Their change rows, copied inside the database: the only rows of
        # this new commit so far are the ones just added.
        conn.execute(_added_changes(kind), {"commit_id": commit_id, "after": after or 0})
    changes: list[tuple[Any, ...]] = []
    if staged.replaced:
        columns = _written_columns(
            kind, [item for _key, item, _old in staged.replaced], staged.policy_id, now
        )
        names = ["b_id", *(f"b_{c}" for c in (*kind.values, "commit_id", "updated_at"))]
        names += [f"b_{c}" for c in kind.carried]
        conn.execute(
            update(rows)
            .where(rows.c.id == bindparam("b_id"))
            .values({name[2:]: bindparam(name) for name in names[1:]}),
            [
                dict(zip(names, row, strict=True))
                for row in zip(
                    [old[0] for _key, _item, old in staged.replaced],
                    *columns[:n_values],
                    repeat(commit_id),
                    repeat(now),
                    *columns[n_values:],
                )
            ],
        )
        changes += [
            (commit_id, *key, "replaced", *old[2:], old[1], *new)
            for (key, _item, old), new in zip(
                staged.replaced, zip(*(columns[i] for i in new_at), strict=True), strict=True
            )
        ]
    no_new = (None,) * len(kind.new)
    changes += [
        (commit_id, *key, "removed", *old[2:], old[1], *no_new) for key, old in staged.removed
    ]
    _insert_many(conn, kind.changes, changes, _change_columns(kind))
    for chunk in _chunks([old[0] for _key, old in staged.removed]):
        conn.execute(delete(rows).where(rows.c.id.in_(list(chunk))))


# --------------------------------------------------------------------------
# Reading a commit's changes (history, revert).


def _read_name(kind: Kind, change_column: str) -> str:
    """The name ``commit_changes`` gives a change column (policies: text, ``_id`` dropped)."""
    if change_column in _policy_change_columns(kind):
        return change_column.removesuffix("_id")
    return change_column


def _policy_change_columns(kind: Kind) -> set[str]:
    return {change for row, change in (*kind.old, *kind.new) if row in kind.policy_columns}


def commit_changes(
    conn: Connection, kind: Kind, commit_id: int, *, by_identity: bool = True
) -> list[Any]:
    """Every change row of ``commit_id`` of ``kind``, ordered by identity then id
    (``by_identity``), else by id (the order the commit made them).

    Rows carry every change column by name, the policy columns as canonical
    JSON text under the change column's name less ``_id`` (``old_policy``).
    """
    if not present(conn, kind):
        return []
    changes = kind.changes
    policies = _policy_change_columns(kind)
    columns = [
        policy_text(changes.c[name]).label(_read_name(kind, name))
        if name in policies
        else changes.c[name]
        for name in [column.name for column in changes.columns]
    ]
    order = [*(changes.c[c] for c in kind.identity_columns)] if by_identity else []
    query = select(*columns).where(changes.c.commit_id == commit_id).order_by(*order, changes.c.id)
    return list(conn.execute(query))


def changed_values(kind: Kind, change: Any) -> tuple[Any, ...]:
    """For each ``values`` column of ``kind`` in turn, the value ``change`` (a
    ``commit_changes`` row) replaced and the value it wrote, policies as text."""
    old, new = dict(kind.old), dict(kind.new)
    return tuple(
        getattr(change, _read_name(kind, column[c])) for c in kind.values for column in (old, new)
    )


def changes_after(conn: Connection, kind: Kind, commit_id: int) -> list[Any]:
    """The change rows of ``kind`` made after commit ``commit_id``, in the order they were
    made, read as ``commit_changes`` reads them (policies as text)."""
    changes = kind.changes
    policies = _policy_change_columns(kind)
    columns = [
        policy_text(column).label(_read_name(kind, column.name))
        if column.name in policies
        else column
        for column in changes.columns
    ]
    query = select(*columns).where(changes.c.commit_id > commit_id).order_by(changes.c.id)
    return list(conn.execute(query))


def written_value(kind: Kind, change: Any) -> tuple[Any, ...] | None:
    """The value ``change`` (a ``commit_changes`` row) wrote, policies as text; None: removed."""
    if change.action == "removed":
        return None
    new = dict(kind.new)
    return tuple(getattr(change, _read_name(kind, new[c])) for c in kind.values)


def replaced_value(kind: Kind, change: Any) -> tuple[Any, ...] | None:
    """The value ``change`` (a ``commit_changes`` row) replaced, policies as text; None: added."""
    if change.action == "added":
        return None
    old = dict(kind.old)
    return tuple(getattr(change, _read_name(kind, old[c])) for c in kind.values)


def restored_item(kind: Kind, change: Any, fingerprint: Fingerprint) -> Any:
    """The writer's item that puts back what ``change`` (a ``commit_changes`` row) replaced."""
    old = dict(kind.old)
    return kind.make_item(
        fingerprint,
        change.scope,
        tuple(getattr(change, c) for c in kind.identity),
        tuple(getattr(change, _read_name(kind, old[c])) for c in kind.values),
        tuple(getattr(change, _read_name(kind, old[c])) for c in kind.carried),
    )


# --------------------------------------------------------------------------
# Prune.


def prune_candidates(
    conn: Connection, kind: Kind, conditions: Iterable[Callable[[Any], Any]]
) -> list[tuple[int, int, int, str, str, str]]:
    """``(row id, commit id, fingerprint id, scope, gpu, flashinfer version)`` of the
    rows of ``kind`` matching every condition (each a function of a table with
    ``fingerprint_id``, ``scope`` and ``updated_at`` columns, joined with its
    fingerprint), in id order."""
    if not present(conn, kind):
        return []
    rows = kind.rows
    query = (
        select(
            rows.c.id,
            rows.c.commit_id,
            rows.c.fingerprint_id,
            rows.c.scope,
            F.c.gpu,
            F.c.flashinfer_version,
        )
        .join(F, F.c.id == rows.c.fingerprint_id)
        .where(*(condition(rows) for condition in conditions))
        .order_by(rows.c.id)
    )
    return [tuple(row) for row in conn.execute(query)]


def stage_planned_removals(
    conn: Connection, kind: Kind, versions: Sequence[tuple[int, int]]
) -> Staged:
    """The planned ``(row id, commit id)`` still as planned, staged for removal.

    A row that changed (another commit) or went since the plan was made is
    left out; the caller compares the count with the plan's.
    """
    staged = Staged(kind)
    rows = kind.rows
    identity = [rows.c[c] for c in kind.identity_columns]
    n = len(identity)
    for chunk in _chunks(versions):
        expected = dict(chunk)
        query = select(*identity, *kind.state_columns).where(rows.c.id.in_(list(expected)))
        for row in conn.execute(query):
            key, state = tuple(row[:n]), tuple(row[n:])
            if expected.get(state[0]) == state[1]:
                staged.removed.append((key, state))
    staged.removed.sort(key=itemgetter(0))
    return staged
